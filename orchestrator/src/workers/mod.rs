//! Talking to GPU workers. [`connection::WorkerConnection`] owns one long-lived `Generate`
//! stream to one worker and multiplexes many requests on it, sending new requests in batches.
//! The pool over several workers (health, affinity, failover) is not built yet.

pub mod connection;

pub use connection::{BatchConfig, Generation, WorkerConnection, WorkerError};
