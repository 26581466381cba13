//! Streaming requests for a model that must be loaded first (a repository model no worker
//! holds, loaded on demand). Such a request waits for the load, which can take minutes for a
//! large model; instead of a silent connection, its Server-Sent Events response starts at once
//! and says that the model is loading, every [`LOADING_EVERY`], until the reply's own events
//! follow:
//! - on OpenAI's API, as SSE comments (`: loading model gemma-3-1b@1, 3 s`), which OpenAI's
//!   clients skip;
//! - on the native API, as `model_loading` events (no id: they are not part of the reply, and
//!   a resume does not repeat them);
//! - on Anthropic's, as `ping` events, which its clients skip.
//!
//! A request refused after that (the load failed, or what the handler checks once the model is
//! known) can no longer get an HTTP status: it ends the stream with the error's JSON body, as a
//! `data` event on OpenAI's API, as an `error` event without an id on the native one, and as an
//! `error` event of Anthropic's shape on Anthropic's.

use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use axum::response::sse::Event;
use axum::response::Response;
use serde::Serialize;
use tokio_stream::{Stream, StreamExt};

use super::native::sse;
use super::ApiError;

/// How often a waiting stream says the model is still loading.
pub const LOADING_EVERY: Duration = Duration::from_secs(2);

/// Which API's events a waiting stream sends.
#[derive(Debug, Clone, Copy)]
pub(super) enum Api {
    OpenAi,
    Native,
    Anthropic,
}

/// The native `model_loading` event's data.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ModelLoading {
    /// `name@version`, being loaded for this request.
    pub model: String,
    /// Seconds this request has waited for it.
    pub waited_s: u64,
}

/// An SSE response that says `model` is loading until `rest` (the load, then the request's
/// own start) resolves, then streams the events it gives, or its error.
pub(super) fn after_load<F, S>(api: Api, model: String, rest: F) -> Response
where
    F: Future<Output = Result<S, ApiError>> + Send + 'static,
    S: Stream<Item = Result<Event, Infallible>> + Send + 'static,
{
    let events = async_stream::stream! {
        let mut rest = Box::pin(rest);
        let started = tokio::time::Instant::now();
        let mut tick = tokio::time::interval(LOADING_EVERY);
        let outcome = loop {
            tokio::select! {
                r = &mut rest => break r,
                _ = tick.tick() => yield Ok(loading(api, &model, started.elapsed())),
            }
        };
        match outcome {
            Ok(events) => {
                let mut events = Box::pin(events);
                while let Some(e) = events.next().await {
                    yield e;
                }
            }
            Err(e) => yield Ok(refused(api, &e)),
        }
    };
    sse(events)
}

fn loading(api: Api, model: &str, waited: Duration) -> Event {
    match api {
        Api::OpenAi => {
            Event::default().comment(format!("loading model {model}, {} s", waited.as_secs()))
        }
        Api::Anthropic => Event::default().event("ping").data(r#"{"type":"ping"}"#),
        Api::Native => Event::default().event("model_loading").data(
            serde_json::to_string(&ModelLoading {
                model: model.to_string(),
                waited_s: waited.as_secs(),
            })
            .unwrap_or_default(),
        ),
    }
}

fn refused(api: Api, e: &ApiError) -> Event {
    crate::telemetry::count_error(e.error_type());
    let body = serde_json::to_string(&e.body()).unwrap_or_default();
    match api {
        Api::OpenAi => Event::default().data(body),
        Api::Native => Event::default().event("error").data(body),
        Api::Anthropic => {
            let body = super::anthropic::error_body(e.status(), &e.to_string());
            Event::default().event("error").data(body.to_string())
        }
    }
}
