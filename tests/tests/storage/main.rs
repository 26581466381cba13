//! One storage suite, run against SQLite (a temporary file) and PostgreSQL (a fresh database on
//! `TEST_DATABASE_URL`, default the local server). A missing PostgreSQL fails the test.
//!
//! The suites, by concern: `accounts` (users, keys, one user's data hidden from another),
//! `listing` (sessions, paging, search), `replies` (turns, streaming, finishing, edits),
//! `kept` (the Responses API's kept responses) and `races` (concurrent turns on one session).

mod accounts;
mod kept;
mod listing;
mod races;
mod replies;

use hearth_orchestrator::storage::{
    Checkpoint, Completion, Finish, FunctionCall, KeyId, KeyRole, MessageId, MessageStatus,
    NewApiKey, NewSession, NewToolResult, ReplyLease, ReplyLog, ReplyTimings, ReplyUsage, Role,
    SessionId, SessionPatch, SessionQuery, SqlStore, Store, StoreError, StreamingReply, ToolCall,
    UserId,
};

use hearth_e2e::pg::PgDatabase;

fn sqlite_url(tag: &str) -> (std::path::PathBuf, String) {
    let dir = std::env::temp_dir().join(format!(
        "hearth-storage-{tag}-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let url = format!("sqlite://{}?mode=rwc", dir.join("hearth.db").display());
    (dir, url)
}

/// Runs `suite` on both databases.
macro_rules! both {
    ($name:ident, $suite:path) => {
        mod $name {
            use super::*;

            #[tokio::test]
            async fn sqlite() {
                let (dir, url) = sqlite_url(stringify!($name));
                let store = SqlStore::connect(&url).await.expect("sqlite");
                assert_eq!(store.backend(), "sqlite");
                $suite(&store).await;
                store.close().await;
                let _ = std::fs::remove_dir_all(dir);
            }

            #[tokio::test]
            async fn postgres() {
                let (db, url) = PgDatabase::create(stringify!($name)).await;
                let store = SqlStore::connect(&url).await.expect("postgres");
                assert_eq!(store.backend(), "postgres");
                $suite(&store).await;
                store.close().await;
                db.drop_db().await;
            }
        }
    };
}

both!(users_and_keys, accounts::users_and_keys_suite);
both!(sessions, listing::sessions_suite);
both!(turns, replies::turns_suite);
both!(isolation, accounts::isolation_suite);
both!(concurrency, races::concurrency_suite);
both!(search_and_values, listing::search_and_values_suite);
both!(edit, replies::edit_suite);
both!(purge, replies::purge_suite);
both!(tools, replies::tools_suite);
both!(responses, kept::responses_suite);

#[tokio::test]
async fn sqlite_migration_keeps_messages() {
    let (dir, url) = sqlite_url("migration");
    replies::migration_keeps_messages(&url, "sqlite").await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn postgres_migration_keeps_messages() {
    let (db, url) = PgDatabase::create("migration").await;
    replies::migration_keeps_messages(&url, "postgres").await;
    db.drop_db().await;
}

#[tokio::test]
async fn a_bad_database_url_is_a_clear_error() {
    let e = SqlStore::connect("mysql://localhost/x")
        .await
        .expect_err("unsupported");
    assert!(e.to_string().contains("postgres:// or sqlite:"), "{e}");
    let e = SqlStore::connect("postgres://postgres@127.0.0.1:1/none")
        .await
        .expect_err("nothing listens on port 1");
    assert!(matches!(e, StoreError::Unavailable(_)), "{e:?}");
}

/// Ends the reply `id` (begun by this replica: its first lease) as `done`.
pub(crate) async fn finish(s: &SqlStore, id: &MessageId, done: &Completion) {
    let owned = s
        .finish_message(&ReplyLease::first(id.clone()), done)
        .await
        .expect("finish");
    assert!(owned, "the reply was still streaming under its first lease");
}

/// Saves the reply `id`'s text so far (its first lease; a checkpoint of no tokens).
pub(crate) async fn progress(s: &SqlStore, id: &MessageId, text: &str) -> bool {
    let cp = Checkpoint {
        content: text.into(),
        ..Checkpoint::default()
    };
    s.save_progress(&ReplyLease::first(id.clone()), &cp)
        .await
        .expect("progress")
}

/// A finished reply, for building history.
pub(crate) fn complete(text: &str) -> Completion {
    Completion {
        content: text.into(),
        status: MessageStatus::Complete,
        finish_reason: Finish::Stop,
        usage: ReplyUsage {
            prompt_tokens: 10,
            cached_tokens: 0,
            completion_tokens: 3,
        },
        timings: ReplyTimings {
            ttft_ms: Some(5),
            duration_ms: 20,
        },
        worker: Some("w".into()),
        tool_calls: None,
    }
}
