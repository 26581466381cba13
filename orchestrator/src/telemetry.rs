//! The orchestrator's Prometheus metrics (names as in DESIGN.md), the recorder, the
//! middleware that counts every HTTP request by route and status, and the database check.

use std::sync::OnceLock;

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use std::sync::Arc;
use std::time::Duration;

use hearth_shared::telemetry::{process_metrics, LATENCY_BUCKETS};
use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
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
pub const REPLICA_TAKEOVERS: &str = "hearth_replica_takeovers_total";
pub const PREEMPTIONS: &str = "hearth_fair_share_preemptions_total";
pub const WORKERS_READY: &str = "hearth_workers_ready";
pub const FINISHED: &str = "hearth_requests_finished_total";
pub const ERRORS: &str = "hearth_errors_total";
pub const GENERATION_ERRORS: &str = "hearth_generation_errors_total";
/// The `type`s of [`GENERATION_ERRORS`]: every `GenerationError::kind` (a test there checks).
pub const GENERATION_ERROR_KINDS: [&str; 3] = [
    "service_unavailable",
    "invalid_request_error",
    "internal_error",
];
pub const RATE_LIMITED: &str = "hearth_rate_limited_total";
pub const PROMPT_LENGTH: &str = "hearth_request_prompt_tokens";
pub const GENERATION_LENGTH: &str = "hearth_request_generation_tokens";
pub const DECODE_TIME: &str = "hearth_request_decode_seconds";
pub const DATABASE_UP: &str = "hearth_database_up";
/// Models loaded on demand (a request for a repository model no worker held).
pub const MODEL_LOADS: &str = "hearth_model_loads_on_demand_total";
/// Trace spans dropped on their way to the collector (shared with the worker).
pub use hearth_shared::tracing_export::DROPPED_SPANS;

/// Buckets for per-request token counts (prompt and reply lengths), 1 to 32k tokens.
const LENGTH_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
    32768.0,
];

/// The process-wide recorder, installed on first use (several servers in one test process
/// share it).
pub fn handle() -> Option<PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let built = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(PROMPT_LENGTH.into()), LENGTH_BUCKETS)
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(GENERATION_LENGTH.into()),
                        LENGTH_BUCKETS,
                    )
                })
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
    describe_traffic();
    describe_latency();
    describe_failures();
    start_at_zero();
}

/// Requests, streams, tokens and loads.
fn describe_traffic() {
    describe_counter!(REQUESTS, "HTTP requests by route and status");
    describe_counter!(
        MODEL_LOADS,
        "Repository models loaded on demand for a request no worker could serve"
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
        FINISHED,
        "Generations ended, by finish reason (stop, length, context_full, cancelled, tool_calls, \
         error)"
    );
}

/// Latencies and lengths, as histograms.
fn describe_latency() {
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
    describe_histogram!(PROMPT_LENGTH, "Prompt length of each generation, in tokens");
    describe_histogram!(GENERATION_LENGTH, "Tokens generated by each generation");
    describe_histogram!(
        DECODE_TIME,
        metrics::Unit::Seconds,
        "From a generation's first token to its last event"
    );
}

/// Failures, failovers, limits and the health of what the orchestrator depends on.
fn describe_failures() {
    describe_counter!(
        WORKER_FAILOVERS,
        "Generations moved to another worker after a worker failed"
    );
    describe_counter!(
        REPLICA_TAKEOVERS,
        "Replies continued by this replica after the replica running them stopped"
    );
    describe_counter!(
        PREEMPTIONS,
        "Replies that gave their worker's place to a user who held none, and continued later"
    );
    describe_gauge!(WORKERS_READY, "Workers that are ready to serve");
    describe_counter!(ERRORS, "Error answers by error type (the body's `type`)");
    describe_counter!(
        GENERATION_ERRORS,
        "Generations that ended in an error after they started, by error type"
    );
    describe_counter!(
        RATE_LIMITED,
        "Requests refused by a key's limit (requests_per_minute, tokens_per_day, stops_per_minute, loads_per_hour)"
    );
    describe_gauge!(
        DATABASE_UP,
        "1 when the last periodic database check succeeded, 0 when it failed"
    );
    describe_counter!(
        DROPPED_SPANS,
        "Trace spans never delivered to the OTLP collector (its queue full, or export failed)"
    );
}

/// Series that only move on rare events start at zero, so dashboards and alerts see a flat
/// line (and `rate()` works) rather than no data until the first event.
fn start_at_zero() {
    counter!(WORKER_FAILOVERS).increment(0);
    counter!(DROPPED_SPANS).increment(0);
    counter!(PREEMPTIONS).increment(0);
    counter!(REPLICA_TAKEOVERS).increment(0);
    counter!(MODEL_LOADS).increment(0);
    for limit in [
        "requests_per_minute",
        "tokens_per_day",
        "stops_per_minute",
        "loads_per_hour",
    ] {
        counter!(RATE_LIMITED, "limit" => limit).increment(0);
    }
    for kind in GENERATION_ERROR_KINDS {
        counter!(GENERATION_ERRORS, "type" => kind).increment(0);
    }
    gauge!(QUEUE_DEPTH).increment(0.0);
    gauge!(ACTIVE_STREAMS).increment(0.0);
    gauge!(ACTIVE_SESSIONS).increment(0.0);
}

/// The `/metrics` body: the recorder's metrics and the process's CPU and memory.
pub fn render(handle: Option<&PrometheusHandle>) -> String {
    let mut text = handle.map(PrometheusHandle::render).unwrap_or_default();
    text.push_str(&process_metrics());
    text
}

/// What one generation's end adds to the metrics.
#[derive(Debug, Clone, Copy)]
pub struct ReplyEnd<'a> {
    pub finish_reason: &'a str,
    /// The error type when the generation failed.
    pub error_type: Option<&'a str>,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// From the first token to the end; `None` when no token was produced.
    pub decode: Option<Duration>,
}

pub fn record_reply_end(end: &ReplyEnd<'_>) {
    counter!(FINISHED, "finish_reason" => end.finish_reason.to_string()).increment(1);
    if let Some(kind) = end.error_type {
        counter!(GENERATION_ERRORS, "type" => kind.to_string()).increment(1);
    }
    histogram!(PROMPT_LENGTH).record(end.prompt_tokens as f64);
    histogram!(GENERATION_LENGTH).record(end.completion_tokens as f64);
    if let Some(d) = end.decode {
        histogram!(DECODE_TIME).record(d.as_secs_f64());
    }
}

/// Counts an error answer by its stable `type`.
pub fn count_error(error_type: &'static str) {
    counter!(ERRORS, "type" => error_type).increment(1);
}

/// Counts a request refused by a limit (`requests_per_minute` or `tokens_per_day`).
pub fn count_rate_limited(limit: &'static str) {
    counter!(RATE_LIMITED, "limit" => limit).increment(1);
}

/// How often the database is checked for `hearth_database_up`.
pub const DATABASE_CHECK_EVERY: Duration = Duration::from_secs(5);

/// Checks the database every [`DATABASE_CHECK_EVERY`] and mirrors the result into
/// `hearth_database_up`, so an outage shows (and alerts) even when no request arrives.
pub fn database_check_task(store: Arc<dyn crate::storage::Store>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(DATABASE_CHECK_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let up = tokio::time::timeout(DATABASE_CHECK_EVERY, store.ping())
                .await
                .is_ok_and(|r| r.is_ok());
            gauge!(DATABASE_UP).set(if up { 1.0 } else { 0.0 });
        }
    })
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

/// The request's span, the root of its trace (or, when the client sent a W3C `traceparent`,
/// a child of the client's span). Every response carries the trace's id as `x-trace-id` when
/// it is traced.
pub async fn trace_request(req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let method = req.method().as_str().to_string();
    let span = tracing::info_span!(
        "http.request",
        otel.name = %format!("{method} {route}"),
        otel.kind = "server",
        http.request.method = %method,
        http.route = %route,
        http.response.status_code = tracing::field::Empty,
    );
    let parent = req
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok());
    hearth_shared::tracing_export::set_parent(&span, parent);
    let trace_id = hearth_shared::tracing_export::trace_id(&span);
    let mut response = tracing::Instrument::instrument(next.run(req), span.clone()).await;
    span.record("http.response.status_code", response.status().as_u16());
    if let Some(v) = trace_id.and_then(|id| axum::http::HeaderValue::from_str(&id).ok()) {
        response.headers_mut().insert("x-trace-id", v);
    }
    response
}

/// Records a latency in seconds.
pub fn observe(name: &'static str, secs: f64) {
    histogram!(name).record(secs);
}
