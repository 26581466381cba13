//! Loading models, each onto an engine of its own: the start-up model (`--model`, or the
//! repository's), more of a repository's models (`--load` at start-up, `LoadModel` while
//! serving), and the memory check that admits them (see [`super::models`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hearth_shared::proto::RETRY_AFTER_KEY;
use hearth_shared::tokenizer::Tokenizer;
use tonic::Status;

use super::config::{RunOn, ValidConfig};
use super::models::{ModelPhase, ModelSlot, Need, NoVictim, Residency};
use super::state::{Loaded, TokenizerFile, WorkerState};
use super::ServeError;
use crate::device;
use crate::engine::constraint::{Grammars, Vocabulary};
use crate::engine::mask_threads;
use crate::engine::{Engine, EngineConfig, Weights};
use crate::generic::GenericModel;
use crate::model::{load_gguf, load_safetensors, ModelError};
use crate::repository::{ModelVersion, Repository};

/// Where a model comes from.
#[derive(Debug, Clone)]
pub struct Source {
    /// A GGUF file, or a safetensors checkpoint directory.
    pub path: PathBuf,
    /// The repository version it is, when it came from one.
    pub entry: Option<ModelVersion>,
    pub tokenizer: Option<PathBuf>,
    /// The start-up model: the only one with the K/V disk tier (its directory is one per
    /// worker).
    pub first: bool,
}

/// Loads models for one worker.
#[derive(Debug)]
pub struct Loader {
    pub config: ValidConfig,
    pub device: device::Device,
    pub state: Arc<WorkerState>,
}

impl Loader {
    /// The start-up model.
    pub fn startup_source(&self) -> Source {
        Source {
            path: self.config.model.clone(),
            entry: self.config.entry.clone(),
            tokenizer: self.config.tokenizer.clone(),
            first: true,
        }
    }

    /// The repository's model `spec` (`name` or `name@version`).
    pub fn repository_source(&self, spec: &str) -> Result<Source, Status> {
        let Some(root) = &self.config.repository else {
            return Err(Status::failed_precondition(
                "this worker has no model repository (--repository) to load models from",
            ));
        };
        let repo = Repository::open(root).map_err(|e| Status::internal(e.to_string()))?;
        let entry = repo
            .resolve(spec)
            .map_err(|e| Status::not_found(format!("model: {e}")))?;
        Ok(Source {
            path: entry.weights.clone(),
            tokenizer: entry.tokenizer.clone(),
            entry: Some(entry),
            first: false,
        })
    }

    /// Every version of every model in the repository, as `name@version` (none without one, or
    /// when it cannot be read).
    pub fn available(&self) -> Vec<String> {
        let Some(root) = &self.config.repository else {
            return Vec::new();
        };
        let Ok(repo) = Repository::open(root) else {
            return Vec::new();
        };
        let names = repo.models().unwrap_or_default();
        names
            .iter()
            .flat_map(|n| {
                let versions = repo.versions(n).unwrap_or_default();
                versions.into_iter().map(move |v| format!("{n}@{v}"))
            })
            .collect()
    }

    /// What `source` will take of the worker's memory: the weights file's size, and the K/V
    /// rule of [`super::models`].
    fn need(&self, source: &Source) -> Result<Need, Status> {
        let weights = file_bytes(&source.path)
            .map_err(|e| Status::not_found(format!("{}: {e}", source.path.display())))?;
        let kv = if self.device.is_gpu() && !self.config.kv_budget_given {
            let free = self.device.free_bytes().unwrap_or(0);
            (free.saturating_sub(weights) as f64 * self.config.gpu_memory_fraction) as u64
        } else {
            self.config.engine.kv_budget_bytes as u64
        };
        Ok(Need { weights, kv })
    }

    /// Loads `source` onto an engine of its own, if it fits (with `evict`, once the least
    /// recently used idle models are unloaded to make room), and answers once it is ready (or
    /// its load failed). A model already held answers as soon as its own load ends.
    pub async fn load(&self, source: Source, evict: bool) -> Result<Arc<ModelSlot>, Status> {
        let describe = source.clone();
        let loaded = tokio::task::spawn_blocking(move || describe_model(&describe))
            .await
            .map_err(|e| Status::internal(format!("loading stopped: {e}")))?
            .map_err(|e| Status::failed_precondition(e.to_string()))?;
        let (loaded, tokenizer) = loaded;
        let need = self.need(&source)?;
        let models = &self.state.models;
        let (slot, new) = loop {
            let free = self.device.free_bytes().unwrap_or(0);
            match models.reserve(loaded.clone(), need, free) {
                Ok(r) => break r,
                Err(s) if evict && s.code() == tonic::Code::ResourceExhausted => {
                    let victim = match models.least_recently_used() {
                        Ok(v) => v,
                        Err(NoVictim::None) => return Err(s),
                        Err(NoVictim::Recent(left)) => {
                            return Err(too_recent(&s, &models.residency, left))
                        }
                    };
                    tracing::info!(model = %victim.key(), idle_s = victim.idle_for().as_secs_f64(), "evicting the least recently used model for room");
                    models.unload(&victim, Duration::ZERO).await;
                }
                Err(s) => return Err(s),
            }
        };
        if !new {
            return wait_loaded(slot).await;
        }
        tracing::info!(model = %slot.key(), weights_bytes = need.weights, kv_bytes = need.kv, "loading model");
        let (config, device) = (self.config.clone(), self.device.clone());
        let started = std::time::Instant::now();
        let made = tokio::task::spawn_blocking(move || {
            start_engine(&config, &device, &source, tokenizer.as_ref())
        })
        .await
        .map_err(|e| ServeError::Engine(crate::engine::EngineError::Internal(e.to_string())))
        .and_then(|r| r);
        match made {
            Ok((engine, weights_bytes)) => {
                tracing::info!(model = %slot.key(), load_s = started.elapsed().as_secs_f64(), kv_capacity_tokens = engine.handle().model_info().kv_capacity_tokens, "model ready");
                self.state.models.set_ready(&slot, engine, weights_bytes);
                Ok(slot)
            }
            Err(e) => {
                let msg = format!("loading {} failed: {e}", slot.key());
                tracing::error!(model = %slot.key(), error = %e, "model load failed");
                self.state.models.set_failed(&slot, msg.clone());
                Err(Status::failed_precondition(msg))
            }
        }
    }
}

/// A load refused for room that an eviction would make, but only later: every model that could
/// make it served a request within `--min-resident-secs`. The status carries when to retry, in
/// [`RETRY_AFTER_KEY`] (whole seconds), as well as in its message.
fn too_recent(no_room: &Status, residency: &Residency, left: Duration) -> Status {
    let retry = left.as_secs() + 1;
    let mut s = Status::resource_exhausted(format!(
        "{}; every model that could make room served a request within the last {} s \
         (--min-resident-secs) or is pinned: retry in {retry} s",
        no_room.message(),
        residency.min_resident.as_secs()
    ));
    if let Ok(v) = retry.to_string().parse() {
        s.metadata_mut().insert(RETRY_AFTER_KEY, v);
    }
    s
}

/// Waits for another caller's load of `slot` to end.
async fn wait_loaded(slot: Arc<ModelSlot>) -> Result<Arc<ModelSlot>, Status> {
    while slot.phase() == ModelPhase::Loading {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    match slot.phase() {
        ModelPhase::Ready => Ok(slot),
        _ => Err(Status::failed_precondition(slot.status().error)),
    }
}

/// The bytes of a model file, or of a checkpoint directory's files.
fn file_bytes(path: &Path) -> std::io::Result<u64> {
    if !path.is_dir() {
        return Ok(std::fs::metadata(path)?.len());
    }
    let mut total = 0;
    for e in std::fs::read_dir(path)? {
        let m = e?.metadata()?;
        if m.is_file() {
            total += m.len();
        }
    }
    Ok(total)
}

/// What clients are told of `source` (its name, version, manifest and the tokenizer's special
/// tokens), and its tokenizer; runs on a blocking thread.
fn describe_model(source: &Source) -> Result<(Loaded, Option<Tokenizer>), ServeError> {
    let mut loaded = match &source.entry {
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
            model_id: model_id(&source.path),
            ..Loaded::default()
        },
    };
    let tokenizer = match &source.tokenizer {
        Some(t) => {
            let (tok, bytes) = Tokenizer::from_file_with_bytes(t)?;
            loaded.tokenizer = Some(TokenizerFile {
                sha256: hearth_shared::tokenizer::sha256_hex(&bytes),
                bytes: bytes.into(),
            });
            Some(tok)
        }
        None => None,
    };
    if let Some(tok) = &tokenizer {
        loaded.start_of_turn_id = Some(tok.start_of_turn_id);
        loaded.pad_id = tok.pad_id;
    }
    Ok((loaded, tokenizer))
}

/// Loads `source`'s weights onto `device` with the forward pass `--forward` picks, checks them
/// against its manifest and tokenizer, and starts its engine; runs on a blocking thread.
/// Returns the engine and the bytes the weights take.
fn start_engine(
    config: &ValidConfig,
    device: &device::Device,
    source: &Source,
    tokenizer: Option<&Tokenizer>,
) -> Result<(Engine, u64), ServeError> {
    let model = load_weights(&source.path, &config.run_on, device)?;
    if let Some(e) = &source.entry {
        check_manifest(e, model.config().vocab_size)?;
    }
    if let Some(tok) = tokenizer {
        check_tokenizer(tok, &model)?;
    }
    let mut engine = engine_config(config, device, source, &model)?;
    engine.grammars = grammars(source, &model);
    let weights_bytes = model.weights_bytes() as u64;
    Ok((Engine::start(model, engine)?, weights_bytes))
}

/// `source`'s engine configuration once its weights are on the device: the worker's, with
/// its manifest's context, the disk tier for the start-up model only, and on a GPU without
/// `--kv-budget` a K/V pool of `--gpu-memory-fraction` of the memory the weights left free.
fn engine_config(
    config: &ValidConfig,
    device: &device::Device,
    source: &Source,
    weights: &Weights,
) -> Result<EngineConfig, device::DeviceError> {
    let mut engine = config.engine.clone();
    if !source.first {
        engine.kv_disk = None;
    }
    engine.max_context = source
        .entry
        .as_ref()
        .and_then(|e| e.manifest.context_length)
        .map(|n| n as usize);
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

/// The grammar engine over the model's vocabulary: a GGUF file's own, or for a checkpoint
/// directory its `--tokenizer`. Without one, requests with a grammar are refused (and the log
/// says why once, here).
fn grammars(source: &Source, model: &Weights) -> Option<Arc<Grammars>> {
    let vocab = if source.path.is_dir() {
        match &source.tokenizer {
            Some(t) => Vocabulary::from_tokenizer_json(t),
            None => Err("a checkpoint directory needs --tokenizer for its vocabulary".into()),
        }
    } else {
        Vocabulary::from_gguf(&source.path)
    };
    let made = vocab.and_then(|v| Grammars::for_model(v, model, mask_threads()));
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

pub(super) fn model_id(path: &Path) -> String {
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
