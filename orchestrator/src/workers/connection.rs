//! One worker, one long-lived bidirectional `Generate` stream, many requests.
//!
//! A connection task owns the stream. Callers hand it requests through a bounded channel; it
//! assigns request ids, collects new requests into one `GenerateBatch` (flushed when
//! `max_batch` are waiting or `max_delay` after the first), routes each event back to its
//! request by id, and forwards cancels. A dropped [`Generation`] cancels its request; cancels
//! travel on their own unbounded channel, so a full request queue cannot lose one. When the
//! stream ends or breaks, or the pool gives up on a worker that stopped answering
//! ([`WorkerConnection::abort`]), every open request gets a final `UNAVAILABLE` error event, so
//! callers can retry elsewhere; the connection then refuses new work.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hearth_shared::proto::{self, worker_client::WorkerClient, worker_event::Kind};
use hearth_shared::worker_auth::AddToken;
use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::Code;

/// A worker client whose every call carries the worker token.
pub type Client = WorkerClient<InterceptedService<Channel, AddToken>>;

/// How the orchestrator reaches its workers: the token every call carries, and TLS when the
/// workers serve it (`--worker-ca`).
#[derive(Clone, Debug, Default)]
pub struct WorkerLink {
    pub auth: AddToken,
    /// The authority that signed the workers' certificates (PEM); without it, plain TCP.
    pub ca: Option<Arc<[u8]>>,
    /// The name a worker's certificate must hold; none: the host of its address. A worker
    /// found by DNS is checked for the name it was found under, not for its IP address.
    pub server_name: Option<Arc<str>>,
}

impl WorkerLink {
    /// The endpoint of the worker at `host:port`: `https://`, its certificate checked against
    /// the authority for `host` (or `server_name`), with a CA; `http://` without.
    pub fn endpoint(&self, addr: &str) -> Result<Endpoint, String> {
        let Some(ca) = &self.ca else {
            return Endpoint::from_shared(format!("http://{addr}")).map_err(|e| e.to_string());
        };
        let host = self.server_name.as_deref().unwrap_or_else(|| {
            addr.rsplit_once(':')
                .map_or(addr, |(h, _)| h)
                .trim_start_matches('[')
                .trim_end_matches(']')
        });
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(ca))
            .domain_name(host);
        Endpoint::from_shared(format!("https://{addr}"))
            .and_then(|e| e.tls_config(tls))
            .map_err(|e| e.to_string())
    }

    pub(super) fn client(&self, channel: Channel) -> Client {
        WorkerClient::with_interceptor(channel, self.auth.clone())
    }
}

/// When queued requests are sent.
#[derive(Debug, Clone, Copy)]
pub struct BatchConfig {
    /// Send at once when this many requests are waiting.
    pub max_batch: usize,
    /// Otherwise send this long after the first one arrived.
    pub max_delay: Duration,
}

impl Default for BatchConfig {
    fn default() -> Self {
        Self {
            max_batch: 32,
            max_delay: Duration::from_millis(2),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkerError {
    #[error("cannot reach worker {addr}: {reason}")]
    Connect { addr: String, reason: String },
    #[error("the connection to worker {0} is closed")]
    Closed(String),
    #[error("worker {0} has too many requests queued on this connection")]
    Busy(String),
}

struct Submit(
    proto::GenerateRequest,
    mpsc::UnboundedSender<proto::WorkerEvent>,
);

/// Requests queued per connection before `generate` answers `Busy`.
const COMMAND_QUEUE: usize = 4096;

#[derive(Debug)]
pub struct WorkerConnection {
    addr: String,
    /// This connection among every one this process opened (see [`WorkerConnection::serial`]).
    serial: u64,
    tx: mpsc::Sender<Submit>,
    cancels: mpsc::UnboundedSender<u64>,
    next_id: AtomicU64,
    open: Arc<AtomicBool>,
    abort: Arc<Abort>,
}

/// Why the pool closed a connection from outside ([`WorkerConnection::abort`]).
#[derive(Debug, Default)]
struct Abort {
    reason: Mutex<Option<String>>,
    signal: Notify,
}

/// One request's events: `Started`, `Tokens`…, then exactly one `Finished` or `Error`.
#[derive(Debug)]
pub struct Generation {
    pub request_id: u64,
    pub events: mpsc::UnboundedReceiver<proto::WorkerEvent>,
    cancel: mpsc::UnboundedSender<u64>,
    done: bool,
}

impl Generation {
    /// The next event; `None` after the last one.
    pub async fn next(&mut self) -> Option<proto::WorkerEvent> {
        if self.done {
            return None;
        }
        let e = self.events.recv().await?;
        self.done = matches!(e.kind, Some(Kind::Finished(_) | Kind::Error(_)));
        Some(e)
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if !self.done {
            // Fails only when the connection task is gone, and then nothing runs to cancel.
            let _ = self.cancel.send(self.request_id);
        }
    }
}

/// A number for each connection opened, never reused.
fn next_serial() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl WorkerConnection {
    /// Which connection this is: a worker reached again (after it restarted) is on another
    /// one, so a reply that failed on the first may go to it.
    pub fn serial(&self) -> u64 {
        self.serial
    }

    /// Connects and opens the stream.
    pub async fn connect(
        addr: &str,
        batch: BatchConfig,
        link: &WorkerLink,
    ) -> Result<Self, WorkerError> {
        let err = |e: &dyn std::fmt::Display| WorkerError::Connect {
            addr: addr.to_string(),
            reason: e.to_string(),
        };
        let channel = link
            .endpoint(addr)
            .map_err(|e| err(&e))?
            .connect()
            .await
            .map_err(|e| err(&e))?;
        let mut client = link.client(channel);
        let (out_tx, out_rx) = mpsc::channel(64);
        let inbound = client
            .generate(ReceiverStream::new(out_rx))
            .await
            .map_err(|e| err(&e))?
            .into_inner();
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
        let (cancels, cancel_rx) = mpsc::unbounded_channel();
        let open = Arc::new(AtomicBool::new(true));
        let abort = Arc::new(Abort::default());
        tokio::spawn(connection_task(
            addr.to_string(),
            Inputs {
                submits: rx,
                cancels: cancel_rx,
                abort: abort.clone(),
            },
            out_tx,
            inbound,
            batch,
            open.clone(),
        ));
        Ok(Self {
            addr: addr.to_string(),
            serial: next_serial(),
            tx,
            cancels,
            next_id: AtomicU64::new(1),
            open,
            abort,
        })
    }

    /// Closes the connection from outside: every open request ends with `UNAVAILABLE` and
    /// `reason` (so its caller fails over), and the connection takes no more work.
    pub fn abort(&self, reason: impl Into<String>) {
        *self.abort.reason.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason.into());
        // notify_one keeps a permit, so the task sees it even if it is busy right now.
        self.abort.signal.notify_one();
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::SeqCst)
    }

    /// Queues `req` (its `request_id` is assigned here).
    pub fn generate(&self, mut req: proto::GenerateRequest) -> Result<Generation, WorkerError> {
        if !self.is_open() {
            return Err(WorkerError::Closed(self.addr.clone()));
        }
        req.request_id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let id = req.request_id;
        let (etx, erx) = mpsc::unbounded_channel();
        self.tx.try_send(Submit(req, etx)).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => WorkerError::Busy(self.addr.clone()),
            mpsc::error::TrySendError::Closed(_) => WorkerError::Closed(self.addr.clone()),
        })?;
        Ok(Generation {
            request_id: id,
            events: erx,
            cancel: self.cancels.clone(),
            done: false,
        })
    }
}

type Routes = HashMap<u64, mpsc::UnboundedSender<proto::WorkerEvent>>;

/// What the connection task listens to besides the worker.
struct Inputs {
    submits: mpsc::Receiver<Submit>,
    cancels: mpsc::UnboundedReceiver<u64>,
    abort: Arc<Abort>,
}

async fn connection_task(
    addr: String,
    mut inputs: Inputs,
    out: mpsc::Sender<proto::WorkerRequest>,
    mut inbound: tonic::Streaming<proto::WorkerEvent>,
    batch: BatchConfig,
    open: Arc<AtomicBool>,
) {
    let mut routes: Routes = HashMap::new();
    let mut pending: Vec<proto::GenerateRequest> = Vec::new();
    let mut flush_at: Option<Instant> = None;
    let mut submits_open = true;
    let reason = loop {
        tokio::select! {
            () = inputs.abort.signal.notified() => {
                let why = inputs.abort.reason.lock().unwrap_or_else(|p| p.into_inner()).take();
                break why.unwrap_or_else(|| "the connection was closed".to_string());
            }
            cmd = inputs.submits.recv(), if submits_open => match cmd {
                Some(Submit(req, events)) => {
                    routes.insert(req.request_id, events);
                    pending.push(req);
                    flush_at.get_or_insert_with(|| Instant::now() + batch.max_delay);
                    if pending.len() >= batch.max_batch && !flush(&out, &mut pending, &mut flush_at).await {
                        break "the stream to the worker closed".to_string();
                    }
                }
                // The connection was dropped: its running requests still finish here.
                None => submits_open = false,
            },
            cancel = inputs.cancels.recv() => match cancel {
                Some(id) => {
                    if !send_cancel(&out, &mut pending, &mut routes, id).await {
                        break "the stream to the worker closed".to_string();
                    }
                }
                // The connection and every request it started are gone.
                None => break "the connection was dropped".to_string(),
            },
            () = sleep_until(flush_at) => {
                if !flush(&out, &mut pending, &mut flush_at).await {
                    break "the stream to the worker closed".to_string();
                }
            }
            msg = inbound.message() => match msg {
                Ok(Some(e)) => deliver(&mut routes, e),
                Ok(None) => break "the worker ended the stream".to_string(),
                Err(status) => break format!("the worker stream failed: {}", status.message()),
            },
        }
    };
    open.store(false, Ordering::SeqCst);
    fail_open(&addr, &reason, routes);
}

/// Ends every request still open on a connection that closed for `reason`: `Unavailable`, which
/// fails it over to another worker.
fn fail_open(addr: &str, reason: &str, mut routes: Routes) {
    tracing::warn!(worker = %addr, %reason, open_requests = routes.len(), "worker connection closed");
    let message = format!("worker {addr}: {reason}");
    for (id, tx) in routes.drain() {
        let _ = tx.send(proto::WorkerEvent {
            request_id: id,
            kind: Some(Kind::Error(proto::Error {
                code: Code::Unavailable as i32,
                message: message.clone(),
            })),
        });
    }
}

/// Cancels request `id`: answered here when it was never sent, else the worker is told. False
/// when the stream to the worker is gone.
async fn send_cancel(
    out: &mpsc::Sender<proto::WorkerRequest>,
    pending: &mut Vec<proto::GenerateRequest>,
    routes: &mut Routes,
    id: u64,
) -> bool {
    if let Some(i) = pending.iter().position(|r| r.request_id == id) {
        pending.remove(i);
        deliver(routes, cancelled(id));
        return true;
    }
    if !routes.contains_key(&id) {
        return true;
    }
    let cancel = proto::WorkerRequest {
        kind: Some(proto::worker_request::Kind::Cancel(proto::Cancel {
            request_id: id,
        })),
    };
    out.send(cancel).await.is_ok()
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// Sends what is pending as one batch; false when the stream is gone.
async fn flush(
    out: &mpsc::Sender<proto::WorkerRequest>,
    pending: &mut Vec<proto::GenerateRequest>,
    flush_at: &mut Option<Instant>,
) -> bool {
    *flush_at = None;
    if pending.is_empty() {
        return true;
    }
    let batch = proto::WorkerRequest {
        kind: Some(proto::worker_request::Kind::Batch(proto::GenerateBatch {
            requests: std::mem::take(pending),
        })),
    };
    out.send(batch).await.is_ok()
}

/// Hands an event to its request, forgetting the request after its last event.
fn deliver(routes: &mut Routes, e: proto::WorkerEvent) {
    let last = matches!(e.kind, Some(Kind::Finished(_) | Kind::Error(_)));
    let id = e.request_id;
    if let Some(tx) = routes.get(&id) {
        let _ = tx.send(e);
    }
    if last {
        routes.remove(&id);
    }
}

fn cancelled(id: u64) -> proto::WorkerEvent {
    proto::WorkerEvent {
        request_id: id,
        kind: Some(Kind::Finished(proto::Finished {
            reason: proto::FinishReason::Cancelled as i32,
            ..Default::default()
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection whose task is not running, so its request queue fills up.
    fn stalled(
        queue: usize,
    ) -> (
        WorkerConnection,
        mpsc::Receiver<Submit>,
        mpsc::UnboundedReceiver<u64>,
    ) {
        let (tx, rx) = mpsc::channel(queue);
        let (cancels, cancel_rx) = mpsc::unbounded_channel();
        let conn = WorkerConnection {
            addr: "w".into(),
            serial: next_serial(),
            tx,
            cancels,
            next_id: AtomicU64::new(1),
            open: Arc::new(AtomicBool::new(true)),
            abort: Arc::new(Abort::default()),
        };
        (conn, rx, cancel_rx)
    }

    #[test]
    fn a_cancel_is_not_lost_when_the_request_queue_is_full() {
        let (conn, _submits, mut cancels) = stalled(1);
        let gen = conn
            .generate(proto::GenerateRequest::default())
            .expect("room for one");
        assert!(matches!(
            conn.generate(proto::GenerateRequest::default()),
            Err(WorkerError::Busy(_))
        ));
        let id = gen.request_id;
        drop(gen);
        assert_eq!(
            cancels.try_recv(),
            Ok(id),
            "the dropped request's cancel was lost"
        );
    }

    #[test]
    fn a_finished_request_sends_no_cancel() {
        let (conn, _submits, mut cancels) = stalled(4);
        let mut gen = conn
            .generate(proto::GenerateRequest::default())
            .expect("queued");
        gen.done = true;
        drop(gen);
        assert!(cancels.try_recv().is_err());
    }
}
