//! `hearth` (serve): configuration, start-up and shutdown.
//!
//! With no `--worker`, the quick start: a local `hearth-worker` child on a loopback port (model
//! from the models directory), SQLite under the data directory, no Redis, no auth.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use tokio::io::AsyncBufReadExt;

use crate::api::{router, ApiOptions, AppState, AuthMode};
use crate::bus::StopBus;
use crate::generate::{Generator, Streams};
use crate::limits::{connect_redis, Limiter};
use crate::storage::Store;
use crate::workers::{Affinity, BatchConfig, PoolConfig, WorkerPool};

/// The local user every request acts as when auth is off.
pub const LOCAL_USER: &str = "local";
const DEFAULT_TOKENIZER: &str = "gemma-3-tokenizer.json";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AuthArg {
    /// No keys: every request is the local user. Loopback addresses only.
    None,
    /// `Authorization: Bearer hk_…` on every request (`hearth keys create`).
    Keys,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// HTTP address to listen on.
    #[arg(long, env = "HEARTH_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// A worker's gRPC address (repeat for several). None: start a local worker.
    #[arg(long = "worker", env = "HEARTH_WORKERS", value_delimiter = ',')]
    pub workers: Vec<String>,
    /// Whether requests need an API key.
    #[arg(long, env = "HEARTH_AUTH", value_enum, default_value = "none")]
    pub auth: AuthArg,
    /// Gemma tokenizer.json [default: <models dir>/gemma-3-tokenizer.json].
    #[arg(long, env = "HEARTH_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// Where `scripts/fetch-model.sh` puts models [default: ~/.cache/hearth/models].
    #[arg(long, env = "HEARTH_MODELS_DIR")]
    pub models_dir: Option<PathBuf>,
    /// GGUF model for the local worker [default: the worker's default in the models dir].
    #[arg(long, env = "HEARTH_MODEL")]
    pub model: Option<PathBuf>,
    /// The `hearth-worker` binary for the local worker [default: next to `hearth`].
    #[arg(long, env = "HEARTH_WORKER_BIN")]
    pub worker_bin: Option<PathBuf>,
    /// Extra argument for the local worker (repeat), e.g. `--worker-arg=--kv-budget=1GiB`.
    #[arg(long = "worker-arg", allow_hyphen_values = true)]
    pub worker_args: Vec<String>,
    /// Redis for what replicas share (rate limits, session affinity). None: in process.
    #[arg(long, env = "HEARTH_REDIS_URL")]
    pub redis_url: Option<String>,
    /// Send queued requests to a worker when this many are waiting…
    #[arg(long, env = "HEARTH_BATCH_SIZE", default_value_t = 32)]
    pub batch_size: usize,
    /// …or this many milliseconds after the first.
    #[arg(long, env = "HEARTH_BATCH_DELAY_MS", default_value_t = 2)]
    pub batch_delay_ms: u64,
    /// Requests one worker may have in flight from here [default 0: its max batch + queue].
    #[arg(long, env = "HEARTH_WORKER_CAPACITY", default_value_t = 0)]
    pub worker_capacity: usize,
    /// Requests that may wait when every worker is full; more get 503.
    #[arg(long, env = "HEARTH_MAX_QUEUE", default_value_t = 256)]
    pub max_queue: usize,
    /// How long a queued request waits before it gets 503.
    #[arg(long, env = "HEARTH_QUEUE_TIMEOUT_SECS", default_value_t = 10)]
    pub queue_timeout_secs: u64,
    /// A worker that fails health checks this long with replies open on it is given up on, and
    /// its replies continue on other workers (a stopped process, a frozen VM, a lost network).
    #[arg(long, env = "HEARTH_STALL_TIMEOUT_SECS", default_value_t = 10)]
    pub stall_timeout_secs: u64,
    /// How often workers' health is checked.
    #[arg(long, env = "HEARTH_HEALTH_INTERVAL_MS", default_value_t = 500)]
    pub health_interval_ms: u64,
    /// Reply length when a request does not say.
    #[arg(long, env = "HEARTH_DEFAULT_MAX_TOKENS", default_value_t = 1024)]
    pub default_max_tokens: u32,
    /// Requests per minute for keys without their own limit [default: unlimited].
    #[arg(long, env = "HEARTH_REQUESTS_PER_MINUTE")]
    pub requests_per_minute: Option<u32>,
    /// Generated tokens per day for keys without their own limit [default: unlimited].
    #[arg(long, env = "HEARTH_TOKENS_PER_DAY")]
    pub tokens_per_day: Option<u32>,
    /// Stop a native-API reply when its client disconnects (default: finish and store it).
    #[arg(long, env = "HEARTH_CANCEL_ON_DISCONNECT")]
    pub cancel_on_disconnect: bool,
    /// A `streaming` reply not written for this long belongs to an orchestrator that died and
    /// is marked `error` (checked from start-up on, periodically). Measured on this process's own
    /// clock as time without a save, so replicas' clocks need not agree. Live replies are
    /// written at least every 5 s, so with replicas sharing a database keep this well above that.
    #[arg(long, env = "HEARTH_ORPHAN_AFTER_SECS", default_value_t = 30)]
    pub orphan_after_secs: u64,
    /// The statically exported web UI (`make run` builds it) served at `/`.
    #[arg(long, env = "HEARTH_WEB_DIR", default_value = crate::api::DEFAULT_WEB_DIR)]
    pub web_dir: PathBuf,
    /// Sessions one user may keep; creating more answers 422 `too_many_sessions`.
    #[arg(long, env = "HEARTH_MAX_SESSIONS_PER_USER", default_value_t = 10_000)]
    pub max_sessions_per_user: u64,
    /// Messages one session may hold; a turn beyond answers 422 `session_full`.
    #[arg(
        long,
        env = "HEARTH_MAX_MESSAGES_PER_SESSION",
        default_value_t = 10_000
    )]
    pub max_messages_per_session: usize,
    /// A client has this long from the first byte of a request to the end of its header.
    #[arg(long, env = "HEARTH_HEADER_TIMEOUT_SECS", default_value_t = 10)]
    pub header_timeout_secs: u64,
    /// A request's body must arrive within this long of its header, or it is answered 408.
    #[arg(long, env = "HEARTH_BODY_TIMEOUT_SECS", default_value_t = 30)]
    pub body_timeout_secs: u64,
    /// Open HTTP connections at most; more wait in the listen backlog [default: the open-files
    /// limit less 512].
    #[arg(long, env = "HEARTH_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// On SIGTERM, how long running replies may take to finish before they are stopped.
    #[arg(long, env = "HEARTH_SHUTDOWN_TIMEOUT_SECS", default_value_t = 30)]
    pub shutdown_timeout_secs: u64,
}

fn models_dir(args: &ServeArgs) -> PathBuf {
    args.models_dir.clone().unwrap_or_else(|| {
        std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_default()
            .join(".cache/hearth/models")
    })
}

/// A worker this process started (the quick start); killed when dropped.
#[derive(Debug)]
struct LocalWorker {
    child: tokio::process::Child,
    addr: String,
    _stdout: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

async fn start_local_worker(args: &ServeArgs) -> anyhow::Result<LocalWorker> {
    let bin = match &args.worker_bin {
        Some(b) => b.clone(),
        None => {
            let exe = std::env::current_exe().context("cannot find this executable's path")?;
            let sibling = exe.with_file_name("hearth-worker");
            if sibling.is_file() {
                sibling
            } else {
                PathBuf::from("hearth-worker")
            }
        }
    };
    let mut cmd = tokio::process::Command::new(&bin);
    cmd.arg("serve")
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .arg("--models-dir")
        .arg(models_dir(args));
    if let Some(m) = &args.model {
        cmd.arg("--model").arg(m);
    }
    if let Some(t) = &args.tokenizer {
        cmd.arg("--tokenizer").arg(t);
    }
    cmd.args(&args.worker_args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true);
    // If this process dies without cleaning up (kill -9), the worker goes with it.
    #[cfg(target_os = "linux")]
    // SAFETY: the closure only makes one async-signal-safe system call.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().with_context(|| {
        format!(
            "cannot start the local worker `{}` (build it with `cargo build --release -p hearth-worker`, or pass --worker ADDR)",
            bin.display()
        )
    })?;
    let stdout = child
        .stdout
        .take()
        .context("the local worker has no stdout pipe")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = lines.next_line().await?.unwrap_or_default();
    let addr = serde_json::from_str::<serde_json::Value>(&line)
        .ok()
        .and_then(|v| v["listening"]["grpc"].as_str().map(str::to_string));
    let Some(addr) = addr else {
        let status = child.wait().await.ok();
        bail!(
            "the local worker did not start ({}); its error is above",
            status.map_or_else(|| "no exit status".into(), |s| s.to_string())
        );
    };
    Ok(LocalWorker {
        child,
        addr,
        _stdout: lines,
    })
}

/// Runs the server until SIGINT/SIGTERM.
pub async fn serve(args: ServeArgs, store: Arc<dyn Store>) -> anyhow::Result<()> {
    let app = App::bind(args, store).await?;
    announce(app.local_addr(), &app.state);
    app.run(shutdown_signal()).await
}

/// A bound orchestrator: its listener open, its workers found, its background tasks running.
/// [`App::run`] serves until the shutdown future completes, then lets running replies finish
/// within the shutdown timeout.
#[derive(Debug)]
pub struct App {
    state: AppState,
    listener: tokio::net::TcpListener,
    limits: crate::http_server::HttpLimits,
    shutdown_timeout: Duration,
    streams: Arc<Streams>,
    /// Stopped when the server is done: the orphan sweep, the database check, the stop bus.
    tasks: Vec<tokio::task::JoinHandle<()>>,
    local: Option<LocalWorker>,
}

impl App {
    /// Checks the arguments, connects what they name (Redis, the workers, or a local worker it
    /// starts), and binds `--listen`.
    pub async fn bind(args: ServeArgs, store: Arc<dyn Store>) -> anyhow::Result<Self> {
        // The recorder first: the worker pool records `hearth_workers_ready` only when readiness
        // changes, and a change recorded before the recorder exists would be lost for good.
        let metrics = crate::telemetry::handle();
        let auth = match args.auth {
            AuthArg::Keys => AuthMode::Keys,
            AuthArg::None => {
                if !args.listen.ip().is_loopback() {
                    bail!(
                        "--listen {}: refusing to serve without auth on a non-loopback address; \
                     use --auth keys (and `hearth keys create --user NAME`) or a 127.0.0.1 address",
                        args.listen
                    );
                }
                let user = match store.user_by_name(LOCAL_USER).await? {
                    Some(u) => u,
                    None => store.create_user(LOCAL_USER).await?,
                };
                AuthMode::Disabled(user)
            }
        };
        let tokenizer_path = args
            .tokenizer
            .clone()
            .unwrap_or_else(|| models_dir(&args).join(DEFAULT_TOKENIZER));
        let tokenizer = hearth_shared::tokenizer::Tokenizer::from_file(&tokenizer_path)
            .with_context(|| "run `make fetch-model` (or pass --tokenizer PATH)")?;

        let streams = Arc::new(Streams::default());
        let (limiter, affinity, stop_bus, listener_task) = match &args.redis_url {
            Some(url) => {
                let conn = connect_redis(url)
                    .await
                    .with_context(|| format!("--redis-url {}: cannot connect", redact_url(url)))?;
                let task = StopBus::listen(url.clone(), streams.clone());
                (
                    Limiter::redis(conn.clone()),
                    Affinity::shared(conn.clone()),
                    Some(StopBus::new(conn)),
                    Some(task),
                )
            }
            None => (Limiter::local(), Affinity::local(), None, None),
        };

        // Replies left `streaming` by an orchestrator that died become `error`, keeping their text.
        // Only stale ones: another replica's live replies are saved at least every few seconds.
        let orphan_after = Duration::from_secs(args.orphan_after_secs);
        let sweeper = tokio::spawn({
            let store = store.clone();
            let mut sweep = OrphanSweep::new(orphan_after);
            async move {
                loop {
                    sweep.run(&store).await;
                    tokio::time::sleep((orphan_after / 2).max(Duration::from_millis(250))).await;
                }
            }
        });

        let database_check = crate::telemetry::database_check_task(store.clone());

        let mut local = None;
        let mut workers = args.workers.clone();
        if workers.is_empty() {
            eprintln!("hearth: starting a local worker (loading the model)…");
            let w = start_local_worker(&args).await?;
            workers.push(w.addr.clone());
            local = Some(w);
        }
        let pool = WorkerPool::start(
            &workers,
            affinity,
            PoolConfig {
                batch: BatchConfig {
                    max_batch: args.batch_size.max(1),
                    max_delay: Duration::from_millis(args.batch_delay_ms),
                },
                health_interval: Duration::from_millis(args.health_interval_ms.max(10)),
                per_worker_capacity: args.worker_capacity,
                max_queue: args.max_queue,
                queue_timeout: Duration::from_secs(args.queue_timeout_secs),
                stall_timeout: Duration::from_secs(args.stall_timeout_secs.max(1)),
            },
        );
        if let Some(w) = &mut local {
            // The quick start answers its first request only once the model is loaded.
            loop {
                if pool.ready_count() > 0 {
                    break;
                }
                if let Ok(Some(status)) = w.child.try_wait() {
                    bail!("the local worker exited ({status}); its error is above");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }

        let generator = Arc::new(Generator {
            pool,
            tokenizer: Arc::new(tokenizer),
            store: store.clone(),
            limiter: Arc::new(limiter),
            streams: streams.clone(),
            stop_bus,
        });
        let state = AppState {
            store: store.clone(),
            auth,
            generator,
            options: ApiOptions {
                default_max_tokens: args.default_max_tokens,
                requests_per_minute: args.requests_per_minute.map(i64::from),
                tokens_per_day: args.tokens_per_day.map(i64::from),
                cancel_on_disconnect: args.cancel_on_disconnect,
                web_dir: args.web_dir.clone(),
                max_sessions_per_user: args.max_sessions_per_user,
                max_messages_per_session: args.max_messages_per_session.max(2),
                body_timeout: Duration::from_secs(args.body_timeout_secs.max(1)),
            },
            metrics,
        };
        let listener =
            bind(args.listen).with_context(|| format!("--listen {}: cannot bind", args.listen))?;
        let limits = crate::http_server::HttpLimits {
            header_timeout: Duration::from_secs(args.header_timeout_secs.max(1)),
            max_connections: args
                .max_connections
                .unwrap_or_else(crate::http_server::default_max_connections)
                .max(1),
        };
        let mut tasks = vec![sweeper, database_check];
        tasks.extend(listener_task);
        Ok(Self {
            state,
            listener,
            limits,
            shutdown_timeout: Duration::from_secs(args.shutdown_timeout_secs),
            streams,
            tasks,
            local,
        })
    }

    /// The address `--listen` was bound to (its port, when it asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// Serves until `shutdown` completes; then stops accepting, lets running replies finish
    /// for the shutdown timeout (and stops those still running, stored as `stopped`), and
    /// stops the background tasks and the local worker.
    pub async fn run(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let Self {
            state,
            listener,
            limits,
            shutdown_timeout,
            streams,
            tasks,
            local,
        } = self;
        let (signalled_tx, mut signalled) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            shutdown.await;
            let _ = signalled_tx.send(true);
        });
        let mut on_signal = signalled.clone();
        let http_shutdown = signalled.clone();
        // After the grace period, running replies are stopped (and stored as `stopped`).
        let stopper = tokio::spawn({
            let streams = streams.clone();
            async move {
                let _ = signalled.wait_for(|s| *s).await;
                tokio::time::sleep(shutdown_timeout).await;
                streams.stop_all();
            }
        });
        tokio::spawn(async move {
            let _ = on_signal.wait_for(|s| *s).await;
            eprintln!("hearth: shutting down; letting running replies finish");
        });
        // Open connections get the replies' grace period and a little more to send their ends.
        let hard_deadline = shutdown_timeout + Duration::from_secs(5);
        crate::http_server::serve(
            listener,
            router(state),
            limits,
            http_shutdown,
            hard_deadline,
        )
        .await;
        // Replies whose clients already left are still running as tasks: let them end and store.
        let deadline = tokio::time::Instant::now() + shutdown_timeout + Duration::from_secs(5);
        while streams.running() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        stopper.abort();
        for t in tasks {
            t.abort();
        }
        drop(local);
        Ok(())
    }
}

/// Connection backlog: a burst of clients (a page of tabs reconnecting, a load test) must
/// queue, not be reset; the kernel caps it at `net.core.somaxconn`.
const LISTEN_BACKLOG: u32 = 4096;

fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Finds replies left `streaming` by an orchestrator that died, without comparing clocks.
///
/// A live reply is saved every few seconds, and each save writes a new `updated_at`, whatever
/// the clock of the replica that writes it. So a reply is orphaned when its `updated_at` has not
/// changed for `orphan_after` of this process's own monotonic time. Comparing the stored time
/// with this replica's wall clock instead would fail another replica's live replies whenever
/// the two clocks differ by more than `orphan_after`.
struct OrphanSweep {
    orphan_after: Duration,
    /// Each streaming reply's `updated_at` when last seen, and since when it has not changed.
    seen: std::collections::HashMap<String, (i64, std::time::Instant)>,
}

impl OrphanSweep {
    fn new(orphan_after: Duration) -> Self {
        Self {
            orphan_after,
            seen: Default::default(),
        }
    }

    async fn run(&mut self, store: &Arc<dyn Store>) {
        let replies = match store.streaming_replies().await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "could not check for interrupted replies");
                return;
            }
        };
        let now = std::time::Instant::now();
        let mut seen = std::collections::HashMap::with_capacity(replies.len());
        let mut failed = 0;
        for (id, at) in replies {
            let since = match self.seen.get(&id) {
                Some(&(last, since)) if last == at => since,
                _ => now,
            };
            if now.duration_since(since) < self.orphan_after {
                seen.insert(id, (at, since));
                continue;
            }
            match store.fail_interrupted(&id, at).await {
                Ok(true) => failed += 1,
                // Saved since it was read: alive after all; the next sweep sees the new time.
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "could not mark an interrupted reply");
                    seen.insert(id, (at, since));
                }
            }
        }
        self.seen = seen;
        if failed > 0 {
            tracing::warn!(
                messages = failed,
                "replies left streaming by a stopped orchestrator are marked as errors"
            );
        }
    }
}

/// One JSON line on stdout for programs (`{"listening":{"http":…}}`), and a human banner.
fn announce(addr: SocketAddr, state: &AppState) {
    let line = serde_json::json!({"listening": {"http": addr.to_string()}});
    #[allow(clippy::print_stdout)]
    {
        println!("{line}");
    }
    let ui = &state.options.web_dir;
    if ui.join("index.html").is_file() {
        eprintln!("hearth: ready; open http://{addr}/ for the chat UI");
    } else {
        eprintln!(
            "hearth: ready at http://{addr}/ (API only: the web UI is not built in {}; \
             `make run` builds it)",
            ui.display()
        );
    }
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return;
    }
    let key = match state.auth {
        AuthMode::Keys => " -H 'Authorization: Bearer $HEARTH_API_KEY'",
        AuthMode::Disabled(_) => "",
    };
    eprintln!(
        "\nhearth: serving {model} at http://{addr}\n\n  \
         curl -N http://{addr}/v1/chat/completions{key} -H 'Content-Type: application/json' \\\n    \
         -d '{{\"model\": \"{model}\", \"stream\": true, \"messages\": [{{\"role\": \"user\", \"content\": \"Why is the sky blue?\"}}]}}'\n",
        model = state.model_name(),
    );
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

/// `url` with its password (if any) replaced by `***`, for messages and logs.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let (authority, tail) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            let masked = if userinfo.contains(':') {
                format!("{user}:***")
            } else {
                // `redis://secret@host`: the single part is the password.
                "***".to_string()
            };
            format!("{scheme}://{masked}@{host}{tail}")
        }
        None => url.to_string(),
    }
}

#[cfg(test)]
mod redact_tests {
    use super::redact_url;

    #[test]
    fn passwords_in_urls_are_masked() {
        assert_eq!(
            redact_url("redis://:hunter2@cache:6379/0"),
            "redis://:***@cache:6379/0"
        );
        assert_eq!(
            redact_url("redis://app:hunter2@cache:6379"),
            "redis://app:***@cache:6379"
        );
        assert_eq!(redact_url("redis://hunter2@cache"), "redis://***@cache");
        assert_eq!(
            redact_url("redis://127.0.0.1:6379"),
            "redis://127.0.0.1:6379"
        );
        assert_eq!(redact_url("not a url"), "not a url");
    }
}
