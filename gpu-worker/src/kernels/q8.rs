//! The signed 8-bit block layout (32 values and one f32 scale per block) for weights and
//! activations, conversion from GGUF's Q8_0 and Q5_0 blocks, and the scalar reference kernel.

use super::panels::PANEL;
use half::f16;
use std::ops::Deref;
use std::sync::Arc;

/// Values per block (GGUF's QK8_0 and QK5_0).
pub const QK: usize = 32;

/// An empty vector with room for `n` values, backed by transparent huge pages where the OS allows.
///
/// Weights are streamed from memory on every decode step; with 4 KiB pages the hardware prefetcher
/// stops at every page boundary (and the TLB misses every 4 KiB), with 2 MiB pages it does not.
/// The hint is given before the memory is first touched, so the pages are huge from the start.
pub(super) fn weight_vec<T>(n: usize) -> Vec<T> {
    let v: Vec<T> = Vec::with_capacity(n);
    advise_huge_pages(v.as_ptr() as usize, n * std::mem::size_of::<T>());
    v
}

/// Asks the OS to back the 2 MiB-aligned part of `[start, start + bytes)` with huge pages.
/// Only a hint: contents are unchanged and failure is harmless. Memory not yet touched stays
/// unbacked until first written.
pub fn advise_huge_pages(start: usize, bytes: usize) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        if bytes >= 2 * HUGE {
            let aligned = start.next_multiple_of(HUGE);
            let end = (start + bytes) & !(HUGE - 1);
            if end > aligned {
                // SAFETY: the range lies inside one live allocation; MADV_HUGEPAGE changes only how
                // the kernel backs the pages, never their contents.
                unsafe {
                    libc::madvise(
                        aligned as *mut libc::c_void,
                        end - aligned,
                        libc::MADV_HUGEPAGE,
                    );
                }
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, bytes);
}

/// A matrix's 8-bit values: its own buffer, or a range of an arena shared by many matrices (see
/// [`pack_into_arena`]).
#[derive(Clone, Debug)]
pub struct Values {
    buf: Arc<Vec<i8>>,
    start: usize,
    len: usize,
}

impl Values {
    pub(super) fn owned(v: Vec<i8>) -> Self {
        let len = v.len();
        Self {
            buf: Arc::new(v),
            start: 0,
            len,
        }
    }
}

impl Deref for Values {
    type Target = [i8];
    fn deref(&self) -> &[i8] {
        &self.buf[self.start..self.start + self.len]
    }
}

/// Moves the values of many matrices into one huge-page-backed allocation, so the small per-layer
/// matrices stream as fast as the big ones (a 1 MiB matrix alone cannot fill a 2 MiB page).
pub fn pack_into_arena(matrices: &mut [&mut Q8Matrix]) {
    let total: usize = matrices.iter().map(|m| m.qs.len()).sum();
    let mut arena = weight_vec(total);
    for m in matrices.iter() {
        arena.extend_from_slice(&m.qs);
    }
    let arena = Arc::new(arena);
    let mut at = 0;
    for m in matrices.iter_mut() {
        let len = m.qs.len();
        m.qs = Values {
            buf: arena.clone(),
            start: at,
            len,
        };
        at += len;
    }
}

/// How a [`Q8Matrix`] lays out its values and scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Row-major values (`rows × cols`) and one scale per block, row by row.
    Rows,
    /// Panels of [`PANEL`] rows, for the AVX-512 VNNI panel kernel (see [`super::panels`]).
    Panels,
    /// Panels of [`PANEL`] rows holding values in `[-16, 15]` in 5 bits (see [`super::panels`]).
    Panels5,
    /// Panels of [`PANEL`] rows holding GGUF's Q4_K as it is (see [`super::panels`]).
    PanelsQ4K,
    /// Panels of [`PANEL`] rows holding GGUF's Q6_K as it is (see [`super::panels`]).
    PanelsQ6K,
}

/// Bytes of a GGUF Q8_0 block: `f16 d, i8 qs[32]`.
pub(super) const Q8_0_BYTES: usize = 34;
/// Bytes of a GGUF Q5_0 block: `f16 d, u8 qh[4], u8 qs[16]`.
pub(super) const Q5_0_BYTES: usize = 22;

/// Decodes one GGUF block: its 32 values into the slice, its scale returned.
pub(super) type Decode = fn(&[u8], &mut [i8]) -> f32;

/// A Q8_0 block's values (`-128` read as `-127`) and scale.
pub(super) fn q8_0_block(b: &[u8], out: &mut [i8]) -> f32 {
    for (o, &v) in out.iter_mut().zip(&b[2..]) {
        *o = (v as i8).max(-127);
    }
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// A Q5_0 block's values and scale.
pub(super) fn q5_0_block(b: &[u8], out: &mut [i8]) -> f32 {
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let nib = &b[6..22];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 16 {
            nib[j] & 0x0f
        } else {
            nib[j - 16] >> 4
        };
        let high = (((qh >> j) & 1) as u8) << 4;
        *o = ((low | high) as i8) - 16;
    }
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// A weight matrix of `rows × cols` in 32-value blocks: `qs` holds the values and `scales` one
/// factor per block, kept apart so SIMD loads of values are contiguous. `layout` says in which
/// order; every constructor makes [`Layout::Rows`]. Panels keep their scales as f16 in
/// `half_scales` (every scale a constructor makes is an f16 value) and leave `scales` empty; the
/// row layout leaves `half_scales` empty.
#[derive(Clone, Debug)]
pub struct Q8Matrix {
    pub rows: usize,
    pub cols: usize,
    pub qs: Values,
    pub scales: Vec<f32>,
    pub half_scales: Vec<f16>,
    pub layout: Layout,
}

#[derive(Debug, thiserror::Error)]
#[error("{format} data for a {rows}x{cols} matrix: {reason}")]
pub struct LayoutError {
    format: &'static str,
    rows: usize,
    cols: usize,
    reason: String,
}

impl Q8Matrix {
    pub(super) fn check(
        format: &'static str,
        rows: usize,
        cols: usize,
        bytes: usize,
        block_bytes: usize,
    ) -> Result<(), LayoutError> {
        let err = |reason: String| LayoutError {
            format,
            rows,
            cols,
            reason,
        };
        if !cols.is_multiple_of(QK) {
            return Err(err(format!("width must be a multiple of {QK}")));
        }
        let want = rows * cols / QK * block_bytes;
        if bytes != want {
            return Err(err(format!("expected {want} bytes, found {bytes}")));
        }
        Ok(())
    }

    /// From GGUF Q8_0 blocks: `f16 d, i8 qs[32]` (34 bytes). Values stay in `[-127, 127]`, as
    /// the kernels need: GGUF's quantizer never writes `-128`, and one in a file is read as `-127`.
    pub fn from_q8_0(rows: usize, cols: usize, data: &[u8]) -> Result<Self, LayoutError> {
        Self::from_blocks("Q8_0", rows, cols, data, Q8_0_BYTES, q8_0_block)
    }

    /// From GGUF Q5_0 blocks: `f16 d, u8 qh[4], u8 qs[16]` (22 bytes); value `j` is the low (`j < 16`)
    /// or high nibble of `qs[j % 16]` with bit `j` of `qh` on top, minus 16.
    pub fn from_q5_0(rows: usize, cols: usize, data: &[u8]) -> Result<Self, LayoutError> {
        Self::from_blocks("Q5_0", rows, cols, data, Q5_0_BYTES, q5_0_block)
    }

    /// Converts GGUF blocks of `block_bytes` each with `decode` (values out, scale returned), in
    /// parallel: the 262k-row embedding is most of a model's load time.
    fn from_blocks(
        format: &'static str,
        rows: usize,
        cols: usize,
        data: &[u8],
        block_bytes: usize,
        decode: impl Fn(&[u8], &mut [i8]) -> f32 + Sync,
    ) -> Result<Self, LayoutError> {
        use rayon::prelude::*;
        Self::check(format, rows, cols, data.len(), block_bytes)?;
        let blocks = rows * cols / QK;
        let mut qs = weight_vec(rows * cols);
        qs.resize(rows * cols, 0i8);
        let mut scales = weight_vec(blocks);
        scales.resize(blocks, 0f32);
        const CHUNK: usize = 4096;
        qs.par_chunks_mut(CHUNK * QK)
            .zip(scales.par_chunks_mut(CHUNK))
            .zip(data.par_chunks(CHUNK * block_bytes))
            .for_each(|((q, d), src)| {
                for ((q, d), b) in q
                    .chunks_exact_mut(QK)
                    .zip(d.iter_mut())
                    .zip(src.chunks_exact(block_bytes))
                {
                    *d = decode(b, q);
                }
            });
        Ok(Self {
            rows,
            cols,
            qs: Values::owned(qs),
            scales,
            half_scales: Vec::new(),
            layout: Layout::Rows,
        })
    }

    /// Quantizes dense f32 weights (`rows × cols`, row-major) to this layout, with each block's
    /// scale an f16 value (as GGUF's own 8-bit blocks have), so the panel layout can hold it.
    pub fn quantize(rows: usize, cols: usize, w: &[f32]) -> Self {
        assert_eq!(w.len(), rows * cols);
        assert_eq!(cols % QK, 0, "width must be a multiple of {QK}");
        let mut qs = weight_vec(rows * cols);
        qs.resize(rows * cols, 0i8);
        let mut scales = weight_vec(rows * cols / QK);
        scales.resize(rows * cols / QK, 0f32);
        for (i, (src, dst)) in w.chunks_exact(QK).zip(qs.chunks_exact_mut(QK)).enumerate() {
            scales[i] = quantize_block_with(src, dst, |d| {
                let half = f16::from_f32(d).to_f32();
                if half.is_finite() && half > 0.0 {
                    half
                } else {
                    d
                }
            });
        }
        Self {
            rows,
            cols,
            qs: Values::owned(qs),
            scales,
            half_scales: Vec::new(),
            layout: Layout::Rows,
        }
    }

    /// Row `r` as f32 (embedding lookup).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        if self.layout != Layout::Rows {
            return super::panels::dequantize_row(self, r, out);
        }
        let bpr = self.cols / QK;
        let qs = &self.qs[r * self.cols..(r + 1) * self.cols];
        for (b, (q, o)) in qs
            .chunks_exact(QK)
            .zip(out.chunks_exact_mut(QK))
            .enumerate()
        {
            let d = self.scales[r * bpr + b];
            for (o, &q) in o.iter_mut().zip(q) {
                *o = d * q as f32;
            }
        }
    }

    /// The rows of several matrices of equal width and layout, stacked (one product instead of
    /// several). Panels stack only whole: each part's rows must fill its panels.
    pub fn concat_rows(parts: &[&Q8Matrix]) -> Option<Self> {
        let (cols, layout) = parts.first().map(|p| (p.cols, p.layout))?;
        if parts.iter().any(|p| p.cols != cols || p.layout != layout) {
            return None;
        }
        if layout != Layout::Rows && parts.iter().any(|p| !p.rows.is_multiple_of(PANEL)) {
            return None;
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        let mut qs = weight_vec(rows * cols);
        let mut scales = weight_vec(rows * cols / QK);
        let mut half_scales = Vec::new();
        for p in parts {
            qs.extend_from_slice(&p.qs);
            scales.extend_from_slice(&p.scales);
            half_scales.extend_from_slice(&p.half_scales);
        }
        Some(Self {
            rows,
            cols,
            qs: Values::owned(qs),
            scales,
            half_scales,
            layout,
        })
    }

    pub fn size_in_bytes(&self) -> usize {
        self.qs.len() + self.scales.len() * 4 + self.half_scales.len() * 2
    }
}

/// Symmetric round-to-nearest(-even) into `[-127, 127]`; returns the scale. Written branch-free
/// so it vectorizes: activations of every layer pass through it on every step.
fn quantize_block(src: &[f32], dst: &mut [i8]) -> f32 {
    quantize_block_with(src, dst, |d| d)
}

/// As [`quantize_block`], with the scale `amax / 127` passed through `round` first (values that
/// round past ±127 are clamped).
#[inline(always)]
fn quantize_block_with(src: &[f32], dst: &mut [i8], round: impl Fn(f32) -> f32) -> f32 {
    // Lane-wise maxima, then across lanes: a shape LLVM turns into vector max and compare
    // instructions (a running scalar maximum stays scalar).
    let mut lanes = [0f32; 16];
    for chunk in src.chunks_exact(16) {
        for (m, &v) in lanes.iter_mut().zip(chunk) {
            let a = v.abs();
            *m = if a > *m { a } else { *m };
        }
    }
    let mut amax = lanes.iter().fold(0f32, |m, &a| if a > m { a } else { m });
    for &v in src.chunks_exact(16).remainder() {
        let a = v.abs();
        amax = if a > amax { a } else { amax };
    }
    let d = round(amax / 127.0);
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (o, &v) in dst.iter_mut().zip(src) {
        // Clamped to ±127 first, so the i32 conversion saturates nowhere and the narrowing is
        // exact; through i32 it vectorizes (a saturating float-to-i8 conversion does not).
        *o = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i32 as i8;
    }
    d
}

/// Activation rows quantized to 8-bit blocks, ready for [`super::matmul_q8`].
#[derive(Clone, Debug, Default)]
pub struct ActQ8 {
    pub rows: usize,
    pub cols: usize,
    pub qs: Vec<i8>,
    pub scales: Vec<f32>,
    /// Sum of each block's values (kernels that offset the weights to unsigned correct with it).
    pub sums: Vec<i32>,
    /// Sum of each block's first 16 values (for weights scaled per 16 values, as Q6_K's).
    pub half_sums: Vec<i32>,
}

/// Quantizes `rows × cols` activations (row-major) block by block.
pub fn quantize_activations(x: &[f32], rows: usize, cols: usize) -> ActQ8 {
    let mut a = ActQ8::default();
    quantize_activations_into(x, rows, cols, &mut a);
    a
}

/// As [`quantize_activations`], reusing `a`'s buffers.
pub fn quantize_activations_into(x: &[f32], rows: usize, cols: usize, a: &mut ActQ8) {
    assert_eq!(x.len(), rows * cols);
    assert_eq!(cols % QK, 0, "width must be a multiple of {QK}");
    a.rows = rows;
    a.cols = cols;
    a.qs.resize(rows * cols, 0);
    a.scales.resize(rows * cols / QK, 0.0);
    a.sums.resize(rows * cols / QK, 0);
    a.half_sums.resize(rows * cols / QK, 0);
    let quantize =
        |x: &[f32], qs: &mut [i8], scales: &mut [f32], sums: &mut [i32], halves: &mut [i32]| {
            #[cfg(target_arch = "x86_64")]
            if super::has_avx512() {
                // SAFETY: AVX-512 F and BW were detected; the slices are whole blocks and their
                // entries (`quantize_blocks` checks).
                unsafe { super::x86::quantize512::quantize_blocks(x, qs, scales, sums, halves) };
                return;
            }
            quantize_blocks(x, qs, scales, sums, halves);
        };
    // A prefill's activations (hundreds of rows) are split across the kernel pool: quantizing
    // them on one thread left the others idle for several percent of a prefill.
    let pool = super::SpinPool::global();
    let tasks = (x.len() / PARALLEL_QUANTIZE_VALUES).min(pool.threads());
    if tasks < 2 {
        quantize(x, &mut a.qs, &mut a.scales, &mut a.sums, &mut a.half_sums);
        return;
    }
    let per = rows.div_ceil(tasks) * cols;
    let parts: Vec<_> = x
        .chunks(per)
        .zip(a.qs.chunks_mut(per))
        .zip(a.scales.chunks_mut(per / QK))
        .zip(
            a.sums
                .chunks_mut(per / QK)
                .zip(a.half_sums.chunks_mut(per / QK)),
        )
        .map(|(((x, qs), scales), (sums, halves))| {
            std::sync::Mutex::new((x, qs, scales, sums, halves))
        })
        .collect();
    pool.run(parts.len(), &|t| {
        if let Ok(mut part) = parts[t].lock() {
            let (x, qs, scales, sums, halves) = &mut *part;
            quantize(x, qs, scales, sums, halves);
        }
    });
}

/// The blocks of `x` quantized into `qs` ([`quantize_block`]), with each block's scale, the sum
/// of its values and the sum of its first half's (portable code; AVX-512 has its own, equal bit
/// for bit).
pub(super) fn quantize_blocks(
    x: &[f32],
    qs: &mut [i8],
    scales: &mut [f32],
    sums: &mut [i32],
    halves: &mut [i32],
) {
    let blocks = x.chunks_exact(QK).zip(qs.chunks_exact_mut(QK));
    let out = scales
        .iter_mut()
        .zip(sums.iter_mut().zip(halves.iter_mut()));
    for ((src, dst), (scale, (sum, half))) in blocks.zip(out) {
        *scale = quantize_block(src, dst);
        *half = dst[..QK / 2].iter().map(|&v| v as i32).sum();
        *sum = *half + dst[QK / 2..].iter().map(|&v| v as i32).sum::<i32>();
    }
}

/// Activation values from which [`quantize_activations`] splits the work across threads.
const PARALLEL_QUANTIZE_VALUES: usize = 1 << 16;

/// Reference kernel: output columns `r0..r1` of every activation row.
pub(super) fn matmul_rows_scalar(w: &Q8Matrix, x: &ActQ8, r0: usize, r1: usize, out: &mut [f32]) {
    let k = w.cols;
    let bpr = k / QK;
    for r in r0..r1 {
        let wq = &w.qs[r * k..(r + 1) * k];
        let ws = &w.scales[r * bpr..(r + 1) * bpr];
        for m in 0..x.rows {
            let xq = &x.qs[m * k..(m + 1) * k];
            let xs = &x.scales[m * bpr..(m + 1) * bpr];
            let mut acc = 0f32;
            for b in 0..bpr {
                let dot: i32 = wq[b * QK..(b + 1) * QK]
                    .iter()
                    .zip(&xq[b * QK..(b + 1) * QK])
                    .map(|(&a, &b)| a as i32 * b as i32)
                    .sum();
                acc += ws[b] * xs[b] * dot as f32;
            }
            out[m * w.rows + r] = acc;
        }
    }
}
