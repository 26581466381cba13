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
use hearth_worker::fixtures::{write_tiny_gguf, TinySpec};
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
    two_steps(|chunks, out| generic.forward(chunks, &mut kv, out).unwrap())
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
