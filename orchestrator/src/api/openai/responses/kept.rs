//! Kept responses: created as a native turn of a session of the caller's, then read
//! (`GET /v1/responses/{id}`, its events again with `stream=true`, from any replica), listed
//! (`…/input_items`), stopped (`…/cancel`) and deleted. A response belongs to its user: to
//! anyone else it is not found.

use std::pin::Pin;
use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio_stream::{Stream, StreamExt};
use utoipa::{IntoParams, ToSchema};

use super::draft::Draft;
use super::stream::{self, Piece};
use super::wire::{call_item, Echo, ResponseObject, ResponsesRequest};
use crate::api::loading::{after_load, Api};
use crate::api::native::sse;
use crate::api::{ApiError, AppState, ValidQuery};
use crate::generate::wire::NativeEvent;
use crate::generate::{Live, RunEvent};
use crate::ids::MessageId;
use crate::service::{Caller, NativeTurn, ReplySource, ValidTurn};
use crate::storage::{Message, MessageStatus, NewItem, NewResponse, Role, StoredResponse};
use crate::tools::Tools;

type Pieces = Pin<Box<dyn Stream<Item = Piece> + Send>>;

/// A kept response's id in a path: `resp_` and the id of the message that holds its reply.
/// Anything else names no response (404).
pub struct ResponseId(MessageId);

impl ResponseId {
    /// `resp_` and a message id; extracted from a route's `{id}` by `api::ids`.
    pub(crate) fn parse(id: &str) -> Option<Self> {
        MessageId::parse(id.strip_prefix("resp_")?).map(Self)
    }
}

#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
pub struct ResponsePath {
    /// A response id, as `POST /v1/responses` returned it.
    #[param(pattern = "^resp_[0-9a-f]{32}$")]
    id: String,
}

/// A request to keep, read and checked before anything is loaded or stored.
struct Kept {
    req: ResponsesRequest,
    tools: Option<Arc<Tools>>,
    previous: Option<StoredResponse>,
    system: Option<String>,
    items: Vec<NewItem>,
}

/// `POST /v1/responses` of a response to keep.
pub(super) async fn create(
    s: AppState,
    caller: Caller,
    req: ResponsesRequest,
    tools: Option<Arc<Tools>>,
) -> Result<Response, ApiError> {
    req.options(tools.as_deref(), &Default::default())?;
    let previous = match req.previous_response_id.as_deref() {
        Some(id) => {
            let id = ResponseId::parse(id).ok_or(ApiError::NotFound("previous response"))?;
            let found = s.chat.response(&caller, &id.0).await;
            Some(found.map_err(|_| ApiError::NotFound("previous response"))?)
        }
        None => None,
    };
    let made = previous
        .iter()
        .flat_map(|p| p.reply.tool_calls.iter().flatten())
        .map(|c| (c.id.clone(), c.function.name.clone()))
        .collect();
    let (system, items) = req.kept_input(made)?;
    let k = Kept {
        req,
        tools,
        previous,
        system,
        items,
    };
    if k.req.stream {
        if let Some(model) = s.chat.needs_load(k.req.model.as_deref()) {
            let events = async move {
                let (draft, live) = start(&s, &caller, &k).await?;
                Ok(stream::translate(
                    draft.clone(),
                    k.tools,
                    live_pieces(live, draft),
                    None,
                ))
            };
            return Ok(after_load(Api::OpenAi, model, events));
        }
    }
    let (draft, live) = start(&s, &caller, &k).await?;
    if k.req.stream {
        let pieces = live_pieces(live, draft.clone());
        return Ok(sse(stream::translate(draft, k.tools, pieces, None)));
    }
    if k.req.background == Some(true) {
        return Ok(Json(draft.in_progress().clone()).into_response());
    }
    let done = match live.outcome().await {
        Some(o) => draft.ended(&o.completion()),
        // Taken over by another replica: as it is kept now.
        None => draft.of_reply(&s.chat.response(&caller, &reply_of(&live)?).await?.reply),
    };
    Ok(Json(done).into_response())
}

/// Starts the response's reply (its model loaded first if it must be) and keeps it.
async fn start(s: &AppState, caller: &Caller, k: &Kept) -> Result<(Draft, Arc<Live>), ApiError> {
    let target = s.chat.target(caller, k.req.model.as_deref()).await?;
    let options = k.req.options(k.tools.as_deref(), &target.defaults())?;
    let draft = Draft::new(&k.req, target.name(), k.tools.is_some(), &target.defaults());
    let request = serde_json::to_string(draft.request())
        .map_err(|e| ApiError::Internal(format!("a response's request: {e}")))?;
    let new = NewResponse {
        items: k.items.clone(),
        system_prompt: k.system.clone(),
        model: k.req.model.clone(),
        previous: k.previous.as_ref().map(|p| p.reply.id.clone()),
        request,
    };
    let turn = ValidTurn::new(NativeTurn::response(new)?, options, k.req.stream);
    let title = k.items.iter().find(|i| i.role == Role::User);
    let title = title.map_or("", |i| i.content.as_str());
    // The model's limit on the reply's length is checked there, and names OpenAI's field.
    let named = |p: &str| p.replace("max_tokens", "max_output_tokens");
    let live = s
        .chat
        .start_response(caller, k.previous.as_ref(), turn, title)
        .await
        .map_err(|e| ApiError::from(e).with_param(named))?;
    let reply = reply_of(&live)?;
    let draft = Draft::kept(&reply, crate::storage::now_ms(), draft.request().clone());
    Ok((draft, live))
}

fn reply_of(live: &Live) -> Result<MessageId, ApiError> {
    live.ids
        .as_ref()
        .map(|ids| ids.message_id.clone())
        .ok_or_else(|| ApiError::Internal("a kept response without its message".into()))
}

/// The pieces of a reply this replica runs, its end as `draft` then stands.
fn live_pieces(live: Arc<Live>, draft: Draft) -> Pieces {
    Box::pin(live.subscribe(0).filter_map(move |(_, e)| match e {
        RunEvent::Text(t) => Some(Piece::Text(t)),
        RunEvent::End(o) => Some(Piece::End(Box::new(draft.ended(&o.completion())))),
        RunEvent::Begin | RunEvent::Logprobs(_) => None,
    }))
}

/// The pieces of a reply from its shared stream (another replica runs it), its end as then
/// kept. A stream that was lost ends without an end: the client reads it again later.
fn shared_pieces(
    events: impl Stream<Item = NativeEvent> + Send + 'static,
    s: AppState,
    caller: Caller,
    draft: Draft,
    reply: MessageId,
) -> Pieces {
    Box::pin(async_stream::stream! {
        let mut events = std::pin::pin!(events);
        while let Some(e) = events.next().await {
            if e.name == "token" {
                let data: Value = serde_json::from_str(&e.data).unwrap_or_default();
                if let Some(t) = data.get("text").and_then(Value::as_str) {
                    yield Piece::Text(t.to_string());
                }
            } else if e.ends_reply() {
                if let Ok(kept) = s.chat.response(&caller, &reply).await {
                    yield Piece::End(Box::new(draft.of_reply(&kept.reply)));
                }
                return;
            } else if e.is_last() {
                return;
            }
        }
    })
}

/// The draft of a kept response, from what was kept of its request.
fn draft_of(kept: &StoredResponse) -> Result<Draft, ApiError> {
    let request: Echo = serde_json::from_str(&kept.request)
        .map_err(|e| ApiError::Internal(format!("a kept response's request: {e}")))?;
    Ok(Draft::kept(&kept.reply.id, kept.created_at, request))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct GetParams {
    /// The response's events (Server-Sent Events), from its first, as they were streamed.
    #[serde(default)]
    stream: bool,
    /// With `stream`: only the events after this `sequence_number`.
    #[param(minimum = 0)]
    starting_after: Option<u64>,
}

/// A kept response as it stands, or (with `stream`) its events again: those of a reply still
/// running as they come, from any replica.
#[utoipa::path(get, path = "/v1/responses/{id}", operation_id = "getResponse", tag = "openai", params(ResponsePath, GetParams),
    responses(
        (status = 200, description = "The response (or, with `stream`, its events)", content(
            (ResponseObject = "application/json"),
            (String = "text/event-stream"),
        )),
        (status = 404, description = "No response of the caller's has this id", body = crate::api::ErrorBody),
    ))]
pub async fn get(
    State(s): State<AppState>,
    caller: Caller,
    id: ResponseId,
    ValidQuery(p): ValidQuery<GetParams>,
) -> Result<Response, ApiError> {
    let kept = s.chat.response(&caller, &id.0).await?;
    let draft = draft_of(&kept)?;
    if !p.stream {
        return Ok(Json(draft.of_reply(&kept.reply)).into_response());
    }
    let tools = draft.request().tools()?.map(Arc::new);
    let pieces = replay(&s, &caller, &kept, draft.clone()).await?;
    Ok(sse(stream::translate(
        draft,
        tools,
        pieces,
        p.starting_after,
    )))
}

/// A kept response's pieces again: from its reply's log while it is kept (here, or shared in
/// Redis), else from its stored text.
async fn replay(
    s: &AppState,
    caller: &Caller,
    kept: &StoredResponse,
    draft: Draft,
) -> Result<Pieces, ApiError> {
    let ended = kept.reply.status != MessageStatus::Streaming;
    let reply = &kept.reply.id;
    match s.chat.reply_stream(caller, &kept.session_id).await {
        Ok(ReplySource::Local(live)) if live.ids.as_ref().map(|i| &i.message_id) == Some(reply) => {
            return Ok(live_pieces(live, draft));
        }
        Ok(ReplySource::Shared(shared)) if shared.message_id == *reply => {
            let events = s
                .chat
                .shared_events(caller, &kept.session_id, shared, 0)
                .await?;
            if let Some(events) = events {
                let (s, caller) = (s.clone(), caller.clone());
                return Ok(shared_pieces(events, s, caller, draft, reply.clone()));
            }
        }
        Err(e) if !ended => return Err(e.into()),
        _ => {}
    }
    if !ended {
        return Err(ApiError::Unavailable(
            "the response's events cannot be read now; try again shortly".into(),
        ));
    }
    let text = Piece::Text(kept.reply.content.clone());
    let end = Piece::End(Box::new(draft.of_reply(&kept.reply)));
    Ok(Box::pin(tokio_stream::iter([text, end])))
}

/// Stops a kept response's reply if it is still running, and answers the response as it then
/// stands (`cancelled` when it was stopped).
#[utoipa::path(post, path = "/v1/responses/{id}/cancel", operation_id = "cancelResponse", tag = "openai", params(ResponsePath),
    responses(
        (status = 200, description = "The response as it stands", body = ResponseObject),
        (status = 404, description = "No response of the caller's has this id", body = crate::api::ErrorBody),
    ))]
pub async fn cancel(
    State(s): State<AppState>,
    caller: Caller,
    id: ResponseId,
) -> Result<Json<ResponseObject>, ApiError> {
    let kept = s.chat.cancel_response(&caller, &id.0).await?;
    Ok(Json(draft_of(&kept)?.of_reply(&kept.reply)))
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Deleted {
    id: String,
    /// `response`
    object: &'static str,
    deleted: bool,
}

/// Deletes a kept response (stopping its reply if it runs). When its session holds no other
/// response, the session goes too, purged with its messages as deleted sessions are.
#[utoipa::path(delete, path = "/v1/responses/{id}", operation_id = "deleteResponse", tag = "openai", params(ResponsePath),
    responses(
        (status = 200, description = "Deleted", body = Deleted),
        (status = 404, description = "No response of the caller's has this id", body = crate::api::ErrorBody),
    ))]
pub async fn delete(
    State(s): State<AppState>,
    caller: Caller,
    id: ResponseId,
) -> Result<Json<Deleted>, ApiError> {
    s.chat.delete_response(&caller, &id.0).await?;
    Ok(Json(Deleted {
        id: super::draft::response_id(&id.0),
        object: "response",
        deleted: true,
    }))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ItemParams {
    /// `asc` or `desc` (the default: newest first).
    order: Option<String>,
    /// Page size, 1 to 100 (default 20).
    #[param(minimum = 1, maximum = 100)]
    limit: Option<u32>,
    /// Only the items after this item id, in `order`.
    after: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ItemList {
    /// `list`
    object: &'static str,
    #[schema(value_type = Vec<Object>)]
    data: Vec<Value>,
    first_id: Option<String>,
    last_id: Option<String>,
    has_more: bool,
}

/// The items a kept response's request added to its conversation: its messages, function
/// calls and their outputs (its instructions are not items).
#[utoipa::path(get, path = "/v1/responses/{id}/input_items", operation_id = "listResponseInputItems", tag = "openai", params(ResponsePath, ItemParams),
    responses(
        (status = 200, description = "One page of items", body = ItemList),
        (status = 404, description = "No response of the caller's has this id", body = crate::api::ErrorBody),
        (status = 422, description = "A parameter is out of range", body = crate::api::ErrorBody),
    ))]
pub async fn input_items(
    State(s): State<AppState>,
    caller: Caller,
    id: ResponseId,
    ValidQuery(p): ValidQuery<ItemParams>,
) -> Result<Json<ItemList>, ApiError> {
    let limit = p.limit.unwrap_or(20);
    if !(1..=100).contains(&limit) {
        return Err(super::super::wire::refuse("limit", "from 1 to 100"));
    }
    let desc = match p.order.as_deref() {
        None | Some("desc") => true,
        Some("asc") => false,
        Some(_) => return Err(super::super::wire::refuse("order", "`asc` or `desc`")),
    };
    let kept = s.chat.response(&caller, &id.0).await?;
    let mut items: Vec<Value> = s
        .chat
        .response_input(&caller, &kept)
        .await?
        .iter()
        .flat_map(input_item)
        .collect();
    if desc {
        items.reverse();
    }
    if let Some(after) = &p.after {
        let at = items.iter().position(|i| i["id"] == json!(after));
        items.drain(..at.map_or(0, |n| n + 1));
    }
    let has_more = items.len() > limit as usize;
    items.truncate(limit as usize);
    let id_of = |i: &Value| i["id"].as_str().map(str::to_string);
    Ok(Json(ItemList {
        object: "list",
        first_id: items.first().and_then(id_of),
        last_id: items.last().and_then(id_of),
        data: items,
        has_more,
    }))
}

/// A kept message as the input items it was: a message, function calls, or a call's output.
fn input_item(m: &Message) -> Vec<Value> {
    let id = m.id.as_str();
    match (m.role, &m.tool_calls) {
        (Role::User, _) => vec![json!({"type": "message", "id": format!("msg_{id}"),
            "role": "user", "status": "completed",
            "content": [{"type": "input_text", "text": m.content}]})],
        (Role::Assistant, Some(calls)) => calls
            .iter()
            .map(|c| serde_json::to_value(call_item(c)).unwrap_or_default())
            .collect(),
        (Role::Assistant, None) => vec![json!({"type": "message", "id": format!("msg_{id}"),
            "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": m.content, "annotations": []}]})],
        (Role::Tool, _) => vec![json!({"type": "function_call_output",
            "id": format!("fco_{id}"), "call_id": m.tool_call_id, "output": m.content,
            "status": "completed"})],
    }
}
