//! `POST /v1/responses`: OpenAI's Responses API (the OpenAI Agents SDK's default, Codex,
//! LangChain's `use_responses_api`), stateless as chat completions are: `input` (a string or
//! items, function calls and their outputs among them) becomes one reply, answered as a
//! `response` object or streamed as its events. Responses are not kept: `store` is answered
//! `false`, and `previous_response_id` and `background` are refused by name.
//!
//! - `wire`: the request and the `response` object;
//! - `stream`: the streamed events, each with its `sequence_number`.

mod stream;
pub(super) mod wire;

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::stream::StopOnDrop;
use crate::api::loading::{after_load, Api};
use crate::api::native::sse;
use crate::api::{ApiError, AppState, ValidJson};
use crate::generate::{OpenAiFinish, Outcome};
use crate::service::Caller;
use crate::tools::Tools;
use wire::{call_item, OutputItem, OutputText, ResponseObject, ResponseUsage, ResponsesRequest};

/// A model's reply to `input`, as a `response` object or (with `stream`) its events. Stateless:
/// nothing is stored, and a client that goes away cancels its generation.
#[utoipa::path(post, path = "/v1/responses", operation_id = "createResponse", tag = "openai", request_body = ResponsesRequest,
    responses(
        (status = 200, description = "The response (or, with `stream`, its events)", content(
            (ResponseObject = "application/json"),
            (String = "text/event-stream"),
        )),
        (status = 404, description = "`model` names a model this server does not serve (`model_not_found`)", body = crate::api::ErrorBody),
        (status = 422, description = "A field is out of range or asks for what Hearth cannot do", body = crate::api::ErrorBody),
    ))]
pub async fn create(
    State(s): State<AppState>,
    caller: Caller,
    ValidJson(req): ValidJson<ResponsesRequest>,
) -> Result<Response, ApiError> {
    let tools = req.tools()?.map(Arc::new);
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
    let draft = Draft::new(req, target.name(), tools.is_some());
    Ok((draft, guard))
}

/// The `response` object before its reply: what it repeats of the request.
#[derive(Debug, Clone)]
pub(super) struct Draft(ResponseObject);

impl Draft {
    fn new(req: &ResponsesRequest, model: String, has_tools: bool) -> Self {
        let tools: Vec<Value> = req
            .tools
            .iter()
            .flatten()
            .map(|t| serde_json::to_value(t).unwrap_or_default())
            .collect();
        let default_choice = if has_tools { "auto" } else { "none" };
        Self(ResponseObject {
            id: format!("resp_{}", uuid::Uuid::new_v4().simple()),
            object: "response",
            created_at: crate::storage::now_ms() / 1000,
            status: "in_progress",
            model,
            output: Vec::new(),
            error: None,
            incomplete_details: None,
            instructions: req.instructions.clone(),
            max_output_tokens: req.max_output_tokens,
            metadata: req.metadata.clone().unwrap_or_else(|| json!({})),
            parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
            previous_response_id: None,
            store: false,
            background: false,
            temperature: req.temperature,
            top_p: req.top_p,
            tool_choice: req.tool_choice.clone().unwrap_or(json!(default_choice)),
            tools,
            text: json!({"format": req.text.as_ref().and_then(|t| t.format.clone())
                .unwrap_or(json!({"type": "text"}))}),
            truncation: req.truncation.clone().unwrap_or("disabled".into()),
            usage: None,
        })
    }

    /// The object as it stands before the reply: `in_progress`, no output.
    pub(super) fn in_progress(&self) -> &ResponseObject {
        &self.0
    }

    /// The `message` item's id.
    pub(super) fn message_id(&self) -> String {
        format!("msg_{}", self.0.id.trim_start_matches("resp_"))
    }

    /// The object once the reply finished (`finish`): `completed`, or `incomplete` when it
    /// was cut by its length, with its output and usage.
    pub(super) fn finished(&self, o: &Outcome, finish: OpenAiFinish) -> ResponseObject {
        let mut r = self.0.clone();
        r.output = match &o.tool_calls {
            Some(calls) => calls.iter().map(call_item).collect(),
            None => vec![OutputItem::Message {
                id: self.message_id(),
                role: "assistant",
                status: "completed",
                content: vec![OutputText::new(o.content.clone())],
            }],
        };
        (r.status, r.incomplete_details) = match finish {
            OpenAiFinish::Length => ("incomplete", Some(json!({"reason": "max_output_tokens"}))),
            OpenAiFinish::Stop | OpenAiFinish::ToolCalls => ("completed", None),
        };
        r.usage = Some(ResponseUsage::of(o));
        r
    }

    /// The object of a reply that failed saying `message`.
    pub(super) fn failed(&self, o: &Outcome, message: &str) -> ResponseObject {
        let mut r = self.0.clone();
        r.status = "failed";
        r.error = Some(json!({"code": "server_error", "message": message}));
        r.usage = Some(ResponseUsage::of(o));
        r
    }
}
