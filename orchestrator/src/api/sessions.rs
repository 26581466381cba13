//! `/v1/sessions…`: the caller's chat sessions and their messages. Every query is scoped to the
//! caller; another user's session is a 404, exactly like a missing one.

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use hearth_shared::SamplingParams;
use serde::{Deserialize, Deserializer, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::{created, ApiError, AppState, ValidJson, ValidQuery};
use crate::ids::SessionId;
use crate::service::{next_cursor, session_query, Caller, MessagePage, ValidPatch, ValidSession};
use crate::storage::{Message, Session};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/sessions", get(list).post(create))
        .route("/v1/sessions/{id}", get(fetch).patch(update).delete(remove))
        .route(
            "/v1/sessions/{id}/messages",
            get(messages).post(super::native::post_message),
        )
        .route(
            "/v1/sessions/{id}/regenerate",
            post(super::native::regenerate),
        )
        .route(
            "/v1/sessions/{id}/messages/{message_id}/edit",
            post(super::native::edit),
        )
        .route("/v1/sessions/{id}/stop", post(super::native::stop))
        .route("/v1/sessions/{id}/stream", get(super::native::resume))
        .route("/v1/sessions/{id}/ws", get(super::ws::socket))
}

/// A new session; every field is optional.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct CreateSession {
    /// Up to 200 characters, trimmed; "New chat" when empty.
    #[serde(default)]
    title: Option<String>,
    /// Up to 64 KiB.
    #[serde(default)]
    system_prompt: Option<String>,
    #[serde(default)]
    /// Default sampling parameters: the fields given, over the served model's defaults.
    #[schema(value_type = Option<SamplingParams>)]
    params: Option<serde_json::Map<String, serde_json::Value>>,
    /// Default reply length for the session's turns: at least 1, and less than the model's
    /// context.
    #[serde(default)]
    #[schema(minimum = 1)]
    max_tokens: Option<u32>,
    /// The model the session's turns go to: a served model's name, as `/v1/models` lists it
    /// (each turn gets its newest ready version), or `name@version` to keep one version (a 404
    /// `model_not_found` otherwise). Absent: the default model.
    #[serde(default)]
    model: Option<String>,
}

/// Distinguishes an absent field (`None`) from an explicit `null` (`Some(None)`).
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

/// Fields to change: an absent field is left as it is, `null` clears it.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct UpdateSession {
    #[serde(default)]
    title: Option<String>,
    #[serde(default, deserialize_with = "present")]
    system_prompt: Option<Option<String>>,
    #[serde(default, deserialize_with = "present")]
    /// The session's sampling fields (they replace the stored ones); `null` clears them.
    #[schema(value_type = Option<SamplingParams>)]
    params: Option<Option<serde_json::Map<String, serde_json::Value>>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(minimum = 1)]
    max_tokens: Option<Option<u32>>,
    /// A served model's name, or `name@version`; `null`: the default model.
    #[serde(default, deserialize_with = "present")]
    model: Option<Option<String>>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(super) struct ListParams {
    /// Page size, 1 to 100 (default 20).
    #[param(minimum = 1, maximum = 100)]
    limit: Option<u32>,
    /// Only sessions whose title contains this (up to 200 bytes).
    q: Option<String>,
    /// The previous page's `next_cursor`.
    #[param(pattern = "^-?[0-9]+_[0-9a-f]{32}$")]
    before: Option<String>,
}

/// One page of the caller's sessions, newest first.
#[derive(Debug, Serialize, ToSchema)]
pub(super) struct SessionPage {
    data: Vec<Session>,
    /// Pass as `before` for the next page; `null` on the last one.
    #[schema(required = true)]
    next_cursor: Option<String>,
}

/// One page of a session's messages, oldest first.
#[derive(Debug, Serialize, ToSchema)]
pub(super) struct MessageList {
    data: Vec<Message>,
    /// Pass as `before` for the page of earlier messages; `null` on the first page.
    #[schema(required = true)]
    next_cursor: Option<String>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(super) struct MessageParams {
    /// Page size, 1 to 1000 (default 1000): the newest messages before `before`.
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<u32>,
    /// The later page's `next_cursor`.
    #[param(pattern = "^[0-9]+$")]
    before: Option<String>,
}

/// Creates a session for the caller.
#[utoipa::path(post, path = "/v1/sessions", operation_id = "createSession", tag = "sessions",
    request_body = CreateSession,
    responses(
        (status = 201, description = "The new session", body = Session),
        (status = 404, description = "`model` names a model this server does not serve (`model_not_found`)", body = super::ErrorBody),
        (status = 422, description = "A field is out of range, or the caller has the most sessions a user may keep", body = super::ErrorBody),
    ))]
pub(super) async fn create(
    State(s): State<AppState>,
    Caller { user, .. }: Caller,
    ValidJson(body): ValidJson<CreateSession>,
) -> Result<(StatusCode, Json<Session>), ApiError> {
    let new = ValidSession::new(
        body.title.as_deref(),
        body.system_prompt,
        body.params,
        body.max_tokens,
    )?
    .with_model(body.model)?;
    let session = s.chat.create_session(&user, new).await?;
    Ok(created(session))
}

/// The caller's sessions, newest first, a page at a time.
#[utoipa::path(get, path = "/v1/sessions", operation_id = "listSessions", tag = "sessions", params(ListParams),
    responses(
        (status = 200, description = "One page", body = SessionPage),
        (status = 422, description = "A parameter is out of range or not a cursor from this API", body = super::ErrorBody),
    ))]
pub(super) async fn list(
    State(s): State<AppState>,
    Caller { user, .. }: Caller,
    ValidQuery(p): ValidQuery<ListParams>,
) -> Result<Json<SessionPage>, ApiError> {
    let query = session_query(p.limit, p.q, p.before.as_deref())?;
    let limit = query.limit as usize;
    let page = s.chat.sessions(&user, &query).await?;
    let next = (page.len() == limit)
        .then(|| page.last().map(|l| next_cursor(l.updated_at, &l.id)))
        .flatten();
    Ok(Json(SessionPage {
        data: page,
        next_cursor: next,
    }))
}

/// One of the caller's sessions.
#[utoipa::path(get, path = "/v1/sessions/{id}", operation_id = "getSession", tag = "sessions", params(super::SessionPath),
    responses(
        (status = 200, description = "The session", body = Session),
        (status = 404, description = "No such session (another user's is not found either)", body = super::ErrorBody),
    ))]
pub(super) async fn fetch(
    State(s): State<AppState>,
    Caller { user, .. }: Caller,
    id: SessionId,
) -> Result<Json<Session>, ApiError> {
    Ok(Json(s.chat.session(&user, &id).await?))
}

/// Changes a session's title, system prompt or defaults.
#[utoipa::path(patch, path = "/v1/sessions/{id}", operation_id = "updateSession", tag = "sessions", params(super::SessionPath),
    request_body = UpdateSession,
    responses(
        (status = 200, description = "The changed session", body = Session),
        (status = 404, description = "No such session, or `model` names a model this server does not serve (`model_not_found`)", body = super::ErrorBody),
        (status = 422, description = "A field is out of range", body = super::ErrorBody),
    ))]
pub(super) async fn update(
    State(s): State<AppState>,
    Caller { user, .. }: Caller,
    id: SessionId,
    ValidJson(body): ValidJson<UpdateSession>,
) -> Result<Json<Session>, ApiError> {
    let patch = ValidPatch::new(
        body.title.as_deref(),
        body.system_prompt,
        body.params,
        body.max_tokens,
    )?
    .with_model(body.model)?;
    Ok(Json(s.chat.update_session(&user, &id, patch).await?))
}

/// Deletes a session and its messages, stops its running reply and frees its cache on the
/// workers.
#[utoipa::path(delete, path = "/v1/sessions/{id}", operation_id = "deleteSession", tag = "sessions", params(super::SessionPath),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "No such session", body = super::ErrorBody),
    ))]
pub(super) async fn remove(
    State(s): State<AppState>,
    Caller { user, .. }: Caller,
    id: SessionId,
) -> Result<StatusCode, ApiError> {
    s.chat.delete_session(&user, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A session's stored messages, a page at a time: the newest, oldest first (a reply still
/// streaming included, with what it has said so far); `next_cursor` pages back.
#[utoipa::path(get, path = "/v1/sessions/{id}/messages", operation_id = "listMessages", tag = "sessions", params(super::SessionPath, MessageParams),
    responses(
        (status = 200, description = "One page of messages", body = MessageList),
        (status = 404, description = "No such session", body = super::ErrorBody),
        (status = 422, description = "A parameter is out of range or not a cursor from this API", body = super::ErrorBody),
    ))]
pub(super) async fn messages(
    State(s): State<AppState>,
    Caller { user, .. }: Caller,
    id: SessionId,
    ValidQuery(p): ValidQuery<MessageParams>,
) -> Result<Json<MessageList>, ApiError> {
    let page = MessagePage::new(p.limit, p.before.as_deref())?;
    let (data, next_cursor) = s.chat.messages(&user, &id, page).await?;
    Ok(Json(MessageList { data, next_cursor }))
}
