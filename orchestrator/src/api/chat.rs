//! Generation on the native API: post a message, regenerate the last reply, edit an earlier
//! message and answer it again, stop, and resume a stream. Replies stream as Server-Sent Events (`message_start`, `token`, `message_end`,
//! `error`), each with an id `<message id>:<n>` that `GET /v1/sessions/{id}/stream` accepts
//! as `Last-Event-ID`; with `"stream": false` the answer is the finished message as JSON.
//!
//! The user message and an assistant placeholder are stored before generation starts; the
//! reply is saved as it streams and finalized when it ends, whether or not anyone is still
//! listening (unless the server runs with `--cancel-on-disconnect`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use hearth_shared::chat::{render, ChatError, Message as ChatMessage, Role as ChatRole};
use hearth_shared::SamplingParams;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tokio_stream::StreamExt;
use utoipa::ToSchema;

use super::ids::{MessageId, SessionId};
use super::{ApiError, AppState, Caller, ValidJson};
use crate::generate::{Job, Live, Outcome, Persistence, Reservation, RunEvent, TurnIds};
use crate::storage::{Message, MessageStatus, Role, Session};

/// Largest message a user may post.
pub const MAX_CONTENT_BYTES: usize = 256 << 10;
const MAX_STOPS: usize = 16;
const MAX_STOP_CHARS: usize = 256;

/// Options shared by every generation request.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TurnBody {
    /// The new user message, or an edited one's new text: required there, up to 256 KiB, not
    /// blank. Refused on regenerate.
    #[serde(default)]
    #[schema(min_length = 1)]
    pub content: Option<String>,
    /// This turn's sampling parameters; the session's defaults when absent.
    #[serde(default)]
    pub params: Option<SamplingParams>,
    /// `false`: answer with the finished message as JSON instead of Server-Sent Events.
    #[serde(default)]
    #[schema(default = true)]
    pub stream: Option<bool>,
    /// Longest reply: at least 1 and less than the model's context; the session's default, else
    /// the server's, when absent.
    #[serde(default)]
    #[schema(minimum = 1)]
    pub max_tokens: Option<u32>,
    /// Up to 16 strings of 1 to 256 characters; the reply ends before the first one it would
    /// print.
    #[serde(default)]
    #[schema(value_type = Option<super::openapi::StopList>)]
    pub stop: Option<Vec<String>>,
    /// Generate `max_tokens` even past the model's end of turn.
    #[serde(default)]
    pub ignore_eos: bool,
}

/// Validated generation options.
#[derive(Debug, Clone)]
pub struct GenOptions {
    pub params: SamplingParams,
    pub max_tokens: Option<u32>,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
}

pub fn check_stops(stop: Vec<String>, field: &str) -> Result<Vec<String>, ApiError> {
    if stop.len() > MAX_STOPS {
        return Err(ApiError::Validation(format!(
            "{field}: at most {MAX_STOPS} stop strings"
        )));
    }
    for s in &stop {
        if s.is_empty() || s.chars().count() > MAX_STOP_CHARS {
            return Err(ApiError::Validation(format!(
                "{field}: each stop string must be 1 to {MAX_STOP_CHARS} characters"
            )));
        }
    }
    Ok(stop)
}

pub fn check_params(p: SamplingParams, field: &str) -> Result<SamplingParams, ApiError> {
    p.validate()
        .map_err(|e| ApiError::Validation(format!("{field}.{}: {}", e.field, e.reason)))?;
    Ok(p)
}

pub fn check_content(field: &str, c: &str) -> Result<(), ApiError> {
    if c.trim().is_empty() {
        return Err(ApiError::Validation(format!("{field}: must not be empty")));
    }
    if c.len() > MAX_CONTENT_BYTES {
        return Err(ApiError::Validation(format!(
            "{field}: longer than {MAX_CONTENT_BYTES} bytes"
        )));
    }
    if c.contains('\0') {
        return Err(ApiError::Validation(format!(
            "{field}: must not contain NUL characters"
        )));
    }
    Ok(())
}

impl TurnBody {
    fn options(&self, session: &Session) -> Result<GenOptions, ApiError> {
        let params = match (&self.params, &session.params) {
            (Some(p), _) => check_params(p.clone(), "params")?,
            (None, Some(stored)) => serde_json::from_value(stored.clone()).unwrap_or_default(),
            (None, None) => SamplingParams::default(),
        };
        Ok(GenOptions {
            params,
            // The turn's own value, else the session's default (else the server's).
            max_tokens: self
                .max_tokens
                .or_else(|| session.max_tokens.and_then(|n| u32::try_from(n).ok())),
            stop: check_stops(self.stop.clone().unwrap_or_default(), "stop")?,
            ignore_eos: self.ignore_eos,
        })
    }
}

/// Refuses a `max_tokens` the served context cannot hold, before anything is charged or stored.
pub fn check_max_tokens(s: &AppState, max_tokens: Option<u32>) -> Result<(), ApiError> {
    let (Some(want), Some(ctx)) = (max_tokens, s.generator.pool.context_length()) else {
        return Ok(());
    };
    if want == 0 || want as usize >= ctx {
        return Err(ApiError::Validation(format!(
            "max_tokens: must be between 1 and {} (the model's context is {ctx} tokens)",
            ctx - 1
        )));
    }
    Ok(())
}

/// Prompt tokens for `convo` and the number of tokens to generate: the oldest whole turns are
/// dropped until the prompt leaves room for the reply. Tokenizing runs on the blocking pool, so
/// a long history never holds up the runtime's other requests (or its health checks).
pub async fn plan(
    s: &AppState,
    convo: &[ChatMessage],
    max_tokens: Option<u32>,
) -> Result<(Vec<u32>, u32), ApiError> {
    let ctx = s
        .generator
        .pool
        .context_length()
        .ok_or_else(|| ApiError::Unavailable("no worker is ready".into()))?;
    // The server's default shrinks to fit a small model; an explicit value must fit as asked.
    let want = max_tokens.unwrap_or_else(|| s.options.default_max_tokens.min(ctx as u32 / 2));
    check_max_tokens(s, Some(want))?;
    let reserve = (want as usize).min(ctx / 2);
    let tokenizer = s.generator.tokenizer.clone();
    let convo = convo.to_vec();
    let rendered = tokio::task::spawn_blocking(move || render(&tokenizer, &convo, ctx - reserve))
        .await
        .map_err(|e| ApiError::Internal(format!("prompt rendering failed: {e}")))?;
    let prompt = rendered.map_err(|e| match e {
        ChatError::Tokenizer(e) => ApiError::Internal(e.to_string()),
        other => ApiError::Validation(other.to_string()),
    })?;
    let room = (ctx - prompt.tokens.len()) as u32;
    Ok((prompt.tokens, want.min(room)))
}

/// The stored conversation as the template sees it: the system prompt, then every message
/// with text (a reply that was cut off counts with what it said).
fn conversation(session: &Session, history: &[Message]) -> Vec<ChatMessage> {
    let mut out = Vec::with_capacity(history.len() + 2);
    if let Some(sys) = session.system_prompt.as_deref().filter(|s| !s.is_empty()) {
        out.push(ChatMessage::new(ChatRole::System, sys));
    }
    for m in history {
        if m.content.is_empty() {
            continue;
        }
        let role = match m.role {
            Role::User => ChatRole::User,
            Role::Assistant => ChatRole::Assistant,
        };
        out.push(ChatMessage::new(role, m.content.clone()));
    }
    out
}

/// Posts a user message and generates the reply: Server-Sent Events (`message_start`,
/// `token`…, then `message_end` or `error`), or with `"stream": false` the finished reply. Both
/// messages are stored before generation starts, and the reply is saved as it streams.
#[utoipa::path(post, path = "/v1/sessions/{id}/messages", operation_id = "postMessage", tag = "generation", params(super::SessionPath),
    request_body = TurnBody,
    responses(
        (status = 200, description = "The reply", content(
            (super::openapi::ReplyEvent = "text/event-stream"),
            (TurnReply = "application/json"),
        )),
        (status = 404, description = "No such session", body = super::ErrorBody),
        (status = 409, description = "The session already has a reply running", body = super::ErrorBody),
        (status = 422, description = "A field is out of range, or the session is full", body = super::ErrorBody),
    ))]
pub async fn post_message(
    State(s): State<AppState>,
    caller: Caller,
    id: SessionId,
    ValidJson(body): ValidJson<TurnBody>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let content = body
        .content
        .as_deref()
        .ok_or_else(|| ApiError::Validation("content: required".into()))?;
    check_content("content", content)?;
    let user = &caller.user;
    let t = open_turn(&s, &caller, &id, &body, arrived).await?;
    let mut convo = conversation(&t.session, &t.history);
    convo.push(ChatMessage::new(ChatRole::User, content));
    launch(&s, &caller, t.run, &convo, || async {
        let turn = s.store.begin_turn(&user.id, &id, content).await?;
        Ok((Some(turn.user.id), turn.assistant.id))
    })
    .await
}

/// Answers the last user message again, replacing the last reply.
#[utoipa::path(post, path = "/v1/sessions/{id}/regenerate", operation_id = "regenerate", tag = "generation", params(super::SessionPath),
    request_body = TurnBody,
    responses(
        (status = 200, description = "The new reply", content(
            (super::openapi::ReplyEvent = "text/event-stream"),
            (TurnReply = "application/json"),
        )),
        (status = 404, description = "No such session", body = super::ErrorBody),
        (status = 409, description = "A reply is running, or there is no reply to regenerate", body = super::ErrorBody),
        (status = 422, description = "A field is out of range", body = super::ErrorBody),
    ))]
pub async fn regenerate(
    State(s): State<AppState>,
    caller: Caller,
    id: SessionId,
    ValidJson(body): ValidJson<TurnBody>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    if body.content.is_some() {
        return Err(ApiError::Validation(
            "content: not accepted here; regenerate answers the last user message again".into(),
        ));
    }
    let user = &caller.user;
    let t = open_turn(&s, &caller, &id, &body, arrived).await?;
    // The reply to replace is the last message; what came before must end with a user message.
    let from = match t.history.last() {
        Some(m) if m.role == Role::Assistant => m.seq,
        _ => {
            return Err(ApiError::Conflict(
                "the session has no reply to regenerate".into(),
            ))
        }
    };
    let earlier: Vec<Message> = t.history.into_iter().filter(|m| m.seq < from).collect();
    let convo = conversation(&t.session, &earlier);
    let asked = earlier.last().map(|m| m.id.clone());
    launch(&s, &caller, t.run, &convo, || async {
        let reply = s.store.begin_regenerate(&user.id, &id, from).await?;
        Ok((asked, reply.id))
    })
    .await
}

/// `POST /v1/sessions/{id}/messages/{message_id}/edit`: edit and resend. Replaces the user
/// message's content and drops everything after it, in the same transaction that stores the new
/// reply's placeholder, then answers like a new turn. The worker's cache of the session rewinds
/// to the prefix the edit left unchanged by itself.
#[utoipa::path(post, path = "/v1/sessions/{id}/messages/{message_id}/edit", operation_id = "editMessage", tag = "generation",
    params(super::SessionPath,
        ("message_id" = String, Path, pattern = "^[0-9a-f]{32}$", description = "The user message to edit")),
    request_body = TurnBody,
    responses(
        (status = 200, description = "The reply to the edited message", content(
            (super::openapi::ReplyEvent = "text/event-stream"),
            (TurnReply = "application/json"),
        )),
        (status = 404, description = "No such session or message", body = super::ErrorBody),
        (status = 409, description = "The session already has a reply running", body = super::ErrorBody),
        (status = 422, description = "A field is out of range, or the message is not a user message", body = super::ErrorBody),
    ))]
pub async fn edit(
    State(s): State<AppState>,
    caller: Caller,
    id: SessionId,
    message_id: MessageId,
    ValidJson(body): ValidJson<TurnBody>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let content = body
        .content
        .as_deref()
        .ok_or_else(|| ApiError::Validation("content: required (the message's new text)".into()))?;
    check_content("content", content)?;
    let user = &caller.user;
    let t = open_turn(&s, &caller, &id, &body, arrived).await?;
    let target = t
        .history
        .iter()
        .find(|m| m.id == *message_id)
        .ok_or(ApiError::NotFound("message"))?;
    if target.role != Role::User {
        return Err(ApiError::not_a_user_message(format!(
            "message {message_id} is an {} message; only user messages can be edited \
             (POST /v1/sessions/{id}/regenerate answers the last one again)",
            target.role.as_str()
        )));
    }
    let from = target.seq;
    let earlier: Vec<Message> = t.history.into_iter().filter(|m| m.seq < from).collect();
    let mut convo = conversation(&t.session, &earlier);
    convo.push(ChatMessage::new(ChatRole::User, content));
    launch(&s, &caller, t.run, &convo, || async {
        let turn = s
            .store
            .begin_edit(&user.id, &id, &message_id, content)
            .await?;
        Ok((Some(turn.user.id), turn.assistant.id))
    })
    .await
}

/// What a new turn starts from: the caller's session, the options, the session's place (one
/// running reply at a time) and the stored history. Counts against the caller's rate limit.
struct OpenTurn {
    session: Session,
    history: Vec<Message>,
    run: TurnRun,
}

/// What running an admitted turn takes, besides its conversation.
struct TurnRun {
    session_id: String,
    opts: GenOptions,
    place: Place,
    /// Answer with Server-Sent Events (else with the finished reply).
    stream: bool,
    /// When the request arrived (time to first token counts from here).
    arrived: Instant,
}

/// What an admitted turn holds until its reply starts: the session's place and the tokens set
/// aside from the caller's daily budget. Dropped, both are given back.
struct Place {
    reservation: Reservation,
    budget: Option<crate::limits::Budget>,
}

async fn open_turn(
    s: &AppState,
    caller: &Caller,
    session_id: &str,
    body: &TurnBody,
    arrived: Instant,
) -> Result<OpenTurn, ApiError> {
    let session = s.store.get_session(&caller.user.id, session_id).await?;
    let opts = body.options(&session)?;
    check_max_tokens(s, opts.max_tokens)?;
    let reservation = s.generator.streams.reserve(session_id)?;
    let history = s.store.list_messages(&caller.user.id, session_id).await?;
    let cap = s.options.max_messages_per_session;
    if history.len() + 2 > cap {
        return Err(ApiError::Unprocessable {
            kind: "session_full",
            message: format!(
                "this session holds {} messages, and a session may hold at most {cap}; \
                 continue in a new session",
                history.len()
            ),
        });
    }
    // Charged last, so a request refused above costs the caller nothing.
    let reserve = opts.max_tokens.unwrap_or(s.options.default_max_tokens);
    let budget = s
        .generator
        .limiter
        .admit(&caller.quota, u64::from(reserve))
        .await?;
    Ok(OpenTurn {
        session,
        history,
        run: TurnRun {
            session_id: session_id.to_string(),
            opts,
            place: Place {
                reservation,
                budget,
            },
            stream: body.stream.unwrap_or(true),
            arrived,
        },
    })
}

/// The part of a turn after the request is checked: fit the prompt, take a worker, store the
/// turn with `store_turn` (which returns the user and assistant message ids), start generating,
/// and answer. Nothing is stored unless a worker was available.
async fn launch<F, Fut>(
    s: &AppState,
    caller: &Caller,
    run: TurnRun,
    convo: &[ChatMessage],
    store_turn: F,
) -> Result<Response, ApiError>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Result<(Option<String>, String), ApiError>>,
{
    let TurnRun {
        session_id,
        opts,
        place,
        stream,
        arrived,
    } = run;
    let (prompt, max_new_tokens) = plan(s, convo, opts.max_tokens).await?;
    let lease = s
        .generator
        .pool
        .admit(&caller.user.id, Some(&session_id), &[])
        .await?;
    let (user_message_id, message_id) = store_turn().await?;
    let live = Live::new(TurnIds {
        session_id: session_id.clone(),
        user_message_id,
        message_id: message_id.clone(),
    });
    place.reservation.fill(&live);
    let job = Job {
        user_id: caller.user.id.clone(),
        persistence: Persistence::Stored {
            session_id,
            message_id,
        },
        prompt,
        params: opts.params,
        max_new_tokens,
        stop: opts.stop,
        ignore_eos: opts.ignore_eos,
        arrived,
        budget: place.budget,
        lease: Some(lease),
    };
    let g = s.generator.clone();
    let running = live.clone();
    tokio::spawn(async move {
        g.clone().run(job, running.clone()).await;
        g.streams.expire_later(running);
    });
    respond(s, live, stream, 0).await
}

/// Cancels the generation when the client goes away, if the server is configured so.
struct DisconnectGuard {
    live: Arc<Live>,
    cancel: bool,
}

impl Drop for DisconnectGuard {
    fn drop(&mut self) {
        if self.cancel && !self.live.is_finished() {
            self.live.stop();
        }
    }
}

async fn respond(
    s: &AppState,
    live: Arc<Live>,
    stream: bool,
    from: usize,
) -> Result<Response, ApiError> {
    if !stream {
        let guard = DisconnectGuard {
            live: live.clone(),
            cancel: s.options.cancel_on_disconnect,
        };
        let outcome = live
            .outcome()
            .await
            .ok_or_else(|| ApiError::Internal("the generation ended without an outcome".into()))?;
        drop(guard);
        return Ok(Json(TurnReply::new(&live.ids, &outcome)).into_response());
    }
    Ok(sse(native_events(
        live,
        from,
        s.options.cancel_on_disconnect,
    )))
}

/// Wraps an event stream as an SSE response with keep-alives and no proxy buffering.
pub fn sse<S>(events: S) -> Response
where
    S: tokio_stream::Stream<Item = Result<Event, Infallible>> + Send + 'static,
{
    let mut r = Sse::new(events)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response();
    let h = r.headers_mut();
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

fn native_events(
    live: Arc<Live>,
    from: usize,
    cancel_on_disconnect: bool,
) -> impl tokio_stream::Stream<Item = Result<Event, Infallible>> + Send + 'static {
    let guard = DisconnectGuard {
        live: live.clone(),
        cancel: cancel_on_disconnect,
    };
    let ids = live.ids.clone();
    live.subscribe(from).map(move |(n, e)| {
        let _keep = &guard;
        let event = Event::default().id(format!("{}:{}", ids.message_id, n + 1));
        Ok(match e {
            RunEvent::Begin => event.event("message_start").data(event_data(&ids)),
            RunEvent::Text(text) => event.event("token").data(event_data(&TokenText { text })),
            RunEvent::End(o) => match o.end.error() {
                Some(e) => event.event("error").data(event_data(&ReplyFailed {
                    error_type: e.kind().to_string(),
                    message: e.to_string(),
                    message_id: ids.message_id.clone(),
                    content: o.content.clone(),
                })),
                None => event
                    .event("message_end")
                    .data(event_data(&ReplyEnd::new(&ids, &o))),
            },
        })
    })
}

/// A reply's token counts.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReplyUsage {
    pub prompt_tokens: u64,
    /// Prompt tokens the worker already held in its cache.
    pub cached_tokens: u64,
    pub completion_tokens: u64,
}

/// A reply's timings, in milliseconds from the request's arrival.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReplyTimings {
    /// Until the first token (`null` when none came).
    #[schema(required = true)]
    pub ttft_ms: Option<u64>,
    pub duration_ms: u64,
}

/// How a reply ended: the SSE `message_end` event's data.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReplyEnd {
    pub message_id: String,
    pub status: MessageStatus,
    /// `stop` (end of turn or a stop string), `length`, `context_full`, `cancelled` (stopped),
    /// or an error's kind.
    pub finish_reason: String,
    pub usage: ReplyUsage,
    pub timings: ReplyTimings,
    /// The worker that finished the reply.
    #[schema(required = true)]
    pub worker: Option<String>,
}

impl ReplyEnd {
    fn new(ids: &TurnIds, o: &Outcome) -> Self {
        Self {
            message_id: ids.message_id.clone(),
            status: o.end.status(),
            finish_reason: o.end.finish_reason().to_string(),
            usage: ReplyUsage {
                prompt_tokens: o.prompt_tokens,
                cached_tokens: o.cached_tokens,
                completion_tokens: o.completion_tokens,
            },
            timings: ReplyTimings {
                ttft_ms: o.ttft_ms,
                duration_ms: o.duration_ms,
            },
            worker: o.worker.clone(),
        }
    }
}

/// A reply that ended in an error: the SSE `error` event's data. What it said before the error
/// is kept.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReplyFailed {
    pub error_type: String,
    pub message: String,
    pub message_id: String,
    pub content: String,
}

/// The SSE `token` event's data.
#[derive(Debug, Serialize, ToSchema)]
pub struct TokenText {
    pub text: String,
}

/// Why a finished reply failed.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReplyError {
    pub error_type: String,
    pub message: String,
}

/// A finished reply, as a turn with `"stream": false` answers.
#[derive(Debug, Serialize, ToSchema)]
pub struct TurnReply {
    #[serde(flatten)]
    pub end: ReplyEnd,
    pub session_id: String,
    /// The user message the reply answers.
    #[schema(required = true)]
    pub user_message_id: Option<String>,
    pub content: String,
    /// Present when the reply ended in an error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ReplyError>,
}

impl TurnReply {
    fn new(ids: &TurnIds, o: &Outcome) -> Self {
        Self {
            end: ReplyEnd::new(ids, o),
            session_id: ids.session_id.clone(),
            user_message_id: ids.user_message_id.clone(),
            content: o.content.clone(),
            error: o.end.error().map(|e| ReplyError {
                error_type: e.kind().to_string(),
                message: e.to_string(),
            }),
        }
    }
}

fn event_data<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

/// `GET /v1/sessions/{id}/stream`: the session's running (or just finished) reply, from the
/// event after `Last-Event-ID` (or from its start).
#[utoipa::path(get, path = "/v1/sessions/{id}/stream", operation_id = "resumeStream", tag = "generation", params(super::SessionPath,
        ("Last-Event-ID" = Option<String>, Header, description = "The last event received (`<message id>:<n>`); the stream continues after it")),
    responses(
        (status = 200, description = "The reply's events (`message_start`, `token`, `message_end` or `error`)", content_type = "text/event-stream", body = super::openapi::ReplyEvent),
        (status = 404, description = "No such session, or no reply running or just finished", body = super::ErrorBody),
    ))]
pub async fn resume(
    State(s): State<AppState>,
    caller: Caller,
    id: SessionId,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    s.store.get_session(&caller.user.id, &id).await?;
    let live = s
        .generator
        .streams
        .get(&id)
        .ok_or(ApiError::NotFound("stream"))?;
    let from = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.rsplit_once(':'))
        .filter(|(msg, _)| *msg == live.ids.message_id)
        .and_then(|(_, n)| n.parse::<usize>().ok())
        .unwrap_or(0);
    Ok(sse(native_events(live, from, false)))
}

/// What a stop did.
#[derive(Debug, Serialize, ToSchema)]
pub struct StopResult {
    /// Whether a running reply was stopped (and stored as `stopped`).
    pub stopped: bool,
    /// The reply as stored once it ended, when there was one running.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<Message>,
}

impl StopResult {
    const NOTHING: Self = Self {
        stopped: false,
        message: None,
    };
}

/// `POST /v1/sessions/{id}/stop`: cancels the running reply (on the worker within one engine
/// step) and answers once it is stored as `stopped`, with the stored message. A reply running
/// on another replica is stopped through Redis.
#[utoipa::path(post, path = "/v1/sessions/{id}/stop", operation_id = "stopReply", tag = "generation", params(super::SessionPath),
    responses(
        (status = 200, description = "The stopped reply, or `stopped: false` when none was running", body = StopResult),
        (status = 404, description = "No such session", body = super::ErrorBody),
    ))]
pub async fn stop(
    State(s): State<AppState>,
    caller: Caller,
    id: SessionId,
) -> Result<Json<StopResult>, ApiError> {
    s.store.get_session(&caller.user.id, &id).await?;
    s.generator.limiter.admit_stop(&caller.quota).await?;
    let streaming = |m: &Message| m.role == Role::Assistant && m.status == MessageStatus::Streaming;
    let reply_id = if let Some(live) = s.generator.streams.get(&id).filter(|l| !l.is_finished()) {
        live.stop();
        // The outcome is stored before it is announced, so one read finds the final message.
        let _ = tokio::time::timeout(Duration::from_secs(10), live.outcome()).await;
        live.ids.message_id.clone()
    } else {
        let last = s.store.last_message(&caller.user.id, &id).await?;
        let (Some(bus), Some(reply)) = (&s.generator.stop_bus, last.filter(streaming)) else {
            return Ok(Json(StopResult::NOTHING));
        };
        if !bus.publish(&id).await {
            return Err(ApiError::Unavailable(
                "the reply runs on another replica and Redis cannot be reached to stop it".into(),
            ));
        }
        reply.id
    };
    // The replica running it stores the stopped reply; wait for that, reading only that message
    // and less often as the wait grows.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut pause = Duration::from_millis(20);
    loop {
        let m = s.store.get_message(&caller.user.id, &id, &reply_id).await?;
        if !streaming(&m) {
            return Ok(Json(StopResult {
                stopped: m.status == MessageStatus::Stopped,
                message: Some(m),
            }));
        }
        if Instant::now() + pause >= deadline {
            break;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(500));
    }
    Ok(Json(StopResult::NOTHING))
}
