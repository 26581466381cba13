//! What the worker's and the orchestrator's metrics have in common.

/// Histogram buckets for every latency (`*_seconds`), 5 ms to 60 s, so dashboards can compare
/// the orchestrator's and the workers' figures bucket for bucket.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
