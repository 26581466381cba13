//! The fair queue of the worker pool, and preemption.
//!
//! Each worker takes at most `capacity` requests at a time from this orchestrator; when every
//! worker is full, requests wait in a bounded queue (`max_queue`, `queue_timeout`) and are then
//! refused, never piled up.
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
//!
//! Within one user (an API key's owner), the end users a client names (OpenAI's `user`) share
//! that user's turn: among one user's new waiting requests, the end user holding the fewest of
//! the user's places goes first. End users never order one user's requests against another's:
//! a user's new requests all stand where its first one arrived. Who is preempted, and whose queue place is taken when
//! the queue is full, is decided between users only.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::pool::{Ask, Pick, PoolError, WorkerPool};
use super::Lease;
use crate::ids::UserId;
use crate::telemetry;

/// Whom a request is for, as the fair queue sees it: a user, and within that user the end user
/// the client named, if any.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Tenant {
    pub user: UserId,
    pub end_user: Option<Arc<str>>,
}

impl Tenant {
    /// `user`'s requests, with no end user named.
    pub fn user(user: &UserId) -> Self {
        Self {
            user: user.clone(),
            end_user: None,
        }
    }

    /// `user`'s requests for the end user `end_user`, if one is named.
    pub fn within(user: &UserId, end_user: Option<&str>) -> Self {
        Self {
            user: user.clone(),
            end_user: end_user.map(Arc::from),
        }
    }
}

/// The queue and the places each user holds, which order it.
#[derive(Debug, Default)]
pub(super) struct Fair {
    next_ticket: u64,
    waiting: Vec<Waiter>,
    /// Workers' places (leases) held per user.
    pub(super) held: HashMap<UserId, usize>,
    /// And per user and end user.
    held_within: HashMap<Tenant, usize>,
    pub(super) next_lease: u64,
    /// Every place held, oldest first.
    pub(super) leases: Vec<Held>,
}

#[derive(Debug)]
struct Waiter {
    ticket: u64,
    tenant: Tenant,
    /// The workers it may take. `ask.resumed`: a preempted reply waiting to continue; it goes
    /// before its user's new requests, and neither the queue's bound nor its timeout applies
    /// to it.
    ask: Ask,
}

/// A place held, as the queue sees it.
#[derive(Debug)]
pub(super) struct Held {
    pub(super) id: u64,
    pub(super) tenant: Tenant,
    pub(super) addr: String,
    /// Asked to give the place up.
    pub(super) yielding: bool,
    pub(super) signal: Arc<Notify>,
}

/// Queue order, one total order: fewest places held by the user, then a preempted reply before
/// new requests; preempted replies then go by arrival, and a user's new requests all stand where
/// its first new request arrived, among them the end user holding the fewest of the user's
/// places first, then arrival. End users thus order a user's own new requests only.
pub(super) type Rank = (usize, bool, u64, usize, u64);

impl Fair {
    /// Each waiting user's first new (not preempted) request's ticket.
    pub(super) fn firsts(&self) -> HashMap<&UserId, u64> {
        let mut m: HashMap<&UserId, u64> = HashMap::new();
        for w in self.waiting.iter().filter(|w| !w.ask.resumed) {
            m.entry(&w.tenant.user)
                .and_modify(|f| *f = (*f).min(w.ticket))
                .or_insert(w.ticket);
        }
        m
    }

    /// The rank of `t`'s request (`resumed`, `ticket`), with the users' first new requests
    /// ([`Fair::firsts`]) made once for many ranks.
    pub(super) fn rank_among(
        &self,
        firsts: &HashMap<&UserId, u64>,
        t: &Tenant,
        resumed: bool,
        ticket: u64,
    ) -> Rank {
        let (place, within) = if resumed {
            (ticket, 0)
        } else {
            let first = firsts.get(&t.user).map_or(ticket, |&f| f.min(ticket));
            (first, self.held_within.get(t).copied().unwrap_or(0))
        };
        (
            self.held.get(&t.user).copied().unwrap_or(0),
            !resumed,
            place,
            within,
            ticket,
        )
    }

    pub(super) fn rank(&self, t: &Tenant, resumed: bool, ticket: u64) -> Rank {
        self.rank_among(&self.firsts(), t, resumed, ticket)
    }

    /// Counts a place `t` took.
    pub(super) fn hold(&mut self, t: &Tenant) {
        *self.held.entry(t.user.clone()).or_default() += 1;
        *self.held_within.entry(t.clone()).or_default() += 1;
    }

    /// Counts a place `t` gave back.
    pub(super) fn release(&mut self, t: &Tenant) {
        fn down<K: std::hash::Hash + Eq>(m: &mut HashMap<K, usize>, k: &K) {
            if let Some(n) = m.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    m.remove(k);
                }
            }
        }
        down(&mut self.held, &t.user);
        down(&mut self.held_within, t);
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
    fn take(pool: &'a WorkerPool, tenant: &Tenant, ask: &Ask) -> Option<Self> {
        let mut fair = pool.fair();
        if !ask.resumed && fair.waiting.len() >= pool.config.max_queue {
            let mut counts: HashMap<&UserId, usize> = HashMap::new();
            for w in fair.waiting.iter().filter(|w| !w.ask.resumed) {
                *counts.entry(&w.tenant.user).or_default() += 1;
            }
            let mine = counts.get(&tenant.user).copied().unwrap_or(0);
            let (most, theirs) = counts
                .into_iter()
                .max_by_key(|&(u, n)| (n, std::cmp::Reverse(u)))?;
            if mine + 1 >= theirs {
                return None;
            }
            let most = most.clone();
            let newest = fair
                .waiting
                .iter()
                .rposition(|w| w.tenant.user == most && !w.ask.resumed)
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
            tenant: tenant.clone(),
            ask: ask.clone(),
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

/// Whether two asks would be given the same worker now.
fn same_workers(a: &Ask, b: &Ask) -> bool {
    (&a.model, &a.preferred, &a.exclude) == (&b.model, &b.preferred, &b.exclude)
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

/// How long a reply under way (preempted, failed over, taken over) waits for a worker to be
/// ready when none is (all restarting, say) before it fails.
const NO_WORKER_PATIENCE: Duration = Duration::from_secs(60);

impl WorkerPool {
    pub(super) async fn wait_for_room(
        self: &Arc<Self>,
        user: &Tenant,
        ask: Ask,
    ) -> Result<Lease, PoolError> {
        // The place in the queue is given back when this future ends in any way, including
        // being dropped while it waits (a client that goes away, a stop).
        let Some(place) = QueuePlace::take(self, user, &ask) else {
            return Err(PoolError::Full);
        };
        let deadline = Instant::now() + self.config.queue_timeout;
        let patience = Instant::now() + NO_WORKER_PATIENCE;
        loop {
            let notified = self.room.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.turn(place.ticket) {
                Turn::Bumped => return Err(PoolError::Full),
                Turn::Behind => {}
                Turn::Next => match self.pick(user, &ask) {
                    Pick::Got(l) => return Ok(l),
                    Pick::NoneReady if !ask.resumed || Instant::now() >= patience => {
                        return Err(PoolError::NoWorker)
                    }
                    Pick::NoneReady => {}
                    Pick::Full => self.preempt_for(&user.user, &ask),
                },
            }
            if ask.resumed {
                // Looked at again now and then too: a worker's coming back is one notice.
                let _ = tokio::time::timeout(Duration::from_secs(1), notified).await;
            } else if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(PoolError::Full);
            }
        }
    }

    /// When `user` holds no place and waits with every worker full, asks the user with the
    /// most places (at least two, not counting those already asked) to give their newest up,
    /// on a worker `user` may use (one serving its model, not excluded). One place is asked
    /// for each waiting user who holds none, and the freed place goes to the first of them in
    /// queue order.
    fn preempt_for(&self, user: &UserId, ask: &Ask) {
        let mut fair = self.fair();
        if fair.held.contains_key(user) {
            return;
        }
        let starving: std::collections::HashSet<&UserId> = fair
            .waiting
            .iter()
            .filter(|w| !w.ask.resumed && !fair.held.contains_key(&w.tenant.user))
            .map(|w| &w.tenant.user)
            .collect();
        let asked = fair.leases.iter().filter(|l| l.yielding).count();
        if starving.len() <= asked {
            return;
        }
        let mut keeps: HashMap<&UserId, usize> = HashMap::new();
        for l in fair.leases.iter().filter(|l| !l.yielding) {
            *keeps.entry(&l.tenant.user).or_default() += 1;
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
        let victim = victim.clone();
        let newest = fair.leases.iter_mut().rev().find(|l| {
            l.tenant.user == victim
                && !l.yielding
                && !ask.exclude.iter().any(|e| e.addr == l.addr)
                && self.usable(&l.addr, ask)
        });
        if let Some(l) = newest {
            l.yielding = true;
            l.signal.notify_one();
            metrics::counter!(telemetry::PREEMPTIONS).increment(1);
        }
    }

    pub(super) fn fair(&self) -> std::sync::MutexGuard<'_, Fair> {
        self.fair.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a waiting request ranked before `rank` could take a worker's place now, on a
    /// worker `mine` could use too: a request for another model never holds this one up.
    pub(super) fn someone_ahead(&self, fair: &Fair, rank: Rank, mine: &Ask) -> bool {
        // Most waiting requests ask for the same workers: try each distinct ask once.
        let mut asked: Vec<(&Ask, bool)> = Vec::new();
        let firsts = fair.firsts();
        fair.waiting
            .iter()
            .filter(|w| fair.rank_among(&firsts, &w.tenant, w.ask.resumed, w.ticket) < rank)
            .any(|w| {
                if let Some(&(_, able)) = asked.iter().find(|a| same_workers(a.0, &w.ask)) {
                    return able;
                }
                let able = self
                    .choose(&w.ask)
                    .is_ok_and(|(slot, _)| self.usable(&slot.addr, mine));
                asked.push((&w.ask, able));
                able
            })
    }

    /// Whether the worker at `addr` serves what `ask` needs.
    fn usable(&self, addr: &str, ask: &Ask) -> bool {
        let Some(model) = &ask.model else {
            return true;
        };
        self.slots()
            .iter()
            .any(|s| s.addr == addr && s.serves(model))
    }

    fn turn(&self, ticket: u64) -> Turn {
        let fair = self.fair();
        let Some(me) = fair.waiting.iter().find(|w| w.ticket == ticket) else {
            return Turn::Bumped;
        };
        let mine = fair.rank(&me.tenant, me.ask.resumed, me.ticket);
        if self.someone_ahead(&fair, mine, &me.ask) {
            Turn::Behind
        } else {
            Turn::Next
        }
    }

    /// Requests waiting for room now.
    pub fn queued(&self) -> usize {
        self.fair().waiting.len()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::workers::{Affinity, PoolConfig};

    fn resumed_ask() -> Ask {
        Ask {
            resumed: true,
            ..Ask::default()
        }
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

    /// The user called `name` in a test: alice, bob, carol, dave and erin sort by name.
    fn user(name: &str) -> UserId {
        let n = ["alice", "bob", "carol", "dave", "erin"]
            .iter()
            .position(|&u| u == name)
            .expect("a test user");
        UserId::parse(&format!("{:032x}", n + 1)).expect("an id")
    }

    fn tenant(name: &str) -> Tenant {
        Tenant::user(&user(name))
    }

    fn users(pool: &WorkerPool) -> Vec<UserId> {
        pool.fair()
            .waiting
            .iter()
            .map(|w| w.tenant.user.clone())
            .collect()
    }

    #[tokio::test]
    async fn a_full_queue_is_shared_a_user_with_fewer_waiting_takes_the_newest_place_of_the_most() {
        let p = pool(4);
        let alice: Vec<_> = (0..4)
            .map(|_| QueuePlace::take(&p, &tenant("alice"), &Ask::default()).expect("room"))
            .collect();
        assert!(
            QueuePlace::take(&p, &tenant("alice"), &Ask::default()).is_none(),
            "full"
        );
        let bob1 =
            QueuePlace::take(&p, &tenant("bob"), &Ask::default()).expect("bob takes a place");
        assert_eq!(
            users(&p),
            [user("alice"), user("alice"), user("alice"), user("bob")]
        );
        assert_eq!(
            p.turn(alice[3].ticket),
            Turn::Bumped,
            "alice's newest lost it"
        );
        assert_eq!(p.turn(alice[0].ticket), Turn::Next);
        let bob2 = QueuePlace::take(&p, &tenant("bob"), &Ask::default()).expect("bob again");
        assert_eq!(p.turn(alice[2].ticket), Turn::Bumped);
        // Two each: nobody takes from anybody any more.
        assert!(QueuePlace::take(&p, &tenant("bob"), &Ask::default()).is_none());
        assert!(QueuePlace::take(&p, &tenant("alice"), &Ask::default()).is_none());
        assert_eq!(p.queued(), 4);
        // A bumped place that is dropped gives nothing back twice; a real one frees a place.
        drop(alice);
        assert_eq!(users(&p), [user("bob"), user("bob")]);
        drop((bob1, bob2));
        assert_eq!(p.queued(), 0);
    }

    #[tokio::test]
    async fn the_queue_ranks_users_by_the_places_they_hold_then_by_arrival() {
        let p = pool(8);
        let a1 = QueuePlace::take(&p, &tenant("alice"), &Ask::default()).expect("room");
        let b1 = QueuePlace::take(&p, &tenant("bob"), &Ask::default()).expect("room");
        let mut fair = p.fair();
        assert!(
            fair.rank(&tenant("alice"), false, a1.ticket)
                < fair.rank(&tenant("bob"), false, b1.ticket)
        );
        // Alice holds two workers' places, Bob none: Bob goes first although he came later.
        fair.held.insert(user("alice"), 2);
        assert!(
            fair.rank(&tenant("bob"), false, b1.ticket)
                < fair.rank(&tenant("alice"), false, a1.ticket)
        );
        drop(fair);
        // With no worker ready, nobody can take a place, so nobody stands in anyone's way.
        assert_eq!(p.turn(a1.ticket), Turn::Next);
        assert_eq!(p.turn(b1.ticket), Turn::Next);
    }

    #[tokio::test]
    async fn within_a_user_the_end_user_with_fewer_places_goes_first() {
        let p = pool(8);
        let alice = user("alice");
        let (ann, bo) = (
            Tenant::within(&alice, Some("ann")),
            Tenant::within(&alice, Some("bo")),
        );
        let a = QueuePlace::take(&p, &ann, &Ask::default()).expect("room");
        let b = QueuePlace::take(&p, &bo, &Ask::default()).expect("room");
        let mut fair = p.fair();
        assert!(fair.rank(&ann, false, a.ticket) < fair.rank(&bo, false, b.ticket));
        // Ann holds two of alice's places, Bo none: Bo goes first among alice's requests.
        fair.hold(&ann);
        fair.hold(&ann);
        assert!(fair.rank(&bo, false, b.ticket) < fair.rank(&ann, false, a.ticket));
        // Between users the end users do not count: bob, holding nothing, goes before both.
        let bob = tenant("bob");
        fair.release(&ann);
        fair.hold(&Tenant::within(&alice, Some("bo")));
        assert!(fair.rank(&bob, false, u64::MAX) < fair.rank(&bo, false, b.ticket));
        fair.release(&ann);
        fair.release(&bo);
        assert!(
            fair.held.is_empty() && fair.held_within.is_empty(),
            "all given back"
        );
    }

    #[tokio::test]
    async fn end_users_never_move_their_user_ahead_of_another() {
        let p = pool(8);
        let alice = user("alice");
        let b = QueuePlace::take(&p, &tenant("bob"), &Ask::default()).expect("room");
        let zed = Tenant::within(&alice, Some("zed"));
        let z = QueuePlace::take(&p, &zed, &Ask::default()).expect("room");
        let ann = Tenant::within(&alice, Some("ann"));
        let a = QueuePlace::take(&p, &ann, &resumed_ask()).expect("room");
        let mut fair = p.fair();
        // Alice and bob hold two places each; bob's request came first, so it goes first,
        // whatever end user alice's request names.
        fair.hold(&ann);
        fair.hold(&ann);
        fair.hold(&tenant("bob"));
        fair.hold(&tenant("bob"));
        assert!(fair.rank(&tenant("bob"), false, b.ticket) < fair.rank(&zed, false, z.ticket));
        // Within alice, ann's preempted reply goes before zed's new request, although ann holds
        // more of alice's places.
        assert!(fair.rank(&ann, true, a.ticket) < fair.rank(&zed, false, z.ticket));
        drop(fair);
        assert_eq!(p.turn(b.ticket), Turn::Next);
    }

    /// Gives `user` a place on `addr` as the queue sees it, with the signal that asks it back.
    fn hold(p: &WorkerPool, user: &UserId, addr: &str) -> Arc<Notify> {
        let mut fair = p.fair();
        fair.hold(&Tenant::user(user));
        let id = fair.next_lease;
        fair.next_lease += 1;
        let signal = Arc::new(Notify::new());
        fair.leases.push(Held {
            id,
            tenant: Tenant::user(user),
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
        let alice: Vec<_> = (0..3).map(|_| hold(&p, &user("alice"), "w1")).collect();
        let dave = hold(&p, &user("dave"), "w1");
        // Alice waits too, but she holds places: she asks nobody for one.
        let _a = QueuePlace::take(&p, &tenant("alice"), &Ask::default()).expect("room");
        p.preempt_for(&user("alice"), &Ask::default());
        assert!(!asked(&alice[2]).await);
        // Bob holds none: alice's newest place is asked back, once.
        let _b = QueuePlace::take(&p, &tenant("bob"), &Ask::default()).expect("room");
        p.preempt_for(&user("bob"), &Ask::default());
        p.preempt_for(&user("bob"), &Ask::default());
        assert!(asked(&alice[2]).await, "alice's newest place");
        assert!(!asked(&alice[1]).await && !asked(&alice[0]).await);
        // Carol holds none either: one more of alice's. Not dave's: he holds only one.
        let _c = QueuePlace::take(&p, &tenant("carol"), &Ask::default()).expect("room");
        p.preempt_for(&user("carol"), &Ask::default());
        assert!(asked(&alice[1]).await);
        // Erin, a third: alice keeps her last place and dave his only one.
        let _e = QueuePlace::take(&p, &tenant("erin"), &Ask::default()).expect("room");
        p.preempt_for(&user("erin"), &Ask::default());
        assert!(!asked(&alice[0]).await && !asked(&dave).await);
        assert_eq!(p.fair().leases.iter().filter(|l| l.yielding).count(), 2);
    }

    #[tokio::test]
    async fn a_place_on_a_worker_the_waiter_cannot_use_is_not_asked_for() {
        let p = pool(8);
        let on_w2 = hold(&p, &user("alice"), "w2");
        let on_w1 = hold(&p, &user("alice"), "w1");
        let _b = QueuePlace::take(
            &p,
            &tenant("bob"),
            &Ask {
                exclude: vec![crate::workers::Excluded {
                    addr: "w1".into(),
                    serial: 0,
                }],
                ..Ask::default()
            },
        )
        .expect("room");
        p.preempt_for(
            &user("bob"),
            &Ask {
                exclude: vec![crate::workers::Excluded {
                    addr: "w1".into(),
                    serial: 0,
                }],
                ..Ask::default()
            },
        );
        assert!(!asked(&on_w1).await, "bob's reply just failed on w1");
        assert!(asked(&on_w2).await);
    }

    #[tokio::test]
    async fn a_preempted_reply_waits_before_its_users_new_requests_and_past_a_full_queue() {
        let p = pool(1);
        hold(&p, &user("alice"), "w1");
        let new = QueuePlace::take(&p, &tenant("alice"), &Ask::default()).expect("room");
        assert!(
            QueuePlace::take(&p, &tenant("alice"), &Ask::default()).is_none(),
            "full"
        );
        let resumed = QueuePlace::take(&p, &tenant("alice"), &resumed_ask()).expect("not bounded");
        let fair = p.fair();
        assert!(
            fair.rank(&tenant("alice"), true, resumed.ticket)
                < fair.rank(&tenant("alice"), false, new.ticket),
            "the preempted reply goes first"
        );
    }
}
