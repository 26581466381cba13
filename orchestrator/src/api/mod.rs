//! The HTTP API. [`router`] is separate from any socket so tests can drive it directly.
//!
//! Built so far: authentication, the session routes (create, list/search, get, rename, delete,
//! list messages), `/healthz` and `/readyz`. Generation (posting a message, stop, regenerate,
//! the OpenAI-compatible routes) needs the worker pool and is not built yet.

mod error;
mod sessions;

pub use error::ApiError;

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use axum::routing::get;
use axum::Router;

use crate::auth::{authenticate, AuthError};
use crate::storage::{Store, User};

/// Largest request body accepted (a chat message with a long paste fits; a file does not).
pub const MAX_BODY_BYTES: usize = 1 << 20;

#[derive(Clone, Debug)]
pub struct AppState {
    pub store: Arc<dyn Store>,
    pub auth: AuthMode,
}

/// Whether requests must carry an API key.
#[derive(Clone, Debug)]
pub enum AuthMode {
    Keys,
    /// The embedded default: no keys, every request acts as this one local user. Only allowed
    /// on a loopback address (checked where the server binds).
    Disabled(User),
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .merge(sessions::routes())
        .fallback(|| async { ApiError::NotFound("route") })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

async fn ready(State(s): State<AppState>) -> Result<&'static str, ApiError> {
    s.store.ping().await?;
    Ok("ready")
}

/// The authenticated user of a request.
#[derive(Debug, Clone)]
pub struct Caller(pub User);

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        match &state.auth {
            AuthMode::Disabled(user) => Ok(Caller(user.clone())),
            AuthMode::Keys => {
                let token = parts
                    .headers
                    .get(header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("Bearer "))
                    .ok_or(ApiError::Unauthorized)?;
                match authenticate(state.store.as_ref(), token.trim()).await {
                    Ok(c) => Ok(Caller(c.user)),
                    Err(AuthError::InvalidKey) => Err(ApiError::Unauthorized),
                    Err(AuthError::Store(e)) => Err(e.into()),
                }
            }
        }
    }
}

/// `Json<T>` whose rejections are [`ApiError`]s (so every error has the same body).
#[derive(Debug)]
pub struct ValidJson<T>(pub T);

impl<S, T> FromRequest<S> for ValidJson<T>
where
    axum::Json<T>: FromRequest<S, Rejection = axum::extract::rejection::JsonRejection>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let axum::Json(v) = axum::Json::<T>::from_request(req, state).await?;
        Ok(Self(v))
    }
}

/// `Query<T>` with [`ApiError`] rejections.
#[derive(Debug)]
pub struct ValidQuery<T>(pub T);

impl<S, T> FromRequestParts<S> for ValidQuery<T>
where
    axum::extract::Query<T>:
        FromRequestParts<S, Rejection = axum::extract::rejection::QueryRejection>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let axum::extract::Query(v) =
            axum::extract::Query::<T>::from_request_parts(parts, state).await?;
        Ok(Self(v))
    }
}

/// `Path<T>` with [`ApiError`] rejections: a path segment that is not even valid text names
/// nothing, so it is a 404 like any other unknown id.
#[derive(Debug)]
pub struct ValidPath<T>(pub T);

impl<S, T> FromRequestParts<S> for ValidPath<T>
where
    axum::extract::Path<T>:
        FromRequestParts<S, Rejection = axum::extract::rejection::PathRejection>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let axum::extract::Path(v) = axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map_err(|_| ApiError::NotFound("resource"))?;
        Ok(Self(v))
    }
}

/// `201 Created` with a JSON body.
pub fn created<T: serde::Serialize>(v: T) -> (StatusCode, axum::Json<T>) {
    (StatusCode::CREATED, axum::Json(v))
}
