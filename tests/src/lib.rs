//! Whole-stack tests and the `hearth-bench` load generator.
//!
//! The library holds what the tests share: [`stack`] starts real `hearth-worker` and `hearth`
//! processes on loopback ports over a real database and talks to them the way the tests do
//! (sessions, turns, streamed replies, metrics, waits); [`http`] is a small HTTP/1.1 and SSE
//! client over real sockets; [`pg`] gives each test a PostgreSQL database of its own, or a whole
//! server it may stop; [`redis`] is a Redis a test may stop; [`prometheus`] runs a real Prometheus
//! for the deploy/ dashboard test; [`tls`] makes a test's own certificate authority for servers
//! with TLS on; [`proxy`] is a TCP proxy a test can cut; [`chaos`] is the seeded chaos run and
//! its history checker (`make chaos`); and [`rng`] is the tests' one seeded random source
//! (`HEARTH_TEST_SEED` replays a run). The tests are in `tests/tests/`; the engine's own tests are
//! in `gpu-worker/tests`. [`bench`] is the `hearth-bench` load generator.

pub mod bench;
pub mod chaos;
pub mod http;
pub mod pg;
pub mod prometheus;
pub mod proxy;
pub mod redis;
pub mod rng;
pub mod stack;
pub mod tls;

/// A loopback port that was free a moment ago, for a server the test starts itself.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}
