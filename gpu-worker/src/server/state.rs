//! What every RPC of one worker process shares: the serving state (loading → ready → draining),
//! the engine once it exists, and the count of requests being streamed.

use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use tokio::sync::{watch, Notify};
use tonic::Status;

use crate::device::Device;
use crate::engine::EngineHandle;

/// Where the worker is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    Loading = 1,
    Ready = 2,
    Draining = 3,
}

/// Facts about the loaded model that `Info` reports beyond the engine's [`crate::engine::ModelInfo`].
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
}

#[derive(Debug)]
pub struct WorkerState {
    phase: AtomicU8,
    /// Tells open `Generate` streams that draining began, so they refuse new requests.
    drain_tx: watch::Sender<bool>,
    engine: OnceLock<(EngineHandle, Loaded)>,
    pub device: Device,
    /// Engine request ids are unique per process; each stream maps its own ids onto them.
    next_engine_id: AtomicU64,
    in_flight: AtomicUsize,
    /// Woken whenever a request stops streaming, for the drain to re-check `in_flight`.
    idle: Notify,
}

impl WorkerState {
    pub fn new(device: Device) -> Arc<Self> {
        Arc::new(Self {
            phase: AtomicU8::new(Phase::Loading as u8),
            drain_tx: watch::channel(false).0,
            engine: OnceLock::new(),
            device,
            next_engine_id: AtomicU64::new(1),
            in_flight: AtomicUsize::new(0),
            idle: Notify::new(),
        })
    }

    pub fn phase(&self) -> Phase {
        match self.phase.load(Ordering::SeqCst) {
            1 => Phase::Loading,
            2 => Phase::Ready,
            _ => Phase::Draining,
        }
    }

    /// Publishes the engine and starts accepting work (unless draining already began).
    pub fn set_ready(&self, engine: EngineHandle, loaded: Loaded) {
        let _ = self.engine.set((engine, loaded));
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

    pub fn engine(&self) -> Option<&(EngineHandle, Loaded)> {
        self.engine.get()
    }

    /// The engine once the model is loaded (also while draining), else `UNAVAILABLE`.
    pub fn loaded(&self) -> Result<&(EngineHandle, Loaded), Status> {
        self.engine
            .get()
            .ok_or_else(|| Status::unavailable("the worker is still loading its model"))
    }

    /// The engine, if the worker accepts new work; otherwise the status to refuse it with.
    pub fn accepting(&self) -> Result<&EngineHandle, Status> {
        match (self.phase(), self.engine.get()) {
            (Phase::Ready, Some((engine, _))) => Ok(engine),
            (Phase::Draining, _) => Err(Status::unavailable(
                "the worker is shutting down and accepts no new requests",
            )),
            _ => self.loaded().map(|(engine, _)| engine),
        }
    }

    pub fn next_engine_id(&self) -> u64 {
        self.next_engine_id.fetch_add(1, Ordering::Relaxed)
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Counts a request as streaming until the guard drops.
    pub fn track(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(self.clone())
    }

    /// Resolves once no request is streaming.
    pub async fn all_idle(&self) {
        loop {
            let woken = self.idle.notified();
            if self.in_flight() == 0 {
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
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.0.idle.notify_waiters();
    }
}
