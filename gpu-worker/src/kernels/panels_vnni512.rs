//! The panel layout's AVX-512 VNNI kernel (the layout itself: [`super`]): each block of a panel is
//! rebuilt in registers once and serves up to 16 activation rows, whose 4 values go from memory
//! straight into `vpdpbusd` as broadcasts. Its pieces (rebuilding a block, its scales, where each
//! sum starts, and adding a sum to a row) are shared with the AMX kernel, which differs only in
//! how it forms the integer sums.

use super::{
    ActQ8, Layout, Q8Matrix, PANEL, PANEL_BLOCK, PANEL_BLOCK4, PANEL_BLOCK5, PANEL_BLOCK6, QK, QK_K,
};
use std::arch::x86_64::*;

/// How far ahead of the 64 bytes being read each panel stream asks for memory.
const PREFETCH_BYTES: usize = 2048;
/// Activation rows [`panel_rows`] takes at a time, at most: 16 accumulators beside the
/// block's 8 weight vectors.
const ROWS_AT_ONCE: usize = 16;
/// Rows of [`panel_rows`] whose sums are interleaved, so that several independent chains of
/// multiply-adds are in flight.
const CHAINS: usize = 4;

/// The panel formats, as the kernels' const parameter.
pub(in crate::kernels) const EIGHT: u8 = 0;
pub(in crate::kernels) const FIVE: u8 = 1;
pub(in crate::kernels) const Q4K: u8 = 2;
pub(in crate::kernels) const Q6K: u8 = 3;

/// Bytes of one panel's block in format `F`.
const fn block_bytes(f: u8) -> usize {
    match f {
        FIVE => PANEL_BLOCK5,
        Q4K => PANEL_BLOCK4,
        Q6K => PANEL_BLOCK6,
        _ => PANEL_BLOCK,
    }
}

/// What each activation block starts its sums at, and Q4_K's minimum term, made once per
/// task for the rows it takes: `first`/`second` are the integer start of a block (or of
/// Q6_K's two halves; none for Q4_K, whose sums start at 0), `min` is Q4_K's `x_s·Σx`.
pub(in crate::kernels) struct Starts {
    first: Vec<i32>,
    second: Vec<i32>,
    min: Vec<f32>,
}

impl Starts {
    /// Where entry `at`'s sum starts in format `F` (for Q6_K, its half `half`'s); 0 for Q4_K.
    #[inline]
    pub(in crate::kernels) fn start<const F: u8>(&self, half: usize, at: usize) -> i32 {
        match (F, half) {
            (Q4K, _) => 0,
            (_, 0) => self.first[at],
            _ => self.second[at],
        }
    }

    /// Q4_K's `x_s·Σx` for entry `at`; 0 for the other formats.
    #[inline]
    pub(in crate::kernels) fn min<const F: u8>(&self, at: usize) -> f32 {
        if F == Q4K {
            self.min[at]
        } else {
            0.0
        }
    }

    /// For activation blocks `range` (row-major by row, then block).
    pub(in crate::kernels) fn new<const F: u8>(x: &ActQ8, range: std::ops::Range<usize>) -> Self {
        let sums = &x.sums[range.clone()];
        let (first, second, min) = match F {
            // The 8-bit and 5-bit values are stored offset by 128 and 16.
            EIGHT => (
                sums.iter().map(|&s| -128 * s).collect(),
                Vec::new(),
                Vec::new(),
            ),
            FIVE => (
                sums.iter().map(|&s| -16 * s).collect(),
                Vec::new(),
                Vec::new(),
            ),
            // Q4_K's values are unsigned as stored: its sums start at 0.
            Q4K => (
                Vec::new(),
                Vec::new(),
                x.scales[range.clone()]
                    .iter()
                    .zip(sums)
                    .map(|(&d, &s)| d * s as f32)
                    .collect(),
            ),
            // Q6_K's values are offset by 32 and each half of a block scaled on its own.
            _ => {
                let halves = &x.half_sums[range];
                (
                    halves.iter().map(|&h| -32 * h).collect(),
                    halves
                        .iter()
                        .zip(sums)
                        .map(|(&h, &s)| -32 * (s - h))
                        .collect(),
                    Vec::new(),
                )
            }
        };
        Starts { first, second, min }
    }
}

/// Where block `b` of panel `p` begins in `w`'s values, in format `F` (as an address: it may
/// lie past the matrix for a panel that does not exist; only reads through it need one).
#[inline]
pub(in crate::kernels) fn block_ptr<const F: u8>(w: &Q8Matrix, p: usize, b: usize) -> *const i8 {
    w.qs.as_ptr()
        .wrapping_add((p * (w.cols / QK) + b) * block_bytes(F))
}

/// Adds a block's integer sum (started at its start, for Q6_K a half block's) to a row's
/// accumulator: `acc + sum·(scale·x_s)`, and for Q4_K `− min·x_min`. The AMX kernel adds its
/// sums through this too, so the two agree bit for bit.
///
/// # Safety
/// AVX-512 F.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
pub(in crate::kernels) unsafe fn accumulate<const F: u8>(
    acc: __m512,
    sum: __m512i,
    scale: __m512,
    xs: f32,
    min: __m512,
    xmin: f32,
) -> __m512 {
    let with_q = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(sum),
        _mm512_mul_ps(scale, _mm512_set1_ps(xs)),
        acc,
    );
    if F == Q4K {
        _mm512_fnmadd_ps(min, _mm512_set1_ps(xmin), with_q)
    } else {
        with_q
    }
}

/// Block `b` of panel `p` as eight vectors of unsigned bytes, one per group of 4 values (4 of
/// each of the panel's 16 rows), rebuilt in registers from format `F`.
///
/// # Safety
/// AVX-512 F and BW; panel `p` of `w` exists.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
pub(in crate::kernels) unsafe fn unpack<const F: u8>(
    w: &Q8Matrix,
    p: usize,
    b: usize,
) -> [__m512i; QK / 4] {
    let block = block_ptr::<F>(w, p, b);
    let load = |at: *const i8| {
        // A hint only: it never faults, so an address past the matrix is harmless.
        _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH_BYTES));
        // SAFETY: callers pass addresses inside panel p's block b.
        unsafe { _mm512_loadu_si512(at as *const __m512i) }
    };
    let mut v = [_mm512_setzero_si512(); QK / 4];
    if F == EIGHT {
        for (g, v) in v.iter_mut().enumerate() {
            *v = load(block.wrapping_add(64 * g));
        }
        return v;
    }
    let nibble = _mm512_set1_epi8(0x0f);
    // Two groups per vector of nibbles: 2j in the low ones, 2j + 1 in the high ones.
    for j in 0..QK / 8 {
        let nibbles = load(block.wrapping_add(64 * j));
        let low = _mm512_and_si512(nibbles, nibble);
        let high = _mm512_and_si512(_mm512_srli_epi16::<4>(nibbles), nibble);
        (v[2 * j], v[2 * j + 1]) = match F {
            FIVE => {
                // SAFETY: the block's fifth bits follow its nibbles.
                let fifths = unsafe {
                    let bits = block.add(PANEL_BLOCK / 2 + 16 * j) as *const u64;
                    [
                        std::ptr::read_unaligned(bits),
                        std::ptr::read_unaligned(bits.add(1)),
                    ]
                };
                let sixteen = _mm512_set1_epi8(16);
                (
                    _mm512_mask_add_epi8(low, fifths[0], low, sixteen),
                    _mm512_mask_add_epi8(high, fifths[1], high, sixteen),
                )
            }
            Q6K => {
                let pairs = load(block.wrapping_add(PANEL_BLOCK / 2 + 64 * (j / 2)));
                // Groups 2j and 2j + 1 take bits 4(j mod 2) and 4(j mod 2) + 2, moved to
                // bits 4 and 5 (16-bit shifts: the mask drops what crosses between bytes).
                let (first, second) = if j % 2 == 0 {
                    (_mm512_slli_epi16::<4>(pairs), _mm512_slli_epi16::<2>(pairs))
                } else {
                    (pairs, _mm512_srli_epi16::<2>(pairs))
                };
                let bits = _mm512_set1_epi8(0x30);
                (
                    _mm512_or_si512(low, _mm512_and_si512(first, bits)),
                    _mm512_or_si512(high, _mm512_and_si512(second, bits)),
                )
            }
            _ => (low, high),
        };
    }
    v
}

/// Block `b` of panel `p`'s 16 row scales (for Q6_K, one per half of the block) and, for
/// Q4_K, its 16 minimums `dmin·m`.
///
/// # Safety
/// AVX-512 F; panel `p` of `w` exists.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
pub(in crate::kernels) unsafe fn scales<const F: u8>(
    w: &Q8Matrix,
    p: usize,
    b: usize,
) -> ([__m512; 2], __m512) {
    let (bpr, spr) = (w.cols / QK, w.cols / QK_K);
    let block = w.qs.as_ptr().wrapping_add((p * bpr + b) * block_bytes(F));
    let half = w.half_scales.as_ptr();
    let f16s = |at: *const half::f16| {
        // SAFETY: callers pass 16 scales of panel p.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(at as *const __m256i)) }
    };
    // SAFETY: panel p exists: its block's scales (and Q4_K's minimums), and its f16 scales
    // for the block or its super-block.
    unsafe {
        match F {
            Q4K => {
                let h = half.add((p * spr + b * QK / QK_K) * 2 * PANEL);
                let at = block.add(PANEL_BLOCK / 2);
                let both = _mm512_cvtepu8_epi32(_mm_loadu_si128(at as *const __m128i));
                let sc = _mm512_and_si512(both, _mm512_set1_epi32(63));
                // Each byte of the minimums' high bits twice, then lane 2i's low nibble and
                // lane 2i + 1's high one.
                let high = _mm_loadl_epi64(at.add(PANEL) as *const __m128i);
                let high = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(high, high));
                let shifts = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
                let high = _mm512_srlv_epi32(high, shifts);
                let high = _mm512_and_si512(high, _mm512_set1_epi32(0x0f));
                let mn =
                    _mm512_or_si512(_mm512_srli_epi32::<6>(both), _mm512_slli_epi32::<2>(high));
                let scale = _mm512_mul_ps(f16s(h), _mm512_cvtepi32_ps(sc));
                let min = _mm512_mul_ps(f16s(h.add(PANEL)), _mm512_cvtepi32_ps(mn));
                ([scale; 2], min)
            }
            Q6K => {
                let d = f16s(half.add((p * spr + b * QK / QK_K) * PANEL));
                let at = block.add(PANEL_BLOCK * 3 / 4);
                let sc = |h: usize| {
                    let sc = _mm_loadu_si128(at.add(h * PANEL) as *const __m128i);
                    _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)))
                };
                ([sc(0), sc(1)], _mm512_setzero_ps())
            }
            _ => (
                [f16s(half.add((p * bpr + b) * PANEL)); 2],
                _mm512_setzero_ps(),
            ),
        }
    }
}

/// Rows `m .. m + A` against panel `p`, every block: each block of the panel is rebuilt in
/// registers once and serves all `A` rows, whose values go straight from memory into the
/// multiply-adds as broadcasts. Each row's result is `Σ_b scale_w · scale_x · dot_b`, added
/// block by block in order, whatever `A` is.
///
/// # Safety
/// AVX-512 F, BW and VNNI; `w` is in format `F` and panel `p` exists; rows `m .. m + A` of
/// `x` exist, and `starts` covers rows `m0 ..` from before `m`; `out` holds
/// `x.rows × w.rows` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn panel_rows<const A: usize, const F: u8>(
    w: &Q8Matrix,
    x: &ActQ8,
    (starts, m0): (&Starts, usize),
    p: usize,
    m: usize,
    out: &mut [f32],
) {
    let (k, bpr) = (w.cols, w.cols / QK);
    // Q6_K is scaled each 16 values: its blocks are summed and scaled in two halves.
    let halves = if F == Q6K { 2 } else { 1 };
    let mut acc = [_mm512_setzero_ps(); A];
    for b in 0..bpr {
        // SAFETY: panel p exists.
        let (wv, (scale, min)) = unsafe { (unpack::<F>(w, p, b), scales::<F>(w, p, b)) };
        for a0 in (0..A).step_by(CHAINS) {
            let chains = CHAINS.min(A - a0);
            for half in 0..halves {
                let mut sum = [_mm512_setzero_si512(); CHAINS];
                for c in 0..chains {
                    let at = (m + a0 + c - m0) * bpr + b;
                    sum[c] = _mm512_set1_epi32(starts.start::<F>(half, at));
                }
                for g in half * QK / 4 / halves..(half + 1) * QK / 4 / halves {
                    for c in 0..chains {
                        let at = (m + a0 + c) * k + b * QK + 4 * g;
                        // SAFETY: row m + a0 + c < x.rows, value at + 3 < its row's end.
                        let four = unsafe {
                            std::ptr::read_unaligned(x.qs.as_ptr().add(at) as *const i32)
                        };
                        sum[c] = _mm512_dpbusd_epi32(sum[c], wv[g], _mm512_set1_epi32(four));
                    }
                }
                for c in 0..chains {
                    let a = a0 + c;
                    let at = (m + a) * bpr + b;
                    // SAFETY: row m + a < x.rows has block b's scale.
                    let xs = unsafe { *x.scales.get_unchecked(at) };
                    let xmin = starts.min::<F>(at - m0 * bpr);
                    // SAFETY: AVX-512 F, as this function's.
                    acc[a] = unsafe { accumulate::<F>(acc[a], sum[c], scale[half], xs, min, xmin) };
                }
            }
        }
    }
    let row = p * PANEL;
    // The last panel may be padding past the matrix's rows: those lanes are not stored.
    let mask = ((1u32 << (w.rows - row).min(PANEL)) - 1) as __mmask16;
    for a in 0..A {
        // SAFETY: cells (m + a, row .. row + valid) lie inside `out`.
        unsafe {
            _mm512_mask_storeu_ps(out.as_mut_ptr().add((m + a) * w.rows + row), mask, acc[a])
        };
    }
}

/// Output columns `r0..r1` (multiples of [`PANEL`], or `r1 = w.rows`) of every activation row.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub unsafe fn matmul_rows(w: &Q8Matrix, x: &ActQ8, r0: usize, r1: usize, out: &mut [f32]) {
    match w.layout {
        // SAFETY: as this function's contract.
        Layout::Panels5 => unsafe { rows::<FIVE>(w, x, r0, r1, out) },
        // SAFETY: as above.
        Layout::PanelsQ4K => unsafe { rows::<Q4K>(w, x, r0, r1, out) },
        // SAFETY: as above.
        Layout::PanelsQ6K => unsafe { rows::<Q6K>(w, x, r0, r1, out) },
        // SAFETY: as above.
        _ => unsafe { rows::<EIGHT>(w, x, r0, r1, out) },
    }
}

/// The task's panels against the activation rows, a block of rows at a time (they stay in
/// cache while the panels pass over them) and panel by panel within it: a panel (about 11 KB
/// at 640 columns in 8 bits) stays in L1 while the block's rows pass over it.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn rows<const F: u8>(w: &Q8Matrix, x: &ActQ8, r0: usize, r1: usize, out: &mut [f32]) {
    let (first, end, block) = super::task_bounds(w, x, r0, r1, out);
    let bpr = w.cols / QK;
    let mut m0 = 0;
    while m0 < x.rows {
        let m1 = (m0 + block).min(x.rows);
        let starts = Starts::new::<F>(x, m0 * bpr..m1 * bpr);
        let s = (&starts, m0);
        for p in first..end {
            let mut m = m0;
            // SAFETY (each call): panel p < end exists, rows m .. m + A <= m1 lie inside x
            // and `starts` covers them.
            while m + ROWS_AT_ONCE <= m1 {
                unsafe { panel_rows::<ROWS_AT_ONCE, F>(w, x, s, p, m, out) };
                m += ROWS_AT_ONCE;
            }
            if m + 8 <= m1 {
                unsafe { panel_rows::<8, F>(w, x, s, p, m, out) };
                m += 8;
            }
            if m + 4 <= m1 {
                unsafe { panel_rows::<4, F>(w, x, s, p, m, out) };
                m += 4;
            }
            while m < m1 {
                unsafe { panel_rows::<1, F>(w, x, s, p, m, out) };
                m += 1;
            }
        }
        m0 = m1;
    }
}

/// Block `b` of panel `p`'s integer sums for activation row `m`, as [`panel_rows`] forms them
/// (started, then summed by `vpdpbusd`): one row of 16 for each half of the block in turn (Q6_K
/// has two).
///
/// # Safety
/// AVX-512 F, BW and VNNI; panel `p` and row `m` exist.
#[cfg(test)]
pub(in crate::kernels) unsafe fn block_sums(
    w: &Q8Matrix,
    x: &ActQ8,
    (p, b): (usize, usize),
    m: usize,
) -> Vec<[i32; PANEL]> {
    // SAFETY (each): as this function's contract.
    match w.layout {
        Layout::Panels5 => unsafe { sums_of::<FIVE>(w, x, (p, b), m) },
        Layout::PanelsQ4K => unsafe { sums_of::<Q4K>(w, x, (p, b), m) },
        Layout::PanelsQ6K => unsafe { sums_of::<Q6K>(w, x, (p, b), m) },
        _ => unsafe { sums_of::<EIGHT>(w, x, (p, b), m) },
    }
}

#[cfg(test)]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn sums_of<const F: u8>(
    w: &Q8Matrix,
    x: &ActQ8,
    (p, b): (usize, usize),
    m: usize,
) -> Vec<[i32; PANEL]> {
    let (k, bpr) = (w.cols, w.cols / QK);
    let halves = if F == Q6K { 2 } else { 1 };
    let starts = Starts::new::<F>(x, m * bpr..(m + 1) * bpr);
    // SAFETY: panel p exists.
    let wv = unsafe { unpack::<F>(w, p, b) };
    (0..halves)
        .map(|half| {
            let mut sum = _mm512_set1_epi32(starts.start::<F>(half, b));
            for g in half * QK / 4 / halves..(half + 1) * QK / 4 / halves {
                // SAFETY: row m exists; its block b's group g.
                let four = unsafe {
                    std::ptr::read_unaligned(x.qs.as_ptr().add(m * k + b * QK + 4 * g) as *const i32)
                };
                sum = _mm512_dpbusd_epi32(sum, wv[g], _mm512_set1_epi32(four));
            }
            let mut lanes = [0i32; PANEL];
            // SAFETY: 16 lanes into 16 i32s.
            unsafe { _mm512_storeu_si512(lanes.as_mut_ptr().cast(), sum) };
            lanes
        })
        .collect()
}
