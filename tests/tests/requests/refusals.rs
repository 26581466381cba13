//! Requests the server must refuse, each with the answer its documentation gives and nothing
//! stored: a queued request past `--queue-timeout-secs`, a regenerate with nothing to regenerate
//! or while a reply runs, and stops past their per-key limit. A refused turn is not charged to
//! the caller's rate limit.

use std::time::{Duration, Instant};

use hearth_e2e::http::{Reply, Req};
use hearth_e2e::stack::{
    clear_of_a_minute_boundary, history, metric, new_session, stream_turn, Db, Stack,
};
use serde_json::json;

async fn regenerate(s: &Stack, key: &str, sid: &str) -> Reply {
    Req::new("POST", &format!("/v1/sessions/{sid}/regenerate"))
        .key(Some(key))
        .json(&json!({"max_tokens": 2, "stream": false}))
        .send(s.addr())
        .await
}

async fn stop(s: &Stack, key: &str, sid: &str) -> Reply {
    Req::new("POST", &format!("/v1/sessions/{sid}/stop"))
        .key(Some(key))
        .send(s.addr())
        .await
}

#[tokio::test]
async fn a_queued_request_is_answered_503_once_the_queue_timeout_passes() {
    let s = Stack::scripted(
        "queuetimeout",
        Db::Sqlite,
        1,
        40,
        &[
            "--worker-capacity",
            "1",
            "--max-queue",
            "4",
            "--queue-timeout-secs",
            "1",
        ],
    )
    .await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    // The one worker place is taken for the whole test.
    let mut busy = stream_turn(s.addr(), &k, &sid, 900).await;
    busy.next().await.expect("message_start");

    let other = new_session(s.addr(), &k).await;
    let started = Instant::now();
    let r = Req::new("POST", &format!("/v1/sessions/{other}/messages"))
        .key(Some(&k))
        .json(&json!({"content": "hi", "max_tokens": 2, "stream": false}))
        .send(s.addr())
        .await;
    let waited = started.elapsed();
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "service_unavailable");
    // A lower bound only: a slow machine cannot answer early, however slow it is. How soon
    // after the timeout the answer comes is a matter for the benchmarks.
    println!("a queued request was answered 503 after {waited:?} (queue timeout 1 s)");
    assert!(
        waited >= Duration::from_millis(900),
        "answered after {waited:?}, before the 1 s queue timeout had passed"
    );
    assert!(
        history(s.addr(), &k, &other).await.is_empty(),
        "nothing stored"
    );
    assert_eq!(metric(s.addr(), "hearth_queue_depth").await, 0.0);

    // Once the place is free, the same request is served.
    let r = stop(&s, &k, &sid).await;
    assert_eq!(r.status, 200, "{}", r.text());
    drop(busy);
    let r = Req::new("POST", &format!("/v1/sessions/{other}/messages"))
        .key(Some(&k))
        .json(&json!({"content": "hi", "max_tokens": 2, "stream": false}))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    s.finish().await;
}

#[tokio::test]
async fn a_regenerate_with_no_reply_or_beside_a_running_one_is_409_and_changes_nothing() {
    let s = Stack::scripted("regen409", Db::Postgres, 1, 40, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;

    // Nothing to regenerate in a new session.
    let r = regenerate(&s, &k, &sid).await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("no reply to regenerate")),
        "{}",
        r.text()
    );
    assert!(history(s.addr(), &k, &sid).await.is_empty());

    // A reply is running: a regenerate, a new message and an edit all wait their turn.
    let mut running = stream_turn(s.addr(), &k, &sid, 900).await;
    let start = running.next().await.expect("message_start").json();
    let user_id = start["user_message_id"]
        .as_str()
        .expect("user id")
        .to_string();
    let before = history(s.addr(), &k, &sid).await;
    assert_eq!(before.len(), 2);
    let r = regenerate(&s, &k, &sid).await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "conflict_error");
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&k))
        .json(&json!({"content": "and another", "stream": false}))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 409, "{}", r.text());
    let r = Req::new(
        "POST",
        &format!("/v1/sessions/{sid}/messages/{user_id}/edit"),
    )
    .key(Some(&k))
    .json(&json!({"content": "changed", "stream": false}))
    .send(s.addr())
    .await;
    assert_eq!(r.status, 409, "{}", r.text());
    let after = history(s.addr(), &k, &sid).await;
    assert_eq!(after.len(), 2, "{after:?}");
    assert_eq!(after[0]["content"], before[0]["content"]);
    assert_eq!(after[1]["id"], before[1]["id"]);

    // Once it ends, regenerate replaces it.
    let r = stop(&s, &k, &sid).await;
    assert_eq!(r.status, 200, "{}", r.text());
    drop(running);
    let r = regenerate(&s, &k, &sid).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let after = history(s.addr(), &k, &sid).await;
    assert_eq!(after.len(), 2);
    assert_ne!(after[1]["id"], before[1]["id"], "the reply was replaced");
    s.finish().await;
}

#[tokio::test]
async fn stops_past_their_per_key_limit_get_429_with_retry_after() {
    let s = Stack::start("stoplimit", Db::Sqlite, 1, &[]).await;
    let (k, other) = (s.key("alice").await, s.key("bob").await);
    let sid = new_session(s.addr(), &k).await;
    let theirs = new_session(s.addr(), &other).await;
    // 120 stops a minute per key (all counted in one UTC minute).
    clear_of_a_minute_boundary(Duration::from_secs(30)).await;
    for i in 0..120 {
        let r = stop(&s, &k, &sid).await;
        assert_eq!(r.status, 200, "stop {i}: {}", r.text());
        assert_eq!(r.json()["stopped"], false);
    }
    let r = stop(&s, &k, &sid).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    let retry = r.retry_after_secs();
    assert!((1..=60).contains(&retry), "{retry}");
    // Another key's stops are counted apart.
    assert_eq!(stop(&s, &other, &theirs).await.status, 200);
    s.finish().await;
}

#[tokio::test]
async fn a_refused_turn_is_not_charged_to_the_rate_limit() {
    let s = Stack::start(
        "refusedfree",
        Db::Sqlite,
        1,
        &["--requests-per-minute", "1"],
    )
    .await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let messages = format!("/v1/sessions/{sid}/messages");
    let post = |body: serde_json::Value| {
        let (messages, k, addr) = (&messages, &k, s.addr());
        async move {
            Req::new("POST", messages)
                .key(Some(k))
                .json(&body)
                .send(addr)
                .await
        }
    };
    // Every request below falls in one UTC minute, the limit's window.
    clear_of_a_minute_boundary(Duration::from_secs(30)).await;
    // Refused for what the session holds, for the served model, or for the message named.
    let r = regenerate(&s, &k, &sid).await;
    assert_eq!(r.status, 409, "{}", r.text());
    let r = post(json!({"content": "hi", "max_tokens": 1_000_000, "stream": false})).await;
    assert_eq!(r.status, 422, "{}", r.text());
    let missing = "0".repeat(32);
    let r = Req::new(
        "POST",
        &format!("/v1/sessions/{sid}/messages/{missing}/edit"),
    )
    .key(Some(&k))
    .json(&json!({"content": "changed", "stream": false}))
    .send(s.addr())
    .await;
    assert_eq!(r.status, 404, "{}", r.text());
    assert!(history(s.addr(), &k, &sid).await.is_empty());
    // None of them used the one request a minute: this turn is served, and the next is not.
    let r = post(json!({"content": "hi", "max_tokens": 2, "stream": false})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = post(json!({"content": "again", "max_tokens": 2, "stream": false})).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(history(s.addr(), &k, &sid).await.len(), 2);
    s.finish().await;
}

/// Sends a request's header (announcing a 1 MB body) and as much of the body as `body` holds;
/// the first bytes of the answer, if one comes within a minute.
async fn header_then_wait(addr: std::net::SocketAddr, key: Option<&str>, body: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    let len = if body.is_empty() {
        1_000_000
    } else {
        body.len()
    };
    let head = format!(
        "POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}\
         Content-Type: application/json\r\nContent-Length: {len}\r\n\r\n"
    );
    conn.write_all(head.as_bytes()).await.expect("header");
    conn.write_all(body).await.expect("body");
    let mut buf = vec![0; 512];
    let n = tokio::time::timeout(Duration::from_secs(60), conn.read(&mut buf))
        .await
        .map_err(|_| "no answer within a minute")
        .expect("an answer before the body")
        .expect("read");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[tokio::test]
async fn a_body_without_a_valid_key_is_refused_before_it_is_read() {
    // A server that read the body first would wait ten minutes for this one.
    let s = Stack::scripted(
        "keyfirst",
        Db::Sqlite,
        1,
        10,
        &["--body-timeout-secs", "600"],
    )
    .await;
    for key in [None, Some("hk_not_a_key_of_this_server")] {
        let answer = header_then_wait(s.addr(), key, b"").await;
        assert!(answer.starts_with("HTTP/1.1 401"), "{key:?}: {answer}");
    }
    // With a valid key the body is read and the request served as usual.
    let k = s.key("alice").await;
    let answer = header_then_wait(s.addr(), Some(&k), b"{}").await;
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
}

/// A refused value's error names its field in OpenAI's `param` (beside a message that names it
/// too) and says what went wrong in `code`, on both APIs and whether the value failed a range
/// check or did not parse; a request wrong as a whole has `param` null.
#[tokio::test]
async fn a_refused_value_names_its_field_in_param() {
    let s = Stack::scripted("param", Db::Sqlite, 1, 5, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let chat = |extra: serde_json::Value| {
        let mut body =
            json!({"model": "scripted", "messages": [{"role": "user", "content": "hi"}]});
        for (f, v) in extra.as_object().expect("fields") {
            body[f] = v.clone();
        }
        body
    };
    let turn = format!("/v1/sessions/{sid}/messages");
    for (path, body, code, param) in [
        (
            "/v1/chat/completions",
            chat(json!({"temperature": -1})),
            "invalid_value",
            Some("temperature"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"max_tokens": "many"})),
            "invalid_value",
            Some("max_tokens"),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "scripted", "messages": [{"role": "wizard", "content": "hi"}]}),
            "invalid_value",
            Some("messages[0].role"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"top_logprobs": 3})),
            "invalid_value",
            Some("top_logprobs"),
        ),
        (
            turn.as_str(),
            json!({"content": "hi", "params": {"top_p": 2}}),
            "invalid_value",
            Some("params.top_p"),
        ),
        (
            turn.as_str(),
            json!({"content": " "}),
            "invalid_value",
            Some("content"),
        ),
        (
            turn.as_str(),
            json!({"contnet": "hi"}),
            "invalid_value",
            Some("contnet"),
        ),
        (turn.as_str(), json!([1]), "invalid_value", None),
    ] {
        let r = Req::new("POST", path)
            .key(Some(&k))
            .json(&body)
            .send(s.addr())
            .await;
        let e = &r.json()["error"];
        assert_eq!(r.status, 422, "{body}: {}", r.text());
        assert_eq!(e["code"], code, "{body}: {}", r.text());
        assert_eq!(e["param"].as_str(), param, "{body}: {}", r.text());
        if let Some(p) = param {
            let m = e["message"].as_str().expect("a message");
            assert!(m.starts_with(&format!("{p}: ")), "{body}: {m}");
        }
    }
    assert!(
        history(s.addr(), &k, &sid).await.is_empty(),
        "a refused turn was stored"
    );
}
