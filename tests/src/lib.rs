//! Whole-stack tests and the `hearth-bench` load generator.
//!
//! The library holds what the tests share: [`stack`] starts real `hearth-worker` and `hearth`
//! processes on loopback ports over a real database, [`http`] is a small HTTP/1.1 and SSE client
//! over real sockets, [`pg`] gives each test a PostgreSQL database of its own, and [`prometheus`]
//! runs a real Prometheus for the deploy/ dashboard test, and [`redis`] a Redis a test may stop. The tests are
//! in `tests/tests/`; the engine's own tests are in `gpu-worker/tests`. [`bench`] is the
//! `hearth-bench` load generator.

pub mod bench;
pub mod http;
pub mod pg;
pub mod prometheus;
pub mod redis;
pub mod stack;
