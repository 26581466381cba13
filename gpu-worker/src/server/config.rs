//! The worker service's configuration: flags with `HEARTH_…` environment fallbacks, validated once
//! at start-up into a [`ValidConfig`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::models::Residency;
use crate::device::DeviceSpec;
use crate::engine::{DiskConfig, EngineConfig};
use crate::kv::KvDtype;
use crate::repository::ModelVersion;
use hearth_shared::worker_auth::WorkerToken;

/// Default model and tokenizer file names inside the models directory (what
/// `scripts/fetch-model.sh` writes).
pub const DEFAULT_MODEL: &str = "gemma-3-270m-q4_k_m.gguf";
pub const DEFAULT_TOKENIZER: &str = "gemma-3-tokenizer.json";

/// `hearth-worker serve` options. Worker-specific variables are prefixed `HEARTH_WORKER_` so an
/// orchestrator's own settings, inherited by a worker it starts, never leak into the worker.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeConfig {
    /// GGUF model file [default: <models dir>/gemma-3-270m-q4_k_m.gguf], or an http(s) URL,
    /// fetched into `<models dir>/fetched/` before loading (resumed if cut; see
    /// `--model-sha256`).
    #[arg(long, env = "HEARTH_MODEL")]
    pub model: Option<PathBuf>,
    /// The sha256 (64 hex digits) a `--model` URL's file must have; a download that does not
    /// match is removed and the worker does not start.
    #[arg(long, env = "HEARTH_MODEL_SHA256")]
    pub model_sha256: Option<String>,
    /// A model repository (`<name>/<version>/` directories): `--model` then names a model in it,
    /// `name` (its newest version) or `name@version` [default: its one model].
    #[arg(long, env = "HEARTH_MODEL_REPOSITORY")]
    pub repository: Option<PathBuf>,
    /// The repository version `--model` named, once resolved.
    #[arg(skip)]
    pub entry: Option<ModelVersion>,
    /// A `--model` URL, fetched into the models cache once the worker listens (`--model` is
    /// then the file it will be).
    #[arg(skip)]
    pub fetch: Option<FetchPlan>,
    /// More of the repository's models to load at start-up beside `--model` (`name` or
    /// `name@version`; repeat the flag, or separate them with commas). Each runs on an engine
    /// of its own with a K/V pool of `--kv-budget`.
    #[arg(
        long = "load",
        env = "HEARTH_WORKER_LOAD",
        value_delimiter = ',',
        requires = "repository"
    )]
    pub load: Vec<String>,
    /// Memory all the worker's models may take together, weights and K/V pools (bytes, or with
    /// a unit: `8GiB`): a load that would go past it is refused, naming the bytes needed and
    /// free [default: none; a load must fit in the device's free memory].
    #[arg(long, env = "HEARTH_WORKER_MEMORY_BUDGET", value_parser = parse_bytes)]
    pub memory_budget: Option<u64>,
    /// Seconds a repository model stays loaded with no request streaming on it, after which it
    /// is unloaded (and loaded again on demand); a request's `keep_alive` overrides it for its
    /// model. Negative: for good. A model given by path is never unloaded this way.
    #[arg(long, env = "HEARTH_WORKER_KEEP_ALIVE_SECS", default_value_t = -1, allow_hyphen_values = true)]
    pub keep_alive_secs: i64,
    /// Repository models an eviction for room never takes (they go only by their keep-alive or
    /// an admin's unload): names (every version) or `name@version`, comma-separated.
    #[arg(long, env = "HEARTH_WORKER_PIN", value_delimiter = ',')]
    pub pin: Vec<String>,
    /// An eviction for room never takes a model that served a request within this many
    /// seconds: a load that only such a model could make room for is refused, saying when to
    /// retry. So requests for models in turn cannot make a worker swap them without end.
    #[arg(long, env = "HEARTH_WORKER_MIN_RESIDENT_SECS", default_value_t = 30)]
    pub min_resident_secs: u64,
    /// Optional tokenizer.json: checked against the model's vocabulary at start-up, and its
    /// special tokens reported by `Info`.
    #[arg(long, env = "HEARTH_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// Where `scripts/fetch-model.sh` puts models [default: ~/.cache/hearth/models].
    #[arg(long, env = "HEARTH_MODELS_DIR")]
    pub models_dir: Option<PathBuf>,
    /// gRPC listen address (port 0 picks a free port; the bound address is printed on stdout).
    #[arg(long, env = "HEARTH_WORKER_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// HTTP address for `/metrics`, `/healthz` and `/readyz`.
    #[arg(
        long,
        env = "HEARTH_WORKER_METRICS_LISTEN",
        default_value = "127.0.0.1:9091"
    )]
    pub metrics_listen: SocketAddr,
    /// Shared secret every gRPC call must carry (`authorization: Bearer …`); the orchestrator
    /// sends it from its own `--worker-token`. Required to listen on a non-loopback address.
    #[arg(long, env = "HEARTH_WORKER_TOKEN", hide_env_values = true)]
    pub worker_token: Option<String>,
    /// Serve gRPC over TLS with this certificate (PEM; with --tls-key); orchestrators check it
    /// against their `--worker-ca`.
    #[arg(long, env = "HEARTH_WORKER_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "HEARTH_WORKER_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    #[command(flatten)]
    pub run_on: RunOn,
    /// KV cache budget: bytes, or with a unit (`512MiB`, `2GiB`, `1.5GB`) [default: 2GiB on the
    /// CPU; on a GPU, --gpu-memory-fraction of the memory left free once the weights are loaded].
    #[arg(long, env = "HEARTH_WORKER_KV_BUDGET", value_parser = parse_bytes)]
    pub kv_budget: Option<u64>,
    /// On a GPU without --kv-budget: the share of the device memory still free after loading
    /// the weights that K/V memory takes (the rest is left for activations and other processes).
    #[arg(long, env = "HEARTH_WORKER_GPU_MEMORY_FRACTION", default_value_t = 0.8)]
    pub gpu_memory_fraction: f64,
    /// Element type of stored K/V: `f16` (default), `int8` (an f16 scale per 32 keys or 64 values;
    /// about half the bytes of f16) or `f32`.
    #[arg(long, env = "HEARTH_WORKER_KV_DTYPE", value_enum, default_value_t = KvDtype::F16)]
    pub kv_dtype: KvDtype,
    /// Disk tier for idle sessions evicted from memory, in GB (10^9 bytes); 0 turns it off.
    #[arg(long, env = "HEARTH_WORKER_KV_DISK_GB", default_value_t = 0.0)]
    pub kv_disk_gb: f64,
    /// Directory of the disk tier's file (recreated at start-up).
    #[arg(
        long,
        env = "HEARTH_WORKER_KV_DISK_DIR",
        default_value = "data/kv-tier"
    )]
    pub kv_disk_dir: PathBuf,
    /// Positions past the sliding window whose sliding-layer K/V stay in memory, so regenerating
    /// a reply up to this long resumes from the session's cache; older positions keep only the
    /// global layers (for Gemma 3, a sixth of the memory). `off` keeps every layer.
    #[arg(long, env = "HEARTH_WORKER_KV_WINDOW_MARGIN", default_value = "512", value_parser = parse_margin)]
    pub kv_window_margin: WindowMargin,
    /// Most sequences decoded in one engine step.
    #[arg(long, env = "HEARTH_WORKER_MAX_BATCH", default_value_t = 64)]
    pub max_batch: usize,
    /// Most requests waiting for admission; beyond it requests get RESOURCE_EXHAUSTED.
    #[arg(long, env = "HEARTH_WORKER_MAX_WAITING", default_value_t = 1024)]
    pub max_waiting: usize,
    /// Prompt tokens prefilled per engine step across all sequences.
    #[arg(long, env = "HEARTH_WORKER_PREFILL_CHUNK", default_value_t = 512)]
    pub prefill_chunk: usize,
    /// While sequences decode, a step prefills the prompt work that adds at most this many times
    /// a decode-only step's measured time: a step with a prefill then takes about (1 + this)
    /// times a decode-only step, so replies keep streaming while a long prompt arrives, at the
    /// cost of that prompt's time to first token. 0 prefills up to --prefill-chunk in every step.
    #[arg(long, env = "HEARTH_WORKER_PREFILL_SHARE", default_value_t = 1.0)]
    pub prefill_share: f64,
    /// Speculative decoding by prompt lookup: most draft tokens (runs of the prompt or reply
    /// that repeat) verified beside a sequence's next token in one step; 0 turns it off. The
    /// output is the same either way (seeded sampling included).
    #[arg(long, env = "HEARTH_WORKER_SPEC_TOKENS", default_value_t = 4)]
    pub spec_tokens: usize,
    /// Drafts are tried only in steps with at most this many decoding sequences and no prompt
    /// being prefilled (where a step is bound by reading the weights, not by arithmetic).
    #[arg(long, env = "HEARTH_WORKER_SPEC_MAX_BATCH", default_value_t = 2)]
    pub spec_max_batch: usize,
    /// Seconds a SIGTERM waits for in-flight sequences before cancelling them.
    #[arg(long, env = "HEARTH_WORKER_DRAIN_TIMEOUT_SECS", default_value_t = 30)]
    pub drain_timeout_secs: u64,
    /// Load tests only: load no model and give every request one token per this many
    /// milliseconds (echoing its prompt tokens), to measure what the layers above add.
    #[arg(long, env = "HEARTH_WORKER_SCRIPTED_TOKEN_MS")]
    pub scripted_token_ms: Option<u64>,
    /// Tests of stall handling only, with `--scripted-token-ms`: the engine thread stops for
    /// good after this many tokens in all, as a hung engine would.
    #[arg(long, env = "HEARTH_WORKER_SCRIPTED_FREEZE_AFTER_TOKENS")]
    pub scripted_freeze_after_tokens: Option<u64>,
    /// An engine that has work but has not finished a step for this long is stuck: health
    /// reports it not ready (`engine_stalled`), so its replies fail over.
    #[arg(long, env = "HEARTH_WORKER_ENGINE_STALL_SECS", default_value_t = 120)]
    pub engine_stall_secs: u64,
}

/// Where the model runs and which forward pass runs it (`serve` and `bench` both take these).
#[derive(clap::Args, Debug, Clone)]
pub struct RunOn {
    /// `auto`, `cpu` or `cuda:N` (one worker per GPU: run one with `cuda:1` for the second).
    #[arg(long, env = "HEARTH_WORKER_DEVICE", default_value = "auto")]
    pub device: DeviceSpec,
    /// Which forward pass runs the model: `kernels` (Hearth's CPU kernels), `candle` (the
    /// device-generic pass on candle tensors, which CUDA devices use; on the CPU it is for
    /// checking the two against each other) or `auto` (kernels on the CPU, candle on a GPU).
    #[arg(long, env = "HEARTH_WORKER_FORWARD", value_enum, default_value_t = ForwardPass::Auto)]
    pub forward: ForwardPass,
    /// The candle forward pass only: steps of at least this many tokens (prefill, large
    /// batches) multiply through dequantized f16 copies of the weight matrices (cuBLAS on CUDA)
    /// instead of the quantized kernels. The copies take 2 bytes per weight beside the stored
    /// blocks. Off unless given.
    #[arg(long, env = "HEARTH_WORKER_DENSE_GEMM_TOKENS")]
    pub dense_gemm_tokens: Option<usize>,
    /// On a CUDA device: replay greedy decode steps from CUDA graphs captured per batch shape
    /// (`false` issues every kernel of every step; for comparing the two).
    #[arg(long, env = "HEARTH_WORKER_CUDA_GRAPHS", default_value_t = true, action = clap::ArgAction::Set)]
    pub cuda_graphs: bool,
    /// Which CPU kernels run the model: `auto` (the best this CPU has), `amx`, `vnni`, `avx2` or
    /// `scalar`, for comparing them. One this CPU cannot run is refused.
    #[arg(long, env = "HEARTH_WORKER_KERNELS", value_enum, default_value_t = crate::kernels::KernelChoice::Auto)]
    pub kernels: crate::kernels::KernelChoice,
}

impl RunOn {
    /// Refuses combinations that cannot run, naming the flag.
    pub fn check(&self, kv_dtype: KvDtype) -> Result<(), ConfigError> {
        let cuda = matches!(self.device, DeviceSpec::Cuda(_));
        if self.forward == ForwardPass::Kernels && cuda {
            return Err(invalid(
                "--forward",
                "`kernels` runs on the CPU only; a CUDA device takes `candle` (or `auto`)",
            ));
        }
        crate::kernels::pick(self.kernels, crate::kernels::detect_isa())
            .map_err(|e| invalid("--kernels", e))?;
        let candle = self.forward == ForwardPass::Candle || cuda;
        if candle && kv_dtype == KvDtype::Int8 {
            return Err(invalid(
                "--kv-dtype",
                "int8 K/V is a format of the CPU kernels; the candle forward pass (and so a \
                 CUDA device) stores f16 or f32",
            ));
        }
        match self.dense_gemm_tokens {
            Some(0) => Err(invalid("--dense-gemm-tokens", "must be at least 1 token")),
            Some(_) if self.forward == ForwardPass::Kernels => Err(invalid(
                "--dense-gemm-tokens",
                "applies to the candle forward pass; `kernels` choose their own GEMM",
            )),
            _ => Ok(()),
        }
    }

    /// Sets the CPU kernels (`--kernels`, checked by [`RunOn::check`]) and opens the device.
    pub fn select_device(&self) -> Result<crate::device::Device, crate::device::DeviceError> {
        if let Err(e) = crate::kernels::use_kernels(self.kernels) {
            tracing::warn!(error = %e, "--kernels not applied");
        }
        crate::device::select(self.device)
    }

    /// Whether the candle forward pass runs on `device` (a GPU, or `--forward candle`).
    pub fn candle_on(&self, device: &crate::device::Device) -> bool {
        match self.forward {
            ForwardPass::Auto => device.is_gpu(),
            ForwardPass::Kernels => false,
            ForwardPass::Candle => true,
        }
    }

    /// What the candle pass loads with these flags on `device`.
    pub fn generic_options(&self, device: &crate::device::Device) -> crate::generic::LoadOptions {
        crate::generic::LoadOptions {
            dense_gemm_tokens: self.dense_gemm_tokens,
            step_graphs: self.cuda_graphs && device.is_gpu(),
        }
    }
}

/// `--forward`: which forward pass runs the model.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForwardPass {
    Auto,
    Kernels,
    Candle,
}

/// A certificate and its private key (PEM); `Debug` shows neither, so logging a
/// configuration never prints the key.
#[derive(Clone)]
pub struct TlsIdentity {
    pub cert: Vec<u8>,
    pub key: Vec<u8>,
}

impl std::fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsIdentity(…)")
    }
}

/// A model file to fetch before loading it: from where, and into which cache directory.
#[derive(Debug, Clone)]
pub struct FetchPlan {
    pub source: crate::fetch::Source,
    pub cache: PathBuf,
}

/// Default K/V budget on the CPU.
pub const DEFAULT_CPU_KV_BUDGET: usize = 2 << 30;

/// A configuration that passed [`ServeConfig::validate`].
#[derive(Debug, Clone)]
pub struct ValidConfig {
    pub model: PathBuf,
    /// The repository version the model is, when it came from one.
    pub entry: Option<ModelVersion>,
    /// The model repository, when there is one: `LoadModel` loads from it.
    pub repository: Option<PathBuf>,
    /// `--model`'s URL, fetched (into `model`) before it loads.
    pub fetch: Option<FetchPlan>,
    /// Its models to load at start-up beside the first (`--load`).
    pub load: Vec<String>,
    /// `--memory-budget`.
    pub memory_budget: Option<u64>,
    /// `--keep-alive-secs`, in milliseconds (negative: for good).
    pub keep_alive_ms: i64,
    /// `--pin` and `--min-resident-secs`.
    pub residency: Residency,
    pub tokenizer: Option<PathBuf>,
    pub listen: SocketAddr,
    pub metrics_listen: SocketAddr,
    /// Every gRPC call must carry it, when set.
    pub token: Option<WorkerToken>,
    /// The certificate and key gRPC is served with over TLS, when set.
    pub tls: Option<TlsIdentity>,
    pub run_on: RunOn,
    /// `--kv-budget` when given; otherwise the engine's budget is set once the device is known
    /// (see [`ValidConfig::gpu_memory_fraction`]).
    pub kv_budget_given: bool,
    pub gpu_memory_fraction: f64,
    pub engine: EngineConfig,
    pub drain_timeout: Duration,
    /// Scripted mode (load tests): the token interval; no model is loaded.
    pub scripted: Option<Duration>,
    /// Scripted mode: tokens after which the engine thread stops (stall tests).
    pub scripted_freeze_after: Option<u64>,
    /// How long an engine with work may go without finishing a step before it counts as stuck.
    pub engine_stall: Duration,
}

/// One line for the log: what a person checks at start-up (the whole configuration is logged at
/// debug level).
impl std::fmt::Display for ValidConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let e = &self.engine;
        let model = self.model.file_name().map_or_else(
            || self.model.display().to_string(),
            |n| n.to_string_lossy().into(),
        );
        write!(
            f,
            "model {model} on {}, gRPC {} ({}), metrics {}, K/V {} ",
            self.run_on.device,
            self.listen,
            match (self.token.is_some(), self.tls.is_some()) {
                (true, true) => "TLS, token required",
                (true, false) => "token required",
                (false, true) => "TLS, no token",
                (false, false) => "no token",
            },
            self.metrics_listen,
            e.kv_dtype.name()
        )?;
        if self.kv_budget_given {
            write!(f, "{} MiB", e.kv_budget_bytes >> 20)?;
        } else {
            write!(
                f,
                "{}% of free GPU memory ({} MiB on a CPU)",
                self.gpu_memory_fraction * 100.0,
                e.kv_budget_bytes >> 20
            )?;
        }
        write!(
            f,
            ", batch {}, queue {}, speculation {} tokens",
            e.max_batch, e.max_waiting, e.spec_tokens
        )?;
        match self.scripted {
            Some(interval) => write!(f, ", scripted ({} ms a token)", interval.as_millis()),
            None => Ok(()),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("{flag}: {reason}")]
    Invalid { flag: &'static str, reason: String },
    #[error(
        "--model: {path} does not exist (run `make fetch-model`, or pass --model / HEARTH_MODEL)"
    )]
    MissingModel { path: String },
    #[error("--tokenizer: {path} does not exist")]
    MissingTokenizer { path: String },
}

fn invalid(flag: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        flag,
        reason: reason.into(),
    }
}

impl ServeConfig {
    pub fn validate(self) -> Result<ValidConfig, ConfigError> {
        let models_dir = self.models_dir.clone().unwrap_or_else(default_models_dir);
        let model = self
            .model
            .clone()
            .unwrap_or_else(|| models_dir.join(DEFAULT_MODEL));
        if let Some(0) = self.scripted_token_ms {
            return Err(invalid("--scripted-token-ms", "must be at least 1"));
        }
        if self.scripted_freeze_after_tokens.is_some() && self.scripted_token_ms.is_none() {
            return Err(invalid(
                "--scripted-freeze-after-tokens",
                "only with --scripted-token-ms",
            ));
        }
        if !model.exists() && self.scripted_token_ms.is_none() && self.fetch.is_none() {
            return Err(ConfigError::MissingModel {
                path: model.display().to_string(),
            });
        }
        if let Some(t) = &self.tokenizer {
            if !t.is_file() {
                return Err(ConfigError::MissingTokenizer {
                    path: t.display().to_string(),
                });
            }
        }
        if !(1..=4096).contains(&self.max_batch) {
            return Err(invalid("--max-batch", "must be between 1 and 4096"));
        }
        if self.max_waiting == 0 {
            return Err(invalid("--max-waiting", "must be at least 1"));
        }
        if self.prefill_chunk == 0 {
            return Err(invalid("--prefill-chunk", "must be at least 1"));
        }
        if !(self.prefill_share.is_finite() && (0.0..=1000.0).contains(&self.prefill_share)) {
            return Err(invalid(
                "--prefill-share",
                format!("{} is not a number between 0 and 1000", self.prefill_share),
            ));
        }
        if self.spec_tokens > 64 {
            return Err(invalid(
                "--spec-tokens",
                format!("{} is more than 64 draft tokens", self.spec_tokens),
            ));
        }
        if self.kv_budget == Some(0) {
            return Err(invalid("--kv-budget", "must be more than 0 bytes"));
        }
        if self.memory_budget == Some(0) {
            return Err(invalid("--memory-budget", "must be more than 0 bytes"));
        }
        if !(self.gpu_memory_fraction > 0.0 && self.gpu_memory_fraction <= 1.0) {
            return Err(invalid(
                "--gpu-memory-fraction",
                format!(
                    "{} is not a share above 0 and at most 1",
                    self.gpu_memory_fraction
                ),
            ));
        }
        self.run_on.check(self.kv_dtype)?;
        if self.listen == self.metrics_listen && self.listen.port() != 0 {
            return Err(invalid(
                "--metrics-listen",
                format!("{} is also the gRPC address", self.listen),
            ));
        }
        if !(self.kv_disk_gb.is_finite() && (0.0..=1e6).contains(&self.kv_disk_gb)) {
            return Err(invalid(
                "--kv-disk-gb",
                format!("{} is not a size between 0 and 1000000", self.kv_disk_gb),
            ));
        }
        let token = self.token()?;
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => {
                let read = |flag: &'static str, p: &PathBuf| {
                    std::fs::read(p).map_err(|e| invalid(flag, format!("{}: {e}", p.display())))
                };
                Some(TlsIdentity {
                    cert: read("--tls-cert", cert)?,
                    key: read("--tls-key", key)?,
                })
            }
            _ => None,
        };
        let kv_disk = (self.kv_disk_gb > 0.0).then(|| DiskConfig {
            dir: self.kv_disk_dir.clone(),
            bytes: (self.kv_disk_gb * 1e9) as u64,
        });
        let engine = EngineConfig {
            kv_disk,
            kv_budget_bytes: match self.kv_budget {
                Some(b) => usize::try_from(b)
                    .map_err(|_| invalid("--kv-budget", "larger than this machine can address"))?,
                None => DEFAULT_CPU_KV_BUDGET,
            },
            max_batch: self.max_batch,
            max_waiting: self.max_waiting,
            prefill_chunk: self.prefill_chunk,
            prefill_share: self.prefill_share,
            spec_tokens: self.spec_tokens,
            spec_max_batch: self.spec_max_batch,
            kv_dtype: self.kv_dtype,
            kv_window_margin: self.kv_window_margin.0,
            // Room for every waiting request plus the cancels and drops that accompany them.
            command_queue: self.max_waiting * 2 + 64,
            on_step: Some(crate::telemetry::record_step),
            max_context: self
                .entry
                .as_ref()
                .and_then(|e| e.manifest.context_length)
                .map(|n| n as usize),
            ..EngineConfig::default()
        };
        Ok(ValidConfig {
            model,
            entry: self.entry,
            repository: self.repository,
            fetch: self.fetch,
            load: self.load,
            memory_budget: self.memory_budget,
            // Negative is for good, whatever its value: -1, as a request says it.
            keep_alive_ms: match self.keep_alive_secs {
                s if s < 0 => -1,
                s => s.saturating_mul(1000),
            },
            residency: Residency {
                pinned: self
                    .pin
                    .iter()
                    .map(|p| p.trim().to_string())
                    .filter(|p| !p.is_empty())
                    .collect(),
                min_resident: Duration::from_secs(self.min_resident_secs),
            },
            tokenizer: self.tokenizer,
            listen: self.listen,
            metrics_listen: self.metrics_listen,
            token,
            tls,
            run_on: self.run_on,
            kv_budget_given: self.kv_budget.is_some(),
            gpu_memory_fraction: self.gpu_memory_fraction,
            engine,
            drain_timeout: Duration::from_secs(self.drain_timeout_secs),
            scripted: self.scripted_token_ms.map(Duration::from_millis),
            scripted_freeze_after: self.scripted_freeze_after_tokens,
            engine_stall: Duration::from_secs(self.engine_stall_secs.max(1)),
        })
    }
}

impl ServeConfig {
    /// The token, well formed; refuses a non-loopback gRPC address without one, where any peer
    /// on the network could generate, drop sessions' caches and read every prompt and reply.
    fn token(&self) -> Result<Option<WorkerToken>, ConfigError> {
        let token = self
            .worker_token
            .as_deref()
            .map(WorkerToken::new)
            .transpose()
            .map_err(|why| invalid("--worker-token", why))?;
        if token.is_none() && !self.listen.ip().is_loopback() {
            return Err(invalid(
                "--listen",
                format!(
                    "refusing to serve gRPC on {} without --worker-token (HEARTH_WORKER_TOKEN): \
                     any peer on the network could generate and read every prompt; set a token \
                     (the orchestrator's --worker-token) or listen on 127.0.0.1",
                    self.listen
                ),
            ));
        }
        Ok(token)
    }
}

/// `$HOME/.cache/hearth/models`, where the fetch script puts models by default.
pub fn default_models_dir() -> PathBuf {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default()
        .join(".cache/hearth/models")
}

/// Parses `123`, `512MiB`, `2GiB`, `1.5GB`, `64k` (binary units for `Ki`/`Mi`/`Gi`, decimal for
/// `K`/`M`/`G`; case-insensitive, optional trailing `B`).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size (examples: 1073741824, 512MiB, 2GiB)"))?;
    let unit = unit.trim().to_ascii_lowercase();
    let unit = unit.strip_suffix('b').unwrap_or(&unit);
    let scale: f64 = match unit {
        "" => 1.0,
        "k" => 1e3,
        "m" => 1e6,
        "g" => 1e9,
        "t" => 1e12,
        "ki" => 1024.0,
        "mi" => 1024.0 * 1024.0,
        "gi" => 1024.0 * 1024.0 * 1024.0,
        "ti" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => {
            return Err(format!(
                "`{s}`: unknown unit (use B, KiB, MiB, GiB, KB, MB, GB)"
            ))
        }
    };
    let bytes = value * scale;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("`{s}` is too large"));
    }
    Ok(bytes as u64)
}

/// `--kv-window-margin`: a token count, or `off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowMargin(pub Option<usize>);

fn parse_margin(s: &str) -> Result<WindowMargin, String> {
    match s.trim() {
        "off" => Ok(WindowMargin(None)),
        n => n
            .parse()
            .map(|n| WindowMargin(Some(n)))
            .map_err(|_| format!("`{s}` is not a token count or `off`")),
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
