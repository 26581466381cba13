//! Models loaded and unloaded while the stack serves, from one repository:
//! - one worker serves two models at once, each on its own engine;
//! - the admin API loads and unloads models, and refuses callers without an admin key;
//! - a load that does not fit the worker's memory budget is refused naming the bytes;
//! - a request for a repository model no worker holds loads it on demand, evicting the least
//!   recently used idle model for room (a streamed one is told that the model is loading), and
//!   an admin key's `keep_alive` unloads an idle model, on OpenAI requests and native turns
//!   alike; an ordinary key's only lengthens a model's stay, up to `--max-keep-alive-secs`;
//! - unloading a model while one of its replies streams lets that reply continue on another
//!   worker serving the model, whole; another model's stream is unaffected.

use std::time::Duration;

use hearth_e2e::http::Req;
use hearth_e2e::stack::{
    finish, history, metric, new_session_with, post, read_tokens, serving_worker, slow_spec,
    stream_turn, token_text, Stack, WORKER_TOKEN,
};
use hearth_orchestrator::auth::KeyOptions;
use hearth_orchestrator::storage::KeyRole;
use hearth_worker::fixtures::{write_tiny_gguf, TinySpec};
use serde_json::{json, Value};

/// The bytes a CPU worker's kernels take for the weights of the GGUF model at `file` (they
/// repack the file's tensors): what the worker's memory accounting counts once it is loaded.
fn cpu_weights_bytes(file: &std::path::Path) -> u64 {
    hearth_worker::model::load_gguf(file)
        .expect("loads")
        .weights_bytes() as u64
}

/// `slow/1` (a model whose replies take seconds), and `alpha/1`, `beta/1` and `gamma/1` (tiny
/// ones, the same size). Returns the repository and the bytes the tiny ones' weights take once
/// loaded.
fn repository(tag: &str) -> (std::path::PathBuf, u64) {
    let root = std::env::temp_dir().join(format!("hearth-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let write = |name: &str, spec: &TinySpec| {
        let dir = root.join(name).join("1");
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("model.gguf");
        write_tiny_gguf(&file, spec).expect("model");
        cpu_weights_bytes(&file)
    };
    let _ = write("slow", &slow_spec());
    let mut size = 0;
    for (i, name) in ["alpha", "beta", "gamma"].into_iter().enumerate() {
        size = write(
            name,
            &TinySpec {
                seed: 21 + i as u64,
                ..TinySpec::default()
            },
        );
    }
    (root, size)
}

async fn admin_key(s: &Stack) -> String {
    let options = KeyOptions {
        role: KeyRole::Admin,
        ..KeyOptions::default()
    };
    s.key_with("root", options).await
}

/// The ids `/v1/models` lists as loaded (not only `available` in a repository).
async fn listed(s: &Stack, key: &str) -> Vec<String> {
    let r = Req::new("GET", "/v1/models")
        .key(Some(key))
        .send(s.addr())
        .await;
    r.json()["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter(|c| c["state"] != "available")
        .map(|c| c["id"].as_str().expect("id").to_string())
        .collect()
}

/// The card `/v1/models` lists for `id`.
async fn card(s: &Stack, key: &str, id: &str) -> Value {
    let r = Req::new("GET", "/v1/models")
        .key(Some(key))
        .send(s.addr())
        .await;
    let data = r.json()["data"].clone();
    data.as_array()
        .expect("data")
        .iter()
        .find(|c| c["id"] == id)
        .cloned()
        .unwrap_or_else(|| panic!("{id} is not listed: {data}"))
}

/// Waits until `/v1/models` lists exactly `want` as loaded (in any order).
async fn wait_listed(s: &Stack, key: &str, want: &[&str]) {
    let mut want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
    want.sort();
    let mut last = Vec::new();
    for _ in 0..100 {
        last = listed(s, key).await;
        last.sort();
        if last == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("/v1/models lists {last:?}, not {want:?}");
}

async fn ask(s: &Stack, key: &str, model: &str, extra: Value) -> hearth_e2e::http::Reply {
    let mut body = json!({"model": model, "max_tokens": 3,
                          "messages": [{"role": "user", "content": "Hi"}]});
    for (k, v) in extra.as_object().expect("object") {
        body[k] = v.clone();
    }
    post(s.addr(), key, "/v1/chat/completions", &body).await
}

/// The worker's models as the admin API lists them: `name@version` → state.
async fn worker_models(s: &Stack, admin: &str) -> Vec<(String, String)> {
    let r = Req::new("GET", "/v1/admin/workers")
        .key(Some(admin))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["data"][0]["models"]
        .as_array()
        .expect("models")
        .iter()
        .map(|m| {
            (
                m["model"].as_str().expect("model").to_string(),
                m["state"].as_str().expect("state").to_string(),
            )
        })
        .collect()
}

/// The keep-alive (ms; negative: for good) the stack's first worker holds for `model`
/// (`name@version`) now, asked of the worker itself: a request's `keep_alive` is applied as the
/// request starts, so once its reply is in, this shows it.
async fn worker_keep_alive(s: &Stack, model: &str) -> i64 {
    use hearth_shared::proto::{worker_client::WorkerClient, InfoRequest};
    let url = format!("http://{}", s.workers[0].grpc);
    let mut c = WorkerClient::connect(url).await.expect("connect");
    let mut req = tonic::Request::new(InfoRequest {});
    let bearer = format!("Bearer {WORKER_TOKEN}").parse().expect("header");
    req.metadata_mut().insert("authorization", bearer);
    let info = c.info(req).await.expect("info").into_inner();
    let m = info
        .models
        .iter()
        .find(|m| format!("{}@{}", m.model_id, m.model_version) == model)
        .unwrap_or_else(|| panic!("the worker holds no {model}: {:?}", info.models));
    m.keep_alive_ms
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_worker_serves_loads_evicts_and_unloads_models_while_another_streams() {
    let (root, tiny) = repository("lifecycle");
    let slow = cpu_weights_bytes(&root.join("slow/1/model.gguf"));
    // Room for slow, alpha and beta with their 64 MiB K/V pools, and not one model more.
    let kv = 64u64 << 20;
    let budget = (slow + kv + 2 * (tiny + kv) + tiny + kv / 2).to_string();
    let specs = ["slow"];
    let flags = [
        "--load",
        "alpha,beta",
        "--memory-budget",
        budget.as_str(),
        "--min-resident-secs",
        "0",
    ];
    let s = Stack::from_repository_with("lifecycle", &root, &specs, &flags, &[]).await;
    let (k, admin) = (s.key("alice").await, admin_key(&s).await);
    wait_listed(&s, &k, &["slow", "alpha", "beta"]).await;
    // gamma is in the repository only: listed as available, loaded by the first request for it.
    let gamma = card(&s, &k, "gamma").await;
    assert_eq!(
        (&gamma["state"], &gamma["workers"]),
        (&json!("available"), &json!(0))
    );

    // A long reply of one model streams through everything below.
    let sid = new_session_with(s.addr(), &k, &json!({"model": "slow"})).await;
    let mut sse = stream_turn(s.addr(), &k, &sid, 300).await;
    let head = token_text(&read_tokens(&mut sse, 3).await);

    // Two models of the one worker answer beside it.
    for m in ["alpha", "beta"] {
        assert_eq!(ask(&s, &k, m, json!({})).await.status, 200, "{m}");
    }

    // Only admin keys reach the admin API.
    let load = json!({"model": "gamma"});
    let r = post(s.addr(), &k, "/v1/admin/models/load", &load).await;
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "permission_error");
    let r = Req::new("GET", "/v1/admin/workers")
        .key(Some(&k))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 403, "{}", r.text());

    // gamma does not fit the budget: refused, naming the bytes, and nothing changes.
    let r = post(s.addr(), &admin, "/v1/admin/models/load", &load).await;
    assert_eq!(r.status, 422, "{}", r.text());
    let e = r.json()["error"].clone();
    assert_eq!(e["code"], "insufficient_memory", "{e}");
    let msg = e["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("gamma@1 needs") && msg.contains("is free"),
        "{msg}"
    );
    assert_eq!(worker_models(&s, &admin).await.len(), 3);

    // Unloading beta makes room; gamma loads.
    let r = post(
        s.addr(),
        &admin,
        "/v1/admin/models/unload",
        &json!({"model": "beta"}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["workers"][0]["worker"], "worker-1");
    let r = post(s.addr(), &admin, "/v1/admin/models/load", &load).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["model"]["state"], "ready", "{}", r.text());
    wait_listed(&s, &k, &["slow", "alpha", "gamma"]).await;
    assert_eq!(ask(&s, &k, "gamma", json!({})).await.status, 200);

    // A request for beta, which no worker holds now, loads it on demand: the least recently
    // used idle model (alpha) is evicted for room. The busy one (slow) never is.
    let loads = "hearth_model_loads_on_demand_total";
    let before = metric(s.addr(), loads).await;
    // Streamed, the response starts at once and says that the model is loading.
    let r = ask(&s, &k, "beta", json!({"stream": true})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let body = r.text();
    let loading = body
        .find(": loading model beta@1")
        .expect("a loading comment");
    assert!(loading < body.find("data: ").expect("chunks"), "{body}");
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    assert_eq!(metric(s.addr(), loads).await, before + 1.0);
    let held: Vec<String> = worker_models(&s, &admin)
        .await
        .into_iter()
        .map(|m| m.0)
        .collect();
    assert!(
        held.contains(&"beta@1".into()) && !held.contains(&"alpha@1".into()),
        "{held:?}"
    );
    assert!(held.contains(&"slow@1".into()), "{held:?}");

    // keep_alive is an operator's tool: gamma is every tenant's. An ordinary key's shorter
    // stay (0 would unload it) changes nothing; its longer one is taken, up to the
    // orchestrator's cap (--max-keep-alive-secs, an hour by default). gamma stays loaded
    // throughout: nothing loads it again.
    let loads_before = metric(s.addr(), loads).await;
    assert_eq!(
        worker_keep_alive(&s, "gamma@1").await,
        -1,
        "for good, at first"
    );
    for (key, keep, held) in [
        (&k, json!(0), -1),
        (&k, json!(30), -1),
        (&admin, json!(60), 60_000),
        (&k, json!(0), 60_000),
        (&k, json!(7200), 3_600_000),
        (&k, json!(-1), 3_600_000),
        (&k, json!(5), 3_600_000),
    ] {
        let r = ask(&s, key, "gamma", json!({ "keep_alive": keep })).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let now = worker_keep_alive(&s, "gamma@1").await;
        assert_eq!(now, held, "after keep_alive {keep} from {key}");
    }
    assert_eq!(
        metric(s.addr(), loads).await,
        loads_before,
        "gamma was reloaded"
    );
    // An admin key's keep_alive 0: gamma goes as soon as its request ends.
    let r = ask(&s, &admin, "gamma", json!({"keep_alive": 0})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    wait_listed(&s, &k, &["slow", "beta"]).await;
    // The same on a native turn: a session of gamma loads it again, and its turn's keep_alive
    // unloads it once the reply is done.
    let gsid = new_session_with(s.addr(), &admin, &json!({"model": "gamma"})).await;
    let turns = format!("/v1/sessions/{gsid}/messages");
    let turn = json!({"content": "Hi", "max_tokens": 3, "stream": false, "keep_alive": 0});
    let r = post(s.addr(), &admin, &turns, &turn).await;
    assert_eq!(r.status, 200, "{}", r.text());
    wait_listed(&s, &k, &["slow", "beta"]).await;
    // A streamed turn of the session, whose model is gone now, loads it again: the stream
    // says so first (`model_loading`, without an id), then brings the reply.
    let turn = json!({"content": "Hi again", "max_tokens": 3, "keep_alive": 0});
    let r = post(s.addr(), &admin, &turns, &turn).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let body = r.text();
    assert!(
        body.starts_with("event: model_loading\ndata: {\"model\":\"gamma@1\""),
        "{body}"
    );
    assert!(body.contains("event: message_end"), "{body}");
    wait_listed(&s, &k, &["slow", "beta"]).await;
    let bad = json!({"content": "Hi", "keep_alive": 1e12});
    let r = post(s.addr(), &admin, &turns, &bad).await;
    assert_eq!(r.status, 422, "{}", r.text());
    assert!(r.text().contains("keep_alive"), "{}", r.text());

    // An unknown model is still a 404, naming what can be asked for.
    let r = ask(&s, &k, "delta", json!({})).await;
    assert_eq!(r.status, 404, "{}", r.text());
    assert!(r.text().contains("`alpha@1`"), "{}", r.text());

    // The slow reply streamed through all of it, whole.
    let (rest, end) = finish(&mut sse).await;
    let e = end.json();
    assert_eq!(
        (end.event.as_str(), &e["finish_reason"]),
        ("message_end", &json!("length")),
        "{e}"
    );
    assert_eq!(e["usage"]["completion_tokens"], 300, "{e}");
    assert_eq!(
        history(s.addr(), &k, &sid).await[1]["content"],
        head + &rest
    );
    s.finish().await;
    let _ = std::fs::remove_dir_all(root);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unloading_a_model_moves_its_reply_to_another_worker_serving_it() {
    let (root, _) = repository("unload");
    let s = Stack::from_repository_with("unload", &root, &["slow", "slow"], &[], &[]).await;
    let (k, admin) = (s.key("alice").await, admin_key(&s).await);
    let sid = new_session_with(s.addr(), &k, &json!({"model": "slow"})).await;
    let mut sse = stream_turn(s.addr(), &k, &sid, 200).await;
    let head = token_text(&read_tokens(&mut sse, 5).await);
    let home = serving_worker(&s).await;
    let worker = format!("worker-{}", home + 1);
    let unload = json!({"model": "slow@1", "worker": worker, "deadline_ms": 1});
    let r = post(s.addr(), &admin, "/v1/admin/models/unload", &unload).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["workers"][0]["ended"], 1, "{}", r.text());
    let (rest, end) = finish(&mut sse).await;
    let e = end.json();
    assert_eq!(e["status"], "complete", "{e}");
    assert_eq!(e["usage"]["completion_tokens"], 200, "{e}");
    assert_eq!(
        history(s.addr(), &k, &sid).await[1]["content"],
        head + &rest
    );
    assert_eq!(metric(s.addr(), "hearth_worker_failovers_total").await, 1.0);
    // The other worker serves it now; the unloaded one is told apart in the admin view.
    let r = Req::new("GET", "/v1/admin/workers")
        .key(Some(&admin))
        .send(s.addr())
        .await;
    let workers = r.json()["data"].clone();
    assert_eq!(workers[home]["models"], json!([]), "{workers}");
    assert_eq!(
        workers[1 - home]["models"][0]["model"],
        "slow@1",
        "{workers}"
    );
    // Unloading what no worker holds is refused.
    let gone = json!({"model": "alpha"});
    let r = post(s.addr(), &admin, "/v1/admin/models/unload", &gone).await;
    assert_eq!(r.status, 422, "{}", r.text());
    s.finish().await;
    let _ = std::fs::remove_dir_all(root);
}
