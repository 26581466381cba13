//! The storage traits on PostgreSQL or SQLite, through sqlx's `Any` driver: one set of
//! queries for both. Placeholders are `$1, $2, …` in order of first use, which both databases
//! read the same way; values are the types both share (text, 64-bit integers, nulls).
//!
//! One file per trait: [`accounts`], [`sessions`], [`transcript`], [`reply_log`],
//! [`responses`]. This one holds the pool, the migrations and the error mapping they share.

mod accounts;
mod reply_log;
mod responses;
mod sessions;
mod transcript;

use std::time::Duration;

use async_trait::async_trait;
use sqlx::any::AnyPoolOptions;
use sqlx::AnyPool;

use super::types::*;
use super::{Store, StoreError, StoreResult};

/// Longest a query waits for a pooled connection before the database counts as unavailable.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);

#[derive(Debug, Clone)]
pub struct SqlStore {
    pool: AnyPool,
    backend: &'static str,
}

fn db_err(e: sqlx::Error) -> StoreError {
    match &e {
        sqlx::Error::RowNotFound => StoreError::NotFound("row"),
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => StoreError::Unavailable(e.to_string()),
        sqlx::Error::Database(d) => match d.code().as_deref().map(classify) {
            Some(Class::Unavailable) => StoreError::Unavailable(e.to_string()),
            Some(Class::BadValue) => StoreError::Invalid(d.message().to_string()),
            _ => StoreError::Internal(e.to_string()),
        },
        _ => StoreError::Internal(e.to_string()),
    }
}

enum Class {
    Unavailable,
    BadValue,
    Other,
}

/// PostgreSQL reports five-character SQLSTATEs (class in the first two); SQLite reports decimal
/// result codes of at most four digits (primary code in the low byte).
fn classify(code: &str) -> Class {
    if code.len() == 5 {
        return match code.get(..2) {
            // Connection exception, insufficient resources, operator intervention (shutdown).
            Some("08" | "53" | "57") => Class::Unavailable,
            // Data exception: a value PostgreSQL cannot store (a NUL character in text, …).
            Some("22") => Class::BadValue,
            _ => Class::Other,
        };
    }
    match code.parse::<u32>() {
        // BUSY, LOCKED, IOERR, FULL, CANTOPEN.
        Ok(c) if matches!(c & 0xff, 5 | 6 | 10 | 13 | 14) => Class::Unavailable,
        _ => Class::Other,
    }
}

/// Maps a unique-constraint violation to `Conflict(what)`, anything else as usual.
fn conflict(what: &'static str) -> impl Fn(sqlx::Error) -> StoreError {
    move |e| match &e {
        sqlx::Error::Database(d) if d.is_unique_violation() => StoreError::Conflict(what),
        _ => db_err(e),
    }
}

impl SqlStore {
    /// Connects (`postgres://…` or `sqlite:…`; a SQLite file is created if missing) and applies
    /// the migrations for that database.
    pub async fn connect(url: &str) -> StoreResult<Self> {
        sqlx::any::install_default_drivers();
        let backend = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            "postgres"
        } else if url.starts_with("sqlite:") {
            "sqlite"
        } else {
            return Err(StoreError::Invalid(format!(
                "database URL must start with postgres:// or sqlite: (got `{}`)",
                url.split(':').next().unwrap_or_default()
            )));
        };
        let pool = AnyPoolOptions::new()
            .max_connections(if backend == "sqlite" { 4 } else { 16 })
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect(url)
            .await
            .map_err(db_err)?;
        let migrated = if backend == "sqlite" {
            // Readers do not wait for the writer; persistent for the database file.
            sqlx::query("PRAGMA journal_mode = WAL")
                .execute(&pool)
                .await
                .map_err(db_err)?;
            sqlx::migrate!("../migrations/sqlite").run(&pool).await
        } else {
            sqlx::migrate!("../migrations/postgres").run(&pool).await
        };
        migrated.map_err(|e| StoreError::Internal(format!("migrations failed: {e}")))?;
        Ok(Self { pool, backend })
    }

    /// `BEGIN`, on a task of its own. A caller cancelled while PostgreSQL has not yet answered
    /// its `BEGIN` (a client gone while the database is slow) would leave the connection in
    /// a transaction that sqlx does not roll back (launchbadge/sqlx#4393): back in the pool,
    /// the next borrower's writes would land in it uncommitted, and vanish. Run to its end,
    /// the transaction is rolled back when it is dropped, whoever drops it.
    async fn begin(&self) -> StoreResult<sqlx::Transaction<'static, sqlx::Any>> {
        let pool = self.pool.clone();
        tokio::spawn(async move { pool.begin().await })
            .await
            .map_err(|e| StoreError::Internal(format!("beginning a transaction: {e}")))?
            .map_err(db_err)
    }

    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// Inside a write transaction: bumps the caller's live session's `updated_at`, which also
    /// takes the write lock up front (SQLite) or locks the session row (PostgreSQL), so
    /// concurrent turns queue instead of failing and a concurrent delete cannot slip between
    /// the check and the write.
    async fn claim(
        tx: &mut sqlx::Transaction<'_, sqlx::Any>,
        user_id: &UserId,
        session_id: &SessionId,
        now: i64,
    ) -> StoreResult<()> {
        let done = sqlx::query(
            "UPDATE sessions SET updated_at = $1 \
             WHERE id = $2 AND user_id = $3 AND deleted_at IS NULL",
        )
        .bind(now)
        .bind(session_id)
        .bind(user_id)
        .execute(&mut **tx)
        .await
        .map_err(db_err)?;
        if done.rows_affected() == 0 {
            return Err(StoreError::NotFound("session"));
        }
        Ok(())
    }
}

#[async_trait]
impl Store for SqlStore {
    fn backend(&self) -> &'static str {
        self.backend
    }

    async fn ping(&self) -> StoreResult<()> {
        sqlx::query("SELECT 1")
            .execute(&self.pool)
            .await
            .map_err(db_err)?;
        Ok(())
    }
}
