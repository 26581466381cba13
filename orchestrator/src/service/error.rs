//! How a chat request fails, in the service's terms: one variant per way. The service returns no
//! HTTP types; the API maps each variant to a status, a native SSE error and an OpenAI error, in
//! one exhaustive match (`api/error.rs`).

use crate::generate::{Busy, GenerationError};
use crate::invalid::Invalid;
use crate::limits::Limited;
use crate::storage::StoreError;
use crate::workers::PoolError;

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The API key is unknown, revoked or expired.
    #[error("missing or invalid API key")]
    InvalidKey,
    /// What was asked for does not exist, or is another user's (the two look the same on
    /// purpose).
    #[error("{0} not found")]
    NotFound(&'static str),
    /// The request names a model that no worker serves; `served` lists what is served, as
    /// `name` or `name@version`, comma-separated.
    #[error(
        "the model `{asked}` does not exist; this server serves {served} (GET /v1/models \
         lists them)"
    )]
    ModelNotFound { asked: String, served: String },
    /// The model is loading on a worker and none has it ready yet.
    #[error("the model `{0}` is loading; try again shortly")]
    ModelLoading(String),
    /// A load on demand did not happen. The message is the same for every caller; `detail`
    /// (the workers' own words: paths, memory figures) is logged, and shown to admin keys
    /// only.
    #[error("the model `{model}` cannot be loaded now: {}{}{}", why.text(),
        retry_after_secs.map(|s| format!("; retry in {s} s")).unwrap_or_default(),
        detail.as_ref().map(|d| format!(" ({d})")).unwrap_or_default())]
    LoadRefused {
        model: String,
        why: LoadRefusal,
        retry_after_secs: Option<u64>,
        detail: Option<String>,
    },
    /// A value out of range or of the wrong kind, and the field it is in.
    #[error("{0}")]
    Invalid(Invalid),
    /// A grammar that does not compile, and the field it is in.
    #[error("{0}")]
    InvalidGrammar(Invalid),
    /// The user keeps the most sessions the server allows.
    #[error(
        "you have {max} sessions, the most this server keeps for one user; delete some to \
         create more"
    )]
    TooManySessions { max: u64 },
    /// The session holds the most messages allowed.
    #[error(
        "this session holds {held} messages, and a session may hold at most {max}; continue \
         in a new session"
    )]
    SessionFull { held: usize, max: usize },
    /// The session's text would pass the most bytes a session may hold.
    #[error(
        "this session holds {held} bytes of text, and with this turn it would pass the {max} a \
         session may hold; continue in a new session"
    )]
    SessionTooLarge { held: usize, max: usize },
    /// An edit aimed at a message that is not a user's; the message says which.
    #[error("{0}")]
    NotAUserMessage(String),
    /// A regenerate in a session whose last message is not a reply.
    #[error("the session has no reply to regenerate")]
    NothingToRegenerate,
    /// A reply is already running in the session.
    #[error(transparent)]
    Busy(#[from] Busy),
    /// A rate or token limit is spent.
    #[error(transparent)]
    Limited(#[from] Limited),
    /// Nothing can serve the request now (no worker ready, a stop that cannot reach the replica
    /// running the reply); the message says what.
    #[error("{0}")]
    Unavailable(String),
    /// The worker pool could not take the request.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// A generation failed before a non-streamed answer was sent.
    #[error(transparent)]
    Generation(#[from] GenerationError),
    /// The store refused or failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A fault of the server's; the detail is logged, never answered.
    #[error("internal error")]
    Internal(String),
}

/// Why a load on demand did not happen, in words every caller may see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadRefusal {
    /// No worker has room, and the models that could make it are in use, pinned or used
    /// too recently to be evicted.
    NoRoom,
    /// A worker tried and failed.
    Failed,
}

impl LoadRefusal {
    pub fn text(self) -> &'static str {
        match self {
            Self::NoRoom => "no worker has room for it",
            Self::Failed => "its load failed",
        }
    }
}
