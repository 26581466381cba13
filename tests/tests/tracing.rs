//! Distributed tracing through the whole stack, received by a real OTLP/gRPC receiver inside
//! the test: one native turn is one connected trace (the orchestrator's request, its reply with
//! the GenAI attributes, the worker attempt, and the worker's request with its phases), a
//! client's `traceparent` becomes the root's parent (templating, the fair queue and the
//! database calls are spans of the request too), and with the receiver gone turns still
//! complete while the dropped spans are counted. A reply whose worker is killed mid-way shows
//! both attempts, the second with the reason it moved on; with `--otlp-include-content` its
//! span holds the prompt and the reply.

use std::net::SocketAddr;
use std::time::Duration;

use hearth_e2e::http::Req;
use hearth_e2e::otlp::{receiver, Got, Receiver};
use hearth_e2e::stack::{metric, new_session, serving_worker, slow_spec, Db, Stack};
use hearth_worker::fixtures::TinySpec;
use serde_json::json;

/// The spans of the trace whose root's HTTP route is `route`, once `names` all arrived.
async fn trace_of(r: &Receiver, route: &str, names: &[&str]) -> Vec<Got> {
    for _ in 0..200 {
        let spans = r.spans.lock().expect("spans").clone();
        let root = spans
            .iter()
            .find(|s| s.attrs.get("http.route").map(String::as_str) == Some(route));
        if let Some(root) = root {
            let trace: Vec<Got> = spans
                .iter()
                .filter(|s| s.trace == root.trace)
                .cloned()
                .collect();
            if names
                .iter()
                .all(|n| trace.iter().any(|s| s.name.starts_with(n)))
            {
                return trace;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let spans = r.spans.lock().expect("spans").clone();
    panic!("no trace of {route} with {names:?}: {spans:#?}");
}

async fn turn(addr: SocketAddr, key: &str, sid: &str, traceparent: Option<&str>) {
    let path = format!("/v1/sessions/{sid}/messages");
    let mut req = Req::new("POST", &path)
        .key(Some(key))
        .json(&json!({"content": "Hello", "max_tokens": 6, "stream": false}));
    if let Some(tp) = traceparent {
        req = req.header("traceparent", tp);
    }
    let r = req.send(addr).await;
    assert!(r.status < 300, "{}", r.text());
}

/// A receiver, and a stack of `workers` workers of `spec` whose processes all send it their
/// spans, `hearth` with `extra` flags too.
async fn traced(
    tag: &str,
    spec: &TinySpec,
    workers: usize,
    extra: &[&str],
) -> (Receiver, hearth_e2e::otlp::Gone, Stack) {
    let (r, at, serving) = receiver().await;
    let endpoint = format!("http://{at}");
    let flags = ["--kv-budget", "64MiB", "--otlp-endpoint", endpoint.as_str()];
    let mut hearth = vec!["--otlp-endpoint", endpoint.as_str()];
    hearth.extend_from_slice(extra);
    let s = Stack::start_full(tag, spec, Db::Sqlite, workers, &flags, &hearth).await;
    (r, serving, s)
}

#[tokio::test]
async fn a_turn_is_one_trace_across_orchestrator_and_worker() {
    let (r, serving, s) = traced("tracing", &TinySpec::default(), 1, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;

    // A client's span is the parent of the request's.
    let client_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let tp = format!("00-{client_trace}-00f067aa0ba902b7-01");
    turn(s.addr(), &k, &sid, Some(&tp)).await;
    let route = "/v1/sessions/{id}/messages";
    let names = [
        "POST",
        "template",
        "queue",
        "db.begin_turn",
        "chat",
        "attempt",
        "worker generate",
        "prefill",
        "decode",
    ];
    let trace = trace_of(&r, route, &names).await;
    let by = |name: &str| {
        trace
            .iter()
            .find(|s| s.name.starts_with(name))
            .unwrap_or_else(|| panic!("{name}: {trace:#?}"))
            .clone()
    };
    let root = by("POST");
    assert_eq!(
        (root.trace.as_str(), root.parent.as_str()),
        (client_trace, "00f067aa0ba902b7")
    );
    assert_eq!(root.service, "hearth");
    // Each span's parent is in the trace, up to the root: one connected tree.
    let ids: Vec<&str> = trace.iter().map(|s| s.id.as_str()).collect();
    for span in trace.iter().filter(|s| s.id != root.id) {
        assert!(
            ids.contains(&span.parent.as_str()),
            "{span:?} hangs loose in {trace:#?}"
        );
    }
    let chat = by("chat");
    assert_eq!(chat.attrs["gen_ai.operation.name"], "chat");
    assert_eq!(chat.attrs["gen_ai.request.max_tokens"], "6");
    assert_eq!(chat.attrs["gen_ai.usage.output_tokens"], "6", "{chat:?}");
    assert!(chat.attrs.contains_key("gen_ai.request.model"), "{chat:?}");
    assert!(
        chat.attrs.contains_key("gen_ai.usage.input_tokens"),
        "{chat:?}"
    );
    assert!(
        chat.attrs["gen_ai.response.finish_reasons"].contains("length"),
        "{chat:?}"
    );
    assert!(
        chat.attrs.contains_key("hearth.time_to_first_token_ms"),
        "{chat:?}"
    );
    let attempt = by("attempt");
    assert_eq!(attempt.parent, chat.id);
    let worker = by("worker generate");
    assert_eq!(
        (worker.service.as_str(), worker.parent.as_str()),
        ("hearth-worker", attempt.id.as_str())
    );
    assert_eq!(
        worker.attrs["gen_ai.usage.output_tokens"], "6",
        "{worker:?}"
    );
    assert_eq!(by("decode").parent, worker.id);
    assert_eq!(by("db.begin_turn").attrs["db.system"], "sqlite");
    // No prompt or reply text goes into a span.
    for span in &trace {
        assert!(
            span.attrs.values().all(|v| !v.contains("Hello")),
            "{span:?}"
        );
    }

    // Without a client's span, the request's is a root.
    let before = r.spans.lock().expect("spans").len();
    turn(s.addr(), &k, &sid, None).await;
    let fresh = loop {
        let spans = r.spans.lock().expect("spans").clone();
        let root = spans[before..]
            .iter()
            .find(|s| s.attrs.get("http.route").map(String::as_str) == Some(route))
            .cloned();
        if let Some(root) = root {
            break root;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_ne!(fresh.trace, client_trace);
    assert!(fresh.parent.is_empty(), "{fresh:?}");

    // The receiver gone: turns still complete, and the spans they make are counted as dropped.
    serving.now().await;
    let dropped = |addr| metric(addr, "hearth_trace_spans_dropped_total");
    let was = dropped(s.addr()).await;
    for _ in 0..3 {
        turn(s.addr(), &k, &sid, None).await;
    }
    let mut now = was;
    for _ in 0..200 {
        now = dropped(s.addr()).await;
        if now > was {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(now > was, "dropped spans {was} -> {now}");
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_that_fails_over_shows_both_attempts() {
    let content = ["--otlp-include-content"];
    let (r, serving, mut s) = traced("tracing_failover", &slow_spec(), 2, &content).await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let mut sse = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&k))
        .json(&json!({"content": "A long story, please", "max_tokens": 80, "ignore_eos": true}))
        .events(s.addr())
        .await;
    let mut tokens = 0;
    while tokens < 10 {
        let e = sse.next().await.expect("the reply ended early");
        tokens += usize::from(e.event == "token");
    }
    let victim = serving_worker(&s).await;
    s.workers[victim].child.kill().expect("kill -9");
    let end = sse.rest().await.pop().expect("an end");
    assert_eq!(end.event, "message_end", "{end:?}");

    let trace = trace_of(&r, "/v1/sessions/{id}/messages", &["chat"]).await;
    let mut attempts: Vec<Got> = Vec::new();
    for _ in 0..200 {
        let spans = r.spans.lock().expect("spans").clone();
        attempts = spans
            .into_iter()
            .filter(|s| s.trace == trace[0].trace && s.name == "attempt")
            .collect();
        if attempts.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(attempts.len(), 2, "{attempts:#?}");
    let failed = attempts
        .iter()
        .find(|a| a.attrs.contains_key("hearth.error"));
    let next = attempts
        .iter()
        .find(|a| a.attrs.contains_key("hearth.failover_reason"));
    let (failed, next) = (
        failed.expect("the failed attempt"),
        next.expect("the next attempt"),
    );
    assert_eq!(
        failed.attrs["hearth.error"],
        next.attrs["hearth.failover_reason"]
    );
    assert_ne!(failed.attrs["hearth.worker"], next.attrs["hearth.worker"]);
    assert_eq!(failed.parent, next.parent, "both under the reply's span");
    // Asked for, the reply's span holds its prompt and text.
    let chat = trace
        .iter()
        .find(|s| s.name.starts_with("chat"))
        .expect("chat");
    assert!(
        chat.attrs["gen_ai.prompt"].contains("A long story, please"),
        "{chat:?}"
    );
    assert!(!chat.attrs["gen_ai.completion"].is_empty(), "{chat:?}");
    serving.now().await;
    s.finish().await;
}
