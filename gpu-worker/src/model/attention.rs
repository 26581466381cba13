//! Attention of each sequence's new tokens over its own paged KV cache.
//!
//! Work is split into (sequence, KV head, 64-token query slice) tasks run across the kernel pool.
//! Keys and values are read through the sequence's block table, and its packed blocks for old
//! positions of global layers (in place when stored as f32, converted head by head when compact). Each query row is
//! computed on its own, over exactly the keys its position can see and in position order, so a
//! token's result never depends on how its sequence was batched, chunked, cached or recomputed
//! (a general matrix product would change its summation order with shape). The heads sharing a
//! KV head are scored together, so each key and value row is read once per token, not per head.

use std::sync::Mutex;

use super::{ops, GemmaConfig, SeqChunk};
use crate::kernels::SpinPool;
use crate::kv::KvStore;

/// Query tokens per task.
const SLICE_TOKENS: usize = 64;

/// Attention for every chunk into `out` (`tokens × heads × head_dim`, rows in chunk order);
/// `q` has the same layout.
pub(super) fn attention(
    c: &GemmaConfig,
    layer: usize,
    local: bool,
    chunks: &[SeqChunk<'_>],
    q: &[f32],
    kv: &KvStore,
    out: &mut [f32],
) {
    let (nh, hd) = (c.num_heads, c.head_dim);
    let group = nh / c.num_kv_heads;
    let window = if local { c.sliding_window } else { None };
    let mut offsets = Vec::with_capacity(chunks.len());
    let mut t = 0;
    for ch in chunks {
        offsets.push(t);
        t += ch.tokens.len();
    }
    // (chunk, KV head, first token of the slice)
    let tasks: Vec<(usize, usize, usize)> = chunks
        .iter()
        .enumerate()
        .flat_map(|(ci, ch)| {
            (0..c.num_kv_heads).flat_map(move |g| {
                (0..ch.tokens.len())
                    .step_by(SLICE_TOKENS)
                    .map(move |t0| (ci, g, t0))
            })
        })
        .collect();
    let results: Vec<Mutex<Vec<f32>>> = tasks.iter().map(|_| Mutex::new(Vec::new())).collect();
    SpinPool::global().run(tasks.len(), &|ti| {
        let (ci, g, t0) = tasks[ti];
        let ch = &chunks[ci];
        let t1 = (t0 + SLICE_TOKENS).min(ch.tokens.len());
        let mut res = vec![0f32; (t1 - t0) * group * hd];
        let mut scores = Vec::new();
        for (i, o) in (t0..t1).zip(res.chunks_exact_mut(group * hd)) {
            let row = offsets[ci] + i;
            let qrows = &q[(row * nh + g * group) * hd..(row * nh + (g + 1) * group) * hd];
            let p = ch.start_pos + i;
            let lo = window.map_or(0, |w| (p + 1).saturating_sub(w));
            token(c, layer, kv, ch, g, qrows, lo..=p, &mut scores, o);
        }
        if let Ok(mut slot) = results[ti].lock() {
            *slot = res;
        }
    });
    for (&(ci, g, t0), res) in tasks.iter().zip(results) {
        let res = res.into_inner().unwrap_or_default();
        for (i, rows) in res.chunks_exact(group * hd).enumerate() {
            let dst = ((offsets[ci] + t0 + i) * nh + g * group) * hd;
            out[dst..dst + group * hd].copy_from_slice(rows);
        }
    }
}

/// The output of the heads in `qrows` (those sharing KV head `g`) for one token that sees the
/// key positions `keys`.
#[allow(clippy::too_many_arguments)]
fn token(
    c: &GemmaConfig,
    layer: usize,
    kv: &KvStore,
    ch: &SeqChunk<'_>,
    g: usize,
    qrows: &[f32],
    keys: std::ops::RangeInclusive<usize>,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let hd = c.head_dim;
    let group = qrows.len() / hd;
    let scale = 1.0 / c.query_pre_attn_scalar.sqrt();
    let len = keys.end() + 1 - keys.start();
    scores.clear();
    scores.resize(group * len, 0.0);
    let mut max = vec![f32::NEG_INFINITY; group];
    let mut buf = vec![0f32; hd];
    for (jj, (at, slot)) in kv
        .rows(layer, ch.blocks, ch.packed, keys.clone())
        .enumerate()
    {
        let key = kv.key(layer, (at, slot), g, &mut buf);
        for (h, q) in qrows.chunks_exact(hd).enumerate() {
            let mut v = ops::dot(q, key) * scale;
            if let Some(cap) = c.attn_logit_softcap {
                v = (v / cap).tanh() * cap;
            }
            scores[h * len + jj] = v;
            max[h] = max[h].max(v);
        }
    }
    let mut inv = vec![0f32; group];
    for h in 0..group {
        let mut sum = 0.0;
        for v in &mut scores[h * len..(h + 1) * len] {
            *v = ops::exp(*v - max[h]);
            sum += *v;
        }
        inv[h] = 1.0 / sum;
    }
    for (jj, (at, slot)) in kv.rows(layer, ch.blocks, ch.packed, keys).enumerate() {
        let value = kv.value(at, slot, g, &mut buf);
        for (h, o) in out.chunks_exact_mut(hd).enumerate() {
            ops::axpy(o, scores[h * len + jj] * inv[h], value);
        }
    }
}
