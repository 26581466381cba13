//! `POST /tokenize` and `POST /detokenize` (vLLM's shapes) through the whole stack: a chat's
//! count is the prompt its chat completion is counted for, prompts and tokens round-trip, and
//! bad input is a 422 that names its field.

use hearth_e2e::http::{Reply, Req};
use hearth_e2e::stack::{Db, Stack};
use serde_json::{json, Value};

async fn post(s: &Stack, key: &str, path: &str, body: Value) -> Reply {
    Req::new("POST", path)
        .key(Some(key))
        .json(&body)
        .send(s.addr())
        .await
}

fn ids(v: &Value) -> Vec<u64> {
    let tokens = v["tokens"].as_array().expect("tokens");
    tokens.iter().filter_map(Value::as_u64).collect()
}

#[tokio::test]
async fn a_chats_count_is_the_prompt_its_completion_counts_and_tokens_round_trip() {
    let s = Stack::start("tokenize", Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;
    let messages = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name three colours."}
    ]);
    let body = json!({"model": "tiny", "messages": messages, "return_token_strs": true});
    let r = post(&s, &k, "/tokenize", body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let t = r.json();
    let tokens = ids(&t);
    assert_eq!(t["count"].as_u64(), Some(tokens.len() as u64), "{t}");
    let context = t["max_model_len"].as_u64().expect("the model's context");
    assert!(context > tokens.len() as u64, "{t}");

    // The same messages as a chat completion: the prompt it is counted for.
    let body = json!({"model": "tiny", "messages": messages, "max_tokens": 1});
    let c = post(&s, &k, "/v1/chat/completions", body).await;
    assert_eq!(c.status, 200, "{}", c.text());
    assert_eq!(
        c.json()["usage"]["prompt_tokens"].as_u64(),
        Some(tokens.len() as u64)
    );

    // Back to text: the rendered prompt, each token's text its part of it.
    let d = post(
        &s,
        &k,
        "/detokenize",
        json!({"model": "tiny", "tokens": tokens}),
    )
    .await;
    assert_eq!(d.status, 200, "{}", d.text());
    let text = d.json()["prompt"].as_str().expect("prompt").to_string();
    assert!(
        text.contains("Name three colours.") && text.contains("Be brief."),
        "{text}"
    );
    let strs: Vec<&str> = t["token_strs"]
        .as_array()
        .expect("token_strs")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(strs.len(), tokens.len());
    assert_eq!(strs.concat(), text);

    // A prompt as it is: after the BOS token unless asked not to, and back to its text.
    let with = post(&s, &k, "/tokenize", json!({"prompt": "Hello there, world"})).await;
    let bare = json!({"prompt": "Hello there, world", "add_special_tokens": false});
    let without = post(&s, &k, "/tokenize", bare).await;
    assert!(with.json()["token_strs"].is_null(), "{}", with.text());
    let (with, without) = (ids(&with.json()), ids(&without.json()));
    assert!(!without.is_empty());
    assert_eq!(with[1..], without[..]);
    let d = post(&s, &k, "/detokenize", json!({"tokens": without})).await;
    assert_eq!(d.json()["prompt"], "Hello there, world");
}

#[tokio::test]
async fn bad_tokenize_requests_are_refused_by_the_field_they_get_wrong() {
    let s = Stack::start("tokenizebad", Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;
    let user = json!([{"role": "user", "content": "hi"}]);
    let tool = json!([{"type": "function", "function": {"name": "f"}}]);
    for (path, body, param) in [
        ("/tokenize", json!({}), Some("messages")),
        (
            "/tokenize",
            json!({"prompt": "x", "messages": user}),
            Some("prompt"),
        ),
        ("/tokenize", json!({"prompt": ""}), Some("prompt")),
        (
            "/tokenize",
            json!({"prompt": "x", "tools": tool}),
            Some("tools"),
        ),
        (
            "/tokenize",
            json!({"messages": user, "add_generation_prompt": false}),
            Some("add_generation_prompt"),
        ),
        (
            "/tokenize",
            json!({"messages": user, "continue_final_message": true}),
            Some("continue_final_message"),
        ),
        (
            "/tokenize",
            json!({"messages": [{"role": "robot", "content": "hi"}]}),
            Some("messages[0].role"),
        ),
        (
            "/tokenize",
            json!({"messages": [{"role": "assistant", "content": "hi"}]}),
            None,
        ),
        ("/tokenize", json!({"prompt": 7}), Some("prompt")),
        (
            "/detokenize",
            json!({"tokens": [1, 99999999]}),
            Some("tokens[1]"),
        ),
        ("/detokenize", json!({"tokens": "1 2"}), Some("tokens")),
    ] {
        let r = post(&s, &k, path, body.clone()).await;
        assert_eq!(r.status, 422, "{path} {body}: {}", r.text());
        let e = &r.json()["error"];
        assert_eq!(e["param"].as_str(), param, "{path} {body}: {}", r.text());
    }
    for path in ["/tokenize", "/detokenize"] {
        let body = json!({"model": "no-such-model", "prompt": "hi", "tokens": [1]});
        let r = post(&s, &k, path, body).await;
        assert_eq!(r.status, 404, "{path}: {}", r.text());
        assert_eq!(r.json()["error"]["code"], "model_not_found");
        let r = Req::new("POST", path)
            .json(&json!({"prompt": "hi", "tokens": [1]}))
            .send(s.addr())
            .await;
        assert_eq!(r.status, 401, "{path} without a key: {}", r.text());
    }
}
