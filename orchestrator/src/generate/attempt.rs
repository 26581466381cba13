//! One reply's way through its workers: the state it carries from one worker to the next
//! (detokenizer, stop matcher, the workers it will not go to again), what a worker's error
//! means for it, and the request that continues it after the tokens it already has.

use std::time::Duration;

use hearth_shared::chat::{Detokenizer, StopMatcher};
use hearth_shared::proto;
use hearth_shared::tokenizer::Tokenizer;
use tokio::sync::watch;
use tokio::time::Interval;

use super::{End, GenRequest, GenerationError, Generator, Job, Progress};
use crate::storage::Checkpoint;
use crate::telemetry;
use crate::workers::{Excluded, Lease};

/// How often a streaming reply's text is saved (when it changed). That it is alive is the
/// heartbeat's to say (see [`super::leases`]).
const SAVE_EVERY: Duration = Duration::from_secs(1);

/// Where one worker's stream left the reply.
pub(super) enum Next {
    /// The reply ended.
    End(End),
    /// The reply goes on with another worker, or with the same one after a preemption.
    Retry,
}

/// What a reply carries from one worker to the next.
pub(super) struct Attempts {
    pub(super) detok: Detokenizer,
    pub(super) stops: StopMatcher,
    /// Workers this reply will not go to again (on the connection it failed on).
    pub(super) failed: Vec<Excluded>,
    /// One of `failed` was only full.
    pub(super) busy: bool,
    /// The last worker's place went to another user's request (see `Lease::yielded`).
    pub(super) preempted: bool,
    pub(super) saver: Option<Saver>,
    pub(super) tick: Interval,
    /// Why the last worker failed the reply, for the next attempt's span.
    pub(super) failure: Option<String>,
}

impl Attempts {
    pub(super) fn new(job: &Job, gen: &Generator) -> Self {
        let mut tick = tokio::time::interval(SAVE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Self {
            detok: Detokenizer::new(),
            stops: StopMatcher::new(job.request.stopping.stop.clone()),
            failed: Vec::new(),
            busy: false,
            preempted: false,
            saver: job.persistence.lease().map(|lease| Saver {
                tx: gen.progress_saver(lease.clone(), job.persistence.record()),
                saved_events: 0,
            }),
            tick,
            failure: None,
        }
    }

    /// The reply leaves its worker because `why`: said on this attempt's span, and on the
    /// next one's.
    pub(super) fn failing(&mut self, why: &str) {
        tracing::Span::current().record("hearth.error", why);
        self.failure = Some(why.to_string());
    }

    /// Feeds the tokens a reply already has (taken over from another replica) through the
    /// detokenizer and stop matcher, as they went when they were generated, and returns the
    /// text they showed. Their held-back state is then as it was there.
    pub(super) fn replay(&mut self, tok: &Tokenizer, generated: &[u32]) -> String {
        let mut text = String::new();
        for &id in generated {
            let piece = self.detok.push(tok, id).unwrap_or_default();
            if !piece.is_empty() {
                text.push_str(&self.stops.push(&piece).text);
            }
        }
        text
    }

    /// What a worker's error means for the reply: go on elsewhere, or end it.
    pub(super) fn fault(&mut self, lease: &Lease, e: proto::Error, generated: usize) -> Next {
        let addr = lease.addr();
        match Fault::of(e.code) {
            Fault::Failover => {
                self.failing(&e.message);
                tracing::warn!(worker = %addr, error = %e.message, generated, "worker failed mid-request; moving on");
                metrics::counter!(telemetry::WORKER_FAILOVERS).increment(1);
                self.failed.push(lease.excluded());
                Next::Retry
            }
            Fault::Busy => {
                self.failing("the worker is full");
                tracing::debug!(worker = %addr, error = %e.message, "worker full; trying another");
                self.failed.push(lease.excluded());
                self.busy = true;
                Next::Retry
            }
            Fault::Refused => Next::End(End::Failed(GenerationError::Refused(e.message))),
            Fault::Internal => {
                tracing::error!(worker = %addr, error = %e.message, "the worker could not run the request");
                Next::End(End::Failed(GenerationError::Internal(
                    "the worker could not generate this reply".into(),
                )))
            }
        }
    }
}

/// Hands a streaming reply's checkpoint to the background saver when it moved on.
pub(super) struct Saver {
    tx: watch::Sender<Checkpoint>,
    saved_events: u64,
}

impl Saver {
    pub(super) fn save(&mut self, cp: Checkpoint) {
        if cp.events != self.saved_events {
            self.saved_events = cp.events;
            self.tx.send_replace(cp);
        }
    }
}

/// The request for the next worker: the prompt plus what was generated so far, and what is
/// left of the reply's length.
pub(super) fn request(job: &Job, p: &Progress, remaining: u32) -> proto::GenerateRequest {
    let GenRequest {
        prompt,
        sampling,
        stopping,
        output,
    } = &job.request;
    let keep_alive = job.placement.keep_alive;
    proto::GenerateRequest {
        request_id: 0,
        session_id: job
            .persistence
            .session_id()
            .map(|s| s.to_string())
            .unwrap_or_default(),
        user_id: job.owner.user_id.to_string(),
        prompt_token_ids: [prompt.tokens.as_slice(), &p.generated].concat(),
        sampling: Some((&sampling.params).into()),
        max_new_tokens: remaining,
        stop_token_ids: Vec::new(),
        ignore_eos: stopping.ignore_eos,
        sampled_tokens: p.generated.len() as u32,
        shared_prefix_tokens: prompt.shared_prefix,
        dry_breaker_ids: sampling.dry_breakers.to_vec(),
        top_logprobs: sampling.logprobs.unwrap_or(0),
        grammar: output.grammar.as_ref().map(Into::into),
        model: job
            .placement
            .model
            .as_ref()
            .map(|m| m.to_string())
            .unwrap_or_default(),
        keep_alive_ms: keep_alive.map(|k| k.ms),
        keep_alive_may_shorten: keep_alive.is_some_and(|k| k.may_shorten),
        traceparent: hearth_shared::tracing_export::current_traceparent().unwrap_or_default(),
    }
}

/// What a worker's error means for the reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// The worker went away, is shutting down, dropped the request, or no longer holds its
    /// model (it was unloaded there): continue on another.
    Failover,
    /// The worker is full: try another, without counting the worker as failed.
    Busy,
    /// The request is wrong; another worker would say the same.
    Refused,
    /// The worker could not run this request. It is not retried elsewhere: a request that
    /// breaks one worker must not be handed to every other.
    Internal,
}

impl Fault {
    fn of(code: i32) -> Self {
        use tonic::Code;
        match Code::from_i32(code) {
            Code::Unavailable
            | Code::Aborted
            | Code::Cancelled
            | Code::DeadlineExceeded
            | Code::NotFound => Self::Failover,
            Code::ResourceExhausted => Self::Busy,
            Code::InvalidArgument
            | Code::FailedPrecondition
            | Code::OutOfRange
            | Code::AlreadyExists
            | Code::PermissionDenied
            | Code::Unauthenticated => Self::Refused,
            Code::Internal | Code::Unknown | Code::Unimplemented | Code::DataLoss | Code::Ok => {
                Self::Internal
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tonic::Code;

    use super::Fault;

    #[test]
    fn only_a_lost_worker_or_model_fails_over_and_a_full_one_is_busy() {
        use Code::*;
        let cases = [
            (Unavailable, Fault::Failover),
            (Aborted, Fault::Failover),
            (Cancelled, Fault::Failover),
            (DeadlineExceeded, Fault::Failover),
            (ResourceExhausted, Fault::Busy),
            (Internal, Fault::Internal),
            (Unknown, Fault::Internal),
            (DataLoss, Fault::Internal),
            (Unimplemented, Fault::Internal),
            (InvalidArgument, Fault::Refused),
            (OutOfRange, Fault::Refused),
            (NotFound, Fault::Failover),
            (FailedPrecondition, Fault::Refused),
        ];
        for (code, fault) in cases {
            assert_eq!(Fault::of(code as i32), fault, "{code:?}");
        }
        assert_eq!(
            Fault::of(999),
            Fault::Internal,
            "an unknown code is not retried"
        );
    }
}
