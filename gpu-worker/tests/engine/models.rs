//! Requests and model files the engine refuses with a clear, typed error (and keeps serving),
//! and checkpoints in two formats that agree.

use hearth_shared::SamplingParams;
use hearth_worker::engine::{EngineConfig, GenerateRequest};

use crate::common::{collect, engine, greedy, prompt, temp_dir, tiny_model, VOCAB};

#[test]
fn bad_requests_get_typed_errors_and_the_engine_keeps_serving() {
    let e = engine(tiny_model(), EngineConfig::default());
    let h = e.handle();
    let cases: Vec<(GenerateRequest, &str)> = vec![
        (greedy(1, vec![], 4), "prompt_token_ids"),
        (greedy(2, vec![5; 1024], 4), "context window"),
        (greedy(3, vec![5, VOCAB + 3], 4), "prompt_token_ids[1]"),
        (
            GenerateRequest {
                params: SamplingParams {
                    temperature: f32::NAN,
                    ..Default::default()
                },
                ..greedy(4, vec![5], 4)
            },
            "temperature",
        ),
        (
            GenerateRequest {
                params: SamplingParams {
                    top_p: 2.0,
                    ..Default::default()
                },
                ..greedy(5, vec![5], 4)
            },
            "top_p",
        ),
        (greedy(6, vec![5], 0), "max_new_tokens"),
        (
            GenerateRequest {
                stop_token_ids: vec![99_999],
                ..greedy(7, vec![5], 4)
            },
            "stop_token_ids",
        ),
    ];
    for (req, needle) in cases {
        let err = h.submit(req).expect_err(needle);
        assert_eq!(
            hearth_worker::server::status::code(&err),
            tonic::Code::InvalidArgument,
            "{err:?}"
        );
        assert!(
            err.to_string().contains(needle),
            "`{err}` should mention `{needle}`"
        );
    }
    let ok = collect(h.submit(greedy(10, prompt(8, 1, VOCAB), 5)).unwrap());
    assert_eq!(ok.tokens.len(), 5);
}

#[test]
fn safetensors_and_gguf_checkpoints_of_the_same_weights_agree() {
    use hearth_worker::fixtures::{write_tiny_gguf, write_tiny_safetensors, TinySpec};
    use hearth_worker::model::{load_gguf, load_safetensors};
    let spec = TinySpec {
        quantized: false,
        ..TinySpec::default()
    };
    let dir = temp_dir("st");
    write_tiny_safetensors(&dir.join("ckpt"), &spec).unwrap();
    write_tiny_gguf(&dir.join("f32.gguf"), &spec).unwrap();
    let st = std::sync::Arc::new(load_safetensors(&dir.join("ckpt")).unwrap());
    let gg = std::sync::Arc::new(load_gguf(&dir.join("f32.gguf")).unwrap());
    assert_eq!(st.config.num_layers, gg.config.num_layers);
    assert_eq!(st.config.sliding_window, gg.config.sliding_window);
    let p = prompt(30, 5, VOCAB);
    let a = collect(
        engine(st, EngineConfig::default())
            .handle()
            .submit(greedy(1, p.clone(), 16))
            .unwrap(),
    );
    let b = collect(
        engine(gg, EngineConfig::default())
            .handle()
            .submit(greedy(2, p, 16))
            .unwrap(),
    );
    assert_eq!(a.tokens, b.tokens);
    for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
        assert!((x - y).abs() < 1e-3, "{x} vs {y}");
    }
}

#[test]
fn missing_or_corrupt_model_files_are_clear_errors() {
    use hearth_worker::model::{load_gguf, load_safetensors};
    let dir = temp_dir("bad");
    let err = load_gguf(&dir.join("nope.gguf")).unwrap_err().to_string();
    assert!(err.contains("nope.gguf"), "{err}");
    std::fs::write(dir.join("junk.gguf"), b"definitely not gguf").unwrap();
    let err = load_gguf(&dir.join("junk.gguf")).unwrap_err().to_string();
    assert!(err.contains("junk.gguf") && err.contains("GGUF"), "{err}");
    let err = load_safetensors(&dir).unwrap_err().to_string();
    assert!(err.contains("config.json"), "{err}");
}
