//! [`ReplyLog`] in SQL: a streaming reply's job, checkpoints, lease and end.

use async_trait::async_trait;
use sqlx::Row;

use super::{db_err, SqlStore};
use crate::storage::types::*;
use crate::storage::{ReplyLog, StoreError, StoreResult};

/// `updated_at` set to the time bound at `$n`, or one past its stored value when that is not
/// earlier: every write of a streaming reply changes it, which is how the orphan sweep tells a
/// live reply from a silent one (whatever the writers' clocks say).
fn bump(n: usize) -> String {
    format!("updated_at = CASE WHEN updated_at < ${n} THEN ${n} ELSE updated_at + 1 END")
}

/// The streaming reply whose id is bound at `$n`, while its lease's epoch is the one at
/// `$n + 1`.
fn held_by(n: usize) -> String {
    format!(
        "id = ${n} AND lease_epoch = ${} AND status = 'streaming'",
        n + 1
    )
}

#[async_trait]
impl ReplyLog for SqlStore {
    async fn save_job(&self, lease: &ReplyLease, job: &str) -> StoreResult<bool> {
        let done = sqlx::query(&format!(
            "UPDATE messages SET reply_job = $1, {} WHERE {}",
            bump(2),
            held_by(3)
        ))
        .bind(job)
        .bind(now_ms())
        .bind(&lease.message_id)
        .bind(lease.epoch)
        .execute(&self.pool)
        .await
        .map_err(db_err)?;
        Ok(done.rows_affected() == 1)
    }

    async fn save_progress(&self, lease: &ReplyLease, cp: &Checkpoint) -> StoreResult<bool> {
        let done = sqlx::query(&format!(
            "UPDATE messages SET content = $1, reply_tokens = $2, reply_events = $3, {} \
             WHERE {}",
            bump(4),
            held_by(5)
        ))
        .bind(&cp.content)
        .bind(encode_tokens(&cp.tokens))
        .bind(cp.events as i64)
        .bind(now_ms())
        .bind(&lease.message_id)
        .bind(lease.epoch)
        .execute(&self.pool)
        .await
        .map_err(db_err)?;
        Ok(done.rows_affected() == 1)
    }

    async fn renew_leases(&self, leases: &[ReplyLease]) -> StoreResult<Vec<MessageId>> {
        let mut lost = Vec::new();
        // A few hundred per statement keeps within every driver's limit on bound values.
        for chunk in leases.chunks(200) {
            let held: Vec<String> = (0..chunk.len())
                .map(|i| format!("(id = ${} AND lease_epoch = ${})", 2 * i + 2, 2 * i + 3))
                .collect();
            let sql = format!(
                "UPDATE messages SET {} WHERE status = 'streaming' AND ({}) \
                 RETURNING id, lease_epoch",
                bump(1),
                held.join(" OR ")
            );
            let mut q = sqlx::query(&sql).bind(now_ms());
            for l in chunk {
                q = q.bind(&l.message_id).bind(l.epoch);
            }
            let rows = q.fetch_all(&self.pool).await.map_err(db_err)?;
            let renewed: Vec<(String, i64)> = rows
                .iter()
                .map(|r| Ok((r.try_get("id")?, r.try_get("lease_epoch")?)))
                .collect::<Result<_, sqlx::Error>>()
                .map_err(db_err)?;
            lost.extend(
                chunk
                    .iter()
                    .filter(|l| {
                        !renewed
                            .iter()
                            .any(|(id, e)| id == l.message_id.as_str() && *e == l.epoch)
                    })
                    .map(|l| l.message_id.clone()),
            );
        }
        Ok(lost)
    }

    #[tracing::instrument(name = "db.finish_message", skip_all, fields(db.system = self.backend))]
    async fn finish_message(&self, lease: &ReplyLease, d: &Completion) -> StoreResult<bool> {
        let done = sqlx::query(
            "UPDATE messages SET content = $1, status = $2, finish_reason = $3, \
             prompt_tokens = $4, cached_tokens = $5, completion_tokens = $6, ttft_ms = $7, \
             duration_ms = $8, worker = $9, tool_calls = $10, updated_at = $11, \
             reply_job = NULL, reply_tokens = NULL, reply_events = NULL \
             WHERE id = $12 AND status = 'streaming' AND lease_epoch = $13",
        )
        .bind(&d.content)
        .bind(d.status.as_str())
        .bind(d.finish_reason.as_str())
        .bind(d.usage.prompt_tokens as i64)
        .bind(d.usage.cached_tokens as i64)
        .bind(d.usage.completion_tokens as i64)
        .bind(d.timings.ttft_ms.map(|t| t as i64))
        .bind(d.timings.duration_ms as i64)
        .bind(&d.worker)
        .bind(
            d.tool_calls
                .as_ref()
                .map(|c| serde_json::to_string(c).unwrap_or_default()),
        )
        .bind(now_ms())
        .bind(&lease.message_id)
        .bind(lease.epoch)
        .execute(&self.pool)
        .await
        .map_err(db_err)?;
        Ok(done.rows_affected() == 1)
    }

    async fn streaming_replies(&self) -> StoreResult<Vec<StreamingReply>> {
        let rows = sqlx::query(
            "SELECT id, updated_at, lease_epoch FROM messages WHERE status = 'streaming'",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(db_err)?;
        rows.iter()
            .map(|r| {
                Ok(StreamingReply {
                    id: r.try_get("id").map_err(db_err)?,
                    updated_at: r.try_get("updated_at").map_err(db_err)?,
                    epoch: r.try_get("lease_epoch").map_err(db_err)?,
                })
            })
            .collect()
    }

    async fn claim_reply(
        &self,
        seen: &StreamingReply,
        silent: bool,
    ) -> StoreResult<Option<ReplyLease>> {
        let sql = format!(
            "UPDATE messages SET lease_epoch = lease_epoch + 1, {} WHERE {}{} \
             RETURNING lease_epoch",
            bump(1),
            held_by(2),
            if silent { " AND updated_at = $4" } else { "" }
        );
        let mut q = sqlx::query(&sql)
            .bind(now_ms())
            .bind(&seen.id)
            .bind(seen.epoch);
        if silent {
            q = q.bind(seen.updated_at);
        }
        let row = q.fetch_optional(&self.pool).await.map_err(db_err)?;
        row.map(|r| {
            Ok(ReplyLease {
                message_id: seen.id.clone(),
                epoch: r.try_get("lease_epoch").map_err(db_err)?,
            })
        })
        .transpose()
    }

    async fn fail_interrupted(&self, lease: &ReplyLease) -> StoreResult<bool> {
        let done = sqlx::query(&format!(
            "UPDATE messages SET status = 'error', \
             finish_reason = COALESCE(finish_reason, 'interrupted'), \
             reply_job = NULL, reply_tokens = NULL, reply_events = NULL, {} WHERE {}",
            bump(1),
            held_by(2)
        ))
        .bind(now_ms())
        .bind(&lease.message_id)
        .bind(lease.epoch)
        .execute(&self.pool)
        .await
        .map_err(db_err)?;
        Ok(done.rows_affected() == 1)
    }

    async fn saved_reply(&self, message_id: &MessageId) -> StoreResult<Option<SavedReply>> {
        let row = sqlx::query(
            "SELECT content, reply_job, reply_tokens, reply_events FROM messages \
             WHERE id = $1 AND status = 'streaming'",
        )
        .bind(message_id)
        .fetch_optional(&self.pool)
        .await
        .map_err(db_err)?;
        let Some(r) = row else {
            return Ok(None);
        };
        let tokens: Option<String> = r.try_get("reply_tokens").map_err(db_err)?;
        let tokens = match tokens.as_deref() {
            None => Vec::new(),
            Some(t) => decode_tokens(t)
                .ok_or_else(|| StoreError::Internal("stored reply tokens are malformed".into()))?,
        };
        let events: Option<i64> = r.try_get("reply_events").map_err(db_err)?;
        Ok(Some(SavedReply {
            checkpoint: Checkpoint {
                content: r.try_get("content").map_err(db_err)?,
                tokens,
                events: events.map_or(0, |e| e.max(0) as u64),
            },
            job: r.try_get("reply_job").map_err(db_err)?,
        }))
    }
}
