//! Every metric the code defines, and every name DESIGN.md promises, is exported by a running
//! stack after ordinary traffic: a dashboard or alert written against the documented names finds
//! each of them (a counter that has not counted yet reads 0, not "no data").

use hearth_e2e::http::Req;
use hearth_e2e::stack::{new_session, slow_spec, Db, Stack};
use serde_json::json;

/// The names DESIGN.md lists (labels left out).
const DOCUMENTED: &[&str] = &[
    "hearth_requests_total",
    "hearth_time_to_first_token_seconds",
    "hearth_inter_token_latency_seconds",
    "hearth_request_duration_seconds",
    "hearth_queue_wait_seconds",
    "hearth_queue_depth",
    "hearth_active_streams",
    "hearth_active_sessions",
    "hearth_prompt_tokens_total",
    "hearth_cached_prompt_tokens_total",
    "hearth_generated_tokens_total",
    "hearth_worker_batch_size",
    "hearth_worker_batch_utilization",
    "hearth_worker_step_duration_seconds",
    "hearth_worker_kv_blocks_used",
    "hearth_worker_kv_blocks_total",
    "hearth_worker_cached_sessions",
    "hearth_worker_session_evictions_total",
    "hearth_worker_device_memory_used_bytes",
    "hearth_worker_device_memory_total_bytes",
    "hearth_worker_prefix_cache_queries_tokens_total",
    "hearth_worker_prefix_cache_hits_tokens_total",
    "hearth_worker_spec_draft_tokens_total",
    "hearth_worker_spec_accepted_tokens_total",
];

/// The names the code defines: every `"hearth_…"` constant in the two telemetry modules.
fn defined(source: &str) -> Vec<String> {
    source
        .lines()
        .filter(|l| l.trim_start().starts_with("pub const"))
        .filter_map(|l| l.split('"').nth(1))
        .filter(|name| name.starts_with("hearth_"))
        .map(str::to_string)
        .collect()
}

/// Whether a `/metrics` page has a sample of `name` (a histogram's as `_bucket`/`_count`).
fn exports(page: &str, name: &str) -> bool {
    page.lines().filter(|l| !l.starts_with('#')).any(|l| {
        let rest = l.strip_prefix(name).unwrap_or("-");
        let rest = rest
            .strip_prefix("_bucket")
            .or_else(|| rest.strip_prefix("_count"))
            .unwrap_or(rest);
        rest.starts_with(' ') || rest.starts_with('{')
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_defined_and_documented_metric_is_exported() {
    // A model slow enough that a reply's tokens arrive apart, so inter-token latency has
    // samples (the tiny model can deliver a short reply in one message).
    let s = Stack::start_with("metricnames", &slow_spec(), Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;
    // Ordinary traffic: a native turn, a stateless completion, and a refused request.
    let sid = new_session(s.addr(), &k).await;
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&k))
        .json(&json!({"content": "hello", "max_tokens": 16, "ignore_eos": true, "stream": false}))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = Req::new("POST", "/v1/chat/completions")
        .key(Some(&k))
        .json(
            &json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 4}),
        )
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = Req::new("GET", "/v1/sessions/00000000000000000000000000000000")
        .key(Some(&k))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 404);

    let hearth = Req::new("GET", "/metrics").send(s.addr()).await.text();
    let worker_addr = s.workers[0].metrics.parse().expect("metrics addr");
    let worker = Req::new("GET", "/metrics").send(worker_addr).await.text();
    let mut names: Vec<String> = DOCUMENTED.iter().map(|n| n.to_string()).collect();
    names.extend(defined(include_str!("../../orchestrator/src/telemetry.rs")));
    names.extend(defined(include_str!("../../gpu-worker/src/telemetry.rs")));
    names.sort();
    names.dedup();
    assert!(names.len() > DOCUMENTED.len(), "{names:?}");
    let missing: Vec<&String> = names
        .iter()
        .filter(|n| {
            let page = if n.starts_with("hearth_worker_") && !n.ends_with("failovers_total") {
                &worker
            } else {
                &hearth
            };
            !exports(page, n)
        })
        .collect();
    assert!(
        missing.is_empty(),
        "not exported: {missing:?}\n--- hearth\n{hearth}\n--- worker\n{worker}"
    );
    s.finish().await;
}
