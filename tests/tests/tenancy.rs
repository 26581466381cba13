//! One tenant cannot make a shared worker load, swap or drop models for everyone else. A worker
//! with room for one tiny model serves `alpha`; its repository also holds `beta`:
//! - naming `beta` in a session (created, or patched: the caller's own, another's, one that
//!   does not exist, or past the session cap) loads nothing; nor does a request its key's rate
//!   limit refuses;
//! - a load that only evicting a model used within `--min-resident-secs` could make room for
//!   is refused with 503 `model_no_room` and `Retry-After`, in words that name no path and no
//!   byte count; an admin key also reads the workers' own words;
//! - each key may start `--max-loads-per-hour` loads; one more is a 429 that names the limit;
//! - a grammar compiles only once its request is charged.

use hearth_e2e::http::Req;
use hearth_e2e::stack::{metric, new_session_with, post, Stack};
use hearth_orchestrator::auth::KeyOptions;
use hearth_worker::fixtures::{write_tiny_gguf, TinySpec};
use serde_json::{json, Value};

const LOADS: &str = "hearth_model_loads_on_demand_total";

/// `alpha/1` and `beta/1`, tiny models of one size; returns the repository and the bytes one
/// takes loaded with its K/V pool (the stack's 64 MiB).
fn repository() -> (std::path::PathBuf, u64) {
    let root = std::env::temp_dir().join(format!("hearth-tenancy-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let mut bytes = 0;
    for (i, name) in ["alpha", "beta"].into_iter().enumerate() {
        let dir = root.join(name).join("1");
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("model.gguf");
        let spec = TinySpec {
            seed: 31 + i as u64,
            ..TinySpec::default()
        };
        write_tiny_gguf(&file, &spec).expect("model");
        let weights = hearth_worker::model::load_gguf(&file)
            .expect("loads")
            .weights_bytes() as u64;
        bytes = weights + (64 << 20);
    }
    (root, bytes)
}

/// `beta`'s state as `/v1/models` lists it.
async fn beta_state(s: &Stack, key: &str) -> Value {
    let r = Req::new("GET", "/v1/models")
        .key(Some(key))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let data = r.json()["data"].clone();
    let beta = data
        .as_array()
        .and_then(|d| d.iter().find(|c| c["id"] == "beta"));
    beta.unwrap_or_else(|| panic!("beta is not listed: {data}"))["state"].clone()
}

fn chat(model: &str) -> Value {
    json!({"model": model, "max_tokens": 2,
           "messages": [{"role": "user", "content": "Hi"}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_tenant_loads_or_swaps_the_models_others_use() {
    let (root, one) = repository();
    // Room for one model and a half.
    let budget = (one + one / 2).to_string();
    let worker = [
        "--memory-budget",
        budget.as_str(),
        "--min-resident-secs",
        "3600",
    ];
    let hearth = ["--max-sessions-per-user", "1", "--max-loads-per-hour", "2"];
    let s = Stack::from_repository_with("tenancy", &root, &["alpha"], &worker, &hearth).await;
    let (alice, bob) = (s.key("alice").await, s.key("bob").await);
    let carol = s.limited_key("carol", 1).await;
    let admin = KeyOptions {
        admin: true,
        ..KeyOptions::default()
    };
    let admin = s.key_with("root", admin).await;
    let r = post(s.addr(), &alice, "/v1/chat/completions", &chat("alpha")).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(beta_state(&s, &alice).await, "available");
    let loads = metric(s.addr(), LOADS).await;

    // Naming beta costs no load: a new session of it, one past the cap, a patch of another
    // user's session or of none.
    let sid = new_session_with(s.addr(), &alice, &json!({"model": "beta"})).await;
    let r = post(s.addr(), &alice, "/v1/sessions", &json!({"model": "beta"})).await;
    assert_eq!(r.status, 422, "past the cap: {}", r.text());
    let beta = json!({"model": "beta"});
    let nobody = "0123456789abcdef0123456789abcdef";
    for (key, id) in [(&bob, sid.as_str()), (&alice, nobody)] {
        let r = Req::new("PATCH", &format!("/v1/sessions/{id}"))
            .key(Some(key))
            .json(&beta)
            .send(s.addr())
            .await;
        assert_eq!(r.status, 404, "{}", r.text());
    }
    // A key whose rate limit is spent is refused before any load, on both APIs.
    let r = post(s.addr(), &carol, "/v1/chat/completions", &chat("alpha")).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = post(s.addr(), &carol, "/v1/chat/completions", &chat("beta")).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(metric(s.addr(), LOADS).await, loads, "nothing was loaded");
    assert_eq!(beta_state(&s, &alice).await, "available");

    // Alice's turn in her beta session: the one model that could make room, alpha, served a
    // request moments ago. Refused, saying when to retry, and no worker detail.
    let turn = json!({"content": "Hi", "max_tokens": 2, "stream": false});
    let turns = format!("/v1/sessions/{sid}/messages");
    let r = post(s.addr(), &alice, &turns, &turn).await;
    assert_eq!(r.status, 503, "{}", r.text());
    let retry: u64 = r
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("Retry-After");
    assert!((1..=3600).contains(&retry), "{retry}");
    let e = r.json()["error"].clone();
    assert_eq!(e["code"], "model_no_room", "{e}");
    let msg = e["message"].as_str().unwrap_or_default().to_string();
    assert!(
        msg.starts_with("the model `beta@1` cannot be loaded now: no worker has room for it"),
        "{msg}"
    );
    assert!(msg.contains(&format!("retry in {retry} s")), "{msg}");
    for detail in ["fits on no worker", "worker-", "MiB", "bytes", "/", "--"] {
        assert!(!msg.contains(detail), "{detail:?} in {msg}");
    }
    // An admin key reads the workers' words too.
    let r = post(s.addr(), &admin, "/v1/chat/completions", &chat("beta")).await;
    assert_eq!(r.status, 503, "{}", r.text());
    let msg = r.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(msg.contains("--min-resident-secs"), "{msg}");
    assert_eq!(beta_state(&s, &alice).await, "available");

    // Alice's second load is her last this hour; Bob has his own.
    let r = post(s.addr(), &alice, "/v1/chat/completions", &chat("beta")).await;
    assert_eq!(r.status, 503, "{}", r.text());
    let r = post(s.addr(), &alice, "/v1/chat/completions", &chat("beta")).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert!(r.header("retry-after").is_some(), "{}", r.text());
    assert!(r.text().contains("--max-loads-per-hour"), "{}", r.text());
    let r = post(s.addr(), &bob, "/v1/chat/completions", &chat("beta")).await;
    assert_eq!(r.status, 503, "{}", r.text());
    // Alice's, Alice's, the admin's and Bob's: four tries, none of them a swap.
    assert_eq!(metric(s.addr(), LOADS).await, loads + 4.0);
    let r = post(s.addr(), &bob, "/v1/chat/completions", &chat("alpha")).await;
    assert_eq!(r.status, 200, "alpha served throughout: {}", r.text());

    // A grammar compiles only once its request is charged: one that does not compile still
    // costs Dave his one request of the minute.
    let dave = s.limited_key("dave", 1).await;
    let mut bad = chat("alpha");
    bad["grammar"] = json!({"type": "lark", "grammar": "start: (("});
    let r = post(s.addr(), &dave, "/v1/chat/completions", &bad).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "invalid_grammar", "{}", r.text());
    let r = post(s.addr(), &dave, "/v1/chat/completions", &chat("alpha")).await;
    assert_eq!(r.status, 429, "{}", r.text());
    s.finish().await;
    let _ = std::fs::remove_dir_all(root);
}
