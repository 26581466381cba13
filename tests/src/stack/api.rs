//! The HTTP API called the way the tests call it: sessions, turns answered as JSON or streamed,
//! a session's stored messages, OpenAI chat completions, and the rate limiter's minute.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::http::{Reply, Req, Sse};

/// Creates an empty session for `key`'s user; its id.
pub async fn new_session(addr: SocketAddr, key: &str) -> String {
    new_session_with(addr, key, &json!({})).await
}

/// Creates a session from `body` (title, system prompt, params…) for `key`'s user; its id.
pub async fn new_session_with(addr: SocketAddr, key: &str, body: &Value) -> String {
    let r = Req::new("POST", "/v1/sessions")
        .key(Some(key))
        .json(body)
        .send(addr)
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    r.json()["id"].as_str().expect("id").to_string()
}

/// A session's stored messages, in order.
pub async fn history(addr: SocketAddr, key: &str, sid: &str) -> Vec<Value> {
    let mut all: Vec<Value> = Vec::new();
    let mut before: Option<String> = None;
    loop {
        let page = match &before {
            Some(c) => format!("/v1/sessions/{sid}/messages?before={c}"),
            None => format!("/v1/sessions/{sid}/messages"),
        };
        let r = Req::new("GET", &page).key(Some(key)).send(addr).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        let mut data = v["data"].as_array().cloned().expect("messages");
        data.append(&mut all);
        all = data;
        match v["next_cursor"].as_str() {
            Some(c) => before = Some(c.to_string()),
            None => return all,
        }
    }
}

/// The stored reply of a session's first turn (its second message) once it is no longer
/// `streaming`, polled every 100 ms; panics if it still is after `within`.
pub async fn settled_reply(addr: SocketAddr, key: &str, sid: &str, within: Duration) -> Value {
    let deadline = Instant::now() + within;
    loop {
        let reply = history(addr, key, sid)
            .await
            .get(1)
            .cloned()
            .unwrap_or_default();
        if reply["status"] != "streaming" {
            return reply;
        }
        assert!(
            Instant::now() < deadline,
            "the reply was still streaming after {within:?}: {reply}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A turn of `content`, at most `max_tokens` long, answered as JSON once it is finished; the
/// request must succeed.
pub async fn json_turn(
    addr: SocketAddr,
    key: &str,
    sid: &str,
    content: &str,
    max_tokens: u32,
) -> Value {
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(key))
        .json(&json!({"content": content, "max_tokens": max_tokens, "stream": false}))
        .send(addr)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// A turn with `body`, streamed; the stream of a request that must be accepted.
pub async fn stream_turn_with(addr: SocketAddr, key: &str, sid: &str, body: &Value) -> Sse {
    let sse = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(key))
        .json(body)
        .events(addr)
        .await;
    assert_eq!(sse.status, 200);
    sse
}

/// A reply of exactly `tokens` tokens to a new message in `sid`, streamed.
pub async fn stream_turn(addr: SocketAddr, key: &str, sid: &str, tokens: u32) -> Sse {
    let body = json!({"content": "Tell me everything", "max_tokens": tokens, "ignore_eos": true});
    stream_turn_with(addr, key, sid, &body).await
}

/// `POST path` with the JSON `body` as `key`'s user, whatever the answer.
pub async fn post(addr: SocketAddr, key: &str, path: &str, body: &Value) -> Reply {
    Req::new("POST", path)
        .key(Some(key))
        .json(body)
        .send(addr)
        .await
}

/// An OpenAI chat completion with `body`, whatever the answer.
pub async fn completion(addr: SocketAddr, key: &str, body: &Value) -> Reply {
    Req::new("POST", "/v1/chat/completions")
        .key(Some(key))
        .json(body)
        .send(addr)
        .await
}

/// An OpenAI chat completion (`body`, not streamed) that must succeed; its JSON reply.
pub async fn chat_completion(addr: SocketAddr, key: &str, body: &Value) -> Value {
    let r = completion(addr, key, body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// Waits, if need be, until the current UTC minute (the rate limiter's window) has at least
/// `need` left, so a test that counts requests per minute does all its counting in one window.
pub async fn clear_of_a_minute_boundary(need: Duration) {
    let now = hearth_orchestrator::storage::now_ms();
    let left = 60_000 - now.rem_euclid(60_000);
    if left < need.as_millis() as i64 {
        tokio::time::sleep(Duration::from_millis(left as u64 + 50)).await;
    }
}
