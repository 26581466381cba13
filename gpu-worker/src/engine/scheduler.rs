//! The scheduler: plain synchronous state driven by the engine thread (and directly by tests).
//!
//! Each [`Scheduler::step`] admits waiting requests while KV blocks allow (evicting idle session
//! caches by each user's share of the pool: see [`super::share`]), gives every running sequence
//! its slice of the step — one token when decoding, a chunk of the prompt when prefilling — runs
//! one batched forward pass, and samples a token for every sequence that reached the end of its
//! input. Finished sequences leave at once; their KV stays behind as the session's cache for the
//! next turn.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use hearth_shared::{FinishReason, RequestId, SessionId, UserId};
use std::sync::Mutex;

use super::backend::{Backend, Weights};
use super::constraint::{Constraint, Next};
use super::lookup;
use super::share::Shares;
use super::types::{EngineConfig, EngineEvent, EngineStats, ValidRequest};
use super::work::{StepTimes, WorkModel};
use super::{EngineError, EventSender, ModelInfo};
use crate::kernels::SpinPool;
use crate::kv::{chain_hash, BlockAllocator, BlockId, DiskTier, Packing, NO_BLOCK};
use crate::model::SeqChunk;
use crate::sampling::LogitSummary;
use llguidance::toktrie::SimpleVob;
use seq::{Cancel, Seq, SeqState};

mod prefill;
mod seq;

/// Most remembered cancels of requests not yet seen.
const EARLY_CANCELS_MAX: usize = 4096;

/// What one step's forward pass ran; the engine thread turns it into metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepSummary {
    /// Sequences that produced one new token from one input token.
    pub decode_seqs: usize,
    /// Sequences that ran a chunk of prompt (or recompute after preemption).
    pub prefill_seqs: usize,
    pub prefill_tokens: usize,
    /// Tokens the decoding sequences produced: one each, plus the draft tokens kept.
    pub decode_tokens: usize,
}

impl StepSummary {
    pub fn batch_size(&self) -> usize {
        self.decode_seqs + self.prefill_seqs
    }

    /// `decode`, `prefill`, or `mixed` when a step did both.
    pub fn phase(&self) -> &'static str {
        match (self.decode_seqs > 0, self.prefill_seqs > 0) {
            (true, true) => "mixed",
            (false, true) => "prefill",
            _ => "decode",
        }
    }
}

/// The outcome of trying to give a waiting request its KV blocks.
enum Placement {
    Ready,
    /// Not enough memory now; try again at a later step.
    Wait,
    /// Needs more tokens than the whole budget holds.
    TooBig(usize),
}

/// A session's KV left behind by its last turn.
#[derive(Debug)]
struct SessionCache {
    /// Whose session: its blocks count towards that user's share of the pool.
    user: UserId,
    tokens: Vec<u32>,
    blocks: Vec<BlockId>,
    /// Packed global layers of the table's leading [`NO_BLOCK`] entries.
    packed: Vec<BlockId>,
    last_used: u64,
}

/// Blocks a table holds: its own (not those packed away) and its packed ones.
fn held(blocks: &[BlockId], packed: &[BlockId]) -> usize {
    blocks.iter().filter(|&&b| b != NO_BLOCK).count() + packed.len()
}

/// Releases a table and its packed blocks.
fn release(alloc: &mut BlockAllocator, blocks: &mut Vec<BlockId>, packed: &mut Vec<BlockId>) {
    alloc.release(blocks);
    alloc.release(packed);
}

/// Fewest prompt tokens' work (at a prompt's start) a step with decoding sequences prefills when
/// prompts wait, so a prompt arriving beside one or two streams is not cut into tiny steps.
const MIN_PREFILL_WITH_DECODES: usize = 32;

/// A step's prefill budget: prompt tokens, and their work in multiply-adds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PrefillBudget {
    pub tokens: usize,
    pub work: f64,
    /// The work is a whole chunk's: a prompt's next token runs even if it costs more.
    pub full: bool,
}

#[derive(Debug)]
pub struct Scheduler {
    /// The architecture's settings (sliding window, sizes), from the weights.
    model_config: crate::model::GemmaConfig,
    config: EngineConfig,
    /// What tokens cost, to hold the prefill beside decoding sequences to a share of their work.
    work: WorkModel,
    /// What passes take here: the prefill's share beside decoding sequences is one of time.
    times: StepTimes,
    /// Prompt work allowed beside decoding sequences in earlier steps and not spent because the
    /// next prompt token cost more: the share holds on average, and a token deep in a long
    /// prompt runs every few steps instead of lengthening every step.
    prefill_credit: f64,
    info: ModelInfo,
    alloc: BlockAllocator,
    /// The forward pass and the K/V storage it reads and writes.
    backend: Backend,
    waiting: Vec<Seq>,
    running: Vec<Seq>,
    sessions: HashMap<SessionId, SessionCache>,
    /// Where evicted session caches go, when configured.
    disk: Option<DiskTier>,
    disk_restores: usize,
    clock: u64,
    evictions: usize,
    preemptions: usize,
    /// Prompt tokens looked up in the cache at admission, and those found there.
    prefix_queries: usize,
    prefix_hits: usize,
    spec_drafted: usize,
    spec_accepted: usize,
    /// Highest request id enqueued so far; see `early_cancels`.
    max_id_seen: u64,
    /// Cancels that overtook their request (they travel on another channel). Only ids above
    /// `max_id_seen` are kept, as those requests may still arrive; the set is bounded.
    early_cancels: HashSet<RequestId>,
    /// The last step's logits, kept so the next step writes into memory already faulted in.
    logits: Vec<f32>,
    /// How long the last step's forward pass took: a grammar whose masks take longer holds up
    /// the others' sampling unless its sequence sits out (see [`Scheduler::masks_pending`]).
    last_forward: Duration,
    /// This step runs sequences whose masks are late because nothing else could run: its
    /// sampling waits for them.
    waits_for_masks: bool,
}

impl Scheduler {
    pub fn new(weights: impl Into<Weights>, config: EngineConfig) -> Result<Self, EngineError> {
        let weights = weights.into();
        let c = weights.config();
        check(&config)?;
        let block_bytes = weights.block_bytes(&config)?;
        let num_blocks = config.kv_budget_bytes / block_bytes;
        if num_blocks == 0 {
            return Err(EngineError::Internal(format!(
                "KV budget of {} bytes is less than one block ({block_bytes} bytes)",
                config.kv_budget_bytes
            )));
        }
        let (bos_id, eos_id, end_of_turn_id) = weights.special();
        let default_stop_ids = [eos_id, end_of_turn_id].into_iter().flatten().collect();
        let info = ModelInfo {
            architecture: c.architecture.clone(),
            context_length: config
                .max_context
                .map_or(c.context_length, |m| m.min(c.context_length)),
            vocab_size: c.vocab_size,
            bos_id,
            eos_id,
            end_of_turn_id,
            default_stop_ids,
            kv_capacity_tokens: num_blocks * config.block_size,
            block_size: config.block_size,
            kv_block_bytes: block_bytes,
            max_batch: config.max_batch,
            max_waiting: config.max_waiting,
            command_queue: config.command_queue,
        };
        // Old positions keep only their global layers once the sliding layers cannot see them.
        let packing = config.kv_window_margin.and_then(|_| {
            c.sliding_window?;
            let globals = (0..c.num_layers).filter(|&l| !c.is_sliding(l)).collect();
            Packing::new(c.num_layers, globals)
        });
        let backend = Backend::new(&weights, num_blocks, &config, packing)?;
        let disk = match &config.kv_disk {
            Some(d) => Some(
                DiskTier::create(&d.dir, d.bytes, backend.saved_bytes(config.block_size)).map_err(
                    |e| EngineError::Internal(format!("KV disk tier in {}: {e}", d.dir.display())),
                )?,
            ),
            None => None,
        };
        Ok(Self {
            model_config: c.clone(),
            backend,
            alloc: BlockAllocator::new(num_blocks),
            config,
            work: WorkModel::new(c),
            times: StepTimes::default(),
            prefill_credit: 0.0,
            info,
            waiting: Vec::new(),
            running: Vec::new(),
            sessions: HashMap::new(),
            disk,
            disk_restores: 0,
            clock: 0,
            evictions: 0,
            preemptions: 0,
            prefix_queries: 0,
            prefix_hits: 0,
            spec_drafted: 0,
            spec_accepted: 0,
            max_id_seen: 0,
            early_cancels: HashSet::new(),
            logits: Vec::new(),
            last_forward: Duration::ZERO,
            waits_for_masks: false,
        })
    }

    pub fn model_info(&self) -> ModelInfo {
        self.info.clone()
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_blocks_used: self.alloc.used(),
            kv_blocks_total: self.alloc.total(),
            kv_blocks_cached: self.alloc.cached(),
            cached_sessions: self.sessions.len(),
            disk_sessions: self.disk.as_ref().map_or(0, DiskTier::sessions),
            disk_restores: self.disk_restores,
            session_evictions: self.evictions,
            preemptions: self.preemptions,
            steps: 0,
            prefix_cache_queries_tokens: self.prefix_queries,
            prefix_cache_hits_tokens: self.prefix_hits,
            spec_draft_tokens: self.spec_drafted,
            spec_accepted_tokens: self.spec_accepted,
        }
    }

    /// Queues a validated request, or answers it at once with an error.
    pub(crate) fn enqueue(&mut self, req: ValidRequest, events: EventSender) {
        let id = req.inner.id;
        self.max_id_seen = self.max_id_seen.max(id.0);
        if self.running.iter().chain(&self.waiting).any(|s| s.id == id) {
            let _ = events.send(EngineEvent::Error(EngineError::DuplicateRequest(id)));
            return;
        }
        // Requests the next step will admit into free batch slots are not really waiting.
        let free_slots = self.config.max_batch.saturating_sub(self.running.len());
        if self.waiting.len() >= self.config.max_waiting + free_slots {
            let _ = events.send(EngineEvent::Error(EngineError::QueueFull {
                limit: self.config.max_waiting,
            }));
            return;
        }
        let cancelled = self.early_cancels.remove(&id);
        self.waiting.push(Seq::new(
            req,
            events,
            &self.config,
            SeqState::new(cancelled),
        ));
    }

    pub(crate) fn cancel(&mut self, id: RequestId) {
        let mut found = false;
        for s in self.running.iter_mut().chain(self.waiting.iter_mut()) {
            if s.id == id {
                s.cancel(Cancel::Client);
                found = true;
            }
        }
        if !found && id.0 > self.max_id_seen {
            if self.early_cancels.len() >= EARLY_CANCELS_MAX {
                self.early_cancels.clear();
            }
            self.early_cancels.insert(id);
        }
    }

    /// Ends every sequence because the worker is shutting down (a drain past its deadline).
    pub(crate) fn cancel_all(&mut self) {
        for s in self.running.iter_mut().chain(self.waiting.iter_mut()) {
            s.cancel(Cancel::Shutdown);
        }
    }

    pub(crate) fn drop_session(&mut self, id: &SessionId) -> Result<(), EngineError> {
        let on_disk = self.disk.as_mut().is_some_and(|d| d.remove(id));
        match self.sessions.remove(id) {
            Some(mut c) => {
                release(&mut self.alloc, &mut c.blocks, &mut c.packed);
                Ok(())
            }
            None if on_disk => Ok(()),
            None => Err(EngineError::UnknownSession(id.clone())),
        }
    }

    /// Ends every running sequence with an internal error (after a failed step).
    pub(crate) fn fail_running(&mut self, why: &str) {
        for mut s in std::mem::take(&mut self.running) {
            s.send(EngineEvent::Error(EngineError::Internal(why.into())));
            release(&mut self.alloc, &mut s.blocks, &mut s.packed);
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Who holds how much of the pool, `asking` counted as a user even if it holds nothing yet.
    fn shares<'a>(&'a self, asking: Option<&'a UserId>) -> Shares<'a> {
        let running = self
            .running
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
    fn idle_victim(&self, asking: Option<(&UserId, usize)>) -> Option<SessionId> {
        let shares = self.shares(asking.map(|(u, _)| u));
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

    /// Frees the idle session cache [`Self::idle_victim`] picks; false if there is none.
    fn evict_one_idle(&mut self, asking: Option<(&UserId, usize)>) -> bool {
        let Some(id) = self.idle_victim(asking) else {
            return false;
        };
        if let Some(mut c) = self.sessions.remove(&id) {
            self.spill(&id, &c);
            release(&mut self.alloc, &mut c.blocks, &mut c.packed);
            self.evictions += 1;
            tracing::debug!(session = %id, "evicted idle session cache");
        }
        true
    }

    /// Copies an evicted session cache to the disk tier, if there is one.
    fn spill(&mut self, id: &SessionId, c: &SessionCache) {
        let per = self.pack_per();
        let (Some(disk), false) = (self.disk.as_mut(), c.tokens.is_empty()) else {
            return;
        };
        let (bs, n) = (self.config.block_size, c.tokens.len());
        let kv = &self.backend;
        // The packed blocks whole, then the table's other blocks.
        let (packed, trimmed) = (c.packed.len(), c.packed.len() * per);
        let records = packed + n.div_ceil(bs) - trimmed;
        let mut failed = None;
        let stored = disk.spill(id.clone(), c.tokens.clone(), packed, records, |i, out| {
            let saved = if i < packed {
                kv.save_block(c.packed[i], bs, out)
            } else {
                let j = trimmed + i - packed;
                kv.save_block(c.blocks[j], bs.min(n - j * bs), out)
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

    /// Brings session `id` back from the disk tier as a session cache of its first `n` tokens
    /// (at most), if that is worth more than `than` tokens found elsewhere and memory allows
    /// (`user`'s share of it: see [`Self::idle_victim`]).
    fn restore(
        &mut self,
        user: &UserId,
        id: &SessionId,
        want: &[u32],
        than: usize,
    ) -> Option<SessionCache> {
        let bs = self.config.block_size;
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
        while self.alloc.free() < need && self.evict_one_idle(Some((user, need))) {}
        let mut fresh = Vec::new();
        // Evictions above may have spilled other sessions and pushed this one out.
        if !self.disk.as_ref()?.contains(id) || !self.alloc.grow(&mut fresh, need * bs, bs) {
            self.alloc.release(&mut fresh);
            return None;
        }
        let crate::kv::Spilled {
            mut tokens,
            blocks: bytes,
            ..
        } = self.disk.as_mut()?.take(id)?;
        let stored = tokens.len();
        let blocks: Vec<BlockId> = std::iter::repeat_n(NO_BLOCK, trimmed)
            .chain(fresh[packed..].iter().copied())
            .collect();
        for (i, (&b, bytes)) in fresh.iter().zip(&bytes).enumerate() {
            let n = match i.checked_sub(packed) {
                None => bs,
                Some(j) => bs.min(stored - (trimmed + j) * bs),
            };
            if let Err(e) = self.backend.load_block(b, n, bytes) {
                tracing::error!(session = %id, error = %e, "cannot restore a session cache from the disk tier");
                self.alloc.release(&mut fresh);
                return None;
            }
        }
        drop(bytes);
        tokens.truncate(common);
        self.disk_restores += 1;
        let last_used = self.tick();
        fresh.truncate(packed);
        Some(SessionCache {
            user: user.clone(),
            tokens,
            blocks,
            packed: fresh,
            last_used,
        })
    }

    /// Removes cancelled sequences and those whose client went away.
    fn reap_cancelled(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            let s = &self.running[i];
            if s.cancelled() || s.events.is_closed() {
                let s = self.running.swap_remove(i);
                s.end_cancelled();
                self.retire(s);
            } else {
                i += 1;
            }
        }
        self.waiting.retain(|s| {
            let gone = s.cancelled() || s.events.is_closed();
            if gone {
                s.end_cancelled();
            }
            !gone
        });
    }

    /// Ends the decoding sequences whose grammar is already known to be complete with nothing
    /// to follow, before a step would run them only to learn it.
    fn end_complete_grammars(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            let s = &mut self.running[i];
            let decoding = s.tokens.len() - s.kv_len == 1;
            if decoding && s.constraint.as_mut().is_some_and(Constraint::done_now) {
                let s = self.running.swap_remove(i);
                s.finish(FinishReason::Stop);
                self.retire(s);
            } else {
                i += 1;
            }
        }
    }

    /// A finished sequence's KV becomes its session's cache (or is freed).
    fn retire(&mut self, mut s: Seq) {
        match s.session.take() {
            Some(id) => {
                if let Some(d) = self.disk.as_mut() {
                    d.remove(&id);
                }
                s.tokens.truncate(s.kv_len);
                self.alloc
                    .truncate(&mut s.blocks, s.kv_len, self.config.block_size);
                let last_used = self.tick();
                let cache = SessionCache {
                    user: s.user.clone(),
                    tokens: std::mem::take(&mut s.tokens),
                    blocks: std::mem::take(&mut s.blocks),
                    packed: std::mem::take(&mut s.packed),
                    last_used,
                };
                if let Some(mut old) = self.sessions.insert(id, cache) {
                    release(&mut self.alloc, &mut old.blocks, &mut old.packed);
                }
            }
            None => release(&mut self.alloc, &mut s.blocks, &mut s.packed),
        }
    }

    /// Index of the next waiting request to admit: the user with the fewest running sequences
    /// first (fair share), preempted sequences before new ones, then arrival order.
    fn next_waiting(&self) -> Option<usize> {
        let mut per_user: HashMap<&UserId, usize> = HashMap::new();
        for s in &self.running {
            *per_user.entry(&s.user).or_default() += 1;
        }
        (0..self.waiting.len()).min_by_key(|&i| {
            let s = &self.waiting[i];
            (
                per_user.get(&s.user).copied().unwrap_or(0),
                !s.was_preempted(),
                s.arrived,
            )
        })
    }

    /// Admits waiting requests while batch slots and KV blocks allow.
    fn admit(&mut self) {
        while self.running.len() < self.config.max_batch {
            let Some(i) = self.next_waiting() else { return };
            let mut s = self.waiting.remove(i);
            match self.place(&mut s) {
                Placement::Ready => {}
                Placement::Wait => {
                    self.waiting.push(s);
                    return;
                }
                Placement::TooBig(need) => {
                    // Cannot fit even in an empty engine; validation normally prevents this.
                    s.send(EngineEvent::Error(EngineError::KvBudgetTooSmall {
                        need,
                        capacity: self.info.kv_capacity_tokens,
                    }));
                    continue;
                }
            }
            let now = Instant::now();
            if !s.was_preempted() {
                self.prefix_queries += s.prompt_len;
                self.prefix_hits += s.kv_len;
                s.cached_tokens = s.kv_len;
                s.admitted = Some(now);
                s.send(EngineEvent::Started {
                    cached_tokens: s.kv_len,
                    queue_ms: now.duration_since(s.arrived).as_secs_f64() * 1e3,
                });
            }
            self.running.push(s);
        }
    }

    /// Gives `s` the longest cached prefix of its input (its session's cache, or blocks of the
    /// prefix cache) and blocks for the rest, evicting idle sessions as needed.
    fn place(&mut self, s: &mut Seq) -> Placement {
        let bs = self.config.block_size;
        let need_tokens = s.tokens.len() + 1;
        self.attach_cached_prefix(s);
        // The block the next token goes into may be registered (immutable) or shared: copy it.
        let cow = !s.kv_len.is_multiple_of(bs) && !self.alloc.writable(s.blocks[s.kv_len / bs]);
        let need =
            BlockAllocator::blocks_needed(s.blocks.len(), need_tokens, bs) + usize::from(cow);
        if !self.free_for(s, need) {
            if !self.running.is_empty() {
                self.detach(s);
                return Placement::Wait;
            }
            // Nothing runs and no idle session is left: only this request's own prefix holds
            // memory. Start it cold rather than wait forever.
            release(&mut self.alloc, &mut s.blocks, &mut s.packed);
            s.kv_len = 0;
            if self.alloc.free() < need_tokens.div_ceil(bs) {
                return Placement::TooBig(need_tokens);
            }
            return self.place_cold(s, need_tokens);
        }
        if cow {
            let at = s.kv_len / bs;
            let Some(fresh) = self.alloc.take_one() else {
                self.detach(s);
                return Placement::Wait;
            };
            if let Err(e) = self.backend.copy_block(s.blocks[at], fresh, s.kv_len % bs) {
                tracing::error!(error = %e, "cannot copy a cached K/V block; recomputing the prompt");
                self.alloc.unref(fresh);
                release(&mut self.alloc, &mut s.blocks, &mut s.packed);
                s.kv_len = 0;
                return self.place_cold(s, need_tokens);
            }
            let old = std::mem::replace(&mut s.blocks[at], fresh);
            self.alloc.unref(old);
        }
        if !self.alloc.grow(&mut s.blocks, need_tokens, bs) {
            // Accounting above guarantees room; keep the request rather than lose it.
            self.detach(s);
            return Placement::Wait;
        }
        Placement::Ready
    }

    /// Frees `need` blocks for waiting `s`: idle session caches within its user's share of the
    /// pool (see [`Self::idle_victim`]), then a place another user holds by fair share
    /// ([`Self::preempt_for`]), and, when nothing runs that would free memory later, any idle
    /// cache rather than have `s` wait for other users' next turns. Whether they are free.
    fn free_for(&mut self, s: &Seq, need: usize) -> bool {
        let asking = Some((&s.user, held(&s.blocks, &s.packed) + need));
        while self.alloc.free() < need && self.evict_one_idle(asking) {}
        while self.alloc.free() < need && self.preempt_for(&s.user) {}
        while self.alloc.free() < need && self.running.is_empty() && self.evict_one_idle(None) {}
        self.alloc.free() >= need
    }

    fn place_cold(&mut self, s: &mut Seq, need_tokens: usize) -> Placement {
        if self
            .alloc
            .grow(&mut s.blocks, need_tokens, self.config.block_size)
        {
            Placement::Ready
        } else {
            Placement::TooBig(need_tokens)
        }
    }

    /// Attaches the longest reusable prefix of `s.tokens` (all but the last token, which must run
    /// for logits): the session's own cache, or shared blocks of the prefix cache, whichever is
    /// longer. The session cache leaves the map either way (it becomes the sequence's KV).
    fn attach_cached_prefix(&mut self, s: &mut Seq) {
        let bs = self.config.block_size;
        let limit = s.tokens.len() - 1;
        let hits = self.alloc.lookup_prefix(&s.chain, &s.tokens[..limit], bs);
        let mut cache = s.session.as_ref().and_then(|id| self.sessions.remove(id));
        if let (None, Some(id)) = (&cache, s.session.clone()) {
            cache = self.restore(&s.user, &id, &s.tokens[..limit], hits.len() * bs);
        }
        let from_session = cache.as_ref().map_or(0, |c| {
            let common = c
                .tokens
                .iter()
                .zip(&s.tokens)
                .take_while(|(a, b)| a == b)
                .count();
            let at = common.min(limit);
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
                if let Some(mut c) = cache {
                    release(&mut self.alloc, &mut c.blocks, &mut c.packed);
                }
                s.kv_len = hits.len() * bs;
                s.blocks = hits;
            }
        }
    }

    /// Undoes [`Self::attach_cached_prefix`] for a request that must wait: a session keeps what
    /// it had as its cache; shared blocks go back to the prefix cache.
    fn detach(&mut self, s: &mut Seq) {
        let bs = self.config.block_size;
        match (&s.session, s.kv_len > 0) {
            (Some(id), true) => {
                self.alloc.truncate(&mut s.blocks, s.kv_len, bs);
                let last_used = self.tick();
                let cache = SessionCache {
                    user: s.user.clone(),
                    tokens: s.tokens[..s.kv_len].to_vec(),
                    blocks: std::mem::take(&mut s.blocks),
                    packed: std::mem::take(&mut s.packed),
                    last_used,
                };
                if let Some(mut old) = self.sessions.insert(id.clone(), cache) {
                    release(&mut self.alloc, &mut old.blocks, &mut old.packed);
                }
            }
            _ => release(&mut self.alloc, &mut s.blocks, &mut s.packed),
        }
        s.kv_len = 0;
        s.hashes.clear();
    }

    /// Offers every newly completed block of `running[ix]` to the prefix cache.
    fn register_full_blocks(&mut self, ix: usize) {
        let bs = self.config.block_size;
        let s = &mut self.running[ix];
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
        self.backend.packing().map_or(1, |p| p.per)
    }

    /// Whether a cache with `packed` packed blocks can take its next token at position `at`: the
    /// sliding layers must still hold every position that token sees.
    fn resumable(&self, packed: usize, at: usize) -> bool {
        let window = self.model_config.sliding_window.unwrap_or(usize::MAX);
        packed == 0
            || at + 1 >= (packed * self.pack_per() * self.config.block_size).saturating_add(window)
    }

    /// Packs the oldest blocks of `running[ix]` that its sliding layers can no longer see, a
    /// group of [`Packing::per`] blocks at a time, keeping `kv_window_margin` more positions
    /// whole so that rewinding that far (regenerating a reply) still resumes from the cache.
    /// Packing reads the blocks and drops the table's references; blocks in the prefix cache stay
    /// there for others.
    fn trim(&mut self, ix: usize) {
        let (Some(margin), Some(window)) = (
            self.config.kv_window_margin,
            self.model_config.sliding_window,
        ) else {
            return;
        };
        if self.backend.packing().is_none() {
            return;
        }
        let (bs, per) = (self.config.block_size, self.pack_per());
        let s = &mut self.running[ix];
        // The first position whose sliding rows must stay, after a rewind of up to `margin`.
        let keep_from = (s.kv_len + 1).saturating_sub(window.saturating_add(margin));
        let groups = keep_from / (per * bs);
        while s.packed.len() < groups && s.hashes.len() >= (s.packed.len() + 1) * per {
            let Some(dst) = self.alloc.take_one() else {
                return;
            };
            let g = s.packed.len();
            let src = &mut s.blocks[g * per..(g + 1) * per];
            self.backend.pack(src, dst);
            for b in src.iter_mut() {
                self.alloc.unref(std::mem::replace(b, NO_BLOCK));
            }
            s.packed.push(dst);
        }
    }

    /// Index of the youngest running sequence (of `user`, if given).
    fn youngest(&self, user: Option<&UserId>) -> Option<usize> {
        (0..self.running.len())
            .filter(|&i| user.is_none_or(|u| self.running[i].user == *u))
            .max_by_key(|&i| self.running[i].arrived)
    }

    /// Index of the running sequence to preempt when one runs out of memory: the youngest of the
    /// user holding the most beyond its share of the pool, else the youngest of all.
    fn memory_victim(&self) -> Option<usize> {
        let shares = self.shares(None);
        let heaviest = shares.over_share().into_iter();
        heaviest
            .filter_map(|u| self.youngest(Some(u)))
            .next()
            .or_else(|| self.youngest(None))
    }

    /// Fair share of the K/V memory: a request of `user`, who has no sequence running, that
    /// finds no room does not wait for another user's long replies to end. The user with the
    /// most running sequences (then the most blocks) gives up its youngest, recomputed later,
    /// as the orchestrator's fair share takes a place from the user holding the most: when it
    /// holds two or more, or more blocks than an equal share of the pool (one huge prompt).
    /// What that sequence had computed stays in the prefix cache, which gives up its last
    /// blocks first, so its recompute is mostly a cache hit. True when one was preempted.
    fn preempt_for(&mut self, user: &UserId) -> bool {
        if self.running.iter().any(|r| &r.user == user) {
            return false;
        }
        let mut per_user: HashMap<&UserId, (usize, usize)> = HashMap::new();
        for r in &self.running {
            let counts = per_user.entry(&r.user).or_default();
            counts.0 += 1;
            counts.1 += held(&r.blocks, &r.packed);
        }
        let equal_share = self.alloc.total() / (per_user.len() + 1);
        let Some((victim, _)) = per_user
            .into_iter()
            .filter(|(_, (n, blocks))| *n >= 2 || *blocks > equal_share)
            .max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(a.0)))
        else {
            return false;
        };
        let victim = victim.clone();
        match self.youngest(Some(&victim)) {
            Some(i) => {
                self.preempt_at(i);
                true
            }
            None => false,
        }
    }

    /// Puts running sequence `i` back in the queue, freeing its KV for recompute.
    fn preempt_at(&mut self, i: usize) -> RequestId {
        let mut s = self.running.remove(i);
        s.drop_draft();
        release(&mut self.alloc, &mut s.blocks, &mut s.packed);
        s.kv_len = 0;
        s.hashes.clear();
        s.mark_preempted();
        self.preemptions += 1;
        tracing::debug!(request = %s.id, "preempted for recompute");
        let id = s.id;
        self.waiting.push(s);
        id
    }

    /// One engine step. Returns what the forward pass ran, or `None` when there was nothing to do.
    /// Its phases: admit work, plan who runs how many tokens (growing block tables, drafting,
    /// evicting and preempting as memory needs), run the forward pass, sample or verify each
    /// sequence's rows, then settle block tables and retire finished sequences.
    pub fn step(&mut self) -> Option<StepSummary> {
        self.reap_cancelled();
        self.end_complete_grammars();
        self.admit();
        if self.running.is_empty() {
            return None;
        }
        // Oldest first: they get blocks first, and the youngest are preempted if memory runs out.
        self.running.sort_by_key(|s| s.arrived);
        let plan = self.plan();
        if plan.is_empty() {
            return None;
        }
        let order: Vec<usize> = plan
            .iter()
            .map(|(id, _)| {
                self.running
                    .iter()
                    .position(|s| s.id == *id)
                    .unwrap_or(usize::MAX)
            })
            .collect();
        let mut logits = std::mem::take(&mut self.logits);
        let mut summaries = Vec::new();
        let work = self.step_work(&plan, &order);
        let started = Instant::now();
        let ran = self.forward(&plan, &order, &mut logits, &mut summaries);
        self.last_forward = started.elapsed();
        let Ok((mut summary, rows)) = ran else {
            self.logits = logits;
            return ran.err();
        };
        let secs = self.last_forward.as_secs_f64();
        self.times.record(summary.decode_seqs > 0, work, secs);
        let finished = self.pick(&plan, &order, &rows, &mut logits, &summaries, &mut summary);
        self.settle(&order, finished);
        self.logits = logits;
        Some(summary)
    }

    /// Who runs how many tokens this step, oldest first: a decoding sequence its next token (and
    /// a draft where speculation pays), a prompt its share of the prefill budget. Each gets the
    /// blocks it needs, by evicting idle sessions, then by preempting the youngest running
    /// sequence (which leaves the plan). A sequence whose grammar's mask is late sits out,
    /// unless nothing else would run.
    fn plan(&mut self) -> Vec<(RequestId, usize)> {
        let held = self.masks_pending();
        let credit = self.prefill_credit;
        let plan = self.plan_without(&held);
        self.waits_for_masks = plan.is_empty() && !held.is_empty();
        if self.waits_for_masks {
            self.prefill_credit = credit;
            return self.plan_without(&HashSet::new());
        }
        plan
    }

    /// [`Scheduler::plan`], with the sequences `held` sitting out.
    fn plan_without(&mut self, held: &HashSet<RequestId>) -> Vec<(RequestId, usize)> {
        let decoding = self
            .running
            .iter()
            .filter(|s| s.tokens.len() - s.kv_len == 1)
            .count();
        let prefilling = self.running.len() > decoding;
        let budget = self.prefill_budget(held);
        let shares = self.prefill_shares(budget);
        // Prompts wait and none could move: what the budget allowed carries over.
        let stalled = !shares.is_empty() && shares.values().all(|&n| n == 0);
        self.prefill_credit = if stalled { budget.work } else { 0.0 };
        // Drafts only where verifying them is nearly free (see `EngineConfig::spec_max_batch`).
        let speculate =
            self.config.spec_tokens > 0 && !prefilling && decoding <= self.config.spec_max_batch;
        let mut plan: Vec<(RequestId, usize)> = Vec::with_capacity(self.running.len());
        let mut i = 0;
        while i < self.running.len() {
            let pending = self.running[i].tokens.len() - self.running[i].kv_len;
            let n = if pending <= 1 {
                pending
            } else {
                shares.get(&self.running[i].id).copied().unwrap_or(0)
            };
            if n == 0 || held.contains(&self.running[i].id) {
                i += 1;
                continue;
            }
            if speculate && pending == 1 && self.running[i].constraint.is_none() {
                if let Some(tokens) = self.draft(i) {
                    plan.push((self.running[i].id, tokens));
                    i += 1;
                    continue;
                }
            }
            match self.make_room(i, n, &mut plan) {
                Ok(at) => {
                    plan.push((self.running[at].id, n));
                    i = at + 1;
                }
                Err(at) => i = at,
            }
        }
        plan
    }

    /// The decoding sequences that sit this step out because their grammar's next mask is still
    /// being computed and its masks come later than a forward pass takes: a heavy grammar then
    /// delays its own sequence, not every other sequence's sampling. A mask that is merely
    /// still on its way (the usual case: it is computed during the forward pass) holds nothing
    /// back. None when that would leave nothing to run (the step then waits for the masks).
    fn masks_pending(&mut self) -> HashSet<RequestId> {
        let forward = self.last_forward;
        let held: HashSet<RequestId> = self
            .running
            .iter_mut()
            .filter(|s| s.tokens.len() - s.kv_len == 1)
            .filter_map(|s| {
                s.constraint
                    .as_mut()
                    .is_some_and(|c| !c.mask_ready() && c.lateness() > forward)
                    .then_some(s.id)
            })
            .collect();
        if held.len() == self.running.len() {
            return HashSet::new();
        }
        held
    }

    /// Drafts tokens after running sequence `i`'s next one by prompt lookup, where free blocks
    /// hold them (a draft never evicts or preempts anything); the tokens it then runs.
    fn draft(&mut self, i: usize) -> Option<usize> {
        let (bs, ctx) = (self.config.block_size, self.info.context_length);
        let s = &self.running[i];
        // Never past the reply's length or the context: every draft token kept is a token
        // emitted, and its position is written.
        let room = (s.max_new - s.generated)
            .saturating_sub(1)
            .min(ctx.saturating_sub(s.tokens.len() + 1));
        let draft = lookup::draft(&s.tokens, s.draft_cap.min(room)).to_vec();
        let want = s.kv_len + 1 + draft.len();
        if draft.is_empty() || !self.alloc.grow(&mut self.running[i].blocks, want, bs) {
            return None;
        }
        let s = &mut self.running[i];
        s.draft = draft.len();
        s.tokens.extend(draft);
        Some(1 + s.draft)
    }

    /// Grows running sequence `i`'s table for `n` more positions, evicting idle sessions within
    /// its user's share of the pool (any, when it runs alone), then preempting sequences (see
    /// [`Self::memory_victim`]) and taking them out of `plan`. Its index then (earlier ones may
    /// have gone), or `Err` with it when it was itself preempted.
    fn make_room(
        &mut self,
        mut i: usize,
        n: usize,
        plan: &mut Vec<(RequestId, usize)>,
    ) -> Result<usize, usize> {
        let bs = self.config.block_size;
        let want = self.running[i].kv_len + n;
        let user = self.running[i].user.clone();
        while !self.alloc.grow(&mut self.running[i].blocks, want, bs) {
            let extra = BlockAllocator::blocks_needed(self.running[i].blocks.len(), want, bs);
            let alone = self.running.len() == 1;
            if self.evict_one_idle(Some((&user, extra))) || alone && self.evict_one_idle(None) {
                continue;
            }
            // Sequence `i` itself runs, so there is always one.
            let Some(v) = self.memory_victim() else {
                return Err(i);
            };
            let victim = self.preempt_at(v);
            plan.retain(|(p, _)| *p != victim);
            match v.cmp(&i) {
                std::cmp::Ordering::Equal => return Err(i),
                std::cmp::Ordering::Less => i -= 1,
                std::cmp::Ordering::Greater => {}
            }
        }
        Ok(i)
    }

    /// The forward pass over the plan (`order`: each planned sequence's index in `running`): its
    /// logits and summaries, what it ran, and each planned sequence's logit rows. On failure
    /// every running sequence fails, and the error is what it ran.
    fn forward(
        &mut self,
        plan: &[(RequestId, usize)],
        order: &[usize],
        logits: &mut Vec<f32>,
        summaries: &mut Vec<LogitSummary>,
    ) -> Result<(StepSummary, Vec<usize>), StepSummary> {
        let bs = self.config.block_size;
        let chunks: Vec<SeqChunk<'_>> = order
            .iter()
            .zip(plan)
            .map(|(&ix, &(_, n))| {
                let s = &self.running[ix];
                let ends = s.kv_len + n == s.tokens.len();
                SeqChunk {
                    tokens: &s.tokens[s.kv_len..s.kv_len + n],
                    start_pos: s.kv_len,
                    blocks: &s.blocks,
                    packed: &s.packed,
                    logit_rows: if ends { 1 + s.draft } else { 0 },
                    summary_only: s.draft == 0 && !s.sampler.needs_row() && s.constraint.is_none(),
                }
            })
            .collect();
        let rows: Vec<usize> = chunks.iter().map(|c| c.logit_rows).collect();
        // Shared and registered blocks are immutable; only a table's own fresh blocks take writes.
        debug_assert!(chunks.iter().all(|c| {
            let (first, last) = (c.start_pos / bs, (c.start_pos + c.tokens.len() - 1) / bs);
            c.blocks[first..=last]
                .iter()
                .all(|&b| self.alloc.writable(b))
        }));
        let mut summary = StepSummary::default();
        for c in &chunks {
            // A chunk that yields logits for each of its tokens is a decode (with its draft), or a
            // prompt's very last token.
            if c.logit_rows == c.tokens.len() {
                summary.decode_seqs += 1;
                summary.decode_tokens += 1;
            } else {
                summary.prefill_seqs += 1;
                summary.prefill_tokens += c.tokens.len();
            }
        }
        let result = self.backend.forward(&chunks, logits, summaries);
        drop(chunks);
        if let Err(e) = result {
            tracing::error!(error = %e, "forward pass failed");
            self.running.iter_mut().for_each(Seq::drop_draft);
            self.fail_running(&e.to_string());
            return Err(summary);
        }
        // Positions now in the cache; a draft's count only once it is verified.
        for (&ix, &(_, n)) in order.iter().zip(plan) {
            let s = &mut self.running[ix];
            s.kv_len += n - s.draft;
        }
        Ok((summary, rows))
    }

    /// Each planned sequence's next token from its rows: plain rows sampled in parallel (262k-wide
    /// rows), drafts verified one row after another (counting the kept tokens in `summary`).
    /// A sequence whose mask does not come in time samples in a later step instead.
    /// Returns the sequences that finished, with their reasons.
    fn pick(
        &mut self,
        plan: &[(RequestId, usize)],
        order: &[usize],
        rows: &[usize],
        logits: &mut [f32],
        summaries: &[LogitSummary],
        summary: &mut StepSummary,
    ) -> Vec<(RequestId, Ending)> {
        let (vocab, ctx) = (self.info.vocab_size, self.info.context_length);
        let mut plain: Vec<Row<'_>> = Vec::new();
        let mut finished = Vec::new();
        let mut drafts: Vec<(usize, &mut [f32], &[LogitSummary])> = Vec::new();
        let mut rest: &mut [f32] = logits;
        let mut rest_summaries: &[LogitSummary] = summaries;
        // A mask later than a quarter of the forward pass is not waited for (unless the step
        // runs only because of it): its sequence samples in a later step.
        let deadline = (!self.waits_for_masks).then(|| Instant::now() + self.last_forward / 4);
        for ((&ix, &r), &(_, n)) in order.iter().zip(rows).zip(plan) {
            if r == 0 {
                continue;
            }
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(r * vocab);
            rest = tail;
            let (my_summaries, tail) = rest_summaries.split_at(r.min(rest_summaries.len()));
            rest_summaries = tail;
            let s = &mut self.running[ix];
            if s.draft > 0 {
                drafts.push((ix, mine, my_summaries));
                continue;
            }
            let mask = match masked(s, deadline) {
                Masked::Free => None,
                Masked::Mask(m) => Some(m),
                Masked::Later => {
                    // Its last position runs again, the same, once the mask is there.
                    s.kv_len -= 1;
                    if n == 1 {
                        summary.decode_seqs -= 1;
                        summary.decode_tokens -= 1;
                    } else {
                        summary.prefill_tokens -= 1;
                    }
                    continue;
                }
                Masked::End(ending) => {
                    finished.push((s.id, ending));
                    continue;
                }
            };
            plain.push((ix, mine, my_summaries.first().copied(), mask));
        }
        for (ix, token, logprob, top) in sample_rows(&mut self.running, plain) {
            let s = &mut self.running[ix];
            if let Some(r) = take(s, (token, logprob, top), ctx) {
                finished.push((s.id, Ok(r)));
            }
        }
        let most = self.config.spec_tokens;
        for (ix, rows, summaries) in drafts {
            let (accepted, drafted, end) =
                verify(&mut self.running[ix], rows, summaries, vocab, ctx, most);
            self.spec_drafted += drafted;
            self.spec_accepted += accepted;
            summary.decode_tokens += accepted;
            if let Some(r) = end {
                finished.push((self.running[ix].id, Ok(r)));
            }
        }
        finished
    }

    /// After a step: each planned sequence's table gives back the blocks of draft tokens not
    /// kept, registers its full blocks in the prefix cache and packs what its window left; then
    /// the finished sequences retire.
    fn settle(&mut self, order: &[usize], finished: Vec<(RequestId, Ending)>) {
        let bs = self.config.block_size;
        for &ix in order {
            let s = &mut self.running[ix];
            self.alloc.truncate(&mut s.blocks, s.tokens.len(), bs);
            self.register_full_blocks(ix);
            self.trim(ix);
        }
        for (id, ending) in finished {
            if let Some(ix) = self.running.iter().position(|s| s.id == id) {
                let s = self.running.swap_remove(ix);
                match ending {
                    Ok(reason) => s.finish(reason),
                    Err(e) => s.send(EngineEvent::Error(e)),
                }
                self.retire(s);
            }
        }
    }
}

/// Sends `s` its sampled token and feeds it to its grammar; how the reply ends, if it does.
fn take(s: &mut Seq, pick: (u32, f32, Vec<(u32, f32)>), ctx: usize) -> Option<FinishReason> {
    let token = pick.0;
    let end = emit(s, pick, ctx);
    let Some(c) = s.constraint.as_mut() else {
        return end;
    };
    match end {
        None => {
            c.advance(token);
            None
        }
        // The token that used up the reply's length may be the one that completed its grammar:
        // then the reply is whole, and says so.
        Some(FinishReason::Length) => Some(if c.ends_with(token) {
            FinishReason::Stop
        } else {
            FinishReason::Length
        }),
        end => end,
    }
}

/// What a sequence's grammar says of the row it is about to sample.
enum Masked {
    /// No grammar.
    Free,
    Mask(SimpleVob),
    /// The mask did not come by the deadline.
    Later,
    /// The grammar ended the reply, or failed.
    End(Ending),
}

/// `s`'s mask for this step (computed during the forward pass), waited for until `deadline`, or
/// for as long as it takes without one.
fn masked(s: &mut Seq, deadline: Option<Instant>) -> Masked {
    let Some(c) = s.constraint.as_mut() else {
        return Masked::Free;
    };
    let next = match deadline {
        Some(d) => c.wait_for(d.saturating_duration_since(Instant::now())),
        None => Some(c.wait()),
    };
    match next {
        None => Masked::Later,
        Some(Next::Mask(m)) => Masked::Mask(m),
        Some(Next::Done) => Masked::End(Ok(FinishReason::Stop)),
        Some(Next::Failed(e)) => Masked::End(Err(EngineError::GrammarFailed(e))),
    }
}

/// The configuration's own limits.
fn check(config: &EngineConfig) -> Result<(), EngineError> {
    if config.block_size == 0 || config.max_batch == 0 || config.prefill_chunk == 0 {
        return Err(EngineError::Internal(
            "block_size, max_batch and prefill_chunk must be positive".into(),
        ));
    }
    if !(config.prefill_share.is_finite() && config.prefill_share >= 0.0) {
        return Err(EngineError::Internal(format!(
            "prefill_share must be a number of at least 0, not {}",
            config.prefill_share
        )));
    }
    Ok(())
}

/// A sequence's pick: its index in the batch, the token, its log-probability and its likeliest
/// alternatives (when asked for).
type Picked = (usize, u32, f32, Vec<(u32, f32)>);

/// A row to sample: the sequence's index in the batch, its logits, their summary where the
/// forward pass made one, and its grammar's mask.
type Row<'a> = (
    usize,
    &'a mut [f32],
    Option<LogitSummary>,
    Option<SimpleVob>,
);

/// How a sequence ends this step: finished, or failed.
type Ending = Result<FinishReason, EngineError>;

/// Samples one token from each row, in parallel on the kernel pool (whose helpers are already
/// awake: handing this to another pool would leave a spinning helper competing for the cores).
fn sample_rows(running: &mut [Seq], rows: Vec<Row<'_>>) -> Vec<Picked> {
    let mut seqs: Vec<Option<&mut Seq>> = running.iter_mut().map(Some).collect();
    type Work<'a> = (
        usize,
        &'a mut Seq,
        &'a mut [f32],
        Option<LogitSummary>,
        Option<SimpleVob>,
    );
    let work: Vec<Mutex<Work<'_>>> = rows
        .into_iter()
        .filter_map(|(ix, row, summary, mask)| {
            seqs.get_mut(ix)
                .and_then(Option::take)
                .map(|s| Mutex::new((ix, s, row, summary, mask)))
        })
        .collect();
    let picks: Vec<Mutex<Picked>> = work
        .iter()
        .map(|_| Mutex::new((0, 0, 0.0, Vec::new())))
        .collect();
    SpinPool::global().run(work.len(), &|i| {
        if let (Ok(mut w), Ok(mut p)) = (work[i].lock(), picks[i].lock()) {
            let (ix, s, row, summary, mask) = &mut *w;
            let top = s.sampler.top_logprobs(row, *summary);
            let (t, lp) = s
                .sampler
                .sample_masked(row, &s.tokens, *summary, mask.as_ref());
            *p = (*ix, t, lp, top);
        }
    });
    picks
        .into_iter()
        .filter_map(|p| p.into_inner().ok())
        .collect()
}

/// Appends a sampled token to `s` and streams it; the reason it ends, if it does.
/// Emits a picked token: `(token, logprob, top)`, its likeliest alternatives when asked for.
fn emit(s: &mut Seq, pick: (u32, f32, Vec<(u32, f32)>), ctx: usize) -> Option<FinishReason> {
    let (token, logprob, top) = pick;
    s.tokens.push(token);
    s.generated += 1;
    if s.first_token.is_none() {
        s.first_token = Some(Instant::now());
    }
    if s.stop_ids.contains(&token) {
        return Some(FinishReason::Stop);
    }
    s.send(EngineEvent::Token {
        id: token,
        logprob,
        top,
    });
    if s.generated >= s.max_new {
        Some(FinishReason::Length)
    } else if s.tokens.len() >= ctx {
        Some(FinishReason::ContextFull)
    } else {
        None
    }
}

/// Verifies the draft at the end of `s.tokens` against `rows` (logits after its last real token
/// and after each draft token): picks each token exactly as a step of its own would have (the
/// same logits, history and sampler, one random draw per token when sampling) and keeps draft
/// tokens while they equal the pick. Every token emitted is thus drawn from the model's own
/// distribution, and a seeded reply is the same token for token with or without drafts; a draft
/// only decides whether the next row's logits, computed after the draft token, can be used. Returns the draft tokens kept,
/// those drafted, and the reason the sequence ends, if it does. Its next draft may be one token
/// longer than what it kept (at most `most`), so a sequence whose drafts keep failing risks one
/// row a step, and one whose drafts hold risks more.
fn verify(
    s: &mut Seq,
    rows: &mut [f32],
    summaries: &[LogitSummary],
    vocab: usize,
    ctx: usize,
    most: usize,
) -> (usize, usize, Option<FinishReason>) {
    let drafted = s.draft;
    let draft = s.tokens.split_off(s.tokens.len() - drafted);
    s.draft = 0;
    let mut kept = 0;
    let mut end = None;
    for (j, row) in rows.chunks_exact_mut(vocab).enumerate() {
        let summary = summaries.get(j).copied();
        let top = s.sampler.top_logprobs(row, summary);
        let (token, logprob) = s.sampler.sample(row, &s.tokens, summary);
        end = emit(s, (token, logprob, top), ctx);
        if end.is_some() || draft.get(j) != Some(&token) {
            break;
        }
        // The draft token at this position was the pick: its K/V, written this step, stands.
        kept += 1;
        s.kv_len += 1;
    }
    s.draft_cap = (kept + 1).min(most).max(1);
    (kept, drafted, end)
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
