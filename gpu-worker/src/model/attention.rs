//! Attention of each sequence's new tokens over its own paged KV cache, as matrix products.
//!
//! Per (sequence, KV head) the keys and values the chunk can see are gathered from their blocks
//! into contiguous matrices, and the chunk's queries are cut into slices that run in parallel.
//! Each query row is computed on its own, over exactly the keys its position can see and in
//! position order, so a token's result never depends on how its sequence was batched, chunked,
//! cached or recomputed (a general matrix product would change its summation order with shape).

use std::sync::Mutex;

use super::{ops, GemmaConfig, SeqChunk};
use crate::kernels::SpinPool;
use crate::kv::KvStore;

/// Query tokens per slice: each slice multiplies only against the keys its tokens can see, which
/// skips most of the masked half of a causal prefill.
const SLICE_TOKENS: usize = 64;

/// The gathered inputs of one (sequence, KV head) pair.
struct Group {
    chunk: usize,
    kv_head: usize,
    /// First gathered key position (the earliest any of the chunk's tokens can see).
    lo_min: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
    /// `[tokens·heads_per_kv, head_dim]`, token-major.
    queries: Vec<f32>,
}

/// Attention for every chunk into `out` (`tokens × heads × head_dim`, rows in chunk order).
/// Work is split into (sequence, KV head, query slice) tasks run across the kernel pool.
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
    let visible_from = |p: usize| window.map_or(0, |w| (p + 1).saturating_sub(w));
    let mut offsets = Vec::with_capacity(chunks.len());
    let mut t = 0;
    for ch in chunks {
        offsets.push(t);
        t += ch.tokens.len();
    }
    let mut groups = Vec::new();
    for (ci, ch) in chunks.iter().enumerate() {
        let (first, end) = (ch.start_pos, ch.start_pos + ch.tokens.len());
        let lo_min = visible_from(first);
        for g in 0..c.num_kv_heads {
            let mut keys = Vec::with_capacity((end - lo_min) * hd);
            let mut values = Vec::with_capacity((end - lo_min) * hd);
            for j in lo_min..end {
                let (k, v) = kv.read(layer, ch.blocks, j);
                keys.extend_from_slice(&k[g * hd..(g + 1) * hd]);
                values.extend_from_slice(&v[g * hd..(g + 1) * hd]);
            }
            let mut queries = Vec::with_capacity(group * ch.tokens.len() * hd);
            for i in 0..ch.tokens.len() {
                let row = offsets[ci] + i;
                queries.extend_from_slice(
                    &q[(row * nh + g * group) * hd..(row * nh + (g + 1) * group) * hd],
                );
            }
            groups.push(Group {
                chunk: ci,
                kv_head: g,
                lo_min,
                keys,
                values,
                queries,
            });
        }
    }
    let tasks: Vec<(usize, usize)> = groups
        .iter()
        .enumerate()
        .flat_map(|(gi, gr)| {
            (0..chunks[gr.chunk].tokens.len())
                .step_by(SLICE_TOKENS)
                .map(move |t0| (gi, t0))
        })
        .collect();
    let results: Vec<Mutex<Vec<f32>>> = tasks.iter().map(|_| Mutex::new(Vec::new())).collect();
    SpinPool::global().run(tasks.len(), &|ti| {
        let (gi, t0) = tasks[ti];
        let gr = &groups[gi];
        let res = slice(
            c,
            gr,
            chunks[gr.chunk].start_pos,
            chunks[gr.chunk].tokens.len(),
            t0,
            &visible_from,
        );
        if let Ok(mut slot) = results[ti].lock() {
            *slot = res;
        }
    });
    for (&(gi, t0), res) in tasks.iter().zip(results) {
        let gr = &groups[gi];
        let res = res.into_inner().unwrap_or_default();
        for (i, rows) in res.chunks_exact(group * hd).enumerate() {
            let row = offsets[gr.chunk] + t0 + i;
            let dst = (row * nh + gr.kv_head * group) * hd;
            out[dst..dst + group * hd].copy_from_slice(rows);
        }
    }
}

/// Output rows of query tokens `t0 .. t0 + SLICE_TOKENS` of one group, token-major.
fn slice(
    c: &GemmaConfig,
    gr: &Group,
    first: usize,
    n: usize,
    t0: usize,
    visible_from: &dyn Fn(usize) -> usize,
) -> Vec<f32> {
    let hd = c.head_dim;
    let group = c.num_heads / c.num_kv_heads;
    let scale = 1.0 / c.query_pre_attn_scalar.sqrt();
    let t1 = (t0 + SLICE_TOKENS).min(n);
    let m = (t1 - t0) * group;
    // Most keys any token of the slice can see.
    let kl = first + t1 - visible_from(first + t0);
    let mut result = vec![0f32; m * hd];
    // The heads sharing this KV head see the same keys: score them together so each key and
    // value row is read from memory once per token, not once per head. Each head's numbers are
    // still computed exactly as on their own.
    let mut scores = vec![0f32; group * kl];
    for (ti, out) in result.chunks_exact_mut(group * hd).enumerate() {
        let p = first + t0 + ti;
        let (lo, hi) = (visible_from(p) - gr.lo_min, p - gr.lo_min);
        let len = hi + 1 - lo;
        let qrows = &gr.queries[(t0 + ti) * group * hd..(t0 + ti + 1) * group * hd];
        let mut max = vec![f32::NEG_INFINITY; group];
        for (jj, j) in (lo..=hi).enumerate() {
            let key = &gr.keys[j * hd..(j + 1) * hd];
            for (h, q) in qrows.chunks_exact(hd).enumerate() {
                let mut v = ops::dot(q, key) * scale;
                if let Some(cap) = c.attn_logit_softcap {
                    v = (v / cap).tanh() * cap;
                }
                scores[h * kl + jj] = v;
                max[h] = max[h].max(v);
            }
        }
        let mut inv = vec![0f32; group];
        for h in 0..group {
            let mut sum = 0.0;
            for v in &mut scores[h * kl..h * kl + len] {
                *v = ops::exp(*v - max[h]);
                sum += *v;
            }
            inv[h] = 1.0 / sum;
        }
        for (jj, j) in (lo..=hi).enumerate() {
            let value = &gr.values[j * hd..(j + 1) * hd];
            for (h, o) in out.chunks_exact_mut(hd).enumerate() {
                ops::axpy(o, scores[h * kl + jj] * inv[h], value);
            }
        }
    }
    result
}
