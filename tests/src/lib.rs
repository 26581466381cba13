//! Whole-stack tests and the `hearth-bench` load generator.
//!
//! The library holds what the tests share: [`stack`] starts real `hearth-worker` and `hearth`
//! processes on loopback ports over a real database and talks to them the way the tests do
//! (sessions, turns, streamed replies, metrics, waits); [`http`] is a small HTTP/1.1 and SSE
//! client over real sockets; [`pg`] gives each test a PostgreSQL database of its own, or a whole
//! server it may stop; [`redis`] is a Redis a test may stop; [`prometheus`] runs a real Prometheus
//! for the deploy/ dashboard test; [`tls`] makes a test's own certificate authority for servers
//! with TLS on; [`proxy`] is a TCP proxy a test can cut; [`otlp`] is an OTLP/gRPC trace receiver
//! that keeps what it is sent; [`chaos`] is the seeded chaos run and
//! its history checker (`make chaos`); and [`rng`] is the tests' one seeded random source
//! (`HEARTH_TEST_SEED` replays a run). The tests are in `tests/tests/`; the engine's own tests are
//! in `gpu-worker/tests`. [`bench`] is the `hearth-bench` load generator.

pub mod bench;
pub mod chaos;
pub mod client;
pub mod http;
pub mod otlp;
pub mod pg;
pub mod prometheus;
pub mod proxy;
pub mod redis;
pub mod rng;
pub mod stack;
pub mod tls;

/// A loopback port that was free a moment ago, for a server the test starts itself. It is
/// drawn at random below the kernel's ephemeral range, where no socket bound to port 0 (every
/// other test's clients and servers, and other processes') can take it before the server binds
/// it; only another draw can, and draws rarely meet.
pub fn free_port() -> u16 {
    use std::hash::BuildHasher;
    let floor = ephemeral_floor();
    if floor <= FREE_PORTS_FROM + 1_000 {
        // No room below the ephemeral range: take one from it.
        return std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
    }
    let span = u64::from(floor - FREE_PORTS_FROM);
    let draws = std::collections::hash_map::RandomState::new();
    for i in 0..10_000u64 {
        let port = FREE_PORTS_FROM + (draws.hash_one((i, std::time::Instant::now())) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {FREE_PORTS_FROM}..{floor}");
}

/// The lowest port [`free_port`] draws (above the well-known services' ports).
const FREE_PORTS_FROM: u16 = 10_000;

/// The first port of the kernel's ephemeral range (Linux's default when it cannot be read).
fn ephemeral_floor() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_drawn_below_the_ephemeral_range() {
        let floor = ephemeral_floor();
        let ports: std::collections::HashSet<u16> = (0..50).map(|_| free_port()).collect();
        if floor > FREE_PORTS_FROM + 1_000 {
            assert!(
                ports.iter().all(|&p| (FREE_PORTS_FROM..floor).contains(&p)),
                "{ports:?}"
            );
        }
        assert!(ports.len() > 40, "draws repeat: {ports:?}");
    }
}
