//! The messages of a session, and the writes that begin a reply: each in one transaction,
//! refused while another reply of the session streams.

use async_trait::async_trait;

use super::types::{Message, MessageId, NewToolResult, SessionId, Turn, UserId};
use super::StoreResult;

#[async_trait]
pub trait Transcript: Send + Sync + std::fmt::Debug {
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
}
