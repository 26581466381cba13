//! [`Sessions`] in SQL: a user's chats, soft deletion and the purge.

use async_trait::async_trait;
use sqlx::any::AnyRow;
use sqlx::Row;

use super::{db_err, SqlStore};
use crate::storage::types::*;
use crate::storage::{Sessions, StoreError, StoreResult};

const SESSION_COLUMNS: &str =
    "id, title, system_prompt, params, max_tokens, model, created_at, updated_at";

fn session_from(r: &AnyRow) -> StoreResult<Session> {
    let params: Option<String> = r.try_get("params").map_err(db_err)?;
    Ok(Session {
        id: r.try_get("id").map_err(db_err)?,
        title: r.try_get("title").map_err(db_err)?,
        system_prompt: r.try_get("system_prompt").map_err(db_err)?,
        params: params
            .map(|p| serde_json::from_str(&p))
            .transpose()
            .map_err(|e| StoreError::Internal(format!("stored session params: {e}")))?,
        max_tokens: r.try_get("max_tokens").map_err(db_err)?,
        model: r.try_get("model").map_err(db_err)?,
        created_at: r.try_get("created_at").map_err(db_err)?,
        updated_at: r.try_get("updated_at").map_err(db_err)?,
    })
}

fn json_text(v: &Option<serde_json::Value>) -> Option<String> {
    v.as_ref().map(serde_json::Value::to_string)
}

/// `%text%` for LIKE, with LIKE's own wildcards escaped (`ESCAPE '\'`).
fn like_pattern(q: &str) -> String {
    let mut p = String::with_capacity(q.len() + 2);
    p.push('%');
    for c in q.to_lowercase().chars() {
        if matches!(c, '%' | '_' | '\\') {
            p.push('\\');
        }
        p.push(c);
    }
    p.push('%');
    p
}

#[async_trait]
impl Sessions for SqlStore {
    #[tracing::instrument(name = "db.create_session", skip_all, fields(db.system = self.backend))]
    async fn create_session(&self, user_id: &UserId, new: NewSession) -> StoreResult<Session> {
        let now = now_ms();
        let s = Session {
            id: SessionId::random(),
            title: new.title,
            system_prompt: new.system_prompt,
            params: new.params,
            max_tokens: new.max_tokens,
            model: new.model,
            created_at: now,
            updated_at: now,
        };
        sqlx::query(
            "INSERT INTO sessions (id, user_id, title, title_lower, system_prompt, params, \
             max_tokens, model, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $9)",
        )
        .bind(&s.id)
        .bind(user_id)
        .bind(&s.title)
        .bind(s.title.to_lowercase())
        .bind(&s.system_prompt)
        .bind(json_text(&s.params))
        .bind(s.max_tokens)
        .bind(&s.model)
        .bind(now)
        .execute(&self.pool)
        .await
        .map_err(db_err)?;
        Ok(s)
    }

    async fn list_sessions(
        &self,
        user_id: &UserId,
        query: &SessionQuery,
    ) -> StoreResult<Vec<Session>> {
        let mut sql = format!(
            "SELECT {SESSION_COLUMNS} FROM sessions WHERE user_id = $1 AND deleted_at IS NULL"
        );
        let mut n = 1;
        let mut next = || {
            n += 1;
            n
        };
        let pattern = query
            .q
            .as_deref()
            .filter(|q| !q.is_empty())
            .map(like_pattern);
        if pattern.is_some() {
            sql += &format!(" AND title_lower LIKE ${} ESCAPE '\\'", next());
        }
        if query.before.is_some() {
            let (a, b) = (next(), next());
            sql += &format!(" AND (updated_at < ${a} OR (updated_at = ${a} AND id < ${b}))");
        }
        sql += &format!(" ORDER BY updated_at DESC, id DESC LIMIT ${}", next());
        let mut q = sqlx::query(&sql).bind(user_id);
        if let Some(p) = &pattern {
            q = q.bind(p.clone());
        }
        if let Some((at, id)) = &query.before {
            q = q.bind(*at).bind(id.clone());
        }
        let rows = q
            .bind(i64::from(query.limit.clamp(1, 200)))
            .fetch_all(&self.pool)
            .await
            .map_err(db_err)?;
        rows.iter().map(session_from).collect()
    }

    #[tracing::instrument(name = "db.get_session", skip_all, fields(db.system = self.backend))]
    async fn get_session(&self, user_id: &UserId, session_id: &SessionId) -> StoreResult<Session> {
        let sql = format!(
            "SELECT {SESSION_COLUMNS} FROM sessions \
             WHERE id = $1 AND user_id = $2 AND deleted_at IS NULL"
        );
        let row = sqlx::query(&sql)
            .bind(session_id)
            .bind(user_id)
            .fetch_optional(&self.pool)
            .await
            .map_err(db_err)?
            .ok_or(StoreError::NotFound("session"))?;
        session_from(&row)
    }

    #[tracing::instrument(name = "db.count_sessions", skip_all, fields(db.system = self.backend))]
    async fn count_sessions(&self, user_id: &UserId) -> StoreResult<u64> {
        let n: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM sessions WHERE user_id = $1 AND deleted_at IS NULL",
        )
        .bind(user_id)
        .fetch_one(&self.pool)
        .await
        .map_err(db_err)?;
        Ok(n.max(0) as u64)
    }

    async fn update_session(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        patch: SessionPatch,
    ) -> StoreResult<Session> {
        let mut tx = self.begin().await?;
        Self::claim(&mut tx, user_id, session_id, now_ms()).await?;
        if let Some(title) = &patch.title {
            sqlx::query("UPDATE sessions SET title = $1, title_lower = $2 WHERE id = $3")
                .bind(title)
                .bind(title.to_lowercase())
                .bind(session_id)
                .execute(&mut *tx)
                .await
                .map_err(db_err)?;
        }
        if let Some(system) = &patch.system_prompt {
            sqlx::query("UPDATE sessions SET system_prompt = $1 WHERE id = $2")
                .bind(system.clone())
                .bind(session_id)
                .execute(&mut *tx)
                .await
                .map_err(db_err)?;
        }
        if let Some(params) = &patch.params {
            sqlx::query("UPDATE sessions SET params = $1 WHERE id = $2")
                .bind(json_text(params))
                .bind(session_id)
                .execute(&mut *tx)
                .await
                .map_err(db_err)?;
        }
        if let Some(max_tokens) = patch.max_tokens {
            sqlx::query("UPDATE sessions SET max_tokens = $1 WHERE id = $2")
                .bind(max_tokens)
                .bind(session_id)
                .execute(&mut *tx)
                .await
                .map_err(db_err)?;
        }
        if let Some(model) = &patch.model {
            sqlx::query("UPDATE sessions SET model = $1 WHERE id = $2")
                .bind(model.clone())
                .bind(session_id)
                .execute(&mut *tx)
                .await
                .map_err(db_err)?;
        }
        // Read back inside the transaction: what the caller sees is what was committed.
        let sql = format!("SELECT {SESSION_COLUMNS} FROM sessions WHERE id = $1");
        let row = sqlx::query(&sql)
            .bind(session_id)
            .fetch_one(&mut *tx)
            .await
            .map_err(db_err)?;
        tx.commit().await.map_err(db_err)?;
        session_from(&row)
    }

    async fn delete_session(&self, user_id: &UserId, session_id: &SessionId) -> StoreResult<()> {
        let done = sqlx::query(
            "UPDATE sessions SET deleted_at = $1 \
             WHERE id = $2 AND user_id = $3 AND deleted_at IS NULL",
        )
        .bind(now_ms())
        .bind(session_id)
        .bind(user_id)
        .execute(&self.pool)
        .await
        .map_err(db_err)?;
        if done.rows_affected() == 0 {
            return Err(StoreError::NotFound("session"));
        }
        Ok(())
    }

    async fn purge_deleted(&self, before_ms: i64) -> StoreResult<(u64, u64)> {
        let mut tx = self.begin().await?;
        // Their responses first, where the database does not cascade (SQLite without its
        // foreign keys enforced).
        sqlx::query(
            "DELETE FROM responses WHERE session_id IN \
             (SELECT id FROM sessions WHERE deleted_at IS NOT NULL AND deleted_at < $1)",
        )
        .bind(before_ms)
        .execute(&mut *tx)
        .await
        .map_err(db_err)?;
        let messages = sqlx::query(
            "DELETE FROM messages WHERE session_id IN \
             (SELECT id FROM sessions WHERE deleted_at IS NOT NULL AND deleted_at < $1)",
        )
        .bind(before_ms)
        .execute(&mut *tx)
        .await
        .map_err(db_err)?
        .rows_affected();
        let sessions =
            sqlx::query("DELETE FROM sessions WHERE deleted_at IS NOT NULL AND deleted_at < $1")
                .bind(before_ms)
                .execute(&mut *tx)
                .await
                .map_err(db_err)?
                .rows_affected();
        tx.commit().await.map_err(db_err)?;
        Ok((sessions, messages))
    }
}
