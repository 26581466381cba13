//! How a generation ended, and every answer derived from it: the stored status and finish
//! reason, the native SSE `error` event's `error_type` and the OpenAI `finish_reason`. Each is
//! one exhaustive match here, so a new reason or error cannot fall silently into another's
//! answer; the HTTP error of a non-streamed reply is the API's (`api/error.rs`), from the same
//! table test.

use hearth_shared::FinishReason;

use crate::storage::{Finish, MessageStatus};

/// OpenAI's `finish_reason`: `stop` (end of turn, a stop string, or a cancel), `length`, or
/// `tool_calls` (a reply that is nothing but calls of the request's tools).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OpenAiFinish {
    Stop,
    Length,
    ToolCalls,
}

impl OpenAiFinish {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::ToolCalls => "tool_calls",
        }
    }
}

/// The end of a generation: finished for a reason, or failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    Finished(FinishReason),
    Failed(GenerationError),
}

impl End {
    /// The reply's stored status.
    pub fn status(&self) -> MessageStatus {
        match self {
            Self::Finished(FinishReason::Cancelled) => MessageStatus::Stopped,
            Self::Finished(
                FinishReason::Stop | FinishReason::Length | FinishReason::ContextFull,
            ) => MessageStatus::Complete,
            Self::Failed(_) => MessageStatus::Error,
        }
    }

    /// The stored and native `finish_reason`: `stop`, `length`, `context_full`, `cancelled` or
    /// `error`.
    pub fn finish_reason(&self) -> Finish {
        match self {
            Self::Finished(FinishReason::Stop) => Finish::Stop,
            Self::Finished(FinishReason::Length) => Finish::Length,
            Self::Finished(FinishReason::ContextFull) => Finish::ContextFull,
            Self::Finished(FinishReason::Cancelled) => Finish::Cancelled,
            Self::Failed(_) => Finish::Error,
        }
    }

    /// OpenAI's `finish_reason`, for a reply that finished: it has no word for a full context
    /// (the reply was cut by length) or for a cancel (only a client that went away cancels
    /// there, so no one reads it). A failed reply gets an error instead.
    pub fn openai_finish_reason(&self) -> Result<OpenAiFinish, &GenerationError> {
        match self {
            Self::Finished(FinishReason::Stop | FinishReason::Cancelled) => Ok(OpenAiFinish::Stop),
            Self::Finished(FinishReason::Length | FinishReason::ContextFull) => {
                Ok(OpenAiFinish::Length)
            }
            Self::Failed(e) => Err(e),
        }
    }

    pub fn error(&self) -> Option<&GenerationError> {
        match self {
            Self::Finished(_) => None,
            Self::Failed(e) => Some(e),
        }
    }
}

/// Why a generation failed; the message is for the client and names no internals.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GenerationError {
    /// No worker could take the request: none ready, all full, or every one it tried failed.
    #[error("{0}")]
    Unavailable(String),
    /// A worker refused the request as invalid; any other would too.
    #[error("{0}")]
    Refused(String),
    /// A worker could not run the request, or answered in a way Hearth does not know. Not
    /// retried elsewhere: a request that breaks one worker must not be handed to every other.
    #[error("{0}")]
    Internal(String),
}

impl GenerationError {
    /// Every [`GenerationError::kind`]: the values of the generation-errors metric's `type`,
    /// which telemetry starts at zero (it sits below this module, so the list is kept there).
    pub const KINDS: [&'static str; 3] = crate::telemetry::GENERATION_ERROR_KINDS;

    /// The stable `error_type` of the SSE `error` event and the stored error.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Unavailable(_) => "service_unavailable",
            Self::Refused(_) => "invalid_request_error",
            Self::Internal(_) => "internal_error",
        }
    }
}
