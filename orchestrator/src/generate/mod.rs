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

mod attempt;
mod end;
mod job;
mod leases;
mod live;
mod shared;
pub mod wire;

pub use end::OpenAiFinish;
pub use job::{
    GenRequest, Job, KeepAlive, Output, Owner, Persistence, Placement, Prompt, Sampling, Stopping,
};
pub use leases::Leases;
pub(crate) use leases::{heartbeat_every, heartbeat_task};
pub use live::{
    Busy, End, GenerationError, Live, Outcome, Reservation, RunEvent, Streams, TokenLogprob,
    TopLogprob, TurnIds,
};
pub use shared::{Before, Published, SharedReplies, SharedReply, StreamState};

use std::sync::Arc;

use std::time::Duration;
use tracing::Instrument;

use hearth_shared::proto::{self, worker_event::Kind};
use hearth_shared::tokenizer::Tokenizer;
use hearth_shared::FinishReason;
use tokio::time::Instant;

use crate::storage::{Checkpoint, ReplyLease, ReplyLog, ReplyTimings, ReplyUsage, StoreError};
use crate::telemetry;
use crate::workers::{Generation, Lease, PoolError, Tenant, WorkerPool};

use attempt::{request, Attempts, Next};

/// What every generation needs. Built by the chat service, which alone holds it.
#[derive(Debug)]
pub(crate) struct Generator {
    pub(crate) pool: Arc<WorkerPool>,
    pub(crate) store: Arc<dyn ReplyLog>,
    pub(crate) streams: Arc<Streams>,
    /// How many replies' progress savers are running (see [`Generator::saves_done`]).
    pub(crate) savers: tokio::sync::watch::Sender<usize>,
    /// The leases of the stored replies running here, renewed by the heartbeat.
    pub(crate) leases: Arc<Leases>,
}

struct Progress {
    text: String,
    generated: Vec<u32>,
    /// How many of `generated` the streamed text events carry so far (see [`Live::push_text`]).
    streamed: usize,
    /// The reply began on another replica (see [`Generator::run_from`]): its first token's
    /// time is not known here.
    taken_over: bool,
    cached_tokens: Option<u64>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    worker: Option<String>,
    /// The text and tokens of the events before this replica's log (another replica's,
    /// taken over), which every checkpoint begins with.
    before: (String, Vec<u32>),
    /// The stop string that ended the reply, once one has.
    stop_sequence: Option<String>,
}

impl Progress {
    /// How far the reply's clients may have got: the events shown so far, their text and
    /// tokens. A replica that continues the reply from this checkpoint (its stream lost) can
    /// go on seamlessly for a client that has exactly these events.
    fn checkpoint(&self, live: &Live) -> Checkpoint {
        let (events, text, tokens) = live.shown_so_far();
        let (before_text, before_tokens) = &self.before;
        Checkpoint {
            content: before_text.clone() + &text,
            tokens: [before_tokens.as_slice(), &tokens].concat(),
            events: events as u64,
        }
    }
}

impl Generator {
    /// Runs `job` to its end, reporting to `live`; stores the outcome when the job names a
    /// message. Spawn it: it does not depend on anyone listening.
    pub async fn run(self: Arc<Self>, job: Job, live: Arc<Live>) -> Outcome {
        live.push(RunEvent::Begin);
        self.run_from(job, live, Vec::new()).await
    }

    /// Runs `job` on a task of its own, in its reply's span under the current one.
    pub fn spawn(self: Arc<Self>, job: Job, live: Arc<Live>) {
        let span = Self::chat_span(&job);
        tokio::spawn(self.run(job, live).instrument(span));
    }

    /// The span of one reply, under the current one, with the GenAI request attributes; its
    /// usage and finish are recorded at its end.
    pub fn chat_span(job: &Job) -> tracing::Span {
        let model = job.placement.model.as_ref().map(|m| m.to_string());
        let model = model.unwrap_or_default();
        tracing::info_span!(
            "gen_ai.chat",
            otel.name = %format!("chat {model}"),
            gen_ai.operation.name = "chat",
            gen_ai.request.model = %model,
            gen_ai.request.max_tokens = job.request.stopping.max_new_tokens,
            gen_ai.request.temperature = f64::from(job.request.sampling.params.temperature),
            gen_ai.usage.input_tokens = tracing::field::Empty,
            gen_ai.usage.output_tokens = tracing::field::Empty,
            gen_ai.response.finish_reasons = tracing::field::Empty,
            hearth.cached_tokens = tracing::field::Empty,
            hearth.time_to_first_token_ms = tracing::field::Empty,
            hearth.time_per_output_token_ms = tracing::field::Empty,
            gen_ai.prompt = tracing::field::Empty,
            gen_ai.completion = tracing::field::Empty,
        )
    }

    /// Runs `job` on from the tokens another replica generated (and published) before it died:
    /// `live` goes on after that replica's events, whose text these tokens are.
    pub async fn run_from(
        self: Arc<Self>,
        mut job: Job,
        live: Arc<Live>,
        generated: Vec<u32>,
    ) -> Outcome {
        metrics::gauge!(telemetry::ACTIVE_STREAMS).increment(1.0);
        metrics::gauge!(telemetry::ACTIVE_SESSIONS).set(self.streams.running() as f64);
        if let Some(lease) = job.persistence.lease() {
            self.leases.hold(lease, &live);
        }
        let mut a = Attempts::new(&job, &self);
        let text = a.replay(&job.placement.tokenizer, &generated);
        let mut p = Progress {
            first_token: None,
            streamed: generated.len(),
            taken_over: !generated.is_empty(),
            before: (text.clone(), generated.clone()),
            text,
            generated,
            cached_tokens: None,
            last_token: None,
            worker: None,
            stop_sequence: None,
        };
        let end = self.attempts(&mut job, &live, &mut p, a).await;
        let first_token = p.first_token;
        let outcome = outcome_of(&job, p, end);
        if let Some(b) = job.owner.budget.take() {
            b.settle(outcome.usage.completion_tokens).await;
        }
        record_end(&job, &outcome, first_token);
        live.push(RunEvent::End(Box::new(outcome.clone())));
        if let Some(lease) = job.persistence.lease() {
            self.store_end(lease, &live, &outcome).await;
        }
        live.settle();
        metrics::gauge!(telemetry::ACTIVE_STREAMS).decrement(1.0);
        metrics::gauge!(telemetry::ACTIVE_SESSIONS).set(self.streams.running() as f64);
        outcome
    }

    /// Tries workers until the reply ends or none is left.
    async fn attempts(&self, job: &mut Job, live: &Live, p: &mut Progress, mut a: Attempts) -> End {
        // Taken over after a stop string had already shown (its replica died before the end).
        if a.stops.is_done() {
            p.stop_sequence = a.stops.matched().map(str::to_string);
            return End::Finished(FinishReason::Stop);
        }
        loop {
            if live.stop_requested() {
                return End::Finished(FinishReason::Cancelled);
            }
            let lease = match job.placement.lease.take() {
                Some(l) => l,
                None => match self.admit(job, live, &mut a).await {
                    Ok(l) => l,
                    Err(end) => return end,
                },
            };
            let remaining = job
                .request
                .stopping
                .max_new_tokens
                .saturating_sub(p.generated.len() as u32);
            if remaining == 0 {
                return End::Finished(FinishReason::Length);
            }
            let attempt = tracing::info_span!(
                "hearth.attempt",
                otel.name = "attempt",
                hearth.worker = %lease.name(),
                hearth.failover_reason = a.failure.take(),
                hearth.error = tracing::field::Empty,
            );
            let gen = match attempt.in_scope(|| lease.generate(request(job, p, remaining))) {
                Ok(g) => g,
                Err(e) => {
                    tracing::warn!(worker = %lease.addr(), error = %e, "worker refused the request");
                    a.failed.push(lease.excluded());
                    continue;
                }
            };
            p.worker = Some(lease.name().to_string());
            // `gen` is dropped inside `follow`, before the lease: the generation is cancelled
            // on the worker before its place is freed.
            let follow = self.follow(job, live, p, &mut a, &lease, gen);
            if let Next::End(end) = follow.instrument(attempt).await {
                return end;
            }
        }
    }

    /// Waits for a worker's place: ahead of the user's new requests after a preemption.
    async fn admit(&self, job: &Job, live: &Live, a: &mut Attempts) -> Result<Lease, End> {
        let user = Tenant::within(&job.owner.user_id, job.owner.end_user.as_deref());
        let (session, model) = (job.persistence.session_id(), job.placement.model.as_ref());
        // Every admission here is of a reply already under way (a new turn's first place is
        // taken before it starts), but for a stateless choice beyond the first: it goes ahead
        // of its user's new requests, and waits for a worker to come back.
        let under_way = a.preempted || !a.failed.is_empty() || job.persistence.lease().is_some();
        let admitted = tokio::select! {
            l = self.pool.readmit(&user, model, session, &a.failed), if under_way => l,
            l = self.pool.admit(&user, model, session, &a.failed), if !under_way => l,
            () = live.stopped() => return Err(End::Finished(FinishReason::Cancelled)),
        };
        a.preempted = false;
        admitted.map_err(|e| {
            let why = if a.failed.is_empty() {
                e.to_string()
            } else if a.busy {
                PoolError::Full.to_string()
            } else {
                format!("the worker failed and {e}")
            };
            End::Failed(GenerationError::Unavailable(why))
        })
    }

    /// Follows one worker's stream until the reply ends or must go on elsewhere.
    async fn follow(
        &self,
        job: &Job,
        live: &Live,
        p: &mut Progress,
        a: &mut Attempts,
        lease: &Lease,
        mut gen: Generation,
    ) -> Next {
        let resumed = !p.generated.is_empty();
        loop {
            let event = tokio::select! {
                e = gen.next() => e,
                () = live.stopped() => return Next::End(End::Finished(FinishReason::Cancelled)),
                () = lease.yielded() => {
                    // Dropping the generation cancels it on the worker, then the lease frees
                    // the place; the reply continues from here once it has one again.
                    tracing::debug!(worker = %lease.addr(), generated = p.generated.len(), "giving the worker's place to another user's request");
                    a.preempted = true;
                    return Next::Retry;
                }
                _ = a.tick.tick() => {
                    if let Some(saver) = &mut a.saver {
                        saver.save(p.checkpoint(live));
                    }
                    continue;
                }
            };
            let next = match event.and_then(|e| e.kind) {
                Some(Kind::Started(s)) => {
                    if p.cached_tokens.is_none() && !resumed {
                        p.cached_tokens = Some(u64::from(s.cached_tokens));
                    }
                    None
                }
                Some(Kind::Tokens(t)) => self.tokens(job, live, p, a, t),
                Some(Kind::Finished(f)) => Some(self.finished(job, live, p, a, lease, f.reason)),
                Some(Kind::Error(e)) => Some(a.fault(lease, e, p.generated.len())),
                None => {
                    a.failing("the worker's stream ended");
                    a.failed.push(lease.excluded());
                    Some(Next::Retry)
                }
            };
            if let Some(next) = next {
                return next;
            }
        }
    }

    /// Detokenizes new tokens and streams their text; ends the reply at a stop string.
    fn tokens(
        &self,
        job: &Job,
        live: &Live,
        p: &mut Progress,
        a: &mut Attempts,
        t: proto::Tokens,
    ) -> Option<Next> {
        let now = Instant::now();
        if let Some(prev) = p.last_token {
            telemetry::observe(
                telemetry::INTER_TOKEN,
                now.duration_since(prev).as_secs_f64(),
            );
        }
        p.last_token = Some(now);
        if job.request.sampling.logprobs.is_some() {
            live.push(RunEvent::Logprobs(logprobs(&job.placement.tokenizer, &t)));
        }
        for id in t.ids {
            p.generated.push(id);
            let piece = a
                .detok
                .push(&job.placement.tokenizer, id)
                .unwrap_or_default();
            if piece.is_empty() {
                continue;
            }
            let fed = a.stops.push(&piece);
            self.emit(job, live, p, fed.text);
            if fed.stopped {
                p.stop_sequence = a.stops.matched().map(str::to_string);
                return Some(Next::End(End::Finished(FinishReason::Stop)));
            }
        }
        None
    }

    /// The worker ended the reply: flush what the detokenizer and stop matcher hold back.
    fn finished(
        &self,
        job: &Job,
        live: &Live,
        p: &mut Progress,
        a: &mut Attempts,
        lease: &Lease,
        reason: i32,
    ) -> Next {
        let Some(finish) = proto::FinishReason::try_from(reason)
            .ok()
            .and_then(|r| FinishReason::try_from(r).ok())
        else {
            tracing::error!(worker = %lease.addr(), reason, "unknown finish reason");
            return Next::End(End::Failed(GenerationError::Internal(format!(
                "the worker ended the reply with an unknown finish reason ({reason})"
            ))));
        };
        let tail = a.detok.finish(&job.placement.tokenizer).unwrap_or_default();
        let mut rest = a.stops.push(&tail).text;
        rest.push_str(&a.stops.flush());
        p.stop_sequence = a.stops.matched().map(str::to_string);
        self.emit(job, live, p, rest);
        Next::End(End::Finished(finish))
    }

    /// Saves a reply's job, then its checkpoints in the background, latest first: a slow or
    /// unreachable database delays the saved copy, never the tokens. A write refused because
    /// another replica holds the reply now disowns it here. Ends when the sender is dropped.
    fn progress_saver(
        &self,
        lease: ReplyLease,
        job: Option<String>,
    ) -> tokio::sync::watch::Sender<Checkpoint> {
        let (tx, mut rx) = tokio::sync::watch::channel(Checkpoint::default());
        let (store, leases) = (self.store.clone(), self.leases.clone());
        let savers = self.savers.clone();
        savers.send_modify(|n| *n += 1);
        tokio::spawn(async move {
            let owned = |r: Result<bool, StoreError>, what: &str| match r {
                Ok(false) => {
                    leases.lost(std::slice::from_ref(&lease.message_id));
                    false
                }
                Ok(true) => true,
                Err(e) => {
                    tracing::warn!(error = %e, "could not save a reply's {what}");
                    true
                }
            };
            // A job the database did not take (down a while) is tried again with each
            // checkpoint: without it, no replica can continue the reply once Redis loses it.
            let mut unsaved = job;
            let mut go_on = true;
            loop {
                if let Some(j) = &unsaved {
                    let r = store.save_job(&lease, j).await;
                    if r.is_ok() {
                        unsaved = None;
                    }
                    go_on = owned(r, "job");
                }
                if !go_on || rx.changed().await.is_err() {
                    break;
                }
                let cp = rx.borrow_and_update().clone();
                go_on = owned(store.save_progress(&lease, &cp).await, "progress");
            }
            savers.send_modify(|n| *n -= 1);
        });
        tx
    }

    /// Waits, at most `limit`, until no reply's progress is being saved: replies handed over
    /// at shutdown write nothing more, so the replica taking one over claims it as last saved.
    pub(crate) async fn saves_done(&self, limit: Duration) {
        let mut rx = self.savers.subscribe();
        let _ = tokio::time::timeout(limit, rx.wait_for(|n| *n == 0)).await;
    }

    fn emit(&self, job: &Job, live: &Live, p: &mut Progress, text: String) {
        if text.is_empty() {
            return;
        }
        if p.first_token.is_none() {
            let now = Instant::now();
            p.first_token = Some(now);
            if !p.taken_over {
                telemetry::observe(
                    telemetry::TTFT,
                    now.duration_since(job.owner.arrived).as_secs_f64(),
                );
            }
        }
        p.text.push_str(&text);
        live.push_text(text, &p.generated[p.streamed..]);
        p.streamed = p.generated.len();
    }

    /// Stores how a reply ended, once its shared stream holds the end too: whoever finishes a
    /// reply stores what its clients were shown. Disowns the reply here when its lease is gone
    /// (another replica continues it, from the stream).
    async fn store_end(&self, lease: &ReplyLease, live: &Live, o: &Outcome) {
        if !live.is_disowned() {
            live.wait_published(END_PUBLISH_WAIT).await;
        }
        self.leases.finishing(&lease.message_id);
        if !live.is_disowned() && !self.finish(lease, o).await {
            tracing::warn!(message_id = %lease.message_id, "another replica took this reply over before its end was stored");
            live.disown();
        }
        self.leases.release(&lease.message_id);
    }

    /// Stores the final state, retrying through a short database outage. False when the lease
    /// no longer holds the reply.
    async fn finish(&self, lease: &ReplyLease, o: &Outcome) -> bool {
        let done = o.completion();
        let mut wait = Duration::from_millis(250);
        for attempt in 1..=8 {
            match self.store.finish_message(lease, &done).await {
                Ok(owned) => return owned,
                Err(StoreError::Unavailable(e)) if attempt < 8 => {
                    tracing::warn!(error = %e, attempt, "database unavailable; retrying the reply's final write");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(5));
                }
                Err(e) => {
                    let message_id = &lease.message_id;
                    tracing::error!(error = %e, %message_id, "the reply's final state was not stored; it will be taken over or marked interrupted");
                    return true;
                }
            }
        }
        true
    }
}

/// How `job` ended, from its progress `p` and its `end`: text, tool calls, usage, timings.
fn outcome_of(job: &Job, p: Progress, end: End) -> Outcome {
    let tool_calls = match (&job.request.output.tools, &end) {
        (Some(tools), End::Finished(FinishReason::Stop)) => tools.calls(&p.text),
        _ => None,
    };
    Outcome {
        content: p.text,
        end,
        tool_calls,
        usage: ReplyUsage {
            prompt_tokens: job.request.prompt.tokens.len() as u64,
            cached_tokens: p.cached_tokens.unwrap_or(0),
            completion_tokens: p.generated.len() as u64,
        },
        timings: ReplyTimings {
            ttft_ms: p
                .first_token
                .filter(|_| !p.taken_over)
                .map(|t| t.duration_since(job.owner.arrived).as_millis() as u64),
            duration_ms: job.owner.arrived.elapsed().as_millis() as u64,
        },
        worker: p.worker,
        stop_sequence: p.stop_sequence,
    }
}

/// Records a reply's end in the metrics: its duration, tokens and finish reason (the decode
/// time from its `first_token`).
fn record_end(job: &Job, outcome: &Outcome, first_token: Option<Instant>) {
    trace_end(job, outcome, first_token);
    telemetry::observe(
        telemetry::REQUEST_DURATION,
        job.owner.arrived.elapsed().as_secs_f64(),
    );
    let usage = outcome.usage;
    metrics::counter!(telemetry::PROMPT_TOKENS).increment(usage.prompt_tokens);
    metrics::counter!(telemetry::CACHED_PROMPT_TOKENS).increment(usage.cached_tokens);
    metrics::counter!(telemetry::GENERATED_TOKENS).increment(usage.completion_tokens);
    telemetry::record_reply_end(&telemetry::ReplyEnd {
        finish_reason: outcome.finish_reason().as_str(),
        error_type: outcome.end.error().map(GenerationError::kind),
        prompt_tokens: usage.prompt_tokens,
        completion_tokens: usage.completion_tokens,
        decode: first_token.map(|t| t.elapsed()),
    });
}

/// Records a reply's end on its span (the current one): usage, finish, and its timing.
fn trace_end(job: &Job, outcome: &Outcome, first_token: Option<Instant>) {
    let span = tracing::Span::current();
    let usage = outcome.usage;
    span.record("gen_ai.usage.input_tokens", usage.prompt_tokens);
    span.record("gen_ai.usage.output_tokens", usage.completion_tokens);
    span.record("hearth.cached_tokens", usage.cached_tokens);
    let finish = format!("[\"{}\"]", outcome.finish_reason().as_str());
    span.record("gen_ai.response.finish_reasons", finish.as_str());
    if hearth_shared::tracing_export::include_content() {
        let prompt = job.placement.tokenizer.decode(&job.request.prompt.tokens);
        span.record("gen_ai.prompt", prompt.unwrap_or_default().as_str());
        span.record("gen_ai.completion", outcome.content.as_str());
    }
    if let Some(t) = first_token {
        let ttft = t.duration_since(job.owner.arrived).as_secs_f64() * 1000.0;
        span.record("hearth.time_to_first_token_ms", ttft);
        if usage.completion_tokens > 1 {
            let per = t.elapsed().as_secs_f64() * 1000.0 / (usage.completion_tokens - 1) as f64;
            span.record("hearth.time_per_output_token_ms", per);
        }
    }
}

/// Longest a reply's end waits to be in its shared stream before it is stored anyway (the
/// publisher gives up on Redis sooner: see [`shared`]).
const END_PUBLISH_WAIT: Duration = Duration::from_secs(90);

/// The worker's log-probabilities of `t`'s tokens, with their text.
fn logprobs(tok: &Tokenizer, t: &proto::Tokens) -> Vec<TokenLogprob> {
    let text = |id: u32| {
        let token = tok.decode(&[id]).unwrap_or_default();
        let bytes = token.as_bytes().to_vec();
        (token, bytes)
    };
    t.ids
        .iter()
        .zip(&t.logprobs)
        .enumerate()
        .map(|(i, (&id, &logprob))| {
            let (token, bytes) = text(id);
            let top = t.top.get(i).map_or(Vec::new(), |top| {
                top.ids
                    .iter()
                    .zip(&top.logprobs)
                    .map(|(&id, &logprob)| {
                        let (token, bytes) = text(id);
                        TopLogprob {
                            token,
                            logprob,
                            bytes,
                        }
                    })
                    .collect()
            });
            TokenLogprob {
                token,
                logprob,
                bytes,
                top_logprobs: top,
            }
        })
        .collect()
}
