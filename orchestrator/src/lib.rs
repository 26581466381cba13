//! The Hearth orchestrator: what users and the web frontend talk to.
//!
//! # Layout
//! - [`storage`]: users, API keys, sessions and messages behind one [`storage::Store`] trait,
//!   on PostgreSQL (production) or SQLite (the embedded default).
//!
//! The HTTP API, auth, routing and streaming are not built yet.

pub mod storage;
