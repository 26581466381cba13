//! A real `hearth-worker serve` process on loopback ports, the signals and exit a test sends and
//! waits for, and a gRPC client for it.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use hearth_shared::proto::{self, worker_client::WorkerClient, worker_event::Kind};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Streaming;

pub use hearth_worker::fixtures::WorkerProcess as WorkerProc;

/// Starts the worker binary on `model` (64 MiB of KV unless `extra` says otherwise).
pub fn spawn_worker(model: &Path, extra: &[&str]) -> WorkerProc {
    let mut args = vec!["--kv-budget", "64MiB"];
    args.extend_from_slice(extra);
    WorkerProc::spawn(Path::new(env!("CARGO_BIN_EXE_hearth-worker")), model, &args)
        .expect("start hearth-worker")
}

/// Sends a POSIX signal to the worker process.
pub fn signal(w: &WorkerProc, sig: i32) {
    // SAFETY: kill(2) on a child we own; no memory is touched.
    let rc = unsafe { libc::kill(w.child.id() as i32, sig) };
    assert_eq!(rc, 0, "kill failed");
}

/// Waits up to 20 s for the worker process to exit; its exit status.
pub async fn wait_exit(w: &mut WorkerProc) -> std::process::ExitStatus {
    for _ in 0..1000 {
        if let Some(status) = w.child.try_wait().expect("try_wait") {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("worker did not exit within 20 s");
}

pub async fn connect(w: &WorkerProc) -> WorkerClient<Channel> {
    WorkerClient::connect(format!("http://{}", w.grpc))
        .await
        .expect("connect to worker")
}

pub async fn health(c: &mut WorkerClient<Channel>) -> proto::HealthResponse {
    c.health(proto::HealthRequest {})
        .await
        .expect("health")
        .into_inner()
}

/// Polls `Health` until the model is loaded (bounded, so a broken worker fails the test).
pub async fn wait_ready(c: &mut WorkerClient<Channel>) -> proto::HealthResponse {
    for _ in 0..300 {
        let h = health(c).await;
        if h.ready {
            return h;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("worker never became ready");
}

/// Polls `Health` until `pred` holds.
pub async fn wait_health(
    c: &mut WorkerClient<Channel>,
    what: &str,
    pred: impl Fn(&proto::HealthResponse) -> bool,
) -> proto::HealthResponse {
    let mut last = None;
    for _ in 0..500 {
        let h = health(c).await;
        if pred(&h) {
            return h;
        }
        last = Some(h);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("health never showed {what}: {last:?}");
}

/// Fetches `/metrics` and returns the value of an unlabelled sample.
pub async fn metric(w: &WorkerProc, name: &str) -> Option<f64> {
    let text = http_get(&w.metrics, "/metrics").await.1;
    text.lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
}

/// A minimal HTTP/1.1 GET over a fresh connection: (status, body).
pub async fn http_get(base: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let host = base.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(host).await.expect("connect");
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .expect("write");
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.expect("read");
    let status = buf
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status code");
    let body = buf
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

/// One open `Generate` stream.
pub struct GenStream {
    pub tx: mpsc::Sender<proto::WorkerRequest>,
    pub events: Streaming<proto::WorkerEvent>,
}

pub async fn open(c: &mut WorkerClient<Channel>) -> GenStream {
    let (tx, rx) = mpsc::channel(64);
    let events = c
        .generate(ReceiverStream::new(rx))
        .await
        .expect("open generate stream")
        .into_inner();
    GenStream { tx, events }
}

impl GenStream {
    pub async fn send(&self, requests: Vec<proto::GenerateRequest>) {
        self.tx
            .send(proto::WorkerRequest {
                kind: Some(proto::worker_request::Kind::Batch(proto::GenerateBatch {
                    requests,
                })),
            })
            .await
            .expect("send batch");
    }

    pub async fn cancel(&self, request_id: u64) {
        self.tx
            .send(proto::WorkerRequest {
                kind: Some(proto::worker_request::Kind::Cancel(proto::Cancel {
                    request_id,
                })),
            })
            .await
            .expect("send cancel");
    }

    pub async fn next(&mut self) -> proto::WorkerEvent {
        tokio::time::timeout(Duration::from_secs(60), self.events.message())
            .await
            .expect("an event within 60 s")
            .expect("stream ok")
            .expect("stream open")
    }

    /// Reads events until each of `ids` has its last event.
    pub async fn collect(&mut self, ids: &[u64]) -> HashMap<u64, Outcome> {
        let mut out = HashMap::new();
        self.collect_into(&mut out, ids).await;
        out
    }

    /// Like [`Self::collect`], continuing outcomes already begun.
    pub async fn collect_into(&mut self, out: &mut HashMap<u64, Outcome>, ids: &[u64]) {
        let mut done = 0;
        while done < ids.len() {
            let e = self.next().await;
            assert!(
                ids.contains(&e.request_id),
                "event for unknown request {e:?}"
            );
            if out.entry(e.request_id).or_default().apply(e) {
                done += 1;
            }
        }
    }
}

/// Everything one request produced.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    pub cached_tokens: Option<u32>,
    pub tokens: Vec<u32>,
    pub finished: Option<proto::Finished>,
    pub error: Option<proto::Error>,
}

impl Outcome {
    /// Adds an event; true when it was the request's last.
    pub fn apply(&mut self, e: proto::WorkerEvent) -> bool {
        assert!(
            self.finished.is_none() && self.error.is_none(),
            "event after the last one: {e:?}"
        );
        match e.kind.expect("event kind") {
            Kind::Started(s) => {
                assert!(self.cached_tokens.is_none(), "two Started events");
                self.cached_tokens = Some(s.cached_tokens);
                false
            }
            Kind::Tokens(t) => {
                assert!(self.cached_tokens.is_some(), "tokens before Started");
                assert_eq!(t.ids.len(), t.logprobs.len());
                self.tokens.extend(t.ids);
                false
            }
            Kind::Finished(f) => {
                self.finished = Some(f);
                true
            }
            Kind::Error(err) => {
                self.error = Some(err);
                true
            }
        }
    }

    pub fn reason(&self) -> proto::FinishReason {
        let f = self
            .finished
            .as_ref()
            .unwrap_or_else(|| panic!("not finished: {self:?}"));
        proto::FinishReason::try_from(f.reason).expect("known reason")
    }

    pub fn error_code(&self) -> tonic::Code {
        tonic::Code::from(
            self.error
                .as_ref()
                .unwrap_or_else(|| panic!("no error: {self:?}"))
                .code,
        )
    }
}

/// A greedy request with fixed output length.
pub fn request(id: u64, prompt: Vec<u32>, max_new_tokens: u32) -> proto::GenerateRequest {
    proto::GenerateRequest {
        request_id: id,
        user_id: "tester".into(),
        prompt_token_ids: prompt,
        max_new_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}
