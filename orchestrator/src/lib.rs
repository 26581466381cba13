//! The Hearth orchestrator: what users and the web frontend talk to.
//!
//! # Layout
//! - [`api`]: the HTTP API (sessions so far) and its error type.
//! - [`auth`]: API keys: issuing, hashing, constant-time checking.
//! - [`storage`]: users, API keys, sessions and messages behind one [`storage::Store`] trait,
//!   on PostgreSQL (production) or SQLite (the embedded default).
//!
//! Generation through the HTTP API, routing to workers and streaming are not built yet.

pub mod api;
pub mod auth;
pub mod storage;
