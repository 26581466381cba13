//! The Hearth orchestrator: what users and the web frontend talk to.
//!
//! # Layout
//! - [`api`]: the HTTP API (sessions so far) and its error type.
//! - [`auth`]: API keys: issuing, hashing, constant-time checking.
//! - [`storage`]: users, API keys, sessions and messages behind one [`storage::Store`] trait,
//!   on PostgreSQL (production) or SQLite (the embedded default).
//! - [`workers`]: the worker pool (health, affinity, admission) and the long-lived, batched
//!   gRPC stream to each worker.
//! - [`service`]: the chat service, the only thing handlers call, and the validated turn it
//!   takes.
//! - [`generate`]: one generation end to end (failover, detokenization, stop strings, storing).
//! - [`limits`]: per-key rate limits, in process or in Redis.
//! - [`bus`]: stop signals between replicas (Redis pub/sub).
//! - [`config`]: the command line and the checked configuration built from it.
//! - [`server`]: start-up, including the quick start's local worker.
//! - [`http_server`]: the HTTP accept loop (header deadline, connection cap, bounded shutdown).
//! - [`ids`]: session and message ids, well formed by construction.
//! - [`invalid`]: a bad value and the request field it is in, for every layer's validation.
//! - [`tools`]: tool calling: the tools a turn offers, their prompt, calls parsed from a reply.
//! - [`telemetry`]: Prometheus metrics.

pub mod api;
pub mod auth;
pub mod bus;
pub mod config;
pub mod generate;
pub mod http_server;
pub mod ids;
pub mod invalid;
pub mod limits;
mod redis_conn;
pub mod server;
pub mod service;
pub mod storage;
pub mod telemetry;
pub mod tools;
pub mod workers;
