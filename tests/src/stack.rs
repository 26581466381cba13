//! The whole stack on loopback ports: real `hearth-worker` processes with a tiny generated model,
//! the real `hearth` binary, and a real database.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use hearth_orchestrator::auth::{issue_key, KeyOptions};
use hearth_orchestrator::storage::SqlStore;
use hearth_worker::fixtures::{write_tiny_gguf, write_tiny_tokenizer, TinySpec, WorkerProcess};

use super::http::Req;
use super::pg::PgDatabase;

/// A temporary directory with a tiny model and its tokenizer.
#[derive(Debug)]
pub struct Assets {
    pub dir: PathBuf,
    pub model: PathBuf,
    pub tokenizer: PathBuf,
}

/// A model big enough that a long reply takes seconds, so a test can act while it streams.
pub fn slow_spec() -> TinySpec {
    TinySpec {
        layers: 8,
        hidden: 512,
        heads: 8,
        kv_heads: 4,
        head_dim: 64,
        ffn: 2048,
        ..TinySpec::default()
    }
}

pub fn assets(tag: &str) -> Assets {
    assets_with(tag, &TinySpec::default())
}

pub fn assets_with(tag: &str, spec: &TinySpec) -> Assets {
    let dir = std::env::temp_dir().join(format!(
        "hearth-{tag}-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let model = dir.join("tiny.gguf");
    write_tiny_gguf(&model, spec).expect("tiny model");
    let tokenizer = dir.join("tiny-tokenizer.json");
    write_tiny_tokenizer(&tokenizer, TinySpec::default().vocab).expect("tiny tokenizer");
    Assets {
        dir,
        model,
        tokenizer,
    }
}

/// `target/<profile>/<name>`, next to the running test's directory; `cargo test --workspace`
/// builds every binary there. Refuses a binary older than the sources it is built from (a
/// `cargo test -p hearth-e2e` after an edit elsewhere would otherwise test yesterday's code).
fn sibling_bin(name: &str, package: &str, sources: &[&str]) -> PathBuf {
    let exe = std::env::current_exe().expect("test path");
    let bin = exe
        .parent()
        .and_then(|d| d.parent())
        .map(|d| d.join(name))
        .expect("target dir");
    assert!(
        bin.is_file(),
        "{} is missing: run `cargo build -p {package}` (or `make test`)",
        bin.display()
    );
    let built = std::fs::metadata(&bin).and_then(|m| m.modified()).ok();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let newest = sources
        .iter()
        .chain(COMMON_SOURCES.iter())
        .filter_map(|d| newest_source(&root.join(d)))
        .max();
    if let (Some(built), Some((changed, file))) = (built, newest) {
        assert!(
            changed <= built,
            "{} is older than {}: run `cargo build -p {package}` (or `make test`)",
            bin.display(),
            file.display()
        );
    }
    bin
}

/// The most recently modified source file (Rust, proto, SQL, Cargo.toml) under `dir`.
fn newest_source(dir: &Path) -> Option<(std::time::SystemTime, PathBuf)> {
    if dir.is_file() {
        let t = std::fs::metadata(dir).and_then(|m| m.modified()).ok()?;
        return Some((t, dir.to_path_buf()));
    }
    let mut newest: Option<(std::time::SystemTime, PathBuf)> = None;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                // `src/bin/*` are other binaries, named one by one where they count.
                if p.file_name().is_some_and(|n| n != "bin") {
                    stack.push(p);
                }
                continue;
            }
            let source = p
                .extension()
                .and_then(|x| x.to_str())
                .is_some_and(|x| matches!(x, "rs" | "proto" | "sql"))
                || p.file_name().is_some_and(|n| n == "Cargo.toml");
            if !source {
                continue;
            }
            if let Ok(t) = e.metadata().and_then(|m| m.modified()) {
                if newest.as_ref().is_none_or(|(n, _)| t > *n) {
                    newest = Some((t, p));
                }
            }
        }
    }
    newest
}

/// What every binary is built from besides its own crate: the shared crate and its build
/// script (the generated gRPC types), and the locked dependency versions.
const COMMON_SOURCES: [&str; 5] = [
    "shared/src",
    "shared/build.rs",
    "shared/Cargo.toml",
    "proto",
    "Cargo.lock",
];
/// `migrations/` is embedded in `hearth` at build time.
const ORCHESTRATOR_SOURCES: &[&str] = &[
    "orchestrator/src",
    "orchestrator/build.rs",
    "orchestrator/Cargo.toml",
    "migrations",
];
const WORKER_SOURCES: &[&str] = &["gpu-worker/src", "gpu-worker/Cargo.toml"];
const E2E_SOURCES: &[&str] = &[
    "tests/src",
    "tests/Cargo.toml",
    "orchestrator/src",
    "orchestrator/build.rs",
    "migrations",
    "gpu-worker/src",
];

pub fn worker_bin() -> PathBuf {
    sibling_bin("hearth-worker", "hearth-worker", WORKER_SOURCES)
}

pub fn hearth_bin() -> PathBuf {
    sibling_bin("hearth", "hearth-orchestrator", ORCHESTRATOR_SOURCES)
}

pub fn bench_bin() -> PathBuf {
    let sources = [E2E_SOURCES, &["tests/src/bin/hearth-bench.rs"]].concat();
    sibling_bin("hearth-bench", "hearth-e2e", &sources)
}

pub fn stack_bin() -> PathBuf {
    let sources = [E2E_SOURCES, &["tests/src/bin/hearth-stack.rs"]].concat();
    sibling_bin("hearth-stack", "hearth-e2e", &sources)
}

/// The flags test workers run with: a KV budget that suits the tiny model.
const WORKER_FLAGS: [&str; 2] = ["--kv-budget", "64MiB"];

pub fn spawn_worker(a: &Assets) -> WorkerProcess {
    WorkerProcess::spawn(&worker_bin(), &a.model, &WORKER_FLAGS).expect("start worker")
}

/// Resident memory of a process, in bytes (Linux).
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// A `hearth` process; killed when dropped.
#[derive(Debug)]
pub struct Hearth {
    pub child: Child,
    pub addr: SocketAddr,
    _stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl Hearth {
    /// Starts `hearth` with `args` (plus a loopback port the OS chose) and reads its address.
    pub fn spawn(args: &[String]) -> Self {
        use std::io::BufRead;
        let mut child = Command::new(hearth_bin())
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start hearth");
        let mut stdout = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        stdout.read_line(&mut line).expect("address line");
        let v: serde_json::Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("hearth printed `{line}` instead of its address: {e}"));
        let addr = v["listening"]["http"]
            .as_str()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no address in `{line}`"));
        Self {
            child,
            addr,
            _stdout: stdout,
        }
    }

    /// Waits until `/readyz` says every worker is ready (not only the first, so a test that
    /// kills one knows another can take over).
    pub async fn wait_ready(&self) {
        for _ in 0..600 {
            let r = Req::new("GET", "/readyz").send(self.addr).await;
            let all = r.json()["workers"]
                .as_array()
                .is_some_and(|w| w.iter().all(|w| w["ready"] == true));
            if r.status == 200 && all {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("hearth at {} never became ready", self.addr);
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Hearth {
    fn drop(&mut self) {
        self.kill();
    }
}

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
            Db::Sqlite => (
                None,
                format!(
                    "sqlite://{}?mode=rwc",
                    assets.dir.join("hearth.db").display()
                ),
            ),
        };
        let workers: Vec<WorkerProcess> = (0..workers)
            .map(|_| {
                WorkerProcess::spawn(&worker_bin(), &assets.model, worker_flags)
                    .expect("start worker")
            })
            .collect();
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

pub fn path(p: &Path) -> String {
    p.display().to_string()
}

/// `hearth_worker_in_flight_requests` from a worker's `/metrics`.
/// Panics when the worker does not export it (it is set on every scrape), rather than reading
/// a missing metric as "nothing in flight".
pub async fn worker_in_flight(w: &WorkerProcess) -> f64 {
    worker_metric(w, "hearth_worker_in_flight_requests").await
}

/// Waits up to 2 s for a worker to have nothing in flight; returns what it has left.
pub async fn wait_idle(w: &WorkerProcess) -> f64 {
    let mut left = worker_in_flight(w).await;
    for _ in 0..100 {
        if left == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        left = worker_in_flight(w).await;
    }
    left
}

/// The value of the unlabelled metric `name` on the `/metrics` page at `addr` (a worker's
/// metrics address or an orchestrator's). Panics when the page does not export it, so a
/// renamed metric fails the test instead of reading as 0.
pub async fn metric(addr: SocketAddr, name: &str) -> f64 {
    let text = Req::new("GET", "/metrics").send(addr).await.text();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{addr}/metrics does not export {name}"))
}

/// A worker's metric (see [`metric`]).
pub async fn worker_metric(w: &WorkerProcess, name: &str) -> f64 {
    metric(w.metrics.parse().expect("metrics addr"), name).await
}

/// Tokens the worker's engine has decoded, over every request.
pub const DECODED: &str = "hearth_worker_decode_tokens_total";

/// Asserts that the worker has stopped decoding (its decoded-token counter stands still for
/// 300 ms) and decoded fewer than `limit` tokens in all: a generation was cancelled, not run to
/// its end (which would also leave the worker idle).
pub async fn assert_cancelled_before(w: &WorkerProcess, limit: u32) {
    let decoded = worker_metric(w, DECODED).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        worker_metric(w, DECODED).await,
        decoded,
        "the worker kept decoding"
    );
    assert!(
        decoded < f64::from(limit),
        "the reply ran to its end: {decoded} tokens"
    );
}

/// A session's stored messages, in order.
pub async fn history(addr: SocketAddr, key: &str, sid: &str) -> Vec<serde_json::Value> {
    let r = Req::new("GET", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(key))
        .send(addr)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["data"].as_array().cloned().expect("messages")
}

/// Waits, if need be, until the current UTC minute (the rate limiter's window) has at least
/// `need` left, so a test that counts requests per minute does all its counting in one window.
pub async fn clear_of_a_minute_boundary(need: Duration) {
    let now = hearth_orchestrator::storage::now_ms();
    let left = 60_000 - now.rem_euclid(60_000);
    if left < need.as_millis() as i64 {
        tokio::time::sleep(Duration::from_millis(left as u64 + 50)).await;
    }
}

/// Polls `metric` at `addr` until `want(value)` holds; the last value either way.
pub async fn wait_metric(
    addr: SocketAddr,
    name: &str,
    timeout: Duration,
    want: impl Fn(f64) -> bool,
) -> f64 {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let v = metric(addr, name).await;
        if want(v) || tokio::time::Instant::now() >= deadline {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sends a POSIX signal to a child process (SIGSTOP, SIGCONT, SIGTERM…).
pub fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on a child this process started and has not reaped.
    let rc = unsafe { libc::kill(child.id() as i32, sig) };
    assert_eq!(rc, 0, "kill({}, {sig})", child.id());
}

/// An OpenAI chat completion (`body`, not streamed) that must succeed; its JSON reply.
pub async fn chat_completion(
    addr: SocketAddr,
    key: &str,
    body: &serde_json::Value,
) -> serde_json::Value {
    let r = Req::new("POST", "/v1/chat/completions")
        .key(Some(key))
        .json(body)
        .send(addr)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// Creates an empty session for `key`'s user; its id.
pub async fn new_session(addr: SocketAddr, key: &str) -> String {
    let r = Req::new("POST", "/v1/sessions")
        .key(Some(key))
        .json(&serde_json::json!({}))
        .send(addr)
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    r.json()["id"].as_str().expect("id").to_string()
}

impl Stack {
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
}

/// A reply of exactly `tokens` tokens to a new message in `sid`, streamed.
pub async fn stream_turn(addr: SocketAddr, key: &str, sid: &str, tokens: u32) -> super::http::Sse {
    let sse = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(key))
        .json(
            &serde_json::json!({"content": "Tell me everything", "max_tokens": tokens,
                                  "ignore_eos": true}),
        )
        .events(addr)
        .await;
    assert_eq!(sse.status, 200);
    sse
}

/// The index of the worker that has a request in flight (the test's one running reply); waits
/// up to 5 s for one to show it.
pub async fn serving_worker(s: &Stack) -> usize {
    for _ in 0..250 {
        for (i, w) in s.workers.iter().enumerate() {
            if worker_in_flight(w).await >= 1.0 {
                return i;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no worker has a request in flight");
}
