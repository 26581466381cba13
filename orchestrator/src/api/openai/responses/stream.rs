//! A response streamed as the Responses API's events, each with its `sequence_number`:
//! `response.created`, `response.in_progress`; the message item (`response.output_item.added`,
//! `response.content_part.added`, `response.output_text.delta`s, `.done` of each), or each
//! function call (`response.output_item.added`, `response.function_call_arguments.delta` and
//! `.done`, `response.output_item.done`); then `response.completed`, `response.incomplete` or
//! `response.failed`.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::Event;
use serde_json::{json, Value};
use tokio_stream::{Stream, StreamExt};

use super::wire::{call_item, OutputItem, OutputText};
use super::Draft;
use crate::api::openai::stream::StopOnDrop;
use crate::generate::{Outcome, RunEvent};
use crate::tools::{HeldText, Tools};

/// Numbers the events of one response.
struct Events {
    next: u64,
}

impl Events {
    /// Event `kind` with `fields`, its `type` and `sequence_number` added.
    fn event(&mut self, kind: &str, mut fields: Value) -> Result<Event, Infallible> {
        fields["type"] = json!(kind);
        fields["sequence_number"] = json!(self.next);
        self.next += 1;
        Ok(Event::default().event(kind).data(fields.to_string()))
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
            out.push(ev.event(
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
        vec![
            ev.event(
                "response.output_item.added",
                json!({"output_index": 0, "item": item}),
            ),
            ev.event(
                "response.content_part.added",
                json!({"item_id": self.id,
                "output_index": 0, "content_index": 0, "part": OutputText::new(String::new())}),
            ),
        ]
    }

    /// The events that end the output: the held text as calls, or the message's closing.
    fn end(&mut self, ev: &mut Events, o: &Outcome) -> Vec<Result<Event, Infallible>> {
        let held = self.held.take();
        if let Some(calls) = o.tool_calls.as_ref().filter(|_| held.is_some()) {
            return calls
                .iter()
                .zip(0..)
                .flat_map(|(c, i)| call_events(ev, &call_item(c), i))
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
            status: "completed",
            content: vec![part.clone()],
        };
        out.push(ev.event(
            "response.output_text.done",
            json!({"item_id": self.id,
            "output_index": 0, "content_index": 0, "text": self.text, "logprobs": []}),
        ));
        out.push(ev.event(
            "response.content_part.done",
            json!({"item_id": self.id,
            "output_index": 0, "content_index": 0, "part": part}),
        ));
        out.push(ev.event(
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
    vec![
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
}

/// The response's events, from `response.created` to its end. Dropping the stream (the client
/// went away) stops the generation.
pub(super) fn events(
    draft: Draft,
    guard: StopOnDrop,
    tools: Option<Arc<Tools>>,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    async_stream::stream! {
        let live = guard.0.clone();
        let _guard = guard;
        let mut ev = Events { next: 0 };
        yield ev.event("response.created", json!({"response": draft.in_progress()}));
        yield ev.event("response.in_progress", json!({"response": draft.in_progress()}));
        let mut message = Message {
            id: draft.message_id(),
            open: false,
            text: String::new(),
            held: HeldText::new(tools),
        };
        let mut run = std::pin::pin!(live.subscribe(0));
        while let Some((_, e)) = run.next().await {
            match e {
                RunEvent::Text(t) => {
                    for e in message.text(&mut ev, t) {
                        yield e;
                    }
                }
                RunEvent::End(o) => {
                    let finish = match o.end.openai_finish_reason() {
                        Ok(f) => f,
                        Err(e) => {
                            let failed = draft.failed(&o, &e.to_string());
                            yield ev.event("response.failed", json!({"response": failed}));
                            return;
                        }
                    };
                    for e in message.end(&mut ev, &o) {
                        yield e;
                    }
                    let done = draft.finished(&o, finish);
                    let kind = match done.status {
                        "incomplete" => "response.incomplete",
                        _ => "response.completed",
                    };
                    yield ev.event(kind, json!({"response": done}));
                    return;
                }
                RunEvent::Begin | RunEvent::Logprobs(_) => {}
            }
        }
    }
}
