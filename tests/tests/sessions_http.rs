//! The session API over a real socket, with keys on and a real SQLite database.

use std::sync::Arc;

use hearth_e2e::http::Req;
use hearth_orchestrator::api::{router, ApiOptions, AppState, AuthMode};
use hearth_orchestrator::auth::{issue_key, KeyOptions};
use hearth_orchestrator::generate::Streams;
use hearth_orchestrator::limits::Limiter;
use hearth_orchestrator::service::{ChatLimits, ChatService, ServiceParts};
use hearth_orchestrator::storage::SqlStore;
use hearth_orchestrator::workers::{Affinity, PoolConfig, WorkerPool};
use serde_json::{json, Value};

struct Server {
    addr: std::net::SocketAddr,
    store: Arc<SqlStore>,
}

async fn start() -> Server {
    let dir = std::env::temp_dir().join(format!(
        "hearth-api-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir).expect("dir");
    let url = format!("sqlite://{}?mode=rwc", dir.join("hearth.db").display());
    let store = Arc::new(SqlStore::connect(&url).await.expect("store"));
    let tokenizer = dir.join("tokenizer.json");
    hearth_worker::fixtures::write_tiny_tokenizer(&tokenizer, 512).expect("tokenizer");
    // No workers: these tests cover the session routes only.
    let chat = Arc::new(ChatService::new(ServiceParts {
        store: store.clone(),
        pool: WorkerPool::start(&[], Affinity::local(), PoolConfig::default()),
        tokenizers: hearth_orchestrator::service::Tokenizers::from_file(&tokenizer)
            .expect("tokenizer"),
        limiter: Limiter::local(),
        streams: Arc::new(Streams::default()),
        stop_bus: None,
        limits: ChatLimits::default(),
        shared_prompts: Default::default(),
        shared_replies: None,
    }));
    let app = router(AppState {
        chat,
        auth: AuthMode::Keys,
        options: ApiOptions::default(),
        metrics: None,
        body_bytes: Arc::new(tokio::sync::Semaphore::new(
            hearth_orchestrator::api::MAX_BODY_BYTES_IN_FLIGHT,
        )),
        sockets: Arc::default(),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    Server { addr, store }
}

/// One request on a fresh connection: (status, JSON body or Null).
async fn call(
    s: &Server,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<&[u8]>,
) -> (u16, Value) {
    let mut req = Req::new(method, path).key(key);
    if let Some(b) = body {
        req = req.raw(b.to_vec());
    }
    let r = req.send(s.addr).await;
    (r.status, r.json())
}

async fn key(s: &Server, user: &str) -> String {
    issue_key(s.store.as_ref(), user, KeyOptions::default())
        .await
        .expect("key")
        .key
}

fn error_type(v: &Value) -> &str {
    v["error"]["type"]
        .as_str()
        .unwrap_or_else(|| panic!("not an error body: {v}"))
}

#[tokio::test]
async fn sessions_are_created_listed_renamed_and_deleted() {
    let s = start().await;
    let k = key(&s, "alice").await;
    let body = br#"{"title": "Tea", "system_prompt": "Be brief.", "params": {"temperature": 0.5}}"#;
    let (st, created) = call(&s, "POST", "/v1/sessions", Some(&k), Some(body)).await;
    assert_eq!(st, 201, "{created}");
    let id = created["id"].as_str().expect("id").to_string();
    assert_eq!(created["title"], "Tea");
    assert_eq!(created["params"]["temperature"], 0.5);
    for t in ["Coffee", "Rust"] {
        // Distinct creation times, so the newest-first order is certain.
        tokio::time::sleep(std::time::Duration::from_millis(3)).await;
        let b = json!({ "title": t }).to_string();
        assert_eq!(
            call(&s, "POST", "/v1/sessions", Some(&k), Some(b.as_bytes()))
                .await
                .0,
            201
        );
    }
    let (st, list) = call(&s, "GET", "/v1/sessions?limit=2", Some(&k), None).await;
    assert_eq!(st, 200);
    let titles: Vec<_> = list["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|x| x["title"].clone())
        .collect();
    assert_eq!(titles, vec![json!("Rust"), json!("Coffee")]);
    let cursor = list["next_cursor"].as_str().expect("cursor");
    let (_, rest) = call(
        &s,
        "GET",
        &format!("/v1/sessions?limit=2&before={cursor}"),
        Some(&k),
        None,
    )
    .await;
    assert_eq!(rest["data"][0]["title"], "Tea");
    assert_eq!(rest["next_cursor"], Value::Null);
    let (_, found) = call(&s, "GET", "/v1/sessions?q=cof", Some(&k), None).await;
    assert_eq!(found["data"].as_array().map(Vec::len), Some(1));

    let (st, renamed) = call(
        &s,
        "PATCH",
        &format!("/v1/sessions/{id}"),
        Some(&k),
        Some(br#"{"title": "Green tea", "system_prompt": null}"#),
    )
    .await;
    assert_eq!(st, 200, "{renamed}");
    assert_eq!(renamed["title"], "Green tea");
    assert_eq!(renamed["system_prompt"], Value::Null);
    let (st, msgs) = call(
        &s,
        "GET",
        &format!("/v1/sessions/{id}/messages"),
        Some(&k),
        None,
    )
    .await;
    assert_eq!((st, msgs["data"].clone()), (200, json!([])));
    assert_eq!(
        call(&s, "DELETE", &format!("/v1/sessions/{id}"), Some(&k), None)
            .await
            .0,
        204
    );
    assert_eq!(
        call(&s, "GET", &format!("/v1/sessions/{id}"), Some(&k), None)
            .await
            .0,
        404
    );
    // The database is up but no worker is: not ready.
    let (st, ready) = call(&s, "GET", "/readyz", None, None).await;
    assert_eq!((st, ready["ready"].clone()), (503, json!(false)));
}

#[tokio::test]
async fn another_users_session_is_404_on_every_route_and_bad_keys_are_401() {
    let s = start().await;
    let (ka, kb) = (key(&s, "a").await, key(&s, "b").await);
    let (_, created) = call(
        &s,
        "POST",
        "/v1/sessions",
        Some(&ka),
        Some(br#"{"title": "mine"}"#),
    )
    .await;
    let id = created["id"].as_str().expect("id").to_string();
    let path = format!("/v1/sessions/{id}");
    let msgs = format!("{path}/messages");
    let routes: [(&str, &str, Option<&[u8]>); 4] = [
        ("GET", &path, None),
        ("PATCH", &path, Some(br#"{"title": "stolen"}"#)),
        ("DELETE", &path, None),
        ("GET", &msgs, None),
    ];
    for (m, p, b) in routes {
        let (st, body) = call(&s, m, p, Some(&kb), b).await;
        assert_eq!(st, 404, "{m} {p}: {body}");
        assert_eq!(error_type(&body), "not_found_error");
        // The same answer as for a session that does not exist at all.
        let missing = p.replace(&id, &"0".repeat(32));
        assert_eq!(call(&s, m, &missing, Some(&kb), b).await, (st, body));
    }
    let (_, bs) = call(&s, "GET", "/v1/sessions", Some(&kb), None).await;
    assert_eq!(bs["data"], json!([]));
    // A's session is untouched.
    let (st, mine) = call(&s, "GET", &path, Some(&ka), None).await;
    assert_eq!((st, mine["title"].clone()), (200, json!("mine")));

    for bad in [None, Some("hk_nope"), Some(&ka[..60]), Some("")] {
        let (st, body) = call(&s, "GET", "/v1/sessions", bad, None).await;
        assert_eq!(st, 401, "{bad:?}");
        assert_eq!(error_type(&body), "authentication_error");
    }
}

#[tokio::test]
async fn bad_input_gets_a_4xx_json_error_and_changes_nothing() {
    let s = start().await;
    let k = key(&s, "a").await;
    let big = vec![b'a'; 2 << 20];
    let huge_title = json!({ "title": "x".repeat(300) }).to_string();
    let cases: Vec<(&str, &str, Option<&[u8]>, u16)> = vec![
        ("POST", "/v1/sessions", Some(b"{not json"), 400),
        ("POST", "/v1/sessions", Some(br#"{"title": 5}"#), 422),
        ("POST", "/v1/sessions", Some(br#"{"titel": "typo"}"#), 422),
        (
            "POST",
            "/v1/sessions",
            Some(br#"{"params": {"temperature": -1}}"#),
            422,
        ),
        (
            "POST",
            "/v1/sessions",
            Some(br#"{"params": {"top_p": 7}}"#),
            422,
        ),
        ("POST", "/v1/sessions", Some(huge_title.as_bytes()), 422),
        ("POST", "/v1/sessions", Some(&big), 413),
        ("POST", "/v1/sessions", Some(b"\xff\xfe\x00"), 400),
        ("GET", "/v1/sessions?limit=0", None, 422),
        ("GET", "/v1/sessions?limit=abc", None, 422),
        ("GET", "/v1/sessions?before=garbage", None, 422),
        ("GET", "/v1/sessions/not-an-id", None, 404),
        ("GET", "/v1/sessions/..%2F..%2Fetc", None, 404),
        ("DELETE", "/v1/sessions/'%20OR%201=1", None, 404),
        ("GET", "/v1/sessions/%ff%fe", None, 404),
        (
            "POST",
            "/v1/sessions",
            Some(br#"{"title": "a\u0000b"}"#),
            422,
        ),
        (
            "POST",
            "/v1/sessions",
            Some(br#"{"system_prompt": "\u0000"}"#),
            422,
        ),
        ("GET", "/v1/sessions?q=%00", None, 422),
        ("GET", "/v1/nothing-here", None, 404),
        ("PUT", "/v1/sessions", Some(b"{}"), 405),
    ];
    for (m, p, b, want) in cases {
        let (st, body) = call(&s, m, p, Some(&k), b).await;
        assert_eq!(st, want, "{m} {p}: {body}");
        assert!(body["error"]["message"].is_string(), "{m} {p}: {body}");
    }
    let (_, list) = call(&s, "GET", "/v1/sessions", Some(&k), None).await;
    assert_eq!(
        list["data"],
        json!([]),
        "a rejected request stored something"
    );
}
