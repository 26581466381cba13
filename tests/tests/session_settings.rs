//! A session's stored default reply length (`max_tokens`, set on create or PATCH) through the
//! whole stack: turns without their own `max_tokens` use it, a turn's own value overrides it,
//! clearing it falls back to the server's default, and bad values are refused without a change.
//!
//! The worker is the scripted one: it sends exactly `max_new_tokens` tokens, so a reply's
//! length shows which limit the orchestrator asked for.

use hearth_e2e::http::Req;
use hearth_e2e::stack::{Db, Stack};
use hearth_worker::fixtures::TinySpec;
use serde_json::{json, Value};

async fn patch(s: &Stack, key: &str, sid: &str, body: Value) -> (u16, Value) {
    let r = Req::new("PATCH", &format!("/v1/sessions/{sid}"))
        .key(Some(key))
        .json(&body)
        .send(s.addr())
        .await;
    (r.status, r.json())
}

async fn completion_tokens(s: &Stack, key: &str, sid: &str, body: Value) -> u64 {
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(key))
        .json(&body)
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["usage"]["completion_tokens"]
        .as_u64()
        .expect("completion_tokens")
}

#[tokio::test]
async fn session_max_tokens_is_stored_and_used_by_its_turns() {
    let s = Stack::start_full(
        "session-settings",
        &TinySpec::default(),
        Db::Sqlite,
        1,
        &["--kv-budget", "64MiB", "--scripted-token-ms", "1"],
        &[],
    )
    .await;
    let key = s.key("alice").await;
    let r = Req::new("POST", "/v1/sessions")
        .key(Some(&key))
        .json(&json!({"max_tokens": 7}))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["max_tokens"], 7);
    let sid = r.json()["id"].as_str().expect("id").to_string();
    let turn = json!({"content": "hello there", "stream": false});
    assert_eq!(completion_tokens(&s, &key, &sid, turn.clone()).await, 7);

    let (status, body) = patch(&s, &key, &sid, json!({"max_tokens": 11})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["max_tokens"], 11);
    assert_eq!(completion_tokens(&s, &key, &sid, turn.clone()).await, 11);
    // A turn's own value wins over the session's.
    let own = json!({"content": "again", "max_tokens": 3, "stream": false});
    assert_eq!(completion_tokens(&s, &key, &sid, own).await, 3);

    // Bad values are refused by name and change nothing.
    for bad in [json!(0), json!(1 << 30)] {
        let (status, body) = patch(&s, &key, &sid, json!({"max_tokens": bad})).await;
        assert_eq!(status, 422, "max_tokens {bad}: {body}");
        assert!(body.to_string().contains("max_tokens"), "{body}");
    }
    for bad in [json!(-1), json!(1.5), json!("ten")] {
        let (status, body) = patch(&s, &key, &sid, json!({"max_tokens": bad})).await;
        assert_eq!(status, 422, "max_tokens {bad}: {body}");
    }
    let r = Req::new("GET", &format!("/v1/sessions/{sid}"))
        .key(Some(&key))
        .send(s.addr())
        .await;
    assert_eq!(r.json()["max_tokens"], 11);

    // Another user cannot change it.
    let other = s.key("bob").await;
    let (status, _) = patch(&s, &other, &sid, json!({"max_tokens": 5})).await;
    assert_eq!(status, 404);

    // `null` clears it: the server's default applies again (longer than 11 here).
    let (status, body) = patch(&s, &key, &sid, json!({"max_tokens": null})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["max_tokens"], Value::Null);
    assert!(completion_tokens(&s, &key, &sid, turn).await > 11);
    s.finish().await;
}
