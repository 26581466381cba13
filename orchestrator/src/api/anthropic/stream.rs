//! A message streamed as Anthropic's events: `message_start`, `ping`, each content block
//! (`content_block_start`, its deltas, `content_block_stop`), `message_delta` (the stop reason
//! and usage), `message_stop`; a reply that fails ends with an `error` event.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::Event;
use serde_json::{json, Value};
use tokio_stream::{Stream, StreamExt};

use super::wire::{stop_reason, tool_use_block, MessageUsage, OutBlock};
use super::{error_body, Head};
use crate::api::openai::stream::StopOnDrop;
use crate::generate::{Outcome, RunEvent};
use crate::tools::{HeldText, Tools};

/// One event: its name and its JSON, whose `type` repeats the name.
fn event(name: &str, data: Value) -> Result<Event, Infallible> {
    Ok(Event::default().event(name).data(data.to_string()))
}

/// Where the streamed reply stands: the blocks opened so far, and its text held back while it
/// may still become calls of the request's tools.
struct Blocks {
    opened: usize,
    text_open: bool,
    held: HeldText,
}

impl Blocks {
    fn new(tools: Option<Arc<Tools>>) -> Self {
        Self {
            opened: 0,
            text_open: false,
            held: HeldText::new(tools),
        }
    }

    /// The events that show `t`: the text block opened first, unless the text is held back.
    fn text(&mut self, t: String) -> Vec<Result<Event, Infallible>> {
        let Some(t) = self.held.pass(t) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        if t.is_empty() {
            return out;
        }
        if !self.text_open {
            out.push(self.start(&OutBlock::Text {
                text: String::new(),
            }));
            self.text_open = true;
        }
        out.push(event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.opened - 1,
                   "delta": {"type": "text_delta", "text": t}}),
        ));
        out
    }

    fn start(&mut self, block: &OutBlock) -> Result<Event, Infallible> {
        self.opened += 1;
        event(
            "content_block_start",
            json!({"type": "content_block_start", "index": self.opened - 1,
                   "content_block": block}),
        )
    }

    fn stop(&self) -> Result<Event, Infallible> {
        event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": self.opened - 1}),
        )
    }

    /// The events that end the content: the held text as calls (each a `tool_use` block whose
    /// input comes as one `input_json_delta`) or as text, then the open block's stop.
    fn end(&mut self, o: &Outcome) -> Vec<Result<Event, Infallible>> {
        let held = self.held.take();
        let mut out = Vec::new();
        if let Some(calls) = o.tool_calls.as_ref().filter(|_| held.is_some()) {
            for c in calls {
                let OutBlock::ToolUse { id, name, input } = tool_use_block(c) else {
                    continue;
                };
                let empty = OutBlock::ToolUse {
                    id,
                    name,
                    input: json!({}),
                };
                out.push(self.start(&empty));
                out.push(event(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": self.opened - 1,
                           "delta": {"type": "input_json_delta",
                                     "partial_json": input.to_string()}}),
                ));
                out.push(self.stop());
            }
            return out;
        }
        if let Some(t) = held {
            out.extend(self.text(t));
        }
        if !self.text_open {
            // An empty reply still has its (empty) text block, as a finished one does.
            out.push(self.start(&OutBlock::Text {
                text: String::new(),
            }));
        }
        out.push(self.stop());
        out
    }
}

/// The message's events, from `message_start` to `message_stop` (or an `error`). Dropping the
/// stream (the client went away) stops the generation.
pub(super) fn events(
    head: Head,
    guard: StopOnDrop,
    tools: Option<Arc<Tools>>,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    async_stream::stream! {
        let live = guard.0.clone();
        let _guard = guard;
        yield event("message_start", json!({"type": "message_start", "message": {
            "id": head.id, "type": "message", "role": "assistant", "model": head.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 0, "output_tokens": 0}}}));
        yield event("ping", json!({"type": "ping"}));
        let mut blocks = Blocks::new(tools);
        let mut events = std::pin::pin!(live.subscribe(0));
        while let Some((_, e)) = events.next().await {
            match e {
                RunEvent::Text(t) => {
                    for ev in blocks.text(t) {
                        yield ev;
                    }
                }
                RunEvent::End(o) => {
                    let reason = match stop_reason(&o) {
                        Ok(r) => r,
                        Err(e) => {
                            yield event("error", error_body(e.status(), &e.to_string()));
                            return;
                        }
                    };
                    for ev in blocks.end(&o) {
                        yield ev;
                    }
                    yield event("message_delta", json!({"type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": o.stop_sequence},
                        "usage": MessageUsage::of(&o)}));
                    yield event("message_stop", json!({"type": "message_stop"}));
                    return;
                }
                RunEvent::Begin | RunEvent::Logprobs(_) => {}
            }
        }
    }
}
