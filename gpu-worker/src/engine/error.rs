//! The engine's error type: every way a request can be refused or fail.

use hearth_shared::{RequestId, SamplingError, SessionId};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    #[error("prompt_token_ids: the prompt is empty")]
    EmptyPrompt,
    #[error("prompt_token_ids: {len} tokens do not fit the context window of {max} (one position is needed to generate)")]
    PromptTooLong { len: usize, max: usize },
    #[error("prompt_token_ids[{index}]: token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { index: usize, id: u32, vocab: usize },
    #[error("stop_token_ids: token id {id} is outside the vocabulary of {vocab}")]
    StopTokenOutOfRange { id: u32, vocab: usize },
    #[error(transparent)]
    InvalidSampling(#[from] SamplingError),
    #[error("grammar: {0}")]
    InvalidGrammar(String),
    /// The grammar engine failed on a running sequence (a grammar beyond its limits, say).
    #[error("the grammar engine failed: {0}")]
    GrammarFailed(String),
    #[error("max_new_tokens: must be at least 1")]
    InvalidMaxNewTokens,
    #[error(
        "prompt_token_ids: {need} tokens exceed the worker's whole KV budget of {capacity} tokens"
    )]
    KvBudgetTooSmall { need: usize, capacity: usize },
    #[error("the engine queue is full ({limit} waiting requests); retry later")]
    QueueFull { limit: usize },
    #[error("request {0} is already in flight")]
    DuplicateRequest(RequestId),
    #[error("session {0} has no cached state on this worker")]
    UnknownSession(SessionId),
    #[error("the engine is shutting down")]
    ShuttingDown,
    #[error("internal engine error: {0}")]
    Internal(String),
}
