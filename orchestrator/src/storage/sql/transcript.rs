//! [`Transcript`] in SQL: the messages of a session, and the writes that begin a reply.

use async_trait::async_trait;
use sqlx::any::AnyRow;
use sqlx::Row;

use super::{conflict, db_err, SqlStore};
use crate::storage::types::*;
use crate::storage::{StoreError, StoreResult, Transcript};

impl SqlStore {
    /// In one transaction: claims the caller's session, rewrites its history as `rewrite`
    /// says, and appends `messages`. Returns the edited message (if any) and then those written.
    async fn append(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        rewrite: Rewrite<'_>,
        messages: &[NewMessage<'_>],
    ) -> StoreResult<Vec<Message>> {
        let mut tx = self.begin().await?;
        let written = Self::append_in(&mut tx, user_id, session_id, rewrite, messages).await?;
        tx.commit().await.map_err(db_err)?;
        Ok(written)
    }

    /// [`Self::append`] inside the caller's transaction, which commits it.
    pub(super) async fn append_in(
        tx: &mut sqlx::Transaction<'static, sqlx::Any>,
        user_id: &UserId,
        session_id: &SessionId,
        rewrite: Rewrite<'_>,
        messages: &[NewMessage<'_>],
    ) -> StoreResult<Vec<Message>> {
        let now = now_ms();
        Self::claim(tx, user_id, session_id, now).await?;
        // One reply per session across every replica: the session row is locked now, so of two
        // racing turns (a new message on one replica, a regenerate on another) the second sees
        // the first's reply streaming and is refused, and never deletes what the first stored.
        // A streaming reply whose replica died is failed by the orphan sweep, which judges
        // silence on its own clock; comparing `updated_at` with this replica's clock here would
        // let one whose clock runs ahead take the session from a live reply.
        let running: Option<String> = sqlx::query_scalar(
            "SELECT id FROM messages WHERE session_id = $1 AND status = 'streaming' LIMIT 1",
        )
        .bind(session_id)
        .fetch_optional(&mut **tx)
        .await
        .map_err(db_err)?;
        if running.is_some() {
            return Err(StoreError::ReplyRunning);
        }
        let mut written = Vec::with_capacity(messages.len() + 1);
        let truncate_from = match rewrite {
            Rewrite::Keep => None,
            Rewrite::From(seq) => Some(seq),
            Rewrite::Edit {
                message_id,
                content,
            } => {
                let edited = edit_message(tx, session_id, message_id, content, now).await?;
                let after = edited.seq + 1;
                written.push(edited);
                Some(after)
            }
        };
        if let Some(seq) = truncate_from {
            truncate(tx, session_id, seq).await?;
        }
        for m in messages {
            written.push(insert_message(tx, session_id, m, now).await?);
        }
        Ok(written)
    }

    /// The session, if it is the caller's and not deleted.
    async fn owned<'e, E>(exec: E, user_id: &UserId, session_id: &SessionId) -> StoreResult<()>
    where
        E: sqlx::Executor<'e, Database = sqlx::Any>,
    {
        sqlx::query("SELECT id FROM sessions WHERE id = $1 AND user_id = $2 AND deleted_at IS NULL")
            .bind(session_id)
            .bind(user_id)
            .fetch_optional(exec)
            .await
            .map_err(db_err)?
            .map(|_| ())
            .ok_or(StoreError::NotFound("session"))
    }
}

/// Drops the session's messages from sequence number `seq` on, and the responses those replies
/// were.
async fn truncate(
    tx: &mut sqlx::Transaction<'static, sqlx::Any>,
    session_id: &SessionId,
    seq: i64,
) -> StoreResult<()> {
    for sql in [
        "DELETE FROM responses WHERE message_id IN \
         (SELECT id FROM messages WHERE session_id = $1 AND seq >= $2)",
        "DELETE FROM messages WHERE session_id = $1 AND seq >= $2",
    ] {
        sqlx::query(sql)
            .bind(session_id)
            .bind(seq)
            .execute(&mut **tx)
            .await
            .map_err(db_err)?;
    }
    Ok(())
}

/// How a write changes the history before appending.
#[derive(Debug, Clone, Copy)]
pub(super) enum Rewrite<'a> {
    /// A new turn: nothing.
    Keep,
    /// Regenerate: drop messages from this sequence number on.
    From(i64),
    /// Edit and resend: replace this user message's content and drop everything after it.
    Edit {
        message_id: &'a MessageId,
        content: &'a str,
    },
}

pub(super) const MESSAGE_COLUMNS: &str =
    "id, seq, role, content, status, finish_reason, prompt_tokens, \
     cached_tokens, completion_tokens, ttft_ms, duration_ms, worker, tool_calls, tool_call_id, \
     created_at, updated_at";

pub(super) fn message_from(r: &AnyRow) -> StoreResult<Message> {
    let role: String = r.try_get("role").map_err(db_err)?;
    let status: String = r.try_get("status").map_err(db_err)?;
    let finish: Option<String> = r.try_get("finish_reason").map_err(db_err)?;
    let calls: Option<String> = r.try_get("tool_calls").map_err(db_err)?;
    let bad = |what: &str, v: &str| StoreError::Internal(format!("stored message {what} `{v}`"));
    Ok(Message {
        id: r.try_get("id").map_err(db_err)?,
        seq: r.try_get("seq").map_err(db_err)?,
        role: Role::parse(&role).ok_or_else(|| bad("role", &role))?,
        content: r.try_get("content").map_err(db_err)?,
        status: MessageStatus::parse(&status).ok_or_else(|| bad("status", &status))?,
        finish_reason: finish
            .map(|f| Finish::parse(&f).ok_or_else(|| bad("finish_reason", &f)))
            .transpose()?,
        prompt_tokens: r.try_get("prompt_tokens").map_err(db_err)?,
        cached_tokens: r.try_get("cached_tokens").map_err(db_err)?,
        completion_tokens: r.try_get("completion_tokens").map_err(db_err)?,
        ttft_ms: r.try_get("ttft_ms").map_err(db_err)?,
        duration_ms: r.try_get("duration_ms").map_err(db_err)?,
        worker: r.try_get("worker").map_err(db_err)?,
        tool_calls: calls
            .map(|c| serde_json::from_str(&c))
            .transpose()
            .map_err(|e| StoreError::Internal(format!("stored tool calls: {e}")))?,
        tool_call_id: r.try_get("tool_call_id").map_err(db_err)?,
        created_at: r.try_get("created_at").map_err(db_err)?,
        updated_at: r.try_get("updated_at").map_err(db_err)?,
    })
}

/// Inside a transaction that claimed the session: replaces the content of the session's user
/// message `message_id`, and returns it as stored.
async fn edit_message(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    session_id: &SessionId,
    message_id: &MessageId,
    content: &str,
    now: i64,
) -> StoreResult<Message> {
    let sql = format!("SELECT {MESSAGE_COLUMNS} FROM messages WHERE id = $1 AND session_id = $2");
    let row = sqlx::query(&sql)
        .bind(message_id)
        .bind(session_id)
        .fetch_optional(&mut **tx)
        .await
        .map_err(db_err)?
        .ok_or(StoreError::NotFound("message"))?;
    let mut m = message_from(&row)?;
    if m.role != Role::User {
        return Err(StoreError::NotAUserMessage(format!(
            "message {message_id} is an {} message; only user messages can be edited",
            m.role.as_str()
        )));
    }
    sqlx::query("UPDATE messages SET content = $1, updated_at = $2 WHERE id = $3")
        .bind(content)
        .bind(now)
        .bind(message_id)
        .execute(&mut **tx)
        .await
        .map_err(db_err)?;
    m.content = content.to_string();
    m.updated_at = now;
    Ok(m)
}

/// A message `append` writes.
pub(super) struct NewMessage<'a> {
    pub(super) role: Role,
    pub(super) content: &'a str,
    pub(super) status: MessageStatus,
    /// For an assistant message: the calls it made.
    pub(super) tool_calls: Option<&'a [ToolCall]>,
    /// For a `tool` message: the call it answers.
    pub(super) tool_call_id: Option<&'a str>,
}

impl<'a> NewMessage<'a> {
    fn user(content: &'a str) -> Self {
        Self {
            role: Role::User,
            content,
            status: MessageStatus::Complete,
            tool_calls: None,
            tool_call_id: None,
        }
    }

    /// An empty reply, streaming.
    pub(super) fn reply() -> Self {
        Self {
            role: Role::Assistant,
            content: "",
            status: MessageStatus::Streaming,
            tool_calls: None,
            tool_call_id: None,
        }
    }

    fn tool(r: &'a NewToolResult) -> Self {
        Self {
            role: Role::Tool,
            content: &r.content,
            status: MessageStatus::Complete,
            tool_calls: None,
            tool_call_id: Some(&r.tool_call_id),
        }
    }
}

/// Inserts a message inside a transaction, at the session's next sequence number.
pub(super) async fn insert_message(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    session_id: &SessionId,
    m: &NewMessage<'_>,
    now: i64,
) -> StoreResult<Message> {
    let seq: i64 =
        sqlx::query_scalar("SELECT COALESCE(MAX(seq), 0) FROM messages WHERE session_id = $1")
            .bind(session_id)
            .fetch_one(&mut **tx)
            .await
            .map_err(db_err)?;
    let id = MessageId::random();
    let calls = m.tool_calls.map(serde_json::to_string).transpose();
    let calls = calls.map_err(|e| StoreError::Internal(format!("tool calls: {e}")))?;
    sqlx::query(
        "INSERT INTO messages (id, session_id, seq, role, content, status, tool_call_id, \
         created_at, updated_at, tool_calls) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8, $9)",
    )
    .bind(&id)
    .bind(session_id)
    .bind(seq + 1)
    .bind(m.role.as_str())
    .bind(m.content)
    .bind(m.status.as_str())
    .bind(m.tool_call_id)
    .bind(now)
    .bind(calls)
    .execute(&mut **tx)
    .await
    .map_err(conflict("a concurrent turn in this session"))?;
    Ok(Message {
        id,
        seq: seq + 1,
        role: m.role,
        content: m.content.to_string(),
        status: m.status,
        finish_reason: None,
        prompt_tokens: None,
        cached_tokens: None,
        completion_tokens: None,
        ttft_ms: None,
        duration_ms: None,
        worker: None,
        tool_calls: m.tool_calls.map(<[ToolCall]>::to_vec),
        tool_call_id: m.tool_call_id.map(str::to_string),
        created_at: now,
        updated_at: now,
    })
}

#[async_trait]
impl Transcript for SqlStore {
    #[tracing::instrument(name = "db.list_messages", skip_all, fields(db.system = self.backend))]
    async fn list_messages(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
    ) -> StoreResult<Vec<Message>> {
        let mut tx = self.begin().await?;
        Self::owned(&mut *tx, user_id, session_id).await?;
        let sql =
            format!("SELECT {MESSAGE_COLUMNS} FROM messages WHERE session_id = $1 ORDER BY seq");
        let rows = sqlx::query(&sql)
            .bind(session_id)
            .fetch_all(&mut *tx)
            .await
            .map_err(db_err)?;
        tx.commit().await.map_err(db_err)?;
        rows.iter().map(message_from).collect()
    }

    async fn list_messages_page(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        before: Option<i64>,
        limit: u32,
    ) -> StoreResult<Vec<Message>> {
        let mut tx = self.begin().await?;
        Self::owned(&mut *tx, user_id, session_id).await?;
        let sql = format!(
            "SELECT {MESSAGE_COLUMNS} FROM messages WHERE session_id = $1 AND seq < $2 \
             ORDER BY seq DESC LIMIT $3"
        );
        let rows = sqlx::query(&sql)
            .bind(session_id)
            .bind(before.unwrap_or(i64::MAX))
            .bind(i64::from(limit))
            .fetch_all(&mut *tx)
            .await
            .map_err(db_err)?;
        tx.commit().await.map_err(db_err)?;
        let mut page = rows
            .iter()
            .map(message_from)
            .collect::<StoreResult<Vec<_>>>()?;
        page.reverse();
        Ok(page)
    }

    #[tracing::instrument(name = "db.last_message", skip_all, fields(db.system = self.backend))]
    async fn last_message(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
    ) -> StoreResult<Option<Message>> {
        let mut tx = self.begin().await?;
        Self::owned(&mut *tx, user_id, session_id).await?;
        let sql = format!(
            "SELECT {MESSAGE_COLUMNS} FROM messages WHERE session_id = $1 ORDER BY seq DESC LIMIT 1"
        );
        let row = sqlx::query(&sql)
            .bind(session_id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(db_err)?;
        tx.commit().await.map_err(db_err)?;
        row.as_ref().map(message_from).transpose()
    }

    #[tracing::instrument(name = "db.get_message", skip_all, fields(db.system = self.backend))]
    async fn get_message(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        message_id: &MessageId,
    ) -> StoreResult<Message> {
        let mut tx = self.begin().await?;
        Self::owned(&mut *tx, user_id, session_id).await?;
        let sql =
            format!("SELECT {MESSAGE_COLUMNS} FROM messages WHERE session_id = $1 AND id = $2");
        let row = sqlx::query(&sql)
            .bind(session_id)
            .bind(message_id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(db_err)?;
        tx.commit().await.map_err(db_err)?;
        message_from(&row.ok_or(StoreError::NotFound("message"))?)
    }

    #[tracing::instrument(name = "db.begin_turn", skip_all, fields(db.system = self.backend))]
    async fn begin_turn(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        content: &str,
    ) -> StoreResult<Turn> {
        let mut written = self
            .append(
                user_id,
                session_id,
                Rewrite::Keep,
                &[NewMessage::user(content), NewMessage::reply()],
            )
            .await?;
        let assistant = written.pop();
        let user = written.pop();
        match (user, assistant) {
            (Some(user), Some(assistant)) => Ok(Turn { user, assistant }),
            _ => Err(StoreError::Internal(
                "a turn wrote fewer than two messages".into(),
            )),
        }
    }

    #[tracing::instrument(name = "db.begin_tool_results", skip_all, fields(db.system = self.backend))]
    async fn begin_tool_results(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        results: &[NewToolResult],
    ) -> StoreResult<(Vec<Message>, Message)> {
        let mut new: Vec<NewMessage<'_>> = results.iter().map(NewMessage::tool).collect();
        new.push(NewMessage::reply());
        let mut written = self
            .append(user_id, session_id, Rewrite::Keep, &new)
            .await?;
        let reply = written
            .pop()
            .ok_or_else(|| StoreError::Internal("tool results wrote no reply".into()))?;
        Ok((written, reply))
    }

    #[tracing::instrument(name = "db.begin_regenerate", skip_all, fields(db.system = self.backend))]
    async fn begin_regenerate(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        from_seq: i64,
    ) -> StoreResult<Message> {
        self.append(
            user_id,
            session_id,
            Rewrite::From(from_seq),
            &[NewMessage::reply()],
        )
        .await?
        .pop()
        .ok_or_else(|| StoreError::Internal("a reply wrote no message".into()))
    }

    #[tracing::instrument(name = "db.begin_edit", skip_all, fields(db.system = self.backend))]
    async fn begin_edit(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        message_id: &MessageId,
        content: &str,
    ) -> StoreResult<Turn> {
        let mut written = self
            .append(
                user_id,
                session_id,
                Rewrite::Edit {
                    message_id,
                    content,
                },
                &[NewMessage::reply()],
            )
            .await?;
        let assistant = written.pop();
        let user = written.pop();
        match (user, assistant) {
            (Some(user), Some(assistant)) => Ok(Turn { user, assistant }),
            _ => Err(StoreError::Internal(
                "an edit wrote fewer than two messages".into(),
            )),
        }
    }
}
