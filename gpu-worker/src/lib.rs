//! The Hearth GPU worker: Gemma on candle, continuous batching, per-session KV caches.
//!
//! # Layout
//! - [`model`]: Gemma weights (GGUF or safetensors) and the batched forward pass.
//! - [`generic`]: the same forward pass on candle tensors, for CUDA devices (and candle's CPU).
//! - [`kernels`]: CPU matrix kernels for 8-bit block weights that reuse each block across the batch.
//! - [`kv`]: the KV block budget, block tables and paged K/V storage.
//! - [`sampling`]: per-request token sampling with its own seeded RNG.
//! - [`math`]: the vectorizable exponential both forward passes and the sampler use.
//! - [`engine`]: the scheduler on its own thread and the [`engine::EngineHandle`] used to submit,
//!   stream and cancel requests.
//! - [`device`]: device selection and memory reporting (the only device-specific module).
//! - [`server`]: the gRPC service over the engine, its configuration, lifecycle and metrics.
//! - [`telemetry`]: the worker's Prometheus metrics.
//! - [`fixtures`]: tiny random-weight Gemma-shaped models for tests and benchmarks.
//! - [`bench`]: the `hearth-worker bench` benchmark.
//! - [`check`]: `hearth-worker check-greedy`, a device's greedy tokens against the CPU kernels.
//! - [`gen_model`]: random-weight GGUF files shaped like real Gemma 3 models (`gen-model`).
//! - [`fetch`]: model files from HTTP(S) into the models cache (resumed, verified).
//! - [`repository`]: a directory of models and their versions, with optional manifests.

pub mod bench;
pub mod check;
pub mod device;
pub mod engine;
pub mod fetch;
pub mod fixtures;
pub mod gen_model;
pub mod generic;
pub mod kernels;
pub mod kv;
pub mod math;
pub mod model;
pub mod repository;
pub mod sampling;
pub mod server;
pub mod telemetry;
