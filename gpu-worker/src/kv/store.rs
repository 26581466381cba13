//! Paged K/V storage: one slab per layer for K and one for V, indexed through block tables.
//!
//! Rows are stored as f32, f16, or int8 with one f16 scale per group of [`INT8_KEY_GROUP`] key
//! values or [`INT8_VALUE_GROUP`] value values. Slabs are allocated zeroed (the OS maps pages
//! lazily, so an idle worker's resident memory grows only with the blocks actually written).
//! Readers get each head's row as f32, converted into a scratch buffer when the storage is
//! compact; the conversion is exact and deterministic, so a token's K/V reads back the same
//! however it was batched, chunked or cached.

use half::f16;

use super::BlockId;

/// Element type of stored K/V.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum KvDtype {
    F32,
    #[default]
    F16,
    /// int8 with one f16 scale per [`INT8_KEY_GROUP`] consecutive key values of a head and one
    /// per [`INT8_VALUE_GROUP`] value values (symmetric, max-abs).
    Int8,
}

/// Key values sharing one int8 scale, as in GGUF's Q8_0. A scale per whole head row lets one
/// large channel coarsen all the others; a group of 32 keeps the rounding error near each
/// group's own magnitude for 2 bytes per 32 values.
pub const INT8_KEY_GROUP: usize = 32;

/// Value values sharing one int8 scale. A key's rounding error moves its score, and through the
/// softmax every weight; a value's error only enters the output weighted by its position's
/// share, and averages out over the positions attention spreads across. So values take groups
/// twice as long: 2 bytes per 64 values.
pub const INT8_VALUE_GROUP: usize = 64;

/// Values per int8 scale for heads of `head_dim`, aiming at `want`: the first of `want` and
/// [`INT8_KEY_GROUP`] that divides the head, else the whole head.
fn scale_group(head_dim: usize, want: usize) -> usize {
    [want, INT8_KEY_GROUP]
        .into_iter()
        .find(|&g| head_dim.is_multiple_of(g))
        .unwrap_or(head_dim)
}

impl KvDtype {
    /// Bytes of one position's K row and V row of `kv_dim` values each, made of heads of
    /// `head_dim`.
    pub fn kv_row_bytes(self, kv_dim: usize, head_dim: usize) -> usize {
        match self {
            Self::F32 => 2 * kv_dim * 4,
            Self::F16 => 2 * kv_dim * 2,
            Self::Int8 => [INT8_KEY_GROUP, INT8_VALUE_GROUP]
                .map(|g| kv_dim + kv_dim / scale_group(head_dim, g) * 2)
                .iter()
                .sum(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Int8 => "int8",
        }
    }
}

/// Element types whose all-zero bytes are the value zero.
///
/// # Safety
/// Implementors must be plain data for which every byte being 0 is a valid value.
unsafe trait Zeroed: Copy {}
// SAFETY: zero bytes are 0.0, +0.0 (binary16) and 0.
unsafe impl Zeroed for f32 {}
unsafe impl Zeroed for f16 {}
unsafe impl Zeroed for i8 {}

/// A zeroed, lazily backed slab (huge pages where possible: fewer faults as blocks are first
/// written, fewer TLB misses when attention walks a long history).
///
/// Allocated with `alloc_zeroed`, so the OS hands out zero pages on first write and an idle
/// worker's resident memory is the blocks it used, not its budget. (`vec![x; n]` takes that path
/// only for types the standard library knows are zero; for `f16` it wrote every element, which
/// made a 2 GiB budget 2 GiB resident at start.)
fn slab<T: Zeroed>(len: usize) -> Vec<T> {
    let layout = std::alloc::Layout::array::<T>(len).expect("KV slab size overflows");
    if layout.size() == 0 {
        return Vec::new();
    }
    // SAFETY: the layout has a non-zero size; a null result is handled below.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if ptr.is_null() {
        std::alloc::handle_alloc_error(layout);
    }
    crate::kernels::advise_huge_pages(ptr as usize, layout.size());
    // SAFETY: `ptr` was allocated by the global allocator with the layout of `len` values of `T`,
    // and all-zero bytes are a valid `T` (the `Zeroed` contract), so all `len` are initialized.
    unsafe { Vec::from_raw_parts(ptr, len, len) }
}

/// One layer's K or V rows.
#[derive(Debug)]
enum Slab {
    F32(Vec<f32>),
    F16(Vec<f16>),
    /// Values, and one scale per (slot, group of `group` consecutive values of a head).
    Int8 {
        q: Vec<i8>,
        scales: Vec<f16>,
        group: usize,
    },
}

impl Slab {
    /// A slab of `slots` rows of `kv_dim` values; int8 rows take one scale per `group` values.
    fn new(dtype: KvDtype, slots: usize, kv_dim: usize, group: usize) -> Self {
        match dtype {
            KvDtype::F32 => Self::F32(slab(slots * kv_dim)),
            KvDtype::F16 => Self::F16(slab(slots * kv_dim)),
            KvDtype::Int8 => Self::Int8 {
                q: slab(slots * kv_dim),
                scales: slab(slots * kv_dim / group),
                group,
            },
        }
    }

    /// Stores `row` in `slot`; int8 rows are stored times `balance` (per channel of a head).
    fn write(&mut self, slot: usize, row: &[f32], balance: Option<&[f32]>) {
        let d = row.len();
        let o = slot * d;
        match self {
            Self::F32(v) => v[o..o + d].copy_from_slice(row),
            Self::F16(v) => {
                use half::slice::HalfFloatSliceExt;
                v[o..o + d].convert_from_f32_slice(row);
            }
            Self::Int8 { q, scales, group } => {
                let (gs, groups) = (*group, d / *group);
                let dst = q[o..o + d].chunks_exact_mut(gs);
                let scales = &mut scales[slot * groups..(slot + 1) * groups];
                for (gi, ((x, q), scale)) in row.chunks_exact(gs).zip(dst).zip(scales).enumerate() {
                    // This group's channels of the head (groups never straddle heads).
                    let factor = |j: usize| balance.map_or(1.0, |a| a[(gi * gs + j) % a.len()]);
                    let max = (0..gs).fold(0f32, |m, j| m.max((x[j] * factor(j)).abs()));
                    // Quantize against the stored (rounded) scale, so reading back multiplies
                    // by exactly the scale the values were divided by.
                    *scale = f16::from_f32(max / 127.0);
                    let s = scale.to_f32();
                    let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
                    for (j, q) in q.iter_mut().enumerate() {
                        *q = (x[j] * factor(j) * inv).round().clamp(-127.0, 127.0) as i8;
                    }
                }
            }
        }
    }

    /// Asks for head `g` of the row in `slot` to be brought into cache (a hint: it never faults).
    #[inline]
    fn prefetch(&self, slot: usize, g: usize, (d, hd): (usize, usize)) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let o = slot * d + g * hd;
            let lines = |start: *const i8, bytes: usize| {
                for at in (0..bytes).step_by(64) {
                    // SAFETY: a prefetch never faults, whatever the address.
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(at)) };
                }
            };
            match self {
                Self::F32(v) => lines(v.as_ptr().wrapping_add(o).cast(), hd * 4),
                Self::F16(v) => lines(v.as_ptr().wrapping_add(o).cast(), hd * 2),
                Self::Int8 { q, scales, group } => {
                    lines(q.as_ptr().wrapping_add(o), hd);
                    lines(
                        scales.as_ptr().wrapping_add(o / group).cast(),
                        hd / group * 2,
                    );
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (slot, g, d, hd);
    }

    /// Head `g` of the row in `slot`, as f32 into `dst` (`head_dim` values).
    #[inline]
    fn head(
        &self,
        slot: usize,
        g: usize,
        (d, hd): (usize, usize),
        unbalance: Option<&[f32]>,
        dst: &mut [f32],
    ) {
        let o = slot * d + g * hd;
        match self {
            Self::F32(v) => dst.copy_from_slice(&v[o..o + hd]),
            Self::F16(v) => {
                use half::slice::HalfFloatSliceExt;
                v[o..o + hd].convert_to_f32_slice(dst);
            }
            Self::Int8 { q, scales, group } => {
                let gs = *group;
                let first = o / gs;
                let rows = dst.chunks_exact_mut(gs).zip(q[o..o + hd].chunks_exact(gs));
                for ((b, q), s) in rows.zip(&scales[first..first + hd / gs]) {
                    let s = s.to_f32();
                    for (b, &q) in b.iter_mut().zip(q) {
                        *b = f32::from(q) * s;
                    }
                }
                if let Some(inv) = unbalance {
                    for (b, i) in dst.iter_mut().zip(inv) {
                        *b *= i;
                    }
                }
            }
        }
    }

    /// Copies `n` slots from `src` in `from` to `dst` in `self` (another layer's slab, same shape).
    fn copy_from(&mut self, from: &Slab, src: usize, dst: usize, n: usize, d: usize) {
        match (self, from) {
            (Self::F32(t), Self::F32(f)) => {
                t[dst * d..(dst + n) * d].copy_from_slice(&f[src * d..(src + n) * d])
            }
            (Self::F16(t), Self::F16(f)) => {
                t[dst * d..(dst + n) * d].copy_from_slice(&f[src * d..(src + n) * d])
            }
            (
                Self::Int8 {
                    q: t,
                    scales: ts,
                    group,
                },
                Self::Int8 {
                    q: f, scales: fs, ..
                },
            ) => {
                let groups = d / *group;
                t[dst * d..(dst + n) * d].copy_from_slice(&f[src * d..(src + n) * d]);
                ts[dst * groups..(dst + n) * groups]
                    .copy_from_slice(&fs[src * groups..(src + n) * groups]);
            }
            _ => unreachable!("every slab of a store has the store's element type"),
        }
    }

    /// Copies the first `n` slots of block `src` to block `dst` (blocks of `bs` slots).
    fn copy_block(&mut self, src: usize, dst: usize, n: usize, bs: usize, d: usize) {
        let (s, t, len) = (src * bs * d, dst * bs * d, n * d);
        match self {
            Self::F32(v) => v.copy_within(s..s + len, t),
            Self::F16(v) => v.copy_within(s..s + len, t),
            Self::Int8 { q, scales, group } => {
                q.copy_within(s..s + len, t);
                let (s, t, len) = (s / *group, t / *group, len / *group);
                scales.copy_within(s..s + len, t);
            }
        }
    }

    /// The raw bytes of `n` slots from `slot` on, appended to `out` (for the disk tier).
    fn save(&self, slot: usize, n: usize, d: usize, out: &mut Vec<u8>) {
        fn bytes<T: Copy>(v: &[T]) -> &[u8] {
            // SAFETY: f32, f16 and i8 are plain data without padding; any byte is a valid u8.
            unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
        }
        let (a, b) = (slot * d, (slot + n) * d);
        match self {
            Self::F32(v) => out.extend_from_slice(bytes(&v[a..b])),
            Self::F16(v) => out.extend_from_slice(bytes(&v[a..b])),
            Self::Int8 { q, scales, group } => {
                out.extend_from_slice(bytes(&q[a..b]));
                out.extend_from_slice(bytes(&scales[a / group..b / group]));
            }
        }
    }

    /// Restores what [`Slab::save`] wrote for `n` slots from `slot` on; returns the bytes read.
    fn load(&mut self, slot: usize, n: usize, d: usize, src: &[u8]) -> usize {
        fn fill<T: Copy>(dst: &mut [T], src: &[u8]) -> usize {
            let len = std::mem::size_of_val(dst);
            // SAFETY: as in `save`; every bit pattern is a valid f32, f16 or i8.
            let d = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u8>(), len) };
            d.copy_from_slice(&src[..len]);
            len
        }
        let (a, b) = (slot * d, (slot + n) * d);
        match self {
            Self::F32(v) => fill(&mut v[a..b], src),
            Self::F16(v) => fill(&mut v[a..b], src),
            Self::Int8 { q, scales, group } => {
                let read = fill(&mut q[a..b], src);
                read + fill(&mut scales[a / *group..b / *group], &src[read..])
            }
        }
    }
}

/// How the global (full-attention) layers of old positions are kept once the sliding-window
/// layers no longer need them: the rows of `per` consecutive table blocks, global layers only,
/// packed into one block. Sub-block `j`'s global layer `i` lives in that block's storage layer
/// `j * globals.len() + i`, so a packed block holds `per` blocks' worth of history in the space
/// of one.
#[derive(Clone, Debug)]
pub struct Packing {
    pub per: usize,
    globals: Vec<usize>,
    /// Each layer's index among the global layers.
    index: Vec<Option<usize>>,
}

impl Packing {
    /// The packing for a model whose global layers are `globals` (of `num_layers`); `None` when
    /// it would save nothing (no sliding layers, or fewer than two blocks' worth fit in one).
    pub fn new(num_layers: usize, globals: Vec<usize>) -> Option<Self> {
        if globals.is_empty() || globals.iter().any(|&l| l >= num_layers) {
            return None;
        }
        let per = num_layers / globals.len();
        let mut index = vec![None; num_layers];
        for (i, &l) in globals.iter().enumerate() {
            index[l] = Some(i);
        }
        (per >= 2).then_some(Self {
            per,
            globals,
            index,
        })
    }

    /// Storage layer of global layer `layer` for sub-block `sub`.
    #[inline]
    fn storage_layer(&self, layer: usize, sub: usize) -> usize {
        let i = self.index[layer].expect("packed history is read only by global layers");
        sub * self.globals.len() + i
    }
}

/// Paged K/V vectors for every layer.
#[derive(Debug)]
pub struct KvStore {
    pub block_size: usize,
    pub kv_dim: usize,
    pub head_dim: usize,
    pub num_blocks: usize,
    pub dtype: KvDtype,
    packing: Option<Packing>,
    /// Per layer, the int8 key factors of [`KvStore::with_key_balance`] and their reciprocals.
    key_balance: Vec<(Vec<f32>, Vec<f32>)>,
    k: Vec<Slab>,
    v: Vec<Slab>,
}

impl KvStore {
    pub fn new(
        num_layers: usize,
        num_blocks: usize,
        block_size: usize,
        kv_dim: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> Self {
        let slots = num_blocks * block_size;
        let (kg, vg) = (
            scale_group(head_dim, INT8_KEY_GROUP),
            scale_group(head_dim, INT8_VALUE_GROUP),
        );
        Self {
            block_size,
            kv_dim,
            head_dim,
            num_blocks,
            dtype,
            packing: None,
            key_balance: Vec::new(),
            k: (0..num_layers)
                .map(|_| Slab::new(dtype, slots, kv_dim, kg))
                .collect(),
            v: (0..num_layers)
                .map(|_| Slab::new(dtype, slots, kv_dim, vg))
                .collect(),
        }
    }

    /// Bytes of one block across all layers (K and V).
    pub fn block_bytes(
        num_layers: usize,
        block_size: usize,
        kv_dim: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> usize {
        num_layers * block_size * dtype.kv_row_bytes(kv_dim, head_dim)
    }

    fn heads(&self) -> usize {
        self.kv_dim / self.head_dim
    }

    /// Enables [`KvStore::pack`] with `packing`.
    pub fn with_packing(mut self, packing: Option<Packing>) -> Self {
        self.packing = packing;
        self
    }

    /// Int8 keys are stored times `balance[layer]` (one factor per channel of a head; see
    /// [`crate::model::key_balance`]) and divided by it when read. Ignored for other element
    /// types, or when the factors do not fit the layers.
    pub fn with_key_balance(mut self, balance: Option<Vec<Vec<f32>>>) -> Self {
        let fits = |b: &Vec<Vec<f32>>| {
            b.len() == self.k.len() && b.iter().all(|a| a.len() == self.head_dim)
        };
        self.key_balance = match balance {
            Some(b) if self.dtype == KvDtype::Int8 && fits(&b) => b
                .into_iter()
                .map(|a| {
                    let inv = a.iter().map(|x| 1.0 / x).collect();
                    (a, inv)
                })
                .collect(),
            _ => Vec::new(),
        };
        self
    }

    pub fn packing(&self) -> Option<&Packing> {
        self.packing.as_ref()
    }

    /// Packs the global layers of blocks `src` (at most `per` of them, in table order) into the
    /// fresh block `dst`. Reads `src` only, so shared and registered blocks can be packed.
    pub fn pack(&mut self, src: &[BlockId], dst: BlockId) {
        let Some(p) = &self.packing else {
            return;
        };
        debug_assert!(src.len() <= p.per && !src.contains(&dst));
        let (bs, d) = (self.block_size, self.kv_dim);
        for (sub, &b) in src.iter().enumerate() {
            for &layer in &p.globals {
                let to = p.storage_layer(layer, sub);
                let (from_slot, to_slot) = (b as usize * bs, dst as usize * bs);
                for slabs in [&mut self.k, &mut self.v] {
                    if to == layer {
                        slabs[to].copy_block(b as usize, dst as usize, bs, bs, d);
                    } else {
                        let (a, c) = if to < layer {
                            let (lo, hi) = slabs.split_at_mut(layer);
                            (&mut lo[to], &hi[0])
                        } else {
                            let (lo, hi) = slabs.split_at_mut(to);
                            (&mut hi[0], &lo[layer])
                        };
                        a.copy_from(c, from_slot, to_slot, bs, d);
                    }
                }
            }
        }
    }

    #[inline]
    fn slot(&self, blocks: &[BlockId], pos: usize) -> usize {
        blocks[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }

    /// Stores the K and V vectors of the token at `pos`.
    pub fn write(&mut self, layer: usize, blocks: &[BlockId], pos: usize, k: &[f32], v: &[f32]) {
        let s = self.slot(blocks, pos);
        let balance = self.key_balance.get(layer).map(|(a, _)| a.as_slice());
        self.k[layer].write(s, k, balance);
        self.v[layer].write(s, v, None);
    }

    /// The storage slots of every position in `range`, in order. Walks the block table without a
    /// division per position: attention reads every cached position of every layer.
    pub fn slots<'a>(
        &self,
        blocks: &'a [BlockId],
        range: std::ops::RangeInclusive<usize>,
    ) -> impl Iterator<Item = usize> + 'a {
        let bs = self.block_size;
        let (first, last) = (*range.start(), *range.end());
        let mut block = first / bs;
        let mut slot = first % bs;
        (first..=last).map(move |_| {
            let o = blocks[block] as usize * bs + slot;
            slot += 1;
            if slot == bs {
                slot = 0;
                block += 1;
            }
            o
        })
    }

    /// Where the rows of `layer` for every position in `range` are stored, in order: (storage
    /// layer, slot). Positions below `packed.len() * per` blocks are read from the packed blocks
    /// (global layers only); the rest through `blocks`.
    pub fn rows<'a>(
        &'a self,
        layer: usize,
        blocks: &'a [BlockId],
        packed: &'a [BlockId],
        range: std::ops::RangeInclusive<usize>,
    ) -> impl Iterator<Item = (usize, usize)> + 'a {
        let bs = self.block_size;
        let (first, last) = (*range.start(), *range.end());
        let per = self.packing.as_ref().map_or(1, |p| p.per);
        let split = (packed.len() * per * bs).clamp(first, last + 1);
        let head = (first..split).map(move |pos| {
            let (i, off) = (pos / bs, pos % bs);
            let p = self
                .packing
                .as_ref()
                .expect("packed blocks without packing");
            (
                p.storage_layer(layer, i % per),
                packed[i / per] as usize * bs + off,
            )
        });
        head.chain(self.slots(blocks, split..=last).map(move |s| (layer, s)))
    }

    /// KV head `g` of layer `layer`'s key stored at `(at, slot)` (a storage layer and slot from
    /// [`KvStore::rows`]), as f32 into `dst` (`head_dim` values).
    #[inline]
    pub fn key(&self, layer: usize, (at, slot): (usize, usize), g: usize, dst: &mut [f32]) {
        let unbalance = self.key_balance.get(layer).map(|(_, inv)| inv.as_slice());
        self.k[at].head(slot, g, (self.kv_dim, self.head_dim), unbalance, dst)
    }

    /// Asks for KV head `g` of the key and the value at `loc` (as [`KvStore::rows`] gives it) to
    /// be brought into cache: attention issues it a tile ahead of the rows it converts, whose
    /// blocks lie scattered over the slab.
    #[inline]
    pub fn prefetch(&self, (at, slot): (usize, usize), g: usize) {
        let dims = (self.kv_dim, self.head_dim);
        self.k[at].prefetch(slot, g, dims);
        self.v[at].prefetch(slot, g, dims);
    }

    /// KV head `g` of the value in `slot` of `layer`, as f32 into `dst` (`head_dim` values).
    #[inline]
    pub fn value(&self, layer: usize, slot: usize, g: usize, dst: &mut [f32]) {
        self.v[layer].head(slot, g, (self.kv_dim, self.head_dim), None, dst)
    }

    /// K and V of the token at `pos` (all KV heads) as f32.
    pub fn read(&self, layer: usize, blocks: &[BlockId], pos: usize) -> (Vec<f32>, Vec<f32>) {
        let s = self.slot(blocks, pos);
        let hd = self.head_dim;
        let (mut k, mut v) = (vec![0f32; self.kv_dim], vec![0f32; self.kv_dim]);
        for g in 0..self.heads() {
            self.key(layer, (layer, s), g, &mut k[g * hd..(g + 1) * hd]);
            self.value(layer, s, g, &mut v[g * hd..(g + 1) * hd]);
        }
        (k, v)
    }

    /// Copies the first `n` positions of block `src` into block `dst`, every layer (copy-on-write
    /// of a block that must not be written).
    pub fn copy_block(&mut self, src: BlockId, dst: BlockId, n: usize) {
        let (bs, d) = (self.block_size, self.kv_dim);
        for s in self.k.iter_mut().chain(self.v.iter_mut()) {
            s.copy_block(src as usize, dst as usize, n, bs, d);
        }
    }

    /// Appends the stored bytes of block `b`'s first `n` positions, every layer, to `out`.
    pub fn save_block(&self, b: BlockId, n: usize, out: &mut Vec<u8>) {
        let slot = b as usize * self.block_size;
        for s in self.k.iter().chain(self.v.iter()) {
            s.save(slot, n, self.kv_dim, out);
        }
    }

    /// Bytes [`KvStore::save_block`] writes for `n` positions.
    pub fn saved_bytes(&self, n: usize) -> usize {
        self.k.len() * n * self.dtype.kv_row_bytes(self.kv_dim, self.head_dim)
    }

    /// Restores block `b`'s first `n` positions from bytes written by [`KvStore::save_block`].
    pub fn load_block(&mut self, b: BlockId, n: usize, src: &[u8]) {
        let slot = b as usize * self.block_size;
        let mut at = 0;
        for s in self.k.iter_mut().chain(self.v.iter_mut()) {
            at += s.load(slot, n, self.kv_dim, &src[at..]);
        }
    }
}

#[cfg(test)]
#[path = "store_tests.rs"]
mod tests;
