//! The fault storm: every `every`, from the run's seed, one fault among `kill -9` of a replica
//! or a worker (started again 2 s later), `SIGSTOP` of one for 1 to 4 s, and a 5 s cut between
//! one replica and PostgreSQL or Redis; plus, at set points of the run, a restart of Redis (it
//! keeps nothing) and of PostgreSQL. Faults overlap, but at least one replica and one worker are
//! left alone at any time, as a deployment that survives needs.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{watch, Mutex};
use tokio::time::Instant;

use super::cluster::{Cluster, Link, Proc};
use crate::rng::Rng;

/// One fault as it happened.
#[derive(Debug, Clone)]
pub struct Fault {
    /// When it began and ended, since the run began.
    pub at: Duration,
    pub until: Duration,
    pub what: String,
}

/// How the storm goes.
#[derive(Debug, Clone)]
pub struct Storm {
    pub every: Duration,
    /// Restart Redis at the fault with this index (0-based), and PostgreSQL at that one.
    pub redis_restart_at: Option<usize>,
    pub pg_restart_at: Option<usize>,
}

/// A fault's kind, as drawn.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Kill(Proc),
    Stop(Proc, Duration),
    Cut(usize, Link),
    RestartRedis,
    RestartPostgres,
}

/// The processes a fault holds now, so that another one leaves them alone.
type Held = Arc<std::sync::Mutex<HashSet<Proc>>>;

/// Breaks things until `done` turns true; returns every fault, each once it is over.
pub async fn storm(
    cluster: Arc<Mutex<Cluster>>,
    plan: Storm,
    seed: u64,
    start: Instant,
    mut done: watch::Receiver<bool>,
) -> Vec<Fault> {
    let mut rng = Rng::new(seed);
    let held: Held = Arc::default();
    let (replicas, workers) = {
        let c = cluster.lock().await;
        (c.replicas(), c.workers())
    };
    let mut running = Vec::new();
    let mut n = 0;
    loop {
        tokio::select! {
            () = tokio::time::sleep(plan.every) => {}
            _ = done.wait_for(|d| *d) => break,
        }
        let kind = if plan.redis_restart_at == Some(n) {
            Kind::RestartRedis
        } else if plan.pg_restart_at == Some(n) {
            Kind::RestartPostgres
        } else {
            match draw(&mut rng, &held, replicas, workers) {
                Some(k) => k,
                None => continue,
            }
        };
        n += 1;
        running.push(tokio::spawn(inflict(
            cluster.clone(),
            held.clone(),
            kind,
            start,
        )));
    }
    let mut faults = Vec::new();
    for r in running {
        if let Ok(f) = r.await {
            faults.push(f);
        }
    }
    faults.sort_by_key(|f| f.at);
    faults
}

/// A fault on a process no other fault holds, leaving one replica and one worker alone.
fn draw(rng: &mut Rng, held: &Held, replicas: usize, workers: usize) -> Option<Kind> {
    let mut h = held.lock().unwrap_or_else(|p| p.into_inner());
    let free = |kind: fn(usize) -> Proc, n: usize, h: &HashSet<Proc>| -> Vec<Proc> {
        (0..n).map(kind).filter(|p| !h.contains(p)).collect()
    };
    let free_replicas = free(Proc::Replica, replicas, &h);
    let free_workers = free(Proc::Worker, workers, &h);
    let mut targets = Vec::new();
    if free_replicas.len() > 1 {
        targets.extend(free_replicas.iter().copied());
    }
    if free_workers.len() > 1 {
        targets.extend(free_workers.iter().copied());
    }
    if targets.is_empty() {
        return None;
    }
    let target = *rng.pick(&targets);
    h.insert(target);
    let roll = rng.below(100);
    Some(match target {
        Proc::Replica(i) if roll >= 70 => {
            let link = if rng.chance(50) {
                Link::Postgres
            } else {
                Link::Redis
            };
            Kind::Cut(i, link)
        }
        p if roll >= 45 => Kind::Stop(p, Duration::from_millis(rng.range(1000, 4000) as u64)),
        p => Kind::Kill(p),
    })
}

/// Applies one fault, waits it out, and undoes it.
async fn inflict(cluster: Arc<Mutex<Cluster>>, held: Held, kind: Kind, start: Instant) -> Fault {
    let at = start.elapsed();
    let (what, proc) = match kind {
        Kind::Kill(p) => {
            cluster.lock().await.kill(p);
            tokio::time::sleep(Duration::from_secs(2)).await;
            cluster.lock().await.start_proc(p).await;
            (format!("kill -9 {p}"), Some(p))
        }
        Kind::Stop(p, d) => {
            cluster.lock().await.pause(p, true);
            tokio::time::sleep(d).await;
            cluster.lock().await.pause(p, false);
            (format!("SIGSTOP {p} for {:.1} s", d.as_secs_f64()), Some(p))
        }
        Kind::Cut(i, link) => {
            cluster.lock().await.cut(i, link, true);
            tokio::time::sleep(Duration::from_secs(5)).await;
            cluster.lock().await.cut(i, link, false);
            (
                format!("cut replica {i} from {link:?} for 5 s"),
                Some(Proc::Replica(i)),
            )
        }
        Kind::RestartRedis => {
            let mut c = cluster.lock().await;
            c.restart_redis(Duration::from_secs(1)).await;
            ("restart Redis".to_string(), None)
        }
        Kind::RestartPostgres => {
            let mut c = cluster.lock().await;
            c.restart_pg(Duration::from_secs(1)).await;
            ("restart PostgreSQL".to_string(), None)
        }
    };
    if let Some(p) = proc {
        held.lock().unwrap_or_else(|p| p.into_inner()).remove(&p);
    }
    Fault {
        at,
        until: start.elapsed(),
        what,
    }
}
