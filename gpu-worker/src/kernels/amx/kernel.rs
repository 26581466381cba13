//! The AMX kernel for every panel format, written once over [`Tiles`].
//!
//! A panel's block (32 values of its 16 weight rows) is tile `b` as it lies in memory for 8-bit
//! panels (8 rows of 64 bytes: 4 values of each weight row per row, unsigned); the other
//! formats are rebuilt in registers by the VNNI kernel's own code and written out as those 8
//! rows. Up to 16 activation rows' 32 signed values of the block are tile `a`, read in place
//! (row-major, `cols` bytes apart), and one `TDPBSUD` gives the 16 × 16 integer sums the VNNI
//! kernel makes with 128 `vpdpbusd`. Q6_K, scaled each 16 values, takes two products of 16
//! values per block.
//!
//! The sums are then scaled exactly as the VNNI kernel scales its own (its start, `-128·Σx` and
//! the like, then one multiply and fused add per row: [`vnni512::accumulate`]), block by block in
//! order, so every result is the VNNI kernel's bit for bit and a row's result still does not
//! depend on its batch. Products go to four sum tiles in turn (two pairs of `a` and `b` tiles): a
//! block's sums are read back two products after it was issued, so the tile unit and the vector
//! units work side by side instead of one waiting for the other.
//!
//! A thread's tile configuration is its own: each call configures the tiles on the thread it
//! runs on and releases them before it returns, so the pool may run its tasks on any thread.
//! Whole groups of 16 activation rows run with one configuration; the last few rows, if any, with
//! a second one whose `a` and `c` tiles have only those rows.

use super::tiles::{TileConfig, Tiles};
use crate::kernels::panels::vnni512::{self, Starts, EIGHT, FIVE, Q4K, Q6K};
use crate::kernels::panels::{task_bounds, PANEL};
use crate::kernels::q8::{ActQ8, Layout, Q8Matrix, QK};
use std::arch::x86_64::*;

/// Activation rows a tile product covers at most.
const ROWS: usize = 16;
/// Bytes of activations a task takes at a time (whole groups of 16 rows, at least one): fewer
/// than the VNNI kernel's 64 KiB, measured faster with `kernel_speed` (about a third of L1).
const BLOCK_BYTES: usize = 20_000;
/// How far ahead of the block being read each panel stream asks for memory (as the VNNI kernel).
const PREFETCH_BYTES: usize = 2048;
/// The tiles: two pairs of `a` (activations) and `b` (weights) used in turn, and four `c` (sums).
const A0: u8 = 0;
const B0: u8 = 1;
const A1: u8 = 2;
const B1: u8 = 3;
const C0: u8 = 4;
const C1: u8 = 5;
const C2: u8 = 6;
const C3: u8 = 7;
/// Products issued before the first one's sums are read back (at most the four sum tiles).
const LAG: usize = 2;

/// One `c` tile's sums, as `TILESTORED` writes them: 16 rows of 16 lanes.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Sums([[i32; PANEL]; ROWS]);

/// One `b` tile rebuilt from a packed format: 8 rows of 64 bytes.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Weights([u8; PANEL * QK]);

/// Values a tile product sums: a block, or half of one for Q6_K.
const fn depth(f: u8) -> usize {
    if f == Q6K {
        QK / 2
    } else {
        QK
    }
}

/// The tile shapes for products of `rows` activation rows in format `f`.
pub(super) fn config(rows: usize, f: u8) -> TileConfig {
    let k = depth(f);
    let mut c = TileConfig::new();
    for (a, b) in [(A0, B0), (A1, B1)] {
        c = c.with(a, rows, k).with(b, k / 4, 64);
    }
    for s in [C0, C1, C2, C3] {
        c = c.with(s, rows, 4 * PANEL);
    }
    c
}

/// Output columns `r0..r1` (multiples of [`PANEL`], or `r1 = w.rows`) of every activation row,
/// for a panel matrix, with the tile instructions `tiles` gives.
///
/// # Safety
/// The CPU supports AVX-512 F, BW and VNNI (the scales and sums use them).
pub unsafe fn matmul_rows<T: Tiles>(
    tiles: &mut T,
    w: &Q8Matrix,
    x: &ActQ8,
    r0: usize,
    r1: usize,
    out: &mut [f32],
) {
    // SAFETY (each): as this function's contract.
    match w.layout {
        Layout::Panels5 => unsafe { rows::<T, FIVE>(tiles, w, x, r0, r1, out) },
        Layout::PanelsQ4K => unsafe { rows::<T, Q4K>(tiles, w, x, r0, r1, out) },
        Layout::PanelsQ6K => unsafe { rows::<T, Q6K>(tiles, w, x, r0, r1, out) },
        Layout::Panels => unsafe { rows::<T, EIGHT>(tiles, w, x, r0, r1, out) },
        Layout::Rows => panic!("the AMX kernel reads panel matrices only"),
    }
}

/// The task's panels against the activation rows: whole groups of 16 rows, then the rest, a
/// block of rows at a time ([`BLOCK_BYTES`]: they stay in cache while the panels pass over them).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn rows<T: Tiles, const F: u8>(
    tiles: &mut T,
    w: &Q8Matrix,
    x: &ActQ8,
    r0: usize,
    r1: usize,
    out: &mut [f32],
) {
    let (first, end, _) = task_bounds(w, x, r0, r1, out);
    let block = (BLOCK_BYTES / w.cols).max(ROWS) / ROWS * ROWS;
    let bpr = w.cols / QK;
    let whole = x.rows - x.rows % ROWS;
    for (lo, hi) in [(0, whole), (whole, x.rows)] {
        let group = (hi - lo).min(ROWS);
        if group == 0 {
            continue;
        }
        // SAFETY: a palette-1 configuration.
        unsafe { tiles.configure(&config(group, F)) };
        let mut m0 = lo;
        while m0 < hi {
            let m1 = (m0 + block).min(hi);
            let starts = Starts::new::<F>(x, m0 * bpr..m1 * bpr);
            for p in first..end {
                for m in (m0..m1).step_by(group) {
                    let at = Group { m0, m, rows: group };
                    // SAFETY: panel p < end exists; rows m .. m + group lie inside x and
                    // `starts` covers them; the tiles are configured for `group` rows.
                    unsafe { panel_rows::<T, F>(tiles, w, x, &starts, at, p, out) };
                }
            }
            m0 = m1;
        }
    }
    tiles.release();
}

/// Which activation rows a panel's pass takes: `rows` from `m`, in a block starting at `m0`.
#[derive(Clone, Copy)]
struct Group {
    m0: usize,
    m: usize,
    rows: usize,
}

/// The activation rows of `at` against panel `p`, every block: block `b`'s product (or half
/// block's, for Q6_K) is issued, then the sums of the one [`LAG`] products before it are read
/// back and added to each row's accumulator.
///
/// # Safety
/// As [`rows`]'s loop says of its call.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn panel_rows<T: Tiles, const F: u8>(
    tiles: &mut T,
    w: &Q8Matrix,
    x: &ActQ8,
    starts: &Starts,
    at: Group,
    p: usize,
    out: &mut [f32],
) {
    let steps = w.cols / QK * (QK / depth(F));
    let mut acc = [_mm512_setzero_ps(); ROWS];
    let mut sums = Sums([[0; PANEL]; ROWS]);
    let mut rebuilt = [Weights([0; PANEL * QK]); 2];
    for step in 0..steps + LAG {
        // SAFETY (both): as this function's contract.
        if step < steps {
            unsafe { issue::<T, F>(tiles, w, x, at.m, p, step, &mut rebuilt) };
        }
        if step >= LAG {
            unsafe { finish::<T, F>(tiles, w, x, starts, at, p, step - LAG, &mut sums, &mut acc) };
        }
    }
    let row = p * PANEL;
    // The last panel may be padding past the matrix's rows: those lanes are not stored.
    let mask = ((1u32 << (w.rows - row).min(PANEL)) - 1) as __mmask16;
    for (a, acc) in acc.iter().enumerate() {
        if a < at.rows {
            // SAFETY: cells (m + a, row .. row + valid) lie inside `out`.
            unsafe {
                _mm512_mask_storeu_ps(out.as_mut_ptr().add((at.m + a) * w.rows + row), mask, *acc)
            };
        }
    }
}

/// Issues step `step`'s product (block `step / halves`, its half `step % halves`) on pair
/// `step % 2` of `a` and `b` tiles into sum tile `step % 4`, for the activation rows from `m` and
/// panel `p`. Formats other than 8-bit are rebuilt in registers into `rebuilt[step % 2]` first.
///
/// # Safety
/// The tiles are configured (for as many rows as lie from `m` in `x`); panel `p` exists.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn issue<T: Tiles, const F: u8>(
    tiles: &mut T,
    w: &Q8Matrix,
    x: &ActQ8,
    m: usize,
    p: usize,
    step: usize,
    rebuilt: &mut [Weights; 2],
) {
    let halves = QK / depth(F);
    let (b, half, set) = (step / halves, step % halves, step % 2);
    let k = w.cols;
    // SAFETY: the rows from m exist, each with `depth(F)` values from this offset.
    let a = unsafe { x.qs.as_ptr().add(m * k + b * QK + half * depth(F)) }.cast::<u8>();
    let weights = if F == EIGHT {
        let block = vnni512::block_ptr::<F>(w, p, b);
        // A hint only, as the VNNI kernel's: the panel stream ahead of this block.
        for g in 0..QK / 4 {
            _mm_prefetch::<_MM_HINT_T0>(block.wrapping_add(PREFETCH_BYTES + 64 * g));
        }
        block.cast::<u8>()
    } else {
        // SAFETY: panel p exists.
        let wv = unsafe { vnni512::unpack::<F>(w, p, b) };
        let groups = depth(F) / 4;
        for (g, v) in wv[half * groups..(half + 1) * groups].iter().enumerate() {
            // SAFETY: row g of the 8 in `rebuilt[set]`, 64-byte aligned.
            unsafe { _mm512_store_si512(rebuilt[set].0.as_mut_ptr().add(64 * g).cast(), *v) };
        }
        rebuilt[set].0.as_ptr()
    };
    // SAFETY: the tiles are configured; `a` has the group's rows `k` bytes apart, `weights` the
    // block's 64-byte rows.
    unsafe {
        match step % 4 {
            0 => product::<T, A0, B0, C0>(tiles, a, k, weights),
            1 => product::<T, A1, B1, C1>(tiles, a, k, weights),
            2 => product::<T, A0, B0, C2>(tiles, a, k, weights),
            _ => product::<T, A1, B1, C3>(tiles, a, k, weights),
        }
    }
}

/// `c = a · b` on one set of tiles, `a` read `stride` bytes a row and `b` 64.
///
/// # Safety
/// The tiles are configured; `a` and `b` hold their tiles' rows.
#[inline(always)]
unsafe fn product<T: Tiles, const A: u8, const B: u8, const C: u8>(
    tiles: &mut T,
    a: *const u8,
    stride: usize,
    b: *const u8,
) {
    // SAFETY: as this function's contract.
    unsafe {
        tiles.load::<A>(a, stride);
        tiles.load::<B>(b, 64);
        tiles.zero::<C>();
        tiles.dot::<C, A, B>();
    }
}

/// Stores step `step`'s sum tile into `sums`.
///
/// # Safety
/// The tiles are configured.
#[inline(always)]
unsafe fn read_sums<T: Tiles>(tiles: &mut T, step: usize, sums: &mut Sums) {
    let dst = sums.0.as_mut_ptr().cast::<u8>();
    // SAFETY: as this function's contract; `sums` has 16 rows of 64 bytes.
    unsafe {
        match step % 4 {
            0 => tiles.store::<C0>(dst, 64),
            1 => tiles.store::<C1>(dst, 64),
            2 => tiles.store::<C2>(dst, 64),
            _ => tiles.store::<C3>(dst, 64),
        }
    }
}

/// Reads step `step`'s sums (block `step / halves`, its half `step % halves`) back and adds
/// them, scaled, to each row's accumulator, as the VNNI kernel adds its own.
///
/// # Safety
/// As [`panel_rows`]; the step's product was issued.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
#[allow(clippy::too_many_arguments)] // One kernel step's state; a struct would only rename it.
unsafe fn finish<T: Tiles, const F: u8>(
    tiles: &mut T,
    w: &Q8Matrix,
    x: &ActQ8,
    starts: &Starts,
    at: Group,
    p: usize,
    step: usize,
    sums: &mut Sums,
    acc: &mut [__m512; ROWS],
) {
    let halves = QK / depth(F);
    let (b, half) = (step / halves, step % halves);
    let bpr = w.cols / QK;
    // SAFETY: the tiles are configured.
    unsafe { read_sums(tiles, step, sums) };
    // SAFETY: panel p exists.
    let (scale, min) = unsafe { vnni512::scales::<F>(w, p, b) };
    // Each of the 16 rows spelled out with a constant index, so the accumulators stay in
    // registers; rows past the group's are skipped.
    macro_rules! row {
        ($($a:literal)*) => {$(
            if $a < at.rows {
                let row = (at.m + $a) * bpr + b;
                let start = starts.start::<F>(half, row - at.m0 * bpr);
                let xmin = starts.min::<F>(row - at.m0 * bpr);
                // SAFETY: row m + a < x.rows has block b's scale; `sums` has its row.
                unsafe {
                    let xs = *x.scales.get_unchecked(row);
                    let sum = _mm512_load_si512(sums.0[$a].as_ptr().cast());
                    let sum = _mm512_add_epi32(sum, _mm512_set1_epi32(start));
                    acc[$a] = vnni512::accumulate::<F>(acc[$a], sum, scale[half], xs, min, xmin);
                }
            }
        )*};
    }
    row!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
}

/// Block `b` of panel `p`'s integer sums for the `rows` activation rows from `m`, each started as
/// the VNNI kernel starts its own: one row of 16 per activation row, for each half of the block
/// in turn (Q6_K has two). Configures and releases the tiles itself.
///
/// # Safety
/// The CPU supports AVX-512 F, BW and VNNI; panel `p` and the rows exist.
#[cfg(test)]
pub(super) unsafe fn block_sums<T: Tiles>(
    tiles: &mut T,
    w: &Q8Matrix,
    x: &ActQ8,
    (p, b): (usize, usize),
    (m, rows): (usize, usize),
) -> Vec<[i32; PANEL]> {
    // SAFETY (each): as this function's contract.
    match w.layout {
        Layout::Panels5 => unsafe { sums_of::<T, FIVE>(tiles, w, x, (p, b), (m, rows)) },
        Layout::PanelsQ4K => unsafe { sums_of::<T, Q4K>(tiles, w, x, (p, b), (m, rows)) },
        Layout::PanelsQ6K => unsafe { sums_of::<T, Q6K>(tiles, w, x, (p, b), (m, rows)) },
        Layout::Panels => unsafe { sums_of::<T, EIGHT>(tiles, w, x, (p, b), (m, rows)) },
        Layout::Rows => panic!("the AMX kernel reads panel matrices only"),
    }
}

#[cfg(test)]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn sums_of<T: Tiles, const F: u8>(
    tiles: &mut T,
    w: &Q8Matrix,
    x: &ActQ8,
    (p, b): (usize, usize),
    (m, rows): (usize, usize),
) -> Vec<[i32; PANEL]> {
    let (halves, bpr) = (QK / depth(F), w.cols / QK);
    let starts = Starts::new::<F>(x, m * bpr..(m + rows) * bpr);
    let mut rebuilt = [Weights([0; PANEL * QK]); 2];
    let mut all = Vec::new();
    // SAFETY: a palette-1 configuration; then as this function's contract.
    unsafe { tiles.configure(&config(rows, F)) };
    for half in 0..halves {
        let step = b * halves + half;
        let mut sums = Sums([[0; PANEL]; ROWS]);
        // SAFETY: as above.
        unsafe {
            issue::<T, F>(tiles, w, x, m, p, step, &mut rebuilt);
            read_sums(tiles, step, &mut sums);
        }
        for (a, row) in sums.0.iter().enumerate().take(rows) {
            let start = starts.start::<F>(half, a * bpr + b);
            all.push(row.map(|s| s.wrapping_add(start)));
        }
    }
    tiles.release();
    all
}
