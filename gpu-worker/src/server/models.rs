//! The models one worker holds: each with its own engine (its own thread, K/V pool and session
//! cache), its state (loading → ready → unloading, or failed), the memory it takes, and the
//! requests streaming on it.
//!
//! # Memory
//! A model takes its weights (the file's size while it loads, then what the loaded weights
//! report) and its K/V pool. The K/V rule: every model gets a pool of `--kv-budget` bytes (on a
//! GPU without `--kv-budget`, `--gpu-memory-fraction` of the device memory free once its
//! weights are loaded), so a model's capacity does not depend on what else is loaded. A load is
//! admitted when weights + pool fit in what the worker's `--memory-budget` leaves (without a
//! budget: in the device's free memory); otherwise it is refused with `RESOURCE_EXHAUSTED`
//! naming the bytes needed and free.
//!
//! # Unloading
//! A model being unloaded refuses new requests at once. Its running requests may finish until
//! the deadline; then the engine cancels the rest, and their streams end with an `UNAVAILABLE`
//! error instead of `Finished(CANCELLED)`, so the orchestrator continues them on another worker
//! serving the model. The engine is shut down once nothing streams on it, which frees its
//! memory.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use hearth_shared::proto;
use tonic::Status;

use super::state::{Loaded, Streaming};
use crate::engine::{Engine, EngineHandle, EngineStats};

/// Where one model is in its life on this worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ModelPhase {
    Loading = 1,
    Ready = 2,
    Unloading = 3,
    Failed = 4,
}

impl ModelPhase {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::Loading,
            2 => Self::Ready,
            3 => Self::Unloading,
            _ => Self::Failed,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Loading => "loading",
            Self::Ready => "ready",
            Self::Unloading => "being unloaded",
            Self::Failed => "failed",
        }
    }
}

/// Whether keep-alive `ms` keeps a model longer than `now` does (negative: for good).
fn longer_stay(ms: i64, now: i64) -> bool {
    now >= 0 && (ms < 0 || ms > now)
}

/// One model on this worker.
#[derive(Debug)]
pub struct ModelSlot {
    pub loaded: Loaded,
    phase: AtomicU8,
    /// The engine's owner, taken when the model is unloaded (or the worker stops).
    engine: Mutex<Option<Engine>>,
    handle: std::sync::OnceLock<EngineHandle>,
    weights_bytes: AtomicU64,
    pub kv_bytes: u64,
    in_flight: Streaming,
    last_used: Mutex<Instant>,
    error: Mutex<String>,
    /// Its unload's deadline passed and the engine cancelled what was left: those requests end
    /// as `UNAVAILABLE`.
    cut: AtomicBool,
    /// How long it stays loaded once idle, in milliseconds; negative: for good.
    keep_alive_ms: AtomicI64,
}

impl ModelSlot {
    /// `name@version`, or the name of a model given by path.
    pub fn key(&self) -> String {
        self.loaded.key()
    }

    /// Whether `asked` names this model: its key, or its name.
    pub fn named_by(&self, asked: &str) -> bool {
        asked == self.loaded.model_id || asked == self.key()
    }

    pub fn phase(&self) -> ModelPhase {
        ModelPhase::from_u8(self.phase.load(Ordering::SeqCst))
    }

    /// The engine of a model that has one (ready, or unloading).
    pub fn handle(&self) -> Option<&EngineHandle> {
        self.handle.get()
    }

    /// The engine, if the model takes new requests; else the status that refuses them.
    pub fn accepting(&self) -> Result<&EngineHandle, Status> {
        match (self.phase(), self.handle.get()) {
            (ModelPhase::Ready, Some(h)) => Ok(h),
            (phase, _) => Err(Status::unavailable(format!(
                "the model {} is {} on this worker",
                self.key(),
                phase.name()
            ))),
        }
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.count()
    }

    /// Counts a request as streaming on this model until the guard drops.
    pub fn track(self: &Arc<Self>) -> ModelGuard {
        self.in_flight.enter();
        *self.last_used.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        ModelGuard(self.clone())
    }

    /// Whether its unload cut its running requests short (see the module docs).
    pub fn was_cut(&self) -> bool {
        self.cut.load(Ordering::SeqCst)
    }

    /// Whether it came from the repository, so that it can be loaded again after an eviction
    /// or an idle unload (a model given by path at start-up is never unloaded that way).
    pub fn reloadable(&self) -> bool {
        !self.loaded.version.is_empty()
    }

    /// Sets how long it stays loaded once idle (a request's `keep_alive_ms`; negative: for
    /// good). Unless `may_shorten` (an operator's request), only a longer stay is taken.
    pub fn set_keep_alive(&self, ms: i64, may_shorten: bool) {
        let _ = self
            .keep_alive_ms
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| {
                (may_shorten || longer_stay(ms, now)).then_some(ms)
            });
    }

    /// Whether it has been idle longer than its keep-alive, and may be unloaded for it.
    pub fn expired(&self) -> bool {
        let keep = self.keep_alive_ms.load(Ordering::SeqCst);
        self.reloadable()
            && self.phase() == ModelPhase::Ready
            && self.in_flight() == 0
            && keep >= 0
            && self.idle_for() >= Duration::from_millis(keep as u64)
    }

    pub fn bytes(&self) -> u64 {
        self.weights_bytes.load(Ordering::SeqCst) + self.kv_bytes
    }

    pub fn idle_for(&self) -> Duration {
        self.last_used
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed()
    }

    /// As `Info.models` reports it.
    pub fn status(&self) -> proto::ModelStatus {
        let state = match self.phase() {
            ModelPhase::Loading => proto::ModelState::Loading,
            ModelPhase::Ready => proto::ModelState::Ready,
            ModelPhase::Unloading => proto::ModelState::Unloading,
            ModelPhase::Failed => proto::ModelState::Failed,
        };
        let mut s = proto::ModelStatus {
            model_id: self.loaded.model_id.clone(),
            model_version: self.loaded.version.clone(),
            display_name: self.loaded.display_name.clone(),
            state: state as i32,
            weights_bytes: self.weights_bytes.load(Ordering::SeqCst),
            kv_bytes: self.kv_bytes,
            default_params_json: self.loaded.default_params_json.clone(),
            in_flight: self.in_flight() as u32,
            error: self.error.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            idle_s: self.idle_for().as_secs_f64(),
            keep_alive_ms: self.keep_alive_ms.load(Ordering::SeqCst),
            tokenizer_sha256: self
                .loaded
                .tokenizer
                .as_ref()
                .map(|t| t.sha256.clone())
                .unwrap_or_default(),
            ..Default::default()
        };
        if let Some(h) = self.handle.get() {
            let m = h.model_info();
            s.context_length = m.context_length as u32;
            s.vocab_size = m.vocab_size as u32;
            s.max_batch = m.max_batch as u32;
            s.max_waiting = m.max_waiting as u32;
        }
        s
    }

    /// Resolves once none of its requests is streaming.
    async fn all_idle(&self) {
        self.in_flight.all_idle().await;
    }
}

/// A request streaming on a model; see [`ModelSlot::track`].
#[derive(Debug)]
pub struct ModelGuard(Arc<ModelSlot>);

impl ModelGuard {
    pub fn slot(&self) -> &Arc<ModelSlot> {
        &self.0
    }
}

impl Drop for ModelGuard {
    fn drop(&mut self) {
        *self.0.last_used.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        self.0.in_flight.leave();
    }
}

/// The bytes a model needs, for the admission check.
#[derive(Debug, Clone, Copy)]
pub struct Need {
    pub weights: u64,
    pub kv: u64,
}

/// Which models an eviction for room leaves alone, whatever their age: an operator's pinned
/// models, and any that served a request within `min_resident`. So no tenant, asking for
/// models in turn, can make a worker swap the models every other tenant uses.
#[derive(Debug, Clone, Default)]
pub struct Residency {
    /// `--pin`: a model's name (every version of it) or `name@version`.
    pub pinned: Vec<String>,
    /// `--min-resident-secs`.
    pub min_resident: Duration,
}

impl Residency {
    fn pinned(&self, slot: &ModelSlot) -> bool {
        self.pinned.iter().any(|p| slot.named_by(p))
    }

    /// Of `idle` models (ready, reloadable, nothing streaming), the one an eviction takes: the
    /// least recently used that is not pinned, once `min_resident` has passed since its use.
    fn victim(
        &self,
        idle: impl Iterator<Item = Arc<ModelSlot>>,
    ) -> Result<Arc<ModelSlot>, NoVictim> {
        let oldest = idle
            .filter(|s| !self.pinned(s))
            .max_by_key(|s| s.idle_for())
            .ok_or(NoVictim::None)?;
        match self.min_resident.checked_sub(oldest.idle_for()) {
            Some(left) if !left.is_zero() => Err(NoVictim::Recent(left)),
            _ => Ok(oldest),
        }
    }
}

/// Why no model can be evicted for room now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoVictim {
    /// Every model is busy, pinned or not from the repository: none will be, by waiting.
    None,
    /// The oldest idle model served a request too recently: it may be evicted after this long.
    Recent(Duration),
}

/// Every model of the worker, the default (the first loaded) first.
#[derive(Debug, Default)]
pub struct Models {
    slots: RwLock<Vec<Arc<ModelSlot>>>,
    /// What eviction leaves alone.
    pub residency: Residency,
    /// A new model's keep-alive (`--keep-alive`), in milliseconds; negative: for good.
    pub keep_alive_ms: i64,
    /// Bumped on every change of a model's state; `Health.models_epoch`.
    epoch: AtomicU64,
    /// `--memory-budget`: weights and K/V of all models together.
    pub budget: Option<u64>,
    /// Counters of unloaded models' engines, so the worker's totals never go down.
    retired: Mutex<EngineStats>,
}

impl Models {
    pub fn new(budget: Option<u64>, keep_alive_ms: i64, residency: Residency) -> Self {
        Self {
            budget,
            keep_alive_ms,
            residency,
            ..Self::default()
        }
    }

    /// The model to evict for room: a reloadable, ready one with nothing streaming, neither
    /// pinned nor used within [`Residency::min_resident`], the least recently used.
    pub fn least_recently_used(&self) -> Result<Arc<ModelSlot>, NoVictim> {
        let idle = self
            .slots()
            .into_iter()
            .filter(|s| s.reloadable() && s.phase() == ModelPhase::Ready && s.in_flight() == 0);
        self.residency.victim(idle)
    }

    /// Models idle past their keep-alive.
    pub fn expired(&self) -> Vec<Arc<ModelSlot>> {
        self.slots().into_iter().filter(|s| s.expired()).collect()
    }

    fn slots(&self) -> Vec<Arc<ModelSlot>> {
        self.slots.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    fn changed(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
    }

    /// Every model, the default first.
    pub fn all(&self) -> Vec<Arc<ModelSlot>> {
        self.slots()
    }

    /// The model requests that name none get: the first that is ready (else the first).
    pub fn default_model(&self) -> Option<Arc<ModelSlot>> {
        let slots = self.slots();
        slots
            .iter()
            .find(|s| s.phase() == ModelPhase::Ready)
            .or(slots.first())
            .cloned()
    }

    /// The model `asked` names (empty: the default). A name alone names the newest-loaded
    /// ready version of it, else any version of it.
    pub fn find(&self, asked: &str) -> Option<Arc<ModelSlot>> {
        if asked.is_empty() {
            return self.default_model();
        }
        let slots = self.slots();
        let named: Vec<&Arc<ModelSlot>> = slots.iter().filter(|s| s.named_by(asked)).collect();
        named
            .iter()
            .rev()
            .find(|s| s.phase() == ModelPhase::Ready)
            .or(named.last())
            .map(|s| (*s).clone())
    }

    /// What the models take of the worker's memory (failed loads take nothing).
    pub fn used_bytes(&self) -> u64 {
        self.slots()
            .iter()
            .filter(|s| s.phase() != ModelPhase::Failed)
            .map(|s| s.bytes())
            .sum()
    }

    /// Takes a place for a model about to load, if it fits: in the budget when there is one,
    /// else in `device_free` bytes. A model already held (loading or ready) is returned as it
    /// is; a failed one is replaced.
    pub fn reserve(
        &self,
        loaded: Loaded,
        need: Need,
        device_free: u64,
    ) -> Result<(Arc<ModelSlot>, bool), Status> {
        let mut slots = self.slots.write().unwrap_or_else(|p| p.into_inner());
        let key = |l: &Loaded| (l.model_id.clone(), l.version.clone());
        if let Some(s) = slots.iter().find(|s| key(&s.loaded) == key(&loaded)) {
            match s.phase() {
                ModelPhase::Loading | ModelPhase::Ready => return Ok((s.clone(), false)),
                ModelPhase::Unloading => {
                    return Err(Status::unavailable(format!(
                        "the model {} is being unloaded; load it again once it is gone",
                        s.key()
                    )))
                }
                ModelPhase::Failed => slots.retain(|s| key(&s.loaded) != key(&loaded)),
            }
        }
        let held: Vec<&Arc<ModelSlot>> = slots
            .iter()
            .filter(|s| s.phase() != ModelPhase::Failed)
            .collect();
        let used: u64 = held.iter().map(|s| s.bytes()).sum();
        let wanted = need.weights + need.kv;
        let (free, of) = match self.budget {
            Some(b) => (
                b.saturating_sub(used),
                format!("of the worker's --memory-budget of {}", mib(b)),
            ),
            None => (device_free, "of device memory".to_string()),
        };
        if wanted > free {
            let name = loaded.key();
            return Err(Status::resource_exhausted(format!(
                "the model {name} needs {} ({} of weights and {} of K/V) and {} is free {of} \
                 ({} taken by {} model(s)); unload one, or raise the budget",
                mib(wanted),
                mib(need.weights),
                mib(need.kv),
                mib(free),
                mib(used),
                held.len(),
            )));
        }
        let slot = Arc::new(ModelSlot {
            loaded,
            phase: AtomicU8::new(ModelPhase::Loading as u8),
            engine: Mutex::new(None),
            handle: std::sync::OnceLock::new(),
            weights_bytes: AtomicU64::new(need.weights),
            kv_bytes: need.kv,
            in_flight: Streaming::default(),
            last_used: Mutex::new(Instant::now()),
            error: Mutex::new(String::new()),
            cut: AtomicBool::new(false),
            keep_alive_ms: AtomicI64::new(self.keep_alive_ms),
        });
        slots.push(slot.clone());
        drop(slots);
        self.changed();
        Ok((slot, true))
    }

    /// A reserved model's engine is running: it takes requests from now on.
    pub fn set_ready(&self, slot: &ModelSlot, engine: Engine, weights_bytes: u64) {
        let _ = slot.handle.set(engine.handle());
        *slot.engine.lock().unwrap_or_else(|p| p.into_inner()) = Some(engine);
        slot.weights_bytes.store(weights_bytes, Ordering::SeqCst);
        *slot.last_used.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        slot.phase.store(ModelPhase::Ready as u8, Ordering::SeqCst);
        self.changed();
        crate::telemetry::model_state(&slot.key(), ModelPhase::Ready as u8, slot.bytes());
    }

    /// A reserved model failed to load: it stays listed, with why, and takes no memory.
    pub fn set_failed(&self, slot: &ModelSlot, error: String) {
        *slot.error.lock().unwrap_or_else(|p| p.into_inner()) = error;
        slot.phase.store(ModelPhase::Failed as u8, Ordering::SeqCst);
        self.changed();
        crate::telemetry::model_state(&slot.key(), ModelPhase::Failed as u8, 0);
    }

    /// Unloads `slot` (see the module docs): refuses new requests, lets running ones go on
    /// until `deadline`, cancels the rest, shuts the engine down and forgets the model.
    /// Returns how many requests it cut short.
    pub async fn unload(&self, slot: &Arc<ModelSlot>, deadline: Duration) -> usize {
        slot.phase
            .store(ModelPhase::Unloading as u8, Ordering::SeqCst);
        self.changed();
        crate::telemetry::model_state(&slot.key(), ModelPhase::Unloading as u8, slot.bytes());
        let mut cut = 0;
        if tokio::time::timeout(deadline, slot.all_idle())
            .await
            .is_err()
        {
            cut = slot.in_flight();
            tracing::warn!(model = %slot.key(), cut, "unload deadline passed; ending what is left as unavailable");
            slot.cut.store(true, Ordering::SeqCst);
            if let Some(h) = slot.handle() {
                h.cancel_all();
            }
            let _ = tokio::time::timeout(Duration::from_secs(5), slot.all_idle()).await;
        }
        let engine = slot.engine.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(engine) = engine {
            let last = engine.handle().stats();
            add_counters(
                &mut self.retired.lock().unwrap_or_else(|p| p.into_inner()),
                &last,
            );
            let _ = tokio::task::spawn_blocking(move || engine.shutdown()).await;
        }
        self.slots
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|s| !Arc::ptr_eq(s, slot));
        self.changed();
        crate::telemetry::model_state(&slot.key(), 0, 0);
        tracing::info!(model = %slot.key(), cut, "model unloaded");
        cut
    }

    /// Every engine's counts together (unloaded engines' counters included), and the K/V
    /// bytes in use and in all.
    pub fn stats(&self) -> (EngineStats, crate::telemetry::KvBytes) {
        let mut total = self
            .retired
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let (mut used, mut all) = (0, 0);
        for slot in self.slots() {
            let Some(h) = slot.handle() else { continue };
            let s = h.stats();
            let block = h.model_info().kv_block_bytes;
            used += s.kv_blocks_used * block;
            all += s.kv_blocks_total * block;
            add_counters(&mut total, &s);
            total.running += s.running;
            total.waiting += s.waiting;
            total.kv_blocks_used += s.kv_blocks_used;
            total.kv_blocks_total += s.kv_blocks_total;
            total.kv_blocks_cached += s.kv_blocks_cached;
            total.cached_sessions += s.cached_sessions;
            total.disk_sessions += s.disk_sessions;
        }
        (total, crate::telemetry::KvBytes { used, total: all })
    }

    /// Takes every engine out, to shut them down as the worker stops.
    pub fn take_engines(&self) -> Vec<Engine> {
        self.slots()
            .iter()
            .filter_map(|s| s.engine.lock().unwrap_or_else(|p| p.into_inner()).take())
            .collect()
    }
}

/// Adds `b`'s cumulative counters to `a`'s.
fn add_counters(a: &mut EngineStats, b: &EngineStats) {
    a.disk_restores += b.disk_restores;
    a.session_evictions += b.session_evictions;
    a.preemptions += b.preemptions;
    a.steps += b.steps;
    a.prefix_cache_queries_tokens += b.prefix_cache_queries_tokens;
    a.prefix_cache_hits_tokens += b.prefix_cache_hits_tokens;
    a.spec_draft_tokens += b.spec_draft_tokens;
    a.spec_accepted_tokens += b.spec_accepted_tokens;
}

/// Bytes for people: MiB with one decimal.
pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loaded(id: &str, version: &str) -> Loaded {
        Loaded {
            model_id: id.into(),
            version: version.into(),
            ..Loaded::default()
        }
    }

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_load_that_does_not_fit_the_budget_is_refused_naming_the_bytes() {
        let m = Models::new(Some(100 * MIB), -1, Residency::default());
        let need = Need {
            weights: 30 * MIB,
            kv: 30 * MIB,
        };
        let (a, new) = m.reserve(loaded("a", "1"), need, u64::MAX).expect("fits");
        assert!(new);
        assert_eq!(m.used_bytes(), 60 * MIB);
        let (again, new) = m.reserve(loaded("a", "1"), need, u64::MAX).expect("held");
        assert!(
            !new && Arc::ptr_eq(&a, &again),
            "a model already held is returned"
        );
        let e = m
            .reserve(loaded("b", "1"), need, u64::MAX)
            .expect_err("60 MiB more does not fit in the 40 left");
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        for part in ["b@1", "60.0 MiB", "40.0 MiB is free", "100.0 MiB"] {
            assert!(e.message().contains(part), "{part}: {}", e.message());
        }
        // A failed load takes nothing, and the next load of it replaces it.
        m.set_failed(&a, "no".into());
        assert_eq!(m.used_bytes(), 0);
        let (again, new) = m.reserve(loaded("a", "1"), need, u64::MAX).expect("room");
        assert!(new && !Arc::ptr_eq(&a, &again));
        assert_eq!(m.all().len(), 1, "the failed entry is gone");
    }

    #[test]
    fn an_ordinary_keep_alive_only_lengthens_a_stay_and_an_operators_sets_it() {
        let m = Models::new(None, 60_000, Residency::default());
        let (s, _) = m
            .reserve(loaded("a", "1"), Need { weights: 1, kv: 1 }, u64::MAX)
            .expect("fits");
        let now = || s.status().keep_alive_ms;
        assert_eq!(now(), 60_000);
        for (ms, held) in [
            (0, 60_000),
            (30_000, 60_000),
            (90_000, 90_000),
            (-1, -1),
            (5, -1),
        ] {
            s.set_keep_alive(ms, false);
            assert_eq!(now(), held, "an ordinary {ms}");
        }
        s.set_keep_alive(0, true);
        assert_eq!(now(), 0, "an operator's 0");
    }

    #[test]
    fn eviction_takes_the_oldest_model_neither_pinned_nor_used_too_recently() {
        let m = Models::new(None, -1, Residency::default());
        let need = Need { weights: 1, kv: 1 };
        let slot = |id: &str, idle_s: u64| {
            let (s, _) = m.reserve(loaded(id, "1"), need, u64::MAX).expect("fits");
            *s.last_used.lock().expect("lock") = Instant::now() - Duration::from_secs(idle_s);
            s
        };
        let (a, b, c) = (slot("a", 300), slot("b", 200), slot("c", 10));
        let all = || [a.clone(), b.clone(), c.clone()].into_iter();
        let with = |pinned: &[&str], min_resident_s: u64| Residency {
            pinned: pinned.iter().map(|p| p.to_string()).collect(),
            min_resident: Duration::from_secs(min_resident_s),
        };
        let key = |r: Result<Arc<ModelSlot>, NoVictim>| r.map(|s| s.key());
        assert_eq!(key(with(&[], 0).victim(all())), Ok("a@1".into()));
        // Pinned by name, or by its version.
        assert_eq!(key(with(&["a"], 0).victim(all())), Ok("b@1".into()));
        assert_eq!(key(with(&["a@1", "b"], 0).victim(all())), Ok("c@1".into()));
        assert_eq!(key(with(&["a@2"], 0).victim(all())), Ok("a@1".into()));
        // Used too recently: refused, saying for how long yet (a, idle 300 s, needs 600).
        match with(&[], 600).victim(all()) {
            Err(NoVictim::Recent(left)) => {
                assert!((299..=300).contains(&left.as_secs()), "{left:?}")
            }
            other => panic!("{:?}", key(other)),
        }
        assert_eq!(key(with(&["a"], 100).victim(all())), Ok("b@1".into()));
        assert_eq!(
            key(with(&["a", "b", "c"], 0).victim(all())),
            Err(NoVictim::None)
        );
    }

    #[test]
    fn without_a_budget_the_device_s_free_memory_bounds_a_load() {
        let m = Models::new(None, -1, Residency::default());
        let need = Need {
            weights: 10 * MIB,
            kv: 10 * MIB,
        };
        let e = m
            .reserve(loaded("a", ""), need, 15 * MIB)
            .expect_err("20 > 15");
        assert!(e.message().contains("of device memory"), "{}", e.message());
        assert!(m.reserve(loaded("a", ""), need, 25 * MIB).is_ok());
    }

    #[test]
    fn a_name_finds_its_ready_version_and_nothing_finds_the_default() {
        let m = Models::new(None, -1, Residency::default());
        let need = Need { weights: 1, kv: 1 };
        let (one, _) = m.reserve(loaded("a", "1"), need, u64::MAX).expect("a@1");
        let (two, _) = m.reserve(loaded("a", "2"), need, u64::MAX).expect("a@2");
        assert!(Arc::ptr_eq(&m.find("a@1").expect("pinned"), &one));
        // Neither is ready: the name means the last loaded; the default is the first.
        assert!(Arc::ptr_eq(&m.find("a").expect("name"), &two));
        assert!(Arc::ptr_eq(&m.find("").expect("default"), &one));
        assert!(m.find("b").is_none());
        assert!(m.find("a@3").is_none());
        assert!(one.accepting().is_err(), "a loading model takes no request");
        let before = m.epoch();
        m.set_failed(&two, "x".into());
        assert!(m.epoch() > before, "a state change moves the epoch");
    }
}
