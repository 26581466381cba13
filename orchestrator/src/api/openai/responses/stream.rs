//! A response streamed as the Responses API's events, each with its `sequence_number`:
//! `response.created`, `response.in_progress`; the message item (`response.output_item.added`,
//! `response.content_part.added`, `response.output_text.delta`s, `.done` of each), or each
//! function call (`response.output_item.added`, `response.function_call_arguments.delta` and
//! `.done`, `response.output_item.done`); then `response.completed`, `response.incomplete` or
//! `response.failed`, and last `[DONE]`.
//!
//! The events are derived from the reply's pieces (its text as it came, then its end) alone, so
//! a kept response's stream read again from the reply's log, on any replica, numbers them the
//! same, and `starting_after` resumes it where a client left off.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::Event;
use serde_json::{json, Value};
use tokio_stream::{Stream, StreamExt};

use super::wire::{OutputItem, OutputText, ResponseObject};
use super::Draft;
use crate::api::openai::stream::StopOnDrop;
use crate::generate::RunEvent;
use crate::tools::{HeldText, Tools};

/// What a response's events are made of: the reply's text as it comes, then the object as it
/// ended.
pub(super) enum Piece {
    Text(String),
    End(Box<ResponseObject>),
}

/// Numbers the events of one response, and leaves out those a resumed stream was shown.
struct Events {
    next: u64,
    /// The last event the client has (`starting_after`).
    after: Option<u64>,
}

impl Events {
    /// Event `kind` with `fields`, its `type` and `sequence_number` added; none when the
    /// client has it already.
    fn event(&mut self, kind: &str, mut fields: Value) -> Option<Result<Event, Infallible>> {
        let n = self.next;
        self.next += 1;
        if self.after.is_some_and(|a| n <= a) {
            return None;
        }
        fields["type"] = json!(kind);
        fields["sequence_number"] = json!(n);
        Some(Ok(Event::default().event(kind).data(fields.to_string())))
    }
}

/// Where the streamed message stands: whether its item is open, its text so far, and its text
/// held back while it may still become calls of the request's tools.
struct Message {
    id: String,
    open: bool,
    text: String,
    held: HeldText,
}

impl Message {
    /// The events that show `t`: the item and its part opened first, unless the text is held.
    fn text(&mut self, ev: &mut Events, t: String) -> Vec<Result<Event, Infallible>> {
        let Some(t) = self.held.pass(t) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        if !self.open {
            out.extend(self.opening(ev));
        }
        if !t.is_empty() {
            self.text.push_str(&t);
            out.extend(ev.event(
                "response.output_text.delta",
                json!({"item_id": self.id,
                "output_index": 0, "content_index": 0, "delta": t, "logprobs": []}),
            ));
        }
        out
    }

    fn opening(&mut self, ev: &mut Events) -> Vec<Result<Event, Infallible>> {
        self.open = true;
        let item = json!({"type": "message", "id": self.id, "role": "assistant",
                          "status": "in_progress", "content": []});
        let part = OutputText::new(String::new());
        [
            ev.event(
                "response.output_item.added",
                json!({"output_index": 0, "item": item}),
            ),
            ev.event(
                "response.content_part.added",
                json!({"item_id": self.id, "output_index": 0, "content_index": 0, "part": part}),
            ),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    /// The events that end the output of `done`: the held text as its calls, or the
    /// message's closing.
    fn end(&mut self, ev: &mut Events, done: &ResponseObject) -> Vec<Result<Event, Infallible>> {
        let held = self.held.take();
        let calls = done
            .output
            .iter()
            .filter(|i| matches!(i, OutputItem::FunctionCall { .. }));
        if held.is_some() && calls.clone().next().is_some() {
            return calls
                .zip(0..)
                .flat_map(|(c, i)| call_events(ev, c, i))
                .collect();
        }
        let mut out = Vec::new();
        if let Some(t) = held {
            out.extend(self.text(ev, t));
        }
        if !self.open {
            out.extend(self.opening(ev));
        }
        let part = OutputText::new(self.text.clone());
        let item = OutputItem::Message {
            id: self.id.clone(),
            role: "assistant",
            status: if done.status == "completed" {
                "completed"
            } else {
                "incomplete"
            },
            content: vec![part.clone()],
        };
        out.extend(ev.event(
            "response.output_text.done",
            json!({"item_id": self.id,
            "output_index": 0, "content_index": 0, "text": self.text, "logprobs": []}),
        ));
        out.extend(ev.event(
            "response.content_part.done",
            json!({"item_id": self.id,
            "output_index": 0, "content_index": 0, "part": part}),
        ));
        out.extend(ev.event(
            "response.output_item.done",
            json!({"output_index": 0, "item": item}),
        ));
        out
    }
}

/// One function call's events: its item added, its arguments in one delta, done.
fn call_events(ev: &mut Events, item: &OutputItem, index: usize) -> Vec<Result<Event, Infallible>> {
    let OutputItem::FunctionCall {
        id,
        call_id,
        name,
        arguments,
        ..
    } = item
    else {
        return Vec::new();
    };
    let added = json!({"type": "function_call", "id": id, "call_id": call_id, "name": name,
                       "arguments": "", "status": "in_progress"});
    [
        ev.event(
            "response.output_item.added",
            json!({"output_index": index, "item": added}),
        ),
        ev.event(
            "response.function_call_arguments.delta",
            json!({"item_id": id,
            "output_index": index, "delta": arguments}),
        ),
        ev.event(
            "response.function_call_arguments.done",
            json!({"item_id": id,
            "output_index": index, "name": name, "arguments": arguments}),
        ),
        ev.event(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        ),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// A stateless response's events, from `response.created` to its end. Dropping the stream
/// (the client went away) stops the generation.
pub(super) fn events(
    draft: Draft,
    guard: StopOnDrop,
    tools: Option<Arc<Tools>>,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    let live = guard.0.clone();
    let ending = draft.clone();
    let pieces = live.subscribe(0).filter_map(move |(_, e)| match e {
        RunEvent::Text(t) => Some(Piece::Text(t)),
        RunEvent::End(o) => Some(Piece::End(Box::new(match o.end.openai_finish_reason() {
            Ok(finish) => ending.finished(&o, finish),
            Err(e) => ending.failed(&o, &e.to_string()),
        }))),
        RunEvent::Begin | RunEvent::Logprobs(_) => None,
    });
    let events = translate(draft, tools, pieces, None);
    async_stream::stream! {
        let _guard = guard;
        let mut events = std::pin::pin!(events);
        while let Some(e) = events.next().await {
            yield e;
        }
    }
}

/// A response's events from its `pieces`: `response.created` first, the events the pieces
/// make, then the end's. Those numbered up to `after` are left out.
pub(super) fn translate(
    draft: Draft,
    tools: Option<Arc<Tools>>,
    pieces: impl Stream<Item = Piece> + Send + 'static,
    after: Option<u64>,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    async_stream::stream! {
        let mut ev = Events { next: 0, after };
        let start = json!({"response": draft.in_progress()});
        for e in [ev.event("response.created", start.clone()), ev.event("response.in_progress", start)].into_iter().flatten() {
            yield e;
        }
        let mut message = Message {
            id: draft.message_id(),
            open: false,
            text: String::new(),
            held: HeldText::new(tools),
        };
        let mut pieces = std::pin::pin!(pieces);
        while let Some(piece) = pieces.next().await {
            let done = match piece {
                Piece::Text(t) => {
                    for e in message.text(&mut ev, t) {
                        yield e;
                    }
                    continue;
                }
                Piece::End(done) => done,
            };
            let kind = match done.status {
                "failed" => "response.failed",
                "completed" => "response.completed",
                _ => "response.incomplete",
            };
            if kind != "response.failed" {
                for e in message.end(&mut ev, &done) {
                    yield e;
                }
            }
            if let Some(e) = ev.event(kind, json!({"response": done})) {
                yield e;
            }
            // The Open Responses stream's terminal event.
            yield Ok(Event::default().data("[DONE]"));
            return;
        }
    }
}
