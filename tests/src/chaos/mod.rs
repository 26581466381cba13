//! A seeded chaos run against the whole stack, and the history checker that judges it.
//!
//! [`cluster`] starts PostgreSQL, Redis, orchestrator replicas and workers, each of which can be
//! killed, stopped or cut off; [`client`] is a client that chats through whichever replica it
//! picks and resumes what breaks; [`faults`] is the storm, drawn from the run's seed; and
//! [`check`] compares what every client received with what the database stored. [`run`] puts
//! them together: the same seed (`HEARTH_CHAOS_SEED`) draws the same faults and the same
//! clients' choices again.

pub mod check;
pub mod client;
pub mod cluster;
pub mod faults;

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::{watch, Mutex};
use tokio::time::Instant;

use crate::http::Req;
use check::{next_token_delays, quantile, Stored, Verdict};
use client::{ClientLog, Plan};
use cluster::{Cluster, Shape};
use faults::{Fault, Storm};

/// The environment variable that replays a run.
pub const SEED_VAR: &str = "HEARTH_CHAOS_SEED";

/// A chaos run.
#[derive(Debug, Clone)]
pub struct Config {
    pub shape: Shape,
    pub clients: usize,
    pub plan: Plan,
    pub storm: Storm,
    pub seed: u64,
}

/// What a run did and what the checker found.
#[derive(Debug)]
pub struct Report {
    pub seed: u64,
    pub verdict: Verdict,
    pub faults: Vec<Fault>,
    /// For each fault, each turn under way: seconds to its client's next token.
    pub delays: Vec<f64>,
    pub took: Duration,
}

impl Report {
    /// The delays of the turns a fault held up (next token more than a second after it).
    pub fn held_up(&self) -> Vec<f64> {
        self.delays.iter().copied().filter(|d| *d > 1.0).collect()
    }

    pub fn to_json(&self) -> Value {
        let held = self.held_up();
        json!({
            "seed": format!("{:#x}", self.seed),
            "took_s": self.took.as_secs_f64(),
            "verdict": self.verdict.to_json(),
            "next_token_after_fault_s": {
                "all": {"n": self.delays.len(), "p50": quantile(&self.delays, 0.5),
                        "p99": quantile(&self.delays, 0.99)},
                "held_up": {"n": held.len(), "p50": quantile(&held, 0.5),
                            "p99": quantile(&held, 0.99)},
            },
            "faults": self.faults.iter().map(|f| json!({
                "at_s": f.at.as_secs_f64(), "until_s": f.until.as_secs_f64(), "what": f.what,
            })).collect::<Vec<_>>(),
            "notes": self.verdict.notes,
        })
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = &self.verdict;
        let held = self.held_up();
        writeln!(
            f,
            "chaos: seed {:#x} ({SEED_VAR}={:#x} replays it), {:.0} s",
            self.seed,
            self.seed,
            self.took.as_secs_f64()
        )?;
        writeln!(
            f,
            "  {} turns, {} faults; lost {}, stored as error {}, not complete {}, text differs \
             {}, duplicated {}, id gaps {}, repeats {}, error events {}, left waiting {}, told \
             stream lost {}, read from the history {}",
            v.turns,
            v.faults,
            v.lost,
            v.stored_error,
            v.not_complete,
            v.differ,
            v.duplicated,
            v.gaps,
            v.repeats,
            v.client_errors,
            v.left_waiting,
            v.stream_lost,
            v.read_stored
        )?;
        writeln!(
            f,
            "  next token after a fault: p50 {:.2} s, p99 {:.2} s over {} turns under way; held \
             up (> 1 s): {} turns, p50 {:.2} s, p99 {:.2} s; longest wait {:.1} s ({:.1} s after \
             the last fault)",
            quantile(&self.delays, 0.5),
            quantile(&self.delays, 0.99),
            self.delays.len(),
            held.len(),
            quantile(&held, 0.5),
            quantile(&held, 0.99),
            v.longest_wait.as_secs_f64(),
            v.longest_wait_after_faults.as_secs_f64()
        )?;
        for n in &v.notes {
            writeln!(f, "  ! {n}")?;
        }
        Ok(())
    }
}

/// The run's seed: `HEARTH_CHAOS_SEED` (decimal or `0x` hex) when set, else `default`.
pub fn seed_or(default: u64) -> u64 {
    match std::env::var(SEED_VAR) {
        Ok(v) => {
            let v = v.trim().replace('_', "");
            let parsed = match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16).ok(),
                None => v.parse().ok(),
            };
            parsed.unwrap_or_else(|| panic!("{SEED_VAR}={v:?} is not a number"))
        }
        Err(_) => default,
    }
}

/// Starts the cluster, runs the clients through the storm, heals everything, lets the replies
/// settle, and checks the history.
pub async fn run(config: Config) -> Report {
    let began = std::time::Instant::now();
    let cluster = Cluster::start(config.shape.clone()).await;
    let keys = keys(&cluster.db_url, config.clients).await;
    let replicas = cluster.replica_addrs();
    let cluster = Arc::new(Mutex::new(cluster));
    let start = Instant::now();
    let (done_tx, done) = watch::channel(false);
    let storm = tokio::spawn(faults::storm(
        cluster.clone(),
        config.storm.clone(),
        config.seed,
        start,
        done,
    ));
    let clients: Vec<_> = keys
        .iter()
        .enumerate()
        .map(|(i, key)| {
            tokio::spawn(client::run(
                i,
                key.clone(),
                replicas.clone(),
                config.seed ^ (0x9E37_79B9 + i as u64),
                start,
                config.plan.clone(),
            ))
        })
        .collect();
    let mut logs: Vec<ClientLog> = Vec::new();
    for c in clients {
        logs.push(c.await.expect("a client"));
    }
    let _ = done_tx.send(true);
    let faults = storm.await.expect("the storm");
    cluster.lock().await.heal().await;
    let stored = settled_history(&cluster, &logs).await;
    let mut verdict = check::check(&logs, &stored, &faults);
    verdict.faults = faults.len();
    Report {
        seed: config.seed,
        delays: next_token_delays(&logs, &faults),
        verdict,
        faults,
        took: began.elapsed(),
    }
}

/// One key for each client.
async fn keys(db_url: &str, n: usize) -> Vec<String> {
    let store = hearth_orchestrator::storage::SqlStore::connect(db_url)
        .await
        .expect("the run's database");
    let mut keys = Vec::new();
    for i in 0..n {
        let issued = hearth_orchestrator::auth::issue_key(
            &store,
            &format!("chaos-{i}"),
            hearth_orchestrator::auth::KeyOptions::default(),
        )
        .await
        .expect("a key");
        keys.push(issued.key);
    }
    store.close().await;
    keys
}

/// Every client's session as stored, once no reply streams any more (or a minute passed).
async fn settled_history(cluster: &Arc<Mutex<Cluster>>, logs: &[ClientLog]) -> Vec<Stored> {
    let replica = {
        let c = cluster.lock().await;
        for i in 0..c.replicas() {
            c.wait_ready(i, Duration::from_secs(60)).await;
        }
        c.replica_addrs()[0]
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut all = Vec::new();
        for l in logs {
            all.push(history(replica, &l.key, &l.session_id).await);
        }
        let streaming = all
            .iter()
            .flatten()
            .any(|(_, _, status)| status == "streaming");
        if !streaming || Instant::now() >= deadline {
            return all;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn history(addr: std::net::SocketAddr, key: &str, sid: &str) -> Stored {
    let path = format!("/v1/sessions/{sid}/messages?limit=1000");
    let r = Req::new("GET", &path).key(Some(key)).send(addr).await;
    assert_eq!(r.status, 200, "history of {sid}: {}", r.text());
    r.json()["data"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|m| {
            let s = |k: &str| m[k].as_str().unwrap_or_default().to_string();
            (s("role"), s("content"), s("status"))
        })
        .collect()
}
