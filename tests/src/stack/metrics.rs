//! Reading `/metrics` of a worker or an orchestrator, and waiting on it: what a worker has in
//! flight, whether it stopped decoding, which worker serves the running reply.

use std::net::SocketAddr;
use std::time::Duration;

use hearth_worker::fixtures::WorkerProcess;

use super::Stack;
use crate::http::Req;

/// Tokens the worker's engine has decoded, over every request.
pub const DECODED: &str = "hearth_worker_decode_tokens_total";

/// Prompt tokens the worker's engine has run through the model, over every request. A request
/// always moves this counter or [`DECODED`] (a one-token prompt chunk counts as a decode), even
/// when its first token ends the reply and nothing more is decoded.
pub const PREFILLED: &str = "hearth_worker_prefill_tokens_total";

/// The value of the unlabelled metric `name` on the `/metrics` page at `addr` (a worker's
/// metrics address or an orchestrator's). Panics when the page does not export it, so a
/// renamed metric fails the test instead of reading as 0.
pub async fn metric(addr: SocketAddr, name: &str) -> f64 {
    let text = Req::new("GET", "/metrics").send(addr).await.text();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{addr}/metrics does not export {name}"))
}

/// A worker's metric (see [`metric`]).
pub async fn worker_metric(w: &WorkerProcess, name: &str) -> f64 {
    metric(w.metrics.parse().expect("metrics addr"), name).await
}

/// `hearth_worker_in_flight_requests` from a worker's `/metrics`.
/// Panics when the worker does not export it (it is set on every scrape), rather than reading
/// a missing metric as "nothing in flight".
pub async fn worker_in_flight(w: &WorkerProcess) -> f64 {
    worker_metric(w, "hearth_worker_in_flight_requests").await
}

/// Waits up to 2 s for a worker to have nothing in flight; returns what it has left.
pub async fn wait_idle(w: &WorkerProcess) -> f64 {
    let mut left = worker_in_flight(w).await;
    for _ in 0..100 {
        if left == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        left = worker_in_flight(w).await;
    }
    left
}

/// Polls `metric` at `addr` until `want(value)` holds; the last value either way.
pub async fn wait_metric(
    addr: SocketAddr,
    name: &str,
    timeout: Duration,
    want: impl Fn(f64) -> bool,
) -> f64 {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let v = metric(addr, name).await;
        if want(v) || tokio::time::Instant::now() >= deadline {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Asserts that the worker has stopped decoding (its decoded-token counter stands still for
/// 300 ms) and decoded fewer than `limit` tokens in all: a generation was cancelled, not run to
/// its end (which would also leave the worker idle).
pub async fn assert_cancelled_before(w: &WorkerProcess, limit: u32) {
    let decoded = worker_metric(w, DECODED).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        worker_metric(w, DECODED).await,
        decoded,
        "the worker kept decoding"
    );
    assert!(
        decoded < f64::from(limit),
        "the reply ran to its end: {decoded} tokens"
    );
}

/// The index of the worker that has a request in flight (the test's one running reply); waits
/// up to 5 s for one to show it.
pub async fn serving_worker(s: &Stack) -> usize {
    for _ in 0..250 {
        for (i, w) in s.workers.iter().enumerate() {
            if worker_in_flight(w).await >= 1.0 {
                return i;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no worker has a request in flight");
}
