//! The worker pool: the `--worker` addresses, their health, and which one serves a request.
//!
//! Routing: a session goes to the worker that holds its KV cache (affinity), and a stateless
//! request to the worker that served the longest of its leading token runs (see
//! [`prefix_keys`]: it likely holds that prefix in its prefix cache), unless that worker
//! is overloaded (as many requests in flight from here as its batch holds); otherwise to the
//! ready worker with the fewest requests in flight.
//!
//! The workers are the `--worker` addresses, and those DNS lists (see [`super::discovery`]),
//! which come and go while the pool runs: routing reads a snapshot of the list, swapped whole
//! when a worker is added or removed.
//!
//! The queue that orders requests when every worker is full is in [`super::fair`], where
//! sessions' caches are in [`super::affinity`], and each worker's health in [`super::health`].

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use hearth_shared::proto;
use hearth_shared::worker_auth::{AddToken, WorkerToken};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::affinity::{Affinity, PrefixKey};
use super::connection::{BatchConfig, WorkerConnection, WorkerLink};
use super::fair::{Fair, Held};
use super::health::{poll, WorkerSlot, WorkerStatus};
use super::models::ModelKey;
use super::Lease;
use super::Tenant;
use crate::ids::SessionId;
use crate::telemetry;

#[derive(Debug, Clone)]
pub struct PoolConfig {
    pub batch: BatchConfig,
    pub health_interval: Duration,
    /// Requests one worker may have in flight from this orchestrator; 0: the worker's own
    /// `max_batch + max_waiting`.
    pub per_worker_capacity: usize,
    /// Requests that may wait for room when every worker is full.
    pub max_queue: usize,
    /// How long one of them waits before it is refused.
    pub queue_timeout: Duration,
    /// A worker that fails its health checks this long while it has an open connection is
    /// given up on: the connection is closed and its replies fail over to other workers.
    pub stall_timeout: Duration,
    /// The worker token every call carries (`--worker-token`).
    pub token: Option<WorkerToken>,
    /// The authority of the workers' TLS certificates (`--worker-ca`, PEM); none: plain TCP.
    pub worker_ca: Option<Arc<[u8]>>,
}

impl PoolConfig {
    /// How to reach the workers: the token, and TLS with a CA.
    pub fn link(&self) -> WorkerLink {
        WorkerLink {
            auth: AddToken::new(self.token.as_ref()),
            ca: self.worker_ca.clone(),
            server_name: None,
        }
    }
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            batch: BatchConfig::default(),
            health_interval: Duration::from_millis(500),
            per_worker_capacity: 0,
            max_queue: 256,
            queue_timeout: Duration::from_secs(10),
            stall_timeout: Duration::from_secs(10),
            token: None,
            worker_ca: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("no worker is available to serve this request")]
    NoWorker,
    #[error("every worker is busy; try again shortly")]
    Full,
}

/// The workers routing chooses among, as one snapshot.
pub(super) type Slots = Arc<Vec<Arc<WorkerSlot>>>;

#[derive(Debug)]
pub struct WorkerPool {
    /// Read for every request (an uncontended read lock and a reference count), written only
    /// when DNS discovery adds or removes a worker.
    slots: RwLock<Slots>,
    pub(super) affinity: Affinity,
    pub(super) config: PoolConfig,
    /// Woken when a worker gets room or becomes ready, or a waiting request leaves the queue.
    pub(super) room: Notify,
    pub(super) fair: Mutex<Fair>,
    /// Told when a ready worker stops answering: DNS discovery looks its name up again at once.
    /// Its own `Arc`, so the discovery task can wait on it without keeping the pool alive.
    pub(super) lost: Arc<Notify>,
}

/// What a request asks of the pool: the model it needs (none: any worker, while none has
/// reported its model), the worker it would rather have, workers to skip, and whether it is a
/// reply under way (preempted, failed over or taken over) waiting to continue.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Ask {
    pub(super) model: Option<ModelKey>,
    pub(super) preferred: Option<String>,
    pub(super) exclude: Vec<Excluded>,
    pub(super) resumed: bool,
}

/// A worker a reply will not go to again, on the connection it failed on: the same worker
/// reached again (restarted) is another chance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Excluded {
    pub addr: String,
    pub serial: u64,
}

impl Ask {
    /// Whether the worker at `addr`, on the connection `serial`, is one to skip.
    pub(super) fn skips(&self, addr: &str, serial: u64) -> bool {
        self.exclude
            .iter()
            .any(|e| e.addr == addr && e.serial == serial)
    }
}

pub(super) enum Pick {
    Got(Lease),
    /// Ready workers exist but all are full.
    Full,
    NoneReady,
}

impl WorkerPool {
    /// Starts polling every address; workers join as they become ready. Each is named
    /// `worker-<n>` after its place in `addrs`.
    pub fn start(addrs: &[String], affinity: Affinity, config: PoolConfig) -> Arc<Self> {
        let slots = addrs
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let name = format!("worker-{}", i + 1);
                Arc::new(WorkerSlot::new(a.clone(), name, None))
            })
            .collect();
        let pool = Arc::new(Self {
            slots: RwLock::new(Arc::new(slots)),
            affinity,
            config,
            room: Notify::new(),
            fair: Mutex::new(Fair::default()),
            lost: Arc::new(Notify::new()),
        });
        for slot in pool.slots().iter() {
            tokio::spawn(poll(Arc::downgrade(&pool), slot.clone()));
        }
        pool
    }

    /// The workers now.
    pub(super) fn slots(&self) -> Slots {
        self.slots.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Adds the worker at `addr`, called `name`, whose certificate (with `--worker-ca`) must
    /// hold `server_name`, and starts polling it; it takes requests once ready. False (and
    /// nothing done) if the pool has a worker at `addr` already.
    pub(super) fn add_worker(
        self: &Arc<Self>,
        addr: String,
        name: String,
        server_name: Arc<str>,
    ) -> bool {
        let slot = Arc::new(WorkerSlot::new(addr, name, Some(server_name)));
        {
            let mut slots = self.slots.write().unwrap_or_else(|p| p.into_inner());
            if slots.iter().any(|s| s.addr == slot.addr) {
                return false;
            }
            let mut next = Vec::clone(&slots);
            next.push(slot.clone());
            *slots = Arc::new(next);
        }
        tokio::spawn(poll(Arc::downgrade(self), slot));
        true
    }

    /// Takes the worker at `addr` out of routing: no request goes to it from now on, and the
    /// replies running on it fail over to other workers, told `reason`. Its slot goes once the
    /// last of them has moved. False if the pool has no worker at `addr`.
    pub(super) fn remove_worker(&self, addr: &str, reason: &str) -> bool {
        let gone = {
            let mut slots = self.slots.write().unwrap_or_else(|p| p.into_inner());
            let Some(i) = slots.iter().position(|s| s.addr == addr) else {
                return false;
            };
            let mut next = Vec::clone(&slots);
            let gone = next.remove(i);
            *slots = Arc::new(next);
            gone
        };
        gone.retire(reason);
        metrics::gauge!(telemetry::WORKERS_READY).set(self.ready_count() as f64);
        // A queued request that only this worker could take must learn there is none.
        self.room.notify_waiters();
        true
    }

    pub fn ready_count(&self) -> usize {
        self.slots().iter().filter(|s| s.conn().is_some()).count()
    }

    /// One line per worker, for `/readyz`. Public, so it names each worker by its public name
    /// (see [`WorkerSlot::name`]) and leaves out its address and last error (which can hold
    /// addresses); both are logged.
    pub fn describe(&self) -> Vec<WorkerStatus> {
        self.slots()
            .iter()
            .map(|s| {
                let st = s.state();
                WorkerStatus {
                    name: s.name.clone(),
                    ready: st.ready && st.conn.as_ref().is_some_and(|c| c.is_open()),
                    in_flight: s.in_flight.load(Ordering::SeqCst),
                }
            })
            .collect()
    }

    /// Frees `session`'s cached KV on every worker that holds it (a deleted session). Workers
    /// that are down, or hold nothing for it, are skipped: a restarted worker holds nothing.
    pub async fn drop_session(&self, session: &SessionId) {
        let mut calls = tokio::task::JoinSet::new();
        for slot in self.slots().iter() {
            let Some(client) = slot.client.get() else {
                continue;
            };
            let (mut client, addr) = (client.clone(), slot.addr.clone());
            let req = proto::DropSessionRequest {
                session_id: session.to_string(),
            };
            calls.spawn(async move {
                match client.drop_session(req).await {
                    Ok(_) => tracing::debug!(worker = %addr, "session cache dropped"),
                    Err(s) if s.code() == tonic::Code::NotFound => {}
                    Err(s) => {
                        tracing::debug!(worker = %addr, error = %s.message(), "could not drop a session cache");
                    }
                }
            });
        }
        while calls.join_next().await.is_some() {}
    }

    /// Chooses a worker for `user`'s stateless request with the affinity keys `keys` (from
    /// [`prefix_keys`]): the worker that served the longest of them, unless it is overloaded.
    #[tracing::instrument(name = "queue", skip_all)]
    pub async fn admit_prefix(
        self: &Arc<Self>,
        user: &Tenant,
        model: Option<&ModelKey>,
        keys: &[PrefixKey],
    ) -> Result<Lease, PoolError> {
        let ask = Ask {
            model: model.cloned(),
            preferred: self.affinity.get_last(keys).await,
            ..Ask::default()
        };
        let lease = self.admit_preferring(user, ask).await?;
        // Every key, the longer ones being new: the next turn finds the longest.
        for k in keys {
            self.affinity.set_prefix(k, lease.addr()).await;
        }
        Ok(lease)
    }

    /// Chooses a worker serving `model` for `user`'s request of `session` (if any), skipping
    /// `exclude`. Waits in the bounded queue when every such worker is full.
    #[tracing::instrument(name = "queue", skip_all)]
    pub async fn admit(
        self: &Arc<Self>,
        user: &Tenant,
        model: Option<&ModelKey>,
        session: Option<&SessionId>,
        exclude: &[Excluded],
    ) -> Result<Lease, PoolError> {
        let preferred = self.session_worker(session).await;
        let ask = Ask {
            model: model.cloned(),
            preferred: preferred.clone(),
            exclude: exclude.to_vec(),
            resumed: false,
        };
        let lease = self.admit_preferring(user, ask).await?;
        if let Some(s) = session {
            if preferred.as_deref() != Some(lease.addr()) {
                self.affinity.set_session(s, lease.addr()).await;
            }
        }
        Ok(lease)
    }

    /// A worker for a reply that gave its place up to another user ([`Lease::yielded`]), to
    /// continue on: its `session`'s worker if it has room, else any, skipping `exclude`. It
    /// waits ahead of its user's new requests, without the queue's bound or timeout.
    #[tracing::instrument(name = "queue", skip_all)]
    pub async fn readmit(
        self: &Arc<Self>,
        user: &Tenant,
        model: Option<&ModelKey>,
        session: Option<&SessionId>,
        exclude: &[Excluded],
    ) -> Result<Lease, PoolError> {
        let ask = Ask {
            model: model.cloned(),
            preferred: self.session_worker(session).await,
            exclude: exclude.to_vec(),
            resumed: true,
        };
        self.admit_preferring(user, ask).await
    }

    /// The worker that last served `session` (it likely holds the session's KV cache).
    async fn session_worker(&self, session: Option<&SessionId>) -> Option<String> {
        match session {
            Some(s) => self.affinity.get(s).await,
            None => None,
        }
    }

    async fn admit_preferring(
        self: &Arc<Self>,
        user: &Tenant,
        ask: Ask,
    ) -> Result<Lease, PoolError> {
        let started = Instant::now();
        // A request that no waiting one ranks before takes room at once; otherwise it queues.
        // Only waiting requests that could take the same workers count as before it, so a
        // request for one model never waits behind requests for another.
        let behind = {
            let fair = self.fair();
            let mine = fair.rank(user, ask.resumed, u64::MAX);
            self.someone_ahead(&fair, mine, &ask)
        };
        let lease = match behind {
            true => self.wait_for_room(user, ask).await?,
            false => match self.pick(user, &ask) {
                Pick::Got(l) => l,
                // A reply under way waits for a worker to come back (see `wait_for_room`).
                Pick::NoneReady if !ask.resumed => return Err(PoolError::NoWorker),
                Pick::NoneReady | Pick::Full => self.wait_for_room(user, ask).await?,
            },
        };
        telemetry::observe(telemetry::QUEUE_WAIT, started.elapsed().as_secs_f64());
        Ok(lease)
    }

    /// The worker a request would get now, without taking its place.
    pub(super) fn choose(
        &self,
        ask: &Ask,
    ) -> Result<(Arc<WorkerSlot>, Arc<WorkerConnection>), Pick> {
        let cap = self.config.per_worker_capacity;
        let slots = self.slots();
        let candidates: Vec<(&Arc<WorkerSlot>, Arc<WorkerConnection>)> = slots
            .iter()
            .filter(|s| ask.model.as_ref().is_none_or(|m| s.serves(m)))
            .filter_map(|s| s.conn().map(|c| (s, c)))
            .filter(|(s, c)| !ask.skips(&s.addr, c.serial()))
            .collect();
        if candidates.is_empty() {
            return Err(Pick::NoneReady);
        }
        let load = |s: &WorkerSlot| s.in_flight.load(Ordering::SeqCst);
        // The session's worker, unless it is overloaded.
        let sticky = ask.preferred.as_deref().and_then(|p| {
            candidates
                .iter()
                .find(|(s, _)| s.addr == p && load(s) < s.batch().min(s.capacity(cap)))
        });
        let chosen = sticky.or_else(|| {
            candidates
                .iter()
                .filter(|(s, _)| load(s) < s.capacity(cap))
                .min_by_key(|(s, _)| load(s))
        });
        match chosen {
            Some((slot, conn)) => Ok(((*slot).clone(), conn.clone())),
            None => Err(Pick::Full),
        }
    }

    pub(super) fn pick(self: &Arc<Self>, user: &Tenant, ask: &Ask) -> Pick {
        let (slot, conn) = match self.choose(ask) {
            Ok(c) => c,
            Err(p) => return p,
        };
        // Claim a place; a race with another request can overshoot by one, never more than
        // the callers racing.
        slot.in_flight.fetch_add(1, Ordering::SeqCst);
        let signal = Arc::new(Notify::new());
        let id = {
            let mut fair = self.fair();
            fair.hold(user);
            let id = fair.next_lease;
            fair.next_lease += 1;
            fair.leases.push(Held {
                id,
                tenant: user.clone(),
                addr: slot.addr.clone(),
                yielding: false,
                signal: signal.clone(),
            });
            id
        };
        Pick::Got(Lease {
            slot,
            conn,
            pool: self.clone(),
            tenant: user.clone(),
            id,
            yield_signal: signal,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(pool: &WorkerPool) -> Vec<String> {
        pool.describe().into_iter().map(|w| w.name).collect()
    }

    #[tokio::test]
    async fn workers_join_and_leave_the_list_routing_reads() {
        let fixed = ["127.0.0.1:1".to_string()];
        let pool = WorkerPool::start(&fixed, Affinity::local(), PoolConfig::default());
        let found = || ("127.0.0.2:1".to_string(), "worker-x".to_string());
        let (addr, name) = found();
        assert!(pool.add_worker(addr, name, "w.test".into()));
        let (addr, name) = found();
        assert!(
            !pool.add_worker(addr, name, "w.test".into()),
            "one slot an address"
        );
        assert_eq!(names(&pool), ["worker-1", "worker-x"]);
        let before = pool.slots();
        assert!(pool.remove_worker("127.0.0.2:1", "left DNS"));
        assert!(!pool.remove_worker("127.0.0.2:1", "left DNS"));
        assert_eq!(names(&pool), ["worker-1"]);
        // A request that read the list just before still holds the slot, retired: no
        // connection to choose.
        assert_eq!(before.len(), 2);
        assert!(before[1].conn().is_none());
    }
}
