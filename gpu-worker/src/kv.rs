//! KV memory: a fixed budget of token blocks, a free list, and the paged K/V storage.
//!
//! Every sequence (and every idle session cache) owns a block table: block `i` of the table holds
//! the K and V vectors of its tokens `i*block_size .. (i+1)*block_size` for every layer. Accounting
//! is therefore exact: blocks used × block bytes is the memory held. Storage is one f32 slab per
//! layer for K and one for V, allocated zeroed (the OS maps pages lazily, so an idle worker's
//! resident memory grows only with the blocks actually written).

/// Index of a block in the store.
pub type BlockId = u32;

/// Hands out block ids; plain synchronous state, unit-tested on its own.
#[derive(Debug)]
pub struct BlockAllocator {
    total: usize,
    free: Vec<BlockId>,
}

impl BlockAllocator {
    pub fn new(total: usize) -> Self {
        // Pop from the end: low ids first, which keeps touched memory compact.
        Self {
            total,
            free: (0..total as BlockId).rev().collect(),
        }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn free(&self) -> usize {
        self.free.len()
    }

    pub fn used(&self) -> usize {
        self.total - self.free.len()
    }

    /// Grows `table` to hold `tokens` tokens; all or nothing.
    pub fn grow(&mut self, table: &mut Vec<BlockId>, tokens: usize, block_size: usize) -> bool {
        let need = tokens.div_ceil(block_size).saturating_sub(table.len());
        if need > self.free.len() {
            return false;
        }
        let at = self.free.len() - need;
        table.extend(self.free.drain(at..).rev());
        true
    }

    /// Shrinks `table` to the blocks needed for `tokens` tokens, freeing the rest.
    pub fn truncate(&mut self, table: &mut Vec<BlockId>, tokens: usize, block_size: usize) {
        let keep = tokens.div_ceil(block_size);
        while table.len() > keep {
            if let Some(b) = table.pop() {
                self.free.push(b);
            }
        }
    }

    pub fn release(&mut self, table: &mut Vec<BlockId>) {
        self.truncate(table, 0, 1);
    }

    /// Blocks needed to grow a table of `have` blocks to `tokens` tokens.
    pub fn blocks_needed(have: usize, tokens: usize, block_size: usize) -> usize {
        tokens.div_ceil(block_size).saturating_sub(have)
    }
}

/// A zeroed, lazily backed slab (huge pages where possible: fewer faults as blocks are first
/// written, fewer TLB misses when attention walks a long history).
fn slab(len: usize) -> Vec<f32> {
    let v = vec![0f32; len];
    crate::kernels::advise_huge_pages(v.as_ptr() as usize, len * std::mem::size_of::<f32>());
    v
}

/// Paged K/V vectors for every layer.
#[derive(Debug)]
pub struct KvStore {
    pub block_size: usize,
    pub kv_dim: usize,
    pub num_blocks: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl KvStore {
    pub fn new(num_layers: usize, num_blocks: usize, block_size: usize, kv_dim: usize) -> Self {
        let per_layer = num_blocks * block_size * kv_dim;
        Self {
            block_size,
            kv_dim,
            num_blocks,
            k: (0..num_layers).map(|_| slab(per_layer)).collect(),
            v: (0..num_layers).map(|_| slab(per_layer)).collect(),
        }
    }

    /// Bytes of one block across all layers (K and V).
    pub fn block_bytes(num_layers: usize, block_size: usize, kv_dim: usize) -> usize {
        2 * num_layers * block_size * kv_dim * std::mem::size_of::<f32>()
    }

    #[inline]
    fn offset(&self, blocks: &[BlockId], pos: usize) -> usize {
        let b = blocks[pos / self.block_size] as usize;
        (b * self.block_size + pos % self.block_size) * self.kv_dim
    }

    /// Stores the K and V vectors of the token at `pos`.
    pub fn write(&mut self, layer: usize, blocks: &[BlockId], pos: usize, k: &[f32], v: &[f32]) {
        let o = self.offset(blocks, pos);
        let d = self.kv_dim;
        self.k[layer][o..o + d].copy_from_slice(k);
        self.v[layer][o..o + d].copy_from_slice(v);
    }

    /// K and V of every position in `range`, in order (all KV heads). Walks the block table
    /// without a division per position: attention reads every cached position of every layer.
    pub fn positions<'a>(
        &'a self,
        layer: usize,
        blocks: &'a [BlockId],
        range: std::ops::RangeInclusive<usize>,
    ) -> impl Iterator<Item = (&'a [f32], &'a [f32])> + 'a {
        let (bs, d) = (self.block_size, self.kv_dim);
        let (k, v) = (&self.k[layer], &self.v[layer]);
        let (first, last) = (*range.start(), *range.end());
        let mut block = first / bs;
        let mut slot = first % bs;
        (first..=last).map(move |_| {
            let o = (blocks[block] as usize * bs + slot) * d;
            slot += 1;
            if slot == bs {
                slot = 0;
                block += 1;
            }
            (&k[o..o + d], &v[o..o + d])
        })
    }

    /// K and V of the token at `pos` (all KV heads).
    #[inline]
    pub fn read(&self, layer: usize, blocks: &[BlockId], pos: usize) -> (&[f32], &[f32]) {
        let o = self.offset(blocks, pos);
        let d = self.kv_dim;
        (&self.k[layer][o..o + d], &self.v[layer][o..o + d])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grow_is_all_or_nothing_and_exact() {
        let mut a = BlockAllocator::new(4);
        let mut t = Vec::new();
        assert!(a.grow(&mut t, 17, 16)); // 2 blocks
        assert_eq!((t.len(), a.used()), (2, 2));
        assert!(a.grow(&mut t, 32, 16)); // still 2
        assert_eq!(a.used(), 2);
        let mut u = Vec::new();
        assert!(!a.grow(&mut u, 48, 16)); // needs 3, only 2 free
        assert!(u.is_empty());
        assert_eq!(a.free(), 2);
        a.truncate(&mut t, 5, 16);
        assert_eq!((t.len(), a.free()), (1, 3));
        a.release(&mut t);
        assert_eq!(a.free(), 4);
    }

    #[test]
    fn blocks_are_never_handed_out_twice() {
        let mut a = BlockAllocator::new(8);
        let (mut x, mut y) = (Vec::new(), Vec::new());
        assert!(a.grow(&mut x, 40, 8));
        assert!(a.grow(&mut y, 24, 8));
        let mut all: Vec<_> = x.iter().chain(&y).copied().collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 8);
        assert_eq!(a.free(), 0);
    }

    #[test]
    fn store_reads_back_what_was_written_through_the_table() {
        let mut s = KvStore::new(2, 4, 2, 3);
        let blocks = [3, 1];
        for pos in 0..4 {
            let k = [pos as f32; 3];
            let v = [-(pos as f32); 3];
            s.write(1, &blocks, pos, &k, &v);
        }
        for pos in 0..4 {
            let (k, v) = s.read(1, &blocks, pos);
            assert_eq!(k, &[pos as f32; 3]);
            assert_eq!(v, &[-(pos as f32); 3]);
        }
        let walked: Vec<f32> = s.positions(1, &blocks, 1..=3).map(|(k, _)| k[0]).collect();
        assert_eq!(walked, [1.0, 2.0, 3.0]);
        // Layer 0 untouched.
        assert_eq!(s.read(0, &blocks, 2).0, &[0.0; 3]);
    }
}
