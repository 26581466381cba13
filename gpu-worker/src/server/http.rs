//! The worker's plain-HTTP side: `/metrics` for Prometheus (the worker's metrics and the
//! process's CPU and memory), `/healthz` (alive) and `/readyz` (model loaded and accepting work)
//! for orchestration systems that probe over HTTP.

use std::future::Future;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;

use super::state::{Phase, WorkerState};
use crate::telemetry;

#[derive(Clone)]
struct Http {
    state: Arc<WorkerState>,
    metrics: PrometheusHandle,
}

pub async fn serve(
    listener: TcpListener,
    state: Arc<WorkerState>,
    metrics: PrometheusHandle,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(render))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .with_state(Http { state, metrics });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

async fn render(State(h): State<Http>) -> impl IntoResponse {
    if h.state.phase() != Phase::Loading {
        let (stats, kv) = h.state.models.stats();
        telemetry::refresh(&stats, kv, h.state.in_flight(), h.state.device.memory());
    }
    let mut text = h.metrics.render();
    text.push_str(&hearth_shared::telemetry::process_metrics());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
}

/// The phase (200 only when ready) and the device the model runs on, as JSON.
async fn ready(State(h): State<Http>) -> impl IntoResponse {
    let (status, phase) = match h.state.phase() {
        Phase::Ready => (StatusCode::OK, "ready"),
        Phase::Loading => (StatusCode::SERVICE_UNAVAILABLE, "loading"),
        Phase::Draining => (StatusCode::SERVICE_UNAVAILABLE, "draining"),
    };
    let d = &h.state.device;
    let memory = d.memory();
    let body = serde_json::json!({
        "phase": phase,
        "device": {
            "kind": d.kind,
            "ordinal": d.ordinal,
            "name": d.name,
            "compute_capability": d.compute_capability,
            "memory_total_bytes": memory.total_bytes,
            "memory_used_bytes": memory.used_bytes,
            "memory_free_bytes": memory.free_bytes,
        },
    });
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
}
