//! A native reply's events as clients receive them (SSE and the WebSocket alike): each event's
//! id, name and JSON data. The replica running a reply also publishes them, so that another
//! replica can serve a resume (see [`super::shared`]).

use std::borrow::Cow;

use serde::Serialize;
use utoipa::ToSchema;

use super::{Outcome, RunEvent, TurnIds};
use crate::ids::MessageId;
use crate::storage::{Finish, MessageStatus, ReplyTimings, ReplyUsage, ToolCall};

/// The `error_type` of the event a resuming client gets when the reply's shared stream cannot
/// show it the rest as it was begun (see [`super::shared`]).
pub const STREAM_LOST: &str = "stream_lost";

/// One event of a native reply's stream, as SSE and the WebSocket send it: its id
/// (`<message id>:<n>`, what `Last-Event-ID` and `resume` take), its name and its JSON data.
/// Made here from the live log, or read back from Redis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NativeEvent {
    pub id: String,
    pub name: Cow<'static, str>,
    pub data: String,
}

impl NativeEvent {
    /// The reply's last event.
    pub fn is_last(&self) -> bool {
        matches!(&*self.name, "message_end" | "error")
    }

    /// The last event of a reply that ended (not a reader's own `stream_lost`: that reply
    /// goes on).
    pub fn ends_reply(&self) -> bool {
        self.is_last() && !(self.name == "error" && self.data.contains(STREAM_LOST))
    }

    /// The `n`-th (from 0) event of the reply `ids` names.
    pub fn new(ids: &TurnIds, n: usize, e: RunEvent) -> Self {
        let id = format!("{}:{}", ids.message_id, n + 1);
        let (name, data) = match e {
            RunEvent::Begin => ("message_start", event_data(ids)),
            RunEvent::Text(text) => ("token", event_data(&TokenText { text })),
            RunEvent::Logprobs(content) => ("logprobs", event_data(&LogprobsEvent { content })),
            RunEvent::End(o) => match o.end.error() {
                Some(e) => (
                    "error",
                    event_data(&ReplyFailed {
                        error_type: e.kind().to_string(),
                        message: e.to_string(),
                        message_id: ids.message_id.clone(),
                        content: o.content.clone(),
                    }),
                ),
                None => ("message_end", event_data(&ReplyEnd::new(ids, &o))),
            },
        };
        Self {
            id,
            name: Cow::Borrowed(name),
            data,
        }
    }
}

/// How a reply ended: the SSE `message_end` event's data.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReplyEnd {
    #[schema(value_type = String)]
    pub message_id: MessageId,
    pub status: MessageStatus,
    pub finish_reason: Finish,
    pub usage: ReplyUsage,
    pub timings: ReplyTimings,
    /// The worker that finished the reply.
    #[schema(required = true)]
    pub worker: Option<String>,
    /// With `finish_reason` `tool_calls`: the calls the reply makes. Post their results as
    /// `tool_results` on the next turn.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

impl ReplyEnd {
    pub fn new(ids: &TurnIds, o: &Outcome) -> Self {
        Self {
            message_id: ids.message_id.clone(),
            status: o.end.status(),
            finish_reason: o.finish_reason(),
            usage: o.usage,
            timings: o.timings,
            worker: o.worker.clone(),
            tool_calls: o.tool_calls.clone(),
        }
    }
}

/// A reply that ended in an error: the SSE `error` event's data. What it said before the error
/// is kept.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReplyFailed {
    pub error_type: String,
    pub message: String,
    #[schema(value_type = String)]
    pub message_id: MessageId,
    pub content: String,
}

/// The SSE `logprobs` event's data (only for a turn that asked for `logprobs`): the
/// log-probabilities of the tokens whose text the next `token` events bring.
#[derive(Debug, Serialize, ToSchema)]
pub struct LogprobsEvent {
    pub content: Vec<super::TokenLogprob>,
}

/// The SSE `token` event's data.
#[derive(Debug, Serialize, ToSchema)]
pub struct TokenText {
    pub text: String,
}

fn event_data<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_default()
}
