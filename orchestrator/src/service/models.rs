//! The model a request is for ([`Target`]), and what a request that leaves a sampling field
//! out gets for it from that model ([`ModelDefaults`]): resolved against what the workers
//! serve, loaded on demand (charged to the caller, after every other check), with the
//! `keep_alive` the caller may ask for.

use std::time::Duration;

use hearth_shared::SamplingParams;

use super::prompt::check_max_tokens;
use super::tokenizers::ModelTokenizer;
use super::{Caller, ChatError, ChatService, LoadRefusal};
use crate::generate::KeepAlive;
use crate::ids::SessionId;
use crate::workers::{AdminError, Eviction, ModelKey, ServedModel, UnknownModel};

/// The model a request is for, resolved against what the workers serve (see
/// [`crate::workers::WorkerPool::resolve`]).
#[derive(Debug, Clone, Default)]
pub struct Target {
    /// None while no worker has reported its model: any worker serves the request.
    pub model: Option<ServedModel>,
    /// The model's own tokenizer, once found; none: the orchestrator's default one.
    pub tokenizer: Option<ModelTokenizer>,
}

impl Target {
    /// The exact version every worker of the request must serve.
    pub fn key(&self) -> Option<&ModelKey> {
        self.model.as_ref().map(|m| &m.key)
    }

    /// The model's name as replies report it: its id (`id@version` is what pins it).
    pub fn name(&self) -> String {
        self.model
            .as_ref()
            .map_or_else(|| "hearth".to_string(), |m| m.key.id.clone())
    }

    /// The model's context in tokens, once a worker serving it has reported it.
    pub fn context_length(&self) -> Option<usize> {
        self.model.as_ref().and_then(|m| m.context_length)
    }

    /// Its manifest's default sampling parameters.
    pub fn defaults(&self) -> ModelDefaults {
        self.model
            .as_ref()
            .map(|m| ModelDefaults::from_json(&m.default_params_json))
            .unwrap_or_default()
    }
}

impl From<UnknownModel> for ChatError {
    fn from(u: UnknownModel) -> Self {
        let served = u
            .served
            .iter()
            .map(|m| format!("`{m}`"))
            .collect::<Vec<_>>()
            .join(", ");
        ChatError::ModelNotFound {
            asked: u.asked,
            served,
        }
    }
}

/// What a request that leaves a sampling field out gets for it: the served model's defaults
/// (its manifest's `params`), else the built-in ones.
#[derive(Debug, Clone, Default)]
pub struct ModelDefaults {
    /// The manifest's fields, as it gives them.
    fields: serde_json::Map<String, serde_json::Value>,
    params: SamplingParams,
    /// The manifest's temperature, when it sets one.
    temperature: Option<f32>,
}

impl ModelDefaults {
    /// From a worker's `default_params_json` (empty, or not a valid object: the built-in
    /// defaults; the worker checked it already).
    pub fn from_json(json: &str) -> Self {
        let Ok(serde_json::Value::Object(fields)) = serde_json::from_str(json) else {
            return Self::default();
        };
        let temperature = fields
            .get("temperature")
            .and_then(serde_json::Value::as_f64)
            .map(|t| t as f32);
        match serde_json::from_value(serde_json::Value::Object(fields.clone())) {
            Ok(params) => Self {
                fields,
                params,
                temperature,
            },
            Err(_) => Self::default(),
        }
    }

    /// A native turn's parameters in a session whose stored `params` (the fields its client
    /// gave) lie over these defaults, field by field.
    pub fn with_session(&self, stored: Option<&serde_json::Value>) -> SamplingParams {
        let Some(serde_json::Value::Object(session)) = stored else {
            return self.params.clone();
        };
        let mut fields = self.fields.clone();
        fields.extend(session.iter().map(|(k, v)| (k.clone(), v.clone())));
        serde_json::from_value(serde_json::Value::Object(fields)).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "a session's stored params do not parse; built-in defaults used");
            SamplingParams::default()
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The temperature of an OpenAI request that sets none: the model's, else OpenAI's 1.
    pub fn openai_temperature(&self) -> f32 {
        self.temperature.unwrap_or(1.0)
    }
}

/// A model a request names: one a worker serves (or none yet: no worker has reported its
/// model), or one some worker's repository holds, which must be loaded first.
enum Resolved {
    Served(Target),
    Loadable { spec: String, asked: String },
}

/// How long a request waits for its model's load on demand before it is answered 503.
const ON_DEMAND_LOAD_TIMEOUT: Duration = Duration::from_secs(300);

impl ChatService {
    /// The model `asked` names (`name`: its newest version; `name@version`), else the default
    /// model, for `caller`'s request; 404 `model_not_found` for one no worker serves. Until a
    /// worker has reported its model, nothing is refused here: the request waits for a worker
    /// as any other. A model no worker has ready yet, only loading, is a 503 with
    /// `Retry-After`. A model no worker holds but some worker's repository has is loaded
    /// first, on demand, and charged to the caller (see [`Self::load_on_demand`]): call this
    /// only once the request has passed every other check, and been charged.
    pub async fn target(&self, caller: &Caller, asked: Option<&str>) -> Result<Target, ChatError> {
        self.target_for(Some(caller), asked).await
    }

    /// [`Self::target`] for `caller`, or (None) for this replica itself: a reply it takes over,
    /// charged when it started.
    pub(super) async fn target_for(
        &self,
        caller: Option<&Caller>,
        asked: Option<&str>,
    ) -> Result<Target, ChatError> {
        let target = match self.resolve(asked)? {
            Resolved::Served(t) => t,
            Resolved::Loadable { spec, asked } => {
                self.load_on_demand(caller, &spec, &asked).await?
            }
        };
        self.with_tokenizer(target).await
    }

    /// [`Self::target`] without a load: None for a model that must be loaded first (the
    /// request that needs it loads it). So naming a model, as a session does, costs no load.
    pub async fn loaded_target(&self, asked: Option<&str>) -> Result<Option<Target>, ChatError> {
        match self.resolve(asked)? {
            Resolved::Served(t) => Ok(Some(self.with_tokenizer(t).await?)),
            Resolved::Loadable { .. } => Ok(None),
        }
    }

    /// The model `asked` names, served or to be loaded on demand.
    fn resolve(&self, asked: Option<&str>) -> Result<Resolved, ChatError> {
        let model = match self.generator.pool.resolve(asked) {
            Ok(model) => model,
            Err(u) => {
                return match (u.loadable.clone(), asked) {
                    (Some(spec), Some(asked)) => Ok(Resolved::Loadable {
                        spec,
                        asked: asked.to_string(),
                    }),
                    _ => Err(u.into()),
                }
            }
        };
        if let Some(m) = &model {
            if m.ready_workers == 0 && m.loading_workers > 0 {
                return Err(ChatError::ModelLoading(m.key.to_string()));
            }
        }
        Ok(Resolved::Served(Target {
            model,
            tokenizer: None,
        }))
    }

    /// `target` with its model's tokenizer.
    async fn with_tokenizer(&self, mut target: Target) -> Result<Target, ChatError> {
        if let Some(m) = &target.model {
            let pool = &self.generator.pool;
            target.tokenizer = Some(self.tokenizers.for_model(pool, m).await?);
        }
        Ok(target)
    }

    /// Loads the repository version `spec` (which `asked` names) on the worker with the most
    /// room, which first unloads its least recently used idle models if it must (never a
    /// pinned one, nor one used within its `--min-resident-secs`), and waits for it. Requests
    /// for a model being loaded here wait for that one load; the one that starts it is charged
    /// for it first ([`Self::charge_load`]). A refusal says the same to every caller, and
    /// more to an admin key.
    async fn load_on_demand(
        &self,
        caller: Option<&Caller>,
        spec: &str,
        asked: &str,
    ) -> Result<Target, ChatError> {
        let gate = {
            let mut loads = self.loads.lock().unwrap_or_else(|p| p.into_inner());
            loads.entry(spec.to_string()).or_default().clone()
        };
        let _one_load = gate.lock().await;
        let pool = &self.generator.pool;
        // Another request may have loaded it while this one waited.
        if let Ok(Some(model)) = pool.resolve(Some(asked)) {
            if model.ready_workers > 0 {
                return Ok(Target {
                    model: Some(model),
                    tokenizer: None,
                });
            }
        }
        if let Some(c) = caller {
            self.charge_load(c).await?;
        }
        let user = caller.map(|c| c.user.id.to_string());
        tracing::info!(
            model = spec,
            user = user.as_deref(),
            "loading a model on demand"
        );
        metrics::counter!(crate::telemetry::MODEL_LOADS).increment(1);
        let load = pool.load_model(spec, None, Eviction::IdleModels);
        match tokio::time::timeout(ON_DEMAND_LOAD_TIMEOUT, load).await {
            Ok(Ok(_)) => Ok(Target {
                model: pool.resolve(Some(asked))?,
                tokenizer: None,
            }),
            Ok(Err(e)) => Err(self.load_failed(caller, (spec, asked), e)),
            Err(_) => Err(ChatError::ModelLoading(spec.to_string())),
        }
    }

    /// What the caller of a load on demand of `spec` (which `asked` names) is told when the
    /// load failed with `e`: the same to every caller, the workers' words only to an admin key.
    fn load_failed(
        &self,
        caller: Option<&Caller>,
        (spec, asked): (&str, &str),
        e: AdminError,
    ) -> ChatError {
        let refused = |why, retry_after_secs, detail: String| {
            tracing::warn!(model = spec, %detail, "a load on demand did not happen");
            ChatError::LoadRefused {
                model: spec.to_string(),
                why,
                retry_after_secs,
                detail: caller.is_some_and(|c| c.role.is_admin()).then_some(detail),
            }
        };
        match e {
            AdminError::NotFound(_) => self.generator.pool.resolve(Some(asked)).err().map_or_else(
                || ChatError::Unavailable(format!("the model {spec} could not be loaded")),
                ChatError::from,
            ),
            AdminError::NoRoom {
                detail,
                retry_after_secs,
            } => refused(LoadRefusal::NoRoom, retry_after_secs, detail),
            e => refused(LoadRefusal::Failed, None, e.to_string()),
        }
    }

    /// The repository version (`name@version`) that [`Self::target`] would load on demand
    /// for `asked` before a request could start; none when a worker holds it already (or
    /// nothing can load it, which `target` refuses).
    pub fn needs_load(&self, asked: Option<&str>) -> Option<String> {
        asked?;
        self.generator.pool.resolve(asked).err()?.loadable
    }

    /// [`Self::needs_load`] for a turn in the caller's session `id` (none when the session
    /// cannot be read: the turn itself says why).
    pub async fn session_needs_load(&self, caller: &Caller, id: &SessionId) -> Option<String> {
        // Without a repository nothing loads on demand: no read of the session for it.
        if self.generator.pool.available().is_empty() {
            return None;
        }
        let session = self.store.get_session(&caller.user.id, id).await.ok()?;
        self.needs_load(session.model.as_deref())
    }

    /// The model `asked` names, as [`Self::target`] finds it, in any state.
    pub fn lookup(&self, asked: Option<&str>) -> Result<Target, ChatError> {
        Ok(Target {
            model: self.generator.pool.resolve(asked)?,
            tokenizer: None,
        })
    }

    /// Every model some worker serves, as `/v1/models` lists them.
    pub fn models(&self) -> Vec<crate::workers::ServedModel> {
        self.generator.pool.models()
    }

    /// Every version the workers' repositories hold, loaded or not.
    pub fn available(&self) -> Vec<crate::workers::ModelKey> {
        self.generator.pool.available()
    }

    // --- Administration (admin callers only; the API checks) ---

    /// Every worker and the models it holds.
    pub fn worker_models(&self) -> Vec<crate::workers::WorkerModels> {
        self.generator.pool.worker_models()
    }

    /// Loads `model` on `worker`, else where it fits (see [`crate::workers::WorkerPool::load_model`]).
    pub async fn load_model(
        &self,
        model: &str,
        worker: Option<&str>,
    ) -> Result<(String, crate::workers::WorkerModel), crate::workers::AdminError> {
        self.generator
            .pool
            .load_model(model, worker, Eviction::Never)
            .await
    }

    /// Unloads `model` from the workers that hold it (or from `worker`).
    pub async fn unload_model(
        &self,
        model: &str,
        worker: Option<&str>,
        deadline: Option<Duration>,
    ) -> Result<Vec<(String, u32)>, crate::workers::AdminError> {
        self.generator
            .pool
            .unload_model(model, worker, deadline)
            .await
    }

    /// The text of token ids for `target`'s model (a legacy completion's echoed prompt);
    /// nothing for ids its tokenizer cannot read.
    pub fn decode(&self, target: &Target, ids: &[u32]) -> String {
        self.tokenizer(target).tok.decode(ids).unwrap_or_default()
    }

    /// `target`'s tokenizer: its model's own, else the default one.
    pub(super) fn tokenizer(&self, target: &Target) -> ModelTokenizer {
        target
            .tokenizer
            .clone()
            .unwrap_or_else(|| self.tokenizers.default_tokenizer().clone())
    }

    /// The model `asked` names, loaded on demand for `caller` (see [`Self::target`]), and a
    /// reply length checked against its context now that it is known.
    pub(super) async fn load_for(
        &self,
        caller: &Caller,
        asked: Option<&str>,
        max_tokens: Option<u32>,
    ) -> Result<Target, ChatError> {
        let target = self.target(caller, asked).await?;
        if let Some(n) = max_tokens {
            check_max_tokens(n, &target)?;
        }
        Ok(target)
    }

    /// The `keep_alive` (ms; negative: for good) a request asked for, as the caller may have
    /// it. The model is every tenant's: an admin key's request may set any stay (0 unloads the
    /// model once idle), any other may only lengthen it, up to `--max-keep-alive-secs` (for
    /// good means that long).
    pub(super) fn keep_alive(&self, caller: &Caller, asked: Option<i64>) -> Option<KeepAlive> {
        let ms = asked?;
        if caller.role.is_admin() {
            return Some(KeepAlive {
                ms,
                may_shorten: true,
            });
        }
        let cap = self.limits.max_keep_alive_ms;
        Some(KeepAlive {
            ms: if ms < 0 { cap } else { ms.min(cap) },
            may_shorten: false,
        })
    }

    /// Charges a load on demand to the caller: one request of its rate limit, and one of its
    /// key's loads per hour (`--max-loads-per-hour`). A load takes a worker's memory and
    /// time from every tenant: an admin key's is not counted.
    async fn charge_load(&self, caller: &Caller) -> Result<(), ChatError> {
        if caller.role.is_admin() {
            return Ok(());
        }
        let per_hour = self.limits.max_loads_per_hour;
        Ok(self.limiter.admit_load(&caller.quota, per_hour).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::ModelDefaults;

    #[test]
    fn a_session_s_fields_lie_over_the_model_s_defaults() {
        let d = ModelDefaults::from_json(r#"{"temperature": 0.5, "top_k": 5}"#);
        let p = d.with_session(Some(&serde_json::json!({"top_k": 9})));
        assert_eq!((p.temperature, p.top_k), (0.5, 9));
        let p = d.with_session(None);
        assert_eq!((p.temperature, p.top_k), (0.5, 5));
        assert_eq!(d.openai_temperature(), 0.5);
        let none = ModelDefaults::from_json("");
        assert_eq!(
            none.with_session(None),
            hearth_shared::SamplingParams::default()
        );
        assert_eq!(none.openai_temperature(), 1.0);
    }
}
