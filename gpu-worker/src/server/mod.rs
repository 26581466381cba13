//! `hearth-worker serve`: the gRPC service the orchestrator talks to.
//!
//! # Layout
//! - [`config`]: flags and `HEARTH_…` variables, validated into [`ValidConfig`].
//! - [`state`]: what every RPC shares (serving phase, models, in-flight count).
//! - [`models`]: the models the worker holds, each on its own engine, and their memory.
//! - [`loader`]: loading a model onto a new engine.
//! - [`service`]: the `Worker` service: `Info`, `Health`, `Generate`, `DropSession`,
//!   `LoadModel`, `UnloadModel`.
//! - [`stream`]: one multiplexed `Generate` stream.
//! - [`status`]: engine errors as gRPC codes, in one place.
//! - [`http`]: `/metrics`, `/healthz`, `/readyz`.
//!
//! # Lifecycle
//! [`Worker::bind`] binds both listeners (so the caller can print the addresses), then
//! [`Worker::run`] serves `Health` at once, reports not-ready while the start-up models load,
//! serves everything once their engines run, and on `shutdown` stops accepting
//! (`UNAVAILABLE`), waits for in-flight sequences up to the drain deadline, cancels what is
//! left, and returns.

pub mod config;
mod http;
mod loader;
pub mod models;
mod service;
pub mod state;
pub mod status;
mod stream;

pub use config::{ServeConfig, ValidConfig};
pub use loader::load_weights;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hearth_shared::proto::worker_server::WorkerServer;
use hearth_shared::worker_auth::RequireToken;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Identity, ServerTlsConfig};

use crate::device::{self, DeviceError};
use crate::engine::{Engine, EngineError};
use crate::model::ModelError;
use state::{Loaded, WorkerState};

/// How long cancelled sequences get to report `Finished` after the drain deadline, and the
/// servers to close their connections.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Largest `WorkerRequest` accepted: a batch of long prompts (tonic's default is 4 MiB).
const MAX_MESSAGE_BYTES: usize = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("--tokenizer: {0}")]
    Tokenizer(#[from] hearth_shared::tokenizer::TokenizerError),
    #[error("--tokenizer does not belong to the model: {0}")]
    TokenizerMismatch(String),
    #[error("cannot start the engine: {0}")]
    Engine(#[from] EngineError),
    #[error("gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("model loading stopped unexpectedly: {0}")]
    Join(#[from] tokio::task::JoinError),
    /// The repository manifest asks for what the loaded model cannot do.
    #[error("{0}")]
    Manifest(String),
    /// A start-up model could not be loaded (see [`loader::Loader::load`]).
    #[error("{0}")]
    Load(String),
}

/// A worker whose listeners are bound but which serves nothing yet.
#[derive(Debug)]
pub struct Worker {
    config: ValidConfig,
    device: device::Device,
    grpc: TcpListener,
    http: TcpListener,
}

impl Worker {
    /// Opens the device and binds both listeners; nothing is served yet.
    pub async fn bind(config: ValidConfig) -> Result<Self, ServeError> {
        let device = config.run_on.select_device()?;
        let bind = |addr: SocketAddr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| ServeError::Bind { addr, source })
        };
        Ok(Self {
            grpc: bind(config.listen).await?,
            http: bind(config.metrics_listen).await?,
            config,
            device,
        })
    }

    pub fn grpc_addr(&self) -> std::io::Result<SocketAddr> {
        self.grpc.local_addr()
    }

    pub fn metrics_addr(&self) -> std::io::Result<SocketAddr> {
        self.http.local_addr()
    }

    /// Serves until `shutdown` resolves, then drains; see the module docs.
    pub async fn run(
        self,
        metrics: PrometheusHandle,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ServeError> {
        let Self {
            config,
            device,
            grpc,
            http,
        } = self;
        tracing::info!(
            device = %device.name,
            kind = device.kind,
            ordinal = device.ordinal,
            compute_capability = device.compute_capability.as_deref().unwrap_or("-"),
            "device selected"
        );
        crate::telemetry::device_info(&device);
        let state = WorkerState::new(
            device.clone(),
            config.memory_budget,
            config.keep_alive_ms,
            config.residency.clone(),
        );
        let (stop_tx, stop_rx) = watch::channel(false);
        let stopped = |mut rx: watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        let http_task = tokio::spawn(http::serve(
            http,
            state.clone(),
            metrics,
            stopped(stop_rx.clone()),
        ));
        let loader = Arc::new(loader::Loader {
            config: config.clone(),
            device: device.clone(),
            state: state.clone(),
        });
        let service = InterceptedService::new(
            WorkerServer::new(service::WorkerService::new(
                state.clone(),
                config.engine_stall,
                loader.clone(),
            ))
            .max_decoding_message_size(MAX_MESSAGE_BYTES),
            RequireToken::new(config.token.as_ref()),
        );
        let incoming = TcpIncoming::from(grpc).with_nodelay(Some(true));
        let mut builder = tonic::transport::Server::builder();
        if let Some(tls) = &config.tls {
            let identity = Identity::from_pem(&tls.cert, &tls.key);
            builder = builder.tls_config(ServerTlsConfig::new().identity(identity))?;
        }
        let grpc_task = tokio::spawn(
            builder
                // Notice orchestrators that vanished without closing their connection, so their
                // requests are cancelled instead of generating for nobody.
                .http2_keepalive_interval(Some(Duration::from_secs(10)))
                .http2_keepalive_timeout(Some(Duration::from_secs(20)))
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, stopped(stop_rx)),
        );

        tokio::pin!(shutdown);
        let started = Instant::now();
        tokio::select! {
            loaded = load_startup(&loader) => loaded?,
            () = &mut shutdown => {
                tracing::info!("shutdown requested while loading; exiting");
                stop_tx.send_replace(true);
                return Ok(());
            }
        }
        state.set_ready();
        tokio::spawn(unload_expired(state.clone()));
        metrics::gauge!(crate::telemetry::READY).set(1.0);
        tracing::info!(
            load_s = started.elapsed().as_secs_f64(),
            models = state.models.all().len(),
            "ready"
        );

        shutdown.await;
        drain(&state, config.drain_timeout).await;
        stop_tx.send_replace(true);
        join_server("gRPC", grpc_task).await;
        join_server("metrics", http_task).await;
        let engines = state.models.take_engines();
        tokio::task::spawn_blocking(move || engines.into_iter().for_each(Engine::shutdown)).await?;
        tracing::info!("stopped");
        Ok(())
    }
}

/// Unloads the repository models idle past their keep-alive, as long as the worker runs.
async fn unload_expired(state: Arc<WorkerState>) {
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tick.tick().await;
        if state.phase() == state::Phase::Draining {
            return;
        }
        for slot in state.models.expired() {
            tracing::info!(model = %slot.key(), idle_s = slot.idle_for().as_secs_f64(), "idle past its keep-alive; unloading");
            state.models.unload(&slot, Duration::ZERO).await;
        }
    }
}

/// Fetches `--model`'s URL into the models cache (resumed, checked, with a progress bar), with
/// its progress in `Info` meanwhile.
async fn fetch_startup(
    loader: &loader::Loader,
    plan: &config::FetchPlan,
) -> Result<(), ServeError> {
    let progress = Arc::new(crate::fetch::Progress::default());
    loader.state.set_fetching(Some(state::Fetching {
        model_id: loader::model_id(&loader.config.model),
        progress: progress.clone(),
    }));
    let fetched = match crate::fetch::Fetcher::new(&plan.cache) {
        Ok(f) => f.fetch(&plan.source, &progress).await,
        Err(e) => Err(e),
    };
    loader.state.set_fetching(None);
    fetched
        .map(|_| ())
        .map_err(|e| ServeError::Load(format!("--model: {e}")))
}

/// Loads the start-up models: `--model` (or a scripted engine), then each `--load`.
async fn load_startup(loader: &loader::Loader) -> Result<(), ServeError> {
    let config = &loader.config;
    if let Some(interval) = config.scripted {
        tracing::warn!(
            ?interval,
            "scripted mode: no model, tokens on a timer (load tests only)"
        );
        let info = Loaded {
            model_id: "scripted".into(),
            ..Loaded::default()
        };
        let none = models::Need { weights: 0, kv: 0 };
        let models = &loader.state.models;
        let (slot, _) = models
            .reserve(info, none, u64::MAX)
            .map_err(|s| ServeError::Load(s.message().to_string()))?;
        let engine = Engine::scripted(interval, &config.engine, config.scripted_freeze_after)?;
        models.set_ready(&slot, engine, 0);
        return Ok(());
    }
    if let Some(plan) = &config.fetch {
        fetch_startup(loader, plan).await?;
    }
    let load = |source| async move {
        loader
            .load(source, false)
            .await
            .map(|_| ())
            .map_err(|s| ServeError::Load(s.message().to_string()))
    };
    load(loader.startup_source()).await?;
    for spec in &config.load {
        let source = loader
            .repository_source(spec)
            .map_err(|s| ServeError::Load(format!("--load: {}", s.message())))?;
        load(source).await?;
    }
    Ok(())
}

/// Waits (a bounded time) for a server task to close its connections.
async fn join_server<E: std::fmt::Display>(name: &str, task: JoinHandle<Result<(), E>>) {
    match tokio::time::timeout(SHUTDOWN_GRACE, task).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "{name} server ended with an error"),
        Ok(Err(e)) => tracing::warn!(error = %e, "{name} server task failed"),
        Err(_) => tracing::warn!("{name} server did not close its connections in time"),
    }
}

/// Stops accepting, lets in-flight requests finish until `deadline`, then cancels the rest.
async fn drain(state: &Arc<WorkerState>, deadline: Duration) {
    let in_flight = state.in_flight();
    tracing::info!(in_flight, deadline_s = deadline.as_secs_f64(), "draining");
    state.begin_drain();
    metrics::gauge!(crate::telemetry::READY).set(0.0);
    if tokio::time::timeout(deadline, state.all_idle())
        .await
        .is_err()
    {
        tracing::warn!(
            in_flight = state.in_flight(),
            "drain deadline passed; cancelling what is left"
        );
        for slot in state.models.all() {
            if let Some(h) = slot.handle() {
                h.cancel_all();
            }
        }
        if tokio::time::timeout(SHUTDOWN_GRACE, state.all_idle())
            .await
            .is_err()
        {
            tracing::error!(
                in_flight = state.in_flight(),
                "requests still open after cancel"
            );
        }
    }
}
