//! The Hearth orchestrator: what users and the web frontend talk to.
//!
//! # Layout
//! - [`api`]: the HTTP API (sessions so far) and its error type.
//! - [`auth`]: API keys: issuing, hashing, constant-time checking.
//! - [`storage`]: users, API keys, sessions and messages behind one [`storage::Store`] trait,
//!   on PostgreSQL (production) or SQLite (the embedded default).
//! - [`workers`]: the long-lived, batched gRPC stream to a GPU worker.
//!
//! Generation through the HTTP API, the worker pool (routing, failover) and SSE are not built yet.

pub mod api;
pub mod auth;
pub mod storage;
pub mod workers;
