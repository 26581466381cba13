//! One worker, one long-lived bidirectional `Generate` stream, many requests.
//!
//! A connection task owns the stream. Callers hand it requests through a bounded channel; it
//! assigns request ids, collects new requests into one `GenerateBatch` (flushed when
//! `max_batch` are waiting or `max_delay` after the first), routes each event back to its
//! request by id, and forwards cancels. A dropped [`Generation`] cancels its request. When the
//! stream ends or breaks, every open request gets a final `UNAVAILABLE` error event, so callers
//! can retry elsewhere; the connection then refuses new work.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hearth_shared::proto::{self, worker_client::WorkerClient, worker_event::Kind};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

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

enum Command {
    Submit(
        proto::GenerateRequest,
        mpsc::UnboundedSender<proto::WorkerEvent>,
    ),
    Cancel(u64),
}

/// Requests queued per connection before `generate` answers `Busy`.
const COMMAND_QUEUE: usize = 4096;

#[derive(Debug)]
pub struct WorkerConnection {
    addr: String,
    tx: mpsc::Sender<Command>,
    next_id: AtomicU64,
    open: Arc<AtomicBool>,
}

/// One request's events: `Started`, `Tokens`…, then exactly one `Finished` or `Error`.
#[derive(Debug)]
pub struct Generation {
    pub request_id: u64,
    pub events: mpsc::UnboundedReceiver<proto::WorkerEvent>,
    cancel: mpsc::Sender<Command>,
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
            let _ = self.cancel.try_send(Command::Cancel(self.request_id));
        }
    }
}

impl WorkerConnection {
    /// Connects and opens the stream.
    pub async fn connect(addr: &str, batch: BatchConfig) -> Result<Self, WorkerError> {
        let err = |e: &dyn std::fmt::Display| WorkerError::Connect {
            addr: addr.to_string(),
            reason: e.to_string(),
        };
        let mut client = WorkerClient::connect(format!("http://{addr}"))
            .await
            .map_err(|e| err(&e))?;
        let (out_tx, out_rx) = mpsc::channel(64);
        let inbound = client
            .generate(ReceiverStream::new(out_rx))
            .await
            .map_err(|e| err(&e))?
            .into_inner();
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
        let open = Arc::new(AtomicBool::new(true));
        tokio::spawn(connection_task(
            addr.to_string(),
            rx,
            out_tx,
            inbound,
            batch,
            open.clone(),
        ));
        Ok(Self {
            addr: addr.to_string(),
            tx,
            next_id: AtomicU64::new(1),
            open,
        })
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
        self.tx
            .try_send(Command::Submit(req, etx))
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => WorkerError::Busy(self.addr.clone()),
                mpsc::error::TrySendError::Closed(_) => WorkerError::Closed(self.addr.clone()),
            })?;
        Ok(Generation {
            request_id: id,
            events: erx,
            cancel: self.tx.clone(),
            done: false,
        })
    }
}

type Routes = HashMap<u64, mpsc::UnboundedSender<proto::WorkerEvent>>;

async fn connection_task(
    addr: String,
    mut commands: mpsc::Receiver<Command>,
    out: mpsc::Sender<proto::WorkerRequest>,
    mut inbound: tonic::Streaming<proto::WorkerEvent>,
    batch: BatchConfig,
    open: Arc<AtomicBool>,
) {
    let mut routes: Routes = HashMap::new();
    let mut pending: Vec<proto::GenerateRequest> = Vec::new();
    let mut flush_at: Option<Instant> = None;
    let reason = loop {
        tokio::select! {
            cmd = commands.recv() => match cmd {
                Some(Command::Submit(req, events)) => {
                    routes.insert(req.request_id, events);
                    pending.push(req);
                    flush_at.get_or_insert_with(|| Instant::now() + batch.max_delay);
                    if pending.len() >= batch.max_batch && !flush(&out, &mut pending, &mut flush_at).await {
                        break "the stream to the worker closed".to_string();
                    }
                }
                Some(Command::Cancel(id)) => {
                    if let Some(i) = pending.iter().position(|r| r.request_id == id) {
                        // Never sent: answer it here.
                        pending.remove(i);
                        deliver(&mut routes, cancelled(id));
                    } else if routes.contains_key(&id) {
                        let cancel = proto::WorkerRequest {
                            kind: Some(proto::worker_request::Kind::Cancel(proto::Cancel {
                                request_id: id,
                            })),
                        };
                        if out.send(cancel).await.is_err() {
                            break "the stream to the worker closed".to_string();
                        }
                    }
                }
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
