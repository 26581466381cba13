//! The API's one error type, mapped to an HTTP status in one place. Bodies are
//! `{"error": {"message", "type", "code", "param"}}` (OpenAI's shape: `code` one of
//! [`ErrorCode`], `param` the request field at fault or `null`); internal details are logged,
//! never returned.

use crate::invalid::Invalid;
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::generate::GenerationError;
use crate::service::{ChatError, LoadRefusal};
use crate::storage::StoreError;

/// Every error's body (OpenAI's shape).
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// For people: names the problem (and the field, for a bad value).
    pub message: String,
    /// Stable, for programs: `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `rate_limit_error`, …
    #[serde(rename = "type")]
    pub kind: String,
    /// Stable, for programs: what went wrong.
    pub code: ErrorCode,
    /// The request field at fault (`temperature`, `messages[2].content`), or `null` when the
    /// problem is not one field's.
    pub param: Option<String>,
}

/// What went wrong, for programs: the error body's `code`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// A value out of range or of the wrong kind (`param` names it).
    InvalidValue,
    /// Not JSON, or not the JSON the route takes.
    InvalidJson,
    /// A grammar, JSON Schema or tool schema that does not compile.
    InvalidGrammar,
    UnsupportedMediaType,
    /// An edit aimed at a message that is not a user message.
    NotAUserMessage,
    /// The caller keeps the most sessions the server allows.
    TooManySessions,
    /// The session holds the most messages or bytes it may.
    SessionFull,
    InvalidApiKey,
    Forbidden,
    NotFound,
    ModelNotFound,
    /// An admin load that no worker has the memory for.
    InsufficientMemory,
    MethodNotAllowed,
    Conflict,
    BodyTooLarge,
    BodyTimeout,
    RateLimitExceeded,
    Unavailable,
    /// The model is loading: retry after `Retry-After`.
    ModelLoading,
    /// No worker has room for the model now.
    ModelNoRoom,
    /// A worker tried to load the model and failed.
    ModelLoadFailed,
    Internal,
}

impl ErrorCode {
    /// The code as the body spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidValue => "invalid_value",
            Self::InvalidJson => "invalid_json",
            Self::InvalidGrammar => "invalid_grammar",
            Self::UnsupportedMediaType => "unsupported_media_type",
            Self::NotAUserMessage => "not_a_user_message",
            Self::TooManySessions => "too_many_sessions",
            Self::SessionFull => "session_full",
            Self::InvalidApiKey => "invalid_api_key",
            Self::Forbidden => "forbidden",
            Self::NotFound => "not_found",
            Self::ModelNotFound => "model_not_found",
            Self::InsufficientMemory => "insufficient_memory",
            Self::MethodNotAllowed => "method_not_allowed",
            Self::Conflict => "conflict",
            Self::BodyTooLarge => "body_too_large",
            Self::BodyTimeout => "body_timeout",
            Self::RateLimitExceeded => "rate_limit_exceeded",
            Self::Unavailable => "unavailable",
            Self::ModelLoading => "model_loading",
            Self::ModelNoRoom => "model_no_room",
            Self::ModelLoadFailed => "model_load_failed",
            Self::Internal => "internal",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Well-formed JSON with a value out of range or of the wrong kind, and the field it is in.
    #[error("{0}")]
    Validation(Invalid),
    /// Well-formed, but asks for something the target cannot do; `kind` names the problem
    /// (it is the body's `type` and `code`).
    #[error("{message}")]
    Unprocessable { kind: ErrorCode, message: String },
    /// Not JSON, or not the JSON the route takes.
    #[error("{0}")]
    BadRequest(String),
    /// A grammar (a JSON Schema, a Lark grammar, a regular expression) that does not compile,
    /// and the field it is in; a 400, as OpenAI answers an invalid schema.
    #[error("{0}")]
    InvalidGrammar(Invalid),
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("missing or invalid API key")]
    Unauthorized,
    /// The request may not be served from where it came.
    #[error("{0}")]
    Forbidden(String),
    /// Missing, or another user's (the two are indistinguishable on purpose).
    #[error("{0} not found")]
    NotFound(&'static str),
    /// A model no worker serves (OpenAI's `model_not_found`).
    #[error("{0}")]
    ModelNotFound(String),
    #[error("method not allowed on this route")]
    MethodNotAllowed,
    #[error("{0}")]
    Conflict(String),
    #[error("request body too large")]
    PayloadTooLarge,
    /// The body did not arrive within this many seconds of the header.
    #[error("the request body did not arrive within {0} s")]
    BodyTimeout(u64),
    #[error("{0}")]
    RateLimited(crate::limits::Limited),
    #[error("the service is unavailable: {0}")]
    Unavailable(String),
    /// A model that is only loading yet: 503 with `Retry-After`.
    #[error("{0}")]
    Loading(String),
    /// A model that could not be loaded on demand: 503, with `Retry-After` when waiting helps.
    #[error("{message}")]
    LoadRefused {
        code: ErrorCode,
        message: String,
        retry_after_secs: Option<u64>,
    },
    #[error("internal error")]
    Internal(String),
}

impl ApiError {
    /// The error's JSON body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                message: self.to_string(),
                kind: self.error_type().to_string(),
                code: self.code(),
                param: self.param().map(str::to_string),
            },
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::Validation(_) => StatusCode::UNPROCESSABLE_ENTITY,
            Self::Unprocessable { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            Self::BadRequest(_) | Self::InvalidGrammar(_) => StatusCode::BAD_REQUEST,
            Self::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::Forbidden(_) => StatusCode::FORBIDDEN,
            Self::NotFound(_) | Self::ModelNotFound(_) => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::Conflict(_) => StatusCode::CONFLICT,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::RateLimited(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::Unavailable(_) | Self::Loading(_) | Self::LoadRefused { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Stable, machine-readable.
    pub fn error_type(&self) -> &'static str {
        match self {
            Self::Validation(_) => "invalid_request_error",
            Self::Unprocessable { kind, .. } => kind.as_str(),
            Self::BadRequest(_) | Self::InvalidGrammar(_) => "invalid_request_error",
            Self::UnsupportedMediaType(_) => "invalid_request_error",
            Self::Unauthorized => "authentication_error",
            Self::Forbidden(_) => "permission_error",
            Self::NotFound(_) => "not_found_error",
            Self::ModelNotFound(_) => "invalid_request_error",
            Self::MethodNotAllowed => "invalid_request_error",
            Self::Conflict(_) => "conflict_error",
            Self::PayloadTooLarge => "request_too_large",
            Self::BodyTimeout(_) => "request_timeout",
            Self::RateLimited(_) => "rate_limit_error",
            Self::Unavailable(_) | Self::Loading(_) | Self::LoadRefused { .. } => {
                "service_unavailable"
            }
            Self::Internal(_) => "internal_error",
        }
    }

    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Validation(_) => ErrorCode::InvalidValue,
            Self::Unprocessable { kind, .. } => *kind,
            Self::BadRequest(_) => ErrorCode::InvalidJson,
            Self::InvalidGrammar(_) => ErrorCode::InvalidGrammar,
            Self::UnsupportedMediaType(_) => ErrorCode::UnsupportedMediaType,
            Self::Unauthorized => ErrorCode::InvalidApiKey,
            Self::Forbidden(_) => ErrorCode::Forbidden,
            Self::NotFound(_) => ErrorCode::NotFound,
            Self::ModelNotFound(_) => ErrorCode::ModelNotFound,
            Self::MethodNotAllowed => ErrorCode::MethodNotAllowed,
            Self::Conflict(_) => ErrorCode::Conflict,
            Self::PayloadTooLarge => ErrorCode::BodyTooLarge,
            Self::BodyTimeout(_) => ErrorCode::BodyTimeout,
            Self::RateLimited(_) => ErrorCode::RateLimitExceeded,
            Self::Unavailable(_) => ErrorCode::Unavailable,
            Self::Loading(_) => ErrorCode::ModelLoading,
            Self::LoadRefused { code, .. } => *code,
            Self::Internal(_) => ErrorCode::Internal,
        }
    }

    /// The request field at fault, where the error is one field's.
    pub fn param(&self) -> Option<&str> {
        match self {
            Self::Validation(i) | Self::InvalidGrammar(i) => i.param.as_deref(),
            _ => None,
        }
    }
}

impl ApiError {
    /// The same error with the field it names renamed by `rename`: for an API whose request
    /// names the field otherwise than the check does.
    pub fn with_param(self, rename: impl Fn(&str) -> String) -> Self {
        let renamed = |i: Invalid| match i.param {
            Some(p) => Invalid::field(rename(&p), i.why),
            None => i,
        };
        match self {
            Self::Validation(i) => Self::Validation(renamed(i)),
            Self::InvalidGrammar(i) => Self::InvalidGrammar(renamed(i)),
            other => other,
        }
    }

    /// An edit aimed at a message that is not a user message.
    pub fn not_a_user_message(message: String) -> Self {
        Self::Unprocessable {
            kind: ErrorCode::NotAUserMessage,
            message,
        }
    }
}

/// When a request for a model that is loading may try again.
const LOADING_RETRY_AFTER_SECS: u64 = 2;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        crate::telemetry::count_error(self.error_type());
        if let Self::Internal(detail) = &self {
            tracing::error!(%detail, "internal error");
        }
        let mut response = (status, axum::Json(self.body())).into_response();
        let retry_after = match &self {
            Self::RateLimited(l) => Some(l.retry_after_secs),
            Self::Loading(_) => Some(LOADING_RETRY_AFTER_SECS),
            Self::LoadRefused {
                retry_after_secs, ..
            } => *retry_after_secs,
            _ => None,
        };
        if let Some(secs) = retry_after {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(secs),
            );
        }
        response
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound(what) => Self::NotFound(what),
            StoreError::Conflict(what) => Self::Conflict(format!("{what} already exists")),
            StoreError::Unavailable(why) => {
                tracing::warn!(%why, "database unavailable");
                Self::Unavailable("the database cannot be reached".into())
            }
            StoreError::Invalid(why) => Self::BadRequest(why),
            StoreError::NotAUserMessage(why) => Self::not_a_user_message(why),
            // The same answer as a reply running on this replica.
            StoreError::ReplyRunning => crate::generate::Busy.into(),
            StoreError::Internal(why) => Self::Internal(why),
        }
    }
}

/// A body whose JSON is not the route's: the field serde stopped at (axum reads bodies through
/// `serde_path_to_error`), when it is one, as the `param`.
fn json_data_error(e: &axum::extract::rejection::JsonDataError) -> Invalid {
    type AtPath = serde_path_to_error::Error<serde_json::Error>;
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(at) = err.downcast_ref::<AtPath>() {
            let path = at.path().to_string();
            return match path.as_str() {
                "." | "" => Invalid::request(at.inner().to_string()),
                _ => Invalid::field(path, at.inner().to_string()),
            };
        }
        source = err.source();
    }
    Invalid::request(e.body_text())
}

impl From<crate::tools::ToolError> for ApiError {
    fn from(e: crate::tools::ToolError) -> Self {
        match e {
            crate::tools::ToolError::Invalid(m) => Self::Validation(m),
            crate::tools::ToolError::InvalidGrammar(m) => Self::InvalidGrammar(m),
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        match r {
            JsonRejection::JsonDataError(e) => Self::Validation(json_data_error(&e)),
            JsonRejection::JsonSyntaxError(e) => Self::BadRequest(e.body_text()),
            JsonRejection::MissingJsonContentType(e) => Self::UnsupportedMediaType(e.body_text()),
            JsonRejection::BytesRejection(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Self::PayloadTooLarge
            }
            other => Self::BadRequest(other.body_text()),
        }
    }
}

impl From<QueryRejection> for ApiError {
    fn from(r: QueryRejection) -> Self {
        Self::Validation(Invalid::request(r.body_text()))
    }
}

impl From<crate::limits::Limited> for ApiError {
    fn from(l: crate::limits::Limited) -> Self {
        Self::RateLimited(l)
    }
}

impl From<crate::workers::PoolError> for ApiError {
    fn from(e: crate::workers::PoolError) -> Self {
        Self::Unavailable(e.to_string())
    }
}

impl From<crate::generate::Busy> for ApiError {
    fn from(e: crate::generate::Busy) -> Self {
        Self::Conflict(e.to_string())
    }
}

/// The chat service's failures, each to its HTTP answer (one match, every variant).
impl From<ChatError> for ApiError {
    fn from(e: ChatError) -> Self {
        match e {
            ChatError::InvalidKey => Self::Unauthorized,
            ChatError::NotFound(what) => Self::NotFound(what),
            ChatError::ModelNotFound { .. } => Self::ModelNotFound(e.to_string()),
            ChatError::Invalid(m) => Self::Validation(m),
            ChatError::InvalidGrammar(m) => Self::InvalidGrammar(m),
            ChatError::TooManySessions { .. } => Self::Unprocessable {
                kind: ErrorCode::TooManySessions,
                message: e.to_string(),
            },
            ChatError::SessionFull { .. } | ChatError::SessionTooLarge { .. } => {
                Self::Unprocessable {
                    kind: ErrorCode::SessionFull,
                    message: e.to_string(),
                }
            }
            ChatError::NotAUserMessage(m) => Self::not_a_user_message(m),
            ChatError::NothingToRegenerate => Self::Conflict(e.to_string()),
            ChatError::Busy(b) => b.into(),
            ChatError::Limited(l) => l.into(),
            ChatError::Unavailable(m) => Self::Unavailable(m),
            ChatError::ModelLoading(_) => Self::Loading(e.to_string()),
            ChatError::LoadRefused {
                why,
                retry_after_secs,
                ..
            } => Self::LoadRefused {
                code: match why {
                    LoadRefusal::NoRoom => ErrorCode::ModelNoRoom,
                    LoadRefusal::Failed => ErrorCode::ModelLoadFailed,
                },
                message: e.to_string(),
                retry_after_secs,
            },
            ChatError::Pool(p) => p.into(),
            ChatError::Generation(g) => g.into(),
            ChatError::Store(s) => s.into(),
            ChatError::Internal(m) => Self::Internal(m),
        }
    }
}

/// A generation that failed before a non-streamed answer was sent.
impl From<GenerationError> for ApiError {
    fn from(e: GenerationError) -> Self {
        match e {
            GenerationError::Refused(m) => Self::Validation(Invalid::request(m)),
            // The worker's detail was logged where it happened; the message names none.
            GenerationError::Unavailable(m) | GenerationError::Internal(m) => Self::Unavailable(m),
        }
    }
}

#[cfg(test)]
mod tests {
    use hearth_shared::FinishReason;

    use super::*;
    use crate::generate::{End, OpenAiFinish};
    use crate::storage::MessageStatus;

    #[test]
    fn every_end_has_one_status_finish_reason_error_type_openai_answer_and_http_status() {
        use FinishReason::*;
        use GenerationError::*;
        use MessageStatus::*;
        let ok = |r: &'static str| Ok::<_, StatusCode>(r);
        let cases = [
            (End::Finished(Stop), Complete, "stop", None, ok("stop")),
            (
                End::Finished(Length),
                Complete,
                "length",
                None,
                ok("length"),
            ),
            (
                End::Finished(ContextFull),
                Complete,
                "context_full",
                None,
                ok("length"),
            ),
            (
                End::Finished(Cancelled),
                Stopped,
                "cancelled",
                None,
                ok("stop"),
            ),
            (
                End::Failed(Unavailable("no worker".into())),
                Error,
                "error",
                Some("service_unavailable"),
                Err(StatusCode::SERVICE_UNAVAILABLE),
            ),
            (
                End::Failed(Refused("bad".into())),
                Error,
                "error",
                Some("invalid_request_error"),
                Err(StatusCode::UNPROCESSABLE_ENTITY),
            ),
            (
                End::Failed(Internal("broke".into())),
                Error,
                "error",
                Some("internal_error"),
                Err(StatusCode::SERVICE_UNAVAILABLE),
            ),
        ];
        for (end, status, reason, kind, openai) in cases {
            assert_eq!(end.status(), status, "{end:?}");
            assert_eq!(end.finish_reason().as_str(), reason, "{end:?}");
            assert_eq!(end.error().map(GenerationError::kind), kind, "{end:?}");
            assert_eq!(openai_answer(&end), openai, "{end:?}");
        }
    }

    /// OpenAI's finish reason for `end`, or the HTTP status of a non-streamed answer that failed
    /// (each failure's kind one of the known ones).
    fn openai_answer(end: &End) -> Result<&'static str, StatusCode> {
        let answer = end.openai_finish_reason().map(OpenAiFinish::as_str);
        answer.map_err(|e| {
            assert!(GenerationError::KINDS.contains(&e.kind()), "{e:?}");
            ApiError::from(e.clone()).status()
        })
    }
}
