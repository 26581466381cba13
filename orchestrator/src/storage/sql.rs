//! The [`Store`] on PostgreSQL or SQLite, through sqlx's `Any` driver: one set of queries for
//! both. Placeholders are `$1, $2, …` in order of first use, which both databases read the same
//! way; values are the types both share (text, 64-bit integers, nulls).

use std::time::Duration;

use async_trait::async_trait;
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{AnyPool, Row};

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
        let now = now_ms();
        Self::claim(&mut tx, user_id, session_id, now).await?;
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
        .fetch_optional(&mut *tx)
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
                let edited = edit_message(&mut tx, session_id, message_id, content, now).await?;
                let after = edited.seq + 1;
                written.push(edited);
                Some(after)
            }
        };
        if let Some(seq) = truncate_from {
            sqlx::query("DELETE FROM messages WHERE session_id = $1 AND seq >= $2")
                .bind(session_id)
                .bind(seq)
                .execute(&mut *tx)
                .await
                .map_err(db_err)?;
        }
        for m in messages {
            written.push(insert_message(&mut tx, session_id, m, now).await?);
        }
        tx.commit().await.map_err(db_err)?;
        Ok(written)
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

/// How a write changes the history before appending.
#[derive(Debug, Clone, Copy)]
enum Rewrite<'a> {
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

const SESSION_COLUMNS: &str =
    "id, title, system_prompt, params, max_tokens, model, created_at, updated_at";
const MESSAGE_COLUMNS: &str = "id, seq, role, content, status, finish_reason, prompt_tokens, \
     cached_tokens, completion_tokens, ttft_ms, duration_ms, worker, tool_calls, tool_call_id, \
     created_at, updated_at";

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

fn message_from(r: &AnyRow) -> StoreResult<Message> {
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
        admin: r.try_get::<i64, _>("admin").map_err(db_err)? != 0,
    };
    let user = User {
        id: key.user_id.clone(),
        name: r.try_get("user_name").map_err(db_err)?,
        created_at: r.try_get("user_created_at").map_err(db_err)?,
    };
    Ok((key, user))
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
struct NewMessage<'a> {
    role: Role,
    content: &'a str,
    status: MessageStatus,
    /// For a `tool` message: the call it answers.
    tool_call_id: Option<&'a str>,
}

impl<'a> NewMessage<'a> {
    fn user(content: &'a str) -> Self {
        Self {
            role: Role::User,
            content,
            status: MessageStatus::Complete,
            tool_call_id: None,
        }
    }

    /// An empty reply, streaming.
    fn reply() -> Self {
        Self {
            role: Role::Assistant,
            content: "",
            status: MessageStatus::Streaming,
            tool_call_id: None,
        }
    }

    fn tool(r: &'a NewToolResult) -> Self {
        Self {
            role: Role::Tool,
            content: &r.content,
            status: MessageStatus::Complete,
            tool_call_id: Some(&r.tool_call_id),
        }
    }
}

/// Inserts a message inside a transaction, at the session's next sequence number.
async fn insert_message(
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
    sqlx::query(
        "INSERT INTO messages (id, session_id, seq, role, content, status, tool_call_id, \
         created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8)",
    )
    .bind(&id)
    .bind(session_id)
    .bind(seq + 1)
    .bind(m.role.as_str())
    .bind(m.content)
    .bind(m.status.as_str())
    .bind(m.tool_call_id)
    .bind(now)
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
        tool_calls: None,
        tool_call_id: m.tool_call_id.map(str::to_string),
        created_at: now,
        updated_at: now,
    })
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
            admin: k.admin,
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
        .bind(i64::from(key.admin))
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
    async fn purge_deleted(&self, before_ms: i64) -> StoreResult<(u64, u64)> {
        let mut tx = self.begin().await?;
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
