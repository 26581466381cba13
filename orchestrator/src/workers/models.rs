//! Which models the workers serve, and which one a request means.
//!
//! Each worker reports its model in `Info`: an id and, for a model from a repository, a
//! version. A request names a model as `name` (the newest version any worker serves, ready ones
//! first) or `name@version` (that version only); a request that names none gets the default
//! model, the one the first listed worker serves. Once a request has its model, every worker it
//! goes to (its first, and any it fails over to) serves exactly that version, so a reply that
//! continues elsewhere stays token-exact.

use std::fmt;

use hearth_shared::proto;
use hearth_shared::versions::compare_versions;

use super::pool::WorkerPool;

/// One version of one model, as workers report it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ModelKey {
    pub id: String,
    /// Empty for a model given to its worker by path.
    pub version: String,
}

/// One model as one worker reports it in `Info`.
#[derive(Debug, Clone)]
pub(super) struct Reported {
    pub(super) key: ModelKey,
    pub(super) display_name: String,
    pub(super) context_length: u32,
    pub(super) default_params_json: String,
    pub(super) state: proto::ModelState,
    pub(super) max_batch: u32,
    pub(super) max_waiting: u32,
    /// While its file is fetched: bytes on disk, and the whole file's (0: not known yet).
    pub(super) fetch: Option<(u64, u64)>,
    /// Its own tokenizer's SHA-256 (empty: the orchestrator's default tokenizer).
    pub(super) tokenizer_sha256: String,
}

/// The models a worker reports: its `models` list, or for a worker that sends none (an older
/// one) the one model its other fields describe, ready.
pub(super) fn reported(info: &proto::InfoResponse) -> Vec<Reported> {
    if info.models.is_empty() {
        if info.model_id.is_empty() {
            return Vec::new();
        }
        return vec![Reported {
            key: ModelKey {
                id: info.model_id.clone(),
                version: info.model_version.clone(),
            },
            display_name: info.display_name.clone(),
            context_length: info.context_length,
            default_params_json: info.default_params_json.clone(),
            state: proto::ModelState::Ready,
            max_batch: info.max_batch,
            max_waiting: info.max_waiting,
            fetch: None,
            tokenizer_sha256: String::new(),
        }];
    }
    info.models
        .iter()
        .map(|m| Reported {
            key: ModelKey {
                id: m.model_id.clone(),
                version: m.model_version.clone(),
            },
            display_name: m.display_name.clone(),
            context_length: m.context_length,
            default_params_json: m.default_params_json.clone(),
            state: proto::ModelState::try_from(m.state).unwrap_or(proto::ModelState::Unspecified),
            max_batch: m.max_batch,
            max_waiting: m.max_waiting,
            fetch: (m.fetched_bytes > 0 || m.fetch_total_bytes > 0)
                .then_some((m.fetched_bytes, m.fetch_total_bytes)),
            tokenizer_sha256: m.tokenizer_sha256.clone(),
        })
        .collect()
}

impl ModelKey {
    /// A repository version as a worker lists it (`name@version`), read once when the worker's
    /// `Info` arrives: everything after reads its parts. None when it has no `@`.
    pub fn from_repository(entry: &str) -> Option<Self> {
        let (id, version) = entry.rsplit_once('@')?;
        Some(Self {
            id: id.to_string(),
            version: version.to_string(),
        })
    }

    /// Whether `asked` names this model: its id (which may hold an `@`, as a file's name can),
    /// or `id@version`.
    pub fn named_by(&self, asked: &str) -> bool {
        asked == self.id || (!self.version.is_empty() && asked == self.to_string())
    }
}

impl fmt::Display for ModelKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.version.as_str() {
            "" => f.write_str(&self.id),
            v => write!(f, "{}@{v}", self.id),
        }
    }
}

/// A model as the pool's workers report it.
#[derive(Debug, Clone)]
pub struct ServedModel {
    pub key: ModelKey,
    /// The manifest's display name, else the id.
    pub display_name: String,
    /// The smallest context among the workers serving it, ready ones if any.
    pub context_length: Option<usize>,
    /// The manifest's default sampling parameters, as JSON (empty: none).
    pub default_params_json: String,
    /// Workers ready to serve it now.
    pub ready_workers: usize,
    /// Workers loading it.
    pub loading_workers: usize,
    /// Workers that reported it, in any state.
    pub workers: usize,
    /// While a worker fetches its file: bytes fetched, and the file's size (0: not known yet).
    pub fetch: Option<(u64, u64)>,
    /// The SHA-256 of its own tokenizer, as its workers report it; empty when it has none of
    /// its own (the orchestrator's `--tokenizer` serves it).
    pub tokenizer_sha256: String,
}

/// A model no worker serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownModel {
    pub asked: String,
    /// What is served, or can be loaded from a worker's repository, as `name` or
    /// `name@version`.
    pub served: Vec<String>,
    /// The repository version `asked` names (`name@version`), when a worker can load it.
    pub loadable: Option<String>,
}

impl WorkerPool {
    /// Every model some worker has reported, by id and then newest version first.
    pub fn models(&self) -> Vec<ServedModel> {
        let mut out: Vec<ServedModel> = Vec::new();
        for slot in self.slots().iter() {
            let up = slot.conn().is_some();
            let models = slot.state().models.clone();
            for r in models {
                add_report(&mut out, r, up);
            }
        }
        out.sort_by(|a, b| {
            a.key
                .id
                .cmp(&b.key.id)
                .then_with(|| compare_versions(&b.key.version, &a.key.version))
        });
        out
    }

    /// The model `asked` names, or the default model when it names none. `Ok(None)` while no
    /// worker has reported a model: the request waits for any worker, as at start-up.
    pub fn resolve(&self, asked: Option<&str>) -> Result<Option<ServedModel>, UnknownModel> {
        let models = self.models();
        if models.is_empty() && self.available().is_empty() {
            return Ok(None);
        }
        let newest = |id: &str| {
            // Ready versions first, then the newest: `models` lists each id newest first.
            let of_id = || models.iter().filter(|m| m.key.id == id);
            of_id()
                .find(|m| m.ready_workers > 0)
                .or_else(|| of_id().next())
                .cloned()
        };
        let Some(asked) = asked else {
            let first = self
                .slots()
                .iter()
                .find_map(|s| s.state().info.as_ref().map(|i| i.model_id.clone()))
                .filter(|id| !id.is_empty());
            let any = models.first().map(|m| m.key.id.clone());
            return Ok(first.or(any).as_deref().and_then(newest));
        };
        if let Some(m) = newest(asked) {
            return Ok(Some(m));
        }
        if let Some(m) = models.iter().find(|m| m.key.named_by(asked)) {
            return Ok(Some(m.clone()));
        }
        let available = self.available();
        let mut served: Vec<String> = models.iter().map(|m| m.key.to_string()).collect();
        for a in available.iter().map(ModelKey::to_string) {
            if !served.contains(&a) {
                served.push(a);
            }
        }
        Err(UnknownModel {
            asked: asked.to_string(),
            served,
            loadable: loadable(&available, asked),
        })
    }

    /// Every version some ready worker's repository holds.
    pub fn available(&self) -> Vec<ModelKey> {
        let mut out: Vec<ModelKey> = Vec::new();
        for slot in self.slots().iter().filter(|s| s.conn().is_some()) {
            for a in &slot.state().available {
                if !out.contains(a) {
                    out.push(a.clone());
                }
            }
        }
        out
    }
}

/// The repository version `asked` names among `available` (`name@version`): itself, or for a
/// name the newest version of it.
fn loadable(available: &[ModelKey], asked: &str) -> Option<String> {
    if let Some(k) = available.iter().find(|k| k.to_string() == asked) {
        return Some(k.to_string());
    }
    available
        .iter()
        .filter(|k| k.id == asked)
        .max_by(|x, y| compare_versions(&x.version, &y.version))
        .map(ModelKey::to_string)
}

/// Counts one worker's report of a model (`up`: the worker is ready) into `out`.
fn add_report(out: &mut Vec<ServedModel>, r: Reported, up: bool) {
    let ready = up && r.state == proto::ModelState::Ready;
    let ctx = Some(r.context_length as usize).filter(|&n| n > 0);
    let i = match out.iter().position(|m| m.key == r.key) {
        Some(i) => i,
        None => {
            out.push(ServedModel {
                display_name: match r.display_name.as_str() {
                    "" => r.key.id.clone(),
                    d => d.to_string(),
                },
                key: r.key,
                context_length: None,
                default_params_json: r.default_params_json,
                ready_workers: 0,
                loading_workers: 0,
                workers: 0,
                fetch: None,
                tokenizer_sha256: String::new(),
            });
            out.len() - 1
        }
    };
    let m = &mut out[i];
    m.workers += 1;
    if m.tokenizer_sha256.is_empty() {
        m.tokenizer_sha256 = r.tokenizer_sha256;
    }
    if r.state == proto::ModelState::Loading {
        m.loading_workers += 1;
        m.fetch = r.fetch.or(m.fetch);
    }
    // Ready workers' contexts bound what fits; until one is ready, any reported one.
    if ready {
        if m.ready_workers == 0 {
            m.context_length = None;
        }
        m.ready_workers += 1;
    }
    if ready || m.ready_workers == 0 {
        m.context_length = match (m.context_length, ctx) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repository_name_means_its_newest_version() {
        let available: Vec<ModelKey> = ["a@1", "a@10", "a@9", "b@x"]
            .iter()
            .filter_map(|s| ModelKey::from_repository(s))
            .collect();
        assert_eq!(loadable(&available, "a").as_deref(), Some("a@10"));
        assert_eq!(loadable(&available, "a@9").as_deref(), Some("a@9"));
        assert_eq!(loadable(&available, "b").as_deref(), Some("b@x"));
        assert_eq!(loadable(&available, "a@2"), None);
        assert_eq!(loadable(&available, "c"), None);
    }

    #[test]
    fn a_model_is_named_by_its_id_or_its_id_and_version() {
        let k = ModelKey {
            id: "tiny".into(),
            version: "2".into(),
        };
        assert!(k.named_by("tiny"));
        assert!(k.named_by("tiny@2"));
        assert!(!k.named_by("tiny@1"));
        assert!(!k.named_by("tin"));
        let file = ModelKey {
            id: "model@home".into(),
            version: String::new(),
        };
        assert!(file.named_by("model@home"));
        assert_eq!(file.to_string(), "model@home");
        assert_eq!(k.to_string(), "tiny@2");
    }
}
