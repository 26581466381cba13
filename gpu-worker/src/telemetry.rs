//! The worker's Prometheus metrics: names, descriptions, buckets, and the calls that record them.
//!
//! The engine thread records per-step histograms through the `metrics` facade (a few atomic
//! operations; without an installed recorder they are no-ops, as in unit tests). Gauges that
//! mirror engine state are set from [`EngineStats`] when `/metrics` is scraped, so a scrape never
//! sees a value older than the request that asked for it.

use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};

use crate::device::MemoryUse;
use crate::engine::{EngineStats, StepSummary};

pub const BATCH_SIZE: &str = "hearth_worker_batch_size";
pub const BATCH_UTILIZATION: &str = "hearth_worker_batch_utilization";
pub const STEP_DURATION: &str = "hearth_worker_step_duration_seconds";
pub const PREFILL_TOKENS: &str = "hearth_worker_prefill_tokens_total";
pub const DECODE_TOKENS: &str = "hearth_worker_decode_tokens_total";
pub const RUNNING: &str = "hearth_worker_running_sequences";
pub const WAITING: &str = "hearth_worker_waiting_sequences";
pub const IN_FLIGHT: &str = "hearth_worker_in_flight_requests";
pub const KV_BLOCKS_USED: &str = "hearth_worker_kv_blocks_used";
pub const KV_BLOCKS_TOTAL: &str = "hearth_worker_kv_blocks_total";
pub const KV_BLOCKS_CACHED: &str = "hearth_worker_kv_blocks_cached";
pub const KV_BYTES_USED: &str = "hearth_worker_kv_bytes_used";
pub const KV_BYTES_TOTAL: &str = "hearth_worker_kv_bytes_total";
pub const CACHED_SESSIONS: &str = "hearth_worker_cached_sessions";
pub const SESSION_EVICTIONS: &str = "hearth_worker_session_evictions_total";
pub const PREEMPTIONS: &str = "hearth_worker_preemptions_total";
pub const PREFIX_CACHE_QUERIES: &str = "hearth_worker_prefix_cache_queries_tokens_total";
pub const PREFIX_CACHE_HITS: &str = "hearth_worker_prefix_cache_hits_tokens_total";
pub const SPEC_DRAFT: &str = "hearth_worker_spec_draft_tokens_total";
pub const SPEC_ACCEPTED: &str = "hearth_worker_spec_accepted_tokens_total";
pub const DEVICE_MEMORY_USED: &str = "hearth_worker_device_memory_used_bytes";
pub const DEVICE_MEMORY_TOTAL: &str = "hearth_worker_device_memory_total_bytes";
pub const READY: &str = "hearth_worker_ready";
/// Per model (`model="name@version"`): 1 loading, 2 ready, 3 unloading, 4 failed, 0 unloaded.
pub const MODEL_STATE: &str = "hearth_worker_model_state";
/// Per model: its weights and K/V pool, in bytes (0 once unloaded).
pub const MODEL_BYTES: &str = "hearth_worker_model_bytes";
pub const DEVICE_INFO: &str = "hearth_worker_device_info";

pub use hearth_shared::telemetry::LATENCY_BUCKETS;
const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// Installs the process-wide recorder and describes every metric; `render()` on the handle
/// produces the `/metrics` text.
pub fn install() -> Result<PrometheusHandle, BuildError> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full(BATCH_SIZE.into()), BATCH_BUCKETS)?
        .install_recorder()?;
    describe();
    Ok(handle)
}

fn describe() {
    describe_histogram!(BATCH_SIZE, "Sequences in one engine step's forward pass");
    describe_gauge!(
        BATCH_UTILIZATION,
        "Last step's batch size as a fraction of the configured maximum"
    );
    describe_histogram!(
        STEP_DURATION,
        metrics::Unit::Seconds,
        "Engine step wall time by phase (decode, prefill, mixed)"
    );
    describe_counter!(PREFILL_TOKENS, "Prompt tokens run through the model");
    describe_counter!(
        DECODE_TOKENS,
        "Tokens decoded (one per sequence per decode step, plus speculative draft tokens kept)"
    );
    describe_gauge!(RUNNING, "Sequences in the running batch");
    describe_gauge!(WAITING, "Requests waiting for admission");
    describe_gauge!(IN_FLIGHT, "Requests being streamed, across all connections");
    describe_gauge!(
        KV_BLOCKS_USED,
        "KV blocks held by running sequences and session caches"
    );
    describe_gauge!(KV_BLOCKS_TOTAL, "KV blocks in the budget");
    describe_gauge!(
        KV_BLOCKS_CACHED,
        "Unreferenced KV blocks kept for the prefix cache (reclaimable, not in used)"
    );
    describe_gauge!(KV_BYTES_USED, metrics::Unit::Bytes, "KV bytes in use");
    describe_gauge!(KV_BYTES_TOTAL, metrics::Unit::Bytes, "KV budget in bytes");
    describe_gauge!(CACHED_SESSIONS, "Sessions whose KV is resident");
    describe_counter!(SESSION_EVICTIONS, "Idle session caches evicted for memory");
    describe_counter!(PREEMPTIONS, "Running sequences preempted for recompute");
    describe_counter!(
        PREFIX_CACHE_QUERIES,
        "Prompt tokens looked up in the KV cache at admission"
    );
    describe_counter!(
        PREFIX_CACHE_HITS,
        "Prompt tokens served from cached KV instead of prefilled"
    );
    describe_counter!(
        SPEC_DRAFT,
        "Speculative decoding: draft tokens (prompt lookup) verified by the model"
    );
    describe_counter!(
        SPEC_ACCEPTED,
        "Speculative decoding: draft tokens accepted (acceptance rate: over the draft total)"
    );
    describe_gauge!(
        DEVICE_MEMORY_USED,
        metrics::Unit::Bytes,
        "Device memory in use (CPU: resident set of the worker)"
    );
    describe_gauge!(
        DEVICE_MEMORY_TOTAL,
        metrics::Unit::Bytes,
        "Device memory (CPU: physical memory)"
    );
    describe_gauge!(READY, "1 when the worker accepts generation requests");
    describe_gauge!(
        MODEL_STATE,
        "Per model: 1 loading, 2 ready, 3 unloading, 4 failed, 0 unloaded"
    );
    describe_gauge!(MODEL_BYTES, "Per model: its weights and K/V pool, in bytes");
    describe_gauge!(
        DEVICE_INFO,
        "1, labelled with the device the model runs on (kind, ordinal, name, compute capability)"
    );
}

/// Called by the engine thread after every step that ran the model.
pub fn record_step(summary: &StepSummary, elapsed: Duration, max_batch: usize) {
    let batch = summary.batch_size();
    histogram!(BATCH_SIZE).record(batch as f64);
    gauge!(BATCH_UTILIZATION).set(batch as f64 / max_batch.max(1) as f64);
    histogram!(STEP_DURATION, "phase" => summary.phase()).record(elapsed.as_secs_f64());
    counter!(PREFILL_TOKENS).increment(summary.prefill_tokens as u64);
    counter!(DECODE_TOKENS).increment(summary.decode_tokens as u64);
}

/// A model's state and bytes (see [`MODEL_STATE`]).
pub fn model_state(model: &str, state: u8, bytes: u64) {
    gauge!(MODEL_STATE, "model" => model.to_string()).set(f64::from(state));
    gauge!(MODEL_BYTES, "model" => model.to_string()).set(bytes as f64);
}

/// K/V memory of every engine together: bytes in use and in all.
#[derive(Debug, Clone, Copy, Default)]
pub struct KvBytes {
    pub used: usize,
    pub total: usize,
}

/// Mirrors engine and device state into gauges; called on every scrape.
pub fn refresh(stats: &EngineStats, kv: KvBytes, in_flight: usize, memory: MemoryUse) {
    gauge!(RUNNING).set(stats.running as f64);
    gauge!(WAITING).set(stats.waiting as f64);
    gauge!(IN_FLIGHT).set(in_flight as f64);
    gauge!(KV_BLOCKS_USED).set(stats.kv_blocks_used as f64);
    gauge!(KV_BLOCKS_TOTAL).set(stats.kv_blocks_total as f64);
    gauge!(KV_BLOCKS_CACHED).set(stats.kv_blocks_cached as f64);
    gauge!(KV_BYTES_USED).set(kv.used as f64);
    gauge!(KV_BYTES_TOTAL).set(kv.total as f64);
    gauge!(CACHED_SESSIONS).set(stats.cached_sessions as f64);
    counter!(SESSION_EVICTIONS).absolute(stats.session_evictions as u64);
    counter!(PREEMPTIONS).absolute(stats.preemptions as u64);
    counter!(PREFIX_CACHE_QUERIES).absolute(stats.prefix_cache_queries_tokens as u64);
    counter!(PREFIX_CACHE_HITS).absolute(stats.prefix_cache_hits_tokens as u64);
    counter!(SPEC_DRAFT).absolute(stats.spec_draft_tokens as u64);
    counter!(SPEC_ACCEPTED).absolute(stats.spec_accepted_tokens as u64);
    gauge!(DEVICE_MEMORY_USED).set(memory.used_bytes as f64);
    gauge!(DEVICE_MEMORY_TOTAL).set(memory.total_bytes as f64);
}

/// Publishes [`DEVICE_INFO`] for `device` (once, at start).
pub fn device_info(device: &crate::device::Device) {
    gauge!(
        DEVICE_INFO,
        "kind" => device.kind,
        "ordinal" => device.ordinal.to_string(),
        "name" => device.name.clone(),
        "compute_capability" => device.compute_capability.clone().unwrap_or_default()
    )
    .set(1.0);
}
