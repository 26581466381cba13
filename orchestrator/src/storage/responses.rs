//! Responses of OpenAI's Responses API, kept on sessions: each is the assistant message that
//! answers it, with what its request asked (repeated by the `response` object) beside it.

use async_trait::async_trait;

use super::types::{Message, MessageId, Role, Session, SessionId, ToolCall, UserId};
use super::StoreResult;

/// A message a response's request brings into its session: one of its input items.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewItem {
    pub role: Role,
    pub content: String,
    /// For an assistant message: the calls it made.
    pub tool_calls: Option<Vec<ToolCall>>,
    /// For a `tool` message: the call it answers.
    pub tool_call_id: Option<String>,
}

/// A response to begin: its input items, then an empty reply, in one transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewResponse {
    pub items: Vec<NewItem>,
    /// The session's system prompt from now on (the request's instructions).
    pub system_prompt: Option<String>,
    /// The session's model from now on.
    pub model: Option<String>,
    /// The response this one continues: it must still be the session's last message.
    pub previous: Option<MessageId>,
    /// What the `response` object repeats of the request, JSON.
    pub request: String,
}

/// A kept response: its reply, its session, and what was kept beside them.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredResponse {
    pub session_id: SessionId,
    pub reply: Message,
    pub previous: Option<MessageId>,
    /// The sequence number of the first message its request added.
    pub first_seq: i64,
    pub request: String,
    pub created_at: i64,
}

#[async_trait]
pub trait Responses: Send + Sync + std::fmt::Debug {
    /// In one transaction: the session's system prompt and model as `new` says, its items, an
    /// empty `streaming` reply and the response's row. Refused while another reply of the
    /// session streams ([`super::StoreError::ReplyRunning`]), and when `new.previous` is no
    /// longer the session's last message ([`super::StoreError::Conflict`]). Returns the reply.
    async fn begin_response(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        new: &NewResponse,
    ) -> StoreResult<Message>;

    /// The caller's response whose reply is `message_id`; another user's is not found.
    async fn get_response(
        &self,
        user_id: &UserId,
        message_id: &MessageId,
    ) -> StoreResult<StoredResponse>;

    /// Forgets the response. When its session holds no other response, the session goes too
    /// (deleted, then purged with its messages as any deleted session is): then it returns
    /// that session's id.
    async fn delete_response(
        &self,
        user_id: &UserId,
        message_id: &MessageId,
    ) -> StoreResult<Option<SessionId>>;

    /// A new session of the caller's holding a copy of `session_id`'s messages up to and
    /// including sequence number `through`, its settings the same: where a response that was
    /// already continued is continued again.
    async fn fork_session(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        through: i64,
    ) -> StoreResult<Session>;
}
