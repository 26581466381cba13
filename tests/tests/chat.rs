//! Chat turns through the whole stack over real sockets: the `hearth` binary, real
//! `hearth-worker` processes with a tiny generated model, and a real PostgreSQL database.

use hearth_e2e::http::{Event, Req, Sse};
use hearth_e2e::stack::{serving_worker, slow_spec, wait_idle, Db, Hearth, Stack};
use serde_json::{json, Value};

async fn new_session(s: &Stack, key: &str, body: Value) -> String {
    let r = Req::new("POST", "/v1/sessions")
        .key(Some(key))
        .json(&body)
        .send(s.addr())
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    r.json()["id"].as_str().expect("id").to_string()
}

async fn post_turn(s: &Stack, key: &str, sid: &str, body: Value) -> Sse {
    let path = format!("/v1/sessions/{sid}/messages");
    let sse = Req::new("POST", &path)
        .key(Some(key))
        .json(&body)
        .events(s.addr())
        .await;
    assert_eq!(sse.status, 200);
    sse
}

/// What one streamed reply showed.
#[derive(Debug)]
struct Streamed {
    message_id: String,
    text: String,
    last: Event,
    ids: Vec<String>,
}

fn fold(events: &[Event]) -> Streamed {
    let start = events.first().expect("events");
    assert_eq!(start.event, "message_start", "{events:?}");
    let message_id = start.json()["message_id"]
        .as_str()
        .expect("message id")
        .to_string();
    let text = events
        .iter()
        .filter(|e| e.event == "token")
        .map(|e| e.json()["text"].as_str().expect("text").to_string())
        .collect();
    Streamed {
        message_id,
        text,
        last: events.last().expect("last").clone(),
        ids: events.iter().filter_map(|e| e.id.clone()).collect(),
    }
}

async fn messages(s: &Stack, key: &str, sid: &str) -> Vec<Value> {
    let r = Req::new("GET", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(key))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["data"].as_array().expect("data").clone()
}

#[tokio::test]
async fn a_multi_turn_session_streams_stores_and_reuses_the_cache() {
    // Two workers: the second turn must go where the first left its cache.
    let s = Stack::start("turns", Db::Postgres, 2, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session(&s, &k, json!({"title": "t", "system_prompt": "Be brief."})).await;

    let mut sse = post_turn(
        &s,
        &k,
        &sid,
        json!({"content": "Hello there", "max_tokens": 24}),
    )
    .await;
    assert!(sse
        .header("content-type")
        .is_some_and(|c| c.starts_with("text/event-stream")));
    assert_eq!(sse.header("x-accel-buffering"), Some("no"));
    let one = fold(&sse.rest().await);
    assert_eq!(one.last.event, "message_end", "{:?}", one.last);
    let end1 = one.last.json();
    assert_eq!(end1["status"], "complete");
    let usage1 = end1["usage"].clone();
    assert!(usage1["prompt_tokens"].as_u64().expect("prompt") > 5);
    assert_eq!(usage1["cached_tokens"], 0);
    let completion1 = usage1["completion_tokens"].as_u64().expect("completion");
    assert!((1..=24).contains(&completion1), "{usage1}");
    // Every event has an id `<message id>:<n>`, numbered from 1.
    for (i, id) in one.ids.iter().enumerate() {
        assert_eq!(id, &format!("{}:{}", one.message_id, i + 1));
    }

    let two = fold(
        &post_turn(
            &s,
            &k,
            &sid,
            json!({"content": "And again", "max_tokens": 16}),
        )
        .await
        .rest()
        .await,
    );
    let usage2 = two.last.json()["usage"].clone();
    // Turn one's prompt is a prefix of turn two's, and the worker kept it.
    assert!(
        usage2["cached_tokens"].as_u64() >= usage1["prompt_tokens"].as_u64(),
        "turn 1 {usage1}, turn 2 {usage2}"
    );

    // The stored history is what was streamed, with its accounting.
    let stored = messages(&s, &k, &sid).await;
    assert_eq!(stored.len(), 4);
    let roles: Vec<_> = stored.iter().map(|m| m["role"].clone()).collect();
    assert_eq!(
        roles,
        vec![
            json!("user"),
            json!("assistant"),
            json!("user"),
            json!("assistant")
        ]
    );
    assert_eq!(stored[0]["content"], "Hello there");
    for (m, streamed, usage) in [(&stored[1], &one, &usage1), (&stored[3], &two, &usage2)] {
        assert_eq!(m["id"], json!(streamed.message_id));
        assert_eq!(m["content"], json!(streamed.text));
        assert_eq!(m["status"], "complete");
        assert_eq!(m["prompt_tokens"], usage["prompt_tokens"]);
        assert_eq!(m["cached_tokens"], usage["cached_tokens"]);
        assert_eq!(m["completion_tokens"], usage["completion_tokens"]);
        assert!(m["ttft_ms"].is_u64() && m["duration_ms"].is_u64(), "{m}");
        assert!(
            m["worker"]
                .as_str()
                .is_some_and(|w| w.starts_with("worker-")),
            "a worker name, not its address: {m}"
        );
    }
    assert_eq!(stored[1]["worker"], stored[3]["worker"], "session affinity");

    // JSON instead of a stream, then regenerate it in place.
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&k))
        .json(&json!({"content": "Third", "stream": false, "max_tokens": 8}))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let third = r.json();
    assert_eq!(third["status"], "complete");
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/regenerate"))
        .key(Some(&k))
        .json(&json!({"stream": false, "max_tokens": 8, "params": {"temperature": 1.0, "seed": 3}}))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let again = r.json();
    let stored = messages(&s, &k, &sid).await;
    assert_eq!(stored.len(), 6, "regenerate replaces the last reply");
    assert_eq!(stored[5]["id"], again["message_id"]);
    assert_eq!(stored[5]["content"], again["content"]);
    assert_ne!(stored[5]["id"], third["message_id"]);

    let metrics = Req::new("GET", "/metrics").send(s.addr()).await.text();
    for name in [
        "hearth_time_to_first_token_seconds_count",
        "hearth_generated_tokens_total",
        "hearth_cached_prompt_tokens_total",
        "hearth_requests_total{route=\"/v1/sessions/{id}/messages\",status=\"200\"}",
    ] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }
    s.finish().await;
}

/// A long, fixed-length reply (the tiny model would otherwise stop at random).
fn long_turn(content: &str) -> Value {
    json!({"content": content, "max_tokens": 900, "ignore_eos": true})
}

/// Reads token events until `n` have arrived; returns the text so far.
async fn read_tokens(sse: &mut Sse, n: usize) -> (Vec<Event>, String) {
    let mut seen = Vec::new();
    let mut tokens = 0;
    while tokens < n {
        let e = sse.next().await.expect("stream ended early");
        if e.event == "token" {
            tokens += 1;
        }
        assert_ne!(e.event, "message_end", "finished before {n} tokens");
        seen.push(e);
    }
    let text = fold(&seen).text;
    (seen, text)
}

#[tokio::test]
async fn stop_cancels_and_keeps_the_partial_reply() {
    let s = Stack::start_with("stop", &slow_spec(), Db::Postgres, 1, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session(&s, &k, json!({})).await;
    let mut sse = post_turn(&s, &k, &sid, long_turn("Tell me everything")).await;
    let (mut seen, _) = read_tokens(&mut sse, 3).await;
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/stop"))
        .key(Some(&k))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["stopped"], true, "{}", r.text());
    seen.extend(sse.rest().await);
    let got = fold(&seen);
    let end = got.last.json();
    assert_eq!(got.last.event, "message_end");
    assert_eq!(end["status"], "stopped");
    let completion = end["usage"]["completion_tokens"].as_u64().expect("n");
    assert!(completion < 900, "the stop came too late: {end}");
    let stored = messages(&s, &k, &sid).await;
    assert_eq!(stored[1]["status"], "stopped");
    assert_eq!(stored[1]["content"], json!(got.text));
    assert!(!got.text.is_empty());
    // The cancel reached the worker: nothing is left running there.
    assert_eq!(wait_idle(&s.workers[0]).await, 0.0);
    s.finish().await;
}

#[tokio::test]
async fn another_users_session_is_404_on_every_generation_route() {
    let s = Stack::start("isolation", Db::Postgres, 1, &[]).await;
    let (ka, kb) = (s.key("a").await, s.key("b").await);
    let sid = new_session(&s, &ka, json!({})).await;
    fold(
        &post_turn(&s, &ka, &sid, json!({"content": "mine", "max_tokens": 4}))
            .await
            .rest()
            .await,
    );
    let turn = json!({"content": "let me in", "max_tokens": 4});
    let routes = [
        ("GET", format!("/v1/sessions/{sid}"), None),
        (
            "PATCH",
            format!("/v1/sessions/{sid}"),
            Some(json!({"title": "x"})),
        ),
        ("GET", format!("/v1/sessions/{sid}/messages"), None),
        ("POST", format!("/v1/sessions/{sid}/messages"), Some(turn)),
        (
            "POST",
            format!("/v1/sessions/{sid}/regenerate"),
            Some(json!({})),
        ),
        ("POST", format!("/v1/sessions/{sid}/stop"), None),
        ("GET", format!("/v1/sessions/{sid}/stream"), None),
        ("DELETE", format!("/v1/sessions/{sid}"), None),
    ];
    for (m, p, body) in &routes {
        let mut req = Req::new(m, p).key(Some(&kb));
        if let Some(b) = body {
            req = req.json(b);
        }
        let r = req.send(s.addr()).await;
        assert_eq!(r.status, 404, "{m} {p}: {}", r.text());
        assert_eq!(r.json()["error"]["type"], "not_found_error", "{m} {p}");
        // A bad key is a 401 everywhere, before anything else is looked at.
        let mut req = Req::new(m, p).key(Some("hk_0000000000000000"));
        if let Some(b) = body {
            req = req.json(b);
        }
        assert_eq!(req.send(s.addr()).await.status, 401, "{m} {p}");
    }
    // A's conversation is untouched.
    assert_eq!(messages(&s, &ka, &sid).await.len(), 2);
    s.finish().await;
}

#[tokio::test]
async fn bad_generation_requests_are_refused_and_store_nothing() {
    let s = Stack::start("badgen", Db::Postgres, 1, &[]).await;
    let k = s.limited_key("limited", 3).await;
    let free = s.key("free").await;
    let sid = new_session(&s, &free, json!({})).await;
    let path = format!("/v1/sessions/{sid}/messages");
    let cases: Vec<(Vec<u8>, u16)> = vec![
        (
            json!({"content": "hi", "params": {"temperature": -1}})
                .to_string()
                .into_bytes(),
            422,
        ),
        (
            json!({"content": "hi", "params": {"top_p": 2}})
                .to_string()
                .into_bytes(),
            422,
        ),
        (
            json!({"content": "hi", "max_tokens": 0})
                .to_string()
                .into_bytes(),
            422,
        ),
        (
            json!({"content": "hi", "max_tokens": 100000})
                .to_string()
                .into_bytes(),
            422,
        ),
        (
            json!({"content": "hi", "stop": [""]})
                .to_string()
                .into_bytes(),
            422,
        ),
        (
            json!({"content": "hi", "temperature": 1})
                .to_string()
                .into_bytes(),
            422,
        ),
        (json!({"content": ""}).to_string().into_bytes(), 422),
        (json!({"content": 5}).to_string().into_bytes(), 422),
        (json!({}).to_string().into_bytes(), 422),
        (json!({"content": "a\0b"}).to_string().into_bytes(), 422),
        (b"{\"content\": ".to_vec(), 400),
        (
            json!({"content": "x".repeat(2 << 20)})
                .to_string()
                .into_bytes(),
            413,
        ),
    ];
    for (body, want) in cases {
        let r = Req::new("POST", &path)
            .key(Some(&free))
            .raw(body.clone())
            .send(s.addr())
            .await;
        assert_eq!(
            r.status,
            want,
            "{}: {}",
            String::from_utf8_lossy(&body[..body.len().min(80)]),
            r.text()
        );
        assert!(r.json()["error"]["message"].is_string(), "{}", r.text());
    }
    assert!(messages(&s, &free, &sid).await.is_empty());

    // Three requests a minute for this key: the fourth is a 429 with Retry-After. (All four in
    // one minute: the limiter's windows are UTC minutes.)
    let sid = new_session(&s, &k, json!({})).await;
    hearth_e2e::stack::clear_of_a_minute_boundary(std::time::Duration::from_secs(20)).await;
    let path = format!("/v1/sessions/{sid}/messages");
    let turn = json!({"content": "hi", "max_tokens": 2, "stream": false});
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(
            Req::new("POST", &path)
                .key(Some(&k))
                .json(&turn)
                .send(s.addr())
                .await
                .status,
        );
    }
    assert_eq!(statuses, vec![200, 200, 200]);
    let r = Req::new("POST", &path)
        .key(Some(&k))
        .json(&turn)
        .send(s.addr())
        .await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    let retry = r.retry_after_secs();
    assert!((1..=60).contains(&retry), "{retry}");
    assert_eq!(
        messages(&s, &k, &sid).await.len(),
        6,
        "the refused turn stored nothing"
    );
    // Other keys have their own window.
    let r = Req::new(
        "POST",
        &path.replace(&sid, &new_session(&s, &free, json!({})).await),
    )
    .key(Some(&free))
    .json(&turn)
    .send(s.addr())
    .await;
    assert_eq!(r.status, 200);
    s.finish().await;
}

#[tokio::test]
async fn killing_the_worker_mid_stream_moves_the_reply_to_another() {
    let mut s = Stack::start_with("failover", &slow_spec(), Db::Postgres, 2, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session(&s, &k, json!({})).await;
    let turn = json!({"content": "A long story, please", "max_tokens": 300, "ignore_eos": true});
    let mut sse = post_turn(&s, &k, &sid, turn).await;
    let (mut seen, _) = read_tokens(&mut sse, 5).await;
    let victim = serving_worker(&s).await;
    // Clients see a worker's place in the --worker list, never its address.
    let survivor = format!("worker-{}", 2 - victim);
    s.workers[victim].child.kill().expect("kill -9");
    seen.extend(sse.rest().await);
    let got = fold(&seen);
    assert_eq!(got.last.event, "message_end", "{:?}", got.last);
    let end = got.last.json();
    assert_eq!(end["status"], "complete");
    assert_eq!(end["usage"]["completion_tokens"], 300, "{end}");
    assert_eq!(end["worker"], json!(survivor));
    let stored = messages(&s, &k, &sid).await;
    assert_eq!(stored.len(), 2, "stored once");
    assert_eq!(stored[1]["content"], json!(got.text));
    assert_eq!(stored[1]["status"], "complete");
    assert_eq!(stored[1]["completion_tokens"], 300);
    // /readyz is public: it names the workers the same way, says which is down, and gives
    // neither their addresses nor their errors (which can hold addresses).
    let mut ready = Req::new("GET", "/readyz").send(s.addr()).await;
    for _ in 0..100 {
        if ready.json()["workers"][victim]["ready"] == false {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        ready = Req::new("GET", "/readyz").send(s.addr()).await;
    }
    let body = ready.text();
    for w in &s.workers {
        let port = w.grpc.rsplit(':').next().expect("port");
        assert!(
            !body.contains(port),
            "/readyz names a worker's address: {body}"
        );
    }
    let workers = ready.json()["workers"].clone();
    assert_eq!(
        workers[victim]["name"],
        json!(format!("worker-{}", victim + 1))
    );
    assert_eq!(workers[victim]["ready"], false, "{body}");
    assert_eq!(workers[1 - victim]["ready"], true, "{body}");
    s.finish().await;
}

#[tokio::test]
async fn with_no_worker_left_the_client_gets_an_error_and_the_partial_reply_is_kept() {
    let mut s = Stack::start_with("noworker", &slow_spec(), Db::Postgres, 1, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session(&s, &k, json!({})).await;
    let mut sse = post_turn(&s, &k, &sid, long_turn("Go on")).await;
    let (mut seen, _) = read_tokens(&mut sse, 5).await;
    s.workers[0].child.kill().expect("kill -9");
    seen.extend(sse.rest().await);
    let got = fold(&seen);
    assert_eq!(got.last.event, "error", "{:?}", got.last);
    let err = got.last.json();
    assert_eq!(err["error_type"], "service_unavailable");
    assert!(!got.text.is_empty());
    let stored = messages(&s, &k, &sid).await;
    assert_eq!(stored[1]["status"], "error");
    assert_eq!(stored[1]["content"], json!(got.text));
    // Until a worker is back, new turns get a clear 503 and store nothing.
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&k))
        .json(&json!({"content": "hello?"}))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(messages(&s, &k, &sid).await.len(), 2);
    s.finish().await;
}

#[tokio::test]
async fn a_dropped_client_can_resume_and_the_reply_is_finished_and_stored() {
    let s = Stack::start_with("resume", &slow_spec(), Db::Postgres, 1, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session(&s, &k, json!({})).await;
    let turn = json!({"content": "Once upon a time", "max_tokens": 200, "ignore_eos": true});
    let mut sse = post_turn(&s, &k, &sid, turn).await;
    let (seen, before) = read_tokens(&mut sse, 3).await;
    let last_id = seen.last().and_then(|e| e.id.clone()).expect("id");
    drop(sse);
    // Another turn cannot start while this one runs.
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&k))
        .json(&json!({"content": "me too"}))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 409, "{}", r.text());
    let mut resumed = Req::new("GET", &format!("/v1/sessions/{sid}/stream"))
        .key(Some(&k))
        .header("Last-Event-ID", last_id.clone())
        .events(s.addr())
        .await;
    assert_eq!(resumed.status, 200);
    let rest = resumed.rest().await;
    let (msg, n) = last_id.rsplit_once(':').expect("id shape");
    let n: usize = n.parse().expect("n");
    assert_eq!(
        rest[0].id,
        Some(format!("{msg}:{}", n + 1)),
        "resumes right after"
    );
    let after: String = rest
        .iter()
        .filter(|e| e.event == "token")
        .map(|e| e.json()["text"].as_str().unwrap_or_default().to_string())
        .collect();
    let end = rest.last().expect("end");
    assert_eq!(end.event, "message_end");
    assert_eq!(end.json()["usage"]["completion_tokens"], 200);
    let stored = messages(&s, &k, &sid).await;
    assert_eq!(stored[1]["status"], "complete");
    assert_eq!(stored[1]["content"], json!(format!("{before}{after}")));
    s.finish().await;
}

#[tokio::test]
async fn when_every_worker_is_full_new_requests_get_503() {
    let s = Stack::start_with(
        "admission",
        &slow_spec(),
        Db::Postgres,
        1,
        &["--worker-capacity", "1", "--max-queue", "0"],
    )
    .await;
    let k = s.key("alice").await;
    let (one, two) = (
        new_session(&s, &k, json!({})).await,
        new_session(&s, &k, json!({})).await,
    );
    let mut sse = post_turn(&s, &k, &one, long_turn("first")).await;
    read_tokens(&mut sse, 1).await;
    let r = Req::new("POST", &format!("/v1/sessions/{two}/messages"))
        .key(Some(&k))
        .json(&json!({"content": "second"}))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "service_unavailable");
    assert!(messages(&s, &k, &two).await.is_empty());
    let stop = format!("/v1/sessions/{one}/stop");
    let r = Req::new("POST", &stop).key(Some(&k)).send(s.addr()).await;
    assert_eq!(r.status, 200);
    s.finish().await;
}

#[tokio::test]
async fn a_reply_cut_off_by_an_orchestrator_crash_is_marked_error_after_restart() {
    let mut s = Stack::start_with("crash", &slow_spec(), Db::Postgres, 1, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session(&s, &k, json!({})).await;
    let mut sse = post_turn(&s, &k, &sid, long_turn("Talk")).await;
    // Read on (so the stream never backs up) until a save of the reply's progress shows; the
    // crash must cut a reply that has progress to keep, however fast the worker decodes.
    let (mut seen, _) = read_tokens(&mut sse, 20).await;
    for _ in 0..200 {
        let reply = &messages(&s, &k, &sid).await[1];
        if reply["content"].as_str().is_some_and(|c| !c.is_empty()) {
            break;
        }
        for _ in 0..5 {
            let e = sse.next().await.expect("stream ended early");
            assert_ne!(
                e.event, "message_end",
                "the reply finished before a save showed"
            );
            seen.push(e);
        }
    }
    s.hearth.kill();
    // What was already on its way to the client was streamed too.
    seen.extend(sse.rest().await);
    let streamed = fold(&seen).text;
    let args = Stack::args(
        &s.assets,
        &s.db_url,
        &s.workers,
        &["--orphan-after-secs", "1"],
    );
    s.hearth = Hearth::spawn(&args);
    s.hearth.wait_ready().await;
    let mut last = Value::Null;
    for _ in 0..100 {
        last = messages(&s, &k, &sid).await[1].clone();
        if last["status"] == "error" {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(last["status"], "error", "{last}");
    assert_eq!(last["finish_reason"], "interrupted");
    let saved = last["content"].as_str().expect("content");
    assert!(!saved.is_empty(), "progress was saved while streaming");
    assert!(
        streamed.starts_with(saved),
        "saved text is what was streamed"
    );
    s.finish().await;
}
