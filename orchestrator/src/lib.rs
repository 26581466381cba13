//! The Hearth orchestrator: what users and the web frontend talk to.
//!
//! # Layout
//! - [`auth`]: API keys: issuing, hashing, constant-time checking.
//! - [`storage`]: users, API keys, sessions and messages behind one [`storage::Store`] trait,
//!   on PostgreSQL (production) or SQLite (the embedded default).
//!
//! The HTTP API, routing and streaming are not built yet.

pub mod auth;
pub mod storage;
