//! The K/V memory of one model's engine: each sequence's block table, the prefix cache (full
//! blocks kept in the [`BlockAllocator`] under a chained hash), the session caches left between
//! turns, and the disk tier they spill to. [`KvManager`] decides where K/V goes and what an idle
//! cache gives way to; the scheduler decides who runs and who gives up memory (admission,
//! planning, preemption). Block contents move only through a [`BlockStore`], so the manager is
//! tested without a model or a forward pass (`kv_tests.rs`).

use std::collections::HashMap;

use hearth_shared::{SessionId, UserId};

use super::seq::Seq;
use crate::engine::share::Shares;
use crate::kv::{chain_hash, BlockAllocator, BlockId, DiskTier, Spilled, NO_BLOCK};
use crate::model::ModelError;

/// Where a [`KvManager`] copies block contents: the engine's K/V storage (the backend's), or a
/// test's.
pub(in crate::engine) trait BlockStore {
    /// Packs the global layers of table blocks `src` into block `dst`.
    fn pack(&mut self, src: &[BlockId], dst: BlockId);
    /// Copies the first `n` positions of block `src` into `dst`.
    fn copy_block(&mut self, src: BlockId, dst: BlockId, n: usize) -> Result<(), ModelError>;
    /// Appends the bytes of the first `n` positions of block `b` to `out`.
    fn save_block(&self, b: BlockId, n: usize, out: &mut Vec<u8>) -> Result<(), ModelError>;
    /// Writes `n` positions saved by [`BlockStore::save_block`] into block `b`.
    fn load_block(&mut self, b: BlockId, n: usize, src: &[u8]) -> Result<(), ModelError>;
}

/// How the K/V is laid out, which placement follows.
#[derive(Debug, Clone, Copy)]
pub(super) struct KvLayout {
    pub block_size: usize,
    /// Table blocks per packed block, when old positions keep only their global layers.
    pub pack_per: Option<usize>,
    /// The sliding layers' window, if the model has one.
    pub sliding_window: Option<usize>,
    /// Positions kept whole past the window, so a rewind that far still resumes from the cache
    /// (`kv_window_margin`); packing is off without it.
    pub window_margin: Option<usize>,
}

/// The outcome of trying to give a waiting request its KV blocks.
pub(super) enum Placement {
    Ready,
    /// Not enough memory now; try again at a later step.
    Wait,
    /// Needs more tokens than the whole budget holds.
    TooBig(usize),
}

/// A session's KV left behind by its last turn.
#[derive(Debug)]
pub(super) struct SessionCache {
    /// Whose session: its blocks count towards that user's share of the pool.
    pub user: UserId,
    pub tokens: Vec<u32>,
    pub blocks: Vec<BlockId>,
    /// Packed global layers of the table's leading [`NO_BLOCK`] entries.
    pub packed: Vec<BlockId>,
    last_used: u64,
}

/// Blocks a table holds: its own (not those packed away) and its packed ones.
pub(super) fn held(blocks: &[BlockId], packed: &[BlockId]) -> usize {
    blocks.iter().filter(|&&b| b != NO_BLOCK).count() + packed.len()
}

/// The K/V placement of one engine (see the module's header).
#[derive(Debug)]
pub(super) struct KvManager {
    layout: KvLayout,
    alloc: BlockAllocator,
    sessions: HashMap<SessionId, SessionCache>,
    /// Where evicted session caches go, when configured.
    disk: Option<DiskTier>,
    /// Orders session caches by last use.
    clock: u64,
    evictions: usize,
    disk_restores: usize,
}

/// What [`KvManager`] has done, for the engine's stats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct KvCounts {
    pub cached_sessions: usize,
    pub disk_sessions: usize,
    pub disk_restores: usize,
    pub evictions: usize,
}

impl KvManager {
    /// A pool of `blocks` blocks, empty, spilling to `disk` if given.
    pub(super) fn new(blocks: usize, layout: KvLayout, disk: Option<DiskTier>) -> Self {
        Self {
            layout,
            alloc: BlockAllocator::new(blocks),
            sessions: HashMap::new(),
            disk,
            clock: 0,
            evictions: 0,
            disk_restores: 0,
        }
    }

    /// The pool, to read.
    pub(super) fn alloc(&self) -> &BlockAllocator {
        &self.alloc
    }

    /// The idle session caches, to read.
    #[cfg(test)]
    pub(super) fn sessions(&self) -> &HashMap<SessionId, SessionCache> {
        &self.sessions
    }

    pub(super) fn counts(&self) -> KvCounts {
        KvCounts {
            cached_sessions: self.sessions.len(),
            disk_sessions: self.disk.as_ref().map_or(0, DiskTier::sessions),
            disk_restores: self.disk_restores,
            evictions: self.evictions,
        }
    }

    pub(super) fn free(&self) -> usize {
        self.alloc.free()
    }

    /// Grows `table` to hold `tokens` positions; false (and unchanged) when blocks are short.
    pub(super) fn grow(&mut self, table: &mut Vec<BlockId>, tokens: usize) -> bool {
        self.alloc.grow(table, tokens, self.layout.block_size)
    }

    /// Gives back the blocks of `table` past `tokens` positions.
    pub(super) fn truncate(&mut self, table: &mut Vec<BlockId>, tokens: usize) {
        self.alloc.truncate(table, tokens, self.layout.block_size);
    }

    /// Blocks `table` needs beyond its own to hold `tokens` positions.
    pub(super) fn blocks_needed(&self, table: &[BlockId], tokens: usize) -> usize {
        BlockAllocator::blocks_needed(table.len(), tokens, self.layout.block_size)
    }

    /// Whether block `b` may take writes (neither shared nor in the prefix cache).
    pub(super) fn writable(&self, b: BlockId) -> bool {
        self.alloc.writable(b)
    }

    /// Frees every block `s` holds: it keeps its tokens, and computes them again.
    pub(super) fn forget(&mut self, s: &mut Seq) {
        self.alloc.release(&mut s.blocks);
        self.alloc.release(&mut s.packed);
        s.kv_len = 0;
        s.hashes.clear();
    }

    fn release_cache(&mut self, mut c: SessionCache) {
        self.alloc.release(&mut c.blocks);
        self.alloc.release(&mut c.packed);
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Forgets session `id`'s K/V, in memory and on disk; whether there was any.
    pub(super) fn drop_session(&mut self, id: &SessionId) -> bool {
        let on_disk = self.disk.as_mut().is_some_and(|d| d.remove(id));
        match self.sessions.remove(id) {
            Some(c) => {
                self.release_cache(c);
                true
            }
            None => on_disk,
        }
    }

    /// Who holds how much of the pool (the `running` sequences and the idle caches), `asking`
    /// counted as a user even if it holds nothing yet.
    pub(super) fn shares<'a>(
        &'a self,
        running: &'a [Seq],
        asking: Option<&'a UserId>,
    ) -> Shares<'a> {
        let running = running
            .iter()
            .map(|s| (&s.user, held(&s.blocks, &s.packed)));
        let idle = self.sessions.values();
        let idle = idle.map(|c| (&c.user, held(&c.blocks, &c.packed)));
        Shares::new(self.alloc.total(), running.chain(idle), asking)
    }

    /// The idle session cache to evict next for a request of `asking` that would hold `extra`
    /// more blocks: caches of users over their share of the pool first, then the least recently
    /// used. A user over its share (with `extra`) takes only its own caches and those of users
    /// over theirs (see [`Shares`]); `None` (nothing else can free memory) takes any.
    fn idle_victim(&self, running: &[Seq], asking: Option<(&UserId, usize)>) -> Option<SessionId> {
        let shares = self.shares(running, asking.map(|(u, _)| u));
        let asker_over = asking.is_some_and(|(u, extra)| shares.over(u, extra));
        self.sessions
            .iter()
            .filter_map(|(id, c)| {
                let over = shares.over(&c.user, 0);
                let own = asking.is_some_and(|(u, _)| *u == c.user);
                (own || over || !asker_over).then_some(((!over, c.last_used), id))
            })
            .min_by_key(|(rank, _)| *rank)
            .map(|(_, id)| id.clone())
    }

    /// Frees the idle session cache [`Self::idle_victim`] picks, copying it to the disk tier
    /// first if there is one; false if there is none.
    pub(super) fn evict_one_idle(
        &mut self,
        store: &impl BlockStore,
        running: &[Seq],
        asking: Option<(&UserId, usize)>,
    ) -> bool {
        let Some(id) = self.idle_victim(running, asking) else {
            return false;
        };
        if let Some(c) = self.sessions.remove(&id) {
            self.spill(store, &id, &c);
            self.release_cache(c);
            self.evictions += 1;
            tracing::debug!(session = %id, "evicted idle session cache");
        }
        true
    }

    /// Copies an evicted session cache to the disk tier, if there is one.
    fn spill(&mut self, store: &impl BlockStore, id: &SessionId, c: &SessionCache) {
        let per = self.pack_per();
        let (Some(disk), false) = (self.disk.as_mut(), c.tokens.is_empty()) else {
            return;
        };
        let (bs, n) = (self.layout.block_size, c.tokens.len());
        // The packed blocks whole, then the table's other blocks.
        let (packed, trimmed) = (c.packed.len(), c.packed.len() * per);
        let records = packed + n.div_ceil(bs) - trimmed;
        let mut failed = None;
        let stored = disk.spill(id.clone(), c.tokens.clone(), packed, records, |i, out| {
            let saved = if i < packed {
                store.save_block(c.packed[i], bs, out)
            } else {
                let j = trimmed + i - packed;
                store.save_block(c.blocks[j], bs.min(n - j * bs), out)
            };
            if let Err(e) = saved {
                failed.get_or_insert(e);
            }
        });
        if let Some(e) = failed {
            tracing::error!(session = %id, error = %e, "cannot copy a session cache to the disk tier");
            disk.remove(id);
        } else if !stored {
            tracing::debug!(session = %id, "session cache too large for the disk tier");
        }
    }

    /// Brings session `id` back from the disk tier as a session cache of its first tokens in
    /// common with `want`, if that is worth more than `than` tokens found elsewhere and memory
    /// allows (`user`'s share of it: see [`Self::idle_victim`]).
    fn restore(
        &mut self,
        store: &mut impl BlockStore,
        running: &[Seq],
        (user, id): (&UserId, &SessionId),
        want: &[u32],
        than: usize,
    ) -> Option<SessionCache> {
        let bs = self.layout.block_size;
        let (common, packed) = {
            let disk = self.disk.as_ref()?;
            let tokens = disk.tokens(id)?;
            let common = tokens.iter().zip(want).take_while(|(a, b)| a == b).count();
            (common, disk.packed(id)?)
        };
        if common <= than || !self.resumable(packed, common) {
            return None;
        }
        let trimmed = packed * self.pack_per();
        let need = packed + common.div_ceil(bs) - trimmed;
        while self.alloc.free() < need && self.evict_one_idle(store, running, Some((user, need))) {}
        let mut fresh = Vec::new();
        // Evictions above may have spilled other sessions and pushed this one out.
        if !self.disk.as_ref()?.contains(id) || !self.alloc.grow(&mut fresh, need * bs, bs) {
            self.alloc.release(&mut fresh);
            return None;
        }
        let spilled = self.disk.as_mut()?.take(id)?;
        let Some(mut tokens) = load_spilled(store, spilled, &fresh, (bs, trimmed)) else {
            tracing::error!(session = %id, "cannot restore a session cache from the disk tier");
            self.alloc.release(&mut fresh);
            return None;
        };
        tokens.truncate(common);
        self.disk_restores += 1;
        let blocks = std::iter::repeat_n(NO_BLOCK, trimmed)
            .chain(fresh[packed..].iter().copied())
            .collect();
        fresh.truncate(packed);
        Some(SessionCache {
            user: user.clone(),
            tokens,
            blocks,
            packed: fresh,
            last_used: self.tick(),
        })
    }

    /// Keeps finished sequence `s`'s K/V as its session's cache (the one before freed), or frees
    /// it when it has no session.
    pub(super) fn retire(&mut self, s: &mut Seq) {
        let Some(id) = s.session.take() else {
            return self.forget(s);
        };
        if let Some(d) = self.disk.as_mut() {
            d.remove(&id);
        }
        s.tokens.truncate(s.kv_len);
        let tokens = std::mem::take(&mut s.tokens);
        self.keep(id, s, tokens);
    }

    /// Makes `s`'s first `kv_len` positions, whose tokens are `tokens`, session `id`'s cache.
    fn keep(&mut self, id: SessionId, s: &mut Seq, tokens: Vec<u32>) {
        self.truncate(&mut s.blocks, s.kv_len);
        let cache = SessionCache {
            user: s.user.clone(),
            tokens,
            blocks: std::mem::take(&mut s.blocks),
            packed: std::mem::take(&mut s.packed),
            last_used: self.tick(),
        };
        if let Some(old) = self.sessions.insert(id, cache) {
            self.release_cache(old);
        }
        s.kv_len = 0;
        s.hashes.clear();
    }

    /// Attaches the longest reusable prefix of `s.tokens` (all but the last token, which must run
    /// for logits): the session's own cache (from the disk tier if need be), or shared blocks of
    /// the prefix cache, whichever is longer. The session cache leaves the map either way (it
    /// becomes the sequence's KV).
    pub(super) fn attach_cached_prefix(
        &mut self,
        store: &mut impl BlockStore,
        running: &[Seq],
        s: &mut Seq,
    ) {
        let bs = self.layout.block_size;
        let limit = s.tokens.len() - 1;
        let hits = self.alloc.lookup_prefix(&s.chain, &s.tokens[..limit], bs);
        let mut cache = s.session.as_ref().and_then(|id| self.sessions.remove(id));
        if let (None, Some(id)) = (&cache, s.session.clone()) {
            let whose = (&s.user, &id);
            cache = self.restore(store, running, whose, &s.tokens[..limit], hits.len() * bs);
        }
        let from_session = cache.as_ref().map_or(0, |c| {
            let common = c.tokens.iter().zip(&s.tokens).take_while(|(a, b)| a == b);
            let at = common.count().min(limit);
            // Too far back into packed history: the sliding layers' rows are gone.
            if self.resumable(c.packed.len(), at) {
                at
            } else {
                0
            }
        });
        // A restore may have reclaimed cached blocks: look again.
        let hits = if hits.is_empty() {
            hits
        } else {
            self.alloc.lookup_prefix(&s.chain, &s.tokens[..limit], bs)
        };
        s.hashes.clear();
        match cache {
            Some(mut c) if from_session > 0 && from_session >= hits.len() * bs => {
                self.alloc.truncate(&mut c.blocks, from_session, bs);
                s.blocks = c.blocks;
                s.packed = c.packed;
                s.kv_len = from_session;
            }
            cache => {
                // Take the shared blocks before releasing the session's: they may be the same.
                for &b in &hits {
                    self.alloc.share(b);
                }
                if let Some(c) = cache {
                    self.release_cache(c);
                }
                s.kv_len = hits.len() * bs;
                s.blocks = hits;
            }
        }
    }

    /// Blocks attached `s` still needs to run the rest of its tokens: its table's growth, and a
    /// copy of the block its next token goes into when that one is shared or registered.
    pub(super) fn blocks_to_run(&self, s: &Seq) -> usize {
        self.blocks_needed(&s.blocks, s.tokens.len() + 1) + usize::from(self.copies_on_write(s))
    }

    fn copies_on_write(&self, s: &Seq) -> bool {
        let bs = self.layout.block_size;
        !s.kv_len.is_multiple_of(bs) && !self.alloc.writable(s.blocks[s.kv_len / bs])
    }

    /// Gives attached `s` the blocks [`Self::blocks_to_run`] counted, which the caller freed:
    /// a private copy of a shared last block, then the table's growth. A block that cannot be
    /// copied makes it start cold.
    pub(super) fn place_attached(&mut self, store: &mut impl BlockStore, s: &mut Seq) -> Placement {
        let bs = self.layout.block_size;
        if self.copies_on_write(s) {
            let at = s.kv_len / bs;
            let Some(fresh) = self.alloc.take_one() else {
                self.detach(s);
                return Placement::Wait;
            };
            if let Err(e) = store.copy_block(s.blocks[at], fresh, s.kv_len % bs) {
                tracing::error!(error = %e, "cannot copy a cached K/V block; recomputing the prompt");
                self.alloc.unref(fresh);
                self.forget(s);
                return self.place_cold(s);
            }
            let old = std::mem::replace(&mut s.blocks[at], fresh);
            self.alloc.unref(old);
        }
        if !self.grow(&mut s.blocks, s.tokens.len() + 1) {
            // The caller's accounting guarantees room; keep the request rather than lose it.
            self.detach(s);
            return Placement::Wait;
        }
        Placement::Ready
    }

    /// Gives `s`, holding nothing, blocks for all its tokens, or says it is too big for the pool.
    pub(super) fn place_cold(&mut self, s: &mut Seq) -> Placement {
        let need_tokens = s.tokens.len() + 1;
        if self.alloc.free() < need_tokens.div_ceil(self.layout.block_size)
            || !self.grow(&mut s.blocks, need_tokens)
        {
            return Placement::TooBig(need_tokens);
        }
        Placement::Ready
    }

    /// Undoes [`Self::attach_cached_prefix`] for a request that must wait: a session keeps what
    /// it had as its cache; shared blocks go back to the prefix cache.
    pub(super) fn detach(&mut self, s: &mut Seq) {
        match s.session.clone() {
            Some(id) if s.kv_len > 0 => {
                let tokens = s.tokens[..s.kv_len].to_vec();
                self.keep(id, s, tokens);
            }
            _ => self.forget(s),
        }
    }

    /// Offers every newly completed block of `s` to the prefix cache.
    pub(super) fn register_full_blocks(&mut self, s: &mut Seq) {
        let bs = self.layout.block_size;
        while (s.hashes.len() + 1) * bs <= s.kv_len {
            let i = s.hashes.len();
            let parent = s.chain.parent(i, s.hashes.last().copied());
            let tokens = &s.tokens[i * bs..(i + 1) * bs];
            let h = match s.blocks[i] {
                // Packed away: only the chain goes on.
                NO_BLOCK => chain_hash(parent, tokens),
                b => self.alloc.register(b, parent, tokens),
            };
            s.hashes.push(h);
        }
    }

    /// Table blocks per packed block (1 when nothing is packed).
    fn pack_per(&self) -> usize {
        self.layout.pack_per.unwrap_or(1)
    }

    /// Whether a cache with `packed` packed blocks can take its next token at position `at`: the
    /// sliding layers must still hold every position that token sees.
    fn resumable(&self, packed: usize, at: usize) -> bool {
        let window = self.layout.sliding_window.unwrap_or(usize::MAX);
        let packed_to = packed * self.pack_per() * self.layout.block_size;
        packed == 0 || at + 1 >= packed_to.saturating_add(window)
    }

    /// Packs the oldest blocks of `s` that its sliding layers can no longer see, a group of
    /// `pack_per` blocks at a time, keeping the window's margin more positions whole so that
    /// rewinding that far (regenerating a reply) still resumes from the cache. Packing reads the
    /// blocks and drops the table's references; blocks in the prefix cache stay there for others.
    pub(super) fn trim(&mut self, store: &mut impl BlockStore, s: &mut Seq) {
        let KvLayout {
            block_size: bs,
            pack_per: Some(per),
            sliding_window: Some(window),
            window_margin: Some(margin),
        } = self.layout
        else {
            return;
        };
        // The first position whose sliding rows must stay, after a rewind of up to `margin`.
        let keep_from = (s.kv_len + 1).saturating_sub(window.saturating_add(margin));
        let groups = keep_from / (per * bs);
        while s.packed.len() < groups && s.hashes.len() >= (s.packed.len() + 1) * per {
            let Some(dst) = self.alloc.take_one() else {
                return;
            };
            let g = s.packed.len();
            let src = &mut s.blocks[g * per..(g + 1) * per];
            store.pack(src, dst);
            for b in src.iter_mut() {
                self.alloc.unref(std::mem::replace(b, NO_BLOCK));
            }
            s.packed.push(dst);
        }
    }
}

/// Writes a spilled session's blocks into `fresh` (its packed blocks first, then the table's
/// blocks after the `trimmed` packed away); its tokens, or `None` when a block cannot be loaded.
fn load_spilled(
    store: &mut impl BlockStore,
    spilled: Spilled<'_>,
    fresh: &[BlockId],
    (bs, trimmed): (usize, usize),
) -> Option<Vec<u32>> {
    let Spilled {
        tokens,
        packed,
        blocks,
    } = spilled;
    let stored = tokens.len();
    for (i, (&b, bytes)) in fresh.iter().zip(&blocks).enumerate() {
        let n = match i.checked_sub(packed) {
            None => bs,
            Some(j) => bs.min(stored - (trimmed + j) * bs),
        };
        if let Err(e) = store.load_block(b, n, bytes) {
            tracing::error!(error = %e, "cannot load a K/V block from the disk tier");
            return None;
        }
    }
    Some(tokens)
}

#[cfg(test)]
#[path = "kv_tests.rs"]
mod tests;
