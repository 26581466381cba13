//! `hearth` (serve): configuration, start-up and shutdown.
//!
//! With no `--worker`, the quick start: a local `hearth-worker` child on a loopback port (model
//! from the models directory), SQLite under the data directory, no Redis, no auth.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::io::AsyncBufReadExt;

use crate::api::{router, AppState, AuthMode};
use crate::bus::StopBus;
use crate::config::{self, Workers};
pub use crate::config::{AuthArg, Config, ServeArgs};
use crate::generate::Streams;
use crate::ids::MessageId;
use crate::limits::{connect_redis, Limiter};
use crate::service::{ChatService, ServiceParts, SharedPrompts, Swept};
use crate::storage::Store;
use crate::workers::{Affinity, WorkerPool};

/// The local user every request acts as when auth is off.
pub const LOCAL_USER: &str = "local";

/// A worker this process started (the quick start); killed when dropped.
#[derive(Debug)]
struct LocalWorker {
    child: tokio::process::Child,
    addr: String,
    _stdout: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

async fn start_local_worker(w: &config::LocalWorker) -> anyhow::Result<LocalWorker> {
    let bin = &w.bin;
    let mut cmd = tokio::process::Command::new(bin);
    cmd.arg("serve")
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .arg("--models-dir")
        .arg(&w.models_dir);
    if let Some(m) = &w.model {
        cmd.arg("--model").arg(m);
    }
    if let Some(t) = &w.tokenizer {
        cmd.arg("--tokenizer").arg(t);
    }
    cmd.args(&w.args)
        .env("HEARTH_WORKER_TOKEN", w.token.expose())
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

/// With auth off, every request acts as the local user, created on first start.
async fn auth_mode(arg: AuthArg, store: &dyn Store) -> anyhow::Result<AuthMode> {
    Ok(match arg {
        AuthArg::Keys => AuthMode::Keys,
        AuthArg::None => AuthMode::Disabled(store.ensure_user(LOCAL_USER).await?),
    })
}

/// What replicas share through Redis, or the in-process stand-ins without it.
struct Shared {
    limiter: Limiter,
    affinity: Affinity,
    stop_bus: Option<StopBus>,
    replies: Option<crate::generate::SharedReplies>,
    /// Listens for stop requests from other replicas, and for replies they hand over.
    listener: Option<tokio::task::JoinHandle<()>>,
    /// The replies handed over, for the orphan sweep.
    released: Option<Released>,
}

/// How long start-up waits for PostgreSQL or Redis that do not answer yet (a restart, a
/// deployment that starts everything at once) before it gives up.
pub const STARTUP_PATIENCE: Duration = Duration::from_secs(30);

/// `attempt` until it succeeds, fails with an error `transient` does not accept, or
/// [`STARTUP_PATIENCE`] has passed; each transient failure is logged with `what` it waits for.
pub async fn patiently<T, E, Fut>(
    what: &str,
    transient: impl Fn(&E) -> bool,
    mut attempt: impl FnMut() -> Fut,
) -> Result<T, E>
where
    E: std::fmt::Display,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let deadline = tokio::time::Instant::now() + STARTUP_PATIENCE;
    loop {
        match attempt().await {
            Err(e) if transient(&e) && tokio::time::Instant::now() < deadline => {
                tracing::warn!(error = %e, "{what} does not answer yet; trying again");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            done => return done,
        }
    }
}

/// Message ids of replies other replicas handed over as they shut down.
type Released = tokio::sync::mpsc::UnboundedReceiver<MessageId>;

impl Shared {
    async fn connect(redis_url: Option<&str>, streams: &Arc<Streams>) -> anyhow::Result<Self> {
        let Some(url) = redis_url else {
            return Ok(Self {
                limiter: Limiter::local(),
                affinity: Affinity::local(),
                stop_bus: None,
                replies: None,
                listener: None,
                released: None,
            });
        };
        // A URL that does not parse fails at once; an unreachable server (restarting, not up
        // yet) is waited for.
        let conn = patiently(
            "Redis",
            |e: &redis::RedisError| e.kind() != redis::ErrorKind::InvalidClientConfig,
            || connect_redis(url),
        )
        .await
        .with_context(|| {
            format!(
                "--redis-url {}: cannot connect",
                crate::config::redact_url(url)
            )
        })?;
        let bus = StopBus::new(conn.clone(), url.to_string());
        let (released_tx, released) = tokio::sync::mpsc::unbounded_channel();
        let listener = bus.clone().listen(streams.clone(), released_tx);
        let replies = crate::generate::SharedReplies::new(conn.clone(), url)?;
        Ok(Self {
            replies: Some(replies),
            limiter: Limiter::redis(conn.clone()),
            affinity: Affinity::shared(conn),
            stop_bus: Some(bus),
            listener: Some(listener),
            released: Some(released),
        })
    }
}

/// How long a deleted session's rows stay before they are purged: a minute for a stop or a last
/// write on another replica to land. The session is gone from every query at once.
const PURGE_AFTER: Duration = Duration::from_secs(60);

/// Replies left `streaming` by an orchestrator that died are continued here (with Redis: see
/// [`ChatService::sweep_reply`]), or become `error`, keeping their text. Only stale ones:
/// another replica's live replies are saved at least every few seconds. And sessions deleted
/// more than [`PURGE_AFTER`] ago are removed with their messages.
fn spawn_orphan_sweep(
    store: Arc<dyn Store>,
    chat: Arc<ChatService>,
    orphan_after: Duration,
    mut released: Option<Released>,
) -> tokio::task::JoinHandle<()> {
    let mut sweep = OrphanSweep::new(orphan_after);
    tokio::spawn(async move {
        loop {
            sweep.run(&store, &chat).await;
            let before = crate::storage::now_ms() - PURGE_AFTER.as_millis() as i64;
            match store.purge_deleted(before).await {
                Ok((0, _)) => {}
                Ok((sessions, messages)) => {
                    tracing::debug!(sessions, messages, "deleted sessions purged");
                }
                Err(e) => tracing::warn!(error = %e, "could not purge deleted sessions"),
            }
            let pause = tokio::time::sleep((orphan_after / 2).max(Duration::from_millis(250)));
            tokio::pin!(pause);
            loop {
                tokio::select! {
                    () = &mut pause => break,
                    ids = next_released(&mut released) => take_handed_over(&store, &chat, &ids).await,
                }
            }
        }
    })
}

/// The replies handed over since the last call: waits for one, then takes every one already
/// announced (a replica shutting down hands over all of its replies at once). Never resolves
/// without Redis.
async fn next_released(released: &mut Option<Released>) -> Vec<MessageId> {
    let Some(rx) = released.as_mut() else {
        return std::future::pending().await;
    };
    let Some(first) = rx.recv().await else {
        return std::future::pending().await;
    };
    let mut ids = vec![first];
    while let Ok(id) = rx.try_recv() {
        ids.push(id);
    }
    ids
}

/// Takes over (or leaves to the replica that is quicker) replies another replica handed over
/// as it shut down, without waiting for them to fall silent; one read of the streaming
/// replies for all of them.
async fn take_handed_over(store: &Arc<dyn Store>, chat: &Arc<ChatService>, ids: &[MessageId]) {
    let replies = match store.streaming_replies().await {
        Ok(replies) => replies,
        Err(e) => {
            tracing::warn!(error = %e, "could not read the replies handed over; the sweep finds them later");
            return;
        }
    };
    for reply in replies.iter().filter(|r| ids.contains(&r.id)) {
        match chat.sweep_reply(reply, false).await {
            Ok(Swept::TakenOver) => {
                tracing::info!(message_id = %reply.id, "continuing a reply another replica handed over");
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "could not take over a reply handed over"),
        }
    }
}

/// Connects the configured workers, or starts the quick start's local one and waits until it
/// has loaded its model: the quick start answers its first request only then.
async fn start_workers(
    config: &Config,
    affinity: Affinity,
) -> anyhow::Result<(Arc<WorkerPool>, Option<LocalWorker>)> {
    let (workers, dns, mut local) = match &config.workers {
        Workers::Remote { addrs, dns } => (addrs.clone(), dns.clone(), None),
        Workers::Local(w) => {
            eprintln!("hearth: starting a local worker (loading the model)…");
            let w = start_local_worker(w).await?;
            (vec![w.addr.clone()], None, Some(w))
        }
    };
    let pool = WorkerPool::start(&workers, affinity, config.pool.clone());
    if let Some(dns) = dns {
        crate::workers::discover(&pool, &workers, dns)
            .context("--worker dns: cannot read the system's DNS configuration")?;
    }
    if let Some(w) = &mut local {
        while pool.ready_count() == 0 {
            if let Ok(Some(status)) = w.child.try_wait() {
                bail!("the local worker exited ({status}); its error is above");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok((pool, local))
}

/// Runs the server until SIGINT/SIGTERM.
pub async fn serve(config: Config, store: Arc<dyn Store>) -> anyhow::Result<()> {
    let app = App::bind(config, store).await?;
    announce(app.local_addr(), app.metrics_addr(), &app.state);
    app.run(shutdown_signal()).await
}

/// A bound orchestrator: its listener open, its workers found, its background tasks running.
/// [`App::run`] serves until the shutdown future completes, then lets running replies finish
/// within the shutdown timeout.
#[derive(Debug)]
pub struct App {
    state: AppState,
    listener: tokio::net::TcpListener,
    /// `--metrics-listen`, bound.
    metrics: Option<tokio::net::TcpListener>,
    limits: crate::http_server::HttpLimits,
    shutdown_timeout: Duration,
    streams: Arc<Streams>,
    /// Stopped when the server is done: the orphan sweep, the database check, the stop bus.
    tasks: Vec<tokio::task::JoinHandle<()>>,
    local: Option<LocalWorker>,
}

impl App {
    /// Connects what the configuration names (Redis, the workers, or a local worker it
    /// starts), and binds its listen address.
    pub async fn bind(config: Config, store: Arc<dyn Store>) -> anyhow::Result<Self> {
        // The recorder first: the worker pool records `hearth_workers_ready` only when readiness
        // changes, and a change recorded before the recorder exists would be lost for good.
        let metrics = crate::telemetry::handle();
        let auth = auth_mode(config.auth, store.as_ref()).await?;
        let tokenizers = crate::service::Tokenizers::from_file(&config.tokenizer)
            .with_context(|| "run `make fetch-model` (or pass --tokenizer PATH)")?;
        let shared_prompts =
            SharedPrompts::new(&tokenizers.default_tokenizer().tok, &config.shared_prompts)
                .context("--shared-prompt: cannot render the prompt with the chat template")?;
        for (name, tokens) in shared_prompts.summary() {
            tracing::info!(name, tokens, "shared prompt: cached once for every user");
        }
        let streams = Arc::new(Streams::default());
        let shared = Shared::connect(config.redis_url.as_deref(), &streams).await?;
        let database_check = crate::telemetry::database_check_task(store.clone());
        let (pool, local) = start_workers(&config, shared.affinity).await?;

        let chat = Arc::new(ChatService::new(ServiceParts {
            store: store.clone(),
            pool,
            tokenizers,
            limiter: shared.limiter,
            streams: streams.clone(),
            stop_bus: shared.stop_bus,
            limits: config.limits.clone(),
            shared_prompts,
            shared_replies: shared.replies,
        }));
        let heartbeat = crate::generate::heartbeat_task(
            store.clone(),
            chat.leases(),
            crate::generate::heartbeat_every(config.orphan_after),
        );
        let sweeper = spawn_orphan_sweep(store, chat.clone(), config.orphan_after, shared.released);
        let state = AppState {
            chat,
            auth,
            options: config.api.clone(),
            metrics,
            body_bytes: Arc::new(tokio::sync::Semaphore::new(
                crate::api::MAX_BODY_BYTES_IN_FLIGHT,
            )),
            sockets: Arc::default(),
        };
        let (listener, metrics) = bind_listeners(&config)?;
        let mut tasks = vec![sweeper, database_check, heartbeat];
        tasks.extend(shared.listener);
        Ok(Self {
            state,
            listener,
            metrics,
            limits: config.http,
            shutdown_timeout: config.shutdown_timeout,
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

    /// The address `--metrics-listen` was bound to, if it was given.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// Serves until `shutdown` completes; then stops accepting, lets running replies finish
    /// for the shutdown timeout, then hands those still running over to the other replicas
    /// (with Redis: see [`ChatService::hand_over`]) or stops them (stored as `stopped`), and
    /// stops the background tasks and the local worker.
    pub async fn run(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let Self {
            state,
            listener,
            metrics,
            limits,
            shutdown_timeout,
            streams,
            tasks,
            local,
        } = self;
        let (signalled_tx, signalled) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            shutdown.await;
            let _ = signalled_tx.send(true);
        });
        let http_shutdown = signalled.clone();
        let grace_over = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut stopper = spawn_stopper(
            signalled,
            shutdown_timeout,
            (streams.clone(), state.chat.clone()),
            grace_over.clone(),
        );
        announce_shutdown(http_shutdown.clone());
        // Open connections get the replies' grace period and a little more to send their ends.
        let hard_deadline = shutdown_timeout + Duration::from_secs(5);
        // Scraped until the very end; a tiny router with nothing to drain.
        let metrics_task = metrics.map(|l| serve_metrics(l, &state));
        crate::http_server::serve(
            listener,
            router(state),
            limits,
            http_shutdown,
            hard_deadline,
        )
        .await;
        // Replies whose clients already left are still running as tasks: let them end and store.
        let_replies_end(&streams, shutdown_timeout + Duration::from_secs(5)).await;
        // Handing replies over: their last events published and the other replicas told.
        if grace_over.load(std::sync::atomic::Ordering::Acquire) {
            let _ = tokio::time::timeout(Duration::from_secs(10), &mut stopper).await;
        }
        stopper.abort();
        for t in tasks {
            t.abort();
        }
        // Awaited, so the metrics port is closed once `run` returns.
        if let Some(t) = metrics_task {
            t.abort();
            let _ = t.await;
        }
        drop(local);
        Ok(())
    }
}

/// After `signalled` and the grace period, hands running replies over to the other replicas, or
/// stops them (stored as `stopped`), and raises `grace_over`.
fn spawn_stopper(
    mut signalled: tokio::sync::watch::Receiver<bool>,
    grace: Duration,
    (streams, chat): (Arc<Streams>, Arc<ChatService>),
    grace_over: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let _ = signalled.wait_for(|s| *s).await;
        tokio::time::sleep(grace).await;
        grace_over.store(true, std::sync::atomic::Ordering::Release);
        chat.hand_over().await;
        streams.stop_all();
    })
}

/// Says on stderr when `signalled` rises that the server is shutting down.
fn announce_shutdown(mut signalled: tokio::sync::watch::Receiver<bool>) {
    tokio::spawn(async move {
        let _ = signalled.wait_for(|s| *s).await;
        eprintln!("hearth: shutting down; letting running replies finish");
    });
}

/// Waits, for at most `within`, until no reply runs.
async fn let_replies_end(streams: &Streams, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    while streams.running() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Serves `/metrics` on `listener` (`--metrics-listen`): a tiny router with nothing to drain.
fn serve_metrics(
    listener: tokio::net::TcpListener,
    state: &AppState,
) -> tokio::task::JoinHandle<()> {
    let app = crate::api::metrics_router(state.metrics.clone());
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "the metrics listener stopped");
        }
    })
}

/// Binds `--listen` and, when given, `--metrics-listen`.
fn bind_listeners(
    config: &Config,
) -> anyhow::Result<(tokio::net::TcpListener, Option<tokio::net::TcpListener>)> {
    let listener =
        bind(config.listen).with_context(|| format!("--listen {}: cannot bind", config.listen))?;
    let metrics = match config.metrics_listen {
        Some(addr) => {
            Some(bind(addr).with_context(|| format!("--metrics-listen {addr}: cannot bind"))?)
        }
        None => None,
    };
    Ok((listener, metrics))
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
/// A live reply's owner renews it on a heartbeat, and each renewal writes a new `updated_at`,
/// whatever the clock of the replica that writes it. So a reply is orphaned when its
/// `updated_at` has not changed for `orphan_after` of this process's own monotonic time, while
/// the database could be read: silence it could not have seen (the database was unreachable,
/// for its owner too) does not count. Comparing the stored time with this replica's wall clock
/// instead would fail another replica's live replies whenever the two clocks differ by more
/// than `orphan_after`.
struct OrphanSweep {
    orphan_after: Duration,
    /// Each streaming reply's `updated_at` when last seen, and since when it has not changed.
    seen: std::collections::HashMap<MessageId, (i64, std::time::Instant)>,
}

impl OrphanSweep {
    fn new(orphan_after: Duration) -> Self {
        Self {
            orphan_after,
            seen: Default::default(),
        }
    }

    async fn run(&mut self, store: &Arc<dyn Store>, chat: &Arc<ChatService>) {
        let replies = match store.streaming_replies().await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "could not check for interrupted replies");
                self.seen.clear();
                return;
            }
        };
        let now = std::time::Instant::now();
        let mut seen = std::collections::HashMap::with_capacity(replies.len());
        let (mut failed, mut taken) = (0, 0);
        for reply in replies {
            let since = match self.seen.get(&reply.id) {
                Some(&(last, since)) if last == reply.updated_at => since,
                _ => now,
            };
            if now.duration_since(since) < self.orphan_after {
                seen.insert(reply.id, (reply.updated_at, since));
                continue;
            }
            match chat.sweep_reply(&reply, true).await {
                Ok(Swept::Failed) => failed += 1,
                Ok(Swept::TakenOver | Swept::Finished) => taken += 1,
                // Saved since it was read (alive after all: the next sweep sees the new time),
                // or claimed by another replica.
                Ok(Swept::Alive) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "could not mark an interrupted reply");
                    seen.insert(reply.id, (reply.updated_at, since));
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
        if taken > 0 {
            tracing::warn!(
                messages = taken,
                "replies left streaming by a stopped orchestrator continue here"
            );
        }
    }
}

/// One JSON line on stdout for programs (`{"listening":{"http":…}}`), and a human banner.
fn announce(addr: SocketAddr, metrics: Option<SocketAddr>, state: &AppState) {
    let mut line = serde_json::json!({"listening": {"http": addr.to_string()}});
    if let Some(m) = metrics {
        line["listening"]["metrics"] = m.to_string().into();
    }
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
        model = state.chat.lookup(None).map(|t| t.name()).unwrap_or_default(),
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
