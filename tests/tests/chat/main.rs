//! Chat turns through the whole stack over real sockets: the `hearth` binary, real
//! `hearth-worker` processes with a tiny generated model, and a real PostgreSQL database.
//!
//! [`turns`] holds replies that run to their end and requests refused before a reply starts;
//! [`interrupted`] holds replies cut short (stopped, their worker or their client gone, every
//! worker full, the orchestrator crashed); [`kv`] the worker's int8 K/V and disk tier.

mod interrupted;
mod kv;
mod turns;
