//! Why a generation ended.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token (EOS, `<end_of_turn>`, or one the request named) was produced.
    Stop,
    /// `max_new_tokens` was reached.
    Length,
    /// The context window is full.
    ContextFull,
    /// The caller cancelled.
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::ContextFull => "context_full",
            Self::Cancelled => "cancelled",
        }
    }
}
