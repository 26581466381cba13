//! Users, API keys, sessions and messages, behind one [`Store`] trait.
//!
//! PostgreSQL is the system of record in production; SQLite is the embedded default, so a first
//! run needs nothing installed. Both run the same SQL through sqlx's `Any` driver ([`sql`]);
//! each has its own migrations (`migrations/postgres`, `migrations/sqlite`), applied at start-up.
//!
//! Every query that touches a session or message takes the caller's user id: another user's
//! session is indistinguishable from a missing one ([`StoreError::NotFound`]).

mod sql;
mod types;

pub use sql::SqlStore;
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

#[async_trait]
pub trait Store: Send + Sync + std::fmt::Debug {
    /// Which database this is (`postgres` or `sqlite`), for logs.
    fn backend(&self) -> &'static str;
    /// Cheap round trip, for readiness.
    async fn ping(&self) -> StoreResult<()>;

    async fn create_user(&self, name: &str) -> StoreResult<User>;
    /// The user `name`, created unless it exists: several replicas starting at once all get
    /// the same user.
    async fn ensure_user(&self, name: &str) -> StoreResult<User>;
    async fn user_by_name(&self, name: &str) -> StoreResult<Option<User>>;

    async fn insert_api_key(&self, key: NewApiKey) -> StoreResult<ApiKey>;
    /// Keys whose prefix matches, with their users; the caller compares hashes in constant time
    /// and checks revocation and expiry.
    async fn api_keys_by_prefix(&self, prefix: &str) -> StoreResult<Vec<(ApiKey, User)>>;
    async fn revoke_api_key(&self, key_id: &KeyId, at_ms: i64) -> StoreResult<()>;

    async fn create_session(&self, user_id: &UserId, new: NewSession) -> StoreResult<Session>;
    /// The caller's live sessions, most recently updated first.
    async fn list_sessions(
        &self,
        user_id: &UserId,
        query: &SessionQuery,
    ) -> StoreResult<Vec<Session>>;
    async fn get_session(&self, user_id: &UserId, session_id: &SessionId) -> StoreResult<Session>;
    /// The user's sessions that are not deleted.
    async fn count_sessions(&self, user_id: &UserId) -> StoreResult<u64>;
    async fn update_session(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        patch: SessionPatch,
    ) -> StoreResult<Session>;
    /// Soft delete: the session and its messages disappear from every query.
    async fn delete_session(&self, user_id: &UserId, session_id: &SessionId) -> StoreResult<()>;

    /// The session's messages in order.
    async fn list_messages(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
    ) -> StoreResult<Vec<Message>>;
    /// One page of the session's messages: the newest `limit` before sequence number `before`
    /// (all, without it), oldest first.
    async fn list_messages_page(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        before: Option<i64>,
        limit: u32,
    ) -> StoreResult<Vec<Message>>;
    /// The session's last message, if it has any (one row, however long the history).
    async fn last_message(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
    ) -> StoreResult<Option<Message>>;
    /// One message of the caller's session.
    async fn get_message(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        message_id: &MessageId,
    ) -> StoreResult<Message>;
    /// In one transaction: the user's message, an empty assistant message with status
    /// `streaming`, and the session's `updated_at`. Nothing is written if any part fails.
    async fn begin_turn(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        content: &str,
    ) -> StoreResult<Turn>;
    /// In one transaction: a `tool` message per result, in order, an empty assistant message
    /// with status `streaming`, and the session's `updated_at`. Returns the tool messages and
    /// the reply. The caller checks that each result answers a call of the last reply.
    async fn begin_tool_results(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        results: &[NewToolResult],
    ) -> StoreResult<(Vec<Message>, Message)>;
    /// Regenerate, in one transaction: drops the session's messages from `from_seq` on (the
    /// reply being replaced) and writes a new `streaming` assistant placeholder.
    async fn begin_regenerate(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        from_seq: i64,
    ) -> StoreResult<Message>;
    /// Edit and resend, in one transaction: replaces the content of the user message
    /// `message_id` of the caller's session, drops every later message, and writes a new
    /// `streaming` assistant placeholder after it. The edited message keeps its id and place.
    /// Another session's (or user's) message is [`StoreError::NotFound`]; an assistant message
    /// is [`StoreError::NotAUserMessage`]; either way nothing changes.
    async fn begin_edit(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        message_id: &MessageId,
        content: &str,
    ) -> StoreResult<Turn>;
    /// The job that makes a streaming reply, for a replica that takes it over (see the
    /// service's takeover). False when `lease` no longer holds the reply (another replica
    /// claimed it, or it ended).
    async fn save_job(&self, lease: &ReplyLease, job: &str) -> StoreResult<bool>;
    /// The reply so far, while it streams, with how far it got (its checkpoint). False when
    /// `lease` no longer holds it: nothing is written.
    async fn save_progress(&self, lease: &ReplyLease, checkpoint: &Checkpoint)
        -> StoreResult<bool>;
    /// The owner's heartbeat: a new `updated_at` for each reply it still holds, whatever the
    /// reply is doing. Returns the ids of the replies `leases` no longer hold.
    async fn renew_leases(&self, leases: &[ReplyLease]) -> StoreResult<Vec<MessageId>>;
    /// The reply's final state; its checkpoint is cleared. False when `lease` no longer holds
    /// the reply: nothing is written.
    async fn finish_message(&self, lease: &ReplyLease, done: &Completion) -> StoreResult<bool>;
    /// Every reply in `streaming` state, with its last write's time and its lease's epoch.
    async fn streaming_replies(&self) -> StoreResult<Vec<StreamingReply>>;
    /// Claims a streaming reply for this replica: its epoch grows by one, and the previous
    /// owner can write it no more. Only while the reply is as `seen` (its epoch; and, when
    /// `silent`, its `updated_at`: no write landed since, so its owner is gone), so of replicas
    /// racing for it one wins. The new lease, or None.
    async fn claim_reply(
        &self,
        seen: &StreamingReply,
        silent: bool,
    ) -> StoreResult<Option<ReplyLease>>;
    /// A reply that cannot be continued becomes `error` / `interrupted`, keeping its text: only
    /// while `lease` holds it. Returns whether it changed.
    async fn fail_interrupted(&self, lease: &ReplyLease) -> StoreResult<bool>;
    /// A streaming reply's checkpoint and job; None once it ended (or if there is no such
    /// reply).
    async fn saved_reply(&self, message_id: &MessageId) -> StoreResult<Option<SavedReply>>;
    /// Removes for good the sessions deleted before `before_ms`, with their messages: a deleted
    /// chat is not kept. Returns how many sessions and messages went.
    async fn purge_deleted(&self, before_ms: i64) -> StoreResult<(u64, u64)>;
}
