//! x86-64 SIMD kernels. Each 32-value block is one 256-bit vector; a tile of several weight rows
//! and activation rows keeps its accumulators in registers, so each weight block is loaded once
//! per tile of activation rows and each activation block once per tile of weight rows (AVX2:
//! 4 × 2; AVX-512 VNNI: 4 × 4).
//!
//! Signed×signed 8-bit products go through an unsigned×signed instruction: AVX2 multiplies `|x|`
//! by `w` with `x`'s sign (`vpmaddubsw`+`vpmaddwd`); AVX-512 VNNI flips the weights to unsigned
//! and corrects with the activations' block sums (`vpdpbusd`, one 512-bit vector holding two
//! blocks and a per-half scale vector applying both blocks' scales at once).

use super::q8::{ActQ8, Q8Matrix, QK};

/// How far ahead of the weight row being read the kernels ask for memory. The hardware prefetcher
/// alone kept a one-row product (decode with one sequence) at about half this machine's memory
/// bandwidth: a 262k × 640 matrix took 21 ms without the hint and 10-11 ms with it (2 threads,
/// AVX2, Zen 3). Weights are row-major and each task walks its rows in order, so a fixed distance
/// ahead is memory the task reads next.
const PREFETCH_BYTES: usize = 4096;

/// AVX2: `vpmaddubsw` + `vpmaddwd` per 32-value block.
///
/// The unsigned side of `vpmaddubsw` is `|x|`, made once per activation block and shared by every
/// weight row of the tile, and the weights take `x`'s signs (`vpsignb`). Per weight block and
/// activation row that leaves six vector operations: sign, multiply-add twice, convert, scale,
/// fused multiply-add. Pointers are taken once per tile, so the inner loop does no bounds checks.
/// Weights must lie in `[-127, 127]` (a `-128` would keep its sign under `vpsignb`); every
/// constructor of [`Q8Matrix`] guarantees it.
#[allow(clippy::needless_range_loop)] // Index loops over register tiles read clearer than zips.
pub(super) mod avx2 {
    use super::{ActQ8, Q8Matrix, PREFETCH_BYTES, QK};
    use std::arch::x86_64::*;

    /// Weight rows per tile.
    const R: usize = 4;
    /// Activation rows per tile when there are several: 4 × 2 accumulators leave room in AVX2's 16
    /// vector registers for `|x|`, the weights and temporaries (4 × 4 spilled accumulators).
    const A: usize = 2;

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }

    /// One tile: `RT` weight rows from `wq` (scales `ws`) against `AT` activation rows from `xq`
    /// (scales `xs`), rows `k` values (`bpr` blocks) apart; results go to `out[a * n + i]`.
    ///
    /// # Safety
    /// Every row the tile touches must be in bounds of its buffer, and `out[a * n + i]` too.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    #[allow(clippy::too_many_arguments)] // A tile is addressed by these raw parts.
    unsafe fn tile<const RT: usize, const AT: usize>(
        wq: *const i8,
        ws: *const f32,
        xq: *const i8,
        xs: *const f32,
        k: usize,
        bpr: usize,
        out: *mut f32,
        n: usize,
    ) {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); AT]; RT];
        for b in 0..bpr {
            let mut ax = [_mm256_setzero_si256(); AT];
            let mut xsv = [_mm256_setzero_ps(); AT];
            for a in 0..AT {
                // SAFETY: activation row a and block b are in bounds (caller).
                unsafe {
                    let xv = _mm256_loadu_si256(xq.add(a * k + b * QK) as *const __m256i);
                    ax[a] = _mm256_abs_epi8(xv);
                    xsv[a] = _mm256_broadcast_ss(&*xs.add(a * bpr + b));
                }
            }
            for i in 0..RT {
                let at = wq.wrapping_add(i * k + b * QK);
                // A hint only: it never faults, so an address past the matrix is harmless.
                _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH_BYTES));
                // SAFETY: weight row i and block b are in bounds (caller).
                let (wv, wsv) = unsafe {
                    (
                        _mm256_loadu_si256(at as *const __m256i),
                        _mm256_broadcast_ss(&*ws.add(i * bpr + b)),
                    )
                };
                for a in 0..AT {
                    // SAFETY: as above (reloaded from L1 rather than held in a register).
                    let xv =
                        unsafe { _mm256_loadu_si256(xq.add(a * k + b * QK) as *const __m256i) };
                    let sw = _mm256_sign_epi8(wv, xv);
                    let d = _mm256_madd_epi16(_mm256_maddubs_epi16(ax[a], sw), ones);
                    acc[i][a] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(d),
                        _mm256_mul_ps(wsv, xsv[a]),
                        acc[i][a],
                    );
                }
            }
        }
        for i in 0..RT {
            for a in 0..AT {
                // SAFETY: in bounds (caller).
                unsafe { *out.add(a * n + i) = hsum(acc[i][a]) };
            }
        }
    }

    /// Weight rows `r .. r + RT` against activation rows `m0..m1`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows<const RT: usize>(
        w: &Q8Matrix,
        x: &ActQ8,
        r: usize,
        (m0, m1): (usize, usize),
        out: &mut [f32],
    ) {
        let (k, bpr, n) = (w.cols, w.cols / QK, w.rows);
        let (wq, ws) = (w.qs.as_ptr(), w.scales.as_ptr());
        let (xq, xs) = (x.qs.as_ptr(), x.scales.as_ptr());
        let o = out.as_mut_ptr();
        // SAFETY (all calls): r + RT <= w.rows and m1 <= x.rows (caller), so every row read is in
        // bounds; out holds x.rows × w.rows values (asserted by `matmul_rows`).
        unsafe {
            let (wq, ws) = (wq.add(r * k), ws.add(r * bpr));
            let mut m = m0;
            while m + A <= m1 {
                let (xq, xs, o) = (xq.add(m * k), xs.add(m * bpr), o.add(m * n + r));
                tile::<RT, A>(wq, ws, xq, xs, k, bpr, o, n);
                m += A;
            }
            while m < m1 {
                let (xq, xs, o) = (xq.add(m * k), xs.add(m * bpr), o.add(m * n + r));
                tile::<RT, 1>(wq, ws, xq, xs, k, bpr, o, n);
                m += 1;
            }
        }
    }

    /// Output columns `r0..r1` for every activation row.
    ///
    /// Activation rows are taken about 64 KiB at a time, so a prefill's rows stay in L2 while the
    /// task's weight rows pass over them, instead of streaming from memory once per weight tile.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn matmul_rows(w: &Q8Matrix, x: &ActQ8, r0: usize, r1: usize, out: &mut [f32]) {
        assert!(r1 <= w.rows && w.cols == x.cols && w.cols.is_multiple_of(QK));
        // The fields are public: check every length the raw reads below rely on, overflow included.
        let len = |a: usize, b: usize| a.checked_mul(b).expect("matrix size overflows usize");
        assert!(out.len() >= len(x.rows, w.rows));
        assert!(w.qs.len() >= len(w.rows, w.cols) && w.scales.len() >= len(w.rows, w.cols) / QK);
        assert!(x.qs.len() >= len(x.rows, x.cols) && x.scales.len() >= len(x.rows, x.cols) / QK);
        // About 64 KiB of activations per block.
        let block = (65_536 / w.cols.max(1)).max(A).next_multiple_of(A);
        let mut m0 = 0;
        while m0 < x.rows {
            let ms = (m0, (m0 + block).min(x.rows));
            let mut r = r0;
            while r + R <= r1 {
                // SAFETY: r + R <= r1 <= w.rows, ms.1 <= x.rows.
                unsafe { rows::<R>(w, x, r, ms, out) };
                r += R;
            }
            while r < r1 {
                // SAFETY: r < r1 <= w.rows, ms.1 <= x.rows.
                unsafe { rows::<1>(w, x, r, ms, out) };
                r += 1;
            }
            m0 = ms.1;
        }
    }
}

#[allow(clippy::needless_range_loop)] // Index loops over register tiles read clearer than zips.
pub(super) mod vnni512 {
    //! Weights are flipped to unsigned on the fly (`w ^ 0x80 = w + 128`) so `vpdpbusd` multiplies
    //! them with the signed activations directly; the `128·Σx` this adds is removed by starting
    //! each block's accumulator at `-128·Σx` (spread as `-16·Σx` over the block's 8 lanes).
    //! Activation scale and correction vectors are built once per call, not per weight row.
    use super::{ActQ8, Q8Matrix, PREFETCH_BYTES, QK};
    use std::arch::x86_64::*;

    /// Scalar dot product of one block (odd block counts leave one at the end).
    fn block_dot(w: &Q8Matrix, x: &ActQ8, r: usize, m: usize, b: usize) -> f32 {
        let (k, bpr) = (w.cols, w.cols / QK);
        let wq = &w.qs[r * k + b * QK..r * k + (b + 1) * QK];
        let xq = &x.qs[m * k + b * QK..m * k + (b + 1) * QK];
        let dot: i32 = wq.iter().zip(xq).map(|(&a, &b)| a as i32 * b as i32).sum();
        w.scales[r * bpr + b] * x.scales[m * bpr + b] * dot as f32
    }

    /// Per activation row and block pair: `[s0; 8] ++ [s1; 8]` scales and the correction start.
    /// Built once per product and shared by every task of it.
    pub(in crate::kernels) struct Prepared {
        scales: Vec<__m512>,
        corr: Vec<__m512i>,
        pairs: usize,
    }

    #[target_feature(enable = "avx512f")]
    pub(in crate::kernels) fn prepare(x: &ActQ8) -> Prepared {
        assert_eq!(
            x.sums.len(),
            x.scales.len(),
            "activation block sums missing"
        );
        let bpr = x.cols / QK;
        let pairs = bpr / 2;
        let mut scales = Vec::with_capacity(x.rows * pairs);
        let mut corr = Vec::with_capacity(x.rows * pairs);
        for m in 0..x.rows {
            for p in 0..pairs {
                let b = m * bpr + 2 * p;
                scales.push(_mm512_mask_blend_ps(
                    0xFF00,
                    _mm512_set1_ps(x.scales[b]),
                    _mm512_set1_ps(x.scales[b + 1]),
                ));
                corr.push(_mm512_mask_blend_epi32(
                    0xFF00,
                    _mm512_set1_epi32(-16 * x.sums[b]),
                    _mm512_set1_epi32(-16 * x.sums[b + 1]),
                ));
            }
        }
        Prepared {
            scales,
            corr,
            pairs,
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[inline]
    unsafe fn tile<const R: usize, const A: usize>(
        w: &Q8Matrix,
        x: &ActQ8,
        px: &Prepared,
        r: usize,
        m: usize,
        out: &mut [f32],
    ) {
        let k = w.cols;
        let bpr = k / QK;
        let mut acc = [[_mm512_setzero_ps(); A]; R];
        let flip = _mm512_set1_epi8(-128);
        let halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        for p in 0..px.pairs {
            let b = 2 * p;
            let mut xv = [_mm512_setzero_si512(); A];
            for a in 0..A {
                // SAFETY: row m + a < x.rows and blocks b, b + 1 < bpr: 64 bytes in bounds.
                xv[a] = unsafe {
                    _mm512_loadu_si512(x.qs.as_ptr().add((m + a) * k + b * QK) as *const __m512i)
                };
            }
            for i in 0..R {
                let at = w.qs.as_ptr().wrapping_add((r + i) * k + b * QK);
                // A hint only: it never faults, so an address past the matrix is harmless.
                _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH_BYTES));
                // SAFETY: row r + i < w.rows, blocks b, b + 1 < bpr (values and the two scales).
                let (wv, ws2) = unsafe {
                    (
                        _mm512_loadu_si512(at as *const __m512i),
                        _mm_loadl_epi64(w.scales.as_ptr().add((r + i) * bpr + b) as *const __m128i),
                    )
                };
                let wu = _mm512_xor_si512(wv, flip);
                let ws =
                    _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_castsi128_ps(ws2)));
                for a in 0..A {
                    let j = (m + a) * px.pairs + p;
                    let d = _mm512_dpbusd_epi32(px.corr[j], wu, xv[a]);
                    acc[i][a] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(d),
                        _mm512_mul_ps(ws, px.scales[j]),
                        acc[i][a],
                    );
                }
            }
        }
        for i in 0..R {
            for a in 0..A {
                let mut total = _mm512_reduce_add_ps(acc[i][a]);
                if bpr % 2 == 1 {
                    total += block_dot(w, x, r + i, m + a, bpr - 1);
                }
                out[(m + a) * w.rows + r + i] = total;
            }
        }
    }

    /// Weight rows `r .. r + R` against activation rows `m0..m1`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn rows<const R: usize>(
        w: &Q8Matrix,
        x: &ActQ8,
        px: &Prepared,
        r: usize,
        (m0, m1): (usize, usize),
        out: &mut [f32],
    ) {
        let mut m = m0;
        while m + 4 <= m1 {
            // SAFETY: bounds as documented on `tile`.
            unsafe { tile::<R, 4>(w, x, px, r, m, out) };
            m += 4;
        }
        while m < m1 {
            // SAFETY: as above.
            unsafe { tile::<R, 1>(w, x, px, r, m, out) };
            m += 1;
        }
    }

    /// # Safety
    /// The CPU must support AVX-512 F, BW and VNNI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn matmul_rows(
        w: &Q8Matrix,
        x: &ActQ8,
        px: &Prepared,
        r0: usize,
        r1: usize,
        out: &mut [f32],
    ) {
        assert!(r1 <= w.rows && w.cols == x.cols && w.cols.is_multiple_of(QK));
        assert!(out.len() >= x.rows * w.rows);
        assert_eq!(
            px.scales.len(),
            x.rows * px.pairs,
            "activations prepared for another matrix"
        );
        // Activation rows are taken about 64 KiB at a time (with their prepared scales and
        // corrections, three times that), so they stay in L2 while the task's weight rows pass
        // over them, instead of streaming a prefill's whole input from L3 once per weight tile.
        let block = (65_536 / w.cols.max(1)).max(4).next_multiple_of(4);
        let mut m0 = 0;
        while m0 < x.rows {
            let ms = (m0, (m0 + block).min(x.rows));
            let mut r = r0;
            while r + 4 <= r1 {
                // SAFETY: r + 3 < r1 <= w.rows, ms.1 <= x.rows.
                unsafe { rows::<4>(w, x, px, r, ms, out) };
                r += 4;
            }
            while r < r1 {
                // SAFETY: r < r1 <= w.rows, ms.1 <= x.rows.
                unsafe { rows::<1>(w, x, px, r, ms, out) };
                r += 1;
            }
            m0 = ms.1;
        }
    }
}

/// Activation quantization with AVX-512: the same blocks, scales and sums as the portable
/// [`super::q8::quantize_blocks`], bit for bit (for any input without NaN). Every step is exact
/// or rounds as the portable code does: the largest magnitude (order-free), the scale and its
/// inverse (the same scalar divisions), one product per value, the clamp to ±127, then
/// conversion with round-to-nearest-even (the default rounding mode, as `round_ties_even`).
pub(super) mod quantize512 {
    use super::QK;
    use std::arch::x86_64::*;

    /// Quantizes the blocks of `x` into `qs`, with each block's scale, sum and first half's sum.
    ///
    /// # Safety
    /// AVX-512 F and BW; `x` and `qs` hold whole blocks, and `scales`, `sums` and `halves` one
    /// entry per block.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn quantize_blocks(
        x: &[f32],
        qs: &mut [i8],
        scales: &mut [f32],
        sums: &mut [i32],
        halves: &mut [i32],
    ) {
        assert_eq!(QK, 32, "two 16-value vectors per block");
        let n = x.len() / QK;
        assert!(qs.len() >= n * QK && scales.len() >= n && sums.len() >= n && halves.len() >= n);
        let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
        for b in 0..n {
            // SAFETY: block b's 32 values lie inside `x` and `qs` (checked above).
            unsafe {
                let src = x.as_ptr().add(b * QK);
                let (v0, v1) = (_mm512_loadu_ps(src), _mm512_loadu_ps(src.add(16)));
                let amax =
                    _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
                let d = amax / 127.0;
                let inv = _mm512_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
                // Clamped as floats (a subnormal block's inverse scale is infinite), and NaN
                // to 0 as the portable conversion makes it.
                let q = |v| {
                    let p = _mm512_mul_ps(v, inv);
                    let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(p, p);
                    _mm512_maskz_cvtps_epi32(ordered, _mm512_min_ps(_mm512_max_ps(p, lo), hi))
                };
                let (q0, q1) = (q(v0), q(v1));
                let dst = qs.as_mut_ptr().add(b * QK);
                _mm_storeu_si128(dst as *mut __m128i, _mm512_cvtepi32_epi8(q0));
                _mm_storeu_si128(dst.add(16) as *mut __m128i, _mm512_cvtepi32_epi8(q1));
                let half = _mm512_reduce_add_epi32(q0);
                *scales.get_unchecked_mut(b) = d;
                *halves.get_unchecked_mut(b) = half;
                *sums.get_unchecked_mut(b) = half + _mm512_reduce_add_epi32(q1);
            }
        }
    }
}
