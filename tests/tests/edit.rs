//! Edit and resend through the whole stack: `POST /v1/sessions/{id}/messages/{message_id}/edit`
//! replaces a user message and everything after it, then answers from the shortened history.
//!
//! The worker is the scripted one: it echoes its prompt, so each reply shows exactly which
//! history the orchestrator sent (the tiny tokenizer has one token per character).

use hearth_e2e::http::{Req, Sse};
use hearth_e2e::stack::{history, json_turn, new_session, token_text, Db, Stack};
use hearth_worker::fixtures::TinySpec;
use serde_json::{json, Value};

async fn start(tag: &str, db: Db) -> Stack {
    Stack::start_full(
        tag,
        &TinySpec::default(),
        db,
        1,
        &["--kv-budget", "64MiB", "--scripted-token-ms", "5"],
        &[],
    )
    .await
}

fn edit_path(sid: &str, mid: &str) -> String {
    format!("/v1/sessions/{sid}/messages/{mid}/edit")
}

async fn edit_and_resend(db: Db) {
    let s = start("edit", db).await;
    let (ka, kb) = (s.key("alice").await, s.key("bob").await);
    let sid = new_session(s.addr(), &ka).await;
    let mut asked = Vec::new();
    for q in ["alpha one", "bravo two", "charlie three"] {
        let t = json_turn(s.addr(), &ka, &sid, q, 40).await;
        asked.push(t["user_message_id"].as_str().expect("id").to_string());
    }
    let before = history(s.addr(), &ka, &sid).await;
    assert_eq!(before.len(), 6);
    let first = asked[0].clone();
    let a_reply = before[1]["id"].as_str().expect("reply id").to_string();
    let body = json!({"content": "delta edited", "max_tokens": 60});

    // Refusals, none of which changes anything.
    let other_sid = new_session(s.addr(), &kb).await;
    let b_turn = json_turn(s.addr(), &kb, &other_sid, "bob's question", 40).await;
    let b_msg = b_turn["user_message_id"].as_str().expect("id").to_string();
    let refused: Vec<(&str, String, &str, Value, u16, &str)> = vec![
        // Bob cannot edit Alice's message: her session is not his.
        (
            "bob, alice's session",
            edit_path(&sid, &first),
            &kb,
            body.clone(),
            404,
            "not_found_error",
        ),
        // Nor through his own session.
        (
            "bob's session, alice's message",
            edit_path(&other_sid, &first),
            &kb,
            body.clone(),
            404,
            "not_found_error",
        ),
        // Alice cannot edit Bob's message in her session.
        (
            "alice's session, bob's message",
            edit_path(&sid, &b_msg),
            &ka,
            body.clone(),
            404,
            "not_found_error",
        ),
        (
            "unknown message",
            edit_path(&sid, "0123456789abcdef0123456789abcdef"),
            &ka,
            body.clone(),
            404,
            "not_found_error",
        ),
        (
            "malformed message id",
            edit_path(&sid, "nope"),
            &ka,
            body.clone(),
            404,
            "not_found_error",
        ),
        (
            "a reply",
            edit_path(&sid, &a_reply),
            &ka,
            body.clone(),
            422,
            "not_a_user_message",
        ),
        (
            "empty content",
            edit_path(&sid, &first),
            &ka,
            json!({"content": "  "}),
            422,
            "invalid_request_error",
        ),
        (
            "no content",
            edit_path(&sid, &first),
            &ka,
            json!({"max_tokens": 5}),
            422,
            "invalid_request_error",
        ),
        (
            "bad params",
            edit_path(&sid, &first),
            &ka,
            json!({"content": "x", "params": {"temperature": -1}}),
            422,
            "invalid_request_error",
        ),
        (
            "unknown field",
            edit_path(&sid, &first),
            &ka,
            json!({"content": "x", "role": "system"}),
            422,
            "invalid_request_error",
        ),
    ];
    for (what, path, key, body, status, kind) in refused {
        let r = Req::new("POST", &path)
            .key(Some(key))
            .json(&body)
            .send(s.addr())
            .await;
        assert_eq!(r.status, status, "{what}: {}", r.text());
        assert_eq!(r.json()["error"]["type"], kind, "{what}: {}", r.text());
    }
    assert_eq!(history(s.addr(), &ka, &sid).await, before);
    assert_eq!(history(s.addr(), &kb, &other_sid).await.len(), 2);

    // While a reply runs in the session, an edit is a 409 and changes nothing.
    let mut running = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&ka))
        .json(&json!({"content": "echo for a long time", "max_tokens": 5000}))
        .events(s.addr())
        .await;
    assert_eq!(running.status, 200);
    let start = running.next().await.expect("message_start");
    assert_eq!(start.event, "message_start");
    let r = Req::new("POST", &edit_path(&sid, &first))
        .key(Some(&ka))
        .json(&body)
        .send(s.addr())
        .await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "conflict_error");
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/stop"))
        .key(Some(&ka))
        .send(s.addr())
        .await;
    assert_eq!(r.json()["stopped"], true, "{}", r.text());
    running.rest().await;
    let with_stopped = history(s.addr(), &ka, &sid).await;
    assert_eq!(with_stopped.len(), 8);
    assert_eq!(with_stopped[..6], before[..]);

    // Edit the first message: the answer streams like a new turn, from the edited message
    // alone (the scripted worker echoes the prompt it was given).
    let mut sse: Sse = Req::new("POST", &edit_path(&sid, &first))
        .key(Some(&ka))
        .json(&body)
        .events(s.addr())
        .await;
    assert_eq!(sse.status, 200);
    let events = sse.rest().await;
    assert_eq!(events[0].event, "message_start", "{events:?}");
    assert_eq!(events[0].json()["user_message_id"], json!(first));
    let reply_id = events[0].json()["message_id"]
        .as_str()
        .expect("id")
        .to_string();
    let end = events.last().expect("end");
    assert_eq!(end.event, "message_end", "{events:?}");
    assert_eq!(end.json()["status"], "complete");
    let text = token_text(&events);
    assert!(text.contains("delta edited"), "{text:?}");
    for gone in ["alpha", "bravo", "charlie", "echo for"] {
        assert!(
            !text.contains(gone),
            "the prompt still held {gone:?}: {text:?}"
        );
    }

    let after = history(s.addr(), &ka, &sid).await;
    assert_eq!(after.len(), 2, "{after:?}");
    assert_eq!(after[0]["id"], json!(first));
    assert_eq!(after[0]["role"], "user");
    assert_eq!(after[0]["content"], "delta edited");
    assert_eq!(after[0]["seq"], 1);
    assert_eq!(after[1]["id"], json!(reply_id));
    assert_eq!(after[1]["role"], "assistant");
    assert_eq!(after[1]["status"], "complete");
    assert_eq!(after[1]["content"], json!(text));

    // The session goes on from there; a JSON edit (`"stream": false`) of a later message works
    // the same way and keeps what came before it.
    let second = json_turn(s.addr(), &ka, &sid, "echo two", 40).await;
    let second_id = second["user_message_id"].as_str().expect("id");
    let r = Req::new("POST", &edit_path(&sid, second_id))
        .key(Some(&ka))
        .json(&json!({"content": "foxtrot", "max_tokens": 200, "stream": false}))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let reply = r.json();
    assert_eq!(reply["user_message_id"], json!(second_id));
    let content = reply["content"].as_str().expect("content");
    assert!(
        content.contains("delta edited") && content.contains("foxtrot"),
        "{content:?}"
    );
    assert!(!content.contains("echo two"), "{content:?}");
    let after = history(s.addr(), &ka, &sid).await;
    let shape: Vec<(&str, &str)> = after
        .iter()
        .map(|m| {
            (
                m["role"].as_str().expect("role"),
                m["status"].as_str().expect("status"),
            )
        })
        .collect();
    assert_eq!(
        shape,
        [
            ("user", "complete"),
            ("assistant", "complete"),
            ("user", "complete"),
            ("assistant", "complete")
        ]
    );
    assert_eq!(after[2]["content"], "foxtrot");
    assert_eq!(after[3]["content"], json!(content));
    // Bob's session never moved.
    assert_eq!(history(s.addr(), &kb, &other_sid).await.len(), 2);
    s.finish().await;
}

#[tokio::test]
async fn edit_and_resend_on_postgres() {
    edit_and_resend(Db::Postgres).await;
}

#[tokio::test]
async fn edit_and_resend_on_sqlite() {
    edit_and_resend(Db::Sqlite).await;
}
