//! The device-generic forward pass (candle tensors, here on candle's CPU device) against Hearth's
//! CPU kernels, over tiny generated models: the same logits within a stated tolerance for a batch
//! of sequences at different positions, and the same engine behaviour (greedy tokens, session
//! caches, the disk tier) when the scheduler runs it.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use candle_core::Device;
use common::*;
use hearth_shared::SessionId;
use hearth_worker::engine::{DiskConfig, Engine, EngineConfig, GenerateRequest};
use hearth_worker::fixtures::{write_tiny_gguf, write_tiny_safetensors, TinySpec};
use hearth_worker::gen_model::{self, Like};
use hearth_worker::generic::{DeviceKv, GenericModel, LoadOptions};
use hearth_worker::kv::{KvDtype, KvStore};
use hearth_worker::model::{load_gguf, Model, SeqChunk};
use hearth_worker::sampling::LogitSummary;

const VOCAB: u32 = 512;

fn both(spec: &TinySpec) -> (Arc<Model>, Arc<GenericModel>) {
    both_with(spec, LoadOptions::default())
}

fn both_with(spec: &TinySpec, options: LoadOptions) -> (Arc<Model>, Arc<GenericModel>) {
    let path = temp_dir("generic").join("tiny.gguf");
    write_tiny_gguf(&path, spec).unwrap();
    (
        Arc::new(load_gguf(&path).unwrap()),
        Arc::new(GenericModel::load_gguf(&path, &Device::Cpu, options).unwrap()),
    )
}

fn greedy(id: u64, prompt: Vec<u32>, n: u32) -> GenerateRequest {
    let mut r = GenerateRequest::new(id, prompt, n);
    r.ignore_eos = true;
    r
}

/// The largest difference between two sets of logits, relative to the largest logit.
fn worst(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

/// Two steps over three sequences: prompts of 20, 7 and 40 tokens (the last crosses the 16-token
/// sliding window), then a decode, a 3-token chunk and a 5-token chunk, all at their own
/// positions with their own block tables; logits for every position.
fn two_steps(mut forward: impl FnMut(&[SeqChunk<'_>], &mut Vec<f32>)) -> (Vec<f32>, Vec<f32>) {
    let tables: [Vec<u32>; 3] = [vec![5, 1], vec![0], vec![2, 7, 3, 4]];
    let prompts: Vec<Vec<u32>> = [20, 7, 40]
        .iter()
        .enumerate()
        .map(|(i, &n)| prompt(n + 8, i as u32, VOCAB))
        .collect();
    let chunk = |i: usize, from: usize, n: usize| SeqChunk {
        tokens: &prompts[i][from..from + n],
        start_pos: from,
        blocks: &tables[i],
        packed: &[],
        logit_rows: n,
        summary_only: false,
    };
    let (mut first, mut second) = (Vec::new(), Vec::new());
    forward(
        &[chunk(0, 0, 20), chunk(1, 0, 7), chunk(2, 0, 40)],
        &mut first,
    );
    forward(
        &[chunk(0, 20, 1), chunk(1, 7, 3), chunk(2, 40, 5)],
        &mut second,
    );
    (first, second)
}

/// Rows (of `vocab` logits) whose largest logit is at the same index in both.
fn same_top(a: &[f32], b: &[f32], vocab: usize) -> (usize, usize) {
    let top = |r: &[f32]| (0..r.len()).fold(0, |best, i| if r[i] > r[best] { i } else { best });
    let same = a
        .chunks_exact(vocab)
        .zip(b.chunks_exact(vocab))
        .filter(|(x, y)| top(x) == top(y))
        .count();
    (same, a.len() / vocab)
}

/// Both steps' logits from the candle pass.
fn candle_steps(generic: &GenericModel) -> (Vec<f32>, Vec<f32>) {
    let c = &generic.config;
    let mut kv =
        DeviceKv::new(&Device::Cpu, c.num_layers, 8, 16, c.kv_dim(), KvDtype::F32).unwrap();
    two_steps(|chunks, out| {
        let mut summaries = Vec::new();
        generic
            .forward(chunks, &mut kv, out, &mut summaries)
            .unwrap();
        // The device's summaries are those of the rows it returned.
        let rows: Vec<LogitSummary> = out
            .chunks_exact(c.vocab_size)
            .map(LogitSummary::of)
            .collect();
        assert_eq!(summaries.len(), rows.len());
        for (d, h) in summaries.iter().zip(&rows) {
            assert_eq!(d.argmax, h.argmax);
            assert!(
                (d.lse - h.lse).abs() <= 1e-4 * h.lse.abs().max(1.0),
                "{d:?} {h:?}"
            );
        }
    })
}

/// The largest logit difference (relative to the largest logit) and the rows with the same top
/// token, over both steps; asserts the former is within `tolerance`.
fn compare(spec: &TinySpec, tolerance: f32) -> (f32, usize, usize) {
    compare_with(spec, LoadOptions::default(), tolerance)
}

fn compare_with(spec: &TinySpec, options: LoadOptions, tolerance: f32) -> (f32, usize, usize) {
    let (native, generic) = both_with(spec, options);
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
    let got = candle_steps(&generic);
    assert_eq!(want.0.len(), (20 + 7 + 40) * c.vocab_size);
    assert_eq!(want.1.len(), (1 + 3 + 5) * c.vocab_size);
    let err = worst(&want.0, &got.0).max(worst(&want.1, &got.1));
    let (a, n) = same_top(&want.0, &got.0, c.vocab_size);
    let (b, m) = same_top(&want.1, &got.1, c.vocab_size);
    assert!(
        err <= tolerance,
        "largest logit difference {err} (tolerance {tolerance})"
    );
    (err, a + b, n + m)
}

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
    let (q_err, q_same, q_rows) = compare(&TinySpec::default(), 0.1);
    eprintln!(
        "largest logit difference: f32 {f32_err:.2e}, quantized {q_err:.2e}; quantized top token \
         the same at {q_same}/{q_rows} positions"
    );
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

#[test]
fn the_engine_on_the_candle_pass_decodes_as_on_the_kernels_and_batches_exactly() {
    let (native, generic) = both(&TinySpec {
        quantized: false,
        ..Default::default()
    });
    let config = EngineConfig {
        kv_dtype: KvDtype::F32,
        kv_window_margin: None,
        ..Default::default()
    };
    let on_kernels = Engine::start(native, config.clone()).unwrap();
    let on_candle = Engine::start(generic, config).unwrap();
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| prompt(5 + i * 9, i as u32, VOCAB)).collect();
    let solo = |e: &Engine| -> Vec<Vec<u32>> {
        prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                collect(e.handle().submit(greedy(i as u64, p.clone(), 24)).unwrap()).tokens
            })
            .collect()
    };
    let want = solo(&on_kernels);
    assert_eq!(
        solo(&on_candle),
        want,
        "greedy tokens differ between the two passes"
    );
    // All six at once share the candle engine's steps and give the same tokens.
    let streams: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            on_candle
                .handle()
                .submit(greedy(50 + i as u64, p.clone(), 24))
                .unwrap()
        })
        .collect();
    let batched: Vec<_> = streams.into_iter().map(|s| collect(s).tokens).collect();
    assert_eq!(batched, want, "batched decoding on the candle pass differs");
    // Fixed-shape decode steps (what a GPU replays from graphs): six sequences padded to
    // eight, fewer as they finish, the same tokens.
    let (_, fixed) = both_with(
        &TinySpec {
            quantized: false,
            ..Default::default()
        },
        LoadOptions {
            step_graphs: true,
            ..Default::default()
        },
    );
    let on_fixed = Engine::start(
        fixed,
        EngineConfig {
            kv_dtype: KvDtype::F32,
            kv_window_margin: None,
            ..Default::default()
        },
    )
    .unwrap();
    let streams: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            on_fixed
                .handle()
                .submit(greedy(80 + i as u64, p.clone(), 24 - i as u32))
                .unwrap()
        })
        .collect();
    let fixed: Vec<_> = streams.into_iter().map(|s| collect(s).tokens).collect();
    for (i, (got, want)) in fixed.iter().zip(&want).enumerate() {
        assert_eq!(got[..], want[..24 - i], "fixed-shape steps, sequence {i}");
    }
    let distinct: std::collections::HashSet<_> = want.iter().flatten().collect();
    assert!(distinct.len() >= 8, "degenerate output: {want:?}");
}

#[test]
fn session_caches_and_the_disk_tier_work_on_device_memory() {
    let (_, generic) = both(&TinySpec::default());
    let c = &generic.config;
    let block_bytes = DeviceKv::block_bytes(c.num_layers, 16, c.kv_dim(), KvDtype::F16).unwrap();
    let dir = temp_dir("generic-disk");
    let config = EngineConfig {
        // Room for two of the three sessions below (3 blocks each).
        kv_budget_bytes: 8 * block_bytes,
        kv_disk: Some(DiskConfig {
            dir: dir.clone(),
            bytes: 64 * block_bytes as u64,
        }),
        ..Default::default()
    };
    let e = Engine::start(generic.clone(), config).unwrap();
    let h = e.handle();
    let mut history = Vec::new();
    for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
        let p = prompt(40, 30 + i as u32, VOCAB);
        let mut r = greedy(i as u64, p.clone(), 4);
        r.session = Some(SessionId::new(name));
        let out = collect(h.submit(r).unwrap());
        assert_eq!(out.tokens.len(), 4, "{:?}", out.error);
        history.push((p, out.tokens));
    }
    assert!(h.stats().session_evictions >= 1, "{:?}", h.stats());
    // Session "c" is still in device memory; "a" was evicted to disk. Both resume from cache
    // and answer as a cold engine does.
    let cold = Engine::start(generic, EngineConfig::default()).unwrap();
    for (n, (name, at)) in [("c", 2), ("a", 0)].into_iter().enumerate() {
        let (p, reply) = &history[at];
        let mut turn2 = p.clone();
        turn2.extend(reply);
        turn2.extend(prompt(10, 39, VOCAB));
        let mut r = greedy(10 + n as u64, turn2.clone(), 8);
        r.session = Some(SessionId::new(name));
        let warm = collect(h.submit(r).unwrap());
        assert_eq!(warm.cached_tokens, Some(43), "session {name}");
        let fresh = collect(
            cold.handle()
                .submit(greedy(20 + n as u64, turn2, 8))
                .unwrap(),
        );
        assert_eq!(fresh.cached_tokens, Some(0));
        assert_eq!(warm.tokens, fresh.tokens, "session {name}");
    }
    assert_eq!(h.stats().disk_restores, 1);
}

#[test]
fn int8_kv_on_the_candle_pass_is_refused_with_a_clear_error() {
    let (_, generic) = both(&TinySpec::default());
    let err = Engine::start(
        generic,
        EngineConfig {
            kv_dtype: KvDtype::Int8,
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("int8"), "{err}");
}

/// A decode step of a Gemma 3 270M-shaped model (gen-model's random weights, the published
/// Q4_K_M file's formats) on candle's CPU device: the device operations it issues (counted by
/// what each costs on CUDA, see `DeviceOps`) per layer and per token, the same at batch 1, 4 and
/// 16: attention is one launch for the whole step.
#[test]
fn a_decode_step_issues_few_device_operations_whatever_the_batch() {
    let path = temp_dir("device-ops").join("270m.gguf");
    gen_model::write(Like::Gemma3_270m, &path, 1).unwrap();
    let model = GenericModel::load_gguf(&path, &Device::Cpu, LoadOptions::default()).unwrap();
    let c = model.config.clone();
    // Q/K/V are one product in every layer (Q5_0 beside Q8_0 becomes Q8_0), as are gate/up.
    assert!((0..c.num_layers).all(|l| model.products_per_layer(l) == 4));
    let mut kv =
        DeviceKv::new(&Device::Cpu, c.num_layers, 48, 16, c.kv_dim(), KvDtype::F16).unwrap();
    let mut steps = Vec::new();
    for batch in [1u32, 4, 16] {
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|i| vec![3 * i, 3 * i + 1, 3 * i + 2])
            .collect();
        let tokens: Vec<[u32; 1]> = (0..batch).map(|i| [1000 + i]).collect();
        let chunks: Vec<SeqChunk<'_>> = (0..batch as usize)
            .map(|i| SeqChunk {
                tokens: &tokens[i],
                start_pos: 20 + i,
                blocks: &tables[i],
                packed: &[],
                logit_rows: 1,
                // Greedy decoding: the rows stay on the device, their summaries come back.
                summary_only: true,
            })
            .collect();
        let before = model.device_ops().count();
        let (mut logits, mut summaries) = (Vec::new(), Vec::new());
        model
            .forward(&chunks, &mut kv, &mut logits, &mut summaries)
            .unwrap();
        assert_eq!(summaries.len(), batch as usize);
        assert!(logits.is_empty() || logits.len() == batch as usize * c.vocab_size);
        steps.push(model.device_ops().count().since(before));
    }
    assert_eq!(steps[0], steps[1], "batch 1 and 4");
    assert_eq!(steps[0], steps[2], "batch 1 and 16");
    let per_token = steps[0].total();
    // Outside the layers: the meta upload, the embedding lookup and its norm, the output
    // product (2), the summaries and their download.
    let per_layer = (per_token - 7) as f64 / c.num_layers as f64;
    eprintln!(
        "decode step: {} kernel launches and {} copies, {per_layer:.1} per layer, {per_token} per \
         token at batch 1 (the same at 4 and 16)",
        steps[0].kernels, steps[0].copies
    );
    assert!(per_layer <= 22.0, "{per_layer} device operations per layer");
    assert!(per_token <= 400, "{per_token} device operations per token");
}

/// Rows whose sampler reads only their summary stay on the device: a step mixing them with rows
/// that come to the host writes just those, at their places, with the same values and summaries
/// as a step that brings every row.
#[test]
fn summary_only_rows_stay_on_the_device_and_the_others_arrive_in_place() {
    let (_, generic) = both(&TinySpec::default());
    let c = generic.config.clone();
    let tables: [Vec<u32>; 3] = [vec![0, 1], vec![2, 3], vec![4, 5]];
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(12, 60 + i, VOCAB)).collect();
    let run = |summary_only: [bool; 3], logits: &mut Vec<f32>| {
        let mut kv =
            DeviceKv::new(&Device::Cpu, c.num_layers, 6, 16, c.kv_dim(), KvDtype::F32).unwrap();
        let chunks: Vec<SeqChunk<'_>> = (0..3)
            .map(|i| SeqChunk {
                tokens: &prompts[i],
                start_pos: 0,
                blocks: &tables[i],
                packed: &[],
                logit_rows: 2,
                summary_only: summary_only[i],
            })
            .collect();
        let mut summaries = Vec::new();
        generic
            .forward(&chunks, &mut kv, logits, &mut summaries)
            .unwrap();
        summaries
    };
    let mut all = Vec::new();
    let want = run([false; 3], &mut all);
    let vocab = c.vocab_size;
    assert_eq!(all.len(), 6 * vocab);
    // A buffer from an earlier step, marked, so rows left alone show.
    let mut mixed = vec![f32::NAN; 6 * vocab];
    let got = run([false, true, false], &mut mixed);
    assert_eq!(got, want, "summaries");
    assert_eq!(mixed.len(), 6 * vocab);
    for r in [0, 1, 4, 5] {
        assert_eq!(
            mixed[r * vocab..][..vocab],
            all[r * vocab..][..vocab],
            "row {r}"
        );
    }
    assert!(mixed[2 * vocab..4 * vocab].iter().all(|x| x.is_nan()));
    // Only summaries: no row comes to the host.
    let before = generic.device_ops().count();
    let mut none = vec![f32::NAN; 6 * vocab];
    assert_eq!(run([true; 3], &mut none), want);
    assert!(none.iter().all(|x| x.is_nan()));
    let ops = generic.device_ops().count().since(before);
    assert_eq!(ops.copies, 2, "the meta upload and the summaries' download");
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
        worst = worst.max(self::worst(&want, &got));
        assert_eq!(
            same_top(&want, &got, c.vocab_size),
            (1, 1),
            "top token at {to}"
        );
    }
    eprintln!("largest logit difference against candle-transformers' gemma3: {worst:.2e}");
    assert!(worst <= 1e-4, "largest logit difference {worst}");
}

/// `check-greedy` on the CPU: the candle pass's greedy reply against itself (exact) and against
/// the CPU kernels (within their tolerance); held to a tolerance of zero against the kernels, the
/// check sees the positions where the two round differently and fails.
#[test]
fn check_greedy_compares_a_devices_reply_with_a_cpu_pass() {
    use hearth_worker::check::{check_greedy, CheckOptions, Reference};
    use hearth_worker::device::DeviceSpec;
    use hearth_worker::server::config::{ForwardPass, RunOn};
    let path = temp_dir("check-greedy").join("tiny.gguf");
    gen_model::write(Like::Tiny, &path, 2).unwrap();
    let options = |reference, tolerance| CheckOptions {
        model: None,
        run_on: RunOn {
            device: DeviceSpec::Cpu,
            forward: ForwardPass::Candle,
            dense_gemm_tokens: None,
            cuda_graphs: true,
        },
        prompt_tokens: 24,
        tokens: 32,
        reference,
        tolerance,
    };
    let same = check_greedy(&path, &options(Reference::Candle, None)).unwrap();
    assert_eq!(same["pass"], true, "{same}");
    assert_eq!(same["same_argmax"], 32, "{same}");
    assert_eq!(same["worst_gap_logits"], 0.0, "{same}");
    let distinct: std::collections::HashSet<_> = same["reply"].as_array().unwrap().iter().collect();
    assert!(distinct.len() >= 8, "a degenerate reply: {same}");
    let kernels = check_greedy(&path, &options(Reference::Kernels, None)).unwrap();
    assert_eq!(kernels["pass"], true, "{kernels}");
    let gap = kernels["worst_gap_logits"].as_f64().unwrap();
    assert!(gap > 0.0, "{kernels}");
    let strict = check_greedy(&path, &options(Reference::Kernels, Some(0.0))).unwrap();
    assert_eq!(strict["pass"], false, "{strict}");
}
