//! Block bookkeeping: reference counts, the prefix cache, and reuse of cached blocks.
//!
//! A block is in exactly one of three states:
//! - **free**: on the free list, content meaningless;
//! - **used**: referenced by one or more block tables (`refs > 0`);
//! - **cached**: unreferenced, but registered under the chained hash of the tokens it holds, so a
//!   later prompt with the same prefix can take it back. Cached blocks count as available memory
//!   and are reclaimed least-recently-released first when the free list runs dry.
//!
//! Only full blocks are registered, and a registered block is immutable: nothing writes into it
//! again until it has been reclaimed (unregistered) and handed out afresh. A table that must write
//! into a registered block copies it first (see `writable`). Hence a block shared by several tables
//! — which can only be obtained through the registry — is never written by any of them.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use super::{BlockId, NO_BLOCK};

/// The chain every user's roots hang from (see [`user_root`]), and the root of operators'
/// shared system prompts (see [`Chain`]).
pub const ROOT_HASH: u64 = 0x6865_6172_7468_6b76;

/// Parent hash of the first block of `user`'s sequences. The prefix cache is scoped per user:
/// with one root for everyone, a user could learn whether another user's prompt begins with
/// guessed text from the `cached_tokens` of a reply (or its time to first token). The user id
/// is the orchestrator's, which the worker token vouches for; a request cannot set another's.
pub fn user_root(user: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    ROOT_HASH.hash(&mut h);
    user.hash(&mut h);
    h.finish()
}

/// Where a sequence's prefix-cache chain starts, block by block. Every block is the user's own
/// ([`user_root`]), except the leading blocks that lie wholly inside an operator's shared system
/// prompt: those hang from [`ROOT_HASH`], so every user's copy of that prompt is one cached copy.
/// The first block past them is chained to the user's root as well as to them, so nothing a
/// user wrote after the shared prompt ever matches another user's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chain {
    user: u64,
    shared_blocks: usize,
}

impl Chain {
    /// `user`'s chain, whose first `shared_tokens` tokens are an operator's shared prompt (the
    /// orchestrator says so; 0 for none). Only whole blocks are shared.
    pub fn new(user: &str, shared_tokens: usize, block_size: usize) -> Self {
        Self {
            user: user_root(user),
            shared_blocks: shared_tokens / block_size.max(1),
        }
    }

    /// A chain private to `user` from its first block.
    pub fn private(user: &str) -> Self {
        Self::new(user, 0, 1)
    }

    /// The parent hash of block `index`, whose predecessor's hash is `prev` (`None` for the
    /// first block).
    pub fn parent(&self, index: usize, prev: Option<u64>) -> u64 {
        match prev {
            None if self.shared_blocks > 0 => ROOT_HASH,
            None => self.user,
            Some(h) if index == self.shared_blocks => {
                chain_hash(h, &[(self.user >> 32) as u32, self.user as u32])
            }
            Some(h) => h,
        }
    }
}

/// The key of the block holding `tokens`, after the blocks whose chain ended in `parent`: it
/// covers every earlier token of the sequence.
pub fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// What a registered block holds; compared in full on lookup, so a hash collision can never hand
/// out the wrong K/V (the parent hash stands for the earlier blocks, themselves checked this way).
#[derive(Debug)]
struct Key {
    hash: u64,
    parent: u64,
    tokens: Box<[u32]>,
}

/// Hands out block ids and tracks sharing; plain synchronous state, unit-tested on its own.
#[derive(Debug)]
pub struct BlockAllocator {
    total: usize,
    free: Vec<BlockId>,
    refs: Vec<u32>,
    keys: Vec<Option<Key>>,
    by_hash: HashMap<u64, BlockId>,
    /// Cached blocks by release stamp (oldest first) and each block's stamp.
    lru: BTreeMap<u64, BlockId>,
    stamp: Vec<u64>,
    clock: u64,
}

impl BlockAllocator {
    pub fn new(total: usize) -> Self {
        // Pop from the end: low ids first, which keeps touched memory compact.
        Self {
            total,
            free: (0..total as BlockId).rev().collect(),
            refs: vec![0; total],
            keys: (0..total).map(|_| None).collect(),
            by_hash: HashMap::new(),
            lru: BTreeMap::new(),
            stamp: vec![0; total],
            clock: 0,
        }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    /// Blocks a table can get: free ones and cached ones (reclaimed on demand).
    pub fn free(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// Blocks referenced by at least one table.
    pub fn used(&self) -> usize {
        self.total - self.free()
    }

    /// Unreferenced blocks kept for their prefix.
    pub fn cached(&self) -> usize {
        self.lru.len()
    }

    pub fn refs(&self, b: BlockId) -> u32 {
        self.refs[b as usize]
    }

    pub fn is_registered(&self, b: BlockId) -> bool {
        self.keys[b as usize].is_some()
    }

    /// Whether a table holding `b` may write into it: it is the only holder and the block is not
    /// registered (registered blocks are immutable).
    pub fn writable(&self, b: BlockId) -> bool {
        self.refs[b as usize] == 1 && self.keys[b as usize].is_none()
    }

    /// One block for a table, from the free list or else the least recently released cached one.
    fn take(&mut self) -> Option<BlockId> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.lru.pop_first()?;
                if let Some(k) = self.keys[b as usize].take() {
                    self.by_hash.remove(&k.hash);
                }
                b
            }
        };
        debug_assert_eq!(self.refs[b as usize], 0);
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// Grows `table` to hold `tokens` tokens with fresh (writable) blocks; all or nothing.
    pub fn grow(&mut self, table: &mut Vec<BlockId>, tokens: usize, block_size: usize) -> bool {
        let need = tokens.div_ceil(block_size).saturating_sub(table.len());
        if need > self.free() {
            return false;
        }
        for _ in 0..need {
            match self.take() {
                Some(b) => table.push(b),
                None => return false,
            }
        }
        true
    }

    /// One fresh block (for a copy-on-write), if any is available.
    pub fn take_one(&mut self) -> Option<BlockId> {
        self.take()
    }

    /// Takes another reference to `b` (a cached block comes back into use).
    pub fn share(&mut self, b: BlockId) {
        let i = b as usize;
        if self.refs[i] == 0 {
            self.lru.remove(&self.stamp[i]);
        }
        self.refs[i] += 1;
    }

    /// Drops one reference: the last one frees the block, or caches it if registered.
    pub fn unref(&mut self, b: BlockId) {
        let i = b as usize;
        debug_assert!(self.refs[i] > 0, "block {b} released twice");
        self.refs[i] = self.refs[i].saturating_sub(1);
        if self.refs[i] > 0 {
            return;
        }
        if self.keys[i].is_some() {
            self.clock += 1;
            self.stamp[i] = self.clock;
            self.lru.insert(self.clock, b);
        } else {
            self.free.push(b);
        }
    }

    /// Shrinks `table` to the blocks needed for `tokens` tokens, releasing the rest (the last
    /// block first, so a chain's tail is reclaimed before its head). [`NO_BLOCK`] entries hold
    /// nothing and are just dropped.
    pub fn truncate(&mut self, table: &mut Vec<BlockId>, tokens: usize, block_size: usize) {
        let keep = tokens.div_ceil(block_size);
        while table.len() > keep {
            match table.pop() {
                Some(NO_BLOCK) | None => {}
                Some(b) => self.unref(b),
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

    /// Registers the full block `b` (holding `tokens`, after the chain `parent`) in the prefix
    /// cache; returns its chain hash. A block already registered, or whose content another block
    /// already holds, is left as it is (it stays private and is freed, not cached, when released).
    pub fn register(&mut self, b: BlockId, parent: u64, tokens: &[u32]) -> u64 {
        let hash = chain_hash(parent, tokens);
        let i = b as usize;
        if self.keys[i].is_none() && !self.by_hash.contains_key(&hash) && self.refs[i] > 0 {
            self.keys[i] = Some(Key {
                hash,
                parent,
                tokens: tokens.into(),
            });
            self.by_hash.insert(hash, b);
        }
        hash
    }

    /// The cached or used block holding `tokens` after the chain `parent`, with its hash.
    pub fn lookup(&self, parent: u64, tokens: &[u32]) -> Option<(BlockId, u64)> {
        let hash = chain_hash(parent, tokens);
        let b = *self.by_hash.get(&hash)?;
        let k = self.keys[b as usize].as_ref()?;
        (k.parent == parent && *k.tokens == *tokens).then_some((b, hash))
    }

    /// The longest run of registered blocks holding `tokens` from its start, whole blocks only,
    /// on `chain` (see [`Chain`]).
    pub fn lookup_prefix(&self, chain: &Chain, tokens: &[u32], block_size: usize) -> Vec<BlockId> {
        let mut prev = None;
        let mut out = Vec::new();
        for (i, chunk) in tokens.chunks_exact(block_size).enumerate() {
            match self.lookup(chain.parent(i, prev), chunk) {
                Some((b, h)) => {
                    out.push(b);
                    prev = Some(h);
                }
                None => break,
            }
        }
        out
    }
}

impl BlockAllocator {
    /// Checks the bookkeeping against `tables` (every table holding blocks): each block's count
    /// equals the tables holding it, free and cached blocks are unreferenced and listed once, and
    /// used + free = total. For tests.
    pub fn audit<'a>(&self, tables: impl IntoIterator<Item = &'a [BlockId]>) -> Result<(), String> {
        let mut held = vec![0u32; self.total];
        for t in tables {
            for &b in t.iter().filter(|&&b| b != NO_BLOCK) {
                held[b as usize] += 1;
            }
        }
        if held != self.refs {
            return Err(format!(
                "reference counts {:?} but tables hold {held:?}",
                self.refs
            ));
        }
        let mut seen = vec![false; self.total];
        for &b in self.free.iter().chain(self.lru.values()) {
            if self.refs[b as usize] != 0 || std::mem::replace(&mut seen[b as usize], true) {
                return Err(format!(
                    "block {b} is available but referenced or listed twice"
                ));
            }
        }
        if let Some(&b) = self.free.iter().find(|&&b| self.keys[b as usize].is_some()) {
            return Err(format!("free block {b} is still registered"));
        }
        let in_use = self.refs.iter().filter(|&&r| r > 0).count();
        if in_use != self.used() || in_use + self.free() != self.total {
            return Err(format!(
                "{in_use} referenced blocks but used() = {} and free() = {}",
                self.used(),
                self.free()
            ));
        }
        Ok(())
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

    /// A chain whose every block hangs from [`ROOT_HASH`], as [`register_all`] registers them.
    const ALL_SHARED: Chain = Chain {
        user: 0,
        shared_blocks: usize::MAX,
    };

    /// Registers every block of `table` as the chain of `tokens`.
    fn register_all(a: &mut BlockAllocator, table: &[BlockId], tokens: &[u32], bs: usize) {
        let mut parent = ROOT_HASH;
        for (b, chunk) in table.iter().zip(tokens.chunks_exact(bs)) {
            parent = a.register(*b, parent, chunk);
        }
    }

    #[test]
    fn released_registered_blocks_are_cached_and_found_by_prefix() {
        let mut a = BlockAllocator::new(6);
        let tokens: Vec<u32> = (0..12).collect();
        let mut t = Vec::new();
        assert!(a.grow(&mut t, 12, 4));
        register_all(&mut a, &t, &tokens, 4);
        assert!(t.iter().all(|&b| a.is_registered(b) && !a.writable(b)));
        a.release(&mut t);
        // Unreferenced but kept: available, not used, and found again.
        assert_eq!((a.used(), a.free(), a.cached()), (0, 6, 3));
        let hit = a.lookup_prefix(&ALL_SHARED, &tokens, 4);
        assert_eq!(hit.len(), 3);
        // A different second block stops the match after the first; a partial block never matches.
        let mut other = tokens.clone();
        other[5] = 99;
        assert_eq!(a.lookup_prefix(&ALL_SHARED, &other, 4), hit[..1]);
        assert_eq!(a.lookup_prefix(&ALL_SHARED, &tokens[..7], 4), hit[..1]);
        // The chain covers every earlier token: the same block content after another first
        // block is a different key.
        let shifted: Vec<u32> = [100, 101, 102, 103].into_iter().chain(4..8).collect();
        assert!(a.lookup_prefix(&ALL_SHARED, &shifted, 4).is_empty());
        for &b in &hit {
            a.share(b);
        }
        assert_eq!((a.used(), a.cached()), (3, 0));
    }

    #[test]
    fn eviction_takes_only_unreferenced_blocks_oldest_first() {
        let mut a = BlockAllocator::new(4);
        let (mut x, mut y) = (Vec::new(), Vec::new());
        assert!(a.grow(&mut x, 8, 4));
        register_all(&mut a, &x, &[1, 1, 1, 1, 2, 2, 2, 2], 4);
        assert!(a.grow(&mut y, 8, 4));
        register_all(&mut a, &y, &[3, 3, 3, 3, 4, 4, 4, 4], 4);
        // y's first block is shared by a third table; then both x and y are released.
        let mut z = vec![y[0]];
        a.share(y[0]);
        a.release(&mut x);
        a.release(&mut y);
        assert_eq!((a.used(), a.cached(), a.free()), (1, 3, 3));
        // Three fresh blocks: all cached ones but never the referenced one.
        let mut w = Vec::new();
        assert!(a.grow(&mut w, 12, 4));
        assert!(!w.contains(&z[0]));
        assert_eq!(a.refs(z[0]), 1);
        assert!(a.is_registered(z[0]));
        assert!(!a.grow(&mut w, 16, 4), "only the referenced block is left");
        // Reclaimed blocks lost their keys; the referenced one is still found.
        assert_eq!(a.lookup_prefix(&ALL_SHARED, &[3, 3, 3, 3], 4), vec![z[0]]);
        assert!(a.lookup_prefix(&ALL_SHARED, &[1, 1, 1, 1], 4).is_empty());
        a.release(&mut z);
        a.release(&mut w);
        assert_eq!((a.used(), a.free()), (0, 4));
    }

    #[test]
    fn lru_reclaims_the_least_recently_released_first_tail_before_head() {
        let mut a = BlockAllocator::new(4);
        let mut x = Vec::new();
        assert!(a.grow(&mut x, 8, 4));
        register_all(&mut a, &x, &[1, 1, 1, 1, 2, 2, 2, 2], 4);
        let mut y = Vec::new();
        assert!(a.grow(&mut y, 8, 4));
        register_all(&mut a, &y, &[3, 3, 3, 3, 4, 4, 4, 4], 4);
        let (x0, x1) = (x[0], x[1]);
        a.release(&mut x); // x1 then x0
        a.release(&mut y);
        let mut w = Vec::new();
        assert!(a.grow(&mut w, 4, 4));
        assert_eq!(w, vec![x1], "the tail of the oldest chain goes first");
        assert_eq!(
            a.lookup_prefix(&ALL_SHARED, &[1, 1, 1, 1, 2, 2, 2, 2], 4),
            vec![x0]
        );
    }

    #[test]
    fn duplicate_content_stays_private() {
        let mut a = BlockAllocator::new(4);
        let (mut x, mut y) = (Vec::new(), Vec::new());
        assert!(a.grow(&mut x, 4, 4));
        assert!(a.grow(&mut y, 4, 4));
        let hx = a.register(x[0], ROOT_HASH, &[7; 4]);
        let hy = a.register(y[0], ROOT_HASH, &[7; 4]);
        assert_eq!(hx, hy);
        assert!(a.is_registered(x[0]) && !a.is_registered(y[0]));
        a.release(&mut y);
        assert_eq!(
            (a.cached(), a.free()),
            (0, 3),
            "the private copy is freed, not cached"
        );
        a.release(&mut x);
        assert_eq!(a.cached(), 1);
    }

    /// Registers `tokens`' whole blocks on `chain`, as the scheduler does.
    fn register_chain(
        a: &mut BlockAllocator,
        chain: &Chain,
        tokens: &[u32],
        bs: usize,
    ) -> Vec<BlockId> {
        let mut t = Vec::new();
        assert!(a.grow(&mut t, tokens.len(), bs));
        let mut prev = None;
        for (i, (b, chunk)) in t.iter().zip(tokens.chunks_exact(bs)).enumerate() {
            prev = Some(a.register(*b, chain.parent(i, prev), chunk));
        }
        t
    }

    #[test]
    fn users_share_the_operators_prompt_blocks_and_nothing_after_them() {
        let mut a = BlockAllocator::new(16);
        // Two blocks of an operator's prompt, then what alice wrote.
        let tokens: Vec<u32> = (0..16).collect();
        let alice = Chain::new("alice", 9, 4);
        let mut t = register_chain(&mut a, &alice, &tokens, 4);
        a.release(&mut t);
        assert_eq!(a.lookup_prefix(&alice, &tokens, 4).len(), 4);
        // Bob, with the same shared prompt, finds its whole blocks (two of its nine tokens'
        // worth), but not alice's blocks after it, though he sends her exact tokens.
        assert_eq!(
            a.lookup_prefix(&Chain::new("bob", 9, 4), &tokens, 4).len(),
            2
        );
        assert_eq!(
            a.lookup_prefix(&Chain::new("bob", 16, 4), &tokens, 4).len(),
            2
        );
        // Without a shared prompt, nothing of alice's is his.
        assert!(a
            .lookup_prefix(&Chain::private("bob"), &tokens, 4)
            .is_empty());
        // And alice's own private chain is not her shared one.
        assert!(a
            .lookup_prefix(&Chain::private("alice"), &tokens, 4)
            .is_empty());
    }
}
