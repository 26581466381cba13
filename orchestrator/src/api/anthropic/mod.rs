//! Anthropic's Messages API, for the clients that speak it (the `anthropic` SDKs, Claude
//! Code): `POST /v1/messages`, answered whole or streamed, with tools (`tool_use` and
//! `tool_result` blocks) and stop sequences, and `POST /v1/messages/count_tokens`. Stateless,
//! as chat completions are: nothing is stored, and a client that goes away cancels its
//! generation.
//!
//! - `wire`: the request (checked into a conversation and Hearth's tools) and the answer;
//! - `stream`: the streamed events.
//!
//! A key comes as `x-api-key` (Anthropic's header) or as a bearer token, as on every route.
//! Errors, including those of the layers before the handler (a missing key, a body too large),
//! have Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`, a bad value
//! answered 400 `invalid_request_error` as Anthropic answers it (422 elsewhere).

mod stream;
pub(super) mod wire;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};

use super::loading::{after_load, Api};
use super::native::sse;
use super::openai::stream::StopOnDrop;
use super::{ApiError, AppState, ValidJson};
use crate::service::{Caller, ToTokenize};
use wire::{blocks, stop_reason, Message, MessageUsage, MessagesRequest, TokenCount};

/// The path every route of this API starts with.
const PREFIX: &str = "/v1/messages";

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route(PREFIX, post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
}

/// What every event of one message repeats.
struct Head {
    id: String,
    model: String,
}

/// Anthropic's Messages API: a reply to `messages`, whole or streamed (`stream`: Server-Sent
/// Events from `message_start` to `message_stop`). Stateless: nothing is stored, and a client
/// that goes away cancels its generation.
#[utoipa::path(post, path = "/v1/messages", operation_id = "createMessage", tag = "anthropic", request_body = MessagesRequest,
    responses(
        (status = 200, description = "The message (or, with `stream`, its events)", content(
            (Message = "application/json"),
            (String = "text/event-stream"),
        )),
        (status = 400, description = "A field is missing, out of range or asks for what Hearth cannot do (`invalid_request_error`)", body = AnthropicError),
        (status = 401, description = "A missing or unknown key (`authentication_error`)", body = AnthropicError),
        (status = 404, description = "`model` names a model this server does not serve (`not_found_error`)", body = AnthropicError),
    ))]
pub async fn messages(
    State(s): State<AppState>,
    caller: Caller,
    ValidJson(req): ValidJson<MessagesRequest>,
) -> Result<Response, ApiError> {
    let tools = req.tools()?;
    if s.chat.needs_load(Some(req.model.as_str())).is_some() {
        // What can be refused before the load is, with its status.
        req.turn(tools.as_ref(), &Default::default())?;
        if req.stream {
            let model = req.model.clone();
            let events = async move {
                let (head, guard) = start(&s, &caller, &req, tools.as_ref()).await?;
                Ok(stream::events(head, guard, tools.map(Arc::new)))
            };
            return Ok(after_load(Api::Anthropic, model, events));
        }
    }
    let (head, guard) = start(&s, &caller, &req, tools.as_ref()).await?;
    if req.stream {
        return Ok(sse(stream::events(head, guard, tools.map(Arc::new))));
    }
    let outcome = guard.outcome().await?;
    Ok(Json(Message {
        id: head.id,
        kind: "message",
        role: "assistant",
        model: head.model,
        stop_reason: Some(stop_reason(&outcome)?),
        content: blocks(&outcome),
        stop_sequence: outcome.stop_sequence.clone(),
        usage: MessageUsage::of(&outcome),
    })
    .into_response())
}

/// Starts the message's generation on its model (loaded first if it must be). Dropping the
/// guard (the client went away) stops it.
async fn start(
    s: &AppState,
    caller: &Caller,
    req: &MessagesRequest,
    tools: Option<&crate::tools::Tools>,
) -> Result<(Head, StopOnDrop), ApiError> {
    let target = s.chat.target(caller, Some(req.model.as_str())).await?;
    let turn = req.turn(tools, &target.defaults())?;
    let guard = StopOnDrop::start(&s.chat, caller, turn, &target).await?;
    let head = Head {
        id: format!("msg_{}", uuid::Uuid::new_v4().simple()),
        model: target.name(),
    };
    Ok((head, guard))
}

/// How many tokens the message's prompt holds (its system prompt, tools and messages, rendered
/// as `POST /v1/messages` renders them), without generating.
#[utoipa::path(post, path = "/v1/messages/count_tokens", operation_id = "countMessageTokens", tag = "anthropic", request_body = MessagesRequest,
    responses(
        (status = 200, description = "The prompt's size", body = TokenCount),
        (status = 400, description = "A field is missing or out of range (`invalid_request_error`)", body = AnthropicError),
        (status = 404, description = "`model` names a model this server does not serve (`not_found_error`)", body = AnthropicError),
    ))]
pub async fn count_tokens(
    State(s): State<AppState>,
    caller: Caller,
    ValidJson(req): ValidJson<MessagesRequest>,
) -> Result<Json<TokenCount>, ApiError> {
    let tools = req.tools()?;
    let convo = req.conversation(tools.as_ref())?;
    let counted = s
        .chat
        .tokenize(
            &caller,
            Some(req.model.as_str()),
            ToTokenize::Chat(convo),
            false,
        )
        .await?;
    Ok(Json(TokenCount {
        input_tokens: counted.tokens.len(),
    }))
}

/// Anthropic's error body.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct AnthropicError {
    /// `error`
    #[serde(rename = "type")]
    pub kind: String,
    /// `type` (`invalid_request_error`, `authentication_error`, `not_found_error`, …) and
    /// `message`.
    #[schema(value_type = Object)]
    pub error: Value,
}

/// Anthropic's error type for an answer's `status`.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        408 | 504 => "timeout_error",
        503 | 529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

/// Anthropic's error body for an error answered `status`, saying `message`.
pub(super) fn error_body(status: StatusCode, message: &str) -> Value {
    json!({"type": "error", "error": {"type": error_type(status), "message": message}})
}

/// Gives every error answered on this API's routes Anthropic's shape, whichever layer made it
/// (the key check and the body guard answer before any handler runs); a bad value (422 on the
/// other APIs) is a 400, as Anthropic answers it. The message, which names the field at fault,
/// is kept.
pub(super) async fn errors_in_its_shape(req: Request, next: axum::middleware::Next) -> Response {
    if !req.uri().path().starts_with(PREFIX) {
        return next.run(req).await;
    }
    let response = next.run(req).await;
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, super::MAX_BODY_BYTES)
        .await
        .unwrap_or_default();
    let message = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).trim().to_string());
    let status = match status {
        StatusCode::UNPROCESSABLE_ENTITY => StatusCode::BAD_REQUEST,
        s => s,
    };
    parts.status = status;
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let body = error_body(status, &message).to_string();
    Response::from_parts(parts, axum::body::Body::from(body))
}
