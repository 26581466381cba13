//! One batched `Generate` stream to a real `hearth-worker` process (tiny generated model).

use std::time::Duration;

use hearth_orchestrator::workers::{BatchConfig, WorkerConnection, WorkerError, WorkerLink};
use hearth_shared::proto::{self, worker_client::WorkerClient, worker_event::Kind};
use hearth_shared::worker_auth::{AddToken, WorkerToken};
use hearth_worker::fixtures::WorkerProcess;

struct Worker {
    process: WorkerProcess,
    addr: String,
}

fn spawn_worker() -> Worker {
    let process = hearth_e2e::stack::spawn_worker(&hearth_e2e::stack::assets("wc"));
    Worker {
        addr: process.grpc.clone(),
        process,
    }
}

/// The stack's worker token, as the orchestrator sends it.
fn token() -> AddToken {
    let token = WorkerToken::new(hearth_e2e::stack::WORKER_TOKEN).expect("token");
    AddToken::new(Some(&token))
}

/// The link to a stack worker: its token, plain TCP.
fn auth() -> WorkerLink {
    WorkerLink {
        auth: token(),
        ..WorkerLink::default()
    }
}

/// A gRPC client of the worker at `addr` that sends the token.
async fn client(
    addr: &str,
) -> WorkerClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, AddToken>,
> {
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .expect("address")
        .connect()
        .await
        .expect("connect");
    WorkerClient::with_interceptor(channel, token())
}

async fn health(addr: &str) -> proto::HealthResponse {
    let mut c = client(addr).await;
    for _ in 0..500 {
        let h = c
            .health(proto::HealthRequest {})
            .await
            .expect("health")
            .into_inner();
        if h.ready {
            return h;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("worker not ready");
}

fn request(seed: u32, n: u32) -> proto::GenerateRequest {
    proto::GenerateRequest {
        prompt_token_ids: (0..8).map(|i| 200 + (i * 37 + seed * 11) % 300).collect(),
        max_new_tokens: n,
        ignore_eos: true,
        user_id: "u".into(),
        ..Default::default()
    }
}

/// Reads events until the first tokens arrive.
async fn until_tokens(g: &mut hearth_orchestrator::workers::Generation) {
    while let Some(e) = g.next().await {
        if matches!(e.kind, Some(Kind::Tokens(_))) {
            return;
        }
    }
    panic!("ended before any token");
}

/// (tokens, finish reason or error code)
async fn drain(g: &mut hearth_orchestrator::workers::Generation) -> (usize, Result<i32, i32>) {
    let mut tokens = 0;
    while let Some(e) = g.next().await {
        match e.kind.expect("kind") {
            Kind::Tokens(t) => tokens += t.ids.len(),
            Kind::Finished(f) => return (tokens, Ok(f.reason)),
            Kind::Error(err) => return (tokens, Err(err.code)),
            Kind::Started(_) => {}
        }
    }
    panic!("no last event");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_requests_share_one_batched_stream_and_each_gets_its_own_result() {
    let w = spawn_worker();
    health(&w.addr).await;
    let conn = WorkerConnection::connect(
        &w.addr,
        BatchConfig {
            max_batch: 8,
            max_delay: Duration::from_millis(5),
        },
        &auth(),
    )
    .await
    .expect("connect");
    let mut gens: Vec<_> = (0..20)
        .map(|i| (5 + i, conn.generate(request(i, 5 + i)).expect("generate")))
        .collect();
    let ids: std::collections::HashSet<u64> = gens.iter().map(|(_, g)| g.request_id).collect();
    assert_eq!(ids.len(), 20, "request ids are unique");
    for (n, g) in &mut gens {
        assert_eq!(
            drain(g).await,
            (*n as usize, Ok(proto::FinishReason::Length as i32))
        );
    }

    // A dropped generation is cancelled on the worker.
    let mut long = conn.generate(request(99, 900)).expect("generate");
    until_tokens(&mut long).await;
    drop(long);
    let mut c = client(&w.addr).await;
    let mut idle = false;
    for _ in 0..500 {
        let h = c
            .health(proto::HealthRequest {})
            .await
            .expect("health")
            .into_inner();
        if h.running == 0 && h.in_flight == 0 {
            idle = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(idle, "the dropped request kept running");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_worker_fails_every_open_request_with_unavailable() {
    let mut w = spawn_worker();
    health(&w.addr).await;
    let conn = WorkerConnection::connect(&w.addr, BatchConfig::default(), &auth())
        .await
        .expect("connect");
    let mut gens: Vec<_> = (0..4)
        .map(|i| conn.generate(request(i, 900)).expect("generate"))
        .collect();
    // Wait until all are streaming, then kill the worker outright.
    for g in &mut gens {
        until_tokens(g).await;
    }
    w.process.child.kill().expect("kill -9");
    for g in &mut gens {
        let (_, end) = drain(g).await;
        assert_eq!(end, Err(tonic::Code::Unavailable as i32));
    }
    for _ in 0..100 {
        if !conn.is_open() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!conn.is_open());
    assert!(matches!(
        conn.generate(request(1, 1)),
        Err(WorkerError::Closed(_))
    ));
    let err = WorkerConnection::connect(&w.addr, BatchConfig::default(), &auth())
        .await
        .expect_err("gone");
    assert!(err.to_string().contains(&w.addr), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_without_the_worker_token_is_refused() {
    let w = spawn_worker();
    health(&w.addr).await;
    let err = WorkerConnection::connect(&w.addr, BatchConfig::default(), &WorkerLink::default())
        .await
        .expect_err("no token");
    assert!(err.to_string().contains("requires a token"), "{err}");
    let wrong = WorkerToken::new("not-the-stack-token-0123456789").expect("token");
    let link = WorkerLink {
        auth: AddToken::new(Some(&wrong)),
        ..WorkerLink::default()
    };
    let err = WorkerConnection::connect(&w.addr, BatchConfig::default(), &link)
        .await
        .expect_err("another token");
    assert!(err.to_string().contains("wrong worker token"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_over_tls_is_checked_against_the_authority() {
    let ca = hearth_e2e::tls::TestCa::new("worker");
    let other = hearth_e2e::tls::TestCa::new("worker-other");
    let assets = hearth_e2e::stack::assets("wc_tls");
    let (cert, key) = (
        ca.server_cert.display().to_string(),
        ca.server_key.display().to_string(),
    );
    let w = hearth_e2e::stack::worker_with(
        &assets.model,
        &[
            "--kv-budget",
            "64MiB",
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
        ],
    );
    let link = |ca: Option<&std::path::Path>| WorkerLink {
        auth: token(),
        ca: ca.map(|p| std::fs::read(p).expect("CA").into()),
        server_name: None,
    };
    let verified = link(Some(&ca.ca));
    let channel = verified
        .endpoint(&w.grpc)
        .expect("endpoint")
        .connect()
        .await
        .expect("a verified TLS channel");
    let mut c = WorkerClient::with_interceptor(channel, token());
    for _ in 0..500 {
        let h = c
            .health(proto::HealthRequest {})
            .await
            .expect("health over TLS");
        if h.into_inner().ready {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let conn = WorkerConnection::connect(&w.grpc, BatchConfig::default(), &verified)
        .await
        .expect("a verified TLS connection");
    let mut g = conn.generate(request(1, 4)).expect("generate");
    assert_eq!(
        drain(&mut g).await,
        (4, Ok(proto::FinishReason::Length as i32)),
        "a reply over TLS"
    );
    // Checked for the name given rather than the address's host (a worker found by DNS).
    let misnamed = WorkerLink {
        server_name: Some("workers.hearth.test".into()),
        ..verified.clone()
    };
    for (what, l) in [
        ("plain TCP", link(None)),
        ("another authority", link(Some(&other.ca))),
        ("a name its certificate does not hold", misnamed),
    ] {
        let refused = WorkerConnection::connect(&w.grpc, BatchConfig::default(), &l).await;
        assert!(refused.is_err(), "{what} reached a TLS worker");
    }
}
