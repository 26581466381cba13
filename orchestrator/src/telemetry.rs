//! The orchestrator's Prometheus metrics (names as in DESIGN.md), the recorder, and the
//! middleware that counts every HTTP request by route and status.

use std::sync::OnceLock;

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use hearth_shared::telemetry::LATENCY_BUCKETS;
use metrics::{counter, describe_counter, describe_gauge, describe_histogram, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

pub const REQUESTS: &str = "hearth_requests_total";
pub const TTFT: &str = "hearth_time_to_first_token_seconds";
pub const INTER_TOKEN: &str = "hearth_inter_token_latency_seconds";
pub const REQUEST_DURATION: &str = "hearth_request_duration_seconds";
pub const QUEUE_WAIT: &str = "hearth_queue_wait_seconds";
pub const QUEUE_DEPTH: &str = "hearth_queue_depth";
pub const ACTIVE_STREAMS: &str = "hearth_active_streams";
pub const ACTIVE_SESSIONS: &str = "hearth_active_sessions";
pub const PROMPT_TOKENS: &str = "hearth_prompt_tokens_total";
pub const CACHED_PROMPT_TOKENS: &str = "hearth_cached_prompt_tokens_total";
pub const GENERATED_TOKENS: &str = "hearth_generated_tokens_total";
pub const WORKER_FAILOVERS: &str = "hearth_worker_failovers_total";
pub const WORKERS_READY: &str = "hearth_workers_ready";

/// The process-wide recorder, installed on first use (several servers in one test process
/// share it).
pub fn handle() -> Option<PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let built = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
                .and_then(|b| b.install_recorder());
            match built {
                Ok(h) => {
                    describe();
                    Some(h)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "metrics recorder not installed; /metrics is empty");
                    None
                }
            }
        })
        .clone()
}

fn describe() {
    describe_counter!(REQUESTS, "HTTP requests by route and status");
    describe_histogram!(
        TTFT,
        metrics::Unit::Seconds,
        "From request arrival to the first token sent"
    );
    describe_histogram!(
        INTER_TOKEN,
        metrics::Unit::Seconds,
        "Between consecutive tokens of a reply"
    );
    describe_histogram!(
        REQUEST_DURATION,
        metrics::Unit::Seconds,
        "Generation requests from arrival to their last event"
    );
    describe_histogram!(
        QUEUE_WAIT,
        metrics::Unit::Seconds,
        "Time a request waited for a worker with room"
    );
    describe_gauge!(QUEUE_DEPTH, "Requests waiting for a worker with room");
    describe_gauge!(ACTIVE_STREAMS, "Generations in progress");
    describe_gauge!(ACTIVE_SESSIONS, "Sessions with a reply in progress");
    describe_counter!(PROMPT_TOKENS, "Prompt tokens sent to workers");
    describe_counter!(
        CACHED_PROMPT_TOKENS,
        "Prompt tokens served from a session's KV cache"
    );
    describe_counter!(GENERATED_TOKENS, "Tokens generated");
    describe_counter!(
        WORKER_FAILOVERS,
        "Generations moved to another worker after a worker failed"
    );
    describe_gauge!(WORKERS_READY, "Workers that are ready to serve");
}

/// Counts every request as `hearth_requests_total{route, status}`; the route is the matched
/// pattern (`/v1/sessions/{id}`), never the raw path, so ids do not explode the label set.
pub async fn count_requests(req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let response = next.run(req).await;
    let status = response.status().as_u16().to_string();
    counter!(REQUESTS, "route" => route, "status" => status).increment(1);
    response
}

/// Records a latency in seconds.
pub fn observe(name: &'static str, secs: f64) {
    histogram!(name).record(secs);
}
