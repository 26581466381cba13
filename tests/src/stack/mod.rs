//! The whole stack on loopback ports: real `hearth-worker` processes with a tiny generated model,
//! the real `hearth` binary, and a real database, and what the tests do with it.
//!
//! [`Stack`] (here) starts and stops it and issues keys. The parts: `assets` writes the tiny
//! model and tokenizer, `bins` finds the built binaries (and refuses stale ones), `process` runs
//! and signals the processes, `metrics` reads and waits on `/metrics`, `api` calls the HTTP API
//! the way the tests do, and `stream` reads streamed replies. Everything is re-exported here, so a
//! test imports from `hearth_e2e::stack` alone.

mod api;
mod assets;
mod bins;
mod metrics;
mod process;
mod stream;

use std::net::SocketAddr;
use std::path::Path;

use hearth_orchestrator::auth::{issue_key, KeyOptions};
use hearth_orchestrator::storage::SqlStore;
use hearth_worker::fixtures::{TinySpec, WorkerProcess};

pub use api::{
    chat_completion, clear_of_a_minute_boundary, completion, history, json_turn, new_session,
    new_session_with, post, settled_reply, stream_turn, stream_turn_with,
};
pub use assets::{assets, assets_with, path, slow_spec, Assets};
pub use bins::{bench_bin, hearth_bin, stack_bin, worker_bin};
pub use metrics::{
    assert_cancelled_before, metric, serving_worker, wait_idle, wait_metric, worker_in_flight,
    worker_metric, DECODED, PREFILLED,
};
pub use process::{
    rss_bytes, scripted_worker, signal, spawn_worker, wait_exit, worker_at, worker_with, Hearth,
    WORKER_TOKEN,
};
pub use stream::{event_seq, finish, fold, read_tokens, token_text, Streamed};

use crate::pg::PgDatabase;
use process::WORKER_FLAGS;

/// Which database a stack uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Db {
    Postgres,
    Sqlite,
}

/// Workers, one orchestrator with keys on, a database, and a store on it for the test's own
/// checks and keys.
#[derive(Debug)]
pub struct Stack {
    pub assets: Assets,
    pub workers: Vec<WorkerProcess>,
    pub hearth: Hearth,
    pub store: SqlStore,
    pub db_url: String,
    pg: Option<PgDatabase>,
}

impl Stack {
    pub async fn start(tag: &str, db: Db, workers: usize, extra: &[&str]) -> Self {
        Self::start_with(tag, &TinySpec::default(), db, workers, extra).await
    }

    pub async fn start_with(
        tag: &str,
        spec: &TinySpec,
        db: Db,
        workers: usize,
        extra: &[&str],
    ) -> Self {
        Self::start_full(tag, spec, db, workers, &WORKER_FLAGS, extra).await
    }

    /// `workers` scripted workers (a token every `token_ms`, no model) and `hearth` with `extra`.
    pub async fn scripted(
        tag: &str,
        db: Db,
        workers: usize,
        token_ms: u64,
        extra: &[&str],
    ) -> Self {
        let ms = token_ms.to_string();
        let flags = ["--scripted-token-ms", ms.as_str()];
        Self::start_full(tag, &TinySpec::default(), db, workers, &flags, extra).await
    }

    /// Workers started with `worker_flags` (e.g. a scripted worker for load tests) and `hearth`
    /// with `extra` flags.
    pub async fn start_full(
        tag: &str,
        spec: &TinySpec,
        db: Db,
        workers: usize,
        worker_flags: &[&str],
        extra: &[&str],
    ) -> Self {
        let assets = assets_with(tag, spec);
        let (pg, db_url) = match db {
            Db::Postgres => {
                let (pg, url) = PgDatabase::create(tag).await;
                (Some(pg), url)
            }
            Db::Sqlite => (None, assets.sqlite_url()),
        };
        let workers: Vec<WorkerProcess> = (0..workers)
            .map(|_| worker_with(&assets.model, worker_flags))
            .collect();
        Self::around(assets, workers, db_url, pg, extra).await
    }

    /// `hearth` with `extra` flags in front of `workers`, on `db_url`.
    async fn around(
        assets: Assets,
        workers: Vec<WorkerProcess>,
        db_url: String,
        pg: Option<PgDatabase>,
        extra: &[&str],
    ) -> Self {
        let hearth = Hearth::spawn(&Self::args(&assets, &db_url, &workers, extra));
        hearth.wait_ready().await;
        let store = SqlStore::connect(&db_url).await.expect("store");
        Self {
            assets,
            workers,
            hearth,
            store,
            db_url,
            pg,
        }
    }

    /// One worker for each of `specs` (`name` or `name@version`), serving it from the model
    /// repository `root`, and `hearth` with `extra` flags, on SQLite.
    pub async fn from_repository(tag: &str, root: &Path, specs: &[&str], extra: &[&str]) -> Self {
        Self::from_repository_with(tag, root, specs, &[], extra).await
    }

    /// [`Self::from_repository`], its workers started with `worker_flags` too.
    pub async fn from_repository_with(
        tag: &str,
        root: &Path,
        specs: &[&str],
        worker_flags: &[&str],
        extra: &[&str],
    ) -> Self {
        let assets = assets_with(tag, &TinySpec::default());
        let db_url = assets.sqlite_url();
        let root = path(root);
        let mut flags = WORKER_FLAGS.to_vec();
        flags.extend(["--repository", root.as_str()]);
        flags.extend_from_slice(worker_flags);
        let workers = specs
            .iter()
            .map(|spec| worker_with(Path::new(spec), &flags))
            .collect();
        Self::around(assets, workers, db_url, None, extra).await
    }

    pub fn args(
        assets: &Assets,
        db_url: &str,
        workers: &[WorkerProcess],
        extra: &[&str],
    ) -> Vec<String> {
        let mut args: Vec<String> = vec![
            "--database-url".into(),
            db_url.into(),
            "--tokenizer".into(),
            path(&assets.tokenizer),
            "--auth".into(),
            "keys".into(),
            "--health-interval-ms".into(),
            "100".into(),
        ];
        for w in workers {
            args.push("--worker".into());
            args.push(w.grpc.clone());
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    }

    pub fn addr(&self) -> SocketAddr {
        self.hearth.addr
    }

    pub async fn key(&self, user: &str) -> String {
        self.key_with(user, KeyOptions::default()).await
    }

    /// A key allowed `requests_per_minute` generation requests a minute.
    pub async fn limited_key(&self, user: &str, requests_per_minute: i64) -> String {
        self.key_with(
            user,
            KeyOptions {
                requests_per_minute: Some(requests_per_minute),
                ..KeyOptions::default()
            },
        )
        .await
    }

    pub async fn key_with(&self, user: &str, options: KeyOptions) -> String {
        issue_key(&self.store, user, options)
            .await
            .expect("key")
            .key
    }

    /// Drops the test database.
    pub async fn finish(mut self) {
        self.hearth.kill();
        self.store.close().await;
        if let Some(pg) = self.pg.take() {
            pg.drop_db().await;
        }
        let _ = std::fs::remove_dir_all(&self.assets.dir);
    }
}
