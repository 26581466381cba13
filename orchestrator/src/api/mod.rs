//! The HTTP API. [`router`] is separate from any socket so tests can drive it directly.
//!
//! - [`sessions`]: the caller's sessions and stored messages;
//! - [`chat`]: generation on the native API (post, regenerate, stop, resume; SSE or JSON);
//! - [`openai`]: `/v1/chat/completions` and `/v1/models`; [`completions`]: `/v1/completions`;
//! - [`anthropic`]: Anthropic's `/v1/messages` and `/v1/messages/count_tokens`;
//! - [`admin`]: the workers' models, loaded and unloaded (admin keys only);
//! - operations: `/healthz`, `/readyz` (database and at least one worker), `/metrics`;
//! - [`openapi`]: the API's OpenAPI 3.1 document at `/openapi.json`;
//! - [`web`]: the web UI's static files at `/` (every path the API does not claim).

mod admin;
mod anthropic;
mod error;
mod ids;
pub mod loading;
mod native;
mod openai;
mod openapi;
mod sessions;
mod web;
pub mod ws;

pub use crate::ids::{MessageId, SessionId};
pub use error::{ApiError, ErrorBody, ErrorCode};
pub use openapi::json as openapi_json;

use crate::invalid::Invalid;
use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;

use crate::service::{Caller, ChatService};
use crate::storage::User;

/// Where `make run` builds the web UI, relative to the working directory.
pub const DEFAULT_WEB_DIR: &str = "web/out";

/// Largest request body accepted (a chat message with a long paste fits; a file does not).
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// Bytes of request bodies read or held at once, across every connection: 64 bodies of the
/// largest size. A request that would go over waits for no one: it is answered 503 at once.
pub const MAX_BODY_BYTES_IN_FLIGHT: usize = 64 << 20;

/// What the handlers share: the chat service (the only way to the store, the workers and the
/// limits), how callers are identified, and the HTTP layer's own settings.
#[derive(Clone, Debug)]
pub struct AppState {
    pub chat: Arc<ChatService>,
    pub auth: AuthMode,
    pub options: ApiOptions,
    pub metrics: Option<PrometheusHandle>,
    /// Permits for [`MAX_BODY_BYTES_IN_FLIGHT`], one a byte.
    pub body_bytes: Arc<tokio::sync::Semaphore>,
    /// The open WebSockets, in all and per key.
    pub sockets: Arc<ws::Sockets>,
}

/// Settings of the HTTP layer.
#[derive(Clone, Debug)]
pub struct ApiOptions {
    /// Whether `/metrics` is served beside the API (no `--metrics-listen`).
    pub metrics_on_api: bool,
    /// On the native API, stop a reply when its client disconnects (default: finish and store).
    pub cancel_on_disconnect: bool,
    /// The statically exported web UI served at `/`.
    pub web_dir: PathBuf,
    /// Time a request's body may take to arrive, from the end of its header.
    pub body_timeout: std::time::Duration,
    /// WebSockets one key may hold open at once.
    pub max_sockets_per_key: usize,
    /// Time a WebSocket's message may take to be written before its reader counts as gone.
    pub socket_write_timeout: std::time::Duration,
    /// Time a WebSocket's client may send nothing before the socket is closed.
    pub socket_idle: std::time::Duration,
}

impl Default for ApiOptions {
    fn default() -> Self {
        Self {
            metrics_on_api: true,
            cancel_on_disconnect: false,
            web_dir: PathBuf::from(DEFAULT_WEB_DIR),
            body_timeout: std::time::Duration::from_secs(30),
            max_sockets_per_key: 32,
            socket_write_timeout: std::time::Duration::from_secs(30),
            socket_idle: std::time::Duration::from_secs(60),
        }
    }
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
    let open = matches!(state.auth, AuthMode::Disabled(_));
    let router = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready));
    let router = if state.options.metrics_on_api {
        router.route("/metrics", get(render_metrics))
    } else {
        router
    };
    let router = router
        .route("/openapi.json", get(openapi::serve))
        .merge(sessions::routes())
        .merge(admin::routes())
        .route("/v1/chat/completions", post(openai::chat::completions))
        .route("/v1/completions", post(openai::completions::completions))
        .route("/v1/responses", post(openai::responses::create))
        .route(
            "/v1/responses/{id}",
            get(openai::responses::kept::get).delete(openai::responses::kept::delete),
        )
        .route(
            "/v1/responses/{id}/input_items",
            get(openai::responses::kept::input_items),
        )
        .route(
            "/v1/responses/{id}/cancel",
            post(openai::responses::kept::cancel),
        )
        .route("/v1/models", get(openai::models::models))
        .route("/v1/models/{id}", get(openai::models::model))
        .route("/tokenize", post(openai::tokenize::tokenize))
        .route("/detokenize", post(openai::tokenize::detokenize))
        .merge(anthropic::routes())
        .fallback(web::fallback)
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            read_body_within,
        ));
    // Without keys, anything that can reach the port is the user: refuse requests that a web
    // page on another site made through a name that resolves to this machine (DNS rebinding).
    let router = if open {
        router.layer(axum::middleware::from_fn(loopback_names_only))
    } else {
        router
    };
    router
        .layer(axum::middleware::from_fn(anthropic::errors_in_its_shape))
        .layer(axum::middleware::from_fn(crate::telemetry::count_requests))
        .layer(axum::middleware::from_fn(crate::telemetry::trace_request))
        .with_state(state)
}

/// Reads a request's whole body within `--body-timeout-secs` of its header, or answers 408
/// (and one over [`MAX_BODY_BYTES`] 413) before any handler runs. The accept loop bounds the
/// header's arrival; without this a client could send a header and then its body a byte at a
/// time, or never, and hold a connection and a task for as long as it liked. Bodies here are
/// small JSON documents, so buffering them first costs nothing a handler would not pay.
///
/// Nothing of a body is read before its sender is known: with keys, a request that has a body
/// must carry a valid key first (401 otherwise, the body unread), and the caller found is handed
/// to the handler. And no more than [`MAX_BODY_BYTES_IN_FLIGHT`] of bodies are held at once.
async fn read_body_within(
    State(s): State<AppState>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    let (mut parts, body) = req.into_parts();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let has_body = declared.map_or(parts.headers.contains_key(header::TRANSFER_ENCODING), |n| {
        n > 0
    });
    if !has_body {
        return next.run(Request::from_parts(parts, body)).await;
    }
    if matches!(s.auth, AuthMode::Keys) {
        match caller_of(&parts, &s).await {
            Ok(caller) => {
                parts.extensions.insert(caller);
            }
            Err(e) => return e.into_response(),
        }
    }
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return ApiError::PayloadTooLarge.into_response();
    }
    let reserve = declared.map_or(MAX_BODY_BYTES, |n| n as usize) as u32;
    let Ok(_held) = s.body_bytes.clone().try_acquire_many_owned(reserve) else {
        return ApiError::Unavailable(
            "too many request bodies are being received at once; try again shortly".into(),
        )
        .into_response();
    };
    let deadline = s.options.body_timeout;
    match tokio::time::timeout(deadline, axum::body::to_bytes(body, MAX_BODY_BYTES)).await {
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, axum::body::Body::from(bytes)))
                .await
        }
        Ok(Err(e)) => {
            let e = e.into_inner();
            if e.is::<http_body_util::LengthLimitError>() {
                ApiError::PayloadTooLarge.into_response()
            } else {
                ApiError::BadRequest(format!("the request body could not be read: {e}"))
                    .into_response()
            }
        }
        Err(_) => ApiError::BodyTimeout(deadline.as_secs()).into_response(),
    }
}

/// Whether `host` (a `Host` header or an origin's authority, port allowed) names this machine:
/// `localhost` (or a name under `.localhost`), 127.0.0.0/8 or `[::1]`.
fn is_loopback_name(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(v6) => match v6.split_once(']') {
            Some((addr, rest)) if rest.is_empty() || rest.starts_with(':') => addr,
            _ => return false,
        },
        None => host.rsplit_once(':').map_or(host, |(name, port)| {
            if port.chars().all(|c| c.is_ascii_digit()) {
                name
            } else {
                host
            }
        }),
    };
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    if name == "localhost" || name.ends_with(".localhost") {
        return true;
    }
    name.parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback())
}

/// With `--auth none`: the `Host` must be a loopback name, and an `Origin`, when a browser
/// sends one, a loopback origin; otherwise 403 and nothing is read or changed.
async fn loopback_names_only(req: Request, next: axum::middleware::Next) -> Response {
    match foreign_site(&req) {
        Some(refusal) => refusal.into_response(),
        None => next.run(req).await,
    }
}

/// Why a request without a key may not be served here, if it may not.
fn foreign_site(req: &Request) -> Option<ApiError> {
    let header_str = |name| req.headers().get(name).and_then(|v| v.to_str().ok());
    let host = header_str(header::HOST).or_else(|| req.uri().authority().map(|a| a.as_str()));
    if !host.is_some_and(is_loopback_name) {
        return Some(ApiError::Forbidden(
            "this server runs without API keys and answers only to localhost; the Host header \
             names another site (start it with --auth keys to serve other names)"
                .into(),
        ));
    }
    let origin = header_str(header::ORIGIN)?;
    let authority = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    if origin != "null" && !authority.is_some_and(is_loopback_name) {
        return Some(ApiError::Forbidden(format!(
            "this server runs without API keys and does not answer requests from pages of \
             {origin}"
        )));
    }
    None
}

async fn ready(State(s): State<AppState>) -> Result<Response, ApiError> {
    let r = s.chat.readiness().await?;
    let body = serde_json::json!({
        "ready": r.ready_workers > 0,
        "workers": r.workers,
        "resume": r.resume,
    });
    if r.ready_workers == 0 {
        return Ok((StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response());
    }
    Ok(axum::Json(body).into_response())
}

async fn render_metrics(State(s): State<AppState>) -> Response {
    metrics_text(s.metrics.as_ref())
}

/// `/metrics` alone (and `/healthz`), for `--metrics-listen`: a port Prometheus reaches and
/// clients of the API do not.
pub fn metrics_router(metrics: Option<PrometheusHandle>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                async move { metrics_text(metrics.as_ref()) }
            }),
        )
}

fn metrics_text(metrics: Option<&PrometheusHandle>) -> Response {
    let text = crate::telemetry::render(metrics);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// The `{id}` of the session routes.
#[derive(Debug, utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)] // documents the path; handlers take it as a `SessionId`
struct SessionPath {
    /// A session id, as `POST /v1/sessions` returned it.
    #[param(pattern = "^[0-9a-f]{32}$")]
    id: String,
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    /// The caller the body guard already found (a request with a body), else from the headers.
    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        if let Some(c) = parts.extensions.get::<Caller>() {
            return Ok(c.clone());
        }
        caller_of(parts, state).await
    }
}

/// The request's caller: the local user without keys, else the owner of its API key.
async fn caller_of(parts: &Parts, state: &AppState) -> Result<Caller, ApiError> {
    caller_with(state, api_key(&parts.headers)).await
}

/// The key a request carries, if it carries one: in an `Authorization: Bearer …` header, or
/// in `x-api-key` (Anthropic's clients send it there).
fn api_key(headers: &axum::http::HeaderMap) -> Option<&str> {
    let header_str = |name| {
        headers
            .get(name)
            .and_then(|v: &header::HeaderValue| v.to_str().ok())
    };
    header_str(header::AUTHORIZATION)
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| header_str(header::HeaderName::from_static("x-api-key")))
}

/// The caller of a request that carries `key` (if any): the local user without keys, else the
/// key's owner.
async fn caller_with(state: &AppState, key: Option<&str>) -> Result<Caller, ApiError> {
    match &state.auth {
        AuthMode::Disabled(user) => Ok(state.chat.local_caller(user)),
        AuthMode::Keys => {
            let key = key.ok_or(ApiError::Unauthorized)?;
            Ok(state.chat.key_caller(key.trim()).await?)
        }
    }
}

/// `Json<T>` whose rejections are [`ApiError`]s (so every error has the same body).
#[derive(Debug)]
pub struct ValidJson<T>(pub T);

impl<S, T> FromRequest<S> for ValidJson<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    /// Bodies are JSON objects. serde would also build a struct from an array (fields in
    /// order), which no client means and which would slip past `deny_unknown_fields`.
    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let axum::Json(v) = axum::Json::<serde_json::Value>::from_request(req, state).await?;
        if !v.is_object() {
            return Err(ApiError::Validation(Invalid::request(
                "the request body must be a JSON object",
            )));
        }
        // Through `serde_path_to_error`: a wrong value's error names its field (the `param`).
        serde_path_to_error::deserialize(v).map(Self).map_err(|e| {
            let (path, why) = (e.path().to_string(), e.inner().to_string());
            ApiError::Validation(match path.as_str() {
                "." => Invalid::request(format!("invalid request body: {why}")),
                _ => Invalid::field(path, why),
            })
        })
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

/// `201 Created` with a JSON body.
pub fn created<T: serde::Serialize>(v: T) -> (StatusCode, axum::Json<T>) {
    (StatusCode::CREATED, axum::Json(v))
}

#[cfg(test)]
mod tests {
    use super::is_loopback_name;

    #[test]
    fn loopback_names_are_told_from_other_sites() {
        for ok in [
            "localhost",
            "localhost:8080",
            "LOCALHOST.",
            "app.localhost:3000",
            "127.0.0.1",
            "127.0.0.1:8080",
            "127.1.2.3:9",
            "[::1]",
            "[::1]:8080",
        ] {
            assert!(is_loopback_name(ok), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:8080",
            "localhost.evil.example",
            "127.0.0.1.nip.io",
            "10.0.0.1:8080",
            "[::2]:80",
            "[::1",
            "",
        ] {
            assert!(!is_loopback_name(bad), "{bad}");
        }
    }
}
