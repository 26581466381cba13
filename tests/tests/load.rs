//! 1,000 concurrent SSE streams through one orchestrator, against a worker in scripted mode
//! (tokens on a timer, no model): every stream completes, the orchestrator's memory stays
//! bounded, and the time it adds per token is reported.
//!
//! The heaviest test (a few seconds, 2,000 sockets): `cargo test -p hearth-e2e --test load` runs it alone;
//! skip it locally with `cargo test --workspace -- --skip thousand`. CI runs it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hearth_e2e::http::Req;
use hearth_e2e::stack::{rss_bytes, Db, Stack};
use hearth_worker::fixtures::TinySpec;
use serde_json::{json, Value};

const STREAMS: usize = 1000;
const TOKENS: u64 = 25;
const TOKEN_MS: u64 = 40;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_concurrent_streams_complete_with_bounded_memory() {
    let token_ms = TOKEN_MS.to_string();
    let s = Stack::start_full(
        "load",
        &TinySpec::default(),
        Db::Sqlite,
        1,
        &["--scripted-token-ms", &token_ms],
        &[],
    )
    .await;
    let k = Arc::new(s.key("load").await);
    let pid = s.hearth.child.id();
    let addr = s.addr();
    let body = Arc::new(json!({
        "model": "scripted",
        "messages": [{"role": "user", "content": "Count with me, please, for a while."}],
        "max_tokens": TOKENS,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    }));
    let rss_idle = rss_bytes(pid).expect("rss");
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(rss_idle));
    let sampler = {
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                if let Some(r) = rss_bytes(pid) {
                    peak.fetch_max(r, std::sync::atomic::Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let started = Instant::now();
    let tasks: Vec<_> = (0..STREAMS)
        .map(|_| {
            let (k, body) = (k.clone(), body.clone());
            tokio::spawn(async move {
                let mut sse = Req::new("POST", "/v1/chat/completions")
                    .key(Some(&k))
                    .json(&body)
                    .events(addr)
                    .await;
                if sse.status != 200 {
                    let status = sse.status;
                    panic!("{status}: {}", sse.body().await);
                }
                let mut gaps = Vec::new();
                let mut last: Option<Instant> = None;
                let mut usage = Value::Null;
                let mut done = false;
                while let Some(e) = sse.next().await {
                    if e.data == "[DONE]" {
                        done = true;
                        break;
                    }
                    let v = e.json();
                    if v["usage"].is_object() {
                        usage = v["usage"].clone();
                    }
                    if v["choices"][0]["delta"]["content"]
                        .as_str()
                        .is_some_and(|t| !t.is_empty())
                    {
                        let now = Instant::now();
                        if let Some(prev) = last {
                            gaps.push(now.duration_since(prev).as_secs_f64());
                        }
                        last = Some(now);
                    }
                }
                (done, usage, gaps)
            })
        })
        .collect();
    let mut gaps: Vec<f64> = Vec::new();
    let mut complete = 0;
    for t in tasks {
        let (done, usage, g) = t.await.expect("stream task");
        if done && usage["completion_tokens"] == TOKENS {
            complete += 1;
        }
        gaps.extend(g);
    }
    let elapsed = started.elapsed();
    sampler.abort();
    // After the streams: what is left once they are gone.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_after = rss_bytes(pid).expect("rss");
    let rss_peak = peak.load(std::sync::atomic::Ordering::Relaxed);

    gaps.sort_by(f64::total_cmp);
    let pct = |q: f64| gaps[((q * gaps.len() as f64) as usize).min(gaps.len() - 1)] * 1000.0;
    let (p50, p99) = (pct(0.50), pct(0.99));
    eprintln!(
        "load: {STREAMS} streams × {TOKENS} tokens every {TOKEN_MS} ms in {:.1} s; \
         inter-token p50 {p50:.1} ms, p99 {p99:.1} ms (orchestrator adds p50 {:.1} ms, p99 {:.1} ms \
         per token over the worker's {TOKEN_MS} ms); hearth RSS idle {} MiB, peak {} MiB, after {} MiB",
        elapsed.as_secs_f64(),
        p50 - TOKEN_MS as f64,
        p99 - TOKEN_MS as f64,
        rss_idle >> 20,
        rss_peak >> 20,
        rss_after >> 20,
    );
    assert_eq!(
        complete, STREAMS,
        "every stream completes with all its tokens"
    );
    // Bounded: a thousand streams cost well under a megabyte each, and it is given back.
    assert!(
        rss_peak < rss_idle + ((STREAMS as u64) << 20),
        "peak {rss_peak} vs idle {rss_idle}"
    );
    assert!(
        rss_after < rss_idle + (256 << 20),
        "after {rss_after} vs idle {rss_idle}"
    );
    s.finish().await;
}
