//! The scheduler: plain synchronous state driven by the engine thread (and directly by tests).
//!
//! Each [`Scheduler::step`] admits waiting requests while KV blocks allow (evicting idle session
//! caches by each user's share of the pool: see [`super::share`]), gives every running sequence
//! its slice of the step — one token when decoding, a chunk of the prompt when prefilling — runs
//! one batched forward pass, and samples a token for every sequence that reached the end of its
//! input. Finished sequences leave at once; their KV stays behind as the session's cache for the
//! next turn. Where K/V goes (block tables, the prefix cache, session caches, the disk tier) is
//! [`kv::KvManager`]'s; this module decides who runs, who waits and who gives up memory.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use hearth_shared::{FinishReason, RequestId, SessionId, UserId};

use super::backend::{Backend, Weights};
use super::constraint::Constraint;
use super::lookup;
use super::types::{EngineConfig, EngineEvent, EngineStats, ValidRequest};
use super::work::{StepTimes, WorkModel};
use super::{EngineError, EventSender, ModelInfo};
use crate::kv::{DiskTier, Packing};
use crate::model::GemmaConfig;
use kv::{held, KvLayout, KvManager, Placement};
use pass::Ending;
pub use pass::StepSummary;
use seq::{Cancel, Seq, SeqState};

pub(super) mod kv;
mod pass;
mod prefill;
mod seq;

/// Most remembered cancels of requests not yet seen.
const EARLY_CANCELS_MAX: usize = 4096;

#[derive(Debug)]
pub struct Scheduler {
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
    /// Where K/V goes: block tables, the prefix cache, session caches, the disk tier.
    kv: KvManager,
    /// The forward pass and the K/V storage it reads and writes.
    backend: Backend,
    waiting: Vec<Seq>,
    running: Vec<Seq>,
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
        let info = describe(&weights, &config, num_blocks, block_bytes);
        // Old positions keep only their global layers once the sliding layers cannot see them.
        let packing = config.kv_window_margin.and_then(|_| {
            c.sliding_window?;
            let globals = (0..c.num_layers).filter(|&l| !c.is_sliding(l)).collect();
            Packing::new(c.num_layers, globals)
        });
        let backend = Backend::new(&weights, num_blocks, &config, packing)?;
        let kv = kv_manager(c, &config, &backend, num_blocks)?;
        Ok(Self {
            backend,
            kv,
            config,
            work: WorkModel::new(c),
            times: StepTimes::default(),
            prefill_credit: 0.0,
            info,
            waiting: Vec::new(),
            running: Vec::new(),
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
        let (alloc, kv) = (self.kv.alloc(), self.kv.counts());
        EngineStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_blocks_used: alloc.used(),
            kv_blocks_total: alloc.total(),
            kv_blocks_cached: alloc.cached(),
            cached_sessions: kv.cached_sessions,
            disk_sessions: kv.disk_sessions,
            disk_restores: kv.disk_restores,
            session_evictions: kv.evictions,
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
        match self.kv.drop_session(id) {
            true => Ok(()),
            false => Err(EngineError::UnknownSession(id.clone())),
        }
    }

    /// Ends every running sequence with an internal error (after a failed step).
    pub(crate) fn fail_running(&mut self, why: &str) {
        for mut s in std::mem::take(&mut self.running) {
            s.send(EngineEvent::Error(EngineError::Internal(why.into())));
            self.kv.forget(&mut s);
        }
    }

    /// Removes cancelled sequences and those whose client went away.
    fn reap_cancelled(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            let s = &self.running[i];
            if s.cancelled() || s.events.is_closed() {
                let mut s = self.running.swap_remove(i);
                s.end_cancelled();
                self.kv.retire(&mut s);
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
                let mut s = self.running.swap_remove(i);
                s.finish(FinishReason::Stop);
                self.kv.retire(&mut s);
            } else {
                i += 1;
            }
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
        self.kv
            .attach_cached_prefix(&mut self.backend, &self.running, s);
        let need = self.kv.blocks_to_run(s);
        if self.free_for(s, need) {
            return self.kv.place_attached(&mut self.backend, s);
        }
        if !self.running.is_empty() {
            self.kv.detach(s);
            return Placement::Wait;
        }
        // Nothing runs and no idle session is left: only this request's own prefix holds
        // memory. Start it cold rather than wait forever.
        self.kv.forget(s);
        self.kv.place_cold(s)
    }

    /// Frees `need` blocks for waiting `s`: idle session caches within its user's share of the
    /// pool (see [`KvManager::evict_one_idle`]), then a place another user holds by fair share
    /// ([`Self::preempt_for`]), and, when nothing runs that would free memory later, any idle
    /// cache rather than have `s` wait for other users' next turns. Whether they are free.
    fn free_for(&mut self, s: &Seq, need: usize) -> bool {
        let asking = Some((&s.user, held(&s.blocks, &s.packed) + need));
        while self.kv.free() < need && self.evict_idle(asking) {}
        while self.kv.free() < need && self.preempt_for(&s.user) {}
        while self.kv.free() < need && self.running.is_empty() && self.evict_idle(None) {}
        self.kv.free() >= need
    }

    /// [`KvManager::evict_one_idle`] for a request of `asking` beside the running sequences.
    fn evict_idle(&mut self, asking: Option<(&UserId, usize)>) -> bool {
        self.kv.evict_one_idle(&self.backend, &self.running, asking)
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
        let shares = self.kv.shares(&self.running, None);
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
        let equal_share = self.kv.alloc().total() / (per_user.len() + 1);
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
        self.kv.forget(&mut s);
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
        let ctx = self.info.context_length;
        let s = &self.running[i];
        // Never past the reply's length or the context: every draft token kept is a token
        // emitted, and its position is written.
        let room = (s.max_new - s.generated)
            .saturating_sub(1)
            .min(ctx.saturating_sub(s.tokens.len() + 1));
        let draft = lookup::draft(&s.tokens, s.draft_cap.min(room)).to_vec();
        let want = s.kv_len + 1 + draft.len();
        if draft.is_empty() || !self.kv.grow(&mut self.running[i].blocks, want) {
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
        let want = self.running[i].kv_len + n;
        let user = self.running[i].user.clone();
        while !self.kv.grow(&mut self.running[i].blocks, want) {
            let extra = self.kv.blocks_needed(&self.running[i].blocks, want);
            let alone = self.running.len() == 1;
            if self.evict_idle(Some((&user, extra))) || alone && self.evict_idle(None) {
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

    /// After a step: each planned sequence's table gives back the blocks of draft tokens not
    /// kept, registers its full blocks in the prefix cache and packs what its window left; then
    /// the finished sequences retire.
    fn settle(&mut self, order: &[usize], finished: Vec<(RequestId, Ending)>) {
        for &ix in order {
            let s = &mut self.running[ix];
            self.kv.truncate(&mut s.blocks, s.tokens.len());
            self.kv.register_full_blocks(s);
            self.kv.trim(&mut self.backend, s);
        }
        for (id, ending) in finished {
            if let Some(ix) = self.running.iter().position(|s| s.id == id) {
                let mut s = self.running.swap_remove(ix);
                match ending {
                    Ok(reason) => s.finish(reason),
                    Err(e) => s.send(EngineEvent::Error(e)),
                }
                self.kv.retire(&mut s);
            }
        }
    }
}

/// What the engine says of the model it serves: its limits under `config`, with `blocks` K/V
/// blocks of `block_bytes` bytes.
fn describe(
    weights: &Weights,
    config: &EngineConfig,
    blocks: usize,
    block_bytes: usize,
) -> ModelInfo {
    let c = weights.config();
    let (bos_id, eos_id, end_of_turn_id) = weights.special();
    ModelInfo {
        architecture: c.architecture.clone(),
        context_length: config
            .max_context
            .map_or(c.context_length, |m| m.min(c.context_length)),
        vocab_size: c.vocab_size,
        bos_id,
        eos_id,
        end_of_turn_id,
        default_stop_ids: [eos_id, end_of_turn_id].into_iter().flatten().collect(),
        kv_capacity_tokens: blocks * config.block_size,
        block_size: config.block_size,
        kv_block_bytes: block_bytes,
        max_batch: config.max_batch,
        max_waiting: config.max_waiting,
        command_queue: config.command_queue,
    }
}

/// The K/V memory of `blocks` blocks as `backend` lays them out, with the disk tier when
/// configured.
fn kv_manager(
    c: &GemmaConfig,
    config: &EngineConfig,
    backend: &Backend,
    blocks: usize,
) -> Result<KvManager, EngineError> {
    let disk = match &config.kv_disk {
        Some(d) => Some(
            DiskTier::create(&d.dir, d.bytes, backend.saved_bytes(config.block_size)).map_err(
                |e| EngineError::Internal(format!("KV disk tier in {}: {e}", d.dir.display())),
            )?,
        ),
        None => None,
    };
    let layout = KvLayout {
        block_size: config.block_size,
        pack_per: backend.packing().map(|p| p.per),
        sliding_window: c.sliding_window,
        window_margin: config.kv_window_margin,
    };
    Ok(KvManager::new(blocks, layout, disk))
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

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
