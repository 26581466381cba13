//! The quick start: `hearth` with no `--worker` starts its own worker, keeps its data in SQLite
//! under the data directory, and serves without keys on loopback; given `--otlp-endpoint`, its
//! worker traces too.

use hearth_e2e::http::Req;
use hearth_e2e::stack::{assets, path, worker_bin, Assets, Hearth};
use serde_json::json;

/// `hearth` with no `--worker`, on `a`'s model, data under `a`'s directory, with `extra` flags.
fn alone(a: &Assets, extra: &[String]) -> Hearth {
    let mut args = vec![
        "--worker-bin".into(),
        path(&worker_bin()),
        "--model".into(),
        path(&a.model),
        "--tokenizer".into(),
        path(&a.tokenizer),
        "--data-dir".into(),
        path(&a.dir.join("data")),
        "--worker-arg=--kv-budget=64MiB".into(),
    ];
    args.extend_from_slice(extra);
    Hearth::spawn(&args)
}

#[tokio::test]
async fn hearth_alone_starts_a_local_worker_and_serves_a_chat() {
    let a = assets("quick");
    let data = a.dir.join("data");
    let hearth = alone(&a, &[]);
    // It prints its address only once the local worker is ready.
    let ready = Req::new("GET", "/readyz").send(hearth.addr).await;
    assert_eq!(ready.status, 200, "{}", ready.text());
    assert!(
        data.join("hearth.db").is_file(),
        "SQLite under the data dir"
    );

    // No key needed: the README's curl, streamed.
    let mut sse = Req::new("POST", "/v1/chat/completions")
        .json(&json!({"stream": true, "max_tokens": 8,
                      "messages": [{"role": "user", "content": "Why is the sky blue?"}]}))
        .events(hearth.addr)
        .await;
    assert_eq!(sse.status, 200);
    let events = sse.rest().await;
    assert_eq!(events.last().map(|e| e.data.as_str()), Some("[DONE]"));

    // Sessions work too, as the local user.
    let r = Req::new("POST", "/v1/sessions")
        .json(&json!({"title": "first"}))
        .send(hearth.addr)
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let sid = r.json()["id"].as_str().expect("id").to_string();
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .json(&json!({"content": "Hello", "stream": false, "max_tokens": 4}))
        .send(hearth.addr)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["status"], "complete");
    drop(hearth);
    let _ = std::fs::remove_dir_all(&a.dir);
}

#[tokio::test]
async fn hearth_alone_passes_its_trace_endpoint_to_its_local_worker() {
    let (traces, at, receiving) = hearth_e2e::otlp::receiver().await;
    let a = assets("quick_traces");
    let hearth = alone(&a, &[format!("--otlp-endpoint=http://{at}")]);
    let r = Req::new("POST", "/v1/chat/completions")
        .json(&json!({"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}))
        .send(hearth.addr)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let mut services = Vec::new();
    for _ in 0..200 {
        services = traces
            .spans
            .lock()
            .expect("spans")
            .iter()
            .map(|s| s.service.clone())
            .collect();
        if services.iter().any(|s| s == "hearth") && services.iter().any(|s| s == "hearth-worker") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    services.dedup();
    assert!(
        services.contains(&"hearth-worker".to_string()),
        "{services:?}"
    );
    assert!(services.contains(&"hearth".to_string()), "{services:?}");
    receiving.now().await;
    drop(hearth);
    let _ = std::fs::remove_dir_all(&a.dir);
}
