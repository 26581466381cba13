//! The real default model (Gemma 3 270M, Q4_K_M), fetched by `scripts/fetch-model.sh`.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::collect;
use hearth_shared::tokenizer::Tokenizer;
use hearth_worker::engine::{Engine, EngineConfig, GenerateRequest};
use hearth_worker::model::load_gguf;

fn models_dir() -> PathBuf {
    std::env::var_os("HEARTH_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/hearth/models")
        })
}

fn require(name: &str) -> PathBuf {
    let p = models_dir().join(name);
    assert!(
        p.is_file(),
        "{} is missing: run `scripts/fetch-model.sh` (the README's test command does)",
        p.display()
    );
    p
}

#[test]
fn the_real_model_continues_a_sentence_with_coherent_english() {
    let tok = Tokenizer::from_file(&require("gemma-3-tokenizer.json")).unwrap();
    let model = Arc::new(load_gguf(&require("gemma-3-270m-q4_k_m.gguf")).unwrap());
    assert_eq!(model.config.architecture, "gemma3");
    assert_eq!(
        (model.config.num_layers, model.config.hidden_size),
        (18, 640)
    );
    assert_eq!(model.end_of_turn_id, Some(tok.end_of_turn_id));
    let engine = Engine::start(
        model,
        EngineConfig {
            kv_budget_bytes: 64 << 20,
            ..Default::default()
        },
    )
    .unwrap();
    let mut prompt = vec![tok.bos_id];
    prompt.extend(tok.encode("The capital of France is").unwrap());
    let out = collect(
        engine
            .handle()
            .submit(GenerateRequest::new(1, prompt.clone(), 12))
            .unwrap(),
    );
    let text = tok.decode(&out.tokens).unwrap();
    // Coherent English: plain words, on topic.
    let words: Vec<&str> = text.split_whitespace().collect();
    assert!(words.len() >= 5, "continuation was {text:?}");
    assert!(
        text.chars()
            .all(|c| c.is_ascii_alphabetic() || " .,;'\n-".contains(c)),
        "continuation was {text:?}"
    );
    assert!(
        ["Paris", "France", "capital", "city"]
            .iter()
            .any(|w| text.contains(w)),
        "continuation was {text:?}"
    );

    // A fact the small base model knows with confidence.
    let mut fact = vec![tok.bos_id];
    fact.extend(
        tok.encode("The capital of France is Paris. The capital of Germany is")
            .unwrap(),
    );
    let berlin = collect(
        engine
            .handle()
            .submit(GenerateRequest::new(3, fact, 3))
            .unwrap(),
    );
    let text = tok.decode(&berlin.tokens).unwrap();
    assert!(
        text.trim_start().starts_with("Berlin"),
        "continuation was {text:?}"
    );

    // The same prompt inside a batch of differently sized prompts gives the same tokens.
    let others = [
        "Water boils at",
        "def fibonacci(n):",
        "Once upon a time, in a land far away,",
    ];
    let mut streams = vec![engine
        .handle()
        .submit(GenerateRequest::new(2, prompt, 12))
        .unwrap()];
    for (i, o) in others.iter().enumerate() {
        let mut p = vec![tok.bos_id];
        p.extend(tok.encode(o).unwrap());
        streams.push(
            engine
                .handle()
                .submit(GenerateRequest::new(10 + i as u64, p, 12))
                .unwrap(),
        );
    }
    let batched: Vec<_> = streams.into_iter().map(collect).collect();
    assert_eq!(batched[0].tokens, out.tokens);
}
