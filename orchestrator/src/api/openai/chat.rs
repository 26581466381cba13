//! `POST /v1/chat/completions`: a checked request becomes a stateless turn with `n` choices,
//! answered whole or streamed.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value;
use tokio_stream::StreamExt;

use super::stream::*;
use super::wire::*;
use crate::api::native::sse;
use crate::api::{ApiError, AppState, ValidJson};
use crate::generate::OpenAiFinish;
use crate::generate::{Live, Outcome, RunEvent, TokenLogprob};
use crate::service::Caller;
use crate::tools::Tools;

/// OpenAI-compatible chat completion, streaming (Server-Sent Events of
/// `chat.completion.chunk`, then `[DONE]`) or not. Stateless: nothing is stored, and a client
/// that goes away cancels its generation.
#[utoipa::path(post, path = "/v1/chat/completions", operation_id = "createChatCompletion", tag = "openai", request_body = ChatRequest,
    responses(
        (status = 200, description = "The completion", content(
            (ChatCompletion = "application/json"),
            (crate::api::openapi::CompletionEvent = "text/event-stream"),
        )),
        (status = 404, description = "`model` names a model this server does not serve (`model_not_found`)", body = crate::api::ErrorBody),
        (status = 422, description = "A field is out of range or asks for what Hearth cannot do", body = crate::api::ErrorBody),
    ))]
pub async fn completions(
    State(s): State<AppState>,
    caller: Caller,
    ValidJson(req): ValidJson<ChatRequest>,
) -> Result<Response, ApiError> {
    let logprobs = req.logprobs == Some(true);
    if req.stream {
        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        let loading = s.chat.needs_load(req.model.as_deref());
        if loading.is_some() {
            // What can be refused before the load is, with its status.
            check_before_load(&req)?;
        }
        let events = async move {
            let (head, guards, tools) = start_chat(&s, &caller, &req).await?;
            let shape = Shape::Chat { tools };
            Ok(streamed_events(
                head,
                guards,
                include_usage,
                logprobs,
                shape,
            ))
        };
        return Ok(match loading {
            Some(model) => {
                crate::api::loading::after_load(crate::api::loading::Api::OpenAi, model, events)
            }
            None => super::chat::sse(events.await?),
        });
    }
    let (head, guards, tools) = start_chat(&s, &caller, &req).await?;
    let lives: Vec<Arc<Live>> = guards.iter().map(|g| g.0.clone()).collect();
    let shape = Shape::Chat {
        tools: tools.clone(),
    };
    let finished = finished_choices(&lives, logprobs, &shape).await?;
    let choices = (0u32..).zip(&finished).map(completion_choice).collect();
    let outcomes: Vec<Outcome> = finished.into_iter().map(|f| f.outcome).collect();
    drop(guards);
    Ok(Json(ChatCompletion {
        id: head.id,
        object: "chat.completion".into(),
        created: head.created,
        model: head.model,
        choices,
        usage: Usage::of(&outcomes),
    })
    .into_response())
}

/// Starts a chat completion's choices: its model (loaded first if it must be), its options,
/// its generations. Dropping the guards (the client went away) stops the generations.
async fn start_chat(
    s: &AppState,
    caller: &Caller,
    req: &ChatRequest,
) -> Result<(Head, Vec<StopOnDrop>, Option<Arc<Tools>>), ApiError> {
    if s.chat.needs_load(req.model.as_deref()).is_some() {
        check_before_load(req)?;
    }
    let target = s.chat.target(caller, req.model.as_deref()).await?;
    let tools = req.tools()?.map(Arc::new);
    let turn = req.turn(tools.as_deref(), &target.defaults())?;
    let lives = s
        .chat
        .complete(caller, turn, &target, req.n.unwrap_or(1))
        .await?;
    let head = Head {
        id: format!("chatcmpl-{}", uuid::Uuid::new_v4().simple()),
        created: crate::storage::now_ms() / 1000,
        model: target.name(),
    };
    Ok((head, lives.into_iter().map(StopOnDrop).collect(), tools))
}

/// What of a request for a model that must be loaded first can be refused before the load:
/// its tools and its turn (with no model defaults yet), so that bad input costs no load.
fn check_before_load(req: &ChatRequest) -> Result<(), ApiError> {
    let tools = req.tools()?;
    req.turn(tools.as_ref(), &Default::default())?;
    Ok(())
}

/// Choice `index` of a chat completion, as answered: its text, or its tool calls.
fn completion_choice((index, f): (u32, &FinishedChoice)) -> CompletionChoice {
    let calls = f.outcome.tool_calls.clone();
    CompletionChoice {
        index,
        finish_reason: match &calls {
            Some(_) => OpenAiFinish::ToolCalls,
            None => f.finish_reason,
        },
        message: AssistantMessage {
            role: "assistant".into(),
            content: calls.is_none().then(|| f.outcome.content.clone()),
            tool_calls: calls,
        },
        logprobs: (!f.logprobs.is_null()).then(|| f.logprobs.clone()),
    }
}

/// A choice of a finished (non-streamed) completion.
pub(super) struct FinishedChoice {
    pub(super) outcome: Outcome,
    pub(super) finish_reason: OpenAiFinish,
    /// In `shape`'s form with `logprobs`, else null.
    pub(super) logprobs: Value,
}

/// Waits for every choice to end, in order: its outcome, OpenAI's finish reason (a failed
/// choice fails the request), and its tokens' log-probabilities when asked for.
pub(super) async fn finished_choices(
    lives: &[Arc<Live>],
    logprobs: bool,
    shape: &Shape,
) -> Result<Vec<FinishedChoice>, ApiError> {
    let mut out = Vec::with_capacity(lives.len());
    for live in lives {
        let outcome = live
            .outcome()
            .await
            .ok_or_else(|| ApiError::Internal("the generation ended without an outcome".into()))?;
        let reason = outcome
            .end
            .openai_finish_reason()
            .map_err(|e| ApiError::from(e.clone()))?;
        let logprobs = if logprobs {
            let mut offset = shape.echoed_len();
            shape.logprobs(collected_logprobs(live).await, &mut offset)
        } else {
            Value::Null
        };
        out.push(FinishedChoice {
            outcome,
            finish_reason: reason,
            logprobs,
        });
    }
    Ok(out)
}

/// What every object of one completion repeats.
pub(super) struct Head {
    pub(super) id: String,
    pub(super) created: i64,
    pub(super) model: String,
}

/// Every token's log-probability of a finished reply.
async fn collected_logprobs(live: &Arc<Live>) -> Vec<TokenLogprob> {
    let mut all = Vec::new();
    let mut events = std::pin::pin!(live.subscribe(0));
    while let Some((_, e)) = events.next().await {
        match e {
            RunEvent::Logprobs(l) => all.extend(l),
            RunEvent::End(_) => break,
            _ => {}
        }
    }
    all
}
