//! The worker pool: the `--worker` addresses, their health, and which one serves a request.
//!
//! Each worker has a poller that calls `Health` every `health_interval`, fetches `Info` once,
//! and (re)opens the batched `Generate` connection. A worker is *ready* when its last health
//! check said so and its connection is open; a connection that breaks makes it unready at once.
//!
//! Routing: a session goes to the worker that holds its KV cache (affinity), and a stateless
//! request to the worker that served the longest of its leading token runs (see
//! [`prefix_keys`]: it likely holds that prefix in its prefix cache), unless that worker
//! is overloaded (as many requests in flight from here as its batch holds); otherwise to the
//! ready worker with the fewest requests in flight. Each worker takes at most `capacity`
//! requests at a time from this orchestrator; when every worker is full, requests wait in a
//! bounded queue (`max_queue`, `queue_timeout`) and are then refused, never piled up.
//!
//! The queue is fair between users: room that frees up goes to the waiting request whose user
//! holds the fewest workers' places, and among equals to the one that came first, so one user
//! with many requests in flight cannot keep another waiting behind them. When the queue is
//! full, a user with fewer waiting requests than the user with the most takes that user's
//! newest place (that request is refused as if the queue had been full for it), so the queue
//! too is shared rather than taken by whoever filled it first.
//!
//! Fair order alone still leaves a user who holds no place waiting for one of another user's
//! replies to end, which can take as long as a reply. So a request whose user holds no place,
//! finding every worker full, asks the user holding the most places (at least two) to give up
//! their newest: that reply's [`Lease::yielded`] resolves, and its generation lets the place go
//! and queues again ahead of its user's other requests, continuing where it stopped like a
//! failover (`hearth_fair_share_preemptions_total` counts them). A user is never preempted down to nothing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hearth_shared::proto::{self, worker_client::WorkerClient};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::connection::{BatchConfig, Generation, WorkerConnection, WorkerError};
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

#[derive(Debug, Default)]
struct SlotState {
    ready: bool,
    info: Option<proto::InfoResponse>,
    conn: Option<Arc<WorkerConnection>>,
    /// The connection a failing health check took out of service, and since when: requests on
    /// it may still finish if the worker recovers, or are failed over after `stall_timeout`.
    suspect: Option<(Instant, Arc<WorkerConnection>)>,
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
    /// in the `--worker` list (the same in every replica started with the same list).
    pub name: String,
    state: Mutex<SlotState>,
    in_flight: AtomicUsize,
    /// For unary calls (`DropSession`); set by the poller.
    client: std::sync::OnceLock<WorkerClient<tonic::transport::Channel>>,
}

impl WorkerSlot {
    fn state(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn conn(&self) -> Option<Arc<WorkerConnection>> {
        let s = self.state();
        s.conn.clone().filter(|c| s.ready && c.is_open())
    }

    fn capacity(&self, configured: usize) -> usize {
        if configured > 0 {
            return configured;
        }
        self.state()
            .info
            .as_ref()
            .map_or(1, |i| (i.max_batch + i.max_waiting).max(1) as usize)
    }

    fn batch(&self) -> usize {
        self.state()
            .info
            .as_ref()
            .map_or(1, |i| i.max_batch.max(1) as usize)
    }
}

/// Where sessions' caches live: in this process, and shared through Redis when there is one.
/// The local map is written either way, so while Redis is down this replica still sends the
/// sessions it routed itself back to their caches (it learns nothing from other replicas then).
#[derive(Debug, Default)]
pub struct Affinity {
    local: Mutex<HashMap<String, String>>,
    redis: Option<crate::limits::Redis>,
}

const AFFINITY_TTL_SECS: u64 = 86_400;

/// Tokens in the shortest prefix routed by affinity: one KV block of the worker.
const PREFIX_UNIT: usize = 16;

/// Affinity keys of a stateless prompt: a hash of each of its leading runs of 16, 32, 64, …
/// tokens (short of its last token, which a worker always computes), shortest first. A
/// conversation resent with one more turn shares its earlier keys; prompts with a common
/// system prompt share the keys that fall inside it.
pub fn prefix_keys(prompt: &[u32]) -> Vec<String> {
    use std::hash::{Hash, Hasher};
    let mut keys = Vec::new();
    let mut len = PREFIX_UNIT;
    while len < prompt.len() {
        // The same key in every orchestrator replica: DefaultHasher::new() has fixed keys.
        let mut h = std::collections::hash_map::DefaultHasher::new();
        prompt[..len].hash(&mut h);
        keys.push(format!("prefix:{len}:{:016x}", h.finish()));
        len *= 2;
    }
    keys
}

impl Affinity {
    /// Remembered in this process only.
    pub fn local() -> Self {
        Self::default()
    }

    /// Shared through Redis, with this process's own memory when Redis cannot be reached.
    pub fn shared(redis: crate::limits::Redis) -> Self {
        Self {
            local: Mutex::default(),
            redis: Some(redis),
        }
    }

    fn remembered(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        self.local.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The worker of the last of `keys` that has one.
    async fn get_last(&self, keys: &[String]) -> Option<String> {
        if let (Some(c), false) = (&self.redis, keys.is_empty()) {
            let mut get = redis::cmd("MGET");
            for k in keys {
                get.arg(format!("hearth:affinity:{k}"));
            }
            if let Some(found) = c
                .cmd::<Vec<Option<String>>>(&get, "prefix affinity unknown")
                .await
            {
                return found.into_iter().rev().flatten().next();
            }
        }
        let m = self.remembered();
        keys.iter().rev().find_map(|k| m.get(k).cloned())
    }

    async fn get(&self, session: &str) -> Option<String> {
        if let Some(c) = &self.redis {
            let get = redis::cmd("GET")
                .arg(format!("hearth:affinity:{session}"))
                .clone();
            if let Some(found) = c
                .cmd::<Option<String>>(&get, "session affinity unknown")
                .await
            {
                return found;
            }
        }
        self.remembered().get(session).cloned()
    }

    async fn set(&self, session: &str, addr: &str) {
        {
            let mut m = self.remembered();
            if m.len() > 100_000 {
                m.clear();
            }
            m.insert(session.to_string(), addr.to_string());
        }
        if let Some(c) = &self.redis {
            let set = redis::cmd("SET")
                .arg(format!("hearth:affinity:{session}"))
                .arg(addr)
                .arg("EX")
                .arg(AFFINITY_TTL_SECS)
                .clone();
            c.cmd::<()>(&set, "session affinity not saved").await;
        }
    }
}

#[derive(Debug)]
pub struct WorkerPool {
    slots: Vec<Arc<WorkerSlot>>,
    affinity: Affinity,
    config: PoolConfig,
    /// Woken when a worker gets room or becomes ready, or a waiting request leaves the queue.
    room: Notify,
    fair: Mutex<Fair>,
}

/// The queue and the places each user holds, which order it.
#[derive(Debug, Default)]
struct Fair {
    next_ticket: u64,
    waiting: Vec<Waiter>,
    /// Workers' places (leases) held per user.
    held: HashMap<String, usize>,
    next_lease: u64,
    /// Every place held, oldest first.
    leases: Vec<Held>,
}

#[derive(Debug)]
struct Waiter {
    ticket: u64,
    user: String,
    preferred: Option<String>,
    exclude: Vec<String>,
    /// A preempted reply waiting to continue: it goes before its user's new requests, and
    /// neither the queue's bound nor its timeout applies to it.
    resumed: bool,
}

/// A place held, as the queue sees it.
#[derive(Debug)]
struct Held {
    id: u64,
    user: String,
    addr: String,
    /// Asked to give the place up.
    yielding: bool,
    signal: Arc<Notify>,
}

/// Queue order: fewest places held by the user, then a preempted reply before new requests,
/// then arrival.
type Rank = (usize, bool, u64);

impl Fair {
    fn rank(&self, user: &str, resumed: bool, ticket: u64) -> Rank {
        (self.held.get(user).copied().unwrap_or(0), !resumed, ticket)
    }
}

/// A worker chosen for one request; it counts as in flight there until dropped.
#[derive(Debug)]
pub struct Lease {
    slot: Arc<WorkerSlot>,
    conn: Arc<WorkerConnection>,
    pool: Arc<WorkerPool>,
    user: String,
    id: u64,
    yield_signal: Arc<Notify>,
}

impl Lease {
    pub fn addr(&self) -> &str {
        &self.slot.addr
    }

    /// The worker's public name (see [`WorkerSlot::name`]).
    pub fn name(&self) -> &str {
        &self.slot.name
    }

    pub fn generate(&self, req: proto::GenerateRequest) -> Result<Generation, WorkerError> {
        self.conn.generate(req)
    }

    /// Resolves once the place is asked for by a user who holds none: the generation should
    /// stop on this worker, drop the lease, and continue through [`WorkerPool::readmit`].
    pub async fn yielded(&self) {
        self.yield_signal.notified().await;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.slot.in_flight.fetch_sub(1, Ordering::SeqCst);
        {
            let mut fair = self.pool.fair();
            if let Some(n) = fair.held.get_mut(&self.user) {
                *n -= 1;
                if *n == 0 {
                    fair.held.remove(&self.user);
                }
            }
            if let Some(i) = fair.leases.iter().position(|l| l.id == self.id) {
                fair.leases.remove(i);
            }
        }
        self.pool.room.notify_waiters();
    }
}

/// One place in the bounded queue, held while a request waits for room.
struct QueuePlace<'a> {
    pool: &'a WorkerPool,
    ticket: u64,
}

impl<'a> QueuePlace<'a> {
    /// A place for `user`'s request, if the queue has one or `user` may take one from the
    /// user with the most waiting requests.
    fn take(
        pool: &'a WorkerPool,
        user: &str,
        preferred: Option<&str>,
        exclude: &[String],
        resumed: bool,
    ) -> Option<Self> {
        let mut fair = pool.fair();
        if !resumed && fair.waiting.len() >= pool.config.max_queue {
            let mut counts: HashMap<&str, usize> = HashMap::new();
            for w in fair.waiting.iter().filter(|w| !w.resumed) {
                *counts.entry(w.user.as_str()).or_default() += 1;
            }
            let mine = counts.get(user).copied().unwrap_or(0);
            let (most, theirs) = counts
                .into_iter()
                .max_by_key(|&(u, n)| (n, std::cmp::Reverse(u)))?;
            if mine + 1 >= theirs {
                return None;
            }
            let most = most.to_string();
            let newest = fair
                .waiting
                .iter()
                .rposition(|w| w.user == most && !w.resumed)
                .expect("the user with the most waiting requests has one");
            fair.waiting.remove(newest);
            metrics::gauge!(telemetry::QUEUE_DEPTH).decrement(1.0);
            // The request that lost its place learns it when it next looks.
            pool.room.notify_waiters();
        }
        let ticket = fair.next_ticket;
        fair.next_ticket += 1;
        fair.waiting.push(Waiter {
            ticket,
            user: user.to_string(),
            preferred: preferred.map(str::to_string),
            exclude: exclude.to_vec(),
            resumed,
        });
        metrics::gauge!(telemetry::QUEUE_DEPTH).increment(1.0);
        Some(Self { pool, ticket })
    }
}

impl Drop for QueuePlace<'_> {
    fn drop(&mut self) {
        let mut fair = self.pool.fair();
        if let Some(i) = fair.waiting.iter().position(|w| w.ticket == self.ticket) {
            fair.waiting.remove(i);
            metrics::gauge!(telemetry::QUEUE_DEPTH).decrement(1.0);
            drop(fair);
            // Whoever it kept waiting may go now.
            self.pool.room.notify_waiters();
        }
    }
}

/// Where a request stands in the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Turn {
    /// No request ranked before it could take a place now.
    Next,
    /// One ranked before it could, and goes first.
    Behind,
    /// A request of a user with fewer waiting took its place.
    Bumped,
}

enum Pick {
    Got(Lease),
    /// Ready workers exist but all are full.
    Full,
    NoneReady,
}

impl WorkerPool {
    /// Starts polling every address; workers join as they become ready.
    pub fn start(addrs: &[String], affinity: Affinity, config: PoolConfig) -> Arc<Self> {
        let pool = Arc::new(Self {
            slots: addrs
                .iter()
                .enumerate()
                .map(|(i, a)| {
                    Arc::new(WorkerSlot {
                        addr: a.clone(),
                        name: format!("worker-{}", i + 1),
                        state: Mutex::new(SlotState::default()),
                        in_flight: AtomicUsize::new(0),
                        client: std::sync::OnceLock::new(),
                    })
                })
                .collect(),
            affinity,
            config,
            room: Notify::new(),
            fair: Mutex::new(Fair::default()),
        });
        for slot in &pool.slots {
            tokio::spawn(poll(Arc::downgrade(&pool), slot.clone()));
        }
        pool
    }

    pub fn ready_count(&self) -> usize {
        self.slots.iter().filter(|s| s.conn().is_some()).count()
    }

    /// The first ready worker's `Info` (model, context length, special tokens).
    pub fn info(&self) -> Option<proto::InfoResponse> {
        self.slots
            .iter()
            .filter(|s| s.conn().is_some())
            .find_map(|s| s.state().info.clone())
    }

    /// The smallest context length among ready workers, so a prompt fits wherever it goes.
    pub fn context_length(&self) -> Option<usize> {
        self.slots
            .iter()
            .filter(|s| s.conn().is_some())
            .filter_map(|s| s.state().info.as_ref().map(|i| i.context_length as usize))
            .min()
    }

    /// One line per worker, for `/readyz`. Public, so it names each worker `worker-<n>` and
    /// leaves out its address and last error (which can hold addresses); both are logged.
    pub fn describe(&self) -> Vec<WorkerStatus> {
        self.slots
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
    pub async fn drop_session(&self, session: &str) {
        let mut calls = tokio::task::JoinSet::new();
        for slot in &self.slots {
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
    pub async fn admit_prefix(
        self: &Arc<Self>,
        user: &str,
        keys: &[String],
    ) -> Result<Lease, PoolError> {
        let preferred = self.affinity.get_last(keys).await;
        let lease = self
            .admit_preferring(user, preferred.as_deref(), &[], false)
            .await?;
        // Every key, the longer ones being new: the next turn finds the longest.
        for k in keys {
            self.affinity.set(k, lease.addr()).await;
        }
        Ok(lease)
    }

    /// Chooses a worker for `user`'s request of `session` (if any), skipping `exclude`. Waits
    /// in the bounded queue when every worker is full.
    pub async fn admit(
        self: &Arc<Self>,
        user: &str,
        session: Option<&str>,
        exclude: &[String],
    ) -> Result<Lease, PoolError> {
        let preferred = self.session_worker(session).await;
        let lease = self
            .admit_preferring(user, preferred.as_deref(), exclude, false)
            .await?;
        if let Some(s) = session {
            if preferred.as_deref() != Some(lease.addr()) {
                self.affinity.set(s, lease.addr()).await;
            }
        }
        Ok(lease)
    }

    /// A worker for a reply that gave its place up to another user ([`Lease::yielded`]), to
    /// continue on: its `session`'s worker if it has room, else any, skipping `exclude`. It
    /// waits ahead of its user's new requests, without the queue's bound or timeout.
    pub async fn readmit(
        self: &Arc<Self>,
        user: &str,
        session: Option<&str>,
        exclude: &[String],
    ) -> Result<Lease, PoolError> {
        let preferred = self.session_worker(session).await;
        self.admit_preferring(user, preferred.as_deref(), exclude, true)
            .await
    }

    /// The worker that last served `session` (it likely holds the session's KV cache).
    async fn session_worker(&self, session: Option<&str>) -> Option<String> {
        match session {
            Some(s) => self.affinity.get(s).await,
            None => None,
        }
    }

    async fn admit_preferring(
        self: &Arc<Self>,
        user: &str,
        preferred: Option<&str>,
        exclude: &[String],
        resumed: bool,
    ) -> Result<Lease, PoolError> {
        let started = Instant::now();
        // A request that no waiting one ranks before takes room at once; otherwise it queues.
        let behind = {
            let fair = self.fair();
            let mine = fair.rank(user, resumed, u64::MAX);
            self.someone_ahead(&fair, mine)
        };
        let lease = match behind {
            true => {
                self.wait_for_room(user, preferred, exclude, resumed)
                    .await?
            }
            false => match self.pick(user, preferred, exclude) {
                Pick::Got(l) => l,
                Pick::NoneReady => return Err(PoolError::NoWorker),
                Pick::Full => {
                    self.wait_for_room(user, preferred, exclude, resumed)
                        .await?
                }
            },
        };
        telemetry::observe(telemetry::QUEUE_WAIT, started.elapsed().as_secs_f64());
        Ok(lease)
    }

    async fn wait_for_room(
        self: &Arc<Self>,
        user: &str,
        preferred: Option<&str>,
        exclude: &[String],
        resumed: bool,
    ) -> Result<Lease, PoolError> {
        // The place in the queue is given back when this future ends in any way, including
        // being dropped while it waits (a client that goes away, a stop).
        let Some(place) = QueuePlace::take(self, user, preferred, exclude, resumed) else {
            return Err(PoolError::Full);
        };
        let deadline = Instant::now() + self.config.queue_timeout;
        loop {
            let notified = self.room.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.turn(place.ticket) {
                Turn::Bumped => return Err(PoolError::Full),
                Turn::Behind => {}
                Turn::Next => match self.pick(user, preferred, exclude) {
                    Pick::Got(l) => return Ok(l),
                    Pick::NoneReady => return Err(PoolError::NoWorker),
                    Pick::Full => self.preempt_for(user, exclude),
                },
            }
            if resumed {
                notified.await;
            } else if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(PoolError::Full);
            }
        }
    }

    /// When `user` holds no place and waits with every worker full, asks the user with the
    /// most places (at least two, not counting those already asked) to give their newest up,
    /// on a worker `user` may use. One place is asked for each waiting user who holds none,
    /// and the freed place goes to the first of them in queue order.
    fn preempt_for(&self, user: &str, exclude: &[String]) {
        let mut fair = self.fair();
        if fair.held.contains_key(user) {
            return;
        }
        let starving: std::collections::HashSet<&str> = fair
            .waiting
            .iter()
            .filter(|w| !w.resumed && !fair.held.contains_key(&w.user))
            .map(|w| w.user.as_str())
            .collect();
        let asked = fair.leases.iter().filter(|l| l.yielding).count();
        if starving.len() <= asked {
            return;
        }
        let mut keeps: HashMap<&str, usize> = HashMap::new();
        for l in fair.leases.iter().filter(|l| !l.yielding) {
            *keeps.entry(l.user.as_str()).or_default() += 1;
        }
        let Some((victim, n)) = keeps
            .into_iter()
            .filter(|&(u, _)| u != user)
            .max_by_key(|&(u, n)| (n, std::cmp::Reverse(u)))
        else {
            return;
        };
        if n < 2 {
            return;
        }
        let victim = victim.to_string();
        let newest = fair
            .leases
            .iter_mut()
            .rev()
            .find(|l| l.user == victim && !l.yielding && !exclude.contains(&l.addr));
        if let Some(l) = newest {
            l.yielding = true;
            l.signal.notify_one();
            metrics::counter!(telemetry::PREEMPTIONS).increment(1);
        }
    }

    fn fair(&self) -> std::sync::MutexGuard<'_, Fair> {
        self.fair.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a waiting request ranked before `rank` could take a worker's place now.
    fn someone_ahead(&self, fair: &Fair, rank: Rank) -> bool {
        // Most waiting requests ask for the same workers: try each distinct ask once.
        let mut asked: Vec<(Option<&str>, &[String], bool)> = Vec::new();
        fair.waiting
            .iter()
            .filter(|w| fair.rank(&w.user, w.resumed, w.ticket) < rank)
            .any(|w| {
                let ask = (w.preferred.as_deref(), w.exclude.as_slice());
                if let Some(&(_, _, able)) = asked.iter().find(|a| (a.0, a.1) == ask) {
                    return able;
                }
                let able = self.choose(ask.0, ask.1).is_ok();
                asked.push((ask.0, ask.1, able));
                able
            })
    }

    fn turn(&self, ticket: u64) -> Turn {
        let fair = self.fair();
        let Some(me) = fair.waiting.iter().find(|w| w.ticket == ticket) else {
            return Turn::Bumped;
        };
        let mine = fair.rank(&me.user, me.resumed, me.ticket);
        if self.someone_ahead(&fair, mine) {
            Turn::Behind
        } else {
            Turn::Next
        }
    }

    /// Requests waiting for room now.
    pub fn queued(&self) -> usize {
        self.fair().waiting.len()
    }

    /// The worker a request would get now, without taking its place.
    fn choose(
        &self,
        preferred: Option<&str>,
        exclude: &[String],
    ) -> Result<(Arc<WorkerSlot>, Arc<WorkerConnection>), Pick> {
        let cap = self.config.per_worker_capacity;
        let candidates: Vec<(&Arc<WorkerSlot>, Arc<WorkerConnection>)> = self
            .slots
            .iter()
            .filter(|s| !exclude.contains(&s.addr))
            .filter_map(|s| s.conn().map(|c| (s, c)))
            .collect();
        if candidates.is_empty() {
            return Err(Pick::NoneReady);
        }
        let load = |s: &WorkerSlot| s.in_flight.load(Ordering::SeqCst);
        // The session's worker, unless it is overloaded.
        let sticky = preferred.and_then(|p| {
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

    fn pick(self: &Arc<Self>, user: &str, preferred: Option<&str>, exclude: &[String]) -> Pick {
        let (slot, conn) = match self.choose(preferred, exclude) {
            Ok(c) => c,
            Err(p) => return p,
        };
        // Claim a place; a race with another request can overshoot by one, never more than
        // the callers racing.
        slot.in_flight.fetch_add(1, Ordering::SeqCst);
        let signal = Arc::new(Notify::new());
        let id = {
            let mut fair = self.fair();
            *fair.held.entry(user.to_string()).or_default() += 1;
            let id = fair.next_lease;
            fair.next_lease += 1;
            fair.leases.push(Held {
                id,
                user: user.to_string(),
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
            user: user.to_string(),
            id,
            yield_signal: signal,
        })
    }
}

/// Keeps one worker's health, info and connection current while the pool exists.
async fn poll(pool: std::sync::Weak<WorkerPool>, slot: Arc<WorkerSlot>) {
    let endpoint = match tonic::transport::Endpoint::from_shared(format!("http://{}", slot.addr)) {
        Ok(e) => e
            .connect_timeout(Duration::from_secs(1))
            .timeout(Duration::from_secs(2)),
        Err(e) => {
            tracing::error!(worker = %slot.addr, error = %e, "not a worker address");
            return;
        }
    };
    let mut client = WorkerClient::new(endpoint.connect_lazy());
    let _ = slot.client.set(client.clone());
    loop {
        let Some(p) = pool.upgrade() else { return };
        let interval = p.config.health_interval;
        let was_ready = slot.conn().is_some();
        let outcome = check(&mut client, &slot, p.config.batch)
            .await
            .and_then(|h| {
                if h.engine_stalled {
                    // Alive but stuck: its replies will not move, so it counts as failing.
                    Err("the worker's engine has not finished a step with work waiting".to_string())
                } else {
                    Ok(h.ready)
                }
            });
        {
            let mut st = slot.state();
            match outcome {
                Ok(ready) => {
                    st.ready = ready;
                    // It answers again: what still runs on the old connection may finish.
                    st.suspect = None;
                }
                Err(e) => {
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
                        .is_some_and(|(since, _)| since.elapsed() >= p.config.stall_timeout);
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
            }
        }
        let ready_now = slot.conn().is_some();
        if ready_now != was_ready {
            if ready_now {
                tracing::info!(worker = %slot.addr, "worker ready");
            }
            metrics::gauge!(telemetry::WORKERS_READY).set(p.ready_count() as f64);
            p.room.notify_waiters();
        }
        drop(p);
        tokio::time::sleep(interval).await;
    }
}

/// One health round: `Health`, `Info` the first time, and an open connection.
async fn check(
    client: &mut WorkerClient<tonic::transport::Channel>,
    slot: &WorkerSlot,
    batch: BatchConfig,
) -> Result<proto::HealthResponse, String> {
    let health = client
        .health(proto::HealthRequest {})
        .await
        .map_err(|s| format!("health check failed: {}", s.message()))?
        .into_inner();
    if slot.state().info.is_none() {
        let info = client
            .info(proto::InfoRequest {})
            .await
            .map_err(|s| format!("info failed: {}", s.message()))?
            .into_inner();
        slot.state().info = Some(info);
    }
    let open = slot.state().conn.as_ref().is_some_and(|c| c.is_open());
    if !open && health.ready && !health.engine_stalled {
        let conn = WorkerConnection::connect(&slot.addr, batch)
            .await
            .map_err(|e| e.to_string())?;
        slot.state().conn = Some(Arc::new(conn));
    }
    Ok(health)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_keys_grow_by_doubling_and_a_longer_conversation_shares_them() {
        let turn1: Vec<u32> = (0..40).collect();
        let mut turn2 = turn1.clone();
        turn2.extend(100..200);
        let (k1, k2) = (prefix_keys(&turn1), prefix_keys(&turn2));
        // 16 and 32 tokens fit before turn 1's last token; 64 and 128 also in turn 2's.
        assert_eq!(k1.len(), 2);
        assert_eq!(k2.len(), 4);
        assert_eq!(k2[..2], k1[..]);
        let mut other = turn1.clone();
        other[20] = 999;
        let k3 = prefix_keys(&other);
        assert_eq!(k3[0], k1[0], "the first 16 tokens are the same");
        assert_ne!(k3[1], k1[1]);
        assert!(prefix_keys(&turn1[..16]).is_empty());
    }

    fn pool(max_queue: usize) -> Arc<WorkerPool> {
        WorkerPool::start(
            &[],
            Affinity::local(),
            PoolConfig {
                max_queue,
                ..PoolConfig::default()
            },
        )
    }

    fn users(pool: &WorkerPool) -> Vec<String> {
        pool.fair().waiting.iter().map(|w| w.user.clone()).collect()
    }

    #[tokio::test]
    async fn a_full_queue_is_shared_a_user_with_fewer_waiting_takes_the_newest_place_of_the_most() {
        let p = pool(4);
        let alice: Vec<_> = (0..4)
            .map(|_| QueuePlace::take(&p, "alice", None, &[], false).expect("room"))
            .collect();
        assert!(
            QueuePlace::take(&p, "alice", None, &[], false).is_none(),
            "full"
        );
        let bob1 = QueuePlace::take(&p, "bob", None, &[], false).expect("bob takes a place");
        assert_eq!(users(&p), ["alice", "alice", "alice", "bob"]);
        assert_eq!(
            p.turn(alice[3].ticket),
            Turn::Bumped,
            "alice's newest lost it"
        );
        assert_eq!(p.turn(alice[0].ticket), Turn::Next);
        let bob2 = QueuePlace::take(&p, "bob", None, &[], false).expect("bob again");
        assert_eq!(p.turn(alice[2].ticket), Turn::Bumped);
        // Two each: nobody takes from anybody any more.
        assert!(QueuePlace::take(&p, "bob", None, &[], false).is_none());
        assert!(QueuePlace::take(&p, "alice", None, &[], false).is_none());
        assert_eq!(p.queued(), 4);
        // A bumped place that is dropped gives nothing back twice; a real one frees a place.
        drop(alice);
        assert_eq!(users(&p), ["bob", "bob"]);
        drop((bob1, bob2));
        assert_eq!(p.queued(), 0);
    }

    #[tokio::test]
    async fn the_queue_ranks_users_by_the_places_they_hold_then_by_arrival() {
        let p = pool(8);
        let a1 = QueuePlace::take(&p, "alice", None, &[], false).expect("room");
        let b1 = QueuePlace::take(&p, "bob", None, &[], false).expect("room");
        let mut fair = p.fair();
        assert!(fair.rank("alice", false, a1.ticket) < fair.rank("bob", false, b1.ticket));
        // Alice holds two workers' places, Bob none: Bob goes first although he came later.
        fair.held.insert("alice".to_string(), 2);
        assert!(fair.rank("bob", false, b1.ticket) < fair.rank("alice", false, a1.ticket));
        drop(fair);
        // With no worker ready, nobody can take a place, so nobody stands in anyone's way.
        assert_eq!(p.turn(a1.ticket), Turn::Next);
        assert_eq!(p.turn(b1.ticket), Turn::Next);
    }

    /// Gives `user` a place on `addr` as the queue sees it, with the signal that asks it back.
    fn hold(p: &WorkerPool, user: &str, addr: &str) -> Arc<Notify> {
        let mut fair = p.fair();
        *fair.held.entry(user.to_string()).or_default() += 1;
        let id = fair.next_lease;
        fair.next_lease += 1;
        let signal = Arc::new(Notify::new());
        fair.leases.push(Held {
            id,
            user: user.to_string(),
            addr: addr.to_string(),
            yielding: false,
            signal: signal.clone(),
        });
        signal
    }

    async fn asked(signal: &Notify) -> bool {
        tokio::time::timeout(Duration::from_millis(20), signal.notified())
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn a_user_without_a_place_gets_one_from_the_user_with_the_most() {
        let p = pool(8);
        let alice: Vec<_> = (0..3).map(|_| hold(&p, "alice", "w1")).collect();
        let dave = hold(&p, "dave", "w1");
        // Alice waits too, but she holds places: she asks nobody for one.
        let _a = QueuePlace::take(&p, "alice", None, &[], false).expect("room");
        p.preempt_for("alice", &[]);
        assert!(!asked(&alice[2]).await);
        // Bob holds none: alice's newest place is asked back, once.
        let _b = QueuePlace::take(&p, "bob", None, &[], false).expect("room");
        p.preempt_for("bob", &[]);
        p.preempt_for("bob", &[]);
        assert!(asked(&alice[2]).await, "alice's newest place");
        assert!(!asked(&alice[1]).await && !asked(&alice[0]).await);
        // Carol holds none either: one more of alice's. Not dave's: he holds only one.
        let _c = QueuePlace::take(&p, "carol", None, &[], false).expect("room");
        p.preempt_for("carol", &[]);
        assert!(asked(&alice[1]).await);
        // Erin, a third: alice keeps her last place and dave his only one.
        let _e = QueuePlace::take(&p, "erin", None, &[], false).expect("room");
        p.preempt_for("erin", &[]);
        assert!(!asked(&alice[0]).await && !asked(&dave).await);
        assert_eq!(p.fair().leases.iter().filter(|l| l.yielding).count(), 2);
    }

    #[tokio::test]
    async fn a_place_on_a_worker_the_waiter_cannot_use_is_not_asked_for() {
        let p = pool(8);
        let on_w2 = hold(&p, "alice", "w2");
        let on_w1 = hold(&p, "alice", "w1");
        let _b = QueuePlace::take(&p, "bob", None, &["w1".to_string()], false).expect("room");
        p.preempt_for("bob", &["w1".to_string()]);
        assert!(!asked(&on_w1).await, "bob's reply just failed on w1");
        assert!(asked(&on_w2).await);
    }

    #[tokio::test]
    async fn a_preempted_reply_waits_before_its_users_new_requests_and_past_a_full_queue() {
        let p = pool(1);
        hold(&p, "alice", "w1");
        let new = QueuePlace::take(&p, "alice", None, &[], false).expect("room");
        assert!(
            QueuePlace::take(&p, "alice", None, &[], false).is_none(),
            "full"
        );
        let resumed = QueuePlace::take(&p, "alice", None, &[], true).expect("not bounded");
        let fair = p.fair();
        assert!(
            fair.rank("alice", true, resumed.ticket) < fair.rank("alice", false, new.ticket),
            "the preempted reply goes first"
        );
    }

    #[tokio::test]
    async fn the_longest_known_prefix_key_wins() {
        let a = Affinity::local();
        let keys = prefix_keys(&(0..100).collect::<Vec<u32>>());
        assert_eq!(a.get_last(&keys).await, None);
        a.set(&keys[0], "w1").await;
        a.set(&keys[2], "w2").await;
        assert_eq!(a.get_last(&keys).await.as_deref(), Some("w2"));
        assert_eq!(a.get_last(&keys[..2]).await.as_deref(), Some("w1"));
    }
}
