//! Kept responses of OpenAI's Responses API, on two orchestrator replicas sharing PostgreSQL and
//! Redis: a response continued with `previous_response_id` runs in its session, whose history
//! the worker holds (cached tokens); a response is read, listed, cancelled and deleted from
//! either replica, and by its user only; a background response's events are read whole from the
//! other replica, and again after any `sequence_number`.

use std::net::SocketAddr;

use hearth_e2e::http::{Event, Reply, Req};
use hearth_e2e::redis::redis_url;
use hearth_e2e::stack::{slow_spec, Db, Hearth, Stack};
use serde_json::{json, Value};

async fn call(addr: SocketAddr, key: &str, method: &str, path: &str, body: Option<Value>) -> Reply {
    let req = Req::new(method, path).key(Some(key));
    match body {
        Some(b) => req.json(&b).send(addr).await,
        None => req.send(addr).await,
    }
}

async fn create(addr: SocketAddr, key: &str, body: Value) -> Value {
    let r = call(addr, key, "POST", "/v1/responses", Some(body)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

fn text(v: &Value) -> &str {
    v["output"][0]["content"][0]["text"]
        .as_str()
        .unwrap_or_default()
}

/// The response's events from `addr`, after `after` when given, up to the `[DONE]` that
/// ends them.
async fn events(addr: SocketAddr, key: &str, id: &str, after: Option<u64>) -> Vec<Event> {
    let query = after.map_or(String::new(), |n| format!("&starting_after={n}"));
    let path = format!("/v1/responses/{id}?stream=true{query}");
    let mut all = Req::new("GET", &path)
        .key(Some(key))
        .events(addr)
        .await
        .rest()
        .await;
    let done = all.pop().map(|e| e.data);
    assert_eq!(done.as_deref(), Some("[DONE]"), "{all:?}");
    all
}

fn deltas(events: &[Event]) -> String {
    events
        .iter()
        .filter(|e| e.event == "response.output_text.delta")
        .map(|e| e.json()["delta"].as_str().unwrap_or_default().to_string())
        .collect()
}

#[tokio::test]
async fn kept_responses_continue_in_their_session_and_resume_on_any_replica() {
    let redis = redis_url();
    let extra = ["--redis-url", redis.as_str()];
    let s = Stack::start_with("responses_kept", &slow_spec(), Db::Postgres, 1, &extra).await;
    let b = Hearth::spawn(&Stack::args(&s.assets, &s.db_url, &s.workers, &extra));
    b.wait_ready().await;
    let (a, b) = (s.addr(), b.addr);
    let k = s.key("alice").await;

    // Kept by default, and continued: the history (its prompt and reply) comes from the cache
    // of the worker that holds the session.
    let ask = json!({"model": "tiny", "input": "Name a colour.", "instructions": "Be brief.",
                     "max_output_tokens": 6, "temperature": 0.0});
    let first = create(a, &k, ask).await;
    assert_eq!(first["store"], true, "{first}");
    let first_id = first["id"].as_str().expect("id");
    let more = json!({"model": "tiny", "input": "And another?", "instructions": "Be brief.",
                      "previous_response_id": first_id, "max_output_tokens": 6,
                      "temperature": 0.0});
    let second = create(a, &k, more.clone()).await;
    assert_eq!(second["previous_response_id"], first_id, "{second}");
    let held = first["usage"]["input_tokens"].as_u64().expect("tokens");
    let cached = second["usage"]["input_tokens_details"]["cached_tokens"].as_u64();
    assert!(cached >= Some(held), "{held} tokens were held: {second}");
    let id = second["id"].as_str().expect("id");

    // Read from the other replica, as it ended.
    let got = call(b, &k, "GET", &format!("/v1/responses/{id}"), None).await;
    assert_eq!(got.status, 200, "{}", got.text());
    let got = got.json();
    assert_eq!(
        (got["status"].clone(), text(&got)),
        (second["status"].clone(), text(&second))
    );
    assert_eq!(got["instructions"], "Be brief.", "{got}");
    let items = call(
        b,
        &k,
        "GET",
        &format!("/v1/responses/{id}/input_items"),
        None,
    )
    .await;
    let items = items.json();
    assert_eq!(items["data"].as_array().map(Vec::len), Some(1), "{items}");
    assert_eq!(
        items["data"][0]["content"][0]["text"], "And another?",
        "{items}"
    );

    // The first response continued again branches off: its own session, the same history.
    let branch = create(b, &k, more).await;
    assert_eq!(
        text(&branch),
        text(&second),
        "greedy, from the same history"
    );
    let items = call(
        a,
        &k,
        "GET",
        &format!("/v1/responses/{first_id}/input_items?order=asc"),
        None,
    )
    .await;
    assert_eq!(
        items.json()["data"][0]["content"][0]["text"],
        "Name a colour."
    );

    // Another user's: nowhere to be found, nor to continue from.
    let eve = s.key("eve").await;
    for (method, path) in [
        ("GET", format!("/v1/responses/{id}")),
        ("GET", format!("/v1/responses/{id}/input_items")),
        ("POST", format!("/v1/responses/{id}/cancel")),
        ("DELETE", format!("/v1/responses/{id}")),
    ] {
        let r = call(b, &eve, method, &path, None).await;
        assert_eq!(r.status, 404, "{method} {path}: {}", r.text());
    }
    let theirs = json!({"model": "tiny", "input": "Hi", "previous_response_id": id});
    let r = call(a, &eve, "POST", "/v1/responses", Some(theirs)).await;
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(
        call(a, &k, "GET", &format!("/v1/responses/{id}"), None)
            .await
            .status,
        200
    );

    // In the background: answered at once. A client reads its first events from the other
    // replica and leaves; it reads the rest from the first, after the last it has: every
    // event once, numbered from 0, the same as a reading of them all.
    let bg = json!({"model": "tiny", "input": "Count.", "background": true,
                    "max_output_tokens": 120, "temperature": 0.0});
    let started = create(a, &k, bg).await;
    let state = (started["status"].as_str(), started["background"].as_bool());
    assert_eq!(state, (Some("in_progress"), Some(true)), "{started}");
    let bg_id = started["id"].as_str().expect("id");
    let path = format!("/v1/responses/{bg_id}?stream=true");
    let mut sse = Req::new("GET", &path).key(Some(&k)).events(b).await;
    let mut all = Vec::new();
    while all.len() < 6 {
        all.push(sse.next().await.expect("an event"));
    }
    drop(sse);
    all.extend(events(a, &k, bg_id, Some(5)).await);
    let numbers: Vec<u64> = all
        .iter()
        .map(|e| e.json()["sequence_number"].as_u64().expect("a number"))
        .collect();
    assert_eq!(numbers, (0..all.len() as u64).collect::<Vec<_>>());
    let last = all.last().expect("events").json();
    let end = last["type"].as_str();
    assert!(
        matches!(end, Some("response.completed" | "response.incomplete")),
        "{last}"
    );
    let done = call(a, &k, "GET", &format!("/v1/responses/{bg_id}"), None).await;
    let done = done.json();
    assert_eq!(deltas(&all), text(&done));
    assert_eq!(last["response"]["usage"], done["usage"]);
    let data = |e: &[Event]| e.iter().map(|e| e.data.clone()).collect::<Vec<_>>();
    assert_eq!(data(&events(b, &k, bg_id, None).await), data(&all));

    // Cancelled from the other replica while it runs; then deleted, with its session.
    let long = json!({"model": "tiny", "input": "Go on.", "background": true,
                      "max_output_tokens": 400, "temperature": 0.0});
    let running = create(a, &k, long).await;
    let run_id = running["id"].as_str().expect("id");
    let cancelled = call(
        b,
        &k,
        "POST",
        &format!("/v1/responses/{run_id}/cancel"),
        None,
    )
    .await;
    assert_eq!(
        cancelled.json()["status"],
        "cancelled",
        "{}",
        cancelled.text()
    );
    let gone = call(b, &k, "DELETE", &format!("/v1/responses/{run_id}"), None).await;
    assert_eq!(gone.json()["deleted"], true, "{}", gone.text());
    for addr in [a, b] {
        let r = call(addr, &k, "GET", &format!("/v1/responses/{run_id}"), None).await;
        assert_eq!(r.status, 404, "{}", r.text());
    }
    let sessions = call(a, &k, "GET", "/v1/sessions", None).await.json();
    let titles: Vec<&str> = sessions["data"]
        .as_array()
        .expect("sessions")
        .iter()
        .filter_map(|s| s["title"].as_str())
        .collect();
    assert!(!titles.contains(&"Go on."), "{titles:?}");
    assert!(titles.contains(&"Count."), "{titles:?}");
    s.finish().await;
}
