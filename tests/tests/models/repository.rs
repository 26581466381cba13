//! A worker serving a model from a model repository, through the whole stack: `/v1/models`
//! shows its name, version and display name, and its manifest's context; requests name it, or
//! pin its version (the repository's other version loads on demand), and a version it does not
//! hold is OpenAI's 404; the manifest's default sampling parameters apply to requests (on both
//! APIs) that leave those fields out.

use std::path::Path;

use hearth_e2e::http::Req;
use hearth_e2e::stack::{
    chat_completion, completion, history, new_session, new_session_with, Stack,
};
use hearth_worker::fixtures::{write_tiny_gguf, TinySpec};
use serde_json::{json, Value};

/// `tiny/1` and `tiny/2` of the tiny model; version 2's manifest names it, caps its context and
/// biases every reply toward one token.
fn repository(root: &Path) {
    for v in ["1", "2"] {
        let dir = root.join("tiny").join(v);
        std::fs::create_dir_all(&dir).expect("dir");
        write_tiny_gguf(&dir.join("tiny.gguf"), &TinySpec::default()).expect("model");
    }
    let manifest = json!({"display_name": "Tiny Two", "context_length": 200,
                          "chat_template": "gemma", "params": {"logit_bias": {"40": 100}}});
    std::fs::write(root.join("tiny/2/manifest.json"), manifest.to_string()).expect("manifest");
}

fn ask(model: &str, extra: Value) -> Value {
    let mut body = json!({"model": model, "max_tokens": 6,
                          "messages": [{"role": "user", "content": "Hello there"}]});
    for (k, v) in extra.as_object().expect("object") {
        body[k] = v.clone();
    }
    body
}

fn text(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repository_model_is_named_pinned_and_keeps_its_manifest() {
    let root = std::env::temp_dir().join(format!("hearth-repo-e2e-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    repository(&root);
    let s = Stack::from_repository("repository", &root, &["tiny"], &[]).await;
    let k = s.key("alice").await;

    let models = Req::new("GET", "/v1/models")
        .key(Some(&k))
        .send(s.addr())
        .await;
    let card = models.json()["data"][0].clone();
    assert_eq!(card["id"], "tiny", "{card}");
    assert_eq!(card["version"], "2", "{card}");
    assert_eq!(card["display_name"], "Tiny Two", "{card}");
    assert_eq!(card["max_model_len"], 200, "{card}");
    let pinned = Req::new("GET", "/v1/models/tiny@2")
        .key(Some(&k))
        .send(s.addr())
        .await;
    assert_eq!(pinned.status, 200, "{}", pinned.text());

    // The manifest's bias is every reply's, unless a request sets its own.
    let biased = text(&chat_completion(s.addr(), &k, &ask("tiny", json!({}))).await);
    let same = json!({"logit_bias": {"40": 100}, "temperature": 1.0});
    let explicit = text(&chat_completion(s.addr(), &k, &ask("tiny@2", same)).await);
    assert_eq!(biased, explicit);
    let other = json!({"logit_bias": {"41": 100}});
    let own = text(&chat_completion(s.addr(), &k, &ask("tiny", other)).await);
    assert_ne!(own, biased);
    let sid = new_session(s.addr(), &k).await;
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&k))
        .json(&json!({"content": "Hello there", "stream": false, "max_tokens": 6}))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        history(s.addr(), &k, &sid).await[1]["content"],
        biased.as_str()
    );
    // A session's own fields lie over the manifest's, field by field (as the web UI's chats
    // have a DRY setting of their own).
    let own = new_session_with(s.addr(), &k, &json!({"params": {"dry_multiplier": 0.0}})).await;
    let r = Req::new("GET", &format!("/v1/sessions/{own}"))
        .key(Some(&k))
        .send(s.addr())
        .await;
    assert_eq!(
        r.json()["params"],
        json!({"dry_multiplier": 0.0}),
        "stored as given"
    );
    let r = Req::new("POST", &format!("/v1/sessions/{own}/messages"))
        .key(Some(&k))
        .json(&json!({"content": "Hello there", "stream": false, "max_tokens": 6}))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["content"], biased.as_str());

    // The repository's other version is listed as available, and loaded on demand by the
    // first request pinning it; the name still means the newest.
    let card = Req::new("GET", "/v1/models")
        .key(Some(&k))
        .send(s.addr())
        .await
        .json()["data"][0]
        .clone();
    assert_eq!(card["versions"][1]["version"], "1", "{card}");
    assert_eq!(card["versions"][1]["state"], "available", "{card}");
    let r = completion(s.addr(), &k, &ask("tiny@1", json!({}))).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let pinned = Req::new("GET", "/v1/models/tiny@1")
        .key(Some(&k))
        .send(s.addr())
        .await;
    assert_eq!(pinned.json()["version"], "1", "{}", pinned.text());
    assert_eq!(pinned.json()["state"], "ready", "{}", pinned.text());
    let biased_again = text(&chat_completion(s.addr(), &k, &ask("tiny", json!({}))).await);
    assert_eq!(biased_again, biased, "`tiny` is still version 2");

    // A version the repository does not hold is OpenAI's 404, naming what can be asked for.
    let r = completion(s.addr(), &k, &ask("tiny@3", json!({}))).await;
    assert_eq!(r.status, 404, "{}", r.text());
    let e = r.json()["error"].clone();
    assert_eq!(e["code"], "model_not_found");
    let message = e["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("`tiny@2`") && message.contains("`tiny@1`"),
        "{e}"
    );
    s.finish().await;
    let _ = std::fs::remove_dir_all(root);
}
