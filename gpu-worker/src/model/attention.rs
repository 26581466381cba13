//! Attention of each sequence's new tokens over its own paged KV cache.
//!
//! Work is split into (sequence, KV head, slice of query tokens) tasks run across the kernel pool.
//! Keys and values are read through the sequence's block table, and its packed blocks for old
//! positions of global layers, a tile of [`KEY_TILE`] positions at a time: read into f32 once
//! per slice (converted when stored compact) and used by every query row of the slice, so a
//! prefill does not re-read and re-convert its whole history per row. Each query row is still computed on its own,
//! over exactly the keys its position can see and in position order, so a token's result never
//! depends on how its sequence was batched, chunked, cached or recomputed (a general matrix
//! product would change its summation order with shape). The heads sharing a KV head are scored
//! together, so each key and value row is read once per tile, not per head.

use std::sync::Mutex;

use super::{GemmaConfig, SeqChunk};
use crate::kernels::SpinPool;
use crate::kv::KvStore;
use crate::math::exp;

/// Query tokens per task, at most.
const SLICE_TOKENS: usize = 64;
/// Key positions converted to f32 together (32 KiB of Gemma 3 head rows: an L1's worth).
const KEY_TILE: usize = 32;
/// Scores a task may hold (4 MiB): long histories take fewer query rows per slice.
const SCORE_BUDGET: usize = 1 << 20;

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
    // (chunk, KV head, first token of the slice, end of the slice)
    let tasks: Vec<(usize, usize, usize, usize)> = chunks
        .iter()
        .enumerate()
        .flat_map(|(ci, ch)| {
            let n = ch.tokens.len();
            let span = window.map_or(ch.start_pos + n, |w| {
                (w + SLICE_TOKENS).min(ch.start_pos + n)
            });
            let slice = (SCORE_BUDGET / (group * span).max(1)).clamp(1, SLICE_TOKENS);
            (0..c.num_kv_heads).flat_map(move |g| {
                (0..n)
                    .step_by(slice)
                    .map(move |t0| (ci, g, t0, (t0 + slice).min(n)))
            })
        })
        .collect();
    let results: Vec<Mutex<Vec<f32>>> = tasks.iter().map(|_| Mutex::new(Vec::new())).collect();
    SpinPool::global().run(tasks.len(), &|ti| {
        let (ci, g, t0, t1) = tasks[ti];
        let qrows = |i: usize| {
            let row = offsets[ci] + i;
            &q[(row * nh + g * group) * hd..(row * nh + (g + 1) * group) * hd]
        };
        let res = slice(c, layer, kv, &chunks[ci], g, window, (t0, t1), qrows);
        if let Ok(mut slot) = results[ti].lock() {
            *slot = res;
        }
    });
    for (&(ci, g, t0, _), res) in tasks.iter().zip(results) {
        let res = res.into_inner().unwrap_or_default();
        for (i, rows) in res.chunks_exact(group * hd).enumerate() {
            let dst = ((offsets[ci] + t0 + i) * nh + g * group) * hd;
            out[dst..dst + group * hd].copy_from_slice(rows);
        }
    }
}

/// The output of the heads sharing KV head `g` for the chunk's tokens `t0..t1` (`qrows(i)`: token
/// `i`'s query heads), each over the positions it sees: from its window's start (or 0) to itself.
/// Rows are `group × head_dim` values per token.
#[allow(clippy::too_many_arguments)]
fn slice<'q>(
    c: &GemmaConfig,
    layer: usize,
    kv: &KvStore,
    ch: &SeqChunk<'_>,
    g: usize,
    window: Option<usize>,
    (t0, t1): (usize, usize),
    qrows: impl Fn(usize) -> &'q [f32],
) -> Vec<f32> {
    let hd = c.head_dim;
    let group = c.num_heads / c.num_kv_heads;
    let scale = 1.0 / c.query_pre_attn_scalar.sqrt();
    let rows = t1 - t0;
    // Row r (token t0 + r) sees positions first(r)..=last(r); both grow with r.
    let last = |r: usize| ch.start_pos + t0 + r;
    let first = |r: usize| window.map_or(0, |w| (last(r) + 1).saturating_sub(w));
    let (lo, hi) = (first(0), last(rows - 1));
    let span = hi + 1 - lo;
    // scores[(r * group + h) * span + (j - lo)]
    let mut scores = vec![0f32; rows * group * span];
    let mut max = vec![f32::NEG_INFINITY; rows * group];
    let mut tile = vec![0f32; KEY_TILE * hd];

    // Where each position's rows are; the next tile's are asked for while this one is read.
    let locs: Vec<(usize, usize)> = kv.rows(layer, ch.blocks, ch.packed, lo..=hi).collect();
    let mut j0 = lo;
    let mut row_scores = vec![0f32; group];
    while j0 <= hi {
        let n = KEY_TILE.min(hi + 1 - j0);
        let ahead = (j0 + n - lo)..(j0 + 2 * n - lo).min(span);
        for &loc in &locs[ahead] {
            kv.prefetch(loc, g);
        }
        for (dst, &loc) in tile.chunks_exact_mut(hd).zip(&locs[j0 - lo..j0 - lo + n]) {
            kv.key(layer, loc, g, dst);
        }
        for r in 0..rows {
            let q = qrows(t0 + r);
            let mut put = |j: usize, h: usize, d: f32| {
                let mut v = d * scale;
                if let Some(cap) = c.attn_logit_softcap {
                    v = (v / cap).tanh() * cap;
                }
                let at = r * group + h;
                scores[at * span + j - lo] = v;
                max[at] = max[at].max(v);
            };
            let (a, b) = (first(r).max(j0), last(r).min(j0 + n - 1));
            let mut j = a;
            // Four keys at a time where the heads come in fours: the same sums, reduced together.
            #[cfg(target_arch = "x86_64")]
            if group == 4 && hd.is_multiple_of(LANES) && crate::kernels::has_avx512() {
                while j + 4 <= b + 1 {
                    let keys = &tile[(j - j0) * hd..(j + 4 - j0) * hd];
                    // SAFETY: AVX-512 F is available (checked); 4 query rows and 4 keys of `hd`.
                    let d = unsafe { dots4x4::scores(q, keys) };
                    for (i, &d) in d.iter().enumerate() {
                        put(j + i / 4, i % 4, d);
                    }
                    j += 4;
                }
            }
            while j <= b {
                let key = &tile[(j - j0) * hd..(j - j0 + 1) * hd];
                dots(q, key, &mut row_scores);
                for (h, &d) in row_scores.iter().enumerate() {
                    put(j, h, d);
                }
                j += 1;
            }
        }
        j0 += n;
    }

    // Softmax weights, each row over exactly its own positions.
    for r in 0..rows {
        let (a, b) = (first(r) - lo, last(r) - lo);
        for h in 0..group {
            let at = r * group + h;
            let row = &mut scores[at * span + a..=at * span + b];
            // The exponentials vectorize on their own; the sum stays in position order.
            row.iter_mut().for_each(|v| *v = exp(*v - max[at]));
            let sum: f32 = row.iter().sum();
            let inv = 1.0 / sum;
            row.iter_mut().for_each(|v| *v *= inv);
        }
    }

    let mut out = vec![0f32; rows * group * hd];
    let mut j0 = lo;
    while j0 <= hi {
        let n = KEY_TILE.min(hi + 1 - j0);
        for (dst, &(at, slot)) in tile.chunks_exact_mut(hd).zip(&locs[j0 - lo..j0 - lo + n]) {
            kv.value(at, slot, g, dst);
        }
        for r in 0..rows {
            let (a, b) = (first(r).max(j0), last(r).min(j0 + n - 1));
            if a > b {
                continue;
            }
            let values = &tile[(a - j0) * hd..(b + 1 - j0) * hd];
            let o = &mut out[r * group * hd..(r + 1) * group * hd];
            let weights = &scores[r * group * span..(r + 1) * group * span];
            accumulate(o, values, weights, span, a - lo);
        }
        j0 += n;
    }
    out
}

/// Lanes of the attention kernels' accumulators (one 512-bit or two 256-bit vectors).
const LANES: usize = 16;

/// Scores of 4 query heads against 4 keys with AVX-512, equal bit for bit to [`dots`] for each
/// pair: each of the 16 accumulators takes its products lane by lane in the same order, and the
/// 16 are then reduced together by shuffles that add the same pairs in the same order as
/// [`reduce`] (lanes `l` and `l + 8`, then `l + 4`, `l + 2`, `l + 1`), so a score does not depend
/// on whether it was computed here or alone. The scalar reduction of each score cost about as
/// much as its products.
#[cfg(target_arch = "x86_64")]
mod dots4x4 {
    use super::LANES;
    use std::arch::x86_64::*;

    /// `out[4·j + h] = q_h · key_j` for the 4 rows `q_h` of `qs` and the 4 rows `key_j` of
    /// `keys`.
    ///
    /// # Safety
    /// AVX-512 F; `qs` and `keys` hold 4 rows each of the same width, a multiple of 16.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores(qs: &[f32], keys: &[f32]) -> [f32; 16] {
        let hd = keys.len() / 4;
        assert!(qs.len() == 4 * hd && keys.len() == 4 * hd && hd.is_multiple_of(LANES));
        let (q, k) = (qs.as_ptr(), keys.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 16];
        for c in (0..hd).step_by(LANES) {
            // SAFETY: c + 16 <= hd, within each of the 4 rows (checked above).
            unsafe {
                let qv = [0, 1, 2, 3].map(|h| _mm512_loadu_ps(q.add(h * hd + c)));
                for j in 0..4 {
                    let kv = _mm512_loadu_ps(k.add(j * hd + c));
                    for h in 0..4 {
                        acc[4 * h + j] = _mm512_fmadd_ps(qv[h], kv, acc[4 * h + j]);
                    }
                }
            }
        }
        // Lanes l + 8 onto l: two accumulators' halves per vector.
        let mut s1 = [_mm512_setzero_ps(); 8];
        for (i, s) in s1.iter_mut().enumerate() {
            let (a, b) = (acc[2 * i], acc[2 * i + 1]);
            let low = _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b);
            let high = _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b);
            *s = _mm512_add_ps(low, high);
        }
        // Then l + 4: each 128-bit block holds one accumulator's 4 remaining lanes.
        let mut s2 = [_mm512_setzero_ps(); 4];
        for (i, s) in s2.iter_mut().enumerate() {
            let (a, b) = (s1[2 * i], s1[2 * i + 1]);
            let low = _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b);
            let high = _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b);
            *s = _mm512_add_ps(low, high);
        }
        // Then l + 2 and l + 1, within 128-bit blocks.
        let mut s3 = [_mm512_setzero_ps(); 2];
        for (i, s) in s3.iter_mut().enumerate() {
            let (a, b) = (s2[2 * i], s2[2 * i + 1]);
            let low = _mm512_shuffle_ps::<0b01_00_01_00>(a, b);
            let high = _mm512_shuffle_ps::<0b11_10_11_10>(a, b);
            *s = _mm512_add_ps(low, high);
        }
        let low = _mm512_shuffle_ps::<0b10_00_10_00>(s3[0], s3[1]);
        let high = _mm512_shuffle_ps::<0b11_01_11_01>(s3[0], s3[1]);
        let sum = _mm512_add_ps(low, high);
        // Accumulator 4h + j ended in lane 4·(i mod 4) + i / 4 for i = 4h + j: lane 4j + h.
        let mut out = [0f32; 16];
        // SAFETY: 16 floats.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), sum) };
        out
    }
}

/// `out[i] = q_i · key` for each of the `out.len()` rows `q_i` of `qs` (`key.len()` values each).
///
/// Every product is accumulated the same way, lane by lane with fused multiply-adds and then a
/// fixed reduction, whichever rows it is computed beside, so a score never depends on how many
/// heads or tokens were computed together. Four rows at a time share each load of the key and
/// keep four independent accumulator chains in flight.
fn dots(qs: &[f32], key: &[f32], out: &mut [f32]) {
    let hd = key.len();
    let mut i = 0;
    while i + 4 <= out.len() {
        out[i..i + 4].copy_from_slice(&dots_n::<4>(&qs[i * hd..(i + 4) * hd], key));
        i += 4;
    }
    while i < out.len() {
        out[i] = dots_n::<1>(&qs[i * hd..(i + 1) * hd], key)[0];
        i += 1;
    }
}

#[inline(always)]
fn dots_n<const N: usize>(qs: &[f32], key: &[f32]) -> [f32; N] {
    let hd = key.len();
    let full = hd - hd % LANES;
    let mut acc = [[0f32; LANES]; N];
    for (c, k) in key[..full].chunks_exact(LANES).enumerate() {
        for (i, acc) in acc.iter_mut().enumerate() {
            let q = &qs[i * hd + c * LANES..i * hd + (c + 1) * LANES];
            for l in 0..LANES {
                acc[l] = q[l].mul_add(k[l], acc[l]);
            }
        }
    }
    let mut out = [0f32; N];
    for (i, (o, acc)) in out.iter_mut().zip(&acc).enumerate() {
        let mut s = reduce(acc);
        for c in full..hd {
            s = qs[i * hd + c].mul_add(key[c], s);
        }
        *o = s;
    }
    out
}

/// The sum of 16 lanes, pairwise in a fixed order.
#[inline(always)]
fn reduce(a: &[f32; LANES]) -> f32 {
    let mut v = *a;
    let mut w = LANES / 2;
    while w > 0 {
        for l in 0..w {
            v[l] += v[l + w];
        }
        w /= 2;
    }
    v[0]
}

/// `o_h += Σ_j weights[h * stride + at + j] · values_j` for each head row `o_h` of `o`, over the
/// value rows of `values` in order.
///
/// Each output value receives its terms one by one in position order (fused multiply-adds), as
/// a row-by-row loop would, so the result does not depend on how positions were tiled; the
/// accumulators stay in registers across the tile and each value row is loaded once for up to
/// four heads.
fn accumulate(o: &mut [f32], values: &[f32], weights: &[f32], stride: usize, at: usize) {
    let hd = o.len() / (weights.len() / stride);
    let heads = o.len() / hd;
    let mut h = 0;
    while h + 4 <= heads {
        accumulate_n::<4>(
            &mut o[h * hd..(h + 4) * hd],
            values,
            &weights[h * stride..],
            stride,
            at,
        );
        h += 4;
    }
    while h < heads {
        accumulate_n::<1>(
            &mut o[h * hd..(h + 1) * hd],
            values,
            &weights[h * stride..],
            stride,
            at,
        );
        h += 1;
    }
}

#[inline(always)]
fn accumulate_n<const N: usize>(
    o: &mut [f32],
    values: &[f32],
    weights: &[f32],
    stride: usize,
    at: usize,
) {
    let hd = o.len() / N;
    let n = values.len() / hd;
    let w = |h: usize, j: usize| weights[h * stride + at + j];
    let full = hd - hd % LANES;
    for c in (0..full).step_by(LANES) {
        let mut acc = [[0f32; LANES]; N];
        for (h, acc) in acc.iter_mut().enumerate() {
            acc.copy_from_slice(&o[h * hd + c..h * hd + c + LANES]);
        }
        for (j, v) in values.chunks_exact(hd).enumerate() {
            let v = &v[c..c + LANES];
            for (h, acc) in acc.iter_mut().enumerate() {
                let wj = w(h, j);
                for l in 0..LANES {
                    acc[l] = wj.mul_add(v[l], acc[l]);
                }
            }
        }
        for (h, acc) in acc.iter().enumerate() {
            o[h * hd + c..h * hd + c + LANES].copy_from_slice(acc);
        }
    }
    for c in full..hd {
        for h in 0..N {
            let mut s = o[h * hd + c];
            for j in 0..n {
                s = w(h, j).mul_add(values[j * hd + c], s);
            }
            o[h * hd + c] = s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn four_heads_by_four_keys_score_as_each_pair_alone() {
        use crate::kernels::tests::{cpu_runs, lacking};
        let wanted = [
            ("avx512f", is_x86_feature_detected!("avx512f")),
            ("avx512bw", is_x86_feature_detected!("avx512bw")),
        ];
        // Not run where the CPU lacks it, and then said so, loudly (see `cpu_runs`).
        if !cpu_runs("AVX-512 four-by-four scores", &lacking(&wanted)) {
            return;
        }
        assert!(crate::kernels::has_avx512(), "the features has_avx512 asks");
        let hd = 256;
        let qs = crate::fixtures::noise(4 * hd, 1, 3.0);
        let keys = crate::fixtures::noise(4 * hd, 2, 5.0);
        // SAFETY: AVX-512 F is available; 4 rows of 256 each.
        let got = unsafe { dots4x4::scores(&qs, &keys) };
        for j in 0..4 {
            let mut want = [0f32; 4];
            dots(&qs, &keys[j * hd..(j + 1) * hd], &mut want);
            for h in 0..4 {
                assert_eq!(
                    got[4 * j + h].to_bits(),
                    want[h].to_bits(),
                    "head {h}, key {j}"
                );
            }
        }
    }
}
