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
use hearth_orchestrator::storage::KeyRole;
use hearth_worker::fixtures::{write_tiny_gguf, TinySpec};
use serde_json::{json, Value};

const LOADS: &str = "hearth_model_loads_on_demand_total";

/// `alpha/1` and `beta/1`, tiny models of one size; returns the repository and the bytes one
/// takes loaded with its K/V pool (the stack's 64 MiB).
fn repository() -> (std::path::PathBuf, u64) {
    repository_of("tenancy", 1024, 64 << 20)
}

/// [`repository`] with models of `context` positions, and the bytes one takes with a K/V pool
/// of `kv` bytes.
fn repository_of(tag: &str, context: usize, kv: u64) -> (std::path::PathBuf, u64) {
    let root = std::env::temp_dir().join(format!("hearth-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let mut bytes = 0;
    for (i, name) in ["alpha", "beta"].into_iter().enumerate() {
        let dir = root.join(name).join("1");
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("model.gguf");
        let spec = TinySpec {
            seed: 31 + i as u64,
            context,
            ..TinySpec::default()
        };
        write_tiny_gguf(&file, &spec).expect("model");
        let weights = hearth_worker::model::load_gguf(&file)
            .expect("loads")
            .weights_bytes() as u64;
        bytes = weights + kv;
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
        role: KeyRole::Admin,
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

/// One of Bob's turns: the time to its first token, and the gaps between its later tokens.
struct Turn {
    first: f64,
    gaps: Vec<f64>,
}

/// Bob's streamed turns in his session, one after another, until `turns` are done: each turn's
/// times, or why it failed.
async fn bob_turns(s: &Stack, key: &str, sid: &str, turns: usize) -> Vec<Result<Turn, String>> {
    let path = format!("/v1/sessions/{sid}/messages");
    let mut out = Vec::new();
    for i in 0..turns {
        let body = json!({"content": format!("Tell me more, {i}"), "max_tokens": 16,
                          "ignore_eos": true});
        let started = std::time::Instant::now();
        let mut sse = Req::new("POST", &path)
            .key(Some(key))
            .json(&body)
            .events(s.addr())
            .await;
        if sse.status != 200 {
            out.push(Err(format!("turn {i}: {}", sse.status)));
            continue;
        }
        let (mut first, mut last, mut gaps) = (None, None, Vec::new());
        let mut end = None;
        while let Some(e) = sse.next().await {
            if e.event == "token" {
                let now = started.elapsed().as_secs_f64();
                match last {
                    None => first = Some(now),
                    Some(t) => gaps.push(now - t),
                }
                last = Some(now);
            }
            if e.event == "message_end" || e.event == "error" {
                end = Some(e.event);
                break;
            }
        }
        out.push(match (first, end.as_deref()) {
            (Some(first), Some("message_end")) => Ok(Turn { first, gaps }),
            (_, end) => Err(format!("turn {i}: ended {end:?}")),
        });
    }
    out
}

/// 128 tools, each with a schema of its own, every call required: a heavy grammar (kept short
/// in words, so that 16 such prompts fit a tiny model's K/V pool one after another).
fn hostile_tools() -> Value {
    let tools: Vec<Value> = (0..128)
        .map(|i| {
            json!({"type": "function", "function": {"name": format!("t{i}"), "parameters": {
                "type": "object", "properties": {"a": {"type": "integer", "minimum": i}},
                "required": ["a"]}}})
        })
        .collect();
    Value::Array(tools)
}

/// What Alice, an ordinary key, does to the others while Bob chats, until `stop`: keep-alive 0
/// on the model Bob uses, asks for the model that does not fit beside it, reads and patches
/// Bob's session by id, floods sockets, and sends 16 constrained requests with 128 tools at
/// once. Returns what she got: each answer's status, counted.
async fn alice(
    s: &Stack,
    key: &str,
    bobs: &str,
    stop: &std::sync::atomic::AtomicBool,
) -> std::collections::BTreeMap<String, usize> {
    use std::sync::atomic::Ordering;
    let mut seen = std::collections::BTreeMap::new();
    let own = new_session_with(s.addr(), key, &json!({"model": "alpha"})).await;
    let tools = hostile_tools();
    while !stop.load(Ordering::SeqCst) {
        let mut keep = chat("alpha");
        keep["keep_alive"] = json!(0);
        let churn = chat("beta");
        let mut heavy = chat("alpha");
        heavy["tools"] = tools.clone();
        // `SOAK_TOOL_CHOICE=auto` keeps the long prompts and drops the grammar: which of the
        // two costs the others.
        let choice = std::env::var("SOAK_TOOL_CHOICE").unwrap_or_else(|_| "required".into());
        heavy["tool_choice"] = json!(choice);
        heavy["max_tokens"] = json!(8);
        let api = "/v1/chat/completions";
        let mut calls = vec![
            (
                "keep_alive 0",
                answer(post(s.addr(), key, api, &keep).await),
            ),
            ("beta", answer(post(s.addr(), key, api, &churn).await)),
        ];
        // Each on a task of its own: one the client gives up on (60 s) is counted, not fatal.
        let heavy = (0..hostile_requests()).map(|_| {
            let (addr, key, body) = (s.addr(), key.to_string(), heavy.clone());
            tokio::spawn(async move { answer(post(addr, &key, api, &body).await) })
        });
        for r in futures_util::future::join_all(heavy).await {
            let got = r.unwrap_or_else(|_| "no answer within 60 s".into());
            calls.push(("constrained, 128 tools", got));
        }
        for (method, path, body) in [
            ("GET", format!("/v1/sessions/{bobs}/messages"), None),
            (
                "PATCH",
                format!("/v1/sessions/{bobs}"),
                Some(json!({"model": "beta"})),
            ),
            ("GET", format!("/v1/sessions/{bobs}/stream"), None),
        ] {
            let mut r = Req::new(method, &path).key(Some(key));
            if let Some(b) = &body {
                r = r.json(b);
            }
            calls.push(("Bob's session", answer(r.send(s.addr()).await)));
        }
        // Sockets on her own session, past her key's cap, held while she goes on.
        let mut held = Vec::new();
        for _ in 0..40 {
            match open_socket(s.addr(), &own, key).await {
                Ok(ws) => {
                    held.push(ws);
                    calls.push(("socket", "101".into()));
                }
                Err(status) => calls.push(("socket", status.to_string())),
            }
        }
        for (what, status) in calls {
            *seen.entry(format!("{what}: {status}")).or_default() += 1;
        }
    }
    seen
}

/// A reply's status, and its error's code when it has one.
fn answer(r: hearth_e2e::http::Reply) -> String {
    match r.status {
        200..=299 => r.status.to_string(),
        s => {
            let e = r.json()["error"].clone();
            let why: String = e["message"]
                .as_str()
                .unwrap_or("")
                .chars()
                .take(60)
                .collect();
            format!("{s} {} ({why})", e["code"].as_str().unwrap_or(""))
        }
    }
}

/// Opens a WebSocket on session `sid`; the status of a refused upgrade.
async fn open_socket(addr: std::net::SocketAddr, sid: &str, key: &str) -> Result<impl Sized, u16> {
    use tokio_tungstenite::tungstenite::{client::IntoClientRequest, http::HeaderValue, Error};
    let mut req = format!("ws://{addr}/v1/sessions/{sid}/ws")
        .into_client_request()
        .expect("request");
    let bearer = HeaderValue::from_str(&format!("Bearer {key}")).expect("header");
    req.headers_mut().insert("authorization", bearer);
    match tokio_tungstenite::connect_async(req).await {
        Ok((ws, _)) => Ok(ws),
        Err(Error::Http(r)) => Err(r.status().as_u16()),
        Err(_) => Err(0),
    }
}

/// Alice's constrained requests at once (`SOAK_HOSTILE`, 16 by default).
fn hostile_requests() -> usize {
    std::env::var("SOAK_HOSTILE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16)
}

/// The turns that succeeded.
fn succeeded(turns: &[Result<Turn, String>]) -> Vec<&Turn> {
    turns.iter().filter_map(|r| r.as_ref().ok()).collect()
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len().max(1) as f64
}

fn p99(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 * 0.99).ceil() as usize).clamp(1, v.len()) - 1]
}

/// `make tenancy-soak`: Bob chats while Alice, with an ordinary key, tries everything above.
/// Targets: none of Bob's turns fails, his p99 time to first token stays within 2x of a run
/// without Alice and his mean inter-token latency within 1.5x, and none of Bob's session
/// reaches her. Wall-clock figures: run on purpose, not in `make test`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a soak that measures time: make tenancy-soak"]
async fn tenancy_soak() {
    // A context that holds 128 tools' descriptions (the tiny tokenizer spells them out); the
    // stack's 64 MiB of K/V hold one such prompt at a time, beside Bob's.
    let (root, one) = repository_of("tenancy-soak", 32_768, 64 << 20);
    let budget = (one + one / 2).to_string();
    let worker = ["--memory-budget", budget.as_str()];
    let s = Stack::from_repository_with("tenancy_soak", &root, &["alpha"], &worker, &[]).await;
    let (alice_key, bob) = (s.key("alice").await, s.key("bob").await);
    // Each phase in a new session of Bob's: their turns are at the same depths (a turn's time to
    // first token grows with the history it follows).
    let session = json!({"model": "alpha"});
    let (sid, later) = (
        new_session_with(s.addr(), &bob, &session).await,
        new_session_with(s.addr(), &bob, &session).await,
    );
    let turns: usize = std::env::var("SOAK_TURNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);

    let alone = bob_turns(&s, &bob, &sid, turns).await;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (attacked, seen) = tokio::join!(
        async {
            let r = bob_turns(&s, &bob, &later, turns).await;
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
            r
        },
        alice(&s, &alice_key, &later, &stop)
    );
    let failed: Vec<&String> = alone
        .iter()
        .chain(&attacked)
        .filter_map(|r| r.as_ref().err())
        .collect();
    let (a, b) = (succeeded(&alone), succeeded(&attacked));
    let firsts = |v: &[&Turn]| v.iter().map(|t| t.first).collect::<Vec<_>>();
    let gaps = |v: &[&Turn]| {
        v.iter()
            .flat_map(|t| t.gaps.iter().copied())
            .collect::<Vec<_>>()
    };
    let (pa, pb) = (p99(&firsts(&a)), p99(&firsts(&b)));
    let (ga, gb) = (gaps(&a), gaps(&b));
    let (ma, mb) = (mean(&ga), mean(&gb));
    println!("tenancy soak: Bob's {turns} turns alone, then {turns} with Alice");
    println!(
        "  Bob's time to first token p99: alone {:.3} s, with Alice {:.3} s ({:.2}x; target <= 2x)",
        pa,
        pb,
        pb / pa
    );
    println!(
        "  Bob's inter-token latency, mean: alone {:.1} ms, with Alice {:.1} ms ({:.2}x; target <= 1.5x); p99 {:.1} ms and {:.1} ms",
        ma * 1e3,
        mb * 1e3,
        mb / ma,
        p99(&ga) * 1e3,
        p99(&gb) * 1e3
    );
    let mut sorted = firsts(&b);
    sorted.sort_by(f64::total_cmp);
    println!("  Bob's times to first token with Alice, sorted (s): {sorted:.2?}");
    println!("  Bob's failed turns: {} (target 0)", failed.len());
    println!("  what Alice got:");
    for (what, n) in &seen {
        println!("    {n:>5}  {what}");
    }
    let leaked: Vec<&String> = seen
        .keys()
        .filter(|k| k.starts_with("Bob's session: 2"))
        .collect();
    assert!(failed.is_empty(), "Bob's turns failed: {failed:?}");
    assert!(leaked.is_empty(), "Alice reached Bob's session: {leaked:?}");
    assert!(
        pb <= 2.0 * pa,
        "Bob's p99 time to first token: {pb:.3} s with Alice, {pa:.3} s alone"
    );
    assert!(
        mb <= 1.5 * ma,
        "Bob's mean inter-token latency: {mb:.4} s with Alice, {ma:.4} s alone"
    );
    s.finish().await;
    let _ = std::fs::remove_dir_all(root);
}
