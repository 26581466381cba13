//! A real OTLP/gRPC trace receiver (tonic with the `opentelemetry-proto` types), for the
//! tracing tests and for `hearth-otlp-sink`: it keeps every span it is sent.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;

/// A span as received: its service, ids, name and attributes (as text).
#[derive(Debug, Clone)]
pub struct Got {
    pub service: String,
    pub trace: String,
    pub id: String,
    pub parent: String,
    pub name: String,
    pub attrs: HashMap<String, String>,
    /// The trace ids of the spans it links to.
    pub links: Vec<String>,
}

#[derive(Debug, Clone, Default)]
pub struct Receiver {
    pub spans: Arc<Mutex<Vec<Got>>>,
}

fn text(v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.clone()) {
        Some(Any::StringValue(s)) => s,
        Some(Any::IntValue(i)) => i.to_string(),
        Some(Any::DoubleValue(d)) => d.to_string(),
        Some(Any::BoolValue(b)) => b.to_string(),
        other => format!("{other:?}"),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut got = self.spans.lock().expect("spans");
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .map(|a| text(&a.value))
                .unwrap_or_default();
            for s in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                got.push(Got {
                    service: service.clone(),
                    trace: hex(&s.trace_id),
                    id: hex(&s.span_id),
                    parent: hex(&s.parent_span_id),
                    name: s.name,
                    attrs: s
                        .attributes
                        .iter()
                        .map(|a| (a.key.clone(), text(&a.value)))
                        .collect(),
                    links: s.links.iter().map(|l| hex(&l.trace_id)).collect(),
                });
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// A receiver listening on loopback, and what shuts it down (its connections closed, its
/// port no longer listening).
pub async fn receiver() -> (Receiver, SocketAddr, Gone) {
    receiver_at("127.0.0.1:0").await
}

/// A receiver listening on `at`.
pub async fn receiver_at(at: &str) -> (Receiver, SocketAddr, Gone) {
    let listener = tokio::net::TcpListener::bind(at).await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let r = Receiver::default();
    let service = TraceServiceServer::new(r.clone());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let _ = tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stopped.await;
            })
            .await;
    });
    (r, addr, Gone { stop, task })
}

#[derive(Debug)]
pub struct Gone {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Gone {
    /// Shuts the receiver down: its connections closed, its port no longer listening.
    pub async fn now(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}
