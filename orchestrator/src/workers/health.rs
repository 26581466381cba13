//! Each worker as the pool knows it, and the poller that keeps it current: it calls `Health`
//! every `health_interval`, fetches `Info` once, and (re)opens the batched `Generate`
//! connection. A worker is *ready* when its last health check said so and its connection is
//! open; a connection that breaks makes it unready at once, checks that fail do after three in
//! a row. A worker that fails its checks for
//! `stall_timeout` with requests in flight has them failed over, and so does one the pool
//! removes (it left DNS): its poller then ends.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hearth_shared::proto;
use tokio::time::Instant;

use super::connection::{Client, WorkerConnection, WorkerLink};
use super::models::{reported, ModelKey, Reported};
use super::pool::{PoolConfig, WorkerPool};
use crate::telemetry;

#[derive(Debug, Default)]
pub(super) struct SlotState {
    pub(super) ready: bool,
    pub(super) info: Option<proto::InfoResponse>,
    /// `info`'s models (see [`reported`]), made once when it arrives: routing reads them for
    /// every request.
    pub(super) models: Vec<Reported>,
    /// `info`'s repository versions (`available`), read into keys once when it arrives.
    pub(super) available: Vec<ModelKey>,
    /// The worker's `models_epoch` when `info` was fetched: a new one means its models changed.
    pub(super) epoch: u64,
    pub(super) conn: Option<Arc<WorkerConnection>>,
    /// The connection a failing health check took out of service, and since when: requests on
    /// it may still finish if the worker recovers, or are failed over after `stall_timeout`.
    pub(super) suspect: Option<(Instant, Arc<WorkerConnection>)>,
    /// Health checks failed in a row (see [`FAILURES_TO_UNREADY`]).
    pub(super) failures: u32,
}

/// Health checks that must fail in a row before a worker whose connection is still open is
/// taken out of service: a worker that answers one check late (its machine busy) keeps serving.
/// A broken connection takes it out at once.
const FAILURES_TO_UNREADY: u32 = 3;

impl SlotState {
    /// Stores a new `Info`, fetched when the worker's `models_epoch` was `epoch`.
    pub(super) fn set_info(&mut self, info: proto::InfoResponse, epoch: u64) {
        self.models = reported(&info);
        self.available = info
            .available
            .iter()
            .filter_map(|a| ModelKey::from_repository(a))
            .collect();
        self.info = Some(info);
        self.epoch = epoch;
    }
}

/// A worker as `/readyz` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct WorkerStatus {
    pub name: String,
    pub ready: bool,
    pub in_flight: usize,
}

#[derive(Debug)]
pub struct WorkerSlot {
    pub addr: String,
    /// What clients and stored messages see instead of the address: `worker-<n>`, its place
    /// in the `--worker host:port` list (the same in every replica started with the same
    /// list), or for a worker found by DNS `worker-` and a hash of its address (the same in
    /// every replica with the same worker token).
    pub name: String,
    pub(super) state: Mutex<SlotState>,
    pub(super) in_flight: AtomicUsize,
    /// For unary calls (`DropSession`); set by the poller.
    pub(super) client: std::sync::OnceLock<Client>,
    /// Set when the pool removed the worker: its poller ends, and any connection is closed.
    retired: AtomicBool,
    /// The name its certificate must hold (see [`WorkerLink::server_name`]).
    server_name: Option<Arc<str>>,
}

impl WorkerSlot {
    pub(super) fn new(addr: String, name: String, server_name: Option<Arc<str>>) -> Self {
        Self {
            addr,
            name,
            state: Mutex::new(SlotState::default()),
            in_flight: AtomicUsize::new(0),
            client: std::sync::OnceLock::new(),
            retired: AtomicBool::new(false),
            server_name,
        }
    }

    /// How to reach this worker.
    pub(super) fn link(&self, config: &PoolConfig) -> WorkerLink {
        WorkerLink {
            server_name: self.server_name.clone(),
            ..config.link()
        }
    }

    /// Out of service for good (the pool removed it): closes its connections, so that the
    /// replies on them fail over with `reason`, and ends its poller at its next round.
    pub(super) fn retire(&self, reason: &str) {
        self.retired.store(true, Ordering::SeqCst);
        self.close(reason);
    }

    fn close(&self, reason: &str) {
        let (conn, suspect) = {
            let mut st = self.state();
            st.ready = false;
            (st.conn.take(), st.suspect.take())
        };
        for c in conn.into_iter().chain(suspect.map(|(_, c)| c)) {
            c.abort(reason);
        }
    }

    pub(super) fn state(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn conn(&self) -> Option<Arc<WorkerConnection>> {
        let s = self.state();
        s.conn.clone().filter(|c| s.ready && c.is_open())
    }

    /// Whether this worker has `model` ready.
    pub(super) fn serves(&self, model: &ModelKey) -> bool {
        self.state()
            .models
            .iter()
            .any(|r| r.key == *model && r.state == proto::ModelState::Ready)
    }

    /// Requests it takes from here: its ready models' batches and queues together.
    pub(super) fn capacity(&self, configured: usize) -> usize {
        if configured > 0 {
            return configured;
        }
        self.sum_ready(|r| r.max_batch + r.max_waiting)
    }

    /// Sequences its ready models decode in one step, together.
    pub(super) fn batch(&self) -> usize {
        self.sum_ready(|r| r.max_batch)
    }

    fn sum_ready(&self, f: impl Fn(&Reported) -> u32) -> usize {
        let n: u32 = self
            .state()
            .models
            .iter()
            .filter(|r| r.state == proto::ModelState::Ready)
            .map(f)
            .sum();
        n.max(1) as usize
    }
}

/// Keeps one worker's health, info and connection current while the pool exists and the
/// worker is in it.
pub(super) async fn poll(pool: std::sync::Weak<WorkerPool>, slot: Arc<WorkerSlot>) {
    let Some(link) = pool.upgrade().map(|p| slot.link(&p.config)) else {
        return;
    };
    let Some(mut client) = health_client(&slot, &link) else {
        return;
    };
    let _ = slot.client.set(client.clone());
    // Ready at the end of the last round: a connection that broke between rounds counts too.
    let mut was_up = false;
    loop {
        let Some(p) = pool
            .upgrade()
            .filter(|_| !slot.retired.load(Ordering::SeqCst))
        else {
            return;
        };
        let interval = p.config.health_interval;
        let was_ready = slot.conn().is_some();
        let epoch = slot.state().epoch;
        let checked = check(&mut client, &slot, &p.config, &link).await;
        if slot.retired.load(Ordering::SeqCst) {
            // A connection this round opened after the removal closes too.
            slot.close("the worker was removed from the pool");
            return;
        }
        let stuck = checked.as_ref().is_ok_and(|h| h.engine_stalled);
        let outcome = checked.and_then(|h| {
            if h.engine_stalled {
                // Alive but stuck: its replies will not move, so it counts as failing.
                Err("the worker's engine has not finished a step with work waiting".to_string())
            } else {
                Ok(h.ready)
            }
        });
        record(&slot, outcome, stuck, p.config.stall_timeout);
        let ready_now = slot.conn().is_some();
        if slot.state().epoch != epoch {
            // Its models changed: a request waiting for one may go now.
            p.room.notify_waiters();
        }
        if ready_now != was_ready {
            if ready_now {
                tracing::info!(worker = %slot.addr, "worker ready");
            }
            metrics::gauge!(telemetry::WORKERS_READY).set(p.ready_count() as f64);
            p.room.notify_waiters();
        }
        if was_up && !ready_now {
            p.lost.notify_one();
        }
        was_up = ready_now;
        drop(p);
        tokio::time::sleep(interval).await;
    }
}

/// A client of `slot`'s worker for its health rounds (connecting when first used); `None`
/// when its address is not one.
fn health_client(slot: &WorkerSlot, link: &WorkerLink) -> Option<Client> {
    match link.endpoint(&slot.addr) {
        Ok(e) => {
            let e = e
                .connect_timeout(Duration::from_secs(1))
                .timeout(Duration::from_secs(2));
            Some(link.client(e.connect_lazy()))
        }
        Err(e) => {
            tracing::error!(worker = %slot.addr, error = %e, "not a worker address");
            None
        }
    }
}

/// Stores a health round's outcome: ready or not, or a failure, which (a worker that says its
/// engine is `stuck` at once, else the [`FAILURES_TO_UNREADY`]th in a row) takes the connection
/// out of service and, once the worker has failed for `stall_timeout`, fails its replies over.
fn record(slot: &WorkerSlot, outcome: Result<bool, String>, stuck: bool, stall_timeout: Duration) {
    let mut st = slot.state();
    let e = match outcome {
        Ok(ready) => {
            st.ready = ready;
            st.failures = 0;
            // It answers again: what still runs on the old connection may finish.
            st.suspect = None;
            return;
        }
        Err(e) => e,
    };
    st.failures += 1;
    let open = st.conn.as_ref().is_some_and(|c| c.is_open());
    if st.ready && open && !stuck && st.failures < FAILURES_TO_UNREADY {
        tracing::debug!(worker = %slot.addr, error = %e, failures = st.failures, "a health check failed");
        return;
    }
    if st.ready {
        tracing::warn!(worker = %slot.addr, error = %e, "worker unavailable");
    } else {
        tracing::debug!(worker = %slot.addr, error = %e, "worker unavailable");
    }
    st.ready = false;
    if let Some(conn) = st.conn.take().filter(|c| c.is_open()) {
        st.suspect.get_or_insert((Instant::now(), conn));
    }
    let stalled = st
        .suspect
        .as_ref()
        .is_some_and(|(since, _)| since.elapsed() >= stall_timeout);
    if stalled {
        if let Some((since, conn)) = st.suspect.take() {
            tracing::warn!(worker = %slot.addr, silent_s = since.elapsed().as_secs_f64(), "worker stalled; failing its replies over");
            conn.abort(format!(
                "the worker has not answered health checks for {} s",
                since.elapsed().as_secs()
            ));
        }
    }
}

/// One health round: `Health`; `Info` when the worker's models changed (its `models_epoch`
/// moved) or it has no connection open (a worker that restarted may serve other models now);
/// and a new connection when none is open.
async fn check(
    client: &mut Client,
    slot: &WorkerSlot,
    config: &PoolConfig,
    link: &WorkerLink,
) -> Result<proto::HealthResponse, String> {
    let health = client
        .health(proto::HealthRequest {})
        .await
        .map_err(|s| format!("health check failed: {}", s.message()))?
        .into_inner();
    let open = slot.state().conn.as_ref().is_some_and(|c| c.is_open());
    let stale = {
        let st = slot.state();
        st.info.is_none() || st.epoch != health.models_epoch
    };
    if stale || (!open && health.ready) {
        let info = client
            .info(proto::InfoRequest {})
            .await
            .map_err(|s| format!("info failed: {}", s.message()))?
            .into_inner();
        slot.state().set_info(info, health.models_epoch);
    }
    if !open && health.ready && !health.engine_stalled {
        let conn = WorkerConnection::connect(&slot.addr, config.batch, link)
            .await
            .map_err(|e| e.to_string())?;
        slot.state().conn = Some(Arc::new(conn));
    }
    Ok(health)
}
