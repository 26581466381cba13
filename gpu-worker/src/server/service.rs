//! The `hearth.worker.v1.Worker` gRPC service over the worker's models and their engines.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hearth_shared::proto::{self, worker_server::Worker};
use hearth_shared::SessionId;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use super::loader::Loader;
use super::state::{Loaded, Phase, WorkerState};
use super::{status, stream};
use crate::engine::ModelInfo;

/// `GetTokenizer`'s chunk size: well under gRPC's default 4 MiB message limit.
const TOKENIZER_CHUNK_BYTES: usize = 1 << 20;

#[derive(Debug, Clone)]
pub struct WorkerService {
    state: Arc<WorkerState>,
    stall: Arc<StallWatch>,
    loader: Arc<Loader>,
}

impl WorkerService {
    /// `engine_stall`: how long an engine with work may go without finishing a step.
    pub fn new(state: Arc<WorkerState>, engine_stall: Duration, loader: Arc<Loader>) -> Self {
        Self {
            state,
            stall: Arc::new(StallWatch {
                limit: engine_stall,
                last: Mutex::new(HashMap::new()),
            }),
            loader,
        }
    }
}

/// Tells a stuck engine from a busy one: each engine's step counter must move while it has
/// work (one engine per model, so a busy model never hides a stuck one).
#[derive(Debug)]
struct StallWatch {
    limit: Duration,
    /// Per engine (its model's key): the step count last seen, and since when it has not moved
    /// (or the engine was idle).
    last: Mutex<HashMap<String, (usize, Instant)>>,
}

impl StallWatch {
    fn stalled(&self, engine: &str, steps: usize, has_work: bool) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let seen = last
            .entry(engine.to_string())
            .or_insert((steps, Instant::now()));
        if steps != seen.0 || !has_work {
            *seen = (steps, Instant::now());
            return false;
        }
        seen.1.elapsed() >= self.limit
    }

    /// Forgets the engines not in `engines` (their models were unloaded).
    fn keep(&self, engines: &[String]) {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        last.retain(|k, _| engines.contains(k));
    }
}

impl WorkerService {
    /// Whether some model's engine has work and has not finished a step for the limit.
    fn any_engine_stalled(&self) -> bool {
        let slots = self.state.models.all();
        let mut stalled = false;
        for slot in &slots {
            let Some(engine) = slot.handle() else {
                continue;
            };
            let s = engine.stats();
            // Work counts from the moment a request is handed to the model: an engine thread
            // that hung while idle never takes a new request off its queue, so its own counts
            // stay at zero.
            let has_work = s.running + s.waiting > 0 || slot.in_flight() > 0;
            stalled |= self.stall.stalled(&slot.key(), s.steps, has_work);
        }
        self.stall
            .keep(&slots.iter().map(|s| s.key()).collect::<Vec<_>>());
        stalled
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<proto::WorkerEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Worker for WorkerService {
    async fn info(
        &self,
        _: Request<proto::InfoRequest>,
    ) -> Result<Response<proto::InfoResponse>, Status> {
        let d = &self.state.device;
        let memory = d.memory();
        let mut r = proto::InfoResponse {
            device: Some(proto::DeviceInfo {
                kind: d.kind.into(),
                ordinal: d.ordinal,
                name: d.name.clone(),
                memory_total_bytes: memory.total_bytes,
                memory_used_bytes: memory.used_bytes,
                memory_free_bytes: memory.free_bytes,
                compute_capability: d.compute_capability.clone().unwrap_or_default(),
            }),
            worker_version: env!("CARGO_PKG_VERSION").into(),
            models: (self.state.fetching().into_iter())
                .chain(self.state.models.all().iter().map(|s| s.status()))
                .collect(),
            available: self.loader.available(),
            memory_budget_bytes: self.state.models.budget.unwrap_or(0),
            memory_used_bytes: self.state.models.used_bytes(),
            ..Default::default()
        };
        // The default model's own fields; none while the worker holds no model (all unloaded).
        if let Some(slot) = self.state.models.default_model() {
            if let Some(engine) = slot.handle() {
                describe_default(&mut r, &slot.loaded, engine.model_info());
            }
        }
        Ok(Response::new(r))
    }

    async fn health(
        &self,
        _: Request<proto::HealthRequest>,
    ) -> Result<Response<proto::HealthResponse>, Status> {
        let phase = self.state.phase();
        let state = match phase {
            Phase::Loading => proto::ServingState::Loading,
            Phase::Ready => proto::ServingState::Ready,
            Phase::Draining => proto::ServingState::Draining,
        };
        let mut r = proto::HealthResponse {
            ready: phase == Phase::Ready,
            state: state as i32,
            in_flight: self.state.in_flight() as u32,
            models_epoch: self.state.models_epoch(),
            ..Default::default()
        };
        if phase != Phase::Loading {
            let (s, _) = self.state.models.stats();
            r.running = s.running as u32;
            r.waiting = s.waiting as u32;
            r.kv_blocks_used = s.kv_blocks_used as u64;
            r.kv_blocks_total = s.kv_blocks_total as u64;
            r.cached_sessions = s.cached_sessions as u32;
            r.session_evictions = s.session_evictions as u64;
            r.preemptions = s.preemptions as u64;
            if self.any_engine_stalled() {
                r.engine_stalled = true;
                r.ready = false;
            }
        }
        Ok(Response::new(r))
    }

    type GenerateStream = EventStream;

    async fn generate(
        &self,
        request: Request<Streaming<proto::WorkerRequest>>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        self.state.accepting()?;
        // The caller's trace context (W3C `traceparent` metadata) follows the stream's logs.
        let traceparent = request
            .metadata()
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let span = tracing::info_span!(
            "generate_stream",
            peer = ?request.remote_addr(),
            traceparent = %traceparent,
        );
        let (tx, rx) = mpsc::channel(stream::OUT_QUEUE);
        tokio::spawn(
            stream::connection_task(self.state.clone(), request.into_inner(), tx).instrument(span),
        );
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn drop_session(
        &self,
        request: Request<proto::DropSessionRequest>,
    ) -> Result<Response<proto::DropSessionResponse>, Status> {
        self.state.loaded()?;
        let id = request.into_inner().session_id;
        if id.is_empty() {
            return Err(Status::invalid_argument("session_id: must not be empty"));
        }
        // A session's cache lives in the engine of the model that served it: ask each.
        let mut dropped = false;
        let mut last = None;
        for slot in self.state.models.all() {
            let Some(engine) = slot.handle() else {
                continue;
            };
            match engine.drop_session(SessionId::new(id.clone())).await {
                Ok(()) => dropped = true,
                Err(e) => last = Some(status::status(&e)),
            }
        }
        match (dropped, last) {
            (true, _) => Ok(Response::new(proto::DropSessionResponse {})),
            (false, Some(s)) => Err(s),
            (false, None) => Err(Status::not_found("no session cache on this worker")),
        }
    }

    async fn load_model(
        &self,
        request: Request<proto::LoadModelRequest>,
    ) -> Result<Response<proto::LoadModelResponse>, Status> {
        self.state.accepting()?;
        let r = request.into_inner();
        if r.model.trim().is_empty() {
            return Err(Status::invalid_argument(
                "model: name a model of the repository",
            ));
        }
        let source = self.loader.repository_source(&r.model)?;
        let slot = self.loader.load(source, r.evict_idle).await?;
        Ok(Response::new(proto::LoadModelResponse {
            model: Some(slot.status()),
        }))
    }

    async fn unload_model(
        &self,
        request: Request<proto::UnloadModelRequest>,
    ) -> Result<Response<proto::UnloadModelResponse>, Status> {
        let r = request.into_inner();
        if r.model.trim().is_empty() {
            return Err(Status::invalid_argument("model: name a loaded model"));
        }
        let slot =
            self.state.models.find(&r.model).ok_or_else(|| {
                Status::not_found(format!("model: `{}` is not loaded here", r.model))
            })?;
        if slot.phase() == super::models::ModelPhase::Loading {
            return Err(Status::failed_precondition(format!(
                "model: {} is still loading; unload it once it is ready",
                slot.key()
            )));
        }
        if slot.phase() == super::models::ModelPhase::Unloading {
            return Err(Status::failed_precondition(format!(
                "model: {} is already being unloaded",
                slot.key()
            )));
        }
        let deadline = match r.deadline_ms {
            0 => self.loader.config.drain_timeout,
            ms => Duration::from_millis(u64::from(ms)),
        };
        let ended = self.state.models.unload(&slot, deadline).await;
        Ok(Response::new(proto::UnloadModelResponse {
            ended: ended as u32,
        }))
    }

    type GetTokenizerStream =
        Pin<Box<dyn Stream<Item = Result<proto::TokenizerChunk, Status>> + Send + 'static>>;

    async fn get_tokenizer(
        &self,
        request: Request<proto::GetTokenizerRequest>,
    ) -> Result<Response<Self::GetTokenizerStream>, Status> {
        let model = request.into_inner().model;
        let slot = self
            .state
            .models
            .find(&model)
            .ok_or_else(|| Status::not_found(format!("model: `{model}` is not loaded here")))?;
        let file = slot.loaded.tokenizer.clone().ok_or_else(|| {
            Status::not_found(format!(
                "model: {} has no tokenizer of its own (its version holds no tokenizer.json)",
                slot.key()
            ))
        })?;
        let chunks = (0..file.bytes.len().div_ceil(TOKENIZER_CHUNK_BYTES)).map(move |i| {
            let from = i * TOKENIZER_CHUNK_BYTES;
            let to = (from + TOKENIZER_CHUNK_BYTES).min(file.bytes.len());
            Ok(proto::TokenizerChunk {
                data: file.bytes[from..to].to_vec(),
            })
        });
        Ok(Response::new(Box::pin(tokio_stream::iter(chunks))))
    }
}

/// `Info`'s fields of the default model.
fn describe_default(r: &mut proto::InfoResponse, loaded: &Loaded, m: &ModelInfo) {
    let blocks_total = m.kv_capacity_tokens / m.block_size;
    r.model_id = loaded.model_id.clone();
    r.architecture = m.architecture.clone();
    r.context_length = m.context_length as u32;
    r.vocab_size = m.vocab_size as u32;
    r.special_tokens = Some(proto::SpecialTokens {
        bos: m.bos_id,
        eos: m.eos_id,
        start_of_turn: loaded.start_of_turn_id,
        end_of_turn: m.end_of_turn_id,
        pad: loaded.pad_id,
        default_stop_ids: m.default_stop_ids.clone(),
    });
    r.kv = Some(proto::KvCapacity {
        block_size: m.block_size as u32,
        blocks_total: blocks_total as u64,
        capacity_tokens: m.kv_capacity_tokens as u64,
        budget_bytes: (blocks_total * m.kv_block_bytes) as u64,
    });
    r.max_batch = m.max_batch as u32;
    r.max_waiting = m.max_waiting as u32;
    r.model_version = loaded.version.clone();
    r.display_name = loaded.display_name.clone();
    r.default_params_json = loaded.default_params_json.clone();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_is_stalled_only_with_work_and_no_steps_for_the_limit() {
        let w = StallWatch {
            limit: Duration::from_millis(30),
            last: Mutex::new(HashMap::new()),
        };
        assert!(!w.stalled("a", 0, true));
        assert!(!w.stalled("b", 0, true));
        std::thread::sleep(Duration::from_millis(40));
        assert!(!w.stalled("b", 5, true), "another engine's steps");
        assert!(
            w.stalled("a", 0, true),
            "work waiting, no step for longer than the limit, whatever the other engine does"
        );
        assert!(!w.stalled("a", 1, true), "a step was made");
        std::thread::sleep(Duration::from_millis(40));
        assert!(!w.stalled("a", 1, false), "idle is not stuck");
        assert!(
            !w.stalled("a", 1, true),
            "the clock restarts when work arrives"
        );
        w.keep(&["b".to_string()]);
        assert!(!w.stalled("a", 1, true), "a forgotten engine starts afresh");
    }
}
