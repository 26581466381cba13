//! The panel kernel for AVX2: the five-bit, Q4_K and Q6_K panels (not the 8-bit ones: AVX2 has
//! no unsigned-by-signed multiply-add into 32 bits, and `vpmaddubsw`'s 16-bit pair sums would
//! saturate on `w + 128`). Values of at most 6 bits against 8-bit activations stay far inside 16
//! bits, so each 256-bit half of a panel vector (8 rows) takes two `vpmaddubsw`, one 16-bit add
//! and one `vpmaddwd`, and the sums are the VNNI kernel's exactly.

use super::{
    ActQ8, Layout, Q8Matrix, PANEL, PANEL_BLOCK, PANEL_BLOCK4, PANEL_BLOCK5, PANEL_BLOCK6, QK,
};
use std::arch::x86_64::*;

const PREFETCH_BYTES: usize = 2048;
const FIVE: u8 = 1;
const Q4K: u8 = 2;
const Q6K: u8 = 3;
/// Rows per 256-bit vector of 32-bit sums: half a panel.
const HALF: usize = PANEL / 2;

/// Whether this kernel takes matrices in `layout`.
pub fn takes(layout: Layout) -> bool {
    matches!(
        layout,
        Layout::Panels5 | Layout::PanelsQ4K | Layout::PanelsQ6K
    )
}

/// 32 bytes, each 16 where bit `i` of `bits` is set (byte `i`), else 0.
#[target_feature(enable = "avx2")]
#[inline]
fn fifth_bits(bits: u32) -> __m256i {
    let v = _mm256_set1_epi32(bits as i32);
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let select = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let hit = _mm256_cmpeq_epi8(
        _mm256_and_si256(_mm256_shuffle_epi8(v, spread), select),
        select,
    );
    _mm256_and_si256(hit, _mm256_set1_epi8(16))
}

/// `P` panels from panel `p0` against activation rows `m .. m + A`, in format `F`.
///
/// # Safety
/// AVX2, FMA and F16C; panels `p0 .. p0 + P` exist, rows `m .. m + A` of `x` exist, and
/// `out` holds `x.rows × w.rows` values.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn tile<const P: usize, const A: usize, const F: u8>(
    w: &Q8Matrix,
    x: &ActQ8,
    p0: usize,
    m: usize,
    out: &mut [f32],
) {
    let (k, bpr) = (w.cols, w.cols / QK);
    let wq = w.qs.as_ptr() as *const u8;
    let xq = x.qs.as_ptr();
    let mut acc = [[[_mm256_setzero_ps(); A]; 2]; P];
    let (block_bytes, offset) = match F {
        FIVE => (PANEL_BLOCK5, 16),
        Q4K => (PANEL_BLOCK4, 0),
        _ => (PANEL_BLOCK6, 0),
    };
    let nibble = _mm256_set1_epi8(0x0f);
    let bits = _mm256_set1_epi8(0x30);
    let ones = _mm256_set1_epi16(1);
    let nibble_shifts = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
    let halves = if F == Q6K { 2 } else { 1 };
    let spr = k / super::QK_K;
    for b in 0..bpr {
        for half in 0..halves {
            let mut sum = [[[_mm256_setzero_si256(); A]; 2]; P];
            for a in 0..A {
                let at = (m + a) * bpr + b;
                let start = if F == Q6K {
                    let first = x.half_sums[at];
                    -32 * if half == 0 { first } else { x.sums[at] - first }
                } else {
                    -offset * x.sums[at]
                };
                for p in 0..P {
                    sum[p][0][a] = _mm256_set1_epi32(start);
                    sum[p][1][a] = _mm256_set1_epi32(start);
                }
            }
            for j in half * QK / 8 / halves..(half + 1) * QK / 8 / halves {
                let mut xb = [[_mm256_setzero_si256(); A]; 2];
                for (h, xb) in xb.iter_mut().enumerate() {
                    for a in 0..A {
                        let at = (m + a) * k + b * QK + 8 * j + 4 * h;
                        // SAFETY: row m + a < x.rows, value at + 3 < its row's end.
                        let four = unsafe { std::ptr::read_unaligned(xq.add(at) as *const i32) };
                        xb[a] = _mm256_set1_epi32(four);
                    }
                }
                for p in 0..P {
                    let block = wq.wrapping_add(((p0 + p) * bpr + b) * block_bytes);
                    let at = block.wrapping_add(j * 64);
                    // A hint only: it never faults.
                    _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH_BYTES) as *const i8);
                    for r in 0..2 {
                        // SAFETY: panel p0 + p exists, so its block b's bytes do.
                        let nibbles =
                            unsafe { _mm256_loadu_si256(at.add(32 * r) as *const __m256i) };
                        let mut low = _mm256_and_si256(nibbles, nibble);
                        let mut high = _mm256_and_si256(_mm256_srli_epi16::<4>(nibbles), nibble);
                        if F == Q6K {
                            let at = block.wrapping_add(PANEL_BLOCK / 2 + 64 * (j / 2) + 32 * r);
                            // SAFETY: as above; the high bits follow the nibbles.
                            let pairs = unsafe { _mm256_loadu_si256(at as *const __m256i) };
                            let (first, second) = if j % 2 == 0 {
                                (_mm256_slli_epi16::<4>(pairs), _mm256_slli_epi16::<2>(pairs))
                            } else {
                                (pairs, _mm256_srli_epi16::<2>(pairs))
                            };
                            low = _mm256_or_si256(low, _mm256_and_si256(first, bits));
                            high = _mm256_or_si256(high, _mm256_and_si256(second, bits));
                        } else if F == FIVE {
                            // SAFETY: panel p0 + p exists, so its block's fifth bits do.
                            let (f0, f1) = unsafe {
                                let fifths =
                                    block.add(PANEL_BLOCK / 2 + 16 * j + 4 * r) as *const u32;
                                (
                                    std::ptr::read_unaligned(fifths),
                                    std::ptr::read_unaligned(fifths.add(2)),
                                )
                            };
                            low = _mm256_add_epi8(low, fifth_bits(f0));
                            high = _mm256_add_epi8(high, fifth_bits(f1));
                        }
                        for a in 0..A {
                            let pairs = _mm256_add_epi16(
                                _mm256_maddubs_epi16(low, xb[0][a]),
                                _mm256_maddubs_epi16(high, xb[1][a]),
                            );
                            sum[p][r][a] =
                                _mm256_add_epi32(sum[p][r][a], _mm256_madd_epi16(pairs, ones));
                        }
                    }
                }
            }
            let (mut scale, mut min) =
                ([[_mm256_setzero_ps(); 2]; P], [[_mm256_setzero_ps(); 2]; P]);
            for p in 0..P {
                let block = wq.wrapping_add(((p0 + p) * bpr + b) * block_bytes);
                let panel = w.half_scales.as_ptr();
                for r in 0..2 {
                    // SAFETY: panel p0 + p exists: its block's scales (and Q4_K's minimums),
                    // and its f16 scales for the block or its super-block.
                    unsafe {
                        if F == Q4K {
                            let h = panel.add(
                                ((p0 + p) * spr + b * QK / super::QK_K) * 2 * PANEL + HALF * r,
                            );
                            let at = block.add(PANEL_BLOCK / 2);
                            let both = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                at.add(HALF * r) as *const __m128i
                            ));
                            let sc = _mm256_and_si256(both, _mm256_set1_epi32(63));
                            let four =
                                std::ptr::read_unaligned(at.add(PANEL + 4 * r) as *const i32);
                            let high = _mm_cvtsi32_si128(four);
                            let high = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(high, high));
                            let high = _mm256_srlv_epi32(high, nibble_shifts);
                            let high = _mm256_and_si256(high, _mm256_set1_epi32(0x0f));
                            let mn = _mm256_or_si256(
                                _mm256_srli_epi32::<6>(both),
                                _mm256_slli_epi32::<2>(high),
                            );
                            let d = _mm256_cvtph_ps(_mm_loadu_si128(h as *const __m128i));
                            let dmin =
                                _mm256_cvtph_ps(_mm_loadu_si128(h.add(PANEL) as *const __m128i));
                            scale[p][r] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
                            min[p][r] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn));
                        } else if F == Q6K {
                            let h = panel
                                .add(((p0 + p) * spr + b * QK / super::QK_K) * PANEL + HALF * r);
                            let at = block.add(PANEL_BLOCK * 3 / 4 + half * PANEL + HALF * r);
                            let sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(at as *const __m128i));
                            let d = _mm256_cvtph_ps(_mm_loadu_si128(h as *const __m128i));
                            scale[p][r] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
                        } else {
                            let h = panel.add(((p0 + p) * bpr + b) * PANEL + HALF * r);
                            scale[p][r] = _mm256_cvtph_ps(_mm_loadu_si128(h as *const __m128i));
                        }
                    }
                }
            }
            for a in 0..A {
                let at = (m + a) * bpr + b;
                let xs = x.scales[at];
                let xsum = _mm256_set1_ps(xs * x.sums[at] as f32);
                let xs = _mm256_set1_ps(xs);
                for p in 0..P {
                    for r in 0..2 {
                        let with_q = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(sum[p][r][a]),
                            _mm256_mul_ps(scale[p][r], xs),
                            acc[p][r][a],
                        );
                        acc[p][r][a] = if F == Q4K {
                            _mm256_fnmadd_ps(min[p][r], xsum, with_q)
                        } else {
                            with_q
                        };
                    }
                }
            }
        }
    }
    for p in 0..P {
        for r in 0..2 {
            let row = (p0 + p) * PANEL + HALF * r;
            // The last panel may be padding past the matrix's rows: those are not stored.
            let valid = w.rows.saturating_sub(row).min(HALF);
            if valid == 0 {
                continue;
            }
            for a in 0..A {
                let dst = &mut out[(m + a) * w.rows + row..][..valid];
                if valid == HALF {
                    // SAFETY: dst holds HALF values.
                    unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), acc[p][r][a]) };
                } else {
                    let mut all = [0f32; HALF];
                    // SAFETY: `all` holds HALF values.
                    unsafe { _mm256_storeu_ps(all.as_mut_ptr(), acc[p][r][a]) };
                    dst.copy_from_slice(&all[..valid]);
                }
            }
        }
    }
}

/// Panels `p0 .. p0 + P` against activation rows `m0..m1`: four rows at a time, then two, one
/// panel per tile, then one row at a time with every panel.
///
/// # Safety
/// As [`tile`], for every panel and row named.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn panels<const P: usize, const F: u8>(
    w: &Q8Matrix,
    x: &ActQ8,
    p0: usize,
    (m0, m1): (usize, usize),
    out: &mut [f32],
) {
    let mut m = m0;
    while m + 4 <= m1 {
        for p in 0..P {
            // SAFETY: as this function's contract.
            unsafe { tile::<1, 4, F>(w, x, p0 + p, m, out) };
        }
        m += 4;
    }
    while m + 2 <= m1 {
        for p in 0..P {
            // SAFETY: as this function's contract.
            unsafe { tile::<1, 2, F>(w, x, p0 + p, m, out) };
        }
        m += 2;
    }
    if m < m1 {
        // SAFETY: as above.
        unsafe { tile::<P, 1, F>(w, x, p0, m, out) };
    }
}

/// Output columns `r0..r1` (multiples of [`PANEL`], or `r1 = w.rows`) of every activation row,
/// for a matrix this kernel [`takes`].
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn matmul_rows(w: &Q8Matrix, x: &ActQ8, r0: usize, r1: usize, out: &mut [f32]) {
    match w.layout {
        // SAFETY: as this function's contract.
        Layout::Panels5 => unsafe { rows::<FIVE>(w, x, r0, r1, out) },
        // SAFETY: as above.
        Layout::PanelsQ4K => unsafe { rows::<Q4K>(w, x, r0, r1, out) },
        // SAFETY: as above.
        Layout::PanelsQ6K => unsafe { rows::<Q6K>(w, x, r0, r1, out) },
        other => panic!("the AVX2 panel kernel does not take {other:?}"),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows<const F: u8>(w: &Q8Matrix, x: &ActQ8, r0: usize, r1: usize, out: &mut [f32]) {
    let (first, end, block) = super::task_bounds(w, x, r0, r1, out);
    let mut m0 = 0;
    while m0 < x.rows {
        let ms = (m0, (m0 + block).min(x.rows));
        let mut p = first;
        while p + 2 <= end {
            // SAFETY: panels p .. p + 2 < end exist; rows ms lie inside x.
            unsafe { panels::<2, F>(w, x, p, ms, out) };
            p += 2;
        }
        if p < end {
            // SAFETY: as above.
            unsafe { panels::<1, F>(w, x, p, ms, out) };
        }
        m0 = ms.1;
    }
}
