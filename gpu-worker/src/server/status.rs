//! Engine errors as gRPC status codes, in one place and without a catch-all arm, so a new error
//! variant cannot be sent with a code nobody chose.

use hearth_shared::proto;
use tonic::{Code, Status};

use crate::engine::EngineError;

pub fn code(e: &EngineError) -> Code {
    match e {
        EngineError::EmptyPrompt
        | EngineError::PromptTooLong { .. }
        | EngineError::TokenOutOfRange { .. }
        | EngineError::StopTokenOutOfRange { .. }
        | EngineError::InvalidSampling(_)
        | EngineError::InvalidGrammar(_)
        | EngineError::GrammarFailed(_)
        | EngineError::InvalidMaxNewTokens
        | EngineError::KvBudgetTooSmall { .. }
        | EngineError::DuplicateRequest(_) => Code::InvalidArgument,
        EngineError::QueueFull { .. } => Code::ResourceExhausted,
        EngineError::UnknownSession(_) => Code::NotFound,
        EngineError::ShuttingDown => Code::Unavailable,
        EngineError::Internal(_) => Code::Internal,
    }
}

pub fn status(e: &EngineError) -> Status {
    Status::new(code(e), e.to_string())
}

/// The in-stream form of an error: the request's last event.
pub fn error_event(request_id: u64, code: Code, message: impl Into<String>) -> proto::WorkerEvent {
    proto::WorkerEvent {
        request_id,
        kind: Some(proto::worker_event::Kind::Error(proto::Error {
            code: code as i32,
            message: message.into(),
        })),
    }
}

#[cfg(test)]
mod tests {
    use hearth_shared::{RequestId, SamplingError, SessionId};

    use super::*;

    #[test]
    fn request_faults_are_invalid_argument_and_load_is_resource_exhausted() {
        let bad = [
            EngineError::EmptyPrompt,
            EngineError::PromptTooLong { len: 9, max: 8 },
            EngineError::TokenOutOfRange {
                index: 0,
                id: 9,
                vocab: 8,
            },
            EngineError::StopTokenOutOfRange { id: 9, vocab: 8 },
            EngineError::InvalidSampling(SamplingError {
                field: "top_p",
                reason: "x".into(),
            }),
            EngineError::InvalidMaxNewTokens,
            EngineError::KvBudgetTooSmall {
                need: 9,
                capacity: 8,
            },
            EngineError::DuplicateRequest(RequestId(1)),
        ];
        for e in &bad {
            assert_eq!(code(e), Code::InvalidArgument, "{e}");
        }
        assert_eq!(
            code(&EngineError::QueueFull { limit: 1 }),
            Code::ResourceExhausted
        );
        assert_eq!(
            code(&EngineError::UnknownSession(SessionId::new("s"))),
            Code::NotFound
        );
        assert_eq!(code(&EngineError::ShuttingDown), Code::Unavailable);
        let s = status(&EngineError::InvalidMaxNewTokens);
        assert!(s.message().contains("max_new_tokens"), "{s:?}");
    }
}
