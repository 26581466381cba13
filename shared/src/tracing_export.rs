//! Logs and distributed traces, the same for both binaries: log lines on stderr (filtered by
//! `RUST_LOG`), and, when an OTLP endpoint is configured, every span of Hearth's own crates
//! exported over OTLP/gRPC to a collector.
//!
//! Export never makes a request wait: a finished span goes into a bounded queue, and one task
//! sends the queue in batches. When the queue is full (the collector is slow) or a batch cannot
//! be sent (the collector is gone), those spans are dropped and counted in [`DROPPED_SPANS`].

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry::Context;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    Sampler, SdkTracerProvider, Span, SpanData, SpanExporter, SpanProcessor,
};
use opentelemetry_sdk::Resource;
use tokio::sync::mpsc;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Spans that were never delivered to the collector (queue full, or export failed).
pub const DROPPED_SPANS: &str = "hearth_trace_spans_dropped_total";

/// Finished spans waiting to be sent, at most.
const QUEUE: usize = 4096;
/// Spans in one export, at most.
const BATCH: usize = 512;
/// How long a batch gathers spans after its first.
const GATHER: Duration = Duration::from_millis(200);
/// How long one export may take before its spans count as dropped.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// Where spans go: the OTLP/gRPC endpoint (none: not exported), the service's name, and the
/// share of new traces sampled (a request that arrives with a sampled parent is always kept).
#[derive(Debug, Clone, PartialEq)]
pub struct TraceExport {
    pub endpoint: Option<String>,
    pub service: String,
    pub ratio: f64,
}

impl TraceExport {
    /// `endpoint` (a flag), else `OTEL_EXPORTER_OTLP_ENDPOINT`; the name from `OTEL_SERVICE_NAME`,
    /// else `service`; the ratio from `OTEL_TRACES_SAMPLER_ARG` (0 to 1), else 1.
    pub fn from_env(endpoint: Option<String>, service: &str) -> Result<Self, String> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let ratio = match var("OTEL_TRACES_SAMPLER_ARG") {
            None => 1.0,
            Some(v) => v
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|r| (0.0..=1.0).contains(r))
                .ok_or_else(|| {
                    format!("OTEL_TRACES_SAMPLER_ARG: a ratio from 0 to 1, got `{v}`")
                })?,
        };
        Ok(Self {
            endpoint: endpoint.or_else(|| var("OTEL_EXPORTER_OTLP_ENDPOINT")),
            service: var("OTEL_SERVICE_NAME").unwrap_or_else(|| service.to_string()),
            ratio,
        })
    }
}

/// Exports spans while it lives; dropping it flushes nothing (spans in flight are lost).
#[derive(Debug)]
pub struct Exporting {
    provider: SdkTracerProvider,
}

impl Drop for Exporting {
    fn drop(&mut self) {
        let _ = self.provider.shutdown();
    }
}

/// Installs the process's subscriber: log lines filtered by `RUST_LOG` (else `default_filter`),
/// and with an endpoint, the spans of Hearth's crates exported (from a thread of their own).
pub fn init(default_filter: &str, export: &TraceExport) -> Result<Option<Exporting>, String> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| default_filter.into());
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        // Colours for a person at a terminal; plain text for log files and collectors.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_filter(filter);
    let Some(endpoint) = &export.endpoint else {
        tracing_subscriber::registry().with(fmt).init();
        return Ok(None);
    };
    let resource = Resource::builder()
        .with_service_name(export.service.clone())
        .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(Bounded::start(endpoint, resource.clone())?)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            export.ratio,
        ))))
        .with_resource(resource)
        .build();
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    let ours = Targets::new()
        .with_target("hearth", LevelFilter::INFO)
        .with_default(LevelFilter::OFF);
    let spans = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("hearth"))
        .with_filter(ours);
    tracing_subscriber::registry().with(fmt).with(spans).init();
    Ok(Some(Exporting { provider }))
}

/// The span processor: finished spans into a bounded queue, sent by one task in batches.
#[derive(Debug)]
struct Bounded {
    queue: mpsc::Sender<SpanData>,
}

impl Bounded {
    /// The queue, and the thread that sends it to `endpoint` (its own runtime, so no request's
    /// runtime ever waits on the collector).
    fn start(endpoint: &str, resource: Resource) -> Result<Self, String> {
        let (queue, spans) = mpsc::channel(QUEUE);
        let (built, ready) = std::sync::mpsc::channel();
        let endpoint = endpoint.to_string();
        let sender = move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("the trace exporter's runtime: {e}"));
            let runtime = match runtime {
                Ok(r) => r,
                Err(e) => return drop(built.send(Err(e))),
            };
            runtime.block_on(async {
                let exporter = opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_endpoint(endpoint.clone())
                    .with_timeout(EXPORT_TIMEOUT)
                    .build()
                    .map_err(|e| format!("the OTLP exporter for {endpoint}: {e}"));
                match exporter {
                    Ok(mut exporter) => {
                        exporter.set_resource(&resource);
                        let _ = built.send(Ok(()));
                        send_batches(spans, exporter).await;
                    }
                    Err(e) => drop(built.send(Err(e))),
                }
            });
        };
        std::thread::Builder::new()
            .name("hearth-otlp".into())
            .spawn(sender)
            .map_err(|e| format!("the trace exporter's thread: {e}"))?;
        ready
            .recv()
            .map_err(|_| "the trace exporter's thread ended".to_string())??;
        Ok(Self { queue })
    }
}

impl SpanProcessor for Bounded {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if self.queue.try_send(span).is_err() {
            metrics::counter!(DROPPED_SPANS).increment(1);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// Sends the queued spans in batches until the queue closes; a batch that fails is counted as
/// dropped.
async fn send_batches<E: SpanExporter>(mut spans: mpsc::Receiver<SpanData>, exporter: E) {
    while let Some(first) = spans.recv().await {
        let mut batch = vec![first];
        let gathered = tokio::time::sleep(GATHER);
        tokio::pin!(gathered);
        while batch.len() < BATCH {
            tokio::select! {
                next = spans.recv() => match next {
                    Some(s) => batch.push(s),
                    None => break,
                },
                _ = &mut gathered => break,
            }
        }
        let n = batch.len() as u64;
        let sent = tokio::time::timeout(EXPORT_TIMEOUT, exporter.export(batch)).await;
        if !matches!(sent, Ok(Ok(()))) {
            metrics::counter!(DROPPED_SPANS).increment(n);
        }
    }
}

/// The W3C `traceparent` of the current span's context, when it is sampled and exported.
pub fn current_traceparent() -> Option<String> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let cx = tracing::Span::current().context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        )
    })
}

/// The context a W3C `traceparent` names (none when it is absent or malformed).
pub fn context_of(traceparent: Option<&str>) -> Option<Context> {
    use opentelemetry::propagation::TextMapPropagator;
    use opentelemetry::trace::TraceContextExt;
    let tp = traceparent?;
    let carrier = std::collections::HashMap::from([("traceparent".to_string(), tp.to_string())]);
    let cx = opentelemetry_sdk::propagation::TraceContextPropagator::new().extract(&carrier);
    cx.span().span_context().is_valid().then_some(cx)
}

/// Makes `span` a child of the trace `traceparent` names, if any.
pub fn set_parent(span: &tracing::Span, traceparent: Option<&str>) {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if let Some(cx) = context_of(traceparent) {
        let _ = span.set_parent(cx);
    }
}

/// The trace id of `span`, when it is part of an exported trace.
pub fn trace_id(span: &tracing::Span) -> Option<String> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

/// Links `span` to the trace `traceparent` names, if any (a takeover to the reply's first trace).
pub fn link_to(span: &tracing::Span, traceparent: Option<&str>) {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if let Some(cx) = context_of(traceparent) {
        span.add_link(cx.span().span_context().clone());
    }
}

static INCLUDE_CONTENT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether spans may hold prompt and reply text (`--otlp-include-content`; off by default).
pub fn include_content() -> bool {
    INCLUDE_CONTENT.load(std::sync::atomic::Ordering::Relaxed)
}

/// Lets spans hold prompt and reply text, or not.
pub fn set_include_content(on: bool) {
    INCLUDE_CONTENT.store(on, std::sync::atomic::Ordering::Relaxed);
}
