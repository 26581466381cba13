//! The OpenAI-compatible API: `POST /v1/chat/completions` (streaming and not, with structured
//! outputs, tools, log-probabilities and several choices) and `GET /v1/models`. Stateless:
//! nothing is stored, and a client that goes away cancels its generation. Fields Hearth cannot
//! honour are refused with a 422 that names them rather than silently ignored; fields that do
//! not change the output (`metadata`, …) are accepted.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use hearth_shared::chat::Role as ChatRole;
use hearth_shared::{Grammar, SamplingParams};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio_stream::StreamExt;
use utoipa::ToSchema;

use super::chat::sse;
use super::{ApiError, AppState, ValidJson};
use crate::generate::{Live, Outcome, RunEvent, TokenLogprob};
use crate::service::{
    Caller, ChatError, Conversation, GenOptions, ModelDefaults, Target, ValidTurn, MAX_CHOICES,
};
use crate::tools::{
    assistant_text, call_names, tool_text, turn_grammar, InToolCall, Tool, ToolCall, ToolChoice,
    Tools,
};
use crate::workers::ServedModel;
use hearth_shared::versions::compare_versions;

/// OpenAI's chat completion request. Fields that do not change the output (`metadata`, …) are
/// accepted and ignored; those Hearth cannot honour are refused by name.
#[derive(Debug, Deserialize, ToSchema)]
pub struct ChatRequest {
    /// A served model's name, as `/v1/models` lists it (its newest ready version), or
    /// `name@version` for one version; another is a 404 `model_not_found`. Absent: the default
    /// model (the first `/v1/models` lists).
    #[serde(default)]
    model: Option<String>,
    #[schema(min_items = 1)]
    messages: Vec<InMessage>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    /// Longest reply: at least 1 and less than the model's context.
    #[serde(default)]
    #[schema(minimum = 1)]
    max_tokens: Option<u32>,
    /// Takes precedence over `max_tokens`.
    #[serde(default)]
    #[schema(minimum = 1)]
    max_completion_tokens: Option<u32>,
    /// OpenAI's default, 1, when absent; 0 is greedy.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 100)]
    temperature: Option<f32>,
    #[serde(default)]
    #[schema(exclusive_minimum = 0, maximum = 1)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<u32>,
    #[serde(default)]
    #[schema(minimum = 0, maximum = 1)]
    min_p: Option<f32>,
    #[serde(default)]
    #[schema(exclusive_minimum = 0, maximum = 10)]
    repetition_penalty: Option<f32>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    stop: Option<StopField>,
    /// Non-standard (vLLM, llama.cpp): generate exactly `max_tokens`.
    #[serde(default)]
    ignore_eos: bool,
    /// Choices to generate (1 to 16); the prompt is prefilled once and counted once in usage.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 16)]
    n: Option<u32>,
    #[serde(default)]
    #[schema(minimum = -2, maximum = 2)]
    frequency_penalty: Option<f32>,
    #[serde(default)]
    #[schema(minimum = -2, maximum = 2)]
    presence_penalty: Option<f32>,
    /// Token id (as a string key) to a bias in [-100, 100] added to its logit; at most 300.
    #[serde(default)]
    logit_bias: Option<std::collections::BTreeMap<u32, f32>>,
    /// Non-standard (llama.cpp's DRY sampler); see the native API's `params`.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 10)]
    dry_multiplier: Option<f32>,
    #[serde(default)]
    #[schema(minimum = 1, maximum = 10)]
    dry_base: Option<f32>,
    #[serde(default)]
    #[schema(minimum = 1, maximum = 1024)]
    dry_allowed_length: Option<u32>,
    #[serde(default)]
    #[schema(minimum = -1)]
    dry_penalty_last_n: Option<i32>,
    #[serde(default)]
    dry_sequence_breakers: Option<Vec<String>>,
    /// Each token's log-probability in `choices[].logprobs.content`.
    #[serde(default)]
    logprobs: Option<bool>,
    /// With `logprobs`: this many likeliest alternatives per token.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 20)]
    top_logprobs: Option<u32>,
    /// Functions the model may call (at most 128); see `tool_choice`.
    #[serde(default)]
    tools: Option<Vec<Tool>>,
    /// `auto` (the default with tools: the model answers or calls), `none`, `required` (a
    /// call to any tool), or a named function; the last two constrain the reply to a call.
    #[serde(default)]
    tool_choice: Option<ToolChoice>,
    /// The end user the request is for (at most 256 bytes): within the API key's share of the
    /// workers, each end user gets a fair share of its own.
    #[serde(default)]
    user: Option<String>,
    /// Non-standard (Ollama): how long, in seconds, the model stays loaded once idle, from
    /// this request on; negative keeps it for good, 0 unloads it as soon as it is idle. It
    /// applies to models from a worker's repository, which load again on demand.
    #[serde(default)]
    keep_alive: Option<f64>,
    /// Accepted: the model may make several calls in one reply (a JSON array of them).
    #[serde(default)]
    #[allow(dead_code)]
    parallel_tool_calls: Option<bool>,
    /// `text` (the default), `json_object` (any JSON object) or `json_schema` (JSON that
    /// validates against `json_schema.schema`): the reply is constrained to it as it is sampled.
    #[serde(default)]
    response_format: Option<ResponseFormat>,
    /// Non-standard: a Lark grammar or a regular expression the reply follows (or a JSON
    /// Schema, as on the native API). Not with a `response_format` other than `text`.
    #[serde(default)]
    grammar: Option<Grammar>,
}

/// OpenAI's `response_format`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(super) enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

#[derive(Debug, Deserialize, ToSchema)]
pub(super) struct JsonSchemaFormat {
    /// The format's name (letters, digits, `_` and `-`, at most 64).
    #[allow(dead_code)] // checked, then only documented: it does not change the output
    name: String,
    #[serde(default)]
    #[allow(dead_code)]
    description: Option<String>,
    /// The JSON Schema; any JSON value when absent.
    #[serde(default)]
    #[schema(value_type = Object)]
    schema: Option<Value>,
    /// Accepted: the reply always follows the schema.
    #[serde(default)]
    #[allow(dead_code)]
    strict: Option<bool>,
}

impl ResponseFormat {
    /// The grammar it asks for: none for `text`.
    fn grammar(&self) -> Result<Option<Grammar>, ApiError> {
        Ok(match self {
            Self::Text => None,
            Self::JsonObject => Some(Grammar::JsonObject),
            Self::JsonSchema { json_schema: f } => {
                let name_ok = !f.name.is_empty()
                    && f.name.len() <= 64
                    && f.name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
                if !name_ok {
                    return Err(refuse(
                        "response_format.json_schema.name",
                        "1 to 64 letters, digits, `_` or `-`",
                    ));
                }
                Some(Grammar::JsonSchema {
                    schema: f.schema.clone().unwrap_or_else(|| json!({})),
                })
            }
        })
    }
}

/// The grammar of `response_format` or of the `grammar` extension (not both).
pub(super) fn requested_grammar(
    format: Option<&ResponseFormat>,
    grammar: Option<&Grammar>,
) -> Result<(&'static str, Option<Grammar>), ApiError> {
    let from_format = format.map(ResponseFormat::grammar).transpose()?.flatten();
    match (from_format, grammar) {
        (Some(_), Some(_)) => Err(refuse(
            "grammar",
            "not with a response_format other than text; send one of the two",
        )),
        (Some(g), None) => Ok(("response_format", Some(g))),
        (None, g) => Ok(("grammar", g.cloned())),
    }
}

#[derive(Debug, Deserialize, ToSchema)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// One stop string or up to 16, each of 1 to 256 characters.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize, ToSchema)]
struct InMessage {
    #[schema(value_type = String, pattern = "^(system|developer|user|assistant|tool)$")]
    role: String,
    #[serde(default)]
    content: Option<Content>,
    /// An assistant message's calls.
    #[serde(default)]
    tool_calls: Option<Vec<InToolCall>>,
    /// A `tool` message: the call whose result it holds.
    #[serde(default)]
    tool_call_id: Option<String>,
    /// Accepted (a participant's or a function's name); not rendered.
    #[serde(default)]
    #[allow(dead_code)]
    name: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

/// A content part; only `text` parts are supported.
#[derive(Debug, Deserialize, ToSchema)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

fn refuse(field: &str, why: &str) -> ApiError {
    ApiError::Validation(format!("{field}: {why}"))
}

impl InMessage {
    /// The message's text: its content, or its text parts joined.
    fn text(&self, field: &str) -> Result<String, ApiError> {
        Ok(match &self.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut t = String::new();
                for (j, p) in parts.iter().enumerate() {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(s)) => t.push_str(s),
                        _ => {
                            return Err(refuse(
                                &format!("{field}.content[{j}]"),
                                "only text parts are supported",
                            ))
                        }
                    }
                }
                t
            }
        })
    }
}

impl ChatRequest {
    /// The request's tools, checked; `None` without any.
    fn tools(&self) -> Result<Option<Tools>, ApiError> {
        Ok(Tools::new(
            self.tools.as_deref(),
            self.tool_choice.as_ref(),
        )?)
    }

    fn check_supported(&self) -> Result<(), ApiError> {
        if let Some(n) = self.n.filter(|n| !(1..=MAX_CHOICES).contains(n)) {
            return Err(refuse(
                "n",
                &format!("must be 1 to {MAX_CHOICES} choices, got {n}"),
            ));
        }
        Ok(())
    }

    /// The request's sampling fields over the model's defaults.
    fn params(&self, defaults: &ModelDefaults) -> SamplingParams {
        let d = defaults.params().clone();
        SamplingParams {
            // OpenAI's default temperature is 1 (unless the model's manifest sets one).
            temperature: self.temperature.unwrap_or(defaults.openai_temperature()),
            top_k: self.top_k.unwrap_or(d.top_k),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            logit_bias: self.logit_bias.clone().unwrap_or(d.logit_bias.clone()),
            dry_multiplier: self.dry_multiplier.unwrap_or(d.dry_multiplier),
            dry_base: self.dry_base.unwrap_or(d.dry_base),
            dry_allowed_length: self.dry_allowed_length.unwrap_or(d.dry_allowed_length),
            dry_penalty_last_n: self.dry_penalty_last_n.unwrap_or(d.dry_penalty_last_n),
            dry_sequence_breakers: self
                .dry_sequence_breakers
                .clone()
                .unwrap_or(d.dry_sequence_breakers),
            seed: self.seed.or(d.seed),
        }
    }

    fn conversation(&self, tools: Option<&Tools>) -> Result<Conversation, ApiError> {
        let mut out = Vec::with_capacity(self.messages.len());
        let mut calls: Vec<(String, String)> = Vec::new();
        for (i, m) in self.messages.iter().enumerate() {
            let field = format!("messages[{i}]");
            let text = m.text(&field)?;
            let entry = match m.role.as_str() {
                "system" | "developer" => (ChatRole::System, text),
                "user" => (ChatRole::User, text),
                "assistant" => {
                    calls.extend(call_names(m.tool_calls.as_deref()));
                    let text = assistant_text(&field, text, m.tool_calls.as_deref())?;
                    (ChatRole::Assistant, text)
                }
                "tool" => {
                    let text = tool_text(&field, &text, m.tool_call_id.as_deref(), &calls)?;
                    (ChatRole::User, text)
                }
                other => {
                    return Err(refuse(
                        &format!("{field}.role"),
                        &format!(
                            "`{other}` is not supported (system, developer, user, assistant, tool)"
                        ),
                    ))
                }
            };
            out.push(entry);
        }
        let convo = Conversation::new(out)?;
        // The tools' description comes first, then the client's own system prompt.
        Ok(match tools.and_then(Tools::system_text) {
            Some(t) => convo.with_system_prefix(t),
            None => convo,
        })
    }

    /// The request as a validated turn: every field checked once, here.
    fn turn(
        &self,
        tools: Option<&Tools>,
        defaults: &ModelDefaults,
    ) -> Result<ValidTurn<Conversation>, ApiError> {
        self.check_supported()?;
        let stop = match self.stop.as_ref() {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(v)) => v.clone(),
        };
        let options = GenOptions::new(
            Some(self.params(defaults)),
            "",
            self.max_completion_tokens.or(self.max_tokens),
            stop,
            self.ignore_eos,
        )?
        .with_logprobs(self.logprobs == Some(true), self.top_logprobs)?;
        let (field, grammar) =
            requested_grammar(self.response_format.as_ref(), self.grammar.as_ref())?;
        let (field, grammar) = turn_grammar(tools, field, grammar)?;
        let options = options
            .with_grammar(field, grammar)?
            .with_tools(tools.cloned())
            .with_end_user(self.user.as_deref())?
            .with_keep_alive(self.keep_alive)?;
        Ok(ValidTurn::new(
            self.conversation(tools)?,
            options,
            self.stream,
        ))
    }
}

/// OpenAI-compatible chat completion, streaming (Server-Sent Events of
/// `chat.completion.chunk`, then `[DONE]`) or not. Stateless: nothing is stored, and a client
/// that goes away cancels its generation.
#[utoipa::path(post, path = "/v1/chat/completions", operation_id = "createChatCompletion", tag = "openai", request_body = ChatRequest,
    responses(
        (status = 200, description = "The completion", content(
            (ChatCompletion = "application/json"),
            (super::openapi::CompletionEvent = "text/event-stream"),
        )),
        (status = 404, description = "`model` names a model this server does not serve (`model_not_found`)", body = super::ErrorBody),
        (status = 422, description = "A field is out of range or asks for what Hearth cannot do", body = super::ErrorBody),
    ))]
pub async fn completions(
    State(s): State<AppState>,
    caller: Caller,
    ValidJson(req): ValidJson<ChatRequest>,
) -> Result<Response, ApiError> {
    let logprobs = req.logprobs == Some(true);
    if req.stream {
        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        let loading = s.chat.needs_load(req.model.as_deref());
        if loading.is_some() {
            // What can be refused before the load is, with its status.
            check_before_load(&req)?;
        }
        let events = async move {
            let (head, guards, tools) = start_chat(&s, &caller, &req).await?;
            let shape = Shape::Chat { tools };
            Ok(streamed_events(
                head,
                guards,
                include_usage,
                logprobs,
                shape,
            ))
        };
        return Ok(match loading {
            Some(model) => super::loading::after_load(super::loading::Api::OpenAi, model, events),
            None => super::chat::sse(events.await?),
        });
    }
    let (head, guards, tools) = start_chat(&s, &caller, &req).await?;
    let lives: Vec<Arc<Live>> = guards.iter().map(|g| g.0.clone()).collect();
    let shape = Shape::Chat {
        tools: tools.clone(),
    };
    let finished = finished_choices(&lives, logprobs, &shape).await?;
    let choices = (0u32..)
        .zip(&finished)
        .map(|(index, f)| {
            let calls = f.outcome.tool_calls.clone();
            CompletionChoice {
                index,
                finish_reason: match &calls {
                    Some(_) => "tool_calls".into(),
                    None => f.finish_reason.clone(),
                },
                message: AssistantMessage {
                    role: "assistant".into(),
                    content: calls.is_none().then(|| f.outcome.content.clone()),
                    tool_calls: calls,
                },
                logprobs: (!f.logprobs.is_null()).then(|| f.logprobs.clone()),
            }
        })
        .collect();
    let outcomes: Vec<Outcome> = finished.into_iter().map(|f| f.outcome).collect();
    drop(guards);
    Ok(Json(ChatCompletion {
        id: head.id,
        object: "chat.completion".into(),
        created: head.created,
        model: head.model,
        choices,
        usage: Usage::of(&outcomes),
    })
    .into_response())
}

/// Starts a chat completion's choices: its model (loaded first if it must be), its options,
/// its generations. Dropping the guards (the client went away) stops the generations.
async fn start_chat(
    s: &AppState,
    caller: &Caller,
    req: &ChatRequest,
) -> Result<(Head, Vec<StopOnDrop>, Option<Arc<Tools>>), ApiError> {
    if s.chat.needs_load(req.model.as_deref()).is_some() {
        check_before_load(req)?;
    }
    let target = s.chat.target(caller, req.model.as_deref()).await?;
    let tools = req.tools()?.map(Arc::new);
    let turn = req.turn(tools.as_deref(), &target.defaults())?;
    let lives = s
        .chat
        .complete(caller, turn, &target, req.n.unwrap_or(1))
        .await?;
    let head = Head {
        id: format!("chatcmpl-{}", uuid::Uuid::new_v4().simple()),
        created: crate::storage::now_ms() / 1000,
        model: target.name(),
    };
    Ok((head, lives.into_iter().map(StopOnDrop).collect(), tools))
}

/// What of a request for a model that must be loaded first can be refused before the load:
/// its tools and its turn (with no model defaults yet), so that bad input costs no load.
fn check_before_load(req: &ChatRequest) -> Result<(), ApiError> {
    let tools = req.tools()?;
    req.turn(tools.as_ref(), &Default::default())?;
    Ok(())
}

/// A choice of a finished (non-streamed) completion.
pub(super) struct FinishedChoice {
    pub(super) outcome: Outcome,
    pub(super) finish_reason: String,
    /// In `shape`'s form with `logprobs`, else null.
    pub(super) logprobs: Value,
}

/// Waits for every choice to end, in order: its outcome, OpenAI's finish reason (a failed
/// choice fails the request), and its tokens' log-probabilities when asked for.
pub(super) async fn finished_choices(
    lives: &[Arc<Live>],
    logprobs: bool,
    shape: &Shape,
) -> Result<Vec<FinishedChoice>, ApiError> {
    let mut out = Vec::with_capacity(lives.len());
    for live in lives {
        let outcome = live
            .outcome()
            .await
            .ok_or_else(|| ApiError::Internal("the generation ended without an outcome".into()))?;
        let reason = outcome
            .end
            .openai_finish_reason()
            .map_err(|e| ApiError::from(e.clone()))?;
        let logprobs = if logprobs {
            let mut offset = shape.echoed_len();
            shape.logprobs(collected_logprobs(live).await, &mut offset)
        } else {
            Value::Null
        };
        out.push(FinishedChoice {
            outcome,
            finish_reason: reason.into(),
            logprobs,
        });
    }
    Ok(out)
}

/// What every object of one completion repeats.
pub(super) struct Head {
    pub(super) id: String,
    pub(super) created: i64,
    pub(super) model: String,
}

/// Every token's log-probability of a finished reply.
pub(super) async fn collected_logprobs(live: &Arc<Live>) -> Vec<TokenLogprob> {
    let mut all = Vec::new();
    let mut events = std::pin::pin!(live.subscribe(0));
    while let Some((_, e)) = events.next().await {
        match e {
            RunEvent::Logprobs(l) => all.extend(l),
            RunEvent::End(_) => break,
            _ => {}
        }
    }
    all
}

/// What a streamed choice looks like: a chat completion's delta, or a legacy completion's text.
#[derive(Debug, Clone)]
pub(super) enum Shape {
    /// With the request's tools, a reply that is calls streams as `tool_calls`.
    Chat { tools: Option<Arc<Tools>> },
    /// `echo`: the prompt's text, sent first.
    Text { echo: Option<String> },
}

impl Shape {
    /// Bytes of echoed prompt before each choice's text.
    fn echoed_len(&self) -> usize {
        match self {
            Self::Chat { .. } | Self::Text { echo: None } => 0,
            Self::Text { echo: Some(p) } => p.len(),
        }
    }

    fn object(&self) -> &'static str {
        match self {
            Self::Chat { .. } => "chat.completion.chunk",
            Self::Text { .. } => "text_completion",
        }
    }

    /// One choice of a chunk: `text` (None: the chat's opening role delta, or an empty one).
    fn choice(&self, index: usize, text: Option<&str>, finish: Value, lp: Value) -> Value {
        match self {
            Self::Chat { .. } => {
                let delta = match text {
                    Some(t) => json!({"content": t}),
                    None if finish.is_null() => json!({"role": "assistant", "content": ""}),
                    None => json!({}),
                };
                json!({"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish})
            }
            Self::Text { .. } => {
                json!({"index": index, "text": text.unwrap_or(""), "logprobs": lp, "finish_reason": finish})
            }
        }
    }

    /// The tools whose calls a streamed reply may be: its text is held back while it may
    /// still become one.
    fn callable_tools(&self) -> Option<&Tools> {
        match self {
            Self::Chat { tools: Some(t) } if t.callable() => Some(t),
            _ => None,
        }
    }

    /// A chunk's choice that carries a reply's calls.
    fn calls_choice(index: usize, calls: &[ToolCall], lp: Value) -> Value {
        let calls: Vec<Value> = calls
            .iter()
            .enumerate()
            .map(|(k, c)| json!({"index": k, "id": c.id, "type": c.kind, "function": c.function}))
            .collect();
        json!({"index": index, "delta": {"tool_calls": calls}, "logprobs": lp, "finish_reason": Value::Null})
    }

    /// The log-probabilities of `tokens` as this shape reports them; `offset` is where the
    /// first token's text starts in the choice's text (legacy `text_offset`), moved past them.
    pub(super) fn logprobs(&self, tokens: Vec<TokenLogprob>, offset: &mut usize) -> Value {
        match self {
            Self::Chat { .. } => json!({ "content": tokens }),
            Self::Text { .. } => {
                let mut offsets = Vec::with_capacity(tokens.len());
                for t in &tokens {
                    offsets.push(*offset);
                    *offset += t.token.len();
                }
                let top: Vec<serde_json::Map<String, Value>> = tokens
                    .iter()
                    .map(|t| {
                        t.top_logprobs
                            .iter()
                            .map(|a| (a.token.clone(), json!(a.logprob)))
                            .collect()
                    })
                    .collect();
                json!({
                    "tokens": tokens.iter().map(|t| t.token.as_str()).collect::<Vec<_>>(),
                    "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
                    "top_logprobs": top,
                    "text_offset": offsets,
                })
            }
        }
    }
}

/// One streamed choice's state: the log-probabilities not sent yet, where its text stands
/// (legacy `text_offset`), and its text held back while it may still become tool calls (`None`
/// once it cannot, or without tools).
struct ChoiceStream {
    index: usize,
    pending: Vec<TokenLogprob>,
    offset: usize,
    held: Option<String>,
}

impl ChoiceStream {
    fn new(index: usize, shape: &Shape) -> Self {
        Self {
            index,
            pending: Vec::new(),
            offset: shape.echoed_len(),
            held: shape.callable_tools().map(|_| String::new()),
        }
    }

    /// The log-probabilities gathered since the last chunk, in `shape`'s form (null without
    /// `logprobs`).
    fn logprobs(&mut self, shape: &Shape, logprobs: bool) -> Value {
        if logprobs {
            shape.logprobs(std::mem::take(&mut self.pending), &mut self.offset)
        } else {
            Value::Null
        }
    }

    /// The choice to send for new text, if any (none while it is held back).
    fn text(&mut self, shape: &Shape, logprobs: bool, t: String) -> Option<Value> {
        let t = match (&mut self.held, shape.callable_tools()) {
            (Some(h), Some(tools)) => {
                h.push_str(&t);
                if tools.may_be_call(h) {
                    return None;
                }
                self.held.take().unwrap_or_default()
            }
            _ => t,
        };
        let lp = self.logprobs(shape, logprobs);
        Some(shape.choice(self.index, Some(&t), Value::Null, lp))
    }

    /// The choices that end it: the held text as the reply's calls or as content, what
    /// log-probabilities are left, and the finish.
    fn end(&mut self, shape: &Shape, o: &Outcome, logprobs: bool, reason: &str) -> Vec<Value> {
        let i = self.index;
        let text = self.held.take();
        // Held all along (else the text went out as words): the reply is its calls, if any.
        if let Some(calls) = o.tool_calls.as_ref().filter(|_| text.is_some()) {
            let lp = self.logprobs(shape, logprobs);
            return vec![
                Shape::calls_choice(i, calls, lp),
                shape.choice(i, None, json!("tool_calls"), Value::Null),
            ];
        }
        let mut out = Vec::new();
        if let Some(t) = text.filter(|t| !t.is_empty()) {
            let lp = self.logprobs(shape, logprobs);
            out.push(shape.choice(i, Some(&t), Value::Null, lp));
        }
        if logprobs && !self.pending.is_empty() {
            // Tokens whose text the stop matcher held back or cut.
            let lp = self.logprobs(shape, logprobs);
            out.push(shape.choice(i, Some(""), Value::Null, lp));
        }
        out.push(shape.choice(i, None, json!(reason), Value::Null));
        out
    }
}

/// The completion as chunk events, then `[DONE]`: each choice's chunks as they come, tagged
/// with its index. With `logprobs`, each text chunk carries the log-probabilities of the tokens
/// that arrived with or before it.
pub(super) fn streamed(
    head: Head,
    guards: Vec<StopOnDrop>,
    include_usage: bool,
    logprobs: bool,
    shape: Shape,
) -> Response {
    sse(streamed_events(
        head,
        guards,
        include_usage,
        logprobs,
        shape,
    ))
}

/// [`streamed`]'s events.
pub(super) fn streamed_events(
    head: Head,
    guards: Vec<StopOnDrop>,
    include_usage: bool,
    logprobs: bool,
    shape: Shape,
) -> impl tokio_stream::Stream<Item = Result<Event, Infallible>> + Send + 'static {
    async_stream::stream! {
        let lives: Vec<Arc<Live>> = guards.iter().map(|g| g.0.clone()).collect();
        let _guards = guards;
        let chunk = |choice: Value| json!({
            "id": head.id, "object": shape.object(), "created": head.created,
            "model": head.model, "choices": [choice],
        });
        let mut merged = tokio_stream::StreamMap::new();
        for (i, live) in lives.iter().enumerate() {
            merged.insert(i, Box::pin(live.subscribe(0)));
        }
        let mut choices: Vec<ChoiceStream> =
            (0..lives.len()).map(|i| ChoiceStream::new(i, &shape)).collect();
        let mut outcomes: Vec<Outcome> = Vec::new();
        while let Some((i, (_, e))) = merged.next().await {
            match e {
                RunEvent::Begin => match &shape {
                    Shape::Chat { .. } => yield data(chunk(shape.choice(i, None, Value::Null, Value::Null))),
                    Shape::Text { echo: Some(p) } => {
                        yield data(chunk(shape.choice(i, Some(p), Value::Null, Value::Null)));
                    }
                    Shape::Text { echo: None } => {}
                },
                RunEvent::Logprobs(l) => choices[i].pending.extend(l),
                RunEvent::Text(t) => {
                    if let Some(c) = choices[i].text(&shape, logprobs, t) {
                        yield data(chunk(c));
                    }
                }
                RunEvent::End(o) => match o.end.openai_finish_reason() {
                    Err(e) => {
                        yield data(json!({"error": {"message": e.to_string(), "type": e.kind(), "code": Value::Null}}));
                        break;
                    }
                    Ok(reason) => {
                        for c in choices[i].end(&shape, &o, logprobs, reason) {
                            yield data(chunk(c));
                        }
                        outcomes.push(*o);
                    }
                },
            }
        }
        if include_usage && outcomes.len() == lives.len() {
            let mut u = chunk(Value::Null);
            u["choices"] = json!([]);
            u["usage"] = json!(Usage::of(&outcomes));
            yield data(u);
        }
        yield Ok::<Event, Infallible>(Event::default().data("[DONE]"));
    }
}

pub(super) fn data(v: Value) -> Result<Event, Infallible> {
    Ok(Event::default().data(v.to_string()))
}

pub(super) struct StopOnDrop(pub(super) Arc<Live>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if !self.0.is_finished() {
            self.0.stop();
        }
    }
}

/// A finished chat completion.
#[derive(Debug, Serialize, ToSchema)]
pub struct ChatCompletion {
    pub id: String,
    /// `chat.completion`
    pub object: String,
    /// Unix seconds.
    pub created: i64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    pub usage: Usage,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CompletionChoice {
    pub index: u32,
    pub message: AssistantMessage,
    /// `{"content": [TokenLogprob, …]}` when the request set `logprobs`, else `null`.
    #[schema(value_type = Option<Object>, required = true)]
    pub logprobs: Option<Value>,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AssistantMessage {
    /// `assistant`
    pub role: String,
    /// The reply's text; `null` when it is tool calls.
    #[schema(required = true)]
    pub content: Option<String>,
    /// The calls the reply makes, when it is nothing but calls of the request's tools.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct PromptTokensDetails {
    /// Prompt tokens the worker already held in its cache.
    pub cached_tokens: u64,
}

impl Usage {
    /// The usage of a request's choices: its prompt once (the first choice's, with what of it
    /// was cached), and every choice's generated tokens.
    pub(super) fn of(choices: &[Outcome]) -> Self {
        let prompt = choices.first().map_or(0, |o| o.usage.prompt_tokens);
        let cached = choices.first().map_or(0, |o| o.usage.cached_tokens);
        let completion: u64 = choices.iter().map(|o| o.usage.completion_tokens).sum();
        Self {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: cached,
            },
        }
    }
}

/// The served models.
#[derive(Debug, Serialize, ToSchema)]
pub struct ModelList {
    /// `list`
    pub object: String,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ModelCard {
    /// The model's name: a request's `model` names it (its newest version), or `id@version`
    /// one version.
    pub id: String,
    /// `model`
    pub object: String,
    pub created: i64,
    pub owned_by: String,
    /// The context in tokens of the version `id` means.
    #[schema(required = true)]
    pub max_model_len: Option<u64>,
    /// The version `id` means (the newest ready one), for a model from a repository.
    #[schema(required = true)]
    pub version: Option<String>,
    /// For people: the repository manifest's display name, else the id.
    pub display_name: String,
    /// `ready` while a worker serves the version `id` means, `loading` while one loads it and
    /// none has it ready, `available` when only a worker's repository holds it (a request loads
    /// it), else `unavailable` (no worker is up).
    pub state: String,
    /// Workers serving that version now.
    pub workers: u32,
    /// Every version some worker has reported, newest first.
    pub versions: Vec<ModelVersion>,
    /// While a worker fetches the version's file from a URL: the bytes fetched so far.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fetched_bytes: Option<u64>,
    /// And the file's size, once its server has said it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fetch_total_bytes: Option<u64>,
}

/// One version of a model.
#[derive(Debug, Serialize, ToSchema)]
pub struct ModelVersion {
    /// Empty for a model its worker was given by path.
    pub version: String,
    pub display_name: String,
    #[schema(required = true)]
    pub max_model_len: Option<u64>,
    /// `ready`, `loading`, `available` or `unavailable`, as the card's.
    pub state: String,
    /// Workers serving it now.
    pub workers: u32,
    /// Workers that reported it, ready or not.
    pub known_workers: u32,
    /// As the card's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fetched_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fetch_total_bytes: Option<u64>,
}

/// Every model a worker serves, one card per model with its versions. The default model (the
/// one a request that names none gets) comes first, then the others by name.
#[utoipa::path(get, path = "/v1/models", operation_id = "listModels", tag = "openai",
    responses((status = 200, description = "The served models, the default first", body = ModelList)))]
pub async fn models(State(s): State<AppState>, _caller: Caller) -> Json<ModelList> {
    let served = s.chat.models();
    let default = s.chat.lookup(None).ok().and_then(|t| t.model);
    let ids = default.iter().chain(&served).map(|m| m.key.id.as_str());
    let mut data: Vec<ModelCard> = Vec::new();
    for id in ids {
        if data.iter().any(|c| c.id == id) {
            continue;
        }
        if let Ok(t) = s.chat.lookup(Some(id)) {
            data.push(model_card(&t, &served));
        }
    }
    add_available(&mut data, s.chat.available());
    Json(ModelList {
        object: "list".into(),
        data,
    })
}

/// The versions workers' repositories hold that no worker has loaded (`name@version` each), as
/// `available` versions of their cards, and cards of their own for models no worker serves: a
/// request for one loads it on demand.
fn add_available(data: &mut Vec<ModelCard>, available: Vec<String>) {
    for (name, version) in available.iter().filter_map(|a| a.rsplit_once('@')) {
        let i = match data.iter().position(|c| c.id == name) {
            Some(i) => i,
            None => {
                data.push(ModelCard {
                    id: name.to_string(),
                    object: "model".into(),
                    created: 0,
                    owned_by: "hearth".into(),
                    max_model_len: None,
                    version: Some(version.to_string()),
                    display_name: name.to_string(),
                    state: "available".into(),
                    workers: 0,
                    versions: Vec::new(),
                    fetched_bytes: None,
                    fetch_total_bytes: None,
                });
                data.len() - 1
            }
        };
        let card = &mut data[i];
        if card.versions.iter().any(|v| v.version == version) {
            continue;
        }
        card.versions.push(ModelVersion {
            version: version.to_string(),
            display_name: name.to_string(),
            max_model_len: None,
            state: "available".into(),
            workers: 0,
            known_workers: 0,
            fetched_bytes: None,
            fetch_total_bytes: None,
        });
        card.versions
            .sort_by(|a, b| compare_versions(&b.version, &a.version));
        // A card of repository versions only names the newest.
        if card.workers == 0 && card.state == "available" {
            card.version = card.versions.first().map(|v| v.version.clone());
        }
    }
}

fn state(m: &ServedModel) -> String {
    match (m.ready_workers, m.loading_workers) {
        (0, 0) => "unavailable",
        (0, _) => "loading",
        _ => "ready",
    }
    .into()
}

/// The card of `target`'s model, the version it names first among `served`'s of that id.
fn model_card(target: &Target, served: &[ServedModel]) -> ModelCard {
    let m = target.model.as_ref();
    let id = target.name();
    let versions = served
        .iter()
        .filter(|v| v.key.id == id)
        .map(|v| ModelVersion {
            version: v.key.version.clone(),
            display_name: v.display_name.clone(),
            max_model_len: v.context_length.map(|n| n as u64),
            state: state(v),
            workers: v.ready_workers as u32,
            known_workers: v.workers as u32,
            fetched_bytes: v.fetch.map(|f| f.0),
            fetch_total_bytes: v.fetch.map(|f| f.1).filter(|&t| t > 0),
        })
        .collect();
    ModelCard {
        display_name: m.map_or_else(|| id.clone(), |m| m.display_name.clone()),
        id,
        object: "model".into(),
        created: 0,
        owned_by: "hearth".into(),
        max_model_len: target.context_length().map(|n| n as u64),
        version: m.map(|m| m.key.version.clone()).filter(|v| !v.is_empty()),
        state: m.map_or_else(|| "unavailable".into(), state),
        workers: m.map_or(0, |m| m.ready_workers as u32),
        versions,
        fetched_bytes: m.and_then(|m| m.fetch).map(|f| f.0),
        fetch_total_bytes: m.and_then(|m| m.fetch).map(|f| f.1).filter(|&t| t > 0),
    }
}

/// One model by its id (its newest version), or one version as `id@version`; else 404.
#[utoipa::path(get, path = "/v1/models/{id}", operation_id = "retrieveModel", tag = "openai",
    params(("id" = String, Path, description = "The model's id, as `/v1/models` lists it, or `id@version`")),
    responses(
        (status = 200, description = "The model", body = ModelCard),
        (status = 404, description = "No model has this id (`model_not_found`)", body = super::ErrorBody),
    ))]
pub async fn model(
    State(s): State<AppState>,
    _caller: Caller,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    let target = s.chat.lookup(Some(&id))?;
    if target.model.is_none() {
        // No worker has reported a model yet: nothing can be named.
        return Err(ChatError::ModelNotFound {
            asked: id,
            served: "no model yet".into(),
        }
        .into());
    }
    Ok(Json(model_card(&target, &s.chat.models())))
}
