//! Generation options are honoured end to end, not only accepted: a stop string ends the reply
//! before it (with `finish_reason: "stop"` on both APIs), and sampling parameters reach the
//! worker (a seed reproduces a sampled reply, another seed changes it, greedy is greedy).

use std::net::SocketAddr;

use hearth_e2e::http::Req;
use hearth_e2e::stack::{chat_completion, new_session, Db, Stack};
use serde_json::{json, Value};

/// A 40-token completion of "Tell me everything", with `extra` fields; it must succeed.
async fn ask(addr: SocketAddr, key: &str, extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "Tell me everything"}],
                          "max_tokens": 40, "ignore_eos": true});
    for (k, v) in extra.as_object().expect("object") {
        body[k] = v.clone();
    }
    chat_completion(addr, key, &body).await
}

fn content(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_string_ends_the_reply_before_it_on_both_apis() {
    // Scripted workers echo the prompt's tokens, so the reply's text is known in advance.
    let s = Stack::scripted("stop_strings", Db::Sqlite, 1, 2, &[]).await;
    let k = s.key("alice").await;
    let whole = ask(s.addr(), &k, json!({})).await;
    let text = content(&whole);
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    let stop = "everything";
    let at = text
        .find(stop)
        .expect("the echoed prompt contains the stop string");
    let cut = ask(s.addr(), &k, json!({"stop": [stop]})).await;
    assert_eq!(cut["choices"][0]["finish_reason"], "stop", "{cut}");
    assert_eq!(
        content(&cut),
        text[..at],
        "the reply ends right before the stop string"
    );

    let sid = new_session(s.addr(), &k).await;
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&k))
        .json(
            &json!({"content": "Tell me everything", "max_tokens": 40, "ignore_eos": true,
                      "stop": [stop], "stream": false}),
        )
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let m = r.json();
    assert_eq!(m["finish_reason"], "stop", "{m}");
    assert!(
        !m["content"].as_str().expect("content").contains(stop),
        "{m}"
    );
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_parameters_reach_the_worker() {
    let s = Stack::start("sampling", Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;
    let sampled = |seed: u64| json!({"temperature": 1.5, "top_p": 1.0, "seed": seed});
    let a = content(&ask(s.addr(), &k, sampled(1)).await);
    let again = content(&ask(s.addr(), &k, sampled(1)).await);
    let b = content(&ask(s.addr(), &k, sampled(2)).await);
    assert_eq!(a, again, "the same seed reproduces the reply");
    assert_ne!(a, b, "another seed changes it");
    // (OpenAI's default temperature is 1: greedy is asked for.)
    let greedy = content(&ask(s.addr(), &k, json!({"temperature": 0.0})).await);
    let zero = content(&ask(s.addr(), &k, json!({"temperature": 0.0, "seed": 5})).await);
    assert_eq!(greedy, zero, "temperature 0 is greedy whatever the seed");
    assert_ne!(greedy, a, "a hot sampled reply differs from the greedy one");
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logit_bias_and_dry_reach_the_worker() {
    let s = Stack::start("bias_dry", Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;
    // Whether the 40-token reply is one piece of text 40 times over.
    let one_piece = |text: &str| {
        let piece = &text[..text.len() / 40];
        !piece.is_empty() && text == piece.repeat(40)
    };
    // +100 on one token (of the tiny model's 512) forces a loop of it.
    let forced = json!({"temperature": 0.0, "logit_bias": {"300": 100}});
    let looped = content(&ask(s.addr(), &k, forced.clone()).await);
    assert!(one_piece(&looped), "{looped:?}");
    // DRY's penalty grows with the repeated run until it outweighs the bias.
    let mut dry = forced;
    dry["dry_multiplier"] = json!(10.0);
    dry["dry_base"] = json!(10.0);
    dry["dry_allowed_length"] = json!(1);
    let broken = content(&ask(s.addr(), &k, dry.clone()).await);
    assert!(!one_piece(&broken), "{broken:?}");
    assert!(
        broken.starts_with(&looped[..looped.len() / 40]),
        "{broken:?}"
    );
    // The native API takes the same parameters.
    let sid = new_session(s.addr(), &k).await;
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&k))
        .json(
            &json!({"content": "Tell me everything", "max_tokens": 40, "ignore_eos": true,
                      "params": {"logit_bias": {"300": 100}}, "stream": false}),
        )
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let native = r.json()["content"].as_str().unwrap_or_default().to_string();
    assert!(one_piece(&native), "{native:?}");
    // A token outside the vocabulary is refused by name.
    let r = Req::new("POST", "/v1/chat/completions")
        .key(Some(&k))
        .json(&json!({"messages": [{"role": "user", "content": "Hi"}],
                      "logit_bias": {"600": 1}}))
        .send(s.addr())
        .await;
    assert!(
        (400..500).contains(&r.status) && r.text().contains("logit_bias"),
        "{}: {}",
        r.status,
        r.text()
    );
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_native_api_streams_log_probabilities_on_request() {
    let s = Stack::start("native_logprobs", Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let turn = |extra: Value| {
        let mut body =
            json!({"content": "Tell me everything", "max_tokens": 6, "ignore_eos": true});
        for (key, v) in extra.as_object().expect("object") {
            body[key] = v.clone();
        }
        let (addr, path, key) = (s.addr(), format!("/v1/sessions/{sid}/messages"), k.clone());
        async move {
            Req::new("POST", &path)
                .key(Some(&key))
                .json(&body)
                .events(addr)
                .await
                .rest()
                .await
        }
    };
    let events = turn(json!({"logprobs": true, "top_logprobs": 3})).await;
    let tokens: Vec<Value> = events
        .iter()
        .filter(|e| e.event == "logprobs")
        .flat_map(|e| e.json()["content"].as_array().cloned().unwrap_or_default())
        .collect();
    assert_eq!(tokens.len(), 6, "{tokens:?}");
    for t in &tokens {
        let lp = t["logprob"].as_f64().expect("logprob");
        let top = t["top_logprobs"].as_array().expect("top");
        assert!(lp <= 0.0 && top.len() == 3, "{t}");
        // Greedy: the pick is the likeliest.
        assert_eq!(top[0]["token"], t["token"], "{t}");
    }
    // Without asking, no such events.
    let plain = turn(json!({})).await;
    assert!(plain.iter().all(|e| e.event != "logprobs"));
    assert!(plain.iter().any(|e| e.event == "message_end"));
    s.finish().await;
}
