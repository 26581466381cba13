//! The candle pass's logits against references: Hearth's CPU kernels (f32 and quantized
//! weights, and f16 copies for large steps) and candle-transformers' own Gemma 3.

use candle_core::Device;
use hearth_worker::fixtures::{write_tiny_gguf, write_tiny_safetensors, TinySpec};
use hearth_worker::generic::{DeviceKv, GenericModel, LoadOptions};
use hearth_worker::kv::{KvDtype, KvStore};
use hearth_worker::model::SeqChunk;
use hearth_worker::sampling::LogitSummary;

use crate::common::{prompt, temp_dir, VOCAB};
use crate::{both, both_with, candle_steps, same_top, two_steps, worst};

#[test]
fn the_candle_pass_gives_the_kernels_logits_for_a_batch_at_different_positions() {
    // F32 weights: the two differ only in summation order.
    let (f32_err, same, rows) = compare(
        &TinySpec {
            quantized: false,
            ..Default::default()
        },
        1e-4,
    );
    assert_eq!(same, rows, "f32: the top token differs");
    // The real model's format mix: both quantize activations to 8 bits, in different blocks and
    // roundings (Hearth's kernels re-quantize k-quant blocks on some CPUs; candle does not).
    let (native, generic) = both(&TinySpec::default());
    let (want, got) = (kernels_steps(&native), candle_steps(&generic));
    let (q_err, q_same, q_rows) = compare_logits(&want, &got, native.config.vocab_size, 0.1);
    let flips = flips_in_noise(&want, &got, native.config.vocab_size);
    eprintln!(
        "largest logit difference: f32 {f32_err:.2e}, quantized {q_err:.2e}; quantized top token \
         the same at {q_same}/{q_rows} positions; where not, the kernels' two tokens were \
         {flips:.2?} RMS differences apart"
    );
    // The quantized passes round activations differently, so each logit moves by a small noise
    // between them, of RMS `σ` over all the logits. Where the top tokens differ, the two tokens'
    // noises moved them past each other: the kernels' margin between them is at most the
    // difference of two such noises, whose RMS is √2·σ. Allowing 4√2·σ ≈ 5.7σ (measured: every
    // such margin within 2.6σ, at 6 of 76 rows) fails a pass whose top token differs where the
    // kernels' choice is clear, which the largest-difference bound (10 % of the largest logit)
    // lets through.
    let bound = 4.0 * std::f32::consts::SQRT_2;
    assert!(
        flips.iter().all(|&m| m <= bound),
        "the quantized passes' top tokens differ where the kernels' margin is {flips:.2?} RMS \
         differences, more than {bound:.1}"
    );
    assert_eq!(q_same + flips.len(), q_rows);
}

/// Where the top tokens of `a` and `b` (both steps' rows of `vocab` logits) differ, how far `a`
/// puts its own top token above `b`'s, in units of the RMS difference between `a` and `b` over
/// all logits.
fn flips_in_noise(a: &(Vec<f32>, Vec<f32>), b: &(Vec<f32>, Vec<f32>), vocab: usize) -> Vec<f32> {
    let top = |r: &[f32]| (0..r.len()).fold(0, |best, i| if r[i] > r[best] { i } else { best });
    let (a, b) = ([&a.0[..], &a.1[..]].concat(), [&b.0[..], &b.1[..]].concat());
    let sq: f64 = a
        .iter()
        .zip(&b)
        .map(|(x, y)| f64::from(x - y).powi(2))
        .sum();
    let rms = (sq / a.len() as f64).sqrt() as f32;
    a.chunks_exact(vocab)
        .zip(b.chunks_exact(vocab))
        .filter_map(|(x, y)| {
            let (i, j) = (top(x), top(y));
            (i != j).then(|| (x[i] - x[j]) / rms)
        })
        .collect()
}

/// The largest logit difference (relative to the largest logit) and the rows with the same top
/// token, over both steps; asserts the former is within `tolerance`.
fn compare(spec: &TinySpec, tolerance: f32) -> (f32, usize, usize) {
    compare_with(spec, LoadOptions::default(), tolerance)
}

fn compare_with(spec: &TinySpec, options: LoadOptions, tolerance: f32) -> (f32, usize, usize) {
    let (native, generic) = both_with(spec, options);
    let want = kernels_steps(&native);
    let got = candle_steps(&generic);
    compare_logits(&want, &got, native.config.vocab_size, tolerance)
}

/// Both steps' logits from the kernels' pass.
fn kernels_steps(native: &hearth_worker::model::Model) -> (Vec<f32>, Vec<f32>) {
    let c = &native.config;
    let mut store = KvStore::new(c.num_layers, 8, 16, c.kv_dim(), c.head_dim, KvDtype::F32);
    let want = two_steps(|chunks, out| {
        let mut summaries = Vec::new();
        native
            .forward(chunks, &mut store, out, &mut summaries)
            .unwrap();
        // The summaries the projection's tasks made are those of the finished rows.
        let rows: Vec<LogitSummary> = out
            .chunks_exact(c.vocab_size)
            .map(LogitSummary::of)
            .collect();
        assert_eq!(summaries, rows);
    });
    assert_eq!(want.0.len(), (20 + 7 + 40) * c.vocab_size);
    assert_eq!(want.1.len(), (1 + 3 + 5) * c.vocab_size);
    want
}

/// The largest difference and the rows with the same top token, as [`compare`].
fn compare_logits(
    want: &(Vec<f32>, Vec<f32>),
    got: &(Vec<f32>, Vec<f32>),
    vocab: usize,
    tolerance: f32,
) -> (f32, usize, usize) {
    let err = worst(&want.0, &got.0).max(worst(&want.1, &got.1));
    let (a, n) = same_top(&want.0, &got.0, vocab);
    let (b, m) = same_top(&want.1, &got.1, vocab);
    assert!(
        err <= tolerance,
        "largest logit difference {err} (tolerance {tolerance})"
    );
    (err, a + b, n + m)
}

#[test]
fn dense_f16_matrices_serve_the_large_steps_within_tolerance() {
    // The first step (67 tokens) goes through the f16 copies, the second (9) through the blocks.
    let dense = LoadOptions {
        dense_gemm_tokens: Some(10),
        ..Default::default()
    };
    for quantized in [false, true] {
        let spec = TinySpec {
            quantized,
            ..Default::default()
        };
        // f16 weights and activations against the kernels' f32 (or 8-bit) arithmetic.
        let tolerance = if quantized { 0.1 } else { 1e-2 };
        let (err, same, rows) = compare_with(&spec, dense, tolerance);
        eprintln!("quantized {quantized}: largest logit difference {err:.2e}, top token the same at {same}/{rows} positions");
        assert!(
            same * 10 >= rows * 9,
            "top token differs at {} of {rows} positions",
            rows - same
        );
        let (_, blocks_only) = both(&spec);
        let (_, with_copies) = both_with(&spec, dense);
        assert!(
            with_copies.weights_bytes() > blocks_only.weights_bytes(),
            "the f16 copies are not counted: {} bytes",
            with_copies.weights_bytes()
        );
        // The large step really took the f16 path: its logits differ from the blocks' own.
        let (a, b) = (candle_steps(&blocks_only), candle_steps(&with_copies));
        assert_ne!(
            a.0, b.0,
            "quantized {quantized}: the 67-token step ignored the f16 copies"
        );
    }
}

/// candle-transformers' Gemma 3 (`models::gemma3`), an implementation written apart from
/// Hearth's, as a reference for one sequence's logits: a 20-token prompt (one chunk here, token
/// by token there), then three decode steps, on a tiny f32 model read from its HuggingFace checkpoint (the same weights as the
/// GGUF file the device pass reads; both then differ only in summation order). Its K/V handling
/// (a cache that grows by concatenation, one position for the whole batch) is not a model for
/// Hearth's, and its sliding window sees one position more than Gemma's, so the sequence stays
/// inside the window. (candle-transformers' `quantized_gemma3` is no reference: in 0.11.1 its
/// feed-forward uses SiLU where Gemma uses GELU.)
#[test]
fn the_device_pass_gives_candle_transformers_gemma3_logits() {
    use candle_core::{DType, IndexOp, Tensor};
    use candle_transformers::models::gemma3::{Config, Model as Reference};
    let spec = TinySpec {
        quantized: false,
        sliding_window: 64,
        sliding_window_pattern: 6,
        ..Default::default()
    };
    let dir = temp_dir("candle-gemma3");
    write_tiny_gguf(&dir.join("tiny.gguf"), &spec).unwrap();
    write_tiny_safetensors(&dir.join("hf"), &spec).unwrap();
    let cfg = Config {
        attention_bias: false,
        head_dim: spec.head_dim,
        hidden_activation: candle_nn::Activation::GeluPytorchTanh,
        hidden_size: spec.hidden,
        intermediate_size: spec.ffn,
        num_attention_heads: spec.heads,
        num_hidden_layers: spec.layers,
        num_key_value_heads: spec.kv_heads,
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        rope_local_base_freq: 10_000.0,
        vocab_size: spec.vocab,
        final_logit_softcapping: None,
        attn_logit_softcapping: None,
        query_pre_attn_scalar: spec.head_dim,
        sliding_window: spec.sliding_window,
        sliding_window_pattern: spec.sliding_window_pattern,
        max_position_embeddings: spec.context,
    };
    // SAFETY: the file was just written by this test and is not changed while mapped.
    let vb = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(
            &[dir.join("hf/model.safetensors")],
            DType::F32,
            &Device::Cpu,
        )
    }
    .unwrap();
    let mut reference = Reference::new(false, &cfg, vb).unwrap();
    let generic =
        GenericModel::load_gguf(&dir.join("tiny.gguf"), &Device::Cpu, LoadOptions::default())
            .unwrap();
    let c = generic.config.clone();
    let all = prompt(23, 5, VOCAB);
    let blocks = [3u32, 0];
    let mut kv =
        DeviceKv::new(&Device::Cpu, c.num_layers, 4, 16, c.kv_dim(), KvDtype::F32).unwrap();
    let mut worst = 0f32;
    for (from, to) in [(0, 20), (20, 21), (21, 22), (22, 23)] {
        // The reference reads one token at a time: its full-attention cache in 0.11.1 refuses a
        // chunk of several (it appends non-contiguous value rows).
        let mut want = Vec::new();
        for p in from..to {
            let ids = Tensor::new(&all[p..p + 1], &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            want = reference
                .forward(&ids, p)
                .unwrap()
                .i((0, 0))
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
        }
        let (mut got, mut summaries) = (Vec::new(), Vec::new());
        let chunk = SeqChunk {
            tokens: &all[from..to],
            start_pos: from,
            blocks: &blocks,
            packed: &[],
            logit_rows: 1,
            summary_only: false,
        };
        generic
            .forward(&[chunk], &mut kv, &mut got, &mut summaries)
            .unwrap();
        worst = worst.max(crate::worst(&want, &got));
        assert_eq!(
            same_top(&want, &got, c.vocab_size),
            (1, 1),
            "top token at {to}"
        );
    }
    eprintln!("largest logit difference against candle-transformers' gemma3: {worst:.2e}");
    assert!(worst <= 1e-4, "largest logit difference {worst}");
}
