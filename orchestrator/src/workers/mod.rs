//! Talking to GPU workers. [`connection::WorkerConnection`] owns one long-lived `Generate`
//! stream to one worker and multiplexes many requests on it, sending new requests in batches;
//! [`pool::WorkerPool`] keeps every worker's health and chooses one for each request
//! (session affinity, least loaded, bounded admission).

pub mod connection;
pub mod pool;

pub use connection::{BatchConfig, Generation, WorkerConnection, WorkerError};
pub use pool::{prefix_keys, Affinity, Lease, PoolConfig, PoolError, WorkerPool, WorkerStatus};
