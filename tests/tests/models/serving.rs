//! Several models across workers: three workers serve `alpha@1`, `alpha@2` and `beta@1` of one
//! repository. `/v1/models` lists both models with their versions; requests go to the worker
//! of the model they name (by name: its newest ready version; pinned: that version), on both
//! APIs, and a session keeps its model; an unknown model is a 404 that lists what is served;
//! with the newest version's worker gone, the name falls back to the older ready version. A
//! model fetched from a URL shows its progress in `/v1/models` while it arrives. A model whose
//! version holds its own tokenizer is tokenized and read with it, not the orchestrator's.

use std::path::Path;

use hearth_e2e::http::Req;
use hearth_e2e::stack::{
    assets, new_session_with, path, post, wait_idle, worker_with, Hearth, Stack, DECODED, PREFILLED,
};
use hearth_orchestrator::auth::{issue_key, KeyOptions};
use hearth_orchestrator::storage::SqlStore;
use hearth_worker::fixtures::{write_tiny_gguf, write_tiny_tokenizer_for, TinySpec};
use serde_json::{json, Value};

/// `alpha/1`, `alpha/2` and `beta/1`: three different tiny models.
fn repository(root: &Path) {
    for (i, (name, v)) in [("alpha", "1"), ("alpha", "2"), ("beta", "1")]
        .into_iter()
        .enumerate()
    {
        let dir = root.join(name).join(v);
        std::fs::create_dir_all(&dir).expect("dir");
        let spec = TinySpec {
            seed: 11 + i as u64,
            ..TinySpec::default()
        };
        write_tiny_gguf(&dir.join("model.gguf"), &spec).expect("model");
    }
}

/// Tokens each worker has run through its model so far, prompt and decoded (0 for the workers in
/// `gone`, which were killed). Decoded tokens alone would not do: a tiny model may end its reply
/// on its first token (sampled at the prompt's last position), and then nothing is decoded. A
/// worker exports each counter from its first step on: until then it is 0.
async fn computed(s: &Stack, gone: &[usize]) -> Vec<f64> {
    let mut out = Vec::new();
    for (i, w) in s.workers.iter().enumerate() {
        if gone.contains(&i) {
            out.push(0.0);
            continue;
        }
        let page = Req::new("GET", "/metrics")
            .send(w.metrics.parse().expect("metrics address"))
            .await
            .text();
        let read = |name: &str| {
            page.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
                .map_or(0.0, |v| v.trim().parse::<f64>().expect("a number"))
        };
        out.push(read(PREFILLED) + read(DECODED));
    }
    out
}

/// Runs `call` and returns the index of the one worker that ran tokens for it.
async fn served_by<F: std::future::Future<Output = ()>>(s: &Stack, call: F) -> usize {
    served_by_of(s, &[], call).await
}

async fn served_by_of<F: std::future::Future<Output = ()>>(
    s: &Stack,
    gone: &[usize],
    call: F,
) -> usize {
    let before = computed(s, gone).await;
    call.await;
    // A worker counts a step's tokens once the step is over, which may be after the client
    // has its reply: wait until some worker's count has moved and every worker is idle, so
    // that a second worker that decoded for the call would show too.
    let moved = |after: &[f64]| -> Vec<usize> {
        (0..before.len())
            .filter(|&i| after[i] > before[i])
            .collect()
    };
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut after = computed(s, gone).await;
    while moved(&after).is_empty() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        after = computed(s, gone).await;
    }
    for (i, w) in s.workers.iter().enumerate() {
        if !gone.contains(&i) {
            assert_eq!(wait_idle(w).await, 0.0, "worker {i} is still busy");
        }
    }
    let after = computed(s, gone).await;
    let moved = moved(&after);
    assert_eq!(
        moved.len(),
        1,
        "exactly one worker ran tokens: {before:?} -> {after:?}"
    );
    moved[0]
}

async fn chat(s: &Stack, key: &str, model: &str) {
    let body = json!({"model": model, "max_tokens": 4,
                      "messages": [{"role": "user", "content": "Hello there"}]});
    let r = Req::new("POST", "/v1/chat/completions")
        .key(Some(key))
        .json(&body)
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{model}: {}", r.text());
    assert_eq!(r.json()["model"], model.split('@').next().unwrap_or(model));
}

async fn turn(s: &Stack, key: &str, sid: &str) {
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(key))
        .json(&json!({"content": "Hello there", "stream": false, "max_tokens": 4}))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

async fn models(s: &Stack, key: &str) -> Vec<Value> {
    let r = Req::new("GET", "/v1/models")
        .key(Some(key))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["data"].as_array().cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_go_to_the_workers_of_the_model_they_name() {
    let root = std::env::temp_dir().join(format!("hearth-models-e2e-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    repository(&root);
    let specs = ["alpha@1", "alpha", "beta"];
    let mut s = Stack::from_repository("models", &root, &specs, &[]).await;
    let k = s.key("alice").await;
    // `hearth` is ready with one worker; wait for all three to be listed.
    let mut cards = models(&s, &k).await;
    for _ in 0..100 {
        let ready = |c: &Value| c["versions"].as_array().map_or(0, |v| v.len());
        if cards.len() == 2 && ready(&cards[0]) == 2 && cards[0]["workers"] == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        cards = models(&s, &k).await;
    }
    assert_eq!(cards.len(), 2, "{cards:?}");
    assert_eq!(cards[0]["id"], "alpha");
    assert_eq!(
        cards[0]["version"], "2",
        "the name means the newest version"
    );
    let versions: Vec<&Value> = cards[0]["versions"]
        .as_array()
        .expect("versions")
        .iter()
        .map(|v| &v["version"])
        .collect();
    assert_eq!(versions, [&json!("2"), &json!("1")]);
    assert_eq!(cards[1]["id"], "beta");
    assert_eq!(
        (&cards[1]["state"], &cards[1]["workers"]),
        (&json!("ready"), &json!(1))
    );

    // By name and pinned, on the OpenAI API.
    assert_eq!(served_by(&s, chat(&s, &k, "alpha")).await, 1);
    assert_eq!(served_by(&s, chat(&s, &k, "alpha@1")).await, 0);
    assert_eq!(served_by(&s, chat(&s, &k, "beta")).await, 2);
    assert_eq!(served_by(&s, chat(&s, &k, "alpha@2")).await, 1);
    let legacy = json!({"model": "beta", "prompt": "Once", "max_tokens": 3});
    let w = served_by(&s, async {
        let r = post(s.addr(), &k, "/v1/completions", &legacy).await;
        assert_eq!(r.status, 200, "{}", r.text());
    })
    .await;
    assert_eq!(w, 2);

    // A session keeps its model, turn after turn.
    let sid = new_session_with(s.addr(), &k, &json!({"model": "beta"})).await;
    for _ in 0..2 {
        assert_eq!(served_by(&s, turn(&s, &k, &sid)).await, 2);
    }
    let pinned = new_session_with(s.addr(), &k, &json!({"model": "alpha@1"})).await;
    assert_eq!(served_by(&s, turn(&s, &k, &pinned)).await, 0);

    // Unknown models and versions: 404, naming what is served.
    for asked in ["gamma", "alpha@3", "beta@2"] {
        let body = json!({"model": asked, "max_tokens": 2,
                          "messages": [{"role": "user", "content": "Hi"}]});
        let legacy = json!({"model": asked, "prompt": "Hi"});
        let r = post(s.addr(), &k, "/v1/completions", &legacy).await;
        assert_eq!(r.status, 404, "{asked}: {}", r.text());
        let r = Req::new("POST", "/v1/chat/completions")
            .key(Some(&k))
            .json(&body)
            .send(s.addr())
            .await;
        assert_eq!(r.status, 404, "{asked}: {}", r.text());
        let e = r.json()["error"].clone();
        assert_eq!(e["code"], "model_not_found", "{e}");
        let msg = e["message"].as_str().unwrap_or_default().to_string();
        for served in ["`alpha@2`", "`alpha@1`", "`beta@1`"] {
            assert!(msg.contains(served), "{msg}");
        }
        let r = Req::new("POST", "/v1/sessions")
            .key(Some(&k))
            .json(&json!({"model": asked}))
            .send(s.addr())
            .await;
        assert_eq!(r.status, 404, "{asked}: {}", r.text());
    }
    let one = Req::new("GET", "/v1/models/alpha@1")
        .key(Some(&k))
        .send(s.addr())
        .await;
    assert_eq!(
        (one.status, one.json()["version"].clone()),
        (200, json!("1"))
    );

    // The newest version's worker goes: the name means the older, ready one.
    s.workers[1].child.kill().expect("kill");
    let _ = s.workers[1].child.wait();
    for _ in 0..100 {
        let cards = models(&s, &k).await;
        if cards[0]["version"] == "1" {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(served_by_of(&s, &[1], chat(&s, &k, "alpha")).await, 0);
    let gone = json!({"model": "alpha@2", "max_tokens": 2,
                      "messages": [{"role": "user", "content": "Hi"}]});
    let r = Req::new("POST", "/v1/chat/completions")
        .key(Some(&k))
        .json(&gone)
        .send(s.addr())
        .await;
    assert_eq!(
        r.status,
        503,
        "a version no ready worker serves: {}",
        r.text()
    );
    s.finish().await;
    let _ = std::fs::remove_dir_all(root);
}

/// Serves `body` at any path over HTTP/1.1, `chunk` bytes every `every`, with its length said
/// up front: a slow model server.
async fn slow_server(body: Vec<u8>, chunk: usize, every: std::time::Duration) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let body = std::sync::Arc::new(body);
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let body = body.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if sock.read(&mut byte).await.unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(byte[0]);
                }
                let header = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                if sock.write_all(header.as_bytes()).await.is_err() {
                    return;
                }
                for part in body.chunks(chunk) {
                    tokio::time::sleep(every).await;
                    if sock.write_all(part).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    format!("http://{addr}/tiny.gguf")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_fetched_from_a_url_shows_its_progress_in_v1_models() {
    let assets = assets("fetch-progress");
    let body = std::fs::read(&assets.model).expect("model");
    let total = body.len() as u64;
    // About two seconds for the whole file.
    let chunk = (body.len() / 40).max(1);
    let url = slow_server(body, chunk, std::time::Duration::from_millis(50)).await;
    let cache = assets.dir.join("models");
    let cache_flag = path(&cache);
    let worker = worker_with(
        Path::new(&url),
        &["--kv-budget", "64MiB", "--models-dir", cache_flag.as_str()],
    );
    let db_url = assets.sqlite_url();
    let workers = vec![worker];
    let mut hearth = Hearth::spawn(&Stack::args(&assets, &db_url, &workers, &[]));
    let store = SqlStore::connect(&db_url).await.expect("store");
    let k = issue_key(&store, "alice", KeyOptions::default())
        .await
        .expect("key")
        .key;
    // Watch the card while the file arrives: loading, with its bytes, then ready.
    let mut seen: Vec<(u64, u64)> = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        assert!(
            std::time::Instant::now() < deadline,
            "never ready: {seen:?}"
        );
        let r = Req::new("GET", "/v1/models")
            .key(Some(&k))
            .send(hearth.addr)
            .await;
        let card = r.json()["data"][0].clone();
        if card["state"] == "ready" {
            assert_eq!(card["id"], "tiny", "{card}");
            break;
        }
        if card["state"] == "loading" {
            if let (Some(done), Some(all)) = (
                card["fetched_bytes"].as_u64(),
                card["fetch_total_bytes"].as_u64(),
            ) {
                seen.push((done, all));
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        seen.iter()
            .any(|&(done, all)| done > 0 && done < total && all == total),
        "progress part way through the {total}-byte file: {seen:?}"
    );
    assert!(seen.windows(2).all(|w| w[0].0 <= w[1].0), "{seen:?}");
    // And the fetched model serves.
    let body = json!({"model": "tiny", "max_tokens": 3,
                      "messages": [{"role": "user", "content": "Hi"}]});
    let r = post(hearth.addr, &k, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    hearth.kill();
    store.close().await;
    drop(workers);
    let _ = std::fs::remove_dir_all(&assets.dir);
}

/// `plain/1` (no tokenizer of its own: the orchestrator's, the tiny one) and `swapped/1`: the
/// same weights, with a vocabulary and `tokenizer.json` whose letters have their case swapped.
/// The same token ids are `hello` for one and `HELLO` for the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_with_its_own_tokenizer_is_read_and_written_with_it() {
    let root = std::env::temp_dir().join(format!("hearth-own-tok-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for (name, swap_case) in [("plain", false), ("swapped", true)] {
        let dir = root.join(name).join("1");
        std::fs::create_dir_all(&dir).expect("dir");
        let spec = TinySpec {
            seed: 31,
            swap_case,
            ..TinySpec::default()
        };
        write_tiny_gguf(&dir.join("model.gguf"), &spec).expect("model");
        if swap_case {
            write_tiny_tokenizer_for(&dir.join("tokenizer.json"), &spec).expect("tokenizer");
        }
    }
    let s = Stack::from_repository("own-tok", &root, &["plain", "swapped"], &[]).await;
    let k = s.key("alice").await;
    // The tiny vocabulary holds one token per letter.
    let vocab = hearth_worker::fixtures::tiny_vocab_text(TinySpec::default().vocab);
    let id = |c: char| {
        vocab
            .iter()
            .position(|t| *t == c.to_string())
            .expect("a letter") as u32
    };
    let hello: Vec<u32> = "hello".chars().map(id).collect();
    let complete = |model: &str, prompt: Value| {
        json!({"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
               "logprobs": 0})
    };

    // Token ids read back with each model's tokenizer.
    for (model, want) in [("plain", "hello"), ("swapped", "HELLO")] {
        let body = json!({"model": model, "prompt": hello, "echo": true, "max_tokens": 1});
        let r = post(s.addr(), &k, "/v1/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let text = r.json()["choices"][0]["text"]
            .as_str()
            .expect("text")
            .to_string();
        assert!(text.starts_with(want), "{model}: {text:?}");
    }

    // Text written with it: `HELLO` is the same ids for `swapped` as `hello` for `plain`, so the
    // same weights continue it alike, token for token.
    let mut ids = vec![hearth_worker::fixtures::BOS];
    ids.extend(&hello);
    let mut replies = Vec::new();
    for (model, prompt) in [
        ("swapped", json!("HELLO")),
        ("swapped", json!(ids)),
        ("plain", json!("hello")),
        ("swapped", json!("hello")),
    ] {
        let r = post(s.addr(), &k, "/v1/completions", &complete(model, prompt)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        replies.push(r.json()["choices"][0]["logprobs"]["token_logprobs"].clone());
    }
    // (Within a rounding's reach: a prompt found in the prefix cache is not prefilled in the
    // same batch shape as a new one.)
    let close = |a: &Value, b: &Value| {
        let (a, b) = (
            a.as_array().expect("logprobs"),
            b.as_array().expect("logprobs"),
        );
        a.len() == b.len()
            && a.iter().zip(b).all(|(x, y)| {
                (x.as_f64().expect("number") - y.as_f64().expect("number")).abs() < 1e-3
            })
    };
    assert!(close(&replies[0], &replies[1]), "{replies:?}");
    assert!(close(&replies[0], &replies[2]), "{replies:?}");
    // And the prompt's ids matter: `hello` is other ids for `swapped`.
    assert!(!close(&replies[0], &replies[3]), "{replies:?}");

    // A chat turn on it renders with its tokenizer too, and its reply reads.
    let body = json!({"model": "swapped", "max_tokens": 3,
                      "messages": [{"role": "user", "content": "Hi"}]});
    let r = post(s.addr(), &k, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    s.finish().await;
    let _ = std::fs::remove_dir_all(root);
}
