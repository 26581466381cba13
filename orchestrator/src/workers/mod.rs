//! Talking to GPU workers. [`connection::WorkerConnection`] owns one long-lived `Generate`
//! stream to one worker and multiplexes many requests on it, sending new requests in batches;
//! [`pool::WorkerPool`] keeps every worker's health and chooses one for each request
//! (session affinity, least loaded, bounded admission); [`discovery`] adds and removes workers
//! as DNS lists them (`--worker dns:NAME:PORT`).

mod admin;
mod affinity;
pub mod connection;
mod discovery;
mod fair;
mod health;
mod lease;
mod models;
pub mod pool;

pub use admin::{AdminError, Eviction, WorkerModel, WorkerModels};
pub use affinity::{prefix_keys, Affinity, PrefixKey};
pub use connection::{BatchConfig, Generation, WorkerConnection, WorkerError, WorkerLink};
pub use discovery::{discover, Discovery, DnsWorkers, DNS_PREFIX};
pub use fair::Tenant;
pub use health::WorkerStatus;
pub use lease::Lease;
pub use models::{ModelKey, ServedModel, UnknownModel};
pub use pool::{Excluded, PoolConfig, PoolError, WorkerPool};
