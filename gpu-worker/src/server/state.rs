//! What every RPC of one worker process shares: the serving state (loading → ready → draining),
//! its models (see [`super::models`]), and the count of requests being streamed.

use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;

use hearth_shared::proto;
use tokio::sync::{watch, Notify};
use tonic::Status;

use super::models::{ModelSlot, Models, Residency};
use crate::device::Device;

/// Where the worker is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    Loading = 1,
    Ready = 2,
    Draining = 3,
}

/// Facts about a loaded model that `Info` reports beyond the engine's [`crate::engine::ModelInfo`].
#[derive(Clone, Debug, Default)]
pub struct Loaded {
    pub model_id: String,
    /// From a repository: the version, the display name and the default sampling parameters
    /// (JSON); empty otherwise.
    pub version: String,
    pub display_name: String,
    pub default_params_json: String,
    pub start_of_turn_id: Option<u32>,
    pub pad_id: Option<u32>,
    /// Its version's own `tokenizer.json` (served by `GetTokenizer`) and the file's SHA-256;
    /// none for a model without one.
    pub tokenizer: Option<TokenizerFile>,
}

/// A tokenizer file as it is on disk, named by its SHA-256.
#[derive(Clone, Debug)]
pub struct TokenizerFile {
    pub sha256: String,
    pub bytes: Arc<[u8]>,
}

impl Loaded {
    /// `name@version`, or the name of a model given by path.
    pub fn key(&self) -> String {
        match self.version.as_str() {
            "" => self.model_id.clone(),
            v => format!("{}@{v}", self.model_id),
        }
    }
}

#[derive(Debug)]
pub struct WorkerState {
    phase: AtomicU8,
    /// Tells open `Generate` streams that draining began, so they refuse new requests.
    drain_tx: watch::Sender<bool>,
    pub models: Models,
    pub device: Device,
    /// Engine request ids are unique per process; each stream maps its own ids onto them.
    next_engine_id: AtomicU64,
    /// Requests streaming, for the drain.
    in_flight: Streaming,
    /// The start-up model's file while it is fetched from a URL.
    fetching: std::sync::Mutex<Option<Fetching>>,
}

impl WorkerState {
    /// `keep_alive_ms`: how long a repository model stays loaded once idle (negative: for good);
    /// `residency`: which models an eviction for room leaves alone.
    pub fn new(
        device: Device,
        memory_budget: Option<u64>,
        keep_alive_ms: i64,
        residency: Residency,
    ) -> Arc<Self> {
        Arc::new(Self {
            phase: AtomicU8::new(Phase::Loading as u8),
            drain_tx: watch::channel(false).0,
            models: Models::new(memory_budget, keep_alive_ms, residency),
            device,
            next_engine_id: AtomicU64::new(1),
            in_flight: Streaming::default(),
            fetching: std::sync::Mutex::default(),
        })
    }

    pub fn phase(&self) -> Phase {
        match self.phase.load(Ordering::SeqCst) {
            1 => Phase::Loading,
            2 => Phase::Ready,
            _ => Phase::Draining,
        }
    }

    /// The start-up models are loaded: the worker accepts work (unless draining began).
    pub fn set_ready(&self) {
        let _ = self.phase.compare_exchange(
            Phase::Loading as u8,
            Phase::Ready as u8,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
    }

    pub fn begin_drain(&self) {
        self.phase.store(Phase::Draining as u8, Ordering::SeqCst);
        self.drain_tx.send_replace(true);
    }

    pub fn drain_signal(&self) -> watch::Receiver<bool> {
        self.drain_tx.subscribe()
    }

    /// The default model, once one is listed (also while draining), else `UNAVAILABLE`.
    pub fn loaded(&self) -> Result<Arc<ModelSlot>, Status> {
        self.models
            .default_model()
            .ok_or_else(|| Status::unavailable("the worker is still loading its model"))
    }

    /// Whether the worker accepts new work; otherwise the status to refuse it with.
    pub fn accepting(&self) -> Result<(), Status> {
        match self.phase() {
            Phase::Ready => Ok(()),
            Phase::Draining => Err(Status::unavailable(
                "the worker is shutting down and accepts no new requests",
            )),
            Phase::Loading => Err(Status::unavailable("the worker is still loading its model")),
        }
    }

    /// The model `asked` names (empty: the default), if it takes new requests now: NOT_FOUND
    /// for a model this worker does not hold, UNAVAILABLE for one loading or unloading.
    pub fn model_for(&self, asked: &str) -> Result<Arc<ModelSlot>, Status> {
        self.accepting()?;
        let slot = self.models.find(asked).ok_or_else(|| {
            let held: Vec<String> = self.models.all().iter().map(|s| s.key()).collect();
            Status::not_found(format!(
                "model: `{asked}` is not loaded on this worker (it holds {})",
                held.join(", ")
            ))
        })?;
        slot.accepting()?;
        Ok(slot)
    }

    pub fn next_engine_id(&self) -> u64 {
        self.next_engine_id.fetch_add(1, Ordering::Relaxed)
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.count()
    }

    /// Counts a request as streaming until the guard drops.
    pub fn track(self: &Arc<Self>) -> InFlight {
        self.in_flight.enter();
        InFlight(self.clone())
    }

    /// Resolves once no request is streaming.
    pub async fn all_idle(&self) {
        self.in_flight.all_idle().await;
    }
}

/// A model file being fetched: the model it will be, and how far the fetch has come.
#[derive(Debug, Clone)]
pub struct Fetching {
    pub model_id: String,
    pub progress: Arc<crate::fetch::Progress>,
}

impl WorkerState {
    pub fn set_fetching(&self, f: Option<Fetching>) {
        *self.fetching.lock().unwrap_or_else(|p| p.into_inner()) = f;
    }

    /// The fetch as `Info.models` reports it: a loading model with its bytes.
    pub fn fetching(&self) -> Option<proto::ModelStatus> {
        let f = self
            .fetching
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()?;
        Some(proto::ModelStatus {
            model_id: f.model_id,
            state: proto::ModelState::Loading as i32,
            fetched_bytes: f.progress.done(),
            fetch_total_bytes: f.progress.total().unwrap_or(0),
            ..Default::default()
        })
    }

    /// `Health.models_epoch`: the models' epoch, moved on by each 64 KiB a fetch brings, so
    /// that the orchestrator fetches `Info` (and its progress) again as it goes (at most once a
    /// health check).
    pub fn models_epoch(&self) -> u64 {
        let fetched = self.fetching().map_or(0, |f| f.fetched_bytes >> 16);
        self.models.epoch() + fetched
    }
}

/// A count of requests streaming, and a wake-up whenever one ends (for a drain, or a model's
/// unload, to check it again).
#[derive(Debug, Default)]
pub struct Streaming {
    count: AtomicUsize,
    idle: Notify,
}

impl Streaming {
    pub fn enter(&self) {
        self.count.fetch_add(1, Ordering::SeqCst);
    }

    pub fn leave(&self) {
        self.count.fetch_sub(1, Ordering::SeqCst);
        self.idle.notify_waiters();
    }

    pub fn count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    /// Resolves once nothing is streaming.
    pub async fn all_idle(&self) {
        loop {
            let woken = self.idle.notified();
            if self.count() == 0 {
                return;
            }
            woken.await;
        }
    }
}

/// A request being streamed; see [`WorkerState::track`].
#[derive(Debug)]
pub struct InFlight(Arc<WorkerState>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.leave();
    }
}
