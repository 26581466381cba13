//! One generation from prompt tokens to a finished reply: worker choice, failover, incremental
//! detokenization, stop strings, progress saved as it streams, and the final record.
//!
//! A generation runs as its own task and reports to a [`Live`] log, so the HTTP side can
//! stream it, let a client reconnect to it, or simply wait for its end. On the native API it
//! outlives the client's connection; the OpenAI routes stop it when their client goes away.
//!
//! Failover: if the worker fails before the first token, the request goes to another worker as
//! if nothing happened. After tokens have streamed, the next worker prefills prompt + tokens so
//! far and continues, so the client sees a pause, not an error. Only when no worker is left does
//! the reply end in an `error`, with what was generated kept.
//!
//! Preemption takes the same path: a reply asked to give its worker's place to a user who holds
//! none (see [`crate::workers::Lease::yielded`]) stops there and continues, ahead of its user's
//! new requests, once a place is free again.

mod end;
mod live;

pub use live::{
    Busy, End, GenerationError, Live, Outcome, Reservation, RunEvent, Streams, TurnIds,
};

use std::sync::Arc;
use std::time::Duration;

use hearth_shared::chat::{Detokenizer, StopMatcher};
use hearth_shared::proto::{self, worker_event::Kind};
use hearth_shared::tokenizer::Tokenizer;
use hearth_shared::{FinishReason, SamplingParams};
use tokio::time::Instant;

use crate::limits::Budget;
use crate::storage::{Completion, Store, StoreError};
use crate::telemetry;
use crate::workers::{Lease, PoolError, WorkerPool};

/// What every generation needs. Built by the chat service, which alone holds it.
#[derive(Debug)]
pub(crate) struct Generator {
    pub(crate) pool: Arc<WorkerPool>,
    pub(crate) tokenizer: Arc<Tokenizer>,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) streams: Arc<Streams>,
}

#[derive(Debug)]
pub struct Job {
    pub user_id: String,
    /// Where the reply is kept, if anywhere.
    pub persistence: Persistence,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub max_new_tokens: u32,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// When the HTTP request arrived (TTFT is measured from here).
    pub arrived: Instant,
    /// The tokens set aside for the reply from its key's daily budget.
    pub budget: Option<Budget>,
    /// The worker already chosen at admission.
    pub lease: Option<Lease>,
}

/// Whether a generation belongs to a stored session or to no one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Persistence {
    /// A native turn: the worker keeps `session_id`'s KV cache between turns, and the reply is
    /// saved to the stored assistant message `message_id` as it streams and when it ends.
    Stored {
        session_id: String,
        message_id: String,
    },
    /// An OpenAI request: nothing is stored, and the worker caches by prefix only.
    Stateless,
}

impl Persistence {
    fn session_id(&self) -> Option<&str> {
        match self {
            Self::Stored { session_id, .. } => Some(session_id),
            Self::Stateless => None,
        }
    }

    fn message_id(&self) -> Option<&str> {
        match self {
            Self::Stored { message_id, .. } => Some(message_id),
            Self::Stateless => None,
        }
    }
}

/// How often a streaming reply's text is saved, and the longest a streaming message goes
/// without a write (so a reply whose orchestrator died can be told from a slow one).
const SAVE_EVERY: Duration = Duration::from_secs(1);
const HEARTBEAT_EVERY: Duration = Duration::from_secs(5);

/// What a worker's error means for the reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// The worker went away, is shutting down, or dropped the request: continue on another.
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
            Code::Unavailable | Code::Aborted | Code::Cancelled | Code::DeadlineExceeded => {
                Self::Failover
            }
            Code::ResourceExhausted => Self::Busy,
            Code::InvalidArgument
            | Code::FailedPrecondition
            | Code::OutOfRange
            | Code::NotFound
            | Code::AlreadyExists
            | Code::PermissionDenied
            | Code::Unauthenticated => Self::Refused,
            Code::Internal | Code::Unknown | Code::Unimplemented | Code::DataLoss | Code::Ok => {
                Self::Internal
            }
        }
    }
}

struct Progress {
    text: String,
    generated: Vec<u32>,
    cached_tokens: Option<u64>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    worker: Option<String>,
}

impl Generator {
    /// Runs `job` to its end, reporting to `live`; stores the outcome when the job names a
    /// message. Spawn it: it does not depend on anyone listening.
    pub async fn run(self: Arc<Self>, mut job: Job, live: Arc<Live>) -> Outcome {
        metrics::gauge!(telemetry::ACTIVE_STREAMS).increment(1.0);
        metrics::gauge!(telemetry::ACTIVE_SESSIONS).set(self.streams.running() as f64);
        live.push(RunEvent::Begin);
        let mut p = Progress {
            text: String::new(),
            generated: Vec::new(),
            cached_tokens: None,
            first_token: None,
            last_token: None,
            worker: None,
        };
        let end = self.attempts(&mut job, &live, &mut p).await;
        let outcome = Outcome {
            content: p.text,
            end,
            prompt_tokens: job.prompt.len() as u64,
            cached_tokens: p.cached_tokens.unwrap_or(0),
            completion_tokens: p.generated.len() as u64,
            ttft_ms: p
                .first_token
                .map(|t| t.duration_since(job.arrived).as_millis() as u64),
            duration_ms: job.arrived.elapsed().as_millis() as u64,
            worker: p.worker,
        };
        if let Some(id) = job.persistence.message_id() {
            self.finish(id, &outcome).await;
        }
        if let Some(b) = job.budget.take() {
            b.settle(outcome.completion_tokens).await;
        }
        telemetry::observe(
            telemetry::REQUEST_DURATION,
            job.arrived.elapsed().as_secs_f64(),
        );
        metrics::counter!(telemetry::PROMPT_TOKENS).increment(outcome.prompt_tokens);
        metrics::counter!(telemetry::CACHED_PROMPT_TOKENS).increment(outcome.cached_tokens);
        metrics::counter!(telemetry::GENERATED_TOKENS).increment(outcome.completion_tokens);
        telemetry::record_reply_end(&telemetry::ReplyEnd {
            finish_reason: outcome.end.finish_reason(),
            error_type: outcome.end.error().map(GenerationError::kind),
            prompt_tokens: outcome.prompt_tokens,
            completion_tokens: outcome.completion_tokens,
            decode: p.first_token.map(|t| t.elapsed()),
        });
        live.push(RunEvent::End(Box::new(outcome.clone())));
        metrics::gauge!(telemetry::ACTIVE_STREAMS).decrement(1.0);
        metrics::gauge!(telemetry::ACTIVE_SESSIONS).set(self.streams.running() as f64);
        outcome
    }

    /// Tries workers until the reply ends or none is left.
    async fn attempts(&self, job: &mut Job, live: &Live, p: &mut Progress) -> End {
        let mut detok = Detokenizer::new();
        let mut stops = StopMatcher::new(job.stop.clone());
        // Workers this reply will not go to again, and whether one of them was only busy.
        let mut failed: Vec<String> = Vec::new();
        let mut busy = false;
        // The last worker's place went to another user's request (see `Lease::yielded`).
        let mut preempted = false;
        let mut saved_len = 0usize;
        let mut saved_at = Instant::now();
        let saver = job
            .persistence
            .message_id()
            .map(|id| self.progress_saver(id.to_string()));
        let mut tick = tokio::time::interval(SAVE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if live.stop_requested() {
                return End::Finished(FinishReason::Cancelled);
            }
            let lease = match job.lease.take() {
                Some(l) => l,
                None => {
                    let (user, session) = (&job.user_id, job.persistence.session_id());
                    let admitted = tokio::select! {
                        a = self.pool.readmit(user, session, &failed), if preempted => a,
                        a = self.pool.admit(user, session, &failed), if !preempted => a,
                        () = live.stopped() => return End::Finished(FinishReason::Cancelled),
                    };
                    preempted = false;
                    match admitted {
                        Ok(l) => l,
                        Err(e) => {
                            let why = if failed.is_empty() {
                                e.to_string()
                            } else if busy {
                                PoolError::Full.to_string()
                            } else {
                                format!("the worker failed and {e}")
                            };
                            return End::Failed(GenerationError::Unavailable(why));
                        }
                    }
                }
            };
            let remaining = job.max_new_tokens.saturating_sub(p.generated.len() as u32);
            if remaining == 0 {
                return End::Finished(FinishReason::Length);
            }
            let mut prompt = job.prompt.clone();
            prompt.extend_from_slice(&p.generated);
            let req = proto::GenerateRequest {
                request_id: 0,
                session_id: job.persistence.session_id().unwrap_or_default().to_string(),
                user_id: job.user_id.clone(),
                prompt_token_ids: prompt,
                sampling: Some((&job.params).into()),
                max_new_tokens: remaining,
                stop_token_ids: Vec::new(),
                ignore_eos: job.ignore_eos,
                sampled_tokens: p.generated.len() as u32,
            };
            let addr = lease.addr().to_string();
            let mut gen = match lease.generate(req) {
                Ok(g) => g,
                Err(e) => {
                    tracing::warn!(worker = %addr, error = %e, "worker refused the request");
                    failed.push(addr);
                    continue;
                }
            };
            p.worker = Some(lease.name().to_string());
            let resumed = !p.generated.is_empty();
            loop {
                let event = tokio::select! {
                    e = gen.next() => e,
                    () = live.stopped() => return End::Finished(FinishReason::Cancelled),
                    () = lease.yielded() => {
                        // Dropping the generation cancels it on the worker, then the lease
                        // frees the place; the reply continues from here once it has one again.
                        tracing::debug!(worker = %addr, generated = p.generated.len(), "giving the worker's place to another user's request");
                        preempted = true;
                        break;
                    }
                    _ = tick.tick() => {
                        if let Some(saver) = &saver {
                            let due = p.text.len() != saved_len || saved_at.elapsed() >= HEARTBEAT_EVERY;
                            if due {
                                saver.send_replace(p.text.clone());
                                saved_len = p.text.len();
                                saved_at = Instant::now();
                            }
                        }
                        continue;
                    }
                };
                let kind = event.and_then(|e| e.kind);
                match kind {
                    Some(Kind::Started(s)) => {
                        if p.cached_tokens.is_none() && !resumed {
                            p.cached_tokens = Some(u64::from(s.cached_tokens));
                        }
                    }
                    Some(Kind::Tokens(t)) => {
                        let now = Instant::now();
                        if let Some(prev) = p.last_token {
                            telemetry::observe(
                                telemetry::INTER_TOKEN,
                                now.duration_since(prev).as_secs_f64(),
                            );
                        }
                        p.last_token = Some(now);
                        for id in t.ids {
                            p.generated.push(id);
                            let piece = detok.push(&self.tokenizer, id).unwrap_or_default();
                            if piece.is_empty() {
                                continue;
                            }
                            let fed = stops.push(&piece);
                            self.emit(job, live, p, fed.text);
                            if fed.stopped {
                                return End::Finished(FinishReason::Stop);
                            }
                        }
                    }
                    Some(Kind::Finished(f)) => {
                        let Some(reason) = proto::FinishReason::try_from(f.reason)
                            .ok()
                            .and_then(|r| FinishReason::try_from(r).ok())
                        else {
                            tracing::error!(worker = %addr, reason = f.reason, "unknown finish reason");
                            return End::Failed(GenerationError::Internal(format!(
                                "the worker ended the reply with an unknown finish reason ({})",
                                f.reason
                            )));
                        };
                        let tail = detok.finish(&self.tokenizer).unwrap_or_default();
                        let mut rest = stops.push(&tail).text;
                        rest.push_str(&stops.flush());
                        self.emit(job, live, p, rest);
                        return End::Finished(reason);
                    }
                    Some(Kind::Error(e)) => match Fault::of(e.code) {
                        Fault::Failover => {
                            tracing::warn!(worker = %addr, error = %e.message, generated = p.generated.len(), "worker failed mid-request; moving on");
                            metrics::counter!(telemetry::WORKER_FAILOVERS).increment(1);
                            failed.push(addr.clone());
                            break;
                        }
                        Fault::Busy => {
                            tracing::debug!(worker = %addr, error = %e.message, "worker full; trying another");
                            failed.push(addr.clone());
                            busy = true;
                            break;
                        }
                        Fault::Refused => {
                            return End::Failed(GenerationError::Refused(e.message));
                        }
                        Fault::Internal => {
                            tracing::error!(worker = %addr, error = %e.message, "the worker could not run the request");
                            return End::Failed(GenerationError::Internal(
                                "the worker could not generate this reply".into(),
                            ));
                        }
                    },
                    None => {
                        failed.push(addr.clone());
                        break;
                    }
                }
            }
        }
    }

    /// Saves a reply's text in the background, latest first: a slow or unreachable database
    /// delays the saved copy, never the tokens. Ends when the sender is dropped.
    fn progress_saver(&self, message_id: String) -> tokio::sync::watch::Sender<String> {
        let (tx, mut rx) = tokio::sync::watch::channel(String::new());
        let store = self.store.clone();
        tokio::spawn(async move {
            while rx.changed().await.is_ok() {
                let text = rx.borrow_and_update().clone();
                // Only a `streaming` message is touched, so a late save never undoes the end.
                if let Err(e) = store.save_progress(&message_id, &text).await {
                    tracing::warn!(error = %e, "could not save reply progress");
                }
            }
        });
        tx
    }

    fn emit(&self, job: &Job, live: &Live, p: &mut Progress, text: String) {
        if text.is_empty() {
            return;
        }
        if p.first_token.is_none() {
            let now = Instant::now();
            p.first_token = Some(now);
            telemetry::observe(
                telemetry::TTFT,
                now.duration_since(job.arrived).as_secs_f64(),
            );
        }
        p.text.push_str(&text);
        live.push(RunEvent::Text(text));
    }

    /// Stores the final state, retrying through a short database outage.
    async fn finish(&self, message_id: &str, o: &Outcome) {
        let done = Completion {
            content: o.content.clone(),
            status: o.end.status(),
            finish_reason: Some(o.end.finish_reason().to_string()),
            prompt_tokens: Some(o.prompt_tokens as i64),
            cached_tokens: Some(o.cached_tokens as i64),
            completion_tokens: Some(o.completion_tokens as i64),
            ttft_ms: o.ttft_ms.map(|t| t as i64),
            duration_ms: Some(o.duration_ms as i64),
            worker: o.worker.clone(),
        };
        let mut wait = Duration::from_millis(250);
        for attempt in 1..=8 {
            match self.store.finish_message(message_id, &done).await {
                Ok(()) => return,
                Err(StoreError::Unavailable(e)) if attempt < 8 => {
                    tracing::warn!(error = %e, attempt, "database unavailable; retrying the reply's final write");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(5));
                }
                Err(e) => {
                    tracing::error!(error = %e, message_id, "the reply's final state was not stored; it will be marked interrupted");
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tonic::Code;

    use super::Fault;

    #[test]
    fn only_a_lost_worker_fails_over_and_a_full_one_is_busy() {
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
            (NotFound, Fault::Refused),
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
