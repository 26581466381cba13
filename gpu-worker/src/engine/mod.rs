//! The engine: a scheduler that owns the model, the KV memory and every live sequence, running on
//! its own OS thread, and the cloneable [`EngineHandle`] that async code uses to talk to it.
//!
//! Requests are validated on the caller's side into a [`ValidRequest`] (only validation builds
//! one), sent over a bounded command channel, and answered with a stream of [`EngineEvent`]s:
//! `Started`, then `Token`s, then exactly one `Finished` or `Error`. Dropping the stream cancels the
//! request at the next engine step.

mod backend;
pub mod constraint;
mod error;
pub mod lookup;
mod mask_queue;
mod scheduler;
mod scripted;
mod share;
mod types;
mod work;

pub use backend::Weights;
pub use error::EngineError;
pub use mask_queue::mask_threads;
pub use scheduler::{Scheduler, StepSummary};
pub use types::{
    DiskConfig, EngineConfig, EngineEvent, EngineStats, GenerateRequest, StepObserver, Timings,
    ValidRequest, DEFAULT_WINDOW_MARGIN,
};

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hearth_shared::{RequestId, SessionId};
use tokio::sync::{mpsc, oneshot};

/// Events of one request. Unbounded, but bounded in practice: a request produces at most
/// `max_new_tokens + 2` events, and the engine thread must never block on a slow reader.
pub type EventStream = mpsc::UnboundedReceiver<EngineEvent>;
pub(crate) type EventSender = mpsc::UnboundedSender<EngineEvent>;

pub(crate) enum Command {
    Submit(Box<ValidRequest>, EventSender),
    DropSession(SessionId, oneshot::Sender<Result<(), EngineError>>),
    /// Nothing but a nudge: a cancel is waiting in the cancel queue. Dropped when the queue is
    /// full, which is harmless, since a busy engine reads the cancel queue every step anyway.
    Wake,
    Shutdown,
}

/// Cancels travel apart from the bounded command queue: a full queue must never lose one.
pub(crate) enum Cancel {
    One(RequestId),
    All,
}

/// Live counters, updated by the engine thread after every step.
#[derive(Debug, Default)]
pub(crate) struct SharedStats {
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    pub blocks_used: AtomicUsize,
    pub blocks_total: AtomicUsize,
    pub blocks_cached: AtomicUsize,
    pub cached_sessions: AtomicUsize,
    pub disk_sessions: AtomicUsize,
    pub disk_restores: AtomicUsize,
    pub evictions: AtomicUsize,
    pub preemptions: AtomicUsize,
    pub steps: AtomicUsize,
    pub prefix_queries: AtomicUsize,
    pub prefix_hits: AtomicUsize,
    pub spec_drafted: AtomicUsize,
    pub spec_accepted: AtomicUsize,
}

/// A cloneable handle to the engine thread.
#[derive(Clone, Debug)]
pub struct EngineHandle {
    tx: SyncSender<Command>,
    cancels: std::sync::mpsc::Sender<Cancel>,
    stats: Arc<SharedStats>,
    info: Arc<ModelInfo>,
    closed: Arc<AtomicBool>,
    grammars: Option<Arc<constraint::Grammars>>,
}

/// What clients need to know about the loaded model.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub architecture: String,
    pub context_length: usize,
    pub vocab_size: usize,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub end_of_turn_id: Option<u32>,
    /// Stop tokens used when a request names none (EOS and `<end_of_turn>`).
    pub default_stop_ids: Vec<u32>,
    pub kv_capacity_tokens: usize,
    pub block_size: usize,
    /// Bytes of one KV block (all layers, K and V).
    pub kv_block_bytes: usize,
    pub max_batch: usize,
    pub max_waiting: usize,
    /// Commands the engine accepts before `submit` answers `QueueFull`.
    pub command_queue: usize,
}

/// Owns the engine thread; dropping it shuts the engine down after in-flight work.
#[derive(Debug)]
pub struct Engine {
    handle: EngineHandle,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Starts the engine thread over `weights` (an `Arc<Model>` for the CPU kernels, an
    /// `Arc<GenericModel>` for the device-generic pass).
    pub fn start(weights: impl Into<Weights>, config: EngineConfig) -> Result<Self, EngineError> {
        let sched = Scheduler::new(weights, config.clone())?;
        let info = Arc::new(sched.model_info());
        let (tx, rx) = sync_channel(config.command_queue);
        let (cancels, cancel_rx) = std::sync::mpsc::channel();
        let stats = Arc::new(SharedStats::default());
        // Counters are valid from the first `stats()` call, not only after the first step.
        publish(&sched, &stats);
        let thread_stats = stats.clone();
        let on_step = config.on_step;
        let thread = std::thread::Builder::new()
            .name("hearth-engine".into())
            .spawn(move || engine_task(sched, rx, cancel_rx, thread_stats, on_step))
            .map_err(|e| EngineError::Internal(format!("cannot start engine thread: {e}")))?;
        Ok(Self {
            handle: EngineHandle {
                tx,
                cancels,
                stats,
                info,
                closed: Arc::new(AtomicBool::new(false)),
                grammars: config.grammars.clone(),
            },
            thread: Some(thread),
        })
    }

    /// Starts a scripted engine (load tests only): no model, one token per request every
    /// `interval`, echoing the request's prompt; see [`scripted`].
    pub fn scripted(
        interval: Duration,
        config: &EngineConfig,
        freeze_after: Option<u64>,
    ) -> Result<Self, EngineError> {
        let info = Arc::new(ModelInfo {
            architecture: "scripted".into(),
            context_length: 1 << 20,
            vocab_size: u32::MAX as usize,
            bos_id: None,
            eos_id: None,
            end_of_turn_id: None,
            default_stop_ids: Vec::new(),
            kv_capacity_tokens: 1 << 30,
            block_size: config.block_size,
            kv_block_bytes: 0,
            max_batch: config.max_batch,
            max_waiting: config.max_waiting,
            command_queue: config.command_queue,
        });
        let (tx, rx) = sync_channel(config.command_queue);
        let (cancels, cancel_rx) = std::sync::mpsc::channel();
        let stats = Arc::new(SharedStats::default());
        let thread_stats = stats.clone();
        let thread = std::thread::Builder::new()
            .name("hearth-scripted".into())
            .spawn(move || {
                scripted::scripted_task(interval, rx, cancel_rx, thread_stats, freeze_after)
            })
            .map_err(|e| EngineError::Internal(format!("cannot start engine thread: {e}")))?;
        Ok(Self {
            handle: EngineHandle {
                tx,
                cancels,
                stats,
                info,
                closed: Arc::new(AtomicBool::new(false)),
                grammars: config.grammars.clone(),
            },
            thread: Some(thread),
        })
    }

    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }

    /// Stops accepting work, lets running sequences finish, and joins the thread.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.handle.closed.store(true, Ordering::SeqCst);
        let _ = self.handle.tx.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

impl EngineHandle {
    pub fn model_info(&self) -> &ModelInfo {
        &self.info
    }

    /// Validates and queues a request; its events arrive on the returned stream.
    pub fn submit(&self, req: GenerateRequest) -> Result<EventStream, EngineError> {
        let valid = types::validate(req, &self.info)?.constrain(self.grammars.as_deref())?;
        if self.closed.load(Ordering::SeqCst) {
            return Err(EngineError::ShuttingDown);
        }
        let (etx, erx) = mpsc::unbounded_channel();
        match self.tx.try_send(Command::Submit(Box::new(valid), etx)) {
            Ok(()) => Ok(erx),
            Err(TrySendError::Full(_)) => Err(EngineError::QueueFull {
                limit: self.info.command_queue,
            }),
            Err(TrySendError::Disconnected(_)) => Err(EngineError::ShuttingDown),
        }
    }

    /// Cancels a request; its stream ends with `Finished { reason: Cancelled }` at the next step.
    pub fn cancel(&self, id: RequestId) {
        // Fails only when the engine is gone, and then nothing is left to cancel.
        let _ = self.cancels.send(Cancel::One(id));
        self.wake();
    }

    /// Makes an idle engine thread look at its cancel queue.
    fn wake(&self) {
        let _ = self.tx.try_send(Command::Wake);
    }

    /// Cancels every running and waiting request (a drain past its deadline).
    pub fn cancel_all(&self) {
        let _ = self.cancels.send(Cancel::All);
        self.wake();
    }

    /// Frees a session's cached KV.
    pub async fn drop_session(&self, session: SessionId) -> Result<(), EngineError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .try_send(Command::DropSession(session, tx))
            .map_err(|e| match e {
                TrySendError::Full(_) => EngineError::QueueFull {
                    limit: self.info.command_queue,
                },
                TrySendError::Disconnected(_) => EngineError::ShuttingDown,
            })?;
        rx.await.map_err(|_| EngineError::ShuttingDown)?
    }

    pub fn stats(&self) -> EngineStats {
        let s = &self.stats;
        let l = |a: &AtomicUsize| a.load(Ordering::Relaxed);
        EngineStats {
            running: l(&s.running),
            waiting: l(&s.waiting),
            kv_blocks_used: l(&s.blocks_used),
            kv_blocks_total: l(&s.blocks_total),
            kv_blocks_cached: l(&s.blocks_cached),
            cached_sessions: l(&s.cached_sessions),
            disk_sessions: l(&s.disk_sessions),
            disk_restores: l(&s.disk_restores),
            session_evictions: l(&s.evictions),
            preemptions: l(&s.preemptions),
            steps: l(&s.steps),
            prefix_cache_queries_tokens: l(&s.prefix_queries),
            prefix_cache_hits_tokens: l(&s.prefix_hits),
            spec_draft_tokens: l(&s.spec_drafted),
            spec_accepted_tokens: l(&s.spec_accepted),
        }
    }
}

/// The engine loop: take commands, run a step, publish counters. Blocks only when idle.
fn engine_task(
    mut sched: Scheduler,
    rx: Receiver<Command>,
    cancels: Receiver<Cancel>,
    stats: Arc<SharedStats>,
    on_step: Option<StepObserver>,
) {
    let max_batch = sched.model_info().max_batch;
    let mut shutting_down = false;
    loop {
        if sched.is_idle() {
            if shutting_down {
                break;
            }
            publish(&sched, &stats);
            match rx.recv() {
                Ok(cmd) => shutting_down |= handle_command(&mut sched, cmd, &stats),
                Err(_) => break,
            }
        }
        // Cancels are taken before commands: a request's cancel is sent after its submit, so
        // every request a cancel taken here names is among the commands taken next, however
        // the two channels interleave.
        let cancelled: Vec<Cancel> = cancels.try_iter().collect();
        loop {
            match rx.try_recv() {
                Ok(cmd) => shutting_down |= handle_command(&mut sched, cmd, &stats),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    shutting_down = true;
                    break;
                }
            }
        }
        for c in cancelled {
            match c {
                Cancel::One(id) => sched.cancel(id),
                Cancel::All => sched.cancel_all(),
            }
        }
        // A bug in one step must not take the engine (and every other user) down.
        let started = Instant::now();
        match catch_unwind(AssertUnwindSafe(|| sched.step())) {
            Ok(Some(summary)) => {
                if let Some(observe) = on_step {
                    observe(&summary, started.elapsed(), max_batch);
                }
            }
            Ok(None) => {}
            Err(_) => {
                tracing::error!("engine step panicked; failing the sequences in it");
                sched.fail_running("internal error in engine step");
            }
        }
        stats.steps.fetch_add(1, Ordering::Relaxed);
        publish(&sched, &stats);
    }
    tracing::info!("engine thread stopped");
}

fn handle_command(sched: &mut Scheduler, cmd: Command, stats: &SharedStats) -> bool {
    match cmd {
        Command::Submit(req, tx) => sched.enqueue(*req, tx),
        Command::Wake => {}
        Command::DropSession(s, reply) => {
            let result = sched.drop_session(&s);
            // The caller may read the counters as soon as it has the answer.
            publish(sched, stats);
            let _ = reply.send(result);
        }
        Command::Shutdown => return true,
    }
    false
}

fn publish(sched: &Scheduler, stats: &SharedStats) {
    let s = sched.stats();
    for (counter, value) in [
        (&stats.running, s.running),
        (&stats.waiting, s.waiting),
        (&stats.blocks_used, s.kv_blocks_used),
        (&stats.blocks_total, s.kv_blocks_total),
        (&stats.blocks_cached, s.kv_blocks_cached),
        (&stats.cached_sessions, s.cached_sessions),
        (&stats.disk_sessions, s.disk_sessions),
        (&stats.disk_restores, s.disk_restores),
        (&stats.evictions, s.session_evictions),
        (&stats.preemptions, s.preemptions),
        (&stats.prefix_queries, s.prefix_cache_queries_tokens),
        (&stats.prefix_hits, s.prefix_cache_hits_tokens),
        (&stats.spec_drafted, s.spec_draft_tokens),
        (&stats.spec_accepted, s.spec_accepted_tokens),
    ] {
        counter.store(value, Ordering::Relaxed);
    }
}
