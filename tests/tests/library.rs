//! The orchestrator as a library: `App::bind` then `App::run(shutdown)`, in this process, on a
//! real worker and a real socket. `run` returns once its shutdown future completes and the
//! server has stopped.

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use hearth_e2e::http::Req;
use hearth_e2e::stack::{assets, path, spawn_worker, Assets, WORKER_TOKEN};
use hearth_orchestrator::server::{App, Config, ServeArgs};
use hearth_orchestrator::storage::SqlStore;
use hearth_worker::fixtures::WorkerProcess;
use serde_json::json;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

/// An app bound to a loopback port (with `extra` flags) on a real worker and a SQLite store.
async fn bound(tag: &str, extra: &[&str]) -> (Assets, WorkerProcess, Arc<SqlStore>, App) {
    let a = assets(tag);
    let worker = spawn_worker(&a);
    let db = format!("sqlite://{}?mode=rwc", a.dir.join("hearth.db").display());
    let store = Arc::new(SqlStore::connect(&db).await.expect("store"));
    let tokenizer = path(&a.tokenizer);
    let mut args = vec![
        "hearth",
        "--listen",
        "127.0.0.1:0",
        "--worker",
        worker.grpc.as_str(),
        "--worker-token",
        WORKER_TOKEN,
        "--tokenizer",
        tokenizer.as_str(),
    ];
    args.extend_from_slice(extra);
    let cli = Cli::parse_from(args);
    let config = Config::from_args(cli.serve).expect("a valid configuration");
    let app = App::bind(config, store.clone()).await.expect("bind");
    (a, worker, store, app)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_serves_from_bind_until_its_shutdown_future_completes() {
    let (a, worker, store, app) = bound(
        "app",
        &["--health-interval-ms", "50", "--shutdown-timeout-secs", "1"],
    )
    .await;
    let addr = app.local_addr();
    assert_ne!(addr.port(), 0, "port 0 is resolved to the bound port");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let client = async move {
        // Serving: the API answers once the worker is ready.
        let mut ready = 0;
        for _ in 0..100 {
            ready = Req::new("GET", "/readyz").send(addr).await.status;
            if ready == 200 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(ready, 200);
        let r = Req::new("POST", "/v1/sessions")
            .json(&json!({"title": "in process"}))
            .send(addr)
            .await;
        assert_eq!(r.status, 201, "{}", r.text());
        let sid = r.json()["id"].as_str().expect("id").to_string();
        let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
            .json(&json!({"content": "hi", "max_tokens": 3, "stream": false}))
            .send(addr)
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
        // Shut down: run returns, and the port no longer accepts.
        stop.send(()).expect("run is waiting");
    };
    let shutdown = async {
        let _ = stopped.await;
    };
    let (served, ()) = tokio::time::timeout(Duration::from_secs(30), async {
        tokio::join!(app.run(shutdown), client)
    })
    .await
    .expect("run returned within 30 s");
    served.expect("run");
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
    store.close().await;
    drop(worker);
    let _ = std::fs::remove_dir_all(&a.dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_move_to_their_own_listener_off_the_api_port() {
    let (a, worker, store, app) = bound("app_metrics", &["--metrics-listen", "127.0.0.1:0"]).await;
    let (addr, metrics) = (
        app.local_addr(),
        app.metrics_addr().expect("metrics address"),
    );
    assert_ne!(metrics.port(), 0);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let client = async move {
        let public = Req::new("GET", "/metrics").send(addr).await;
        assert_eq!(public.status, 404, "no metrics on the API's port");
        let scraped = Req::new("GET", "/metrics").send(metrics).await;
        assert_eq!(scraped.status, 200);
        assert!(scraped.text().contains("hearth_"), "{}", scraped.text());
        stop.send(()).expect("run is waiting");
    };
    let shutdown = async {
        let _ = stopped.await;
    };
    let (served, ()) = tokio::time::timeout(Duration::from_secs(30), async {
        tokio::join!(app.run(shutdown), client)
    })
    .await
    .expect("run returned within 30 s");
    served.expect("run");
    assert!(tokio::net::TcpStream::connect(metrics).await.is_err());
    store.close().await;
    drop(worker);
    let _ = std::fs::remove_dir_all(&a.dir);
}
