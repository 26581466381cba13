//! A request the scheduler serves: its tokens, its K/V blocks, its sampler and grammar, and
//! where it stands ([`SeqState`]).

use std::time::Instant;

use hearth_shared::{FinishReason, RequestId, SessionId, UserId};

use crate::engine::constraint::Constraint;
use crate::engine::types::{EngineConfig, EngineEvent, Timings, ValidRequest};
use crate::engine::{EngineError, EventSender};
use crate::kv::{BlockId, Chain};
use crate::sampling::Sampler;

/// A request being served (or waiting, or preempted).
#[derive(Debug)]
pub(super) struct Seq {
    pub(super) id: RequestId,
    pub(super) user: UserId,
    pub(super) session: Option<SessionId>,
    /// Prompt followed by every generated token.
    pub(super) tokens: Vec<u32>,
    pub(super) prompt_len: usize,
    /// Positions whose K/V are in `blocks` (and `packed`).
    pub(super) kv_len: usize,
    pub(super) blocks: Vec<BlockId>,
    /// Packed global layers of the table's leading [`NO_BLOCK`] entries.
    pub(super) packed: Vec<BlockId>,
    /// Chain hashes of the leading full blocks already offered to the prefix cache.
    pub(super) hashes: Vec<u64>,
    /// Where each block's chain hangs from: the user's own root, so no other user's prompt ever
    /// matches, but for an operator's shared system prompt.
    pub(super) chain: Chain,
    pub(super) generated: usize,
    pub(super) max_new: usize,
    pub(super) stop_ids: Vec<u32>,
    pub(super) sampler: Sampler,
    /// The grammar its tokens follow, with the next step's mask on the way.
    pub(super) constraint: Option<Constraint>,
    /// Draft tokens at the end of `tokens` this step verifies (speculative decoding); 0 between
    /// steps.
    pub(super) draft: usize,
    /// Most draft tokens for its next step (see [`verify`]).
    pub(super) draft_cap: usize,
    pub(super) cached_tokens: usize,
    pub(super) events: EventSender,
    pub(super) arrived: Instant,
    pub(super) admitted: Option<Instant>,
    pub(super) first_token: Option<Instant>,
    pub(super) state: SeqState,
}

/// Where a sequence stands, besides the K/V it holds and the tokens it made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SeqState {
    /// Admitted or waiting, never preempted.
    Live,
    /// Preempted for memory: recomputed when admitted again, without a second `Started`.
    Preempted,
    /// To be ended at the next step: by its client (it finishes `Cancelled`), or by a shutdown
    /// (it ends with `ShuttingDown`, so the caller continues it elsewhere instead of taking it
    /// as stopped).
    Cancelled(Cancel),
}

impl SeqState {
    /// A new request's: cancelled by its client already (the cancel came first), or live.
    pub(super) fn new(cancelled: bool) -> Self {
        match cancelled {
            true => Self::Cancelled(Cancel::Client),
            false => Self::Live,
        }
    }
}

/// Who cancelled a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Cancel {
    Client,
    Shutdown,
}

impl Seq {
    /// A validated request as a sequence to admit, its events going to `events`.
    pub(super) fn new(
        req: ValidRequest,
        events: EventSender,
        config: &EngineConfig,
        state: SeqState,
    ) -> Self {
        let ValidRequest {
            inner,
            stop_ids,
            arrived,
            constraint,
        } = req;
        let prompt_len = inner.prompt.len();
        let sampled_before = inner.sampled_before as usize;
        Seq {
            id: inner.id,
            chain: Chain::new(
                inner.user.as_str(),
                (inner.shared_prefix as usize).min(prompt_len),
                config.block_size,
            ),
            user: inner.user,
            session: inner.session,
            tokens: inner.prompt,
            prompt_len,
            kv_len: 0,
            blocks: Vec::new(),
            packed: Vec::new(),
            hashes: Vec::new(),
            generated: 0,
            max_new: inner.max_new_tokens as usize,
            stop_ids,
            sampler: Sampler::continuing(inner.params, inner.sampled_before)
                .for_sequence(
                    prompt_len.saturating_sub(sampled_before),
                    inner.dry_breakers,
                )
                .with_top_logprobs(inner.top_logprobs as usize),
            constraint,
            draft: 0,
            draft_cap: config.spec_tokens,
            cached_tokens: 0,
            events,
            arrived,
            admitted: None,
            first_token: None,
            state,
        }
    }

    pub(super) fn cancelled(&self) -> bool {
        matches!(self.state, SeqState::Cancelled(_))
    }

    pub(super) fn was_preempted(&self) -> bool {
        self.state == SeqState::Preempted
    }

    /// Cancels it (a shutdown's cancel outranks its client's).
    pub(super) fn cancel(&mut self, by: Cancel) {
        if self.state != SeqState::Cancelled(Cancel::Shutdown) {
            self.state = SeqState::Cancelled(by);
        }
    }

    /// Marks it preempted, unless it is already to be ended.
    pub(super) fn mark_preempted(&mut self) {
        if !self.cancelled() {
            self.state = SeqState::Preempted;
        }
    }

    /// Takes back an unverified draft (a step that will not verify it).
    pub(super) fn drop_draft(&mut self) {
        self.tokens.truncate(self.tokens.len() - self.draft);
        self.draft = 0;
    }

    pub(super) fn send(&self, e: EngineEvent) {
        // A closed receiver is noticed (and the sequence cancelled) at the next step.
        let _ = self.events.send(e);
    }

    pub(super) fn end_cancelled(&self) {
        match self.state {
            SeqState::Cancelled(Cancel::Shutdown) => {
                self.send(EngineEvent::Error(EngineError::ShuttingDown))
            }
            _ => self.finish(FinishReason::Cancelled),
        }
    }

    pub(super) fn finish(&self, reason: FinishReason) {
        let ms = |t: Option<Instant>| {
            t.map_or(0.0, |t| t.duration_since(self.arrived).as_secs_f64() * 1e3)
        };
        self.send(EngineEvent::Finished {
            reason,
            prompt_tokens: self.prompt_len,
            cached_tokens: self.cached_tokens,
            completion_tokens: self.generated,
            timings: Timings {
                queue_ms: ms(self.admitted),
                time_to_first_token_ms: ms(self.first_token),
                total_ms: self.arrived.elapsed().as_secs_f64() * 1e3,
            },
        });
    }
}
