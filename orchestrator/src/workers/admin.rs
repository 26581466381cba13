//! Loading and unloading models on the workers (the admin API), each worker's models as it
//! reports them, and fetching a model's own tokenizer from a worker that holds it.
//!
//! A load goes to the worker named, else to the ready workers in order of free memory (their
//! `--memory-budget` less what their models take, else their device's free memory): the first
//! whose repository has the model and that has room loads it. An unload goes to every worker
//! that holds the model (or the one named); each lets the model's running requests finish until
//! the deadline and ends the rest as unavailable, and this orchestrator continues those on
//! another worker serving the model.

use std::time::Duration;

use hearth_shared::proto;
use serde::Serialize;
use tonic::Code;

use super::connection::Client;
use super::health::WorkerSlot;
use super::models::ModelKey;
use super::pool::{Slots, WorkerPool};

/// One model on one worker, as the admin API shows it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct WorkerModel {
    /// `name@version`, or the name of a model its worker was given by path.
    pub model: String,
    /// `loading`, `ready`, `unloading` or `failed`.
    pub state: String,
    pub weights_bytes: u64,
    pub kv_bytes: u64,
    /// Requests streaming on it now.
    pub in_flight: u32,
    /// Seconds since its last request.
    pub idle_s: f64,
    /// How long it stays loaded once idle, in seconds; none: for good (or until evicted).
    pub keep_alive_s: Option<f64>,
    /// Why its load failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One worker and its models.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct WorkerModels {
    /// `worker-<n>`, its place in the `--worker` list.
    pub worker: String,
    pub ready: bool,
    /// Its `--memory-budget` (0: none), and what its models take.
    pub memory_budget_bytes: u64,
    pub memory_used_bytes: u64,
    pub models: Vec<WorkerModel>,
}

/// Why a load or unload did not happen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdminError {
    #[error("no worker is called `{0}` (GET /v1/admin/workers lists them)")]
    UnknownWorker(String),
    /// No worker's repository has the model, or (unload) no worker holds it.
    #[error("{0}")]
    NotFound(String),
    /// It fits on no worker; the workers' answers name the bytes. With `retry_after_secs`,
    /// room can be made later: the models that could make it were used too recently.
    #[error("{detail}")]
    NoRoom {
        detail: String,
        retry_after_secs: Option<u64>,
    },
    #[error("no worker is ready")]
    NoWorker,
    /// A worker failed to load or unload it.
    #[error("{0}")]
    Failed(String),
}

pub(super) fn model_state(s: i32) -> &'static str {
    match proto::ModelState::try_from(s) {
        Ok(proto::ModelState::Loading) => "loading",
        Ok(proto::ModelState::Ready) => "ready",
        Ok(proto::ModelState::Unloading) => "unloading",
        Ok(proto::ModelState::Failed) => "failed",
        _ => "unknown",
    }
}

/// Most bytes a tokenizer file may have (Gemma 3's is 33 MB).
const MAX_TOKENIZER_BYTES: usize = 256 << 20;

fn key(m: &proto::ModelStatus) -> String {
    ModelKey {
        id: m.model_id.clone(),
        version: m.model_version.clone(),
    }
    .to_string()
}

/// When a worker's refusal says to retry (see [`proto::RETRY_AFTER_KEY`]).
fn retry_after(s: &tonic::Status) -> Option<u64> {
    s.metadata()
        .get(proto::RETRY_AFTER_KEY)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

fn worker_model(m: &proto::ModelStatus) -> WorkerModel {
    WorkerModel {
        model: key(m),
        state: model_state(m.state).into(),
        weights_bytes: m.weights_bytes,
        kv_bytes: m.kv_bytes,
        in_flight: m.in_flight,
        idle_s: m.idle_s,
        keep_alive_s: (m.keep_alive_ms >= 0).then(|| m.keep_alive_ms as f64 / 1000.0),
        error: Some(m.error.clone()).filter(|e| !e.is_empty()),
    }
}

/// A worker's free memory for another model, as its `Info` says.
fn free_bytes(info: &proto::InfoResponse) -> u64 {
    if info.memory_budget_bytes > 0 {
        return info
            .memory_budget_bytes
            .saturating_sub(info.memory_used_bytes);
    }
    info.device.as_ref().map_or(0, |d| d.memory_free_bytes)
}

/// Whether a load may make room on its worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Eviction {
    /// Only where the model fits beside what is loaded (an operator's load).
    Never,
    /// The worker first unloads its least recently used idle models, never a pinned one nor one
    /// used within its `--min-resident-secs` (a load on demand).
    IdleModels,
}

impl WorkerPool {
    /// Every worker and the models it holds.
    pub fn worker_models(&self) -> Vec<WorkerModels> {
        self.slots()
            .iter()
            .map(|s| {
                let ready = s.conn().is_some();
                let st = s.state();
                let info = st.info.clone().unwrap_or_default();
                WorkerModels {
                    worker: s.name.clone(),
                    ready,
                    memory_budget_bytes: info.memory_budget_bytes,
                    memory_used_bytes: info.memory_used_bytes,
                    models: info.models.iter().map(worker_model).collect(),
                }
            })
            .collect()
    }

    /// The worker called `worker` among `slots` (a snapshot the caller holds through its calls).
    fn named<'a>(slots: &'a Slots, worker: &str) -> Result<&'a WorkerSlot, AdminError> {
        slots
            .iter()
            .find(|s| s.name == worker)
            .map(|s| &**s)
            .ok_or_else(|| AdminError::UnknownWorker(worker.to_string()))
    }

    /// A client for a call that may take long (a load): its own connection, without the health
    /// checks' timeout.
    async fn admin_client(&self, slot: &WorkerSlot) -> Result<Client, AdminError> {
        let link = slot.link(&self.config);
        let endpoint = link
            .endpoint(&slot.addr)
            .map_err(AdminError::Failed)?
            .connect_timeout(Duration::from_secs(2));
        let channel = endpoint.connect().await.map_err(|e| {
            tracing::warn!(worker = %slot.addr, error = %e, "admin call: worker unreachable");
            AdminError::Failed(format!("{} cannot be reached", slot.name))
        })?;
        Ok(link.client(channel))
    }

    /// Loads `model` (`name` or `name@version`) on `worker`, else on the ready worker with the
    /// most free memory whose repository has it and where it fits (or where `eviction` makes
    /// room). Returns the worker's name and the model as it reports it.
    pub async fn load_model(
        &self,
        model: &str,
        worker: Option<&str>,
        eviction: Eviction,
    ) -> Result<(String, WorkerModel), AdminError> {
        let slots = self.slots();
        let candidates = Self::load_candidates(&slots, model, worker)?;
        let (mut missing, mut full) = (Vec::new(), Vec::new());
        // The soonest a full worker said it may have room.
        let mut retry: Option<u64> = None;
        for slot in candidates {
            let mut client = self.admin_client(slot).await?;
            let req = proto::LoadModelRequest {
                model: model.to_string(),
                evict_idle: eviction == Eviction::IdleModels,
            };
            match client.load_model(req).await {
                Ok(r) => {
                    let status = r.into_inner().model.unwrap_or_default();
                    tracing::info!(worker = %slot.addr, model = %key(&status), "model loaded");
                    // Routing sees it now, not at the next health check.
                    self.refresh_info(slot, &mut client).await;
                    self.room.notify_waiters();
                    return Ok((slot.name.clone(), worker_model(&status)));
                }
                Err(s) => {
                    let line = format!("{}: {}", slot.name, s.message());
                    match s.code() {
                        Code::NotFound | Code::FailedPrecondition if !is_load_failure(&s) => {
                            missing.push(line)
                        }
                        Code::ResourceExhausted => {
                            full.push(line);
                            retry = retry.into_iter().chain(retry_after(&s)).min();
                        }
                        _ => return Err(AdminError::Failed(line)),
                    }
                }
            }
        }
        if !full.is_empty() {
            return Err(AdminError::NoRoom {
                detail: format!("the model {model} fits on no worker: {}", full.join("; ")),
                retry_after_secs: retry,
            });
        }
        Err(AdminError::NotFound(format!(
            "no worker can load the model {model}: {}",
            missing.join("; ")
        )))
    }

    /// The workers to try loading `model` on, in order: `worker` alone when named, else every
    /// connected worker, those whose repository lists the model first, then the most free
    /// memory first.
    fn load_candidates<'a>(
        slots: &'a Slots,
        model: &str,
        worker: Option<&str>,
    ) -> Result<Vec<&'a WorkerSlot>, AdminError> {
        if let Some(w) = worker {
            return Ok(vec![Self::named(slots, w)?]);
        }
        let has = |s: &WorkerSlot| s.state().available.iter().any(|k| k.named_by(model));
        let mut ranked: Vec<(&WorkerSlot, (bool, u64))> = slots
            .iter()
            .filter(|s| s.conn().is_some())
            .map(|s| {
                let free = s.state().info.as_ref().map_or(0, free_bytes);
                (&**s, (has(s), free))
            })
            .collect();
        if ranked.is_empty() {
            return Err(AdminError::NoWorker);
        }
        ranked.sort_by_key(|&(_, rank)| std::cmp::Reverse(rank));
        Ok(ranked.into_iter().map(|(s, _)| s).collect())
    }

    /// Unloads `model` from every worker that holds it (or from `worker`), letting its running
    /// requests go on for `deadline` first (none: each worker's drain timeout). Returns each worker's name and how many requests it
    /// cut short (they continue elsewhere where another worker serves the model).
    pub async fn unload_model(
        &self,
        model: &str,
        worker: Option<&str>,
        deadline: Option<Duration>,
    ) -> Result<Vec<(String, u32)>, AdminError> {
        let holds = |s: &WorkerSlot| {
            s.state().info.as_ref().is_some_and(|i| {
                i.models
                    .iter()
                    .any(|m| m.model_id == model || key(m) == model)
            })
        };
        let slots = self.slots();
        let targets: Vec<&WorkerSlot> = match worker {
            Some(w) => vec![Self::named(&slots, w)?],
            None => slots.iter().map(|s| &**s).filter(|s| holds(s)).collect(),
        };
        if targets.is_empty() {
            return Err(AdminError::NotFound(format!(
                "no worker holds the model {model}"
            )));
        }
        let mut out = Vec::new();
        for slot in targets {
            let mut client = self.admin_client(slot).await?;
            let req = proto::UnloadModelRequest {
                model: model.to_string(),
                // 0: the worker's own drain timeout; otherwise at least a millisecond.
                deadline_ms: deadline.map_or(0, |d| {
                    u32::try_from(d.as_millis()).unwrap_or(u32::MAX).max(1)
                }),
            };
            match client.unload_model(req).await {
                Ok(r) => {
                    self.refresh_info(slot, &mut client).await;
                    out.push((slot.name.clone(), r.into_inner().ended));
                }
                Err(s) if s.code() == Code::NotFound && worker.is_some() => {
                    return Err(AdminError::NotFound(format!(
                        "{}: {}",
                        slot.name,
                        s.message()
                    )))
                }
                Err(s) => {
                    return Err(AdminError::Failed(format!(
                        "{}: {}",
                        slot.name,
                        s.message()
                    )))
                }
            }
        }
        Ok(out)
    }
}

impl WorkerPool {
    /// Fetches `slot`'s `Info` again (its models changed).
    async fn refresh_info(&self, slot: &WorkerSlot, client: &mut Client) {
        let health = client.health(proto::HealthRequest {}).await;
        let info = client.info(proto::InfoRequest {}).await;
        if let (Ok(h), Ok(i)) = (health, info) {
            slot.state()
                .set_info(i.into_inner(), h.into_inner().models_epoch);
        }
    }
}

/// Whether a worker's refusal says the model's own load failed (a broken file), rather than
/// that the worker cannot load it at all (no repository, not in it).
fn is_load_failure(s: &tonic::Status) -> bool {
    s.code() == Code::FailedPrecondition && s.message().starts_with("loading ")
}

impl WorkerPool {
    /// The tokenizer file of `model` whose SHA-256 is `sha256`, from a ready worker that
    /// reports the model with it (the next one when one fails), checked against the digest.
    pub async fn fetch_tokenizer(
        &self,
        model: &ModelKey,
        sha256: &str,
    ) -> Result<Vec<u8>, AdminError> {
        let name = model.to_string();
        let holds = |s: &WorkerSlot| {
            s.conn().is_some()
                && s.state()
                    .models
                    .iter()
                    .any(|r| r.key == *model && r.tokenizer_sha256 == sha256)
        };
        let mut failures = Vec::new();
        for slot in self.slots().iter().filter(|s| holds(s)) {
            match self.tokenizer_from(slot, &name, sha256).await {
                Ok(bytes) => return Ok(bytes),
                Err(e) => {
                    tracing::warn!(worker = %slot.addr, model = %name, error = %e, "fetching a model's tokenizer failed");
                    failures.push(format!("{}: {e}", slot.name));
                }
            }
        }
        if failures.is_empty() {
            return Err(AdminError::NoWorker);
        }
        Err(AdminError::Failed(format!(
            "the tokenizer of {name} could not be fetched: {}",
            failures.join("; ")
        )))
    }

    async fn tokenizer_from(
        &self,
        slot: &WorkerSlot,
        model: &str,
        sha256: &str,
    ) -> Result<Vec<u8>, String> {
        let mut client = self.admin_client(slot).await.map_err(|e| e.to_string())?;
        let req = proto::GetTokenizerRequest {
            model: model.to_string(),
        };
        let mut chunks = client
            .get_tokenizer(req)
            .await
            .map_err(|s| s.message().to_string())?
            .into_inner();
        let mut bytes = Vec::new();
        while let Some(chunk) = chunks
            .message()
            .await
            .map_err(|s| s.message().to_string())?
        {
            bytes.extend_from_slice(&chunk.data);
            if bytes.len() > MAX_TOKENIZER_BYTES {
                return Err(format!(
                    "the tokenizer is larger than {MAX_TOKENIZER_BYTES} bytes"
                ));
            }
        }
        let got = hearth_shared::tokenizer::sha256_hex(&bytes);
        if got != sha256 {
            return Err(format!(
                "the tokenizer sent has SHA-256 {got}, not the {sha256} reported"
            ));
        }
        Ok(bytes)
    }
}
