//! Workers found by DNS (`--worker dns:NAME:PORT`): every A and AAAA record of NAME is a worker
//! at PORT. A task looks every name up each `refresh`, and at once when a worker stops
//! answering (its replacement may be listed already). An address that appears gets a slot in
//! the pool, as a `--worker` address does at start-up; one that vanishes leaves routing at
//! once, and the replies running on it fail over to other workers.
//!
//! DNS trouble does not empty the pool: a look-up that fails (a timeout, SERVFAIL, a refused
//! query) keeps the workers last found, and an empty answer (NXDOMAIN, or the name without
//! addresses) removes a name's workers only when the next look-up is empty too.
//!
//! [`state`] holds what is known and works out the changes (plain code, tested alone);
//! [`resolve`] asks DNS.

mod resolve;
mod state;

use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;

use hearth_shared::worker_auth::WorkerToken;
use hickory_resolver::net::NetError;
use sha2::{Digest, Sha256};
use tokio::sync::Notify;

use super::pool::WorkerPool;
use resolve::Lookups;
use state::{Changes, Discovered, Note};

/// How a `--worker` argument names workers to find by DNS.
pub const DNS_PREFIX: &str = "dns:";

/// A `--worker dns:NAME:PORT`: a worker at `port` on every address `name` resolves to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsWorkers {
    /// As given; a final dot (`svc.cluster.local.`) skips the resolver's search domains.
    pub name: String,
    pub port: u16,
}

impl DnsWorkers {
    /// Reads `dns:NAME:PORT`; `None` when `arg` is not a `dns:` worker, else the workers or why
    /// they are refused.
    pub fn parse(arg: &str) -> Option<Result<Self, &'static str>> {
        let spec = arg.strip_prefix(DNS_PREFIX)?;
        let Some((name, port)) = spec.rsplit_once(':') else {
            return Some(Err("expected dns:NAME:PORT"));
        };
        let port = match port.parse::<u16>() {
            Ok(p) if p > 0 => p,
            _ => {
                return Some(Err(
                    "the port must be a number from 1 to 65535 (dns:NAME:PORT)",
                ))
            }
        };
        Some(check_name(name).map(|()| Self {
            name: name.to_string(),
            port,
        }))
    }
}

/// A DNS name: dot-separated labels of 1-63 letters, digits, `-` or `_`, 253 bytes at most,
/// perhaps with a final dot; not an IP address.
fn check_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("no name to look up (dns:NAME:PORT)");
    }
    if name.parse::<std::net::IpAddr>().is_ok() || name.starts_with('[') {
        return Err("an IP address needs no DNS: give it as IP:PORT");
    }
    let bare = name.strip_suffix('.').unwrap_or(name);
    let label_ok = |l: &str| {
        (1..=63).contains(&l.len())
            && l.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if bare.len() > 253 || !bare.split('.').all(label_ok) {
        return Err("not a DNS name (labels of letters, digits, '-' or '_', joined by dots)");
    }
    Ok(())
}

/// Where workers are found by DNS, and how often they are looked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Discovery {
    pub names: Vec<DnsWorkers>,
    /// How long after a look-up every name is looked up again (`--dns-refresh-secs`).
    pub refresh: Duration,
    /// The one server to ask, over UDP and TCP (`--dns-server`); none: the system's resolvers.
    pub server: Option<SocketAddr>,
}

/// Starts finding `discovery`'s workers for `pool`, whose fixed `--worker` addresses are
/// `fixed` (a name that lists one leaves it to its own slot). The task ends with the pool.
/// Fails only when the system's resolver configuration cannot be read.
pub fn discover(
    pool: &Arc<WorkerPool>,
    fixed: &[String],
    discovery: Discovery,
) -> Result<(), NetError> {
    let lookups = Lookups::new(discovery.server)?;
    let known = Discovered::new(&discovery.names, fixed);
    let lost = pool.lost.clone();
    tokio::spawn(discovery_task(
        Arc::downgrade(pool),
        lost,
        lookups,
        discovery,
        known,
    ));
    Ok(())
}

/// Looks every name up, brings the pool in line, and waits for the next round.
async fn discovery_task(
    pool: Weak<WorkerPool>,
    lost: Arc<Notify>,
    lookups: Lookups,
    discovery: Discovery,
    mut known: Discovered,
) {
    loop {
        for (i, dns) in discovery.names.iter().enumerate() {
            let answer = lookups.answer(&dns.name).await;
            if let Some(note) = known.answer(i, answer) {
                log_note(&dns.name, note);
            }
        }
        // Not held while waiting, so that the pool (and this task) can end.
        let Some(p) = pool.upgrade() else { return };
        apply(&p, known.changes());
        drop(p);
        tokio::select! {
            () = tokio::time::sleep(discovery.refresh) => {}
            () = lost.notified() => {
                tracing::debug!("a worker stopped answering; looking the names up again");
            }
        }
    }
}

fn log_note(name: &str, note: Note) {
    match note {
        Note::Failed(e) => {
            tracing::warn!(dns = %name, error = %e, "DNS look-up failed; keeping the workers last found");
        }
        Note::PartlyFailed(e) => {
            tracing::warn!(dns = %name, error = %e, "DNS look-up half failed; keeping that record type's workers last found");
        }
        Note::EmptyOnce => {
            tracing::info!(dns = %name, "DNS lists no worker; its workers stay unless the next look-up agrees");
        }
        Note::Emptied => {
            tracing::warn!(dns = %name, "DNS listed no worker twice in a row; removing its workers");
        }
    }
}

/// Adds and removes the pool's discovered workers.
fn apply(pool: &Arc<WorkerPool>, changes: Changes) {
    for (addr, name) in changes.removed {
        tracing::info!(dns = %name, worker = %addr, "worker gone from DNS; its replies move to other workers");
        pool.remove_worker(&addr, &format!("the worker left the DNS answer for {name}"));
    }
    for (addr, name) in changes.added {
        tracing::info!(dns = %name, worker = %addr, "worker found by DNS");
        let public = public_name(&addr, pool.config.token.as_ref());
        let server_name = Arc::from(name.strip_suffix('.').unwrap_or(&name));
        pool.add_worker(addr, public, server_name);
    }
}

/// A discovered worker's public name (see [`super::health::WorkerSlot::name`]): `worker-` and
/// 8 hex digits of its address hashed with the worker token. Every replica names it alike, and
/// the name does not give the address away (a bare hash of a private address is soon guessed).
fn public_name(addr: &str, token: Option<&WorkerToken>) -> String {
    let mut h = Sha256::new();
    h.update(token.map_or("", |t| t.expose()).as_bytes());
    h.update([0]);
    h.update(addr.as_bytes());
    let digest = h.finalize();
    let hex: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
    format!("worker-{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_workers_parse_and_bad_ones_say_why() {
        assert_eq!(DnsWorkers::parse("w0:50051"), None, "not a dns: worker");
        let ok = DnsWorkers::parse("dns:hearth-worker.hearth.svc.cluster.local.:50051");
        assert_eq!(
            ok,
            Some(Ok(DnsWorkers {
                name: "hearth-worker.hearth.svc.cluster.local.".to_string(),
                port: 50051,
            }))
        );
        for (bad, why) in [
            ("dns:", "expected dns:NAME:PORT"),
            ("dns:workers", "expected dns:NAME:PORT"),
            ("dns::50051", "no name"),
            ("dns:workers:", "port"),
            ("dns:workers:0", "port"),
            ("dns:workers:70000", "port"),
            ("dns:workers:http", "port"),
            ("dns:10.0.0.1:50051", "IP address"),
            ("dns:[::1]:50051", "IP address"),
            ("dns:work ers:50051", "not a DNS name"),
            ("dns:a..b:50051", "not a DNS name"),
        ] {
            let got = DnsWorkers::parse(bad).expect("a dns: worker");
            let e = got.expect_err(bad);
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn public_names_are_stable_and_keyed_by_the_token() {
        let token = WorkerToken::new("hearth-test-worker-token-0123456789").expect("token");
        let a = public_name("10.0.0.1:50051", Some(&token));
        assert_eq!(a, public_name("10.0.0.1:50051", Some(&token)));
        assert_eq!(a.len(), "worker-".len() + 8);
        assert!(!a.contains("10.0.0.1"));
        assert_ne!(a, public_name("10.0.0.2:50051", Some(&token)));
        assert_ne!(a, public_name("10.0.0.1:50051", None));
    }
}
