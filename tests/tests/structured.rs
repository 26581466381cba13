//! Constrained decoding end to end. The tiny random-weight model's free replies are noise; with a
//! grammar, the same model answers in JSON that validates against the request's schema, in the
//! words a Lark grammar allows, or in text a regular expression matches, on every API. A reply
//! cut by `max_tokens` says `length`; a grammar that does not compile is a 400 that names it,
//! and nothing is stored.

use hearth_e2e::http::Req;
use hearth_e2e::stack::{chat_completion, history, new_session, post, Db, Stack};
use serde_json::{json, Value};

fn person() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}
        },
        "required": ["name", "age"],
        "additionalProperties": false
    })
}

/// Panics unless `text` is JSON that validates against [`person`].
fn check_person(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    let o = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {text}"));
    for k in o.keys() {
        assert!(["name", "age", "tags"].contains(&k.as_str()), "{k}: {text}");
    }
    let name = o["name"].as_str().unwrap_or_else(|| panic!("name: {text}"));
    assert!(name.chars().count() <= 8, "{text}");
    let age = o["age"].as_u64().unwrap_or_else(|| panic!("age: {text}"));
    assert!(age <= 150, "{text}");
    if let Some(tags) = o.get("tags") {
        let tags = tags.as_array().unwrap_or_else(|| panic!("tags: {text}"));
        assert!(tags.len() <= 3, "{text}");
        assert!(tags.iter().all(|t| t == "a" || t == "b"), "{text}");
    }
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": "tiny", "max_tokens": 120, "temperature": 1.0, "seed": 11,
                          "messages": [{"role": "user", "content": "Who are you?"}]});
    for (k, v) in extra.as_object().expect("object") {
        body[k] = v.clone();
    }
    body
}

fn message(v: &Value, i: usize) -> String {
    v["choices"][i]["message"]["content"]
        .as_str()
        .expect("content")
        .to_string()
}

/// `text` is three digits, a dash and two lowercase letters.
fn is_code(text: &str) -> bool {
    let b = text.as_bytes();
    b.len() == 6
        && b[..3].iter().all(u8::is_ascii_digit)
        && b[3] == b'-'
        && b[4..].iter().all(u8::is_ascii_lowercase)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_follow_the_requested_grammar_on_every_api() {
    let s = Stack::start("structured", Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;

    // Without a grammar the random model's reply is not JSON at all.
    let free = chat_completion(s.addr(), &k, &chat(json!({}))).await;
    assert!(serde_json::from_str::<Value>(&message(&free, 0)).is_err());

    // A JSON Schema, on two choices with their own seeds.
    let format = json!({"type": "json_schema",
                        "json_schema": {"name": "person", "schema": person(), "strict": true}});
    let v = chat_completion(
        s.addr(),
        &k,
        &chat(json!({"response_format": format, "n": 2})),
    )
    .await;
    for i in 0..2 {
        check_person(&message(&v, i));
        assert_eq!(v["choices"][i]["finish_reason"], "stop", "{v}");
    }
    let any = chat_completion(
        s.addr(),
        &k,
        &chat(json!({"response_format": {"type": "json_object"}, "seed": 3})),
    )
    .await;
    let text = message(&any, 0);
    let parsed: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert!(parsed.is_object(), "{text}");

    // A regular expression on the legacy completions.
    let r = post(
        s.addr(),
        &k,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "Code:", "max_tokens": 20, "temperature": 1.0,
                "grammar": {"type": "regex", "pattern": "[0-9]{3}-[a-z]{2}"}}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let text = r.json()["choices"][0]["text"]
        .as_str()
        .expect("text")
        .to_string();
    assert!(is_code(&text), "{text:?}");

    // A Lark grammar on the native API: the stored reply follows it.
    let sid = new_session(s.addr(), &k).await;
    let lark = r#"start: "The answer is " ("yes" | "no") "." "#;
    let r = post(
        s.addr(),
        &k,
        &format!("/v1/sessions/{sid}/messages"),
        &json!({"content": "Well?", "stream": false, "max_tokens": 40,
                "params": {"temperature": 1.0},
                "grammar": {"type": "lark", "grammar": lark}}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let stored = history(s.addr(), &k, &sid).await;
    let reply = stored[1]["content"].as_str().expect("content");
    assert!(
        reply == "The answer is yes." || reply == "The answer is no.",
        "{reply:?}"
    );
    assert_eq!(stored[1]["finish_reason"], "stop");
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_reply_says_length_and_a_bad_grammar_is_a_400_that_stores_nothing() {
    let s = Stack::start("structured_refusals", Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;

    // Three tokens cannot hold the object: the reply is its start, and says it was cut.
    let mut sse = Req::new("POST", "/v1/chat/completions")
        .key(Some(&k))
        .json(&chat(json!({"response_format": {"type": "json_schema",
                                "json_schema": {"name": "p", "schema": person()}},
                            "max_tokens": 3, "stream": true})))
        .events(s.addr())
        .await;
    assert_eq!(sse.status, 200);
    let events = sse.rest().await;
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| e.json())
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(text.starts_with('{'), "{text:?}");
    assert!(serde_json::from_str::<Value>(&text).is_err(), "{text:?}");
    let last = chunks.last().expect("a chunk");
    assert_eq!(last["choices"][0]["finish_reason"], "length");

    for (body, field) in [
        (
            chat(json!({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "p", "schema": {"type": "objekt"}}}})),
            "response_format",
        ),
        (
            chat(json!({"grammar": {"type": "lark", "grammar": "start: ("}})),
            "grammar",
        ),
    ] {
        let r = post(s.addr(), &k, "/v1/chat/completions", &body).await;
        assert_eq!(r.status, 400, "{}", r.text());
        let e = r.json()["error"].clone();
        assert_eq!(e["code"], "invalid_grammar", "{e}");
        assert!(
            e["message"].as_str().expect("message").starts_with(field),
            "{e}"
        );
    }
    let both = chat(json!({"response_format": {"type": "json_object"},
                           "grammar": {"type": "regex", "pattern": "a"}}));
    let r = post(s.addr(), &k, "/v1/chat/completions", &both).await;
    assert_eq!(r.status, 422, "{}", r.text());

    let sid = new_session(s.addr(), &k).await;
    let r = post(
        s.addr(),
        &k,
        &format!("/v1/sessions/{sid}/messages"),
        &json!({"content": "Hi", "grammar": {"type": "regex", "pattern": "[0-9"}}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.json()["error"]["message"]
        .as_str()
        .expect("message")
        .starts_with("grammar: "));
    assert!(
        history(s.addr(), &k, &sid).await.is_empty(),
        "nothing stored"
    );
    s.finish().await;
}
