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
use crate::service::Caller;
use crate::storage::{Message, NewSession, Session, SessionPatch, SessionQuery};

const MAX_TITLE_CHARS: usize = 200;
const MAX_SYSTEM_PROMPT_BYTES: usize = 64 << 10;
const DEFAULT_PAGE: u32 = 20;
const MAX_PAGE: u32 = 100;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/sessions", get(list).post(create))
        .route("/v1/sessions/{id}", get(fetch).patch(update).delete(remove))
        .route(
            "/v1/sessions/{id}/messages",
            get(messages).post(super::chat::post_message),
        )
        .route(
            "/v1/sessions/{id}/regenerate",
            post(super::chat::regenerate),
        )
        .route(
            "/v1/sessions/{id}/messages/{message_id}/edit",
            post(super::chat::edit),
        )
        .route("/v1/sessions/{id}/stop", post(super::chat::stop))
        .route("/v1/sessions/{id}/stream", get(super::chat::resume))
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
    params: Option<SamplingParams>,
    /// Default reply length for the session's turns: at least 1, and less than the model's
    /// context.
    #[serde(default)]
    #[schema(minimum = 1)]
    max_tokens: Option<u32>,
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
    params: Option<Option<SamplingParams>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(minimum = 1)]
    max_tokens: Option<Option<u32>>,
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

/// Text no database column can hold (PostgreSQL refuses NUL characters).
fn check_text(field: &str, t: &str) -> Result<(), ApiError> {
    if t.contains('\0') {
        return Err(ApiError::Validation(format!(
            "{field}: must not contain NUL characters"
        )));
    }
    Ok(())
}

fn check_title(t: &str) -> Result<String, ApiError> {
    check_text("title", t)?;
    let t = t.trim();
    if t.chars().count() > MAX_TITLE_CHARS {
        return Err(ApiError::Validation(format!(
            "title: longer than {MAX_TITLE_CHARS} characters"
        )));
    }
    Ok(t.to_string())
}

fn check_system(s: &str) -> Result<(), ApiError> {
    check_text("system_prompt", s)?;
    if s.len() > MAX_SYSTEM_PROMPT_BYTES {
        return Err(ApiError::Validation(format!(
            "system_prompt: longer than {MAX_SYSTEM_PROMPT_BYTES} bytes"
        )));
    }
    Ok(())
}

fn check_params(p: SamplingParams) -> Result<serde_json::Value, ApiError> {
    let p = crate::service::check_params(p, "params.")?;
    serde_json::to_value(p).map_err(|e| ApiError::Internal(e.to_string()))
}

/// One page of the caller's sessions, newest first.
#[derive(Debug, Serialize, ToSchema)]
pub(super) struct SessionPage {
    data: Vec<Session>,
    /// Pass as `before` for the next page; `null` on the last one.
    #[schema(required = true)]
    next_cursor: Option<String>,
}

/// A session's messages, oldest first.
#[derive(Debug, Serialize, ToSchema)]
pub(super) struct MessageList {
    data: Vec<Message>,
}

/// Creates a session for the caller.
#[utoipa::path(post, path = "/v1/sessions", operation_id = "createSession", tag = "sessions",
    request_body = CreateSession,
    responses(
        (status = 201, description = "The new session", body = Session),
        (status = 422, description = "A field is out of range, or the caller has the most sessions a user may keep", body = super::ErrorBody),
    ))]
pub(super) async fn create(
    State(s): State<AppState>,
    Caller { user, .. }: Caller,
    ValidJson(body): ValidJson<CreateSession>,
) -> Result<(StatusCode, Json<Session>), ApiError> {
    let title = check_title(body.title.as_deref().unwrap_or(""))?;
    if let Some(sys) = &body.system_prompt {
        check_system(sys)?;
    }
    let params = body.params.map(check_params).transpose()?;
    let max_tokens = body
        .max_tokens
        .map(|n| s.chat.check_session_max_tokens(n))
        .transpose()?;
    let session = s
        .chat
        .create_session(
            &user,
            NewSession {
                title: if title.is_empty() {
                    "New chat".into()
                } else {
                    title
                },
                system_prompt: body.system_prompt,
                params,
                max_tokens,
            },
        )
        .await?;
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
    let limit = p.limit.unwrap_or(DEFAULT_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::Validation(format!(
            "limit: must be between 1 and {MAX_PAGE}"
        )));
    }
    let before = p
        .before
        .as_deref()
        .map(|c| {
            c.split_once('_')
                .and_then(|(at, id)| Some((at.parse::<i64>().ok()?, id.to_string())))
                .filter(|(_, id)| SessionId::parse(id).is_some())
                .ok_or_else(|| ApiError::Validation("before: not a cursor from this API".into()))
        })
        .transpose()?;
    if let Some(q) = &p.q {
        check_text("q", q)?;
        if q.len() > 200 {
            return Err(ApiError::Validation("q: longer than 200 bytes".into()));
        }
    }
    let page = s
        .chat
        .sessions(
            &user,
            &SessionQuery {
                q: p.q,
                limit,
                before,
            },
        )
        .await?;
    let next = (page.len() == limit as usize)
        .then(|| page.last().map(|l| format!("{}_{}", l.updated_at, l.id)))
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
        (status = 404, description = "No such session", body = super::ErrorBody),
        (status = 422, description = "A field is out of range", body = super::ErrorBody),
    ))]
pub(super) async fn update(
    State(s): State<AppState>,
    Caller { user, .. }: Caller,
    id: SessionId,
    ValidJson(body): ValidJson<UpdateSession>,
) -> Result<Json<Session>, ApiError> {
    let title = body.title.as_deref().map(check_title).transpose()?;
    if let Some(Some(sys)) = &body.system_prompt {
        check_system(sys)?;
    }
    let params = match body.params {
        Some(Some(p)) => Some(Some(check_params(p)?)),
        Some(None) => Some(None),
        None => None,
    };
    let max_tokens = match body.max_tokens {
        Some(Some(n)) => Some(Some(s.chat.check_session_max_tokens(n)?)),
        Some(None) => Some(None),
        None => None,
    };
    let patch = SessionPatch {
        title,
        system_prompt: body.system_prompt,
        params,
        max_tokens,
    };
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

/// A session's stored messages, oldest first (a reply still streaming included, with what it
/// has said so far).
#[utoipa::path(get, path = "/v1/sessions/{id}/messages", operation_id = "listMessages", tag = "sessions", params(super::SessionPath),
    responses(
        (status = 200, description = "Every message", body = MessageList),
        (status = 404, description = "No such session", body = super::ErrorBody),
    ))]
pub(super) async fn messages(
    State(s): State<AppState>,
    Caller { user, .. }: Caller,
    id: SessionId,
) -> Result<Json<MessageList>, ApiError> {
    let data: Vec<Message> = s.chat.messages(&user, &id).await?;
    Ok(Json(MessageList { data }))
}
