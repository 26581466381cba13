//! `GET /v1/sessions/{id}/ws`: a session over one WebSocket. The client sends commands as JSON
//! text messages and receives the reply's events as the SSE stream has them, in JSON, with
//! their ids:
//!
//! - `{"type": "message", "content": …, …}`: a new turn (the fields of `POST …/messages`, or
//!   its `tool_results`);
//! - `{"type": "regenerate", …}` and `{"type": "edit", "message_id": …, "content": …, …}`;
//! - `{"type": "stop"}`: answered by `{"event": "stopped", "data": <the stop result>}`;
//! - `{"type": "resume", "last_event_id": "<message id>:<n>"}`: the running (or just finished)
//!   reply's events after that one (all of them without it).
//!
//! Each event of a reply is `{"id": "<message id>:<n>", "event": "message_start" | "token" |
//! "logprobs" | "message_end" | "error", "data": {…}}`. A command that is refused gets
//! `{"event": "refused", "status": <HTTP status>, "error": {"message", "type", "code", "param"}}`, the
//! answer its HTTP route would give, and the socket stays open.
//!
//! Authentication is the API's: the key as a bearer header, or (browsers cannot set headers on
//! a WebSocket) as a subprotocol `hearth.key.<key>` beside `hearth.v1`, which the server
//! selects. The `Host` and `Origin` checks of the rest of the API apply, and the key is checked
//! again with every command: a revoked key's socket is closed (1008). Messages are at most
//! [`MAX_MESSAGE_BYTES`]; the server pings every [`PING_EVERY`] (more often when the idle time
//! is shorter), and closes a socket whose client has sent nothing (not even a pong) for
//! `--socket-idle-secs` (60), not counting the time the server spent on the client's last
//! command. A message the client does not read within
//! `--socket-write-timeout-secs` closes the socket (1008) and frees its place. At most
//! [`MAX_SOCKETS`] are open at once, and `--max-sockets-per-key` for one key.

mod command;

use command::Command;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::Response;
use serde_json::{json, Value};
use tokio::time::Instant;
use tokio_stream::{Stream, StreamExt};

use super::native::{resume_from, NativeEvent, StopResult};
use super::{api_key, caller_with, ApiError, AppState};
use crate::generate::{Live, TurnIds};
use crate::ids::SessionId;
use crate::limits::Limited;
use crate::service::{Caller, NativeTurn, ReplySource};

/// Largest message a client may send (a turn's body, as over HTTP).
pub const MAX_MESSAGE_BYTES: usize = super::MAX_BODY_BYTES;
/// How often the server pings, at most: a third of the idle time when that is shorter.
pub const PING_EVERY: Duration = Duration::from_secs(20);
/// Most WebSockets open at once (an upgraded socket leaves the HTTP connection cap).
pub const MAX_SOCKETS: usize = 1024;

/// The open WebSockets: a place each, at most [`MAX_SOCKETS`] in all, and a count per key.
#[derive(Debug)]
pub struct Sockets {
    all: Arc<tokio::sync::Semaphore>,
    per_key: Mutex<HashMap<String, usize>>,
}

impl Default for Sockets {
    fn default() -> Self {
        Self {
            all: Arc::new(tokio::sync::Semaphore::new(MAX_SOCKETS)),
            per_key: Mutex::default(),
        }
    }
}

impl Sockets {
    /// A place for one more socket of the key `bucket`, which may hold `cap`; 429 when it holds
    /// them all, 503 when the server does.
    fn take(self: &Arc<Self>, bucket: &str, cap: usize) -> Result<SocketPlace, ApiError> {
        let mut open = self.per_key.lock().unwrap_or_else(|p| p.into_inner());
        let held = open.get(bucket).copied().unwrap_or(0);
        if held >= cap {
            return Err(ApiError::RateLimited(Limited {
                what: format!(
                    "this key has {held} WebSockets open, the most one key may \
                     (--max-sockets-per-key); close one first"
                ),
                retry_after_secs: 1,
            }));
        }
        let Ok(all) = self.all.clone().try_acquire_owned() else {
            return Err(ApiError::Unavailable(
                "too many WebSockets are open; try again shortly".into(),
            ));
        };
        open.insert(bucket.to_string(), held + 1);
        Ok(SocketPlace {
            sockets: self.clone(),
            bucket: bucket.to_string(),
            _all: all,
        })
    }
}

/// One open socket's place, given back when it drops.
struct SocketPlace {
    sockets: Arc<Sockets>,
    bucket: String,
    _all: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for SocketPlace {
    fn drop(&mut self) {
        let mut open = self
            .sockets
            .per_key
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&self.bucket) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.bucket);
            }
        }
    }
}

/// The subprotocol the server speaks.
const PROTOCOL: &str = "hearth.v1";
/// The prefix of the subprotocol that carries the key.
const KEY_PROTOCOL: &str = "hearth.key.";

/// Opens a session's WebSocket (see the module's documentation for what flows over it).
#[utoipa::path(get, path = "/v1/sessions/{id}/ws", operation_id = "sessionSocket", tag = "generation", params(super::SessionPath),
    responses(
        (status = 101, description = "Switched to the WebSocket (subprotocol `hearth.v1`)"),
        (status = 400, description = "Not a WebSocket upgrade", body = super::ErrorBody),
        (status = 401, description = "Missing or invalid API key", body = super::ErrorBody),
        (status = 404, description = "No such session", body = super::ErrorBody),
        (status = 429, description = "The key holds the most WebSockets one key may (`--max-sockets-per-key`), or its rate limit is reached (see `Retry-After`)", body = super::ErrorBody),
        (status = 503, description = "Too many WebSockets are open", body = super::ErrorBody),
    ))]
pub async fn socket(
    State(s): State<AppState>,
    id: SessionId,
    headers: HeaderMap,
    upgrade: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    let key = socket_key(&headers).map(str::to_string);
    let caller = caller_with(&s, key.as_deref()).await?;
    s.chat.session(&caller.user, &id).await?;
    let upgrade = upgrade.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    let place = s
        .sockets
        .take(&caller.quota.bucket, s.options.max_sockets_per_key)?;
    Ok(upgrade
        .protocols([PROTOCOL])
        .max_message_size(MAX_MESSAGE_BYTES)
        .max_frame_size(MAX_MESSAGE_BYTES)
        .on_upgrade(move |ws| async move {
            Session::new(s, caller, key, id).run(ws).await;
            drop(place);
        }))
}

/// The key: the API's own rules, with the key taken from a `hearth.key.<key>` subprotocol when
/// there is none in the headers.
fn socket_key(headers: &HeaderMap) -> Option<&str> {
    api_key(headers).or_else(|| {
        headers
            .get_all(header::SEC_WEBSOCKET_PROTOCOL)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .find_map(|p| p.trim().strip_prefix(KEY_PROTOCOL))
    })
}

/// A reply's events as the socket sends them, from this replica's log or from Redis.
type Events = Pin<Box<dyn Stream<Item = NativeEvent> + Send>>;

/// The reply a socket forwards: its events, and its live log when this replica runs it (a
/// socket that closes stops it there with `--cancel-on-disconnect`).
struct Following {
    live: Option<Arc<Live>>,
    events: Events,
}

/// One open socket: its session, the key it was opened with (checked again with each
/// command), and the reply whose events it forwards.
struct Session {
    s: AppState,
    caller: Caller,
    key: Option<String>,
    id: SessionId,
    following: Option<Following>,
}

/// What the socket's loop does next: send these messages, or close.
enum Step {
    Send(Vec<Message>),
    Close(Option<CloseFrame>),
}

fn close(code: u16, reason: &str) -> CloseFrame {
    CloseFrame {
        code,
        reason: reason.into(),
    }
}

fn text(v: Value) -> Message {
    Message::Text(v.to_string().into())
}

/// A refused command's answer: what its HTTP route would have said.
fn refused(e: &ApiError) -> Message {
    text(json!({
        "event": "refused",
        "status": e.status().as_u16(),
        "error": e.body().error,
    }))
}

/// The next event of the reply being followed; never, when none is.
async fn next_event(following: &mut Option<Following>) -> Option<NativeEvent> {
    match following {
        Some(f) => f.events.next().await,
        None => std::future::pending().await,
    }
}

impl Session {
    fn new(s: AppState, caller: Caller, key: Option<String>, id: SessionId) -> Self {
        Self {
            s,
            caller,
            key,
            id,
            following: None,
        }
    }

    async fn run(mut self, mut ws: WebSocket) {
        let idle_after = self.s.options.socket_idle;
        let every = PING_EVERY.min(idle_after / 3);
        let mut ping = tokio::time::interval_at(Instant::now() + every, every);
        let mut heard = Instant::now();
        let write_timeout = self.s.options.socket_write_timeout;
        'socket: loop {
            let step = tokio::select! {
                m = ws.recv() => match m {
                    Some(Ok(m)) => {
                        let step = self.received(m).await;
                        // The client is idle from here: the time the command took (a turn
                        // waiting for its model's load) was the server's, not the client's.
                        heard = Instant::now();
                        step
                    }
                    Some(Err(_)) | None => break 'socket,
                },
                e = next_event(&mut self.following) => self.forward(e),
                _ = ping.tick() => match heard.elapsed() >= idle_after {
                    true => Step::Close(Some(close(1001, "idle"))),
                    false => Step::Send(vec![Message::Ping(Vec::new().into())]),
                },
            };
            let (messages, frame) = match step {
                Step::Send(messages) => (messages, None),
                Step::Close(frame) => (Vec::new(), Some(frame)),
            };
            for m in messages {
                match tokio::time::timeout(write_timeout, ws.send(m)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => break 'socket,
                    Err(_) => {
                        // A client that stopped reading: its place goes to another.
                        tracing::info!(session = %self.id, "a WebSocket client stopped reading; closing it");
                        let slow = close(1008, "too slow to read");
                        let _ = tokio::time::timeout(
                            Duration::from_secs(1),
                            ws.send(Message::Close(Some(slow))),
                        )
                        .await;
                        break 'socket;
                    }
                }
            }
            if let Some(frame) = frame {
                let close = ws.send(Message::Close(frame));
                let _ = tokio::time::timeout(write_timeout, close).await;
                break 'socket;
            }
        }
        if let Some(live) = self.following.as_ref().and_then(|f| f.live.as_ref()) {
            if self.s.options.cancel_on_disconnect && !live.is_finished() {
                live.stop();
            }
        }
    }

    /// A reply's event as the socket sends it; the reply is no longer followed after its end.
    fn forward(&mut self, e: Option<NativeEvent>) -> Step {
        let Some(e) = e else {
            self.following = None;
            return Step::Send(Vec::new());
        };
        let last = e.is_last();
        // The event's data is JSON already: written in place, not parsed again.
        let m = Message::Text(
            format!(
                r#"{{"id":{},"event":{},"data":{}}}"#,
                Value::String(e.id),
                Value::String(e.name.into_owned()),
                e.data
            )
            .into(),
        );
        if last {
            self.following = None;
        }
        Step::Send(vec![m])
    }

    async fn received(&mut self, m: Message) -> Step {
        if let Message::Text(_) | Message::Binary(_) = m {
            // The key may have been revoked (or have expired) since the socket opened.
            match caller_with(&self.s, self.key.as_deref()).await {
                Ok(c) => self.caller = c,
                Err(e @ ApiError::Unauthorized) => {
                    return Step::Close(Some(close(1008, &e.to_string())));
                }
                Err(e) => return Step::Send(vec![refused(&e)]),
            }
        }
        match m {
            Message::Text(t) => match self.command(t.as_str()).await {
                Ok(out) => Step::Send(out),
                Err(e) => Step::Send(vec![refused(&e)]),
            },
            Message::Binary(_) => Step::Send(vec![refused(&ApiError::BadRequest(
                "commands are JSON text messages".into(),
            ))]),
            Message::Close(_) => Step::Close(None),
            Message::Ping(_) | Message::Pong(_) => Step::Send(Vec::new()),
        }
    }

    /// Runs one command; what to send back (a reply's events follow as they come).
    async fn command(&mut self, message: &str) -> Result<Vec<Message>, ApiError> {
        match Command::parse(message)? {
            Command::Message(body) => self.start(body.turn(body.posted()?)?).await,
            Command::Regenerate(body) => self.start(body.regenerated()?).await,
            Command::Edit { message_id, turn } => self.start(turn.edited(message_id)?).await,
            Command::Stop => {
                let r = StopResult::of(self.s.chat.stop(&self.caller, &self.id).await?);
                Ok(vec![text(json!({"event": "stopped", "data": r}))])
            }
            Command::Resume { last_event_id } => self.resume(last_event_id.as_deref()).await,
        }
    }

    /// Follows the running (or just finished) reply from after `last` (all of it without).
    async fn resume(&mut self, last: Option<&str>) -> Result<Vec<Message>, ApiError> {
        let live = match self.s.chat.reply_stream(&self.caller, &self.id).await? {
            ReplySource::Local(live) => live,
            ReplySource::Shared(reply) => {
                let from = resume_from(&reply.message_id, last);
                let events = self
                    .s
                    .chat
                    .shared_events(&self.caller, &self.id, reply, from)
                    .await?;
                let events = events.ok_or(ApiError::NotFound("stream"))?;
                self.following = Some(Following {
                    live: None,
                    events: Box::pin(events),
                });
                return Ok(Vec::new());
            }
        };
        let ids = live.ids.clone().ok_or_else(|| {
            ApiError::Internal("a session's reply without its stored turn".into())
        })?;
        let from = resume_from(&ids.message_id, last);
        self.follow(live, ids, from);
        Ok(Vec::new())
    }

    async fn start(
        &mut self,
        turn: crate::service::ValidTurn<NativeTurn>,
    ) -> Result<Vec<Message>, ApiError> {
        let live = self.s.chat.start_turn(&self.caller, &self.id, turn).await?;
        let ids = live
            .ids
            .clone()
            .ok_or_else(|| ApiError::Internal("a native reply without its stored turn".into()))?;
        self.follow(live, ids, 0);
        Ok(Vec::new())
    }

    fn follow(&mut self, live: Arc<Live>, ids: TurnIds, from: usize) {
        let events = live
            .subscribe(from)
            .map(move |(n, e)| NativeEvent::new(&ids, n, e));
        self.following = Some(Following {
            live: Some(live),
            events: Box::pin(events),
        });
    }
}
