//! `hearth-worker serve`: the gRPC service the orchestrator talks to.
//!
//! # Layout
//! - [`config`]: flags and `HEARTH_…` variables, validated into [`ValidConfig`].
//! - [`state`]: what every RPC shares (serving phase, engine, in-flight count).
//! - [`service`]: the `Worker` service: `Info`, `Health`, `Generate`, `DropSession`.
//! - [`stream`]: one multiplexed `Generate` stream.
//! - [`status`]: engine errors as gRPC codes, in one place.
//! - [`http`]: `/metrics`, `/healthz`, `/readyz`.
//!
//! # Lifecycle
//! [`Worker::bind`] binds both listeners (so the caller can print the addresses), then
//! [`Worker::run`] serves `Health` at once, reports not-ready while the model loads, serves
//! everything once the engine runs, and on `shutdown` stops accepting (`UNAVAILABLE`), waits for
//! in-flight sequences up to the drain deadline, cancels what is left, and returns.

pub mod config;
mod http;
mod service;
pub mod state;
pub mod status;
mod stream;

pub use config::{ServeConfig, ValidConfig};

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hearth_shared::proto::worker_server::WorkerServer;
use hearth_shared::tokenizer::Tokenizer;
use hearth_shared::worker_auth::RequireToken;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Identity, ServerTlsConfig};

use crate::device::{self, DeviceError};
use crate::engine::constraint::{Grammars, Vocabulary, MASK_THREADS};
use crate::engine::{Engine, EngineError, Weights};
use crate::generic::GenericModel;
use crate::model::{load_gguf, load_safetensors, ModelError};
use crate::repository::ModelVersion;
use config::RunOn;
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
        let device = device::select(config.run_on.device)?;
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
        let state = WorkerState::new(device.clone());
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
        let service = InterceptedService::new(
            WorkerServer::new(service::WorkerService::new(
                state.clone(),
                config.engine_stall,
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
        let engine = if let Some(interval) = config.scripted {
            tracing::warn!(
                ?interval,
                "scripted mode: no model, tokens on a timer (load tests only)"
            );
            let info = Loaded {
                model_id: "scripted".into(),
                ..Loaded::default()
            };
            (
                Engine::scripted(interval, &config.engine, config.scripted_freeze_after)?,
                info,
            )
        } else {
            let load_config = config.clone();
            let load_device = device.clone();
            let load = tokio::task::spawn_blocking(move || load(&load_config, &load_device));
            let loaded = tokio::select! {
                loaded = load => loaded??,
                () = &mut shutdown => {
                    tracing::info!("shutdown requested while loading; exiting");
                    stop_tx.send_replace(true);
                    return Ok(());
                }
            };
            let (weights, info, grammars) = loaded;
            let mut engine_config = engine_config(&config, &device, &weights)?;
            engine_config.grammars = grammars;
            (Engine::start(weights, engine_config)?, info)
        };
        let (engine, info) = engine;
        state.set_ready(engine.handle(), info);
        metrics::gauge!(crate::telemetry::READY).set(1.0);
        tracing::info!(
            load_s = started.elapsed().as_secs_f64(),
            kv_capacity_tokens = engine.handle().model_info().kv_capacity_tokens,
            "ready"
        );

        shutdown.await;
        drain(&state, &engine, config.drain_timeout).await;
        stop_tx.send_replace(true);
        join_server("gRPC", grpc_task).await;
        join_server("metrics", http_task).await;
        tokio::task::spawn_blocking(move || engine.shutdown()).await?;
        tracing::info!("stopped");
        Ok(())
    }
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
async fn drain(state: &Arc<WorkerState>, engine: &Engine, deadline: Duration) {
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
        engine.handle().cancel_all();
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

/// The engine's configuration once the weights are on the device: on a GPU without
/// `--kv-budget`, K/V takes `--gpu-memory-fraction` of the memory the weights left free.
fn engine_config(
    config: &ValidConfig,
    device: &device::Device,
    weights: &Weights,
) -> Result<crate::engine::EngineConfig, DeviceError> {
    let mut engine = config.engine.clone();
    if device.is_gpu() && !config.kv_budget_given {
        let free = device.free_bytes()? as f64;
        engine.kv_budget_bytes = (free * config.gpu_memory_fraction) as usize;
        tracing::info!(
            free_bytes = free as u64,
            weights_bytes = weights.weights_bytes(),
            kv_budget_bytes = engine.kv_budget_bytes,
            "K/V budget from free device memory"
        );
    }
    Ok(engine)
}

/// What loading makes: the weights, what clients are told of them, and the grammar engine over
/// their vocabulary (where one could be made).
type LoadedModel = (Weights, Loaded, Option<Arc<Grammars>>);

/// Loads the model onto `device` with the forward pass `--forward` picks (and checks the
/// tokenizer against it); runs on a blocking thread.
fn load(config: &ValidConfig, device: &device::Device) -> Result<LoadedModel, ServeError> {
    let path = &config.model;
    let model = load_weights(path, &config.run_on, device)?;
    if let Some(e) = &config.entry {
        check_manifest(e, model.config().vocab_size)?;
    }
    let grammars = grammars(config, &model);
    let mut loaded = match &config.entry {
        Some(e) => Loaded {
            model_id: e.name.clone(),
            version: e.version.clone(),
            display_name: e.manifest.display_name.clone().unwrap_or_default(),
            default_params_json: e
                .manifest
                .params
                .as_ref()
                .map(|p| serde_json::Value::Object(p.clone()).to_string())
                .unwrap_or_default(),
            ..Loaded::default()
        },
        None => Loaded {
            model_id: model_id(path),
            ..Loaded::default()
        },
    };
    if let Some(t) = &config.tokenizer {
        let tok = Tokenizer::from_file(t)?;
        check_tokenizer(&tok, &model)?;
        loaded.start_of_turn_id = Some(tok.start_of_turn_id);
        loaded.pad_id = tok.pad_id;
    }
    Ok((model, loaded, grammars))
}

/// The grammar engine over the model's vocabulary: a GGUF file's own, or for a checkpoint
/// directory its `--tokenizer`. Without one, requests with a grammar are refused (and the log
/// says why once, here).
fn grammars(config: &ValidConfig, model: &Weights) -> Option<Arc<Grammars>> {
    let vocab = if config.model.is_dir() {
        match &config.tokenizer {
            Some(t) => Vocabulary::from_tokenizer_json(t),
            None => Err("a checkpoint directory needs --tokenizer for its vocabulary".into()),
        }
    } else {
        Vocabulary::from_gguf(&config.model)
    };
    let made = vocab.and_then(|v| Grammars::for_model(v, model, MASK_THREADS));
    match made {
        Ok(g) => Some(Arc::new(g)),
        Err(e) => {
            tracing::warn!(error = %e, "constrained decoding is off: requests with a grammar are refused");
            None
        }
    }
}

/// The model at `path` (a GGUF file, or for the kernels a safetensors checkpoint directory),
/// loaded for the forward pass `run_on` picks on `device`.
pub fn load_weights(
    path: &Path,
    run_on: &RunOn,
    device: &device::Device,
) -> Result<Weights, ModelError> {
    if run_on.candle_on(device) {
        if path.is_dir() {
            return Err(ModelError::Unsupported(format!(
                "{}: the candle forward pass loads GGUF files; convert the checkpoint to GGUF",
                path.display()
            )));
        }
        let options = run_on.generic_options(device);
        return Ok(Arc::new(GenericModel::load_gguf(path, &device.candle, options)?).into());
    }
    if run_on.dense_gemm_tokens.is_some() {
        tracing::warn!("--dense-gemm-tokens applies to the candle forward pass; the kernels run");
    }
    Ok(if path.is_dir() {
        Arc::new(load_safetensors(path)?).into()
    } else {
        Arc::new(load_gguf(path)?).into()
    })
}

/// A manifest's defaults against the model: every biased token is in its vocabulary (else
/// every request that leaves `logit_bias` out would be refused for a field it never sent).
fn check_manifest(e: &ModelVersion, vocab: usize) -> Result<(), ServeError> {
    let bias = e
        .manifest
        .params
        .as_ref()
        .and_then(|p| p.get("logit_bias"))
        .and_then(|b| b.as_object());
    let outside = bias
        .into_iter()
        .flat_map(|b| b.keys())
        .find(|k| k.parse::<usize>().map_or(true, |id| id >= vocab));
    match outside {
        Some(k) => Err(ServeError::Manifest(format!(
            "{}@{}: manifest.json: params.logit_bias: token {k} is not in the model's \
             vocabulary of {vocab}",
            e.name, e.version
        ))),
        None => Ok(()),
    }
}

fn model_id(path: &Path) -> String {
    let name = path
        .file_name()
        .unwrap_or(path.as_os_str())
        .to_string_lossy();
    name.strip_suffix(".gguf").unwrap_or(&name).to_string()
}

fn check_tokenizer(tok: &Tokenizer, model: &Weights) -> Result<(), ServeError> {
    let vocab = model.config().vocab_size;
    let (bos, eos, end_of_turn) = model.special();
    for (name, tok_id, model_id) in [
        ("<bos>", tok.bos_id, bos),
        ("<eos>", tok.eos_id, eos),
        ("<end_of_turn>", tok.end_of_turn_id, end_of_turn),
        ("<start_of_turn>", tok.start_of_turn_id, None),
    ] {
        if tok_id as usize >= vocab {
            return Err(ServeError::TokenizerMismatch(format!(
                "{name} is token {tok_id}, outside the model's vocabulary of {vocab}"
            )));
        }
        if let Some(m) = model_id.filter(|&m| m != tok_id) {
            return Err(ServeError::TokenizerMismatch(format!(
                "{name} is token {tok_id} in the tokenizer but {m} in the model"
            )));
        }
    }
    Ok(())
}
