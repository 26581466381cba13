//! Replies that run to their end, and requests refused before a reply starts: a multi-turn
//! session streamed, stored and served from the cache, another user's session (idle, or with a
//! reply running), and generation requests that are malformed or over the key's rate limit.

use std::time::Duration;

use hearth_e2e::http::Req;
use hearth_e2e::stack::{
    clear_of_a_minute_boundary, finish, fold, history, new_session, new_session_with, read_tokens,
    stream_turn, stream_turn_with, Db, Stack,
};
use serde_json::json;

#[tokio::test]
async fn a_multi_turn_session_streams_stores_and_reuses_the_cache() {
    // Two workers: the second turn must go where the first left its cache.
    let s = Stack::start("turns", Db::Postgres, 2, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session_with(
        s.addr(),
        &k,
        &json!({"title": "t", "system_prompt": "Be brief."}),
    )
    .await;

    let mut sse = stream_turn_with(
        s.addr(),
        &k,
        &sid,
        &json!({"content": "Hello there", "max_tokens": 24}),
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
        &stream_turn_with(
            s.addr(),
            &k,
            &sid,
            &json!({"content": "And again", "max_tokens": 16}),
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
    let stored = history(s.addr(), &k, &sid).await;
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
    let stored = history(s.addr(), &k, &sid).await;
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

#[tokio::test]
async fn another_users_session_is_404_on_every_generation_route() {
    let s = Stack::start("isolation", Db::Postgres, 1, &[]).await;
    let (ka, kb) = (s.key("a").await, s.key("b").await);
    let sid = new_session(s.addr(), &ka).await;
    fold(
        &stream_turn_with(
            s.addr(),
            &ka,
            &sid,
            &json!({"content": "mine", "max_tokens": 4}),
        )
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
    assert_eq!(history(s.addr(), &ka, &sid).await.len(), 2);
    s.finish().await;
}

#[tokio::test]
async fn another_user_cannot_stop_resume_or_replace_a_live_reply() {
    let s = Stack::scripted("isolation_live", Db::Postgres, 1, 20, &[]).await;
    let (ka, kb) = (s.key("a").await, s.key("b").await);
    let sid = new_session(s.addr(), &ka).await;
    let mut live = stream_turn(s.addr(), &ka, &sid, 60).await;
    read_tokens(&mut live, 2).await;
    let routes = [
        ("POST", format!("/v1/sessions/{sid}/stop"), None),
        ("GET", format!("/v1/sessions/{sid}/stream"), None),
        (
            "POST",
            format!("/v1/sessions/{sid}/regenerate"),
            Some(json!({"max_tokens": 2})),
        ),
        (
            "POST",
            format!("/v1/sessions/{sid}/messages"),
            Some(json!({"content": "mine now", "max_tokens": 2})),
        ),
        ("DELETE", format!("/v1/sessions/{sid}"), None),
    ];
    for (m, p, body) in &routes {
        let mut req = Req::new(m, p).key(Some(&kb));
        if let Some(b) = body {
            req = req.json(b);
        }
        let r = req.send(s.addr()).await;
        assert_eq!(r.status, 404, "{m} {p} on a live reply: {}", r.text());
    }
    // A's reply ran on untouched to its length, and is stored whole.
    let (_, last) = finish(&mut live).await;
    assert_eq!(last.event, "message_end", "{last:?}");
    assert_eq!(last.json()["finish_reason"], "length");
    assert_eq!(last.json()["usage"]["completion_tokens"], 60);
    let stored = history(s.addr(), &ka, &sid).await;
    assert_eq!(stored.len(), 2);
    assert_eq!(stored[1]["status"], "complete");
    s.finish().await;
}

#[tokio::test]
async fn a_turn_past_the_sessions_byte_cap_is_422_and_stores_nothing() {
    let s = Stack::scripted(
        "bytecap",
        Db::Sqlite,
        1,
        5,
        &["--max-session-bytes", "2048"],
    )
    .await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let path = format!("/v1/sessions/{sid}/messages");
    let post = |text: String| {
        Req::new("POST", &path)
            .key(Some(&k))
            .json(&json!({"content": text, "max_tokens": 2, "stream": false}))
    };
    let r = post("a".repeat(1500)).send(s.addr()).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = post("b".repeat(1000)).send(s.addr()).await;
    assert_eq!(r.status, 422, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "session_full", "{}", r.text());
    assert!(r.text().contains("2048"), "{}", r.text());
    assert_eq!(history(s.addr(), &k, &sid).await.len(), 2, "nothing stored");
    // A turn that fits still goes through.
    let r = post("c".repeat(100)).send(s.addr()).await;
    assert_eq!(r.status, 200, "{}", r.text());
    s.finish().await;
}

#[tokio::test]
async fn a_sessions_messages_come_a_page_at_a_time() {
    let s = Stack::scripted("pages", Db::Postgres, 1, 5, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    for i in 0..3 {
        let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
            .key(Some(&k))
            .json(&json!({"content": format!("turn {i}"), "max_tokens": 2, "stream": false}))
            .send(s.addr())
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let (addr, key, sid) = (s.addr(), k.clone(), sid.clone());
    let page = move |q: &str| {
        let (path, key) = (format!("/v1/sessions/{sid}/messages{q}"), key.clone());
        async move { Req::new("GET", &path).key(Some(&key)).send(addr).await }
    };
    let seqs = |v: &serde_json::Value| -> Vec<i64> {
        v["data"]
            .as_array()
            .expect("data")
            .iter()
            .map(|m| m["seq"].as_i64().expect("seq"))
            .collect()
    };
    let newest = page("?limit=4").await.json();
    assert_eq!(seqs(&newest), [3, 4, 5, 6], "the newest four, oldest first");
    assert_eq!(newest["next_cursor"], "3");
    let earlier = page("?limit=4&before=3").await.json();
    assert_eq!(seqs(&earlier), [1, 2]);
    assert!(earlier["next_cursor"].is_null(), "{earlier}");
    let all = page("").await.json();
    assert_eq!(seqs(&all), [1, 2, 3, 4, 5, 6]);
    assert!(all["next_cursor"].is_null());
    for bad in ["?limit=0", "?limit=1001", "?before=abc", "?before=-1"] {
        let r = page(bad).await;
        assert_eq!(r.status, 422, "{bad}: {}", r.text());
    }
    s.finish().await;
}

#[tokio::test]
async fn bad_generation_requests_are_refused_and_store_nothing() {
    let s = Stack::start("badgen", Db::Postgres, 1, &[]).await;
    let k = s.limited_key("limited", 3).await;
    let free = s.key("free").await;
    let sid = new_session(s.addr(), &free).await;
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
    assert!(history(s.addr(), &free, &sid).await.is_empty());

    // Three requests a minute for this key: the fourth is a 429 with Retry-After. (All four in
    // one minute: the limiter's windows are UTC minutes.)
    let sid = new_session(s.addr(), &k).await;
    clear_of_a_minute_boundary(Duration::from_secs(20)).await;
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
        history(s.addr(), &k, &sid).await.len(),
        6,
        "the refused turn stored nothing"
    );
    // Other keys have their own window.
    let r = Req::new(
        "POST",
        &path.replace(&sid, &new_session(s.addr(), &free).await),
    )
    .key(Some(&free))
    .json(&turn)
    .send(s.addr())
    .await;
    assert_eq!(r.status, 200);
    s.finish().await;
}
