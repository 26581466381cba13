//! The device-generic forward pass (candle tensors, here on candle's CPU device) against Hearth's
//! CPU kernels, over tiny generated models: the same logits within a stated tolerance for a batch
//! of sequences at different positions, and the same engine behaviour (greedy tokens, session
//! caches, the disk tier) when the scheduler runs it.
//!
//! [`logits`] compares logits (with the kernels, with f16 copies, with candle-transformers'
//! Gemma 3); [`scheduling`] runs the engine on the candle pass; [`device`] counts device
//! operations and checks what stays on the device. Here: the models and the two-step batch they
//! are compared on.

#![allow(clippy::unwrap_used)]

#[path = "../common/mod.rs"]
mod common;
mod device;
mod logits;
mod scheduling;

use std::sync::Arc;

use candle_core::Device;
use common::{prompt, temp_dir, VOCAB};
use hearth_worker::fixtures::{write_tiny_gguf, TinySpec};
use hearth_worker::generic::{DeviceKv, GenericModel, LoadOptions};
use hearth_worker::kv::KvDtype;
use hearth_worker::model::{load_gguf, Model, SeqChunk};
use hearth_worker::sampling::LogitSummary;

pub(crate) fn both(spec: &TinySpec) -> (Arc<Model>, Arc<GenericModel>) {
    both_with(spec, LoadOptions::default())
}

pub(crate) fn both_with(spec: &TinySpec, options: LoadOptions) -> (Arc<Model>, Arc<GenericModel>) {
    let path = temp_dir("generic").join("tiny.gguf");
    write_tiny_gguf(&path, spec).unwrap();
    (
        Arc::new(load_gguf(&path).unwrap()),
        Arc::new(GenericModel::load_gguf(&path, &Device::Cpu, options).unwrap()),
    )
}

/// The largest difference between two sets of logits, relative to the largest logit.
pub(crate) fn worst(a: &[f32], b: &[f32]) -> f32 {
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
pub(crate) fn two_steps(
    mut forward: impl FnMut(&[SeqChunk<'_>], &mut Vec<f32>),
) -> (Vec<f32>, Vec<f32>) {
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
pub(crate) fn same_top(a: &[f32], b: &[f32], vocab: usize) -> (usize, usize) {
    let top = |r: &[f32]| (0..r.len()).fold(0, |best, i| if r[i] > r[best] { i } else { best });
    let same = a
        .chunks_exact(vocab)
        .zip(b.chunks_exact(vocab))
        .filter(|(x, y)| top(x) == top(y))
        .count();
    (same, a.len() / vocab)
}

/// Both steps' logits from the candle pass.
pub(crate) fn candle_steps(generic: &GenericModel) -> (Vec<f32>, Vec<f32>) {
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
