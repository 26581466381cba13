//! Generation on the native API: post a message, regenerate the last reply, edit an earlier
//! message and answer it again, stop, and resume a stream. Replies stream as Server-Sent Events (`message_start`, `token`, `message_end`,
//! `error`), each with an id `<message id>:<n>` that `GET /v1/sessions/{id}/stream` accepts
//! as `Last-Event-ID`; with `"stream": false` the answer is the finished message as JSON.
//!
//! The user message and an assistant placeholder are stored before generation starts; the
//! reply is saved as it streams and finalized when it ends, whether or not anyone is still
//! listening (unless the server runs with `--cancel-on-disconnect`).

use crate::invalid::Invalid;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use hearth_shared::{Grammar, SamplingParams};
use serde::{Deserialize, Serialize};
use tokio_stream::StreamExt;
use utoipa::ToSchema;

use super::{ApiError, AppState, ValidJson};
pub use crate::generate::wire::{LogprobsEvent, NativeEvent, ReplyEnd, ReplyFailed, TokenText};
use crate::generate::{Live, Outcome, TurnIds};
use crate::ids::{MessageId, SessionId};
use crate::service::{
    Caller, GenOptions, NativeTurn, ReplySource, StopOutcome, ToolResult, UserText, ValidTurn,
    MAX_TOOL_RESULTS,
};
use crate::storage::{Message, MessageStatus};
use crate::tools::{turn_grammar, Tool, ToolChoice, Tools};

/// Options shared by every generation request.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TurnBody {
    /// The new user message, or an edited one's new text: required there (unless the turn
    /// posts `tool_results`), up to 256 KiB, not blank. Refused on regenerate.
    #[serde(default)]
    #[schema(min_length = 1)]
    pub content: Option<String>,
    /// Instead of `content`, on a new message: the results of the last reply's tool calls, one
    /// for each call. They are stored as `tool` messages, and the model answers them.
    #[serde(default)]
    pub tool_results: Option<Vec<ToolResultBody>>,
    /// Functions the model may call (as OpenAI's `tools`). Their description heads the system
    /// prompt; a reply that is nothing but calls of them ends with `finish_reason` `tool_calls`
    /// and the calls in `tool_calls`. Send them with each turn that may use them.
    #[serde(default)]
    pub tools: Option<Vec<Tool>>,
    /// `auto` (the default with tools), `none`, `required`, or a named function: the last two
    /// constrain the reply to a call.
    #[serde(default)]
    pub tool_choice: Option<ToolChoice>,
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
    /// Stream each token's log-probability as `logprobs` events (Server-Sent Events only).
    #[serde(default)]
    pub logprobs: bool,
    /// With `logprobs`: this many likeliest alternatives per token (0 to 20).
    #[serde(default)]
    #[schema(minimum = 0, maximum = 20)]
    pub top_logprobs: Option<u32>,
    /// The grammar the reply follows as it is sampled: any JSON object, JSON that validates
    /// against a JSON Schema, a Lark grammar or a regular expression. An invalid one is a 400.
    #[serde(default)]
    pub grammar: Option<Grammar>,
    /// How long this session's model stays loaded once idle, from this turn on, in seconds
    /// (Ollama's `keep_alive`): 0 unloads it when the reply is done, a negative value keeps it
    /// loaded for good; the model's own default when absent. At most a week.
    #[serde(default)]
    pub keep_alive: Option<f64>,
}

/// A tool's result, posted on a native turn.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolResultBody {
    /// The call it answers: an id from the last reply's `tool_calls`.
    pub tool_call_id: String,
    /// What the function returned, as text (JSON, say); up to 256 KiB.
    pub content: String,
}

impl TurnBody {
    /// The body's options, checked.
    fn options(&self) -> Result<GenOptions, ApiError> {
        let tools = Tools::new(self.tools.as_deref(), self.tool_choice.as_ref())?;
        let (field, grammar) = turn_grammar(tools.as_ref(), "grammar", self.grammar.clone())?;
        Ok(GenOptions::new(
            self.params.clone(),
            "params.",
            self.max_tokens,
            self.stop.clone().unwrap_or_default(),
            self.ignore_eos,
        )?
        .with_logprobs(self.logprobs, self.top_logprobs)?
        .with_grammar(field, grammar)?
        .with_keep_alive(self.keep_alive)?
        .with_tools(tools))
    }

    /// What a new message posts: its text, or the results of the last reply's calls.
    pub(super) fn posted(&self) -> Result<NativeTurn, ApiError> {
        match (self.content.as_deref(), self.tool_results.as_deref()) {
            (Some(_), Some(_)) => Err(ApiError::Validation(Invalid::field(
                "content",
                "not accepted with `tool_results`; post one or the other",
            ))),
            (None, None) => Err(ApiError::Validation(Invalid::field("content", "required"))),
            (Some(c), None) => Ok(NativeTurn::Post(UserText::new("content", c)?)),
            (None, Some([])) => Err(ApiError::Validation(Invalid::field(
                "tool_results",
                "must not be empty",
            ))),
            (None, Some(r)) if r.len() > MAX_TOOL_RESULTS => Err(ApiError::Validation(
                Invalid::field("tool_results", format!("at most {MAX_TOOL_RESULTS}")),
            )),
            (None, Some(r)) => {
                let results = r
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        ToolResult::new(&format!("tool_results[{i}]"), &t.tool_call_id, &t.content)
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(NativeTurn::ToolResults(results))
            }
        }
    }

    /// Refuses `tool_results` where the turn cannot take them (regenerate, edit).
    fn no_results(&self, why: &str) -> Result<(), ApiError> {
        match self.tool_results {
            Some(_) => Err(ApiError::Validation(Invalid::field("tool_results", why))),
            None => Ok(()),
        }
    }

    /// The body as a regenerate, which takes neither content nor tool results.
    pub(super) fn regenerated(&self) -> Result<ValidTurn<NativeTurn>, ApiError> {
        if self.content.is_some() {
            return Err(ApiError::Validation(Invalid::field(
                "content",
                "not accepted here; regenerate answers the last user message again",
            )));
        }
        self.no_results("not accepted here; post them as a new message")?;
        self.turn(NativeTurn::Regenerate)
    }

    /// The body as an edit of `message_id`: its `content` is the message's new text.
    pub(super) fn edited(&self, message_id: MessageId) -> Result<ValidTurn<NativeTurn>, ApiError> {
        let content = self.content.as_deref().ok_or_else(|| {
            ApiError::Validation(Invalid::field(
                "content",
                "required (the message's new text)",
            ))
        })?;
        self.no_results("not accepted on an edit")?;
        self.turn(NativeTurn::Edit {
            message_id,
            content: UserText::new("content", content)?,
        })
    }

    /// The body as a validated turn answering `input`.
    pub(super) fn turn(&self, input: NativeTurn) -> Result<ValidTurn<NativeTurn>, ApiError> {
        Ok(ValidTurn::new(
            input,
            self.options()?,
            self.stream.unwrap_or(true),
        ))
    }
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
        (status = 404, description = "No such session, or no worker serves the session's model (`model_not_found`)", body = super::ErrorBody),
        (status = 409, description = "The session already has a reply running", body = super::ErrorBody),
        (status = 422, description = "A field is out of range, or the session is full", body = super::ErrorBody),
    ))]
pub async fn post_message(
    State(s): State<AppState>,
    caller: Caller,
    id: SessionId,
    ValidJson(body): ValidJson<TurnBody>,
) -> Result<Response, ApiError> {
    let turn = body.turn(body.posted()?)?;
    start(&s, &caller, &id, turn).await
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
    let turn = body.regenerated()?;
    start(&s, &caller, &id, turn).await
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
    let turn = body.edited(message_id)?;
    start(&s, &caller, &id, turn).await
}

/// Starts the turn and answers with its reply, streamed or finished.
async fn start(
    s: &AppState,
    caller: &Caller,
    session_id: &SessionId,
    turn: ValidTurn<NativeTurn>,
) -> Result<Response, ApiError> {
    let stream = turn.stream();
    if stream {
        if let Some(model) = s.chat.session_needs_load(caller, session_id).await {
            // The turn starts in a task of its own: a client that leaves while the model loads
            // does not cut it between storing the turn and starting its reply.
            let (st, caller, id) = (s.clone(), caller.clone(), session_id.clone());
            let started = tokio::spawn(async move {
                let live = st.chat.start_turn(&caller, &id, turn).await?;
                let ids = live.ids.clone().ok_or_else(|| {
                    ApiError::Internal("a native reply without its stored turn".into())
                })?;
                Ok::<_, ApiError>(native_events(live, ids, 0, st.options.cancel_on_disconnect))
            });
            let events = async move {
                started
                    .await
                    .map_err(|e| ApiError::Internal(format!("starting the turn failed: {e}")))?
            };
            return Ok(super::loading::after_load(
                super::loading::Api::Native,
                model,
                events,
            ));
        }
    }
    let live = s.chat.start_turn(caller, session_id, turn).await?;
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
    let ids = live
        .ids
        .clone()
        .ok_or_else(|| ApiError::Internal("a native reply without its stored turn".into()))?;
    if !stream {
        let guard = DisconnectGuard {
            live: live.clone(),
            cancel: s.options.cancel_on_disconnect,
        };
        let outcome = live
            .outcome()
            .await
            .ok_or_else(|| match live.is_disowned() {
                true => ApiError::Unavailable(format!(
                "this replica is shutting down; the reply goes on on another one: read message \
                 {} of session {} when it is done",
                ids.message_id, ids.session_id
            )),
                false => ApiError::Internal("the generation ended without an outcome".into()),
            })?;
        drop(guard);
        return Ok(Json(TurnReply::new(&ids, &outcome)).into_response());
    }
    Ok(sse(native_events(
        live,
        ids,
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
    ids: TurnIds,
    from: usize,
    cancel_on_disconnect: bool,
) -> impl tokio_stream::Stream<Item = Result<Event, Infallible>> + Send + 'static {
    let guard = DisconnectGuard {
        live: live.clone(),
        cancel: cancel_on_disconnect,
    };
    live.subscribe(from).map(move |(n, e)| {
        let _keep = &guard;
        Ok(sse_event(NativeEvent::new(&ids, n, e)))
    })
}

/// A native reply's event as Server-Sent Events carry it.
fn sse_event(e: NativeEvent) -> Event {
    Event::default().id(e.id).event(e.name).data(e.data)
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
    #[schema(value_type = String)]
    pub session_id: SessionId,
    /// The message the reply answers: the user's, or the last tool result.
    #[schema(value_type = Option<String>, required = true)]
    pub user_message_id: Option<MessageId>,
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
    let last = headers.get("last-event-id").and_then(|v| v.to_str().ok());
    let live = match s.chat.reply_stream(&caller, &id).await? {
        ReplySource::Local(live) => live,
        ReplySource::Shared(reply) => {
            let from = resume_from(&reply.message_id, last);
            let events = s.chat.shared_events(&caller, &id, reply, from).await?;
            let events = events.ok_or(ApiError::NotFound("stream"))?;
            return Ok(sse(events.map(|e| Ok(sse_event(e)))));
        }
    };
    let ids = live
        .ids
        .clone()
        .ok_or_else(|| ApiError::Internal("a session's reply without its stored turn".into()))?;
    let from = resume_from(&ids.message_id, last);
    Ok(sse(native_events(live, ids, from, false)))
}

/// Where a resumed stream of the reply `message_id` starts: after `last` (`<message id>:<n>`)
/// when it is one of its events, else from its start. No reply has [`MAX_EVENT`] events: a
/// number past it names none of them.
pub(super) fn resume_from(message_id: &MessageId, last: Option<&str>) -> usize {
    last.and_then(|v| v.rsplit_once(':'))
        .filter(|(msg, _)| *msg == message_id.as_str())
        .and_then(|(_, n)| n.parse::<usize>().ok())
        .filter(|&n| n <= MAX_EVENT)
        .unwrap_or(0)
}

/// The largest event number a resumed stream takes (a reply has about one event per token).
const MAX_EVENT: usize = u32::MAX as usize;

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
    pub(super) fn of(o: StopOutcome) -> Self {
        match o {
            StopOutcome::NothingRunning => Self {
                stopped: false,
                message: None,
            },
            StopOutcome::Ended(m) => Self {
                stopped: m.status == MessageStatus::Stopped,
                message: Some(*m),
            },
        }
    }
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
    Ok(Json(StopResult::of(s.chat.stop(&caller, &id).await?)))
}
