//! The wire types of OpenAI's Responses API: the request (its `input` items checked into a
//! conversation, its flat function tools into Hearth's tools) and the `response` object.

use hearth_shared::chat::Role as ChatRole;
use hearth_shared::Grammar;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use utoipa::ToSchema;

use super::super::wire::refuse;
use crate::api::ApiError;
use crate::service::{Conversation, GenOptions, ModelDefaults, ValidTurn};
use crate::storage::{NewItem, ReplyUsage, Role};
use crate::tools::{assistant_text, tool_text, InToolCall, Tool, ToolCall, ToolChoice, Tools};

/// OpenAI's Responses request. Fields that do not change the output (`metadata`, `include`,
/// `reasoning`, `prompt_cache_key`, `service_tier`, `parallel_tool_calls`, `truncation`) are
/// accepted; those Hearth cannot honour are refused by name.
#[derive(Debug, Deserialize, ToSchema)]
pub struct ResponsesRequest {
    /// A served model's name, as `/v1/models` lists it, or `name@version`; absent: the default
    /// model.
    #[serde(default)]
    pub(super) model: Option<String>,
    /// A user message's text, or items: messages (`system`, `developer`, `user`, `assistant`;
    /// text content), `function_call` and `function_call_output`.
    #[schema(value_type = Object)]
    pub(super) input: Value,
    /// A system prompt, before the input's own.
    #[serde(default)]
    pub(super) instructions: Option<String>,
    /// Longest reply: at least 1 and less than the model's context.
    #[serde(default)]
    #[schema(minimum = 1)]
    pub(super) max_output_tokens: Option<u32>,
    /// OpenAI's default, 1, when absent; 0 is greedy.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 2)]
    pub(super) temperature: Option<f32>,
    #[serde(default)]
    #[schema(exclusive_minimum = 0, maximum = 1)]
    pub(super) top_p: Option<f32>,
    /// Function tools (`{"type": "function", "name", "description", "parameters"}`).
    #[serde(default)]
    pub(super) tools: Option<Vec<InTool>>,
    /// `auto`, `none`, `required`, or `{"type": "function", "name"}`.
    #[serde(default)]
    #[schema(value_type = Object)]
    pub(super) tool_choice: Option<Value>,
    /// `format`: `text`, `json_object`, or `json_schema` (`name`, `schema`) followed as the
    /// reply is sampled.
    #[serde(default)]
    pub(super) text: Option<TextConfig>,
    #[serde(default)]
    pub(super) stream: bool,
    /// Whether the response is kept (the default): as a session of the caller's and its
    /// messages, so that `previous_response_id` continues it and `GET /v1/responses/{id}` reads
    /// it. `false`: nothing is stored, and a client that goes away stops the reply.
    #[serde(default)]
    pub(super) store: Option<bool>,
    /// Answer at once with the response `in_progress`, and run it detached: read it with
    /// `GET /v1/responses/{id}` (its events with `stream=true`, from any replica). Needs `store`.
    #[serde(default)]
    pub(super) background: Option<bool>,
    /// A kept response of the caller's to continue: its conversation, then `input`. Needs
    /// `store`.
    #[serde(default)]
    pub(super) previous_response_id: Option<String>,
    /// The end user the request is for (as chat completions' `user`).
    #[serde(default)]
    pub(super) user: Option<String>,
    /// Accepted and repeated: the prefix cache finds shared prompts by their tokens.
    #[serde(default)]
    pub(super) prompt_cache_key: Option<String>,
    /// Accepted and repeated.
    #[serde(default)]
    pub(super) safety_identifier: Option<String>,
    #[serde(default)]
    #[schema(value_type = Object)]
    pub(super) metadata: Option<Value>,
    /// Accepted: a reply holds one call or several, as the model writes it.
    #[serde(default)]
    pub(super) parallel_tool_calls: Option<bool>,
    /// `auto` or `disabled`: a prompt longer than the context loses its oldest turns either
    /// way, the system prompt and the last message kept.
    #[serde(default)]
    pub(super) truncation: Option<String>,
}

/// A tool: only functions.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[schema(as = ResponseTool)]
pub(super) struct InTool {
    /// `function`
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    parameters: Option<Value>,
    /// Accepted: a forced call follows its schema whatever this says.
    #[serde(default)]
    strict: Option<bool>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = ResponseTextConfig)]
pub(super) struct TextConfig {
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub(super) format: Option<Value>,
}

impl ResponsesRequest {
    /// The request's tools and tool choice, as Hearth's; `None` without tools.
    pub(super) fn tools(&self) -> Result<Option<Tools>, ApiError> {
        tools_of(self.tools.as_deref(), self.tool_choice.as_ref())
    }

    /// Whether the response is kept (`store`, true unless it says `false`).
    pub(super) fn stored(&self) -> bool {
        self.store != Some(false)
    }

    /// What needs a kept response, refused by name without one.
    fn check_supported(&self) -> Result<(), ApiError> {
        if !self.stored() && self.background == Some(true) {
            let why = "a background response is kept: leave `store` true";
            return Err(refuse("background", why));
        }
        if !self.stored() && self.previous_response_id.is_some() {
            let why = "a response that continues another is kept: leave `store` true";
            return Err(refuse("previous_response_id", why));
        }
        if let Some(t) = self.truncation.as_deref() {
            if t != "auto" && t != "disabled" {
                return Err(refuse("truncation", "`auto` or `disabled`"));
            }
        }
        Ok(())
    }

    /// The grammar `text.format` asks for, if any.
    fn format(&self) -> Result<Option<Grammar>, ApiError> {
        let Some(f) = self.text.as_ref().and_then(|t| t.format.as_ref()) else {
            return Ok(None);
        };
        Ok(match f.get("type").and_then(Value::as_str) {
            Some("text") => None,
            Some("json_object") => Some(Grammar::JsonObject),
            Some("json_schema") => {
                let schema = f.get("schema").cloned().unwrap_or_else(|| json!({}));
                Some(Grammar::JsonSchema { schema })
            }
            _ => {
                let why = "`text`, `json_object` or `json_schema`";
                return Err(refuse("text.format.type", why));
            }
        })
    }

    /// The request as a validated stateless turn: every field checked once, here.
    pub(super) fn turn(
        &self,
        tools: Option<&Tools>,
        defaults: &ModelDefaults,
    ) -> Result<ValidTurn<Conversation>, ApiError> {
        let options = self.options(tools, defaults)?;
        Ok(ValidTurn::new(
            self.conversation(tools)?,
            options,
            self.stream,
        ))
    }

    /// The request's options (sampling, length, format, tools), checked.
    pub(super) fn options(
        &self,
        tools: Option<&Tools>,
        defaults: &ModelDefaults,
    ) -> Result<GenOptions, ApiError> {
        self.check_supported()?;
        let mut params = defaults.params().clone();
        params.temperature = self.temperature.unwrap_or(defaults.openai_temperature());
        params.top_p = self.top_p.unwrap_or(params.top_p);
        let (field, grammar) = crate::tools::turn_grammar(tools, "text.format", self.format()?)?;
        Ok(
            GenOptions::new(Some(params), "", self.max_output_tokens, Vec::new(), false)
                .map_err(|e| {
                    ApiError::from(e).with_param(|p| p.replace("max_tokens", "max_output_tokens"))
                })?
                .with_grammar(field, grammar)?
                .with_tools(tools.cloned())
                .with_end_user(self.user.as_deref())?,
        )
    }

    /// `instructions` and `input` as a conversation: function calls as the model writes
    /// them, their outputs as user text naming the function, the tools' description first.
    pub(super) fn conversation(&self, tools: Option<&Tools>) -> Result<Conversation, ApiError> {
        let mut out: Vec<(ChatRole, String)> = Vec::new();
        if let Some(i) = &self.instructions {
            out.push((ChatRole::System, i.clone()));
        }
        let mut calls: Vec<(String, String)> = Vec::new();
        for entry in self.entries()? {
            out.push(match entry {
                Entry::Said(role, text) => (role, text),
                Entry::Calls(field, made) => {
                    calls.extend(crate::tools::call_names(Some(made.as_slice())));
                    (ChatRole::Assistant, calls_text(&field, &made)?)
                }
                Entry::Output(out) => (ChatRole::User, out.text(&calls)?),
            });
        }
        let convo = Conversation::new(out)
            .map_err(|e| ApiError::from(e).with_param(|p| p.replace("messages", "input")))?;
        Ok(match tools.and_then(Tools::system_text) {
            Some(t) => convo.with_system_prefix(t),
            None => convo,
        })
    }

    /// `instructions` and `input` as a kept response stores them: its system prompt (the
    /// instructions, then the input's system and developer messages) and the messages it adds
    /// to its session. `calls` are the calls its history made, as (id, name), which function
    /// outputs may answer.
    pub(super) fn kept_input(
        &self,
        mut calls: Vec<(String, String)>,
    ) -> Result<(Option<String>, Vec<NewItem>), ApiError> {
        let mut system: Vec<String> = self.instructions.iter().cloned().collect();
        let mut items = Vec::new();
        let item = |role, content| NewItem {
            role,
            content,
            tool_calls: None,
            tool_call_id: None,
        };
        for entry in self.entries()? {
            match entry {
                Entry::Said(ChatRole::System, text) => system.push(text),
                Entry::Said(ChatRole::User, text) => items.push(item(Role::User, text)),
                Entry::Said(ChatRole::Assistant, text) => items.push(item(Role::Assistant, text)),
                Entry::Calls(field, made) => {
                    calls.extend(crate::tools::call_names(Some(made.as_slice())));
                    let stored = made.iter().map(InToolCall::stored).collect();
                    items.push(NewItem {
                        tool_calls: Some(stored),
                        ..item(Role::Assistant, calls_text(&field, &made)?)
                    });
                }
                Entry::Output(out) => {
                    out.text(&calls)?;
                    items.push(NewItem {
                        tool_call_id: out.call_id,
                        ..item(Role::Tool, out.output)
                    });
                }
            }
        }
        if items.is_empty() {
            return Err(refuse("input", "holds no message to answer"));
        }
        let system = (!system.is_empty()).then(|| system.join("\n\n"));
        Ok((system, items))
    }

    /// The input's items read in order, consecutive function calls as one turn's.
    fn entries(&self) -> Result<Vec<Entry>, ApiError> {
        let items = match &self.input {
            Value::String(text) => vec![json!({"role": "user", "content": text})],
            Value::Array(items) => items.clone(),
            _ => return Err(refuse("input", "a string or an array of items")),
        };
        let mut out = Vec::with_capacity(items.len());
        let mut pending: Vec<InToolCall> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let field = format!("input[{i}]");
            let kind = item
                .get("type")
                .and_then(Value::as_str)
                .unwrap_or("message");
            if kind != "function_call" && !pending.is_empty() {
                out.push(Entry::Calls(field.clone(), std::mem::take(&mut pending)));
            }
            match kind {
                "message" => {
                    let (role, text) = message(item, &field)?;
                    out.push(Entry::Said(role, text));
                }
                "function_call" => pending.push(function_call(item, &field)?),
                "function_call_output" => out.push(Entry::Output(CallOutput {
                    call_id: item.get("call_id").and_then(Value::as_str).map(Into::into),
                    output: output_text(item.get("output"), &format!("{field}.output"))?,
                    field,
                })),
                // A reasoning model's summary of its thinking: not part of what it said.
                "reasoning" => {}
                other => {
                    let why = format!(
                        "`{other}` items are not supported (message, function_call, \
                         function_call_output)"
                    );
                    return Err(refuse(&format!("{field}.type"), &why));
                }
            }
        }
        if !pending.is_empty() {
            out.push(Entry::Calls("input".into(), pending));
        }
        Ok(out)
    }
}

/// One input item read: a message, the function calls of one assistant turn, or the output of
/// a call.
enum Entry {
    Said(ChatRole, String),
    /// The field of the item after the calls, and the calls.
    Calls(String, Vec<InToolCall>),
    Output(CallOutput),
}

/// A `function_call_output` item.
struct CallOutput {
    field: String,
    call_id: Option<String>,
    output: String,
}

impl CallOutput {
    /// The output as the model reads it, naming the function of the call it answers, one of
    /// `calls` (else refused).
    fn text(&self, calls: &[(String, String)]) -> Result<String, ApiError> {
        tool_text(&self.field, &self.output, self.call_id.as_deref(), calls)
            .map_err(|e| ApiError::from(e).with_param(|p| p.replace(".tool_call_id", ".call_id")))
    }
}

/// An assistant turn's function calls as the model writes them.
fn calls_text(field: &str, made: &[InToolCall]) -> Result<String, ApiError> {
    Ok(assistant_text(field, String::new(), Some(made))?)
}

/// Tools and a tool choice of the Responses API, as Hearth's; `None` without tools.
pub(super) fn tools_of(
    given: Option<&[InTool]>,
    choice: Option<&Value>,
) -> Result<Option<Tools>, ApiError> {
    let mut tools = Vec::new();
    for (i, t) in given.into_iter().flatten().enumerate() {
        if t.kind != "function" {
            let why = format!("`{}` tools are not supported (only `function`)", t.kind);
            return Err(refuse(&format!("tools[{i}].type"), &why));
        }
        let name = t
            .name
            .clone()
            .ok_or_else(|| refuse(&format!("tools[{i}].name"), "required"))?;
        let parameters = t.parameters.clone();
        tools.push(Tool::function(name, t.description.clone(), parameters));
    }
    let choice = match choice {
        None => None,
        Some(Value::String(m)) => Some(ToolChoice::Mode(m.clone())),
        Some(Value::Object(o)) if o.get("type") == Some(&json!("function")) => {
            let name = o.get("name").and_then(Value::as_str);
            let name = name.ok_or_else(|| refuse("tool_choice.name", "required"))?;
            Some(ToolChoice::named(name.to_string()))
        }
        Some(_) => {
            let why = "`auto`, `none`, `required` or {\"type\": \"function\", \"name\"}";
            return Err(refuse("tool_choice", why));
        }
    };
    let flat = |p: &str| p.replace(".function.", ".");
    Tools::new(Some(tools.as_slice()), choice.as_ref())
        .map_err(|e| ApiError::from(e).with_param(flat))
}

/// A message item: its role and its text.
fn message(item: &Value, field: &str) -> Result<(ChatRole, String), ApiError> {
    let role = match item.get("role").and_then(Value::as_str) {
        Some("system" | "developer") => ChatRole::System,
        Some("user") => ChatRole::User,
        Some("assistant") => ChatRole::Assistant,
        _ => {
            let why = "one of system, developer, user, assistant";
            return Err(refuse(&format!("{field}.role"), why));
        }
    };
    Ok((
        role,
        output_text(item.get("content"), &format!("{field}.content"))?,
    ))
}

/// Text content: a string, or `input_text`/`output_text` parts joined.
fn output_text(content: Option<&Value>, field: &str) -> Result<String, ApiError> {
    match content {
        None => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or_default();
                match (kind, p.get("text").and_then(Value::as_str)) {
                    ("input_text" | "output_text" | "text", Some(t)) => text.push_str(t),
                    _ => {
                        let why = format!(
                            "`{kind}` parts are not supported: the served models read text only"
                        );
                        return Err(refuse(&format!("{field}[{j}].type"), &why));
                    }
                }
            }
            Ok(text)
        }
        Some(_) => Err(refuse(field, "a string or text parts")),
    }
}

/// A `function_call` item as a call of the history.
fn function_call(item: &Value, field: &str) -> Result<InToolCall, ApiError> {
    let get = |name: &str| {
        item.get(name)
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| refuse(&format!("{field}.{name}"), "required"))
    };
    Ok(InToolCall::new(
        get("call_id")?,
        get("name")?,
        get("arguments")?,
    ))
}

/// The `response` object.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[schema(as = Response)]
pub struct ResponseObject {
    /// `resp_` and the id of the message that holds the reply, when kept.
    pub id: String,
    /// `response`
    pub object: &'static str,
    /// Unix seconds.
    pub created_at: i64,
    /// `in_progress`, `completed`, `incomplete`, `cancelled` or `failed`.
    pub status: &'static str,
    pub output: Vec<OutputItem>,
    #[schema(value_type = Option<Object>)]
    pub error: Option<Value>,
    /// `{"reason": "max_output_tokens"}` for a reply cut by its length.
    #[schema(value_type = Option<Object>)]
    pub incomplete_details: Option<Value>,
    /// Unix seconds, once the reply ended.
    pub completed_at: Option<i64>,
    #[serde(flatten)]
    pub request: Echo,
    pub usage: Option<ResponseUsage>,
}

/// What the `response` object repeats of its request (kept with a kept response).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[schema(as = ResponseRequestEcho)]
pub struct Echo {
    pub model: String,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u32>,
    #[schema(value_type = Object)]
    pub metadata: Value,
    pub parallel_tool_calls: bool,
    pub previous_response_id: Option<String>,
    /// Whether the response is kept.
    pub store: bool,
    pub background: bool,
    /// The sampling the reply had: the request's, else the model's defaults.
    pub temperature: f32,
    pub top_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Always 0: `include` asks for no log-probabilities here.
    pub top_logprobs: u32,
    #[schema(value_type = Object)]
    pub tool_choice: Value,
    #[schema(value_type = Vec<Object>)]
    pub tools: Vec<Value>,
    #[schema(value_type = Object)]
    pub text: Value,
    pub truncation: String,
    pub user: Option<String>,
    /// Always null: the served models do not reason apart from their reply.
    #[schema(value_type = Option<Object>)]
    pub reasoning: Option<Value>,
    /// Always null: a reply makes as many calls as the model writes.
    pub max_tool_calls: Option<u32>,
    /// `default`
    pub service_tier: String,
    pub safety_identifier: Option<String>,
    pub prompt_cache_key: Option<String>,
}

impl Echo {
    /// The tools and tool choice it repeats, as Hearth's.
    pub(super) fn tools(&self) -> Result<Option<Tools>, ApiError> {
        if self.tools.is_empty() {
            return Ok(None);
        }
        let given: Vec<InTool> = serde_json::from_value(Value::Array(self.tools.clone()))
            .map_err(|e| ApiError::Internal(format!("a kept response's tools: {e}")))?;
        tools_of(Some(&given), Some(&self.tool_choice))
    }
}

/// An output item: a message with its text, or a function call.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[schema(as = ResponseOutputItem)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    Message {
        id: String,
        /// `assistant`
        role: &'static str,
        status: &'static str,
        content: Vec<OutputText>,
    },
    FunctionCall {
        id: String,
        call_id: String,
        name: String,
        /// The arguments as a JSON text.
        arguments: String,
        status: &'static str,
    },
}

#[derive(Debug, Clone, Serialize, ToSchema)]
#[schema(as = ResponseOutputText)]
pub struct OutputText {
    /// `output_text`
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub text: String,
    #[schema(value_type = Vec<Object>)]
    pub annotations: Vec<Value>,
}

impl OutputText {
    pub(super) fn new(text: String) -> Self {
        Self {
            kind: "output_text",
            text,
            annotations: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
pub struct ResponseUsage {
    pub input_tokens: u64,
    /// `cached_tokens`: prompt tokens the worker already held in its cache.
    #[schema(value_type = Object)]
    pub input_tokens_details: CachedDetails,
    pub output_tokens: u64,
    #[schema(value_type = Object)]
    pub output_tokens_details: ReasoningDetails,
    pub total_tokens: u64,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct CachedDetails {
    pub cached_tokens: u64,
    pub cache_write_tokens: u64,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct ReasoningDetails {
    pub reasoning_tokens: u64,
}

impl ResponseUsage {
    pub(super) fn of(u: &ReplyUsage) -> Self {
        Self {
            input_tokens: u.prompt_tokens,
            input_tokens_details: CachedDetails {
                cached_tokens: u.cached_tokens,
                cache_write_tokens: 0,
            },
            output_tokens: u.completion_tokens,
            output_tokens_details: ReasoningDetails {
                reasoning_tokens: 0,
            },
            total_tokens: u.prompt_tokens + u.completion_tokens,
        }
    }
}

/// A call the reply makes, as a `function_call` item.
pub(super) fn call_item(c: &ToolCall) -> OutputItem {
    OutputItem::FunctionCall {
        id: format!("fc_{}", c.id.trim_start_matches("call_")),
        call_id: c.id.clone(),
        name: c.function.name.clone(),
        arguments: c.function.arguments.clone(),
        status: "completed",
    }
}
