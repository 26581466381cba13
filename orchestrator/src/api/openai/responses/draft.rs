//! The `response` object of one response: what it repeats of its request, and its state as the
//! reply runs and ends (from the running reply's outcome, or from the kept message).

use serde_json::{json, Value};

use super::wire::{call_item, Echo, OutputItem, OutputText, ResponseObject, ResponseUsage};
use super::ResponsesRequest;
use crate::generate::{OpenAiFinish, Outcome};
use crate::ids::MessageId;
use crate::service::ModelDefaults;
use crate::storage::{Completion, Finish, Message, MessageStatus, ReplyUsage, ToolCall};

/// The `response` object before its reply: what it repeats of the request.
#[derive(Debug, Clone)]
pub(super) struct Draft(ResponseObject);

impl Draft {
    /// The draft of `req`, answered by `model` whose sampling defaults are `defaults`.
    pub(super) fn new(
        req: &ResponsesRequest,
        model: String,
        has_tools: bool,
        defaults: &ModelDefaults,
    ) -> Self {
        let tools: Vec<Value> = req
            .tools
            .iter()
            .flatten()
            .map(|t| serde_json::to_value(t).unwrap_or_default())
            .collect();
        let default_choice = if has_tools { "auto" } else { "none" };
        let stored = req.stored();
        Self::of(
            format!("resp_{}", uuid::Uuid::new_v4().simple()),
            crate::storage::now_ms() / 1000,
            Echo {
                model,
                instructions: req.instructions.clone(),
                max_output_tokens: req.max_output_tokens,
                metadata: req.metadata.clone().unwrap_or_else(|| json!({})),
                parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
                previous_response_id: req.previous_response_id.clone().filter(|_| stored),
                store: stored,
                background: stored && req.background == Some(true),
                temperature: req.temperature.unwrap_or(defaults.openai_temperature()),
                top_p: req.top_p.unwrap_or(defaults.params().top_p),
                presence_penalty: defaults.params().presence_penalty,
                frequency_penalty: defaults.params().frequency_penalty,
                top_logprobs: 0,
                tool_choice: req.tool_choice.clone().unwrap_or(json!(default_choice)),
                tools,
                text: json!({"format": req.text.as_ref().and_then(|t| t.format.clone())
                .unwrap_or(json!({"type": "text"}))}),
                truncation: req.truncation.clone().unwrap_or("disabled".into()),
                user: req.user.clone(),
                reasoning: None,
                max_tool_calls: None,
                service_tier: "default".into(),
                safety_identifier: req.safety_identifier.clone(),
                prompt_cache_key: req.prompt_cache_key.clone(),
            },
        )
    }

    /// A kept response's object, before its reply: `id` from its message, `created_at` in
    /// Unix milliseconds.
    pub(super) fn kept(reply: &MessageId, created_at_ms: i64, request: Echo) -> Self {
        Self::of(response_id(reply), created_at_ms / 1000, request)
    }

    fn of(id: String, created_at: i64, request: Echo) -> Self {
        Self(ResponseObject {
            id,
            object: "response",
            created_at,
            status: "in_progress",
            output: Vec::new(),
            error: None,
            incomplete_details: None,
            completed_at: None,
            request,
            usage: None,
        })
    }

    /// The object as it stands before the reply: `in_progress`, no output.
    pub(super) fn in_progress(&self) -> &ResponseObject {
        &self.0
    }

    /// What it repeats of its request.
    pub(super) fn request(&self) -> &Echo {
        &self.0.request
    }

    /// The `message` item's id.
    pub(super) fn message_id(&self) -> String {
        format!("msg_{}", self.0.id.trim_start_matches("resp_"))
    }

    /// The object once the reply finished (`finish`): `completed`, or `incomplete` when it
    /// was cut by its length, with its output and usage.
    pub(super) fn finished(&self, o: &Outcome, finish: OpenAiFinish) -> ResponseObject {
        let status = match finish {
            OpenAiFinish::Length => "incomplete",
            OpenAiFinish::Stop | OpenAiFinish::ToolCalls => "completed",
        };
        self.with(&o.content, o.tool_calls.as_deref(), status, &o.usage)
    }

    /// The object of a reply that failed saying `message`.
    pub(super) fn failed(&self, o: &Outcome, message: &str) -> ResponseObject {
        let mut r = self.0.clone();
        r.status = "failed";
        r.completed_at = Some(crate::storage::now_ms() / 1000);
        r.error = Some(json!({"code": "server_error", "message": message}));
        r.usage = Some(ResponseUsage::of(&o.usage));
        r
    }

    /// The object of a kept response as its message stands: `in_progress` while it streams
    /// (with its text so far), then as it ended.
    pub(super) fn of_reply(&self, m: &Message) -> ResponseObject {
        let count = |n: Option<i64>| n.and_then(|n| u64::try_from(n).ok()).unwrap_or(0);
        let usage = ReplyUsage {
            prompt_tokens: count(m.prompt_tokens),
            cached_tokens: count(m.cached_tokens),
            completion_tokens: count(m.completion_tokens),
        };
        if m.status == MessageStatus::Streaming {
            let mut r = self.with(&m.content, None, "in_progress", &usage);
            r.usage = None;
            r.output.retain(|_| !m.content.is_empty());
            return r;
        }
        let mut r = self.ended(&Completion {
            content: m.content.clone(),
            status: m.status,
            finish_reason: m.finish_reason.unwrap_or(Finish::Stop),
            usage,
            timings: Default::default(),
            worker: m.worker.clone(),
            tool_calls: m.tool_calls.clone(),
        });
        r.completed_at = Some(m.updated_at / 1000);
        r
    }

    /// The object of a kept response whose reply ended as `c`: `completed`, `incomplete` (cut
    /// by its length), `cancelled` (stopped) or `failed`.
    pub(super) fn ended(&self, c: &Completion) -> ResponseObject {
        let status = match (c.status, c.finish_reason) {
            (MessageStatus::Stopped, _) => "cancelled",
            (MessageStatus::Error, _) => "failed",
            (_, Finish::Length | Finish::ContextFull) => "incomplete",
            _ => "completed",
        };
        let mut r = self.with(&c.content, c.tool_calls.as_deref(), status, &c.usage);
        if status == "failed" {
            let why = c.finish_reason.as_str();
            let message = format!("the reply could not be completed ({why})");
            r.error = Some(json!({"code": "server_error", "message": message}));
        }
        r
    }

    /// The object with its output (`content`, or `calls`), `status` and usage.
    fn with(
        &self,
        content: &str,
        calls: Option<&[ToolCall]>,
        status: &'static str,
        usage: &ReplyUsage,
    ) -> ResponseObject {
        let mut r = self.0.clone();
        let item_status = match status {
            "in_progress" => "in_progress",
            "completed" => "completed",
            _ => "incomplete",
        };
        r.output = match calls {
            Some(calls) => calls.iter().map(call_item).collect(),
            None => vec![OutputItem::Message {
                id: self.message_id(),
                role: "assistant",
                status: item_status,
                content: vec![OutputText::new(content.to_string())],
            }],
        };
        r.status = status;
        if status != "in_progress" {
            r.completed_at = Some(crate::storage::now_ms() / 1000);
        }
        if status == "incomplete" {
            r.incomplete_details = Some(json!({"reason": "max_output_tokens"}));
        }
        r.usage = Some(ResponseUsage::of(usage));
        r
    }
}

/// The id of the response whose reply is the message `reply`.
pub(super) fn response_id(reply: &MessageId) -> String {
    format!("resp_{reply}")
}
