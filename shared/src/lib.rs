//! Types shared by the Hearth orchestrator and GPU worker.
//!
//! # Layout
//! - [`chat`]: the Gemma chat template, incremental detokenization and stop strings.
//! - [`grammar`]: constrained decoding's grammars (JSON Schema, Lark, regular expressions).
//! - [`ids`]: newtypes for request, session and user ids.
//! - [`sampling`]: per-request sampling parameters and their validation.
//! - [`finish`]: why a generation ended.
//! - [`proto`]: the orchestrator ⇄ worker gRPC contract (generated) and its conversions.
//! - [`tokenizer`]: a thin wrapper over a `tokenizer.json` with Gemma's special tokens.
//! - [`versions`]: the order of model versions (which is the newest).
//! - [`worker_auth`]: the token every orchestrator-to-worker call carries.

pub mod chat;
pub mod finish;
pub mod grammar;
pub mod ids;
pub mod proto;
pub mod sampling;
pub mod telemetry;
pub mod tokenizer;
pub mod tracing_export;
pub mod versions;
pub mod worker_auth;

pub use finish::FinishReason;
pub use grammar::{Grammar, GrammarError};
pub use ids::{RequestId, SessionId, UserId};
pub use sampling::{SamplingError, SamplingParams};
