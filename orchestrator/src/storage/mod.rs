//! Users, API keys, sessions and messages, behind five narrow traits: [`Accounts`] (users and
//! keys), [`Sessions`] (a user's chats), [`Transcript`] (a session's messages and the writes that
//! begin a reply), [`ReplyLog`] (a streaming reply's job, checkpoints and lease) and
//! [`Responses`] (the Responses API's responses, kept on sessions). [`Store`] is all five on one
//! database, which the server holds; code that uses one imports that trait only.
//!
//! PostgreSQL is the system of record in production; SQLite is the embedded default, so a first
//! run needs nothing installed. Both run the same SQL through sqlx's `Any` driver (`sql`);
//! each has its own migrations (`migrations/postgres`, `migrations/sqlite`), applied at start-up.
//!
//! Every query that touches a session or message takes the caller's user id: another user's
//! session is indistinguishable from a missing one ([`StoreError::NotFound`]).

mod accounts;
mod reply_log;
mod responses;
mod sessions;
mod sql;
mod transcript;
mod types;

pub use accounts::Accounts;
pub use reply_log::ReplyLog;
pub use responses::{NewItem, NewResponse, Responses, StoredResponse};
pub use sessions::Sessions;
pub use sql::SqlStore;
pub use transcript::Transcript;
pub use types::*;

use async_trait::async_trait;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// Missing, soft-deleted, or not the caller's.
    #[error("{0} not found")]
    NotFound(&'static str),
    #[error("{0} already exists")]
    Conflict(&'static str),
    /// The database cannot be reached (down, pool exhausted, connection lost).
    #[error("the database is unavailable: {0}")]
    Unavailable(String),
    #[error("storage: {0}")]
    Invalid(String),
    /// An edit named a message that is not the user's own words (an assistant reply).
    #[error("{0}")]
    NotAUserMessage(String),
    /// Another reply of the session is still streaming (possibly on another replica).
    #[error("another reply of this session is still streaming")]
    ReplyRunning,
    #[error("storage error: {0}")]
    Internal(String),
}

pub type StoreResult<T> = Result<T, StoreError>;

/// Everything the service stores, one database behind five narrow traits; code that needs one
/// of them imports that trait only.
#[async_trait]
pub trait Store:
    Accounts + Sessions + Transcript + ReplyLog + Responses + Send + Sync + std::fmt::Debug
{
    /// Which database this is (`postgres` or `sqlite`), for logs.
    fn backend(&self) -> &'static str;

    /// Cheap round trip, for readiness.
    async fn ping(&self) -> StoreResult<()>;
}
