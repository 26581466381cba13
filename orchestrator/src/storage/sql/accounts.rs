//! [`Accounts`] in SQL: users and API keys.

use async_trait::async_trait;
use sqlx::any::AnyRow;
use sqlx::Row;

use super::{conflict, db_err, SqlStore};
use crate::storage::types::*;
use crate::storage::{Accounts, StoreError, StoreResult};

fn api_key_from(r: &AnyRow) -> StoreResult<(ApiKey, User)> {
    let key = ApiKey {
        id: r.try_get("id").map_err(db_err)?,
        user_id: r.try_get("user_id").map_err(db_err)?,
        prefix: r.try_get("prefix").map_err(db_err)?,
        key_hash: r.try_get("key_hash").map_err(db_err)?,
        requests_per_minute: r.try_get("requests_per_minute").map_err(db_err)?,
        tokens_per_day: r.try_get("tokens_per_day").map_err(db_err)?,
        created_at: r.try_get("created_at").map_err(db_err)?,
        expires_at: r.try_get("expires_at").map_err(db_err)?,
        revoked_at: r.try_get("revoked_at").map_err(db_err)?,
        // Stored as the `admin` flag: 1 for an admin key.
        role: match r.try_get::<i64, _>("admin").map_err(db_err)? {
            0 => KeyRole::User,
            _ => KeyRole::Admin,
        },
    };
    let user = User {
        id: key.user_id.clone(),
        name: r.try_get("user_name").map_err(db_err)?,
        created_at: r.try_get("user_created_at").map_err(db_err)?,
    };
    Ok((key, user))
}

#[async_trait]
impl Accounts for SqlStore {
    async fn create_user(&self, name: &str) -> StoreResult<User> {
        let user = User {
            id: UserId::random(),
            name: name.to_string(),
            created_at: now_ms(),
        };
        sqlx::query("INSERT INTO users (id, name, created_at) VALUES ($1, $2, $3)")
            .bind(&user.id)
            .bind(&user.name)
            .bind(user.created_at)
            .execute(&self.pool)
            .await
            .map_err(conflict("user"))?;
        Ok(user)
    }

    async fn ensure_user(&self, name: &str) -> StoreResult<User> {
        sqlx::query(
            "INSERT INTO users (id, name, created_at) VALUES ($1, $2, $3) \
             ON CONFLICT (name) DO NOTHING",
        )
        .bind(UserId::random())
        .bind(name)
        .bind(now_ms())
        .execute(&self.pool)
        .await
        .map_err(db_err)?;
        self.user_by_name(name)
            .await?
            .ok_or_else(|| StoreError::Internal(format!("user {name} was not created")))
    }

    async fn user_by_name(&self, name: &str) -> StoreResult<Option<User>> {
        let row = sqlx::query("SELECT id, name, created_at FROM users WHERE name = $1")
            .bind(name)
            .fetch_optional(&self.pool)
            .await
            .map_err(db_err)?;
        row.map(|r| {
            Ok(User {
                id: r.try_get("id").map_err(db_err)?,
                name: r.try_get("name").map_err(db_err)?,
                created_at: r.try_get("created_at").map_err(db_err)?,
            })
        })
        .transpose()
    }

    async fn insert_api_key(&self, k: NewApiKey) -> StoreResult<ApiKey> {
        let key = ApiKey {
            id: KeyId::random(),
            user_id: k.user_id,
            prefix: k.prefix,
            key_hash: k.key_hash,
            requests_per_minute: k.requests_per_minute,
            tokens_per_day: k.tokens_per_day,
            created_at: now_ms(),
            expires_at: k.expires_at,
            revoked_at: None,
            role: k.role,
        };
        sqlx::query(
            "INSERT INTO api_keys (id, user_id, prefix, key_hash, requests_per_minute, \
             tokens_per_day, created_at, expires_at, admin) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(&key.id)
        .bind(&key.user_id)
        .bind(&key.prefix)
        .bind(&key.key_hash)
        .bind(key.requests_per_minute)
        .bind(key.tokens_per_day)
        .bind(key.created_at)
        .bind(key.expires_at)
        .bind(i64::from(key.role.is_admin()))
        .execute(&self.pool)
        .await
        .map_err(conflict("api key"))?;
        Ok(key)
    }

    async fn api_keys_by_prefix(&self, prefix: &str) -> StoreResult<Vec<(ApiKey, User)>> {
        let rows = sqlx::query(
            "SELECT k.id, k.user_id, k.prefix, k.key_hash, k.requests_per_minute, \
             k.tokens_per_day, k.created_at, k.expires_at, k.revoked_at, k.admin, \
             u.name AS user_name, u.created_at AS user_created_at \
             FROM api_keys k JOIN users u ON u.id = k.user_id WHERE k.prefix = $1",
        )
        .bind(prefix)
        .fetch_all(&self.pool)
        .await
        .map_err(db_err)?;
        rows.iter().map(api_key_from).collect()
    }

    async fn revoke_api_key(&self, key_id: &KeyId, at_ms: i64) -> StoreResult<()> {
        let done =
            sqlx::query("UPDATE api_keys SET revoked_at = COALESCE(revoked_at, $1) WHERE id = $2")
                .bind(at_ms)
                .bind(key_id)
                .execute(&self.pool)
                .await
                .map_err(db_err)?;
        if done.rows_affected() == 0 {
            return Err(StoreError::NotFound("api key"));
        }
        Ok(())
    }
}
