//! Attention of each sequence's new tokens over its own paged KV cache, as matrix products.
//!
//! Per (sequence, KV head) the keys and values the chunk can see are gathered from their blocks
//! into contiguous matrices; the queries of every head sharing that KV head are stacked, so scores
//! are one `[heads·tokens, keys]` product and the output one `[heads·tokens, head_dim]` product.
//! Causality and sliding windows are applied as masks on the score rows.

use std::sync::Mutex;

use gemm::Parallelism;

use super::{ops, GemmaConfig, SeqChunk};
use crate::kernels::SpinPool;
use crate::kv::KvStore;

/// Query tokens per slice: each slice multiplies only against the keys its tokens can see, which
/// skips most of the masked half of a causal prefill.
const SLICE_TOKENS: usize = 64;

/// `c[m×n] = a[m×k] · b`, with `b` given as `[n×k]` (`b_rows_are_columns`) or `[k×n]`, all
/// row-major.
fn matmul(
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    (m, k, n): (usize, usize, usize),
    b_rows_are_columns: bool,
) {
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    let (rhs_cs, rhs_rs) = if b_rows_are_columns {
        (k as isize, 1)
    } else {
        (1, n as isize)
    };
    // SAFETY: the asserts above keep every index the strides describe inside the three slices,
    // and `c` does not alias `a` or `b` (distinct borrows).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            1,
            k as isize,
            b.as_ptr(),
            rhs_cs,
            rhs_rs,
            0.0,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        )
    }
}

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
    // Keys visible to any token of the slice, relative to the gathered range.
    let (k0, k1) = (visible_from(first + t0) - gr.lo_min, first + t1 - gr.lo_min);
    let (m, kl) = ((t1 - t0) * group, k1 - k0);
    let mut scores = vec![0f32; m * kl];
    matmul(
        &gr.queries[t0 * group * hd..],
        &gr.keys[k0 * hd..],
        &mut scores,
        (m, hd, kl),
        true,
    );
    for (ri, srow) in scores.chunks_exact_mut(kl).enumerate() {
        let p = first + t0 + ri / group;
        let (lo, hi) = (visible_from(p) - gr.lo_min - k0, p - gr.lo_min - k0);
        let mut max = f32::NEG_INFINITY;
        for v in &mut srow[lo..=hi] {
            *v *= scale;
            if let Some(cap) = c.attn_logit_softcap {
                *v = (*v / cap).tanh() * cap;
            }
            max = max.max(*v);
        }
        let mut sum = 0.0;
        for v in &mut srow[lo..=hi] {
            *v = ops::exp(*v - max);
            sum += *v;
        }
        let inv = 1.0 / sum;
        srow[lo..=hi].iter_mut().for_each(|v| *v *= inv);
        srow[..lo].fill(0.0);
        srow[hi + 1..].fill(0.0);
    }
    let mut result = vec![0f32; m * hd];
    matmul(
        &scores,
        &gr.values[k0 * hd..],
        &mut result,
        (m, kl, hd),
        false,
    );
    result
}
