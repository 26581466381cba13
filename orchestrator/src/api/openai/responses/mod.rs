//! OpenAI's Responses API (the OpenAI Agents SDK's default, Codex, LangChain's
//! `use_responses_api`): `input` (a string or items, function calls and their outputs among
//! them) becomes one reply, answered as a `response` object or streamed as its events.
//!
//! A response is kept unless its request says `store: false`: as a session of its user's and
//! that session's messages (`kept`), so `previous_response_id` continues it on the worker that
//! holds its cache, and `GET`, `DELETE`, `cancel` and `input_items` reach it. With
//! `store: false` nothing is kept, as with chat completions, and a client that goes away stops
//! the reply.
//!
//! - `wire`: the request and the `response` object;
//! - `draft`: the object of one response, as its reply runs and ends;
//! - `stream`: the streamed events, each with its `sequence_number`;
//! - `kept`: kept responses.

mod draft;
pub(crate) mod kept;
mod stream;
pub(super) mod wire;

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::stream::StopOnDrop;
use crate::api::loading::{after_load, Api};
use crate::api::native::sse;
use crate::api::{ApiError, AppState, ValidJson};
use crate::service::Caller;
use crate::tools::Tools;
use draft::Draft;
use wire::{ResponseObject, ResponsesRequest};

/// A model's reply to `input`, as a `response` object or (with `stream`) its events; with
/// `background`, the response `in_progress` at once. Kept unless `store` is `false`.
#[utoipa::path(post, path = "/v1/responses", operation_id = "createResponse", tag = "openai", request_body = ResponsesRequest,
    responses(
        (status = 200, description = "The response (or, with `stream`, its events)", content(
            (ResponseObject = "application/json"),
            (String = "text/event-stream"),
        )),
        (status = 404, description = "`model` names a model this server does not serve (`model_not_found`), or `previous_response_id` no response of the caller's", body = crate::api::ErrorBody),
        (status = 409, description = "The response to continue is still in progress", body = crate::api::ErrorBody),
        (status = 422, description = "A field is out of range or asks for what Hearth cannot do", body = crate::api::ErrorBody),
    ))]
pub async fn create(
    State(s): State<AppState>,
    caller: Caller,
    ValidJson(req): ValidJson<ResponsesRequest>,
) -> Result<Response, ApiError> {
    let tools = req.tools()?.map(Arc::new);
    if req.stored() {
        return kept::create(s, caller, req, tools).await;
    }
    if let Some(model) = s.chat.needs_load(req.model.as_deref()) {
        // What can be refused before the load is, with its status.
        req.turn(tools.as_deref(), &Default::default())?;
        if req.stream {
            let events = async move {
                let (draft, guard) = start(&s, &caller, &req, tools.clone()).await?;
                Ok(stream::events(draft, guard, tools))
            };
            return Ok(after_load(Api::OpenAi, model, events));
        }
    }
    let (draft, guard) = start(&s, &caller, &req, tools.clone()).await?;
    if req.stream {
        return Ok(sse(stream::events(draft, guard, tools)));
    }
    let outcome = guard.outcome().await?;
    // A reply that failed is an HTTP error, as a chat completion's is.
    let finish = outcome
        .end
        .openai_finish_reason()
        .map_err(|e| ApiError::from(e.clone()))?;
    Ok(Json(draft.finished(&outcome, finish)).into_response())
}

/// Starts the reply's generation on its model (loaded first if it must be). Dropping the guard
/// (the client went away) stops it.
async fn start(
    s: &AppState,
    caller: &Caller,
    req: &ResponsesRequest,
    tools: Option<Arc<Tools>>,
) -> Result<(Draft, StopOnDrop), ApiError> {
    let target = s.chat.target(caller, req.model.as_deref()).await?;
    let turn = req.turn(tools.as_deref(), &target.defaults())?;
    // The model's limit on the reply's length is checked there, and names OpenAI's field.
    let named = |p: &str| p.replace("max_tokens", "max_output_tokens");
    let guard = StopOnDrop::start(&s.chat, caller, turn, &target)
        .await
        .map_err(|e| ApiError::from(e).with_param(named))?;
    let draft = Draft::new(req, target.name(), tools.is_some(), &target.defaults());
    Ok((draft, guard))
}
