//! [`Responses`] in SQL: a response's row beside its reply, and the fork of a session.

use async_trait::async_trait;
use sqlx::Row;

use super::transcript::{message_from, NewMessage, Rewrite, MESSAGE_COLUMNS};
use super::{conflict, db_err, SqlStore};
use crate::storage::types::*;
use crate::storage::{NewResponse, Responses, StoreError, StoreResult, StoredResponse};

/// The columns of a response joined with its reply (`m`) and its session (`s`).
fn response_columns() -> String {
    let reply = MESSAGE_COLUMNS
        .split(", ")
        .map(|c| format!("m.{c}"))
        .collect::<Vec<_>>()
        .join(", ");
    format!("{reply}, r.session_id, r.previous_id, r.first_seq, r.request")
}

#[async_trait]
impl Responses for SqlStore {
    #[tracing::instrument(name = "db.begin_response", skip_all, fields(db.system = self.backend))]
    async fn begin_response(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        new: &NewResponse,
    ) -> StoreResult<Message> {
        let mut tx = self.begin().await?;
        // The session's row is locked first, so that the check below holds until the commit.
        Self::claim(&mut tx, user_id, session_id, now_ms()).await?;
        if let Some(previous) = &new.previous {
            check_last(&mut tx, session_id, previous).await?;
        }
        sqlx::query("UPDATE sessions SET system_prompt = $1, model = $2 WHERE id = $3")
            .bind(&new.system_prompt)
            .bind(&new.model)
            .bind(session_id)
            .execute(&mut *tx)
            .await
            .map_err(db_err)?;
        let mut messages: Vec<NewMessage<'_>> = new
            .items
            .iter()
            .map(|i| NewMessage {
                role: i.role,
                content: &i.content,
                status: MessageStatus::Complete,
                tool_calls: i.tool_calls.as_deref(),
                tool_call_id: i.tool_call_id.as_deref(),
            })
            .collect();
        messages.push(NewMessage::reply());
        let written =
            Self::append_in(&mut tx, user_id, session_id, Rewrite::Keep, &messages).await?;
        let (Some(first), Some(reply)) = (written.first(), written.last()) else {
            return Err(StoreError::Internal("a response wrote no reply".into()));
        };
        sqlx::query(
            "INSERT INTO responses (message_id, session_id, previous_id, first_seq, request, \
             created_at) VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(&reply.id)
        .bind(session_id)
        .bind(&new.previous)
        .bind(first.seq)
        .bind(&new.request)
        .bind(reply.created_at)
        .execute(&mut *tx)
        .await
        .map_err(conflict("the response"))?;
        tx.commit().await.map_err(db_err)?;
        Ok(reply.clone())
    }

    #[tracing::instrument(name = "db.get_response", skip_all, fields(db.system = self.backend))]
    async fn get_response(
        &self,
        user_id: &UserId,
        message_id: &MessageId,
    ) -> StoreResult<StoredResponse> {
        let sql = format!(
            "SELECT {} FROM responses r JOIN messages m ON m.id = r.message_id \
             JOIN sessions s ON s.id = r.session_id \
             WHERE r.message_id = $1 AND s.user_id = $2 AND s.deleted_at IS NULL",
            response_columns()
        );
        let row = sqlx::query(&sql)
            .bind(message_id)
            .bind(user_id)
            .fetch_optional(&self.pool)
            .await
            .map_err(db_err)?
            .ok_or(StoreError::NotFound("response"))?;
        let reply = message_from(&row)?;
        Ok(StoredResponse {
            session_id: row.try_get("session_id").map_err(db_err)?,
            previous: row.try_get("previous_id").map_err(db_err)?,
            first_seq: row.try_get("first_seq").map_err(db_err)?,
            request: row.try_get("request").map_err(db_err)?,
            created_at: reply.created_at,
            reply,
        })
    }

    #[tracing::instrument(name = "db.delete_response", skip_all, fields(db.system = self.backend))]
    async fn delete_response(
        &self,
        user_id: &UserId,
        message_id: &MessageId,
    ) -> StoreResult<Option<SessionId>> {
        let kept = self.get_response(user_id, message_id).await?;
        let mut tx = self.begin().await?;
        sqlx::query("DELETE FROM responses WHERE message_id = $1")
            .bind(message_id)
            .execute(&mut *tx)
            .await
            .map_err(db_err)?;
        let others: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM responses WHERE session_id = $1")
                .bind(&kept.session_id)
                .fetch_one(&mut *tx)
                .await
                .map_err(db_err)?;
        let gone = (others == 0).then(|| kept.session_id.clone());
        if gone.is_some() {
            sqlx::query(
                "UPDATE sessions SET deleted_at = $1 \
                 WHERE id = $2 AND user_id = $3 AND deleted_at IS NULL",
            )
            .bind(now_ms())
            .bind(&kept.session_id)
            .bind(user_id)
            .execute(&mut *tx)
            .await
            .map_err(db_err)?;
        }
        tx.commit().await.map_err(db_err)?;
        Ok(gone)
    }

    #[tracing::instrument(name = "db.fork_session", skip_all, fields(db.system = self.backend))]
    async fn fork_session(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        through: i64,
    ) -> StoreResult<Session> {
        let from = crate::storage::Sessions::get_session(self, user_id, session_id).await?;
        let mut tx = self.begin().await?;
        let now = now_ms();
        let fork = Session {
            id: SessionId::random(),
            created_at: now,
            updated_at: now,
            ..from
        };
        sqlx::query(
            "INSERT INTO sessions (id, user_id, title, title_lower, system_prompt, params, \
             max_tokens, model, created_at, updated_at) \
             SELECT $1, user_id, title, title_lower, system_prompt, params, max_tokens, model, \
             $2, $2 FROM sessions WHERE id = $3",
        )
        .bind(&fork.id)
        .bind(now)
        .bind(session_id)
        .execute(&mut *tx)
        .await
        .map_err(db_err)?;
        let sql = format!(
            "SELECT {MESSAGE_COLUMNS} FROM messages WHERE session_id = $1 AND seq <= $2 \
             ORDER BY seq"
        );
        let rows = sqlx::query(&sql)
            .bind(session_id)
            .bind(through)
            .fetch_all(&mut *tx)
            .await
            .map_err(db_err)?;
        for row in &rows {
            copy_message(&mut tx, &fork.id, &message_from(row)?).await?;
        }
        tx.commit().await.map_err(db_err)?;
        Ok(fork)
    }
}

/// Whether `previous` is still the session's last message (else a later turn follows it).
async fn check_last(
    tx: &mut sqlx::Transaction<'static, sqlx::Any>,
    session_id: &SessionId,
    previous: &MessageId,
) -> StoreResult<()> {
    let last: Option<String> = sqlx::query_scalar(
        "SELECT id FROM messages WHERE session_id = $1 ORDER BY seq DESC LIMIT 1",
    )
    .bind(session_id)
    .fetch_optional(&mut **tx)
    .await
    .map_err(db_err)?;
    if last.as_deref() != Some(previous.as_str()) {
        return Err(StoreError::Conflict(
            "a later turn of the previous response's session",
        ));
    }
    Ok(())
}

/// Writes `m` into `session_id` under a new id, at the same sequence number.
async fn copy_message(
    tx: &mut sqlx::Transaction<'static, sqlx::Any>,
    session_id: &SessionId,
    m: &Message,
) -> StoreResult<()> {
    let calls = m.tool_calls.as_ref().map(serde_json::to_string).transpose();
    let calls = calls.map_err(|e| StoreError::Internal(format!("tool calls: {e}")))?;
    sqlx::query(
        "INSERT INTO messages (id, session_id, seq, role, content, status, finish_reason, \
         prompt_tokens, cached_tokens, completion_tokens, ttft_ms, duration_ms, worker, \
         tool_calls, tool_call_id, created_at, updated_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)",
    )
    .bind(MessageId::random())
    .bind(session_id)
    .bind(m.seq)
    .bind(m.role.as_str())
    .bind(&m.content)
    .bind(m.status.as_str())
    .bind(m.finish_reason.map(Finish::as_str))
    .bind(m.prompt_tokens)
    .bind(m.cached_tokens)
    .bind(m.completion_tokens)
    .bind(m.ttft_ms)
    .bind(m.duration_ms)
    .bind(&m.worker)
    .bind(calls)
    .bind(&m.tool_call_id)
    .bind(m.created_at)
    .bind(m.updated_at)
    .execute(&mut **tx)
    .await
    .map_err(db_err)?;
    Ok(())
}
