//! One `Generate` stream: many requests multiplexed in, request-tagged events out.
//!
//! A connection task owns the stream's requests. Each accepted request gets a forwarder task that
//! relays its engine events, coalescing tokens that are already queued into one `Tokens` event.
//! A plain request is handed to the engine by the connection task itself, in the stream's order;
//! a constrained one by its forwarder, once its grammar is compiled (which may take seconds), so
//! the connection task never waits on a request and one request's grammar never holds up those
//! behind it on the stream (the orchestrator multiplexes every tenant onto one).
//! Cancellation follows ownership: when the client goes away, the connection task drops every
//! forwarder (and with it the engine event streams) and cancels the requests in the engine, which
//! frees their slots at its next step.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use hearth_shared::proto::{self, worker_event::Kind, worker_request};
use hearth_shared::{Grammar, RequestId, SamplingParams, SessionId, UserId};
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinSet;
use tonic::{Code, Status, Streaming};
use tracing::Instrument;

use super::models::ModelGuard;
use super::state::{InFlight, WorkerState};
use super::status::{self, error_event};
use crate::engine::{EngineError, EngineEvent, EngineHandle, EventStream, GenerateRequest};

pub type EventTx = mpsc::Sender<Result<proto::WorkerEvent, Status>>;

/// Events buffered per stream before forwarders wait for the client to read.
pub const OUT_QUEUE: usize = 512;
/// Most tokens coalesced into one `Tokens` event.
const MAX_TOKENS_PER_EVENT: usize = 64;
/// Longest accepted session or user id, in bytes.
const MAX_ID_BYTES: usize = 256;

/// Runs one stream until the client is done and every request has finished, or the client goes.
pub async fn connection_task(
    state: Arc<WorkerState>,
    mut inbound: Streaming<proto::WorkerRequest>,
    out: EventTx,
) {
    let mut conn = Connection {
        state,
        out,
        live: HashMap::new(),
        forwarders: JoinSet::new(),
        tasks: HashMap::new(),
    };
    let mut drain = conn.state.drain_signal();
    let mut draining = *drain.borrow();
    let mut inbound_open = true;
    loop {
        if conn.forwarders.is_empty() {
            if draining {
                // Tell the client to go elsewhere rather than leaving the stream open.
                let _ = conn
                    .out
                    .send(Err(Status::unavailable("the worker is shutting down")))
                    .await;
                return;
            }
            if !inbound_open {
                return;
            }
        }
        tokio::select! {
            msg = inbound.message(), if inbound_open => match msg {
                Ok(Some(req)) => {
                    if conn.handle(req).await.is_err() {
                        conn.cancel_all();
                        return;
                    }
                }
                // Half-close: no more requests, but those in flight still stream.
                Ok(None) => inbound_open = false,
                Err(e) => {
                    // A broken connection, or a message this server cannot take (too large,
                    // undecodable): end the stream with the reason, if anyone still listens.
                    tracing::debug!(status = %e, "generate stream broken");
                    conn.cancel_all();
                    let _ = conn.out.send(Err(e)).await;
                    return;
                }
            },
            Some(done) = conn.forwarders.join_next_with_id() => {
                if conn.finish(done).await.is_err() {
                    conn.cancel_all();
                    return;
                }
            }
            () = conn.out.closed() => {
                tracing::debug!(requests = conn.live.len(), "generate stream dropped by the client");
                conn.cancel_all();
                return;
            }
            changed = drain.changed(), if !draining => {
                draining = changed.is_err() || *drain.borrow();
            }
        }
    }
}

struct Connection {
    state: Arc<WorkerState>,
    out: EventTx,
    /// The client's request id → its request in the engine.
    live: HashMap<u64, Live>,
    /// One per live request; each returns the request's last event, which the connection sends
    /// only after forgetting the id, so a client may reuse an id as soon as it sees that event.
    /// The forwarder also hands back the request's in-flight count, released once the last
    /// event is sent, so a drain never finishes ahead of a request's final event.
    forwarders: JoinSet<(proto::WorkerEvent, Guards)>,
    /// Forwarder task → client request id, to forget the id even if a forwarder panics.
    tasks: HashMap<tokio::task::Id, u64>,
}

/// The client stopped reading; nothing more can be delivered.
struct Gone;

/// A request of the stream, from its acceptance to its last event.
struct Live {
    id: RequestId,
    /// The engine (its model's) that runs it.
    engine: EngineHandle,
    /// Told of a cancel, for a request that is not in the engine yet (its grammar compiling).
    cancel: Arc<Notify>,
}

impl Live {
    fn cancel(&self) {
        self.engine.cancel(self.id);
        // Keeps a permit if the forwarder is not waiting yet, so no cancel is missed.
        self.cancel.notify_one();
    }
}

/// A request's place in the worker's and its model's in-flight counts.
type Guards = (InFlight, ModelGuard);

impl Connection {
    async fn handle(&mut self, req: proto::WorkerRequest) -> Result<(), Gone> {
        match req.kind {
            Some(worker_request::Kind::Batch(batch)) => {
                for r in batch.requests {
                    self.submit(r).await?;
                }
            }
            Some(worker_request::Kind::Cancel(c)) => {
                // A cancel that races the request's end finds nothing: not an error.
                if let Some(live) = self.live.get(&c.request_id) {
                    live.cancel();
                }
            }
            None => tracing::debug!("empty WorkerRequest ignored"),
        }
        Ok(())
    }

    /// A forwarder ended: forget its id, then deliver its last event.
    async fn finish(
        &mut self,
        done: Result<(tokio::task::Id, (proto::WorkerEvent, Guards)), tokio::task::JoinError>,
    ) -> Result<(), Gone> {
        let (task, last, _in_flight) = match done {
            Ok((task, (last, guard))) => (task, Some(last), Some(guard)),
            Err(e) => (e.id(), None, None),
        };
        let Some(client_id) = self.tasks.remove(&task) else {
            return Ok(());
        };
        self.live.remove(&client_id);
        let last = last.unwrap_or_else(|| {
            error_event(
                client_id,
                Code::Internal,
                "the request's event relay failed",
            )
        });
        self.out.send(Ok(last)).await.map_err(|_| Gone)
    }

    async fn submit(&mut self, r: proto::GenerateRequest) -> Result<(), Gone> {
        let client_id = r.request_id;
        // Counted before the phase check, so a drain that starts meanwhile waits for it.
        let guard = self.state.track();
        match self.start(r, guard).await {
            Ok(()) => Ok(()),
            Err((code, msg)) => self
                .out
                .send(Ok(error_event(client_id, code, msg)))
                .await
                .map_err(|_| Gone),
        }
    }

    /// Starts `r` on its model's engine, or says why not.
    async fn start(
        &mut self,
        mut r: proto::GenerateRequest,
        guard: InFlight,
    ) -> Result<(), (Code, String)> {
        let client_id = r.request_id;
        let refused = |s: Status| (s.code(), s.message().to_string());
        let slot = self.state.model_for(&r.model).map_err(refused)?;
        if self.live.contains_key(&client_id) {
            return Err((
                Code::InvalidArgument,
                format!("request_id: {client_id} is already in flight on this stream"),
            ));
        }
        // Counted before the model's phase is checked again, so an unload that starts
        // meanwhile waits for it.
        let on_model = slot.track();
        let engine = slot.accepting().map_err(refused)?.clone();
        if let Some(ms) = r.keep_alive_ms {
            slot.set_keep_alive(ms, r.keep_alive_may_shorten);
        }
        let (model, traceparent) = (r.model.clone(), std::mem::take(&mut r.traceparent));
        let prompt_tokens = r.prompt_token_ids.len();
        let req = self
            .to_engine_request(r)
            .map_err(|m| (Code::InvalidArgument, m))?;
        let live = Live {
            id: req.id,
            engine: engine.clone(),
            cancel: Arc::new(Notify::new()),
        };
        let submitted: Submission = if req.grammar.is_none() {
            // A plain request is handed over at once, in the stream's order.
            let events = engine
                .submit(req)
                .map_err(|e| (status::code(&e), e.to_string()))?;
            Box::pin(std::future::ready(Ok(events)))
        } else {
            Box::pin(submit_unless_cancelled(engine, req, live.cancel.clone()))
        };
        let out = self.out.clone();
        let span = request_span(&model, prompt_tokens, &traceparent);
        let forwarding = forward(client_id, submitted, out, (guard, on_model));
        let task = self.forwarders.spawn(forwarding.instrument(span));
        self.live.insert(client_id, live);
        self.tasks.insert(task.id(), client_id);
        Ok(())
    }

    fn to_engine_request(&self, r: proto::GenerateRequest) -> Result<GenerateRequest, String> {
        for (field, v) in [("session_id", &r.session_id), ("user_id", &r.user_id)] {
            if v.len() > MAX_ID_BYTES {
                return Err(format!("{field}: longer than {MAX_ID_BYTES} bytes"));
            }
        }
        Ok(GenerateRequest {
            id: RequestId(self.state.next_engine_id()),
            session: (!r.session_id.is_empty()).then(|| SessionId::new(r.session_id)),
            user: if r.user_id.is_empty() {
                UserId::new("anonymous")
            } else {
                UserId::new(r.user_id)
            },
            prompt: r.prompt_token_ids,
            params: r.sampling.map(SamplingParams::from).unwrap_or_default(),
            max_new_tokens: r.max_new_tokens,
            stop_token_ids: r.stop_token_ids,
            ignore_eos: r.ignore_eos,
            sampled_before: r.sampled_tokens,
            shared_prefix: r.shared_prefix_tokens,
            dry_breakers: r.dry_breaker_ids,
            top_logprobs: r.top_logprobs,
            grammar: r
                .grammar
                .map(Grammar::try_from)
                .transpose()
                .map_err(|e| format!("grammar: {e}"))?,
        })
    }

    fn cancel_all(&mut self) {
        for live in self.live.values() {
            live.cancel();
        }
        self.forwarders.abort_all();
    }
}

/// A request on its way to its engine: its event stream once there.
type Submission =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<EventStream, NotSubmitted>> + Send>>;

/// Why a request never reached its engine.
enum NotSubmitted {
    Refused(EngineError),
    /// Cancelled while its grammar waited or compiled.
    Cancelled {
        prompt_tokens: usize,
        since: Instant,
    },
}

/// Hands `req` to `engine`, unless it is cancelled first.
async fn submit_unless_cancelled(
    engine: EngineHandle,
    req: GenerateRequest,
    cancel: Arc<Notify>,
) -> Result<EventStream, NotSubmitted> {
    let (prompt_tokens, since) = (req.prompt.len(), Instant::now());
    tokio::select! {
        biased;
        // A compile that is already running finishes on its own thread; the event stream it
        // returns is dropped there, which the engine takes as a cancel.
        () = cancel.notified() => Err(NotSubmitted::Cancelled { prompt_tokens, since }),
        r = submit_to_engine(engine, req) => r.map_err(NotSubmitted::Refused),
    }
}

/// Hands constrained `req` to `engine`. Its grammar is compiled against the vocabulary as it is
/// taken (milliseconds for a large schema, seconds for a hundred tools), so the request is handed
/// over on the blocking pool, where it cannot hold up the runtime's other streams and health
/// checks, and at most half the cores compile at once: a tenant's many huge grammars
/// wait for each other, and leave the engine the cores it steps on.
async fn submit_to_engine(
    engine: EngineHandle,
    req: GenerateRequest,
) -> Result<EventStream, EngineError> {
    static COMPILING: std::sync::OnceLock<Arc<tokio::sync::Semaphore>> = std::sync::OnceLock::new();
    let slots = COMPILING.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(2, usize::from);
        Arc::new(tokio::sync::Semaphore::new((cores / 2).max(1)))
    });
    let slot = slots
        .clone()
        .acquire_owned()
        .await
        .map_err(|e| EngineError::Internal(format!("the grammar compiler: {e}")))?;
    tokio::task::spawn_blocking(move || {
        let _slot = slot;
        engine.submit(req)
    })
    .await
    .unwrap_or_else(|e| Err(EngineError::Internal(format!("submitting failed: {e}"))))
}

/// Waits for one request to reach its engine, relays its engine events to the stream and
/// returns its last event, unsent. A request its model's unload cut short ends as
/// `UNAVAILABLE`, so the client continues it on another worker.
async fn forward(
    client_id: u64,
    submitted: Submission,
    out: EventTx,
    guards: Guards,
) -> (proto::WorkerEvent, Guards) {
    let last = match submitted.await {
        Ok(mut events) => relay(client_id, &mut events, &out).await,
        Err(NotSubmitted::Refused(e)) => {
            return (
                error_event(client_id, status::code(&e), e.to_string()),
                guards,
            )
        }
        Err(NotSubmitted::Cancelled {
            prompt_tokens,
            since,
        }) => cancelled_before_start(client_id, prompt_tokens, since),
    };
    let slot = guards.1.slot();
    let cancelled = matches!(&last.kind, Some(Kind::Finished(f)) if f.reason == proto::FinishReason::Cancelled as i32);
    if cancelled && slot.was_cut() {
        let msg = format!("the model {} was unloaded from this worker", slot.key());
        return (error_event(client_id, Code::Unavailable, msg), guards);
    }
    (last, guards)
}

/// The last event of a request cancelled before it reached its engine: what the engine sends
/// for a request cancelled while it waits.
fn cancelled_before_start(
    client_id: u64,
    prompt_tokens: usize,
    since: Instant,
) -> proto::WorkerEvent {
    let ms = since.elapsed().as_secs_f64() * 1000.0;
    proto::WorkerEvent {
        request_id: client_id,
        kind: Some(Kind::Finished(proto::Finished {
            reason: proto::FinishReason::Cancelled as i32,
            prompt_tokens: prompt_tokens as u32,
            cached_tokens: 0,
            completion_tokens: 0,
            timings: Some(proto::Timings {
                queue_ms: ms,
                time_to_first_token_ms: 0.0,
                total_ms: ms,
            }),
        })),
    }
}

/// Adds a token (and its alternatives, when asked for) to a batch of them.
fn push_token(t: &mut proto::Tokens, id: u32, logprob: f32, top: Vec<(u32, f32)>) {
    t.ids.push(id);
    t.logprobs.push(logprob);
    if !top.is_empty() {
        let (ids, logprobs) = top.into_iter().unzip();
        t.top.push(proto::TopLogprobs { ids, logprobs });
    }
}

/// The span of one request on this worker, in the orchestrator's trace when it sent one: its
/// phases (`admission`, `prefill`, `decode`) are its children.
fn request_span(model: &str, prompt_tokens: usize, traceparent: &str) -> tracing::Span {
    let span = tracing::info_span!(
        "hearth.worker.generate",
        otel.name = "worker generate",
        otel.kind = "server",
        gen_ai.request.model = %model,
        hearth.prompt_tokens = prompt_tokens,
        hearth.cached_tokens = tracing::field::Empty,
        gen_ai.usage.output_tokens = tracing::field::Empty,
        hearth.time_to_first_token_ms = tracing::field::Empty,
        hearth.finish_reason = tracing::field::Empty,
    );
    let parent = Some(traceparent).filter(|t| !t.is_empty());
    hearth_shared::tracing_export::set_parent(&span, parent);
    span
}

/// Which phase a request is in, each a span under the request's: waiting for the engine to take
/// it, computing its prompt, then generating.
struct Phase {
    span: tracing::Span,
    decoding: bool,
    tokens: usize,
    steps: usize,
}

impl Phase {
    fn new() -> Self {
        Self {
            span: tracing::info_span!("admission"),
            decoding: false,
            tokens: 0,
            steps: 0,
        }
    }

    fn started(&mut self, cached_tokens: usize) {
        tracing::Span::current().record("hearth.cached_tokens", cached_tokens);
        self.span = tracing::info_span!("prefill", hearth.cached_tokens = cached_tokens);
    }

    fn tokens(&mut self, n: usize) {
        if !self.decoding {
            self.decoding = true;
            self.span = tracing::info_span!(
                "decode",
                hearth.tokens = tracing::field::Empty,
                hearth.steps = tracing::field::Empty
            );
        }
        self.tokens += n;
        self.steps += 1;
    }

    fn finished(
        &self,
        reason: hearth_shared::FinishReason,
        completion_tokens: usize,
        ttft_ms: Option<f64>,
    ) {
        self.span.record("hearth.tokens", self.tokens);
        self.span.record("hearth.steps", self.steps);
        let request = tracing::Span::current();
        request.record("gen_ai.usage.output_tokens", completion_tokens);
        request.record("hearth.finish_reason", format!("{reason:?}").as_str());
        if let Some(ms) = ttft_ms {
            request.record("hearth.time_to_first_token_ms", ms);
        }
    }
}

async fn relay(client_id: u64, events: &mut EventStream, out: &EventTx) -> proto::WorkerEvent {
    let mut next: Option<EngineEvent> = None;
    let mut phase = Phase::new();
    loop {
        let event = match next.take() {
            Some(e) => e,
            None => match events.recv().await {
                Some(e) => e,
                None => {
                    let msg = "the engine ended the request without a result";
                    return error_event(client_id, Code::Internal, msg);
                }
            },
        };
        let kind = match event {
            EngineEvent::Started {
                cached_tokens,
                queue_ms,
            } => {
                phase.started(cached_tokens);
                Kind::Started(proto::Started {
                    cached_tokens: cached_tokens as u32,
                    queue_ms,
                })
            }
            EngineEvent::Token { id, logprob, top } => {
                let mut t = proto::Tokens::default();
                push_token(&mut t, id, logprob, top);
                while t.ids.len() < MAX_TOKENS_PER_EVENT {
                    match events.try_recv() {
                        Ok(EngineEvent::Token { id, logprob, top }) => {
                            push_token(&mut t, id, logprob, top);
                        }
                        Ok(other) => {
                            next = Some(other);
                            break;
                        }
                        Err(_) => break,
                    }
                }
                phase.tokens(t.ids.len());
                Kind::Tokens(t)
            }
            EngineEvent::Finished {
                reason,
                prompt_tokens,
                cached_tokens,
                completion_tokens,
                timings,
            } => {
                let ttft = Some(timings.time_to_first_token_ms);
                phase.finished(reason, completion_tokens, ttft);
                return proto::WorkerEvent {
                    request_id: client_id,
                    kind: Some(Kind::Finished(proto::Finished {
                        reason: proto::FinishReason::from(reason) as i32,
                        prompt_tokens: prompt_tokens as u32,
                        cached_tokens: cached_tokens as u32,
                        completion_tokens: completion_tokens as u32,
                        timings: Some(proto::Timings {
                            queue_ms: timings.queue_ms,
                            time_to_first_token_ms: timings.time_to_first_token_ms,
                            total_ms: timings.total_ms,
                        }),
                    })),
                };
            }
            EngineEvent::Error(e) => {
                return error_event(client_id, status::code(&e), e.to_string());
            }
        };
        let event = proto::WorkerEvent {
            request_id: client_id,
            kind: Some(kind),
        };
        if out.send(Ok(event)).await.is_err() {
            // The client is gone; the connection task is cancelling everything.
            return error_event(client_id, Code::Cancelled, "the client went away");
        }
    }
}
