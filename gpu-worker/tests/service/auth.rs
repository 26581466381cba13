//! The worker token: with `--worker-token`, every RPC without the token, or with another one,
//! is refused with UNAUTHENTICATED before it does anything; with it, the worker serves as usual.
//! Without a token the worker will not listen on a network address at all.

use std::path::Path;

use hearth_shared::proto::{self, worker_client::WorkerClient};
use hearth_shared::worker_auth::{AddToken, WorkerToken};
use hearth_worker::fixtures::WorkerProcess;
use tonic::transport::Channel;
use tonic::Code;

use crate::common::worker::{request, spawn_worker};
use crate::common::{prompt, VOCAB};
use crate::tiny_model_file;

const TOKEN: &str = "0123456789abcdef0123456789abcdef";

async fn client(
    w: &WorkerProcess,
    token: Option<&str>,
) -> WorkerClient<tonic::service::interceptor::InterceptedService<Channel, AddToken>> {
    let channel = Channel::from_shared(format!("http://{}", w.grpc))
        .expect("address")
        .connect()
        .await
        .expect("connect");
    let token = token.map(|t| WorkerToken::new(t).expect("token"));
    WorkerClient::with_interceptor(channel, AddToken::new(token.as_ref()))
}

/// The status code of each RPC made with `token`.
async fn codes(w: &WorkerProcess, token: Option<&str>) -> Vec<(&'static str, Code)> {
    let mut c = client(w, token).await;
    let code = |r: Result<(), tonic::Status>| r.err().map_or(Code::Ok, |s| s.code());
    let health = code(c.health(proto::HealthRequest {}).await.map(|_| ()));
    let info = code(c.info(proto::InfoRequest {}).await.map(|_| ()));
    let drop = c
        .drop_session(proto::DropSessionRequest {
            session_id: "s1".into(),
        })
        .await
        .map(|_| ());
    // A session the worker never saw is NOT_FOUND once the call gets through.
    let drop = code(drop);
    let req = proto::WorkerRequest {
        kind: Some(proto::worker_request::Kind::Batch(proto::GenerateBatch {
            requests: vec![request(1, prompt(8, 1, VOCAB), 2)],
        })),
    };
    let generate = match c.generate(tokio_stream::iter(vec![req])).await {
        Err(s) => s.code(),
        Ok(stream) => {
            let mut stream = stream.into_inner();
            match stream.message().await {
                Err(s) => s.code(),
                Ok(_) => Code::Ok,
            }
        }
    };
    vec![
        ("Health", health),
        ("Info", info),
        ("DropSession", drop),
        ("Generate", generate),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rpc_needs_the_worker_token() {
    let model = tiny_model_file();
    let w = spawn_worker(&model, &["--worker-token", TOKEN]);
    let refused: Vec<_> = ["Health", "Info", "DropSession", "Generate"]
        .into_iter()
        .map(|rpc| (rpc, Code::Unauthenticated))
        .collect();
    assert_eq!(codes(&w, None).await, refused, "no token");
    let wrong = "0123456789abcdef0123456789abcdeF";
    assert_eq!(codes(&w, Some(wrong)).await, refused, "another token");
    // Once the model is loaded, every call with the token is served.
    let mut c = client(&w, Some(TOKEN)).await;
    for _ in 0..300 {
        let h = c.health(proto::HealthRequest {}).await.expect("health");
        if h.into_inner().ready {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let served = codes(&w, Some(TOKEN)).await;
    assert!(
        served
            .iter()
            .all(|(_, c)| *c == Code::Ok || *c == Code::NotFound),
        "with the token every call is served: {served:?}"
    );
}

#[test]
fn a_network_address_without_a_token_is_refused_at_start() {
    let model = tiny_model_file();
    let bin = Path::new(env!("CARGO_BIN_EXE_hearth-worker"));
    let out = std::process::Command::new(bin)
        .args([
            "serve",
            "--listen",
            "0.0.0.0:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .arg("--model")
        .arg(&model)
        .env_remove("HEARTH_WORKER_TOKEN")
        .output()
        .expect("run hearth-worker");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--listen: refusing to serve gRPC on 0.0.0.0:0 without --worker-token"),
        "{err}"
    );
}
