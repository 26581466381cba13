//! A user's chats: created, listed, renamed, deleted (softly, then purged).

use async_trait::async_trait;

use super::types::{NewSession, Session, SessionId, SessionPatch, SessionQuery, UserId};
use super::StoreResult;

#[async_trait]
pub trait Sessions: Send + Sync + std::fmt::Debug {
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

    /// Removes for good the sessions deleted before `before_ms`, with their messages: a deleted
    /// chat is not kept. Returns how many sessions and messages went.
    async fn purge_deleted(&self, before_ms: i64) -> StoreResult<(u64, u64)>;
}
