//! The panel layout and its AVX-512 VNNI kernel: batched products that spend their vector
//! operations on multiply-adds rather than on scales.
//!
//! In the row layout one `vpdpbusd` covers 64 values of one weight row (two blocks), and applying
//! the two blocks' scales costs three more operations (convert, multiply, fused add): four vector
//! operations per 64 multiply-adds, whatever the batch. Here one vector holds 4 values of each of
//! 16 weight rows and the activation's 4 values are broadcast, so 8 `vpdpbusd` cover one block of
//! 16 rows and one convert, multiply and fused add apply that block's 16 row scales at once:
//! 11 operations per 512 multiply-adds, about 1.4 per 64.
//!
//! Layout: rows are grouped in panels of [`PANEL`] (the last padded with zero weights and zero
//! scales). Panel `p`, block `b`, group `g` (values `4g..4g + 4` of the block) is 64 bytes: 4 bytes
//! for each of the panel's 16 rows in turn. Values are stored flipped to unsigned (`w + 128`), as
//! `vpdpbusd` takes them; the `128·Σx` this adds is removed by starting each block's sum at
//! `-128·Σx`. Scales: 16 per panel and block, as f16 (GGUF's own 8-bit blocks store them so; the
//! row layout's f32 would add 2 bytes per 32 values to every decoded token's reads), at
//! `(p · blocks + b) · 16 + row`. A panel's bytes are contiguous, so a task reads its weights as
//! one sequential stream.
//!
//! Each output is `Σ_b scale_w · scale_x · dot_b`, summed block by block in order, so a row's result
//! does not depend on which other rows share its tile or its batch.
//!
//! The AVX-512 kernel goes panel by panel: each block of the panel is rebuilt in registers once
//! (eight vectors of bytes, whatever the format) and serves up to 16 activation rows, whose 4
//! values go from memory straight into the `vpdpbusd` as broadcasts. A panel (11 KB at 640 columns
//! in 8 bits) stays in L1 while the rows pass over it, and is read from memory once per batch. An
//! earlier kernel kept tiles of 2 panels × 4 rows in registers with the broadcasts beside them: it
//! ran out of registers, re-read each panel once per 4 rows and unpacked it as often, and reached
//! about half the multiply-add rate.
//!
//! **Five-bit panels** ([`Layout::Panels5`]) hold matrices whose values all lie in `[-16, 15]`
//! (GGUF's Q5_0, widened at load) in 5 bits plus the f16 scale, as the file does, instead of 8:
//! the decode step reads fewer bytes. A panel's block is 320 bytes: four 64-byte vectors of
//! nibbles (vector `j` holds group `2j` in its low nibbles and group `2j + 1` in its high ones,
//! each value stored as `v + 16`), then eight 64-bit masks with each value's fifth bit, one per
//! group. The kernel rebuilds the bytes in registers (two ANDs, a shift and two masked adds per
//! two groups) and corrects with `-16·Σx`. The integer sums are the 8-bit panels' exactly, so the
//! results are the same.
//!
//! **Q4_K panels** ([`Layout::PanelsQ4K`]) hold GGUF's Q4_K matrices as they are: each weight is
//! `d·sc·q − dmin·m` with `q` in `[0, 15]`, 6-bit `sc` and `m` per 32 values and f16 `d`, `dmin`
//! per 256. A panel's block is 280 bytes: the four nibble vectors as above (values stored as `q`),
//! then the 16 rows' `sc` with `m`'s low 2 bits in each byte's top ones, then `m`'s high 4 bits
//! (lane `2i` in byte `i`'s low nibble, lane `2i + 1` in its high one). `half_scales` holds each
//! panel's `d` (16) then `dmin` (16) per 256 values. A block adds `d·sc·x_s·Σqx − dmin·m·x_s·Σx`:
//! the unsigned `q` goes into `vpdpbusd` as is, and the minimum takes one more fused multiply-add.
//! 4.5 bits a weight, as the file holds them (8.5 re-quantized to 8-bit blocks).
//!
//! **Q6_K panels** ([`Layout::PanelsQ6K`]) hold GGUF's Q6_K matrices as they are: each weight is
//! `d·sc·(q − 32)` with `q` in `[0, 63]`, a signed 8-bit `sc` per 16 values and an f16 `d` per 256.
//! A panel's block is 416 bytes: the four nibble vectors of `q`'s low 4 bits as above, two 64-byte
//! vectors of its high 2 bits (vector `h` holds groups `4h .. 4h + 4`, group `g` in bits
//! `2·(g mod 4)` of each byte), then the 16 rows' `sc` for the block's first 16 values and for its
//! last 16. `half_scales` holds each panel's 16 `d` per 256 values. Each half of a block is summed
//! and scaled on its own, starting at `-32·Σx` over its 16 values (the activations' `half_sums`):
//! 6.5625 bits a weight, as the file holds them.

use super::q8::{weight_vec, ActQ8, Layout, Q8Matrix, Values, QK};
use half::f16;

/// Weight rows per panel: one 512-bit vector of 32-bit sums.
pub const PANEL: usize = 16;

/// Bytes of one panel's block: [`PANEL`] rows × [`QK`] values.
pub(super) const PANEL_BLOCK: usize = PANEL * QK;
/// Bytes of one five-bit panel's block: 256 of nibbles, 64 of fifth bits.
pub(super) const PANEL_BLOCK5: usize = PANEL_BLOCK / 2 + PANEL_BLOCK / 8;
/// Bytes of one Q4_K panel's block: 256 of nibbles, then 16 scales and 16 minimums in 6 bits each.
pub(super) const PANEL_BLOCK4: usize = PANEL_BLOCK / 2 + 3 * PANEL / 2;
/// Bytes of one Q6_K panel's block: 256 of low nibbles, 128 of high bit pairs, 2 × 16 scales.
pub(super) const PANEL_BLOCK6: usize = PANEL_BLOCK / 2 + PANEL_BLOCK / 4 + 2 * PANEL;
/// Bytes per Q6_K super-block in a GGUF file: `u8 ql[128], u8 qh[64], i8 scales[16], f16 d`.
const Q6K_BYTES: usize = 210;
/// Values per k-quant super-block (one `d`, and Q4_K's one `dmin`).
pub const QK_K: usize = 256;
/// Bytes per Q4_K super-block in a GGUF file: `f16 d, f16 dmin, u8 scales[12], u8 qs[128]`.
const Q4K_BYTES: usize = 144;

/// Sub-block `j`'s 6-bit scale and minimum from a Q4_K super-block's 12 packed bytes.
fn q4k_scale_min(j: usize, packed: &[u8]) -> (u8, u8) {
    if j < 4 {
        (packed[j] & 63, packed[j + 4] & 63)
    } else {
        (
            (packed[j + 4] & 0x0f) | ((packed[j - 4] >> 6) << 4),
            (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4),
        )
    }
}

/// A GGUF Q4_K matrix (`rows × cols`, `cols` a multiple of 256) in Q4_K panels.
pub fn from_q4_k(rows: usize, cols: usize, data: &[u8]) -> Result<Q8Matrix, String> {
    use rayon::prelude::*;
    if !cols.is_multiple_of(QK_K) {
        return Err(format!("width must be a multiple of {QK_K}"));
    }
    let (spr, bpr) = (cols / QK_K, cols / QK);
    let want = rows * spr * Q4K_BYTES;
    if data.len() != want {
        return Err(format!("expected {want} bytes, found {}", data.len()));
    }
    let panels = rows.div_ceil(PANEL);
    let mut qs = weight_vec(panels * bpr * PANEL_BLOCK4);
    qs.resize(panels * bpr * PANEL_BLOCK4, 0i8);
    let mut half = weight_vec(panels * spr * 2 * PANEL);
    half.resize(panels * spr * 2 * PANEL, f16::ZERO);
    qs.par_chunks_mut(bpr * PANEL_BLOCK4)
        .zip(half.par_chunks_mut(spr * 2 * PANEL))
        .enumerate()
        .for_each(|(p, (q, h))| {
            for lane in 0..PANEL.min(rows - p * PANEL) {
                let row = &data[(p * PANEL + lane) * spr * Q4K_BYTES..][..spr * Q4K_BYTES];
                for (sb, block) in row.chunks_exact(Q4K_BYTES).enumerate() {
                    h[sb * 2 * PANEL + lane] = f16::from_le_bytes([block[0], block[1]]);
                    h[sb * 2 * PANEL + PANEL + lane] = f16::from_le_bytes([block[2], block[3]]);
                    let (packed, nibbles) = (&block[4..16], &block[16..144]);
                    for j in 0..QK_K / QK {
                        let out = &mut q[(sb * (QK_K / QK) + j) * PANEL_BLOCK4..][..PANEL_BLOCK4];
                        let (sc, m) = q4k_scale_min(j, packed);
                        // The scale and the minimum's low 2 bits, then its high 4 in nibbles.
                        out[PANEL_BLOCK / 2 + lane] = (sc | (m & 3) << 6) as i8;
                        let at = PANEL_BLOCK / 2 + PANEL + lane / 2;
                        out[at] = (out[at] as u8 | (m >> 2) << (4 * (lane % 2))) as i8;
                        // Sub-block j: low (even j) or high nibbles of bytes 32·(j/2) ...
                        for i in 0..QK {
                            let byte = nibbles[32 * (j / 2) + i];
                            let v = if j % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                            let (g, t) = (i / 4, lane * 4 + i % 4);
                            let at = (g / 2) * 64 + t;
                            out[at] = (out[at] as u8 | v << (4 * (g % 2))) as i8;
                        }
                    }
                }
            }
        });
    Ok(Q8Matrix {
        rows,
        cols,
        qs: Values::owned(qs),
        scales: Vec::new(),
        half_scales: half,
        layout: Layout::PanelsQ4K,
    })
}

/// Value `i` of a GGUF Q6_K super-block, unsigned (`q` in `[0, 63]`; the weight is
/// `d·sc·(q − 32)`). Each 128-value half keeps low nibbles in 64 bytes `ql` and high bit pairs in
/// 32 bytes `qh`; its quarter `k` takes byte `l + 32·(k mod 2)` of `ql` (low nibble for `k < 2`)
/// and bits `2k` of `qh[l]`.
fn q6k_value(block: &[u8], i: usize) -> u8 {
    let (half, quarter, l) = (i / 128, i % 128 / 32, i % 32);
    let byte = block[64 * half + 32 * (quarter % 2) + l];
    let low = if quarter < 2 { byte & 0x0f } else { byte >> 4 };
    let high = (block[128 + 32 * half + l] >> (2 * quarter)) & 3;
    low | high << 4
}

/// A GGUF Q6_K matrix (`rows × cols`, `cols` a multiple of 256) in Q6_K panels.
pub fn from_q6_k(rows: usize, cols: usize, data: &[u8]) -> Result<Q8Matrix, String> {
    use rayon::prelude::*;
    if !cols.is_multiple_of(QK_K) {
        return Err(format!("width must be a multiple of {QK_K}"));
    }
    let (spr, bpr) = (cols / QK_K, cols / QK);
    let want = rows * spr * Q6K_BYTES;
    if data.len() != want {
        return Err(format!("expected {want} bytes, found {}", data.len()));
    }
    let panels = rows.div_ceil(PANEL);
    let mut qs = weight_vec(panels * bpr * PANEL_BLOCK6);
    qs.resize(panels * bpr * PANEL_BLOCK6, 0i8);
    let mut half = weight_vec(panels * spr * PANEL);
    half.resize(panels * spr * PANEL, f16::ZERO);
    qs.par_chunks_mut(bpr * PANEL_BLOCK6)
        .zip(half.par_chunks_mut(spr * PANEL))
        .enumerate()
        .for_each(|(p, (q, h))| {
            for lane in 0..PANEL.min(rows - p * PANEL) {
                let row = &data[(p * PANEL + lane) * spr * Q6K_BYTES..][..spr * Q6K_BYTES];
                for (sb, block) in row.chunks_exact(Q6K_BYTES).enumerate() {
                    h[sb * PANEL + lane] = f16::from_le_bytes([block[208], block[209]]);
                    for j in 0..QK_K / QK {
                        let out = &mut q[(sb * (QK_K / QK) + j) * PANEL_BLOCK6..][..PANEL_BLOCK6];
                        for half in 0..2 {
                            out[PANEL_BLOCK * 3 / 4 + half * PANEL + lane] =
                                block[192 + 2 * j + half] as i8;
                        }
                        for i in 0..QK {
                            let v = q6k_value(block, j * QK + i);
                            let (g, t) = (i / 4, lane * 4 + i % 4);
                            let at = (g / 2) * 64 + t;
                            out[at] = (out[at] as u8 | (v & 0x0f) << (4 * (g % 2))) as i8;
                            let at = PANEL_BLOCK / 2 + (g / 4) * 64 + t;
                            out[at] = (out[at] as u8 | (v >> 4) << (2 * (g % 4))) as i8;
                        }
                    }
                }
            }
        });
    Ok(Q8Matrix {
        rows,
        cols,
        qs: Values::owned(qs),
        scales: Vec::new(),
        half_scales: half,
        layout: Layout::PanelsQ6K,
    })
}

/// A Q6_K panel matrix's `(q − 32, d·sc)` for value `c` of row `r`.
fn q6k_parts(m: &Q8Matrix, r: usize, c: usize) -> (i32, f32) {
    let (p, lane, b, i) = (r / PANEL, r % PANEL, c / QK, c % QK);
    let (bpr, spr) = (m.cols / QK, m.cols / QK_K);
    let at = (p * bpr + b) * PANEL_BLOCK6;
    let (g, t) = (i / 4, lane * 4 + i % 4);
    let low = (m.qs[at + (g / 2) * 64 + t] as u8 >> (4 * (g % 2))) & 0x0f;
    let high = (m.qs[at + PANEL_BLOCK / 2 + (g / 4) * 64 + t] as u8 >> (2 * (g % 4))) & 3;
    let sc = m.qs[at + PANEL_BLOCK * 3 / 4 + (i / 16) * PANEL + lane];
    let d = m.half_scales[(p * spr + c / QK_K) * PANEL + lane].to_f32();
    ((low | high << 4) as i32 - 32, d * sc as f32)
}

/// A Q4_K panel matrix's `(q, d·sc, dmin·m)` for value `c` of row `r`.
fn q4k_parts(m: &Q8Matrix, r: usize, c: usize) -> (u8, f32, f32) {
    let (p, lane, b, i) = (r / PANEL, r % PANEL, c / QK, c % QK);
    let (bpr, spr) = (m.cols / QK, m.cols / QK_K);
    let at = (p * bpr + b) * PANEL_BLOCK4;
    let (g, t) = (i / 4, lane * 4 + i % 4);
    let byte = m.qs[at + (g / 2) * 64 + t] as u8;
    let q = if g % 2 == 0 { byte & 0x0f } else { byte >> 4 };
    let both = m.qs[at + PANEL_BLOCK / 2 + lane] as u8;
    let high = (m.qs[at + PANEL_BLOCK / 2 + PANEL + lane / 2] as u8 >> (4 * (lane % 2))) & 0x0f;
    let (sc, mn) = (both & 63, both >> 6 | high << 2);
    let h = (p * spr + c / QK_K) * 2 * PANEL;
    let d = m.half_scales[h + lane].to_f32();
    let dmin = m.half_scales[h + PANEL + lane].to_f32();
    (q, d * sc as f32, dmin * mn as f32)
}

/// `m` (row layout) in the panel layout; `None` when a scale is not an f16 value (no constructor
/// makes one), as the panels could not hold it exactly.
pub fn to_panels(m: &Q8Matrix) -> Option<Q8Matrix> {
    assert_eq!(m.layout, Layout::Rows, "already in panels");
    if m.scales.iter().any(|&d| f16::from_f32(d).to_f32() != d) {
        return None;
    }
    let (k, bpr) = (m.cols, m.cols / QK);
    Some(fill_panels(m.rows, m.cols, |r, b, out| {
        out.copy_from_slice(&m.qs[r * k + b * QK..r * k + (b + 1) * QK]);
        m.scales[r * bpr + b]
    }))
}

/// GGUF blocks of `block_bytes` each (`decode` gives a block's 32 values and its f16 scale)
/// straight into the panel layout: what [`to_panels`] makes of the row layout, without that
/// copy in between. For the 262k-row embedding the row copy was the load's largest allocation.
pub(super) fn panels_from_blocks(
    rows: usize,
    cols: usize,
    data: &[u8],
    block_bytes: usize,
    decode: impl Fn(&[u8], &mut [i8]) -> f32 + Sync,
) -> Q8Matrix {
    let bpr = cols / QK;
    fill_panels(rows, cols, |r, b, out| {
        let at = (r * bpr + b) * block_bytes;
        decode(&data[at..at + block_bytes], out)
    })
}

/// An 8-bit panel matrix of `rows × cols` whose block `b` of row `r` is what `block` writes
/// (its 32 values) and returns (its scale, an f16 value); the last panel's missing rows are
/// zero weights with zero scales.
fn fill_panels(
    rows: usize,
    cols: usize,
    block: impl Fn(usize, usize, &mut [i8]) -> f32 + Sync,
) -> Q8Matrix {
    use rayon::prelude::*;
    let (k, bpr) = (cols, cols / QK);
    let panels = rows.div_ceil(PANEL);
    let mut qs = weight_vec(panels * PANEL * k);
    qs.resize(panels * PANEL * k, 0i8);
    let mut scales = weight_vec(panels * PANEL * bpr);
    scales.resize(panels * PANEL * bpr, f16::ZERO);
    qs.par_chunks_mut(PANEL * k)
        .zip(scales.par_chunks_mut(PANEL * bpr))
        .enumerate()
        .for_each(|(p, (q, s))| {
            let mut value = [0i8; QK];
            for lane in 0..PANEL {
                let r = p * PANEL + lane;
                for b in 0..bpr {
                    let scale = if r < rows {
                        block(r, b, &mut value)
                    } else {
                        value = [0; QK];
                        0.0
                    };
                    s[b * PANEL + lane] = f16::from_f32(scale);
                    for (g, four) in value.chunks_exact(4).enumerate() {
                        let at = b * PANEL_BLOCK + g * 4 * PANEL + lane * 4;
                        for (o, &v) in q[at..at + 4].iter_mut().zip(four) {
                            *o = (v as u8 ^ 0x80) as i8;
                        }
                    }
                }
            }
        });
    Q8Matrix {
        rows,
        cols,
        qs: Values::owned(qs),
        scales: Vec::new(),
        half_scales: scales,
        layout: Layout::Panels,
    }
}

/// Value `c` of row `r`, and its block's scale.
fn value(m: &Q8Matrix, r: usize, c: usize) -> (i8, f32) {
    let (p, lane, b, i) = (r / PANEL, r % PANEL, c / QK, c % QK);
    let bpr = m.cols / QK;
    let scale = m.half_scales[(p * bpr + b) * PANEL + lane].to_f32();
    // Byte `t` of group `g`'s 64: lane `lane`, value `i % 4`.
    let (g, t) = (i / 4, lane * 4 + i % 4);
    if m.layout == Layout::Panels5 {
        let at = (p * bpr + b) * PANEL_BLOCK5;
        let nibbles = m.qs[at + (g / 2) * 64 + t] as u8;
        let low = if g % 2 == 0 {
            nibbles & 0x0f
        } else {
            nibbles >> 4
        };
        let fifth = (m.qs[at + PANEL_BLOCK / 2 + g * 8 + t / 8] as u8 >> (t % 8)) & 1;
        return ((low | fifth << 4) as i8 - 16, scale);
    }
    let at = (p * bpr + b) * PANEL_BLOCK + g * 4 * PANEL + t;
    ((m.qs[at] as u8 ^ 0x80) as i8, scale)
}

/// `m` (8-bit panels) in five-bit panels, when every value lies in `[-16, 15]`; else `None`.
pub fn to_five_bit(m: &Q8Matrix) -> Option<Q8Matrix> {
    use rayon::prelude::*;
    let fits = |v: &i8| (-16..16).contains(&((*v as u8 ^ 0x80) as i8));
    if m.layout != Layout::Panels || !m.qs.par_iter().all(fits) {
        return None;
    }
    let blocks = m.qs.len() / PANEL_BLOCK;
    let mut qs = weight_vec(blocks * PANEL_BLOCK5);
    qs.resize(blocks * PANEL_BLOCK5, 0i8);
    qs.par_chunks_mut(PANEL_BLOCK5)
        .zip(m.qs.par_chunks(PANEL_BLOCK))
        .for_each(|(dst, src)| {
            for (g, group) in src.chunks_exact(4 * PANEL).enumerate() {
                for (t, &v) in group.iter().enumerate() {
                    let q = ((v as u8 ^ 0x80) as i8 + 16) as u8;
                    let at = (g / 2) * 64 + t;
                    dst[at] = (dst[at] as u8 | (q & 0x0f) << (4 * (g % 2))) as i8;
                    let bit = PANEL_BLOCK / 2 + g * 8 + t / 8;
                    dst[bit] = (dst[bit] as u8 | (q >> 4) << (t % 8)) as i8;
                }
            }
        });
    Some(Q8Matrix {
        rows: m.rows,
        cols: m.cols,
        qs: Values::owned(qs),
        scales: Vec::new(),
        half_scales: m.half_scales.clone(),
        layout: Layout::Panels5,
    })
}

/// Row `r` as f32 (the embedding lookup of a panel matrix).
pub fn dequantize_row(m: &Q8Matrix, r: usize, out: &mut [f32]) {
    if m.layout == Layout::PanelsQ6K {
        for (c, o) in out[..m.cols].iter_mut().enumerate() {
            let (q, scale) = q6k_parts(m, r, c);
            *o = scale * q as f32;
        }
        return;
    }
    if m.layout == Layout::PanelsQ4K {
        for (c, o) in out[..m.cols].iter_mut().enumerate() {
            let (q, scale, min) = q4k_parts(m, r, c);
            *o = scale * q as f32 - min;
        }
        return;
    }
    if m.layout == Layout::Panels5 {
        for (c, o) in out[..m.cols].iter_mut().enumerate() {
            let (v, d) = value(m, r, c);
            *o = d * v as f32;
        }
        return;
    }
    let (p, lane, bpr) = (r / PANEL, r % PANEL, m.cols / QK);
    for (b, o) in out[..m.cols].chunks_exact_mut(QK).enumerate() {
        let d = m.half_scales[(p * bpr + b) * PANEL + lane].to_f32();
        let base = (p * bpr + b) * PANEL_BLOCK + lane * 4;
        for (g, four) in o.chunks_exact_mut(4).enumerate() {
            let at = base + g * 4 * PANEL;
            for (o, &v) in four.iter_mut().zip(&m.qs[at..at + 4]) {
                *o = d * ((v as u8 ^ 0x80) as i8) as f32;
            }
        }
    }
}

/// Reference kernel for the panel layout: output columns `r0..r1` of every activation row.
pub(super) fn matmul_rows_scalar(w: &Q8Matrix, x: &ActQ8, r0: usize, r1: usize, out: &mut [f32]) {
    let (k, bpr) = (w.cols, w.cols / QK);
    if w.layout == Layout::PanelsQ6K {
        for r in r0..r1 {
            for m in 0..x.rows {
                let mut acc = 0f32;
                for b in 0..bpr {
                    for half in 0..2 {
                        let (mut dot, mut scale) = (0i32, 0.0);
                        for i in half * QK / 2..(half + 1) * QK / 2 {
                            let q;
                            (q, scale) = q6k_parts(w, r, b * QK + i);
                            dot += q * x.qs[m * k + b * QK + i] as i32;
                        }
                        acc = (dot as f32).mul_add(scale * x.scales[m * bpr + b], acc);
                    }
                }
                out[m * w.rows + r] = acc;
            }
        }
        return;
    }
    if w.layout == Layout::PanelsQ4K {
        for r in r0..r1 {
            for m in 0..x.rows {
                let mut acc = 0f32;
                for b in 0..bpr {
                    let (mut dot, mut scale, mut min) = (0i32, 0.0, 0.0);
                    for i in 0..QK {
                        let q;
                        (q, scale, min) = q4k_parts(w, r, b * QK + i);
                        dot += q as i32 * x.qs[m * k + b * QK + i] as i32;
                    }
                    let xs = x.scales[m * bpr + b];
                    acc = (dot as f32).mul_add(scale * xs, acc);
                    acc = (-min).mul_add(xs * x.sums[m * bpr + b] as f32, acc);
                }
                out[m * w.rows + r] = acc;
            }
        }
        return;
    }
    for r in r0..r1 {
        for m in 0..x.rows {
            let mut acc = 0f32;
            for b in 0..bpr {
                let mut dot = 0i32;
                let mut ws = 0.0;
                for i in 0..QK {
                    let (v, d) = value(w, r, b * QK + i);
                    dot += v as i32 * x.qs[m * k + b * QK + i] as i32;
                    ws = d;
                }
                acc = (dot as f32).mul_add(ws * x.scales[m * bpr + b], acc);
            }
            out[m * w.rows + r] = acc;
        }
    }
}

/// Checks a panel kernel's arguments, and returns its first and past-the-end panels and how
/// many activation rows to take at a time (about 64 KiB of them, so they stay in cache while the
/// task's panels pass over them).
pub(in crate::kernels) fn task_bounds(
    w: &Q8Matrix,
    x: &ActQ8,
    r0: usize,
    r1: usize,
    out: &[f32],
) -> (usize, usize, usize) {
    assert!(r1 <= w.rows && w.cols == x.cols && w.cols.is_multiple_of(QK));
    assert!(r0.is_multiple_of(PANEL), "a task must start at a panel");
    assert!(out.len() >= x.rows * w.rows);
    assert_eq!(
        x.sums.len(),
        x.scales.len(),
        "activation block sums missing"
    );
    assert!(
        w.layout != Layout::PanelsQ6K || x.half_sums.len() == x.scales.len(),
        "activation half-block sums missing"
    );
    let block = (65_536 / w.cols.max(1)).max(4).next_multiple_of(4);
    (r0 / PANEL, r1.div_ceil(PANEL), block)
}

#[cfg(target_arch = "x86_64")]
#[path = "panels_avx2.rs"]
#[allow(clippy::needless_range_loop)] // Index loops over register tiles read clearer than zips.
pub(super) mod avx2;

#[cfg(target_arch = "x86_64")]
#[path = "panels_vnni512.rs"]
#[allow(clippy::needless_range_loop)] // Index loops over register tiles read clearer than zips.
pub(in crate::kernels) mod vnni512;
