//! The wire types of Anthropic's Messages API: the request as clients send it (content blocks
//! checked into a conversation, tools into Hearth's tools) and the message as they get it.

use hearth_shared::chat::Role as ChatRole;
use hearth_shared::Grammar;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use crate::api::ApiError;
use crate::generate::Outcome;
use crate::invalid::Invalid;
use crate::service::{Conversation, GenOptions, ModelDefaults, ValidTurn};
use crate::tools::{assistant_text, tool_text, InToolCall, Tool, ToolCall, ToolChoice, Tools};

/// Anthropic's Messages request. Fields that do not change the output (`metadata` but its
/// `user_id`, `cache_control`, `service_tier`, `thinking`: the served models do not think
/// aloud) are accepted and ignored; content Hearth cannot read (images, documents) is refused by
/// name.
#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = AnthropicMessagesRequest)]
pub struct MessagesRequest {
    /// A served model's name, as `/v1/models` lists it, or `name@version`.
    pub(super) model: String,
    /// Longest reply: at least 1. Required, except by `count_tokens`.
    #[serde(default)]
    #[schema(minimum = 1)]
    pub(super) max_tokens: Option<u32>,
    /// Alternating `user` and `assistant` messages, ending with a `user` message.
    #[schema(min_items = 1)]
    pub(super) messages: Vec<InMessage>,
    /// The system prompt: a string or text blocks.
    #[serde(default)]
    pub(super) system: Option<Content>,
    #[serde(default)]
    pub(super) stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    pub(super) stream: bool,
    /// Anthropic's default, 1, when absent (unless the model's manifest sets one); 0 is greedy.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 1)]
    pub(super) temperature: Option<f32>,
    #[serde(default)]
    #[schema(exclusive_minimum = 0, maximum = 1)]
    pub(super) top_p: Option<f32>,
    #[serde(default)]
    pub(super) top_k: Option<u32>,
    /// `user_id`: the end user the request is for; within the key's share of the workers,
    /// each end user gets a fair share of its own.
    #[serde(default)]
    pub(super) metadata: Option<Metadata>,
    /// Functions the model may call (at most 128); see `tool_choice`.
    #[serde(default)]
    pub(super) tools: Option<Vec<InTool>>,
    /// `auto` (the default with tools), `any` (a call of some tool), `tool` (a call of the
    /// named one) or `none`; `any` and `tool` constrain the reply to a call.
    #[serde(default)]
    pub(super) tool_choice: Option<InToolChoice>,
    /// `format` (`{"type": "json_schema", "schema"}`) constrains the reply to JSON that
    /// validates against the schema, as it is sampled; `effort` is accepted.
    #[serde(default)]
    pub(super) output_config: Option<OutputConfig>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = AnthropicOutputConfig)]
pub(super) struct OutputConfig {
    #[serde(default)]
    format: Option<OutputFormat>,
    /// Accepted: the served models answer as they do.
    #[serde(default)]
    #[allow(dead_code)]
    effort: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = AnthropicOutputFormat)]
pub(super) struct OutputFormat {
    /// `json_schema`
    #[serde(rename = "type")]
    kind: String,
    /// The JSON Schema the reply follows.
    #[schema(value_type = Object)]
    schema: Value,
}

#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = AnthropicMetadata)]
pub(super) struct Metadata {
    #[serde(default)]
    user_id: Option<String>,
}

/// A tool: its name, what it does, and its input's JSON Schema.
#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = AnthropicTool)]
pub(super) struct InTool {
    name: String,
    #[serde(default)]
    description: Option<String>,
    /// An object's JSON Schema.
    #[schema(value_type = Object)]
    input_schema: Value,
    /// Only custom tools (absent or `custom`): Anthropic's server tools run on its servers.
    #[serde(rename = "type", default)]
    kind: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = AnthropicToolChoice)]
pub(super) struct InToolChoice {
    /// `auto`, `any`, `tool` or `none`.
    #[serde(rename = "type")]
    kind: String,
    /// With `tool`: the tool to call.
    #[serde(default)]
    name: Option<String>,
    /// Accepted: a reply holds one call or several, as the model writes it.
    #[serde(default)]
    #[allow(dead_code)]
    disable_parallel_tool_use: Option<bool>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = AnthropicInputMessage)]
pub(super) struct InMessage {
    /// `user` or `assistant`.
    role: String,
    content: Content,
}

/// A string, or content blocks.
#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = AnthropicContent)]
#[serde(untagged)]
pub(super) enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

/// A content block: `text`, `tool_use` (an assistant's call), `tool_result` (a user's answer
/// to one); `thinking` blocks of the history are skipped.
#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = AnthropicBlock)]
pub(super) struct Block {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
    /// `tool_use`: the call's id.
    #[serde(default)]
    id: Option<String>,
    /// `tool_use`: the tool called.
    #[serde(default)]
    name: Option<String>,
    /// `tool_use`: its input.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    input: Option<Value>,
    /// `tool_result`: the call it answers.
    #[serde(default)]
    tool_use_id: Option<String>,
    /// `tool_result`: a string or text blocks.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    content: Option<Value>,
    /// `tool_result`: the tool failed.
    #[serde(default)]
    is_error: Option<bool>,
}

pub(super) fn refuse(field: &str, why: impl Into<String>) -> ApiError {
    ApiError::Validation(Invalid::field(field, why))
}

impl MessagesRequest {
    /// The request's tools and tool choice, as Hearth's; `None` without tools.
    pub(super) fn tools(&self) -> Result<Option<Tools>, ApiError> {
        let mut tools = Vec::new();
        for (i, t) in self.tools.iter().flatten().enumerate() {
            if t.kind.as_deref().is_some_and(|k| k != "custom") {
                return Err(refuse(
                    &format!("tools[{i}].type"),
                    "only custom tools (Anthropic's server tools run on its own servers)",
                ));
            }
            tools.push(Tool::function(
                t.name.clone(),
                t.description.clone(),
                Some(t.input_schema.clone()),
            ));
        }
        let choice = self.tool_choice.as_ref().map(tool_choice).transpose()?;
        // The checks name OpenAI's fields (`tools[0].function.parameters`).
        let anthropics = |p: &str| {
            p.replace(".function.parameters", ".input_schema")
                .replace(".function.name", ".name")
        };
        Tools::new(Some(tools.as_slice()), choice.as_ref())
            .map_err(|e| ApiError::from(e).with_param(anthropics))
    }

    /// The request as a validated turn: every field checked once, here.
    pub(super) fn turn(
        &self,
        tools: Option<&Tools>,
        defaults: &ModelDefaults,
    ) -> Result<ValidTurn<Conversation>, ApiError> {
        let max_tokens = match self.max_tokens {
            None => return Err(refuse("max_tokens", "required")),
            Some(0) => return Err(refuse("max_tokens", "must be at least 1")),
            Some(n) => n,
        };
        if let Some(t) = self.temperature.filter(|t| !(0.0..=1.0).contains(t)) {
            return Err(refuse("temperature", format!("0 to 1, got {t}")));
        }
        let mut params = defaults.params().clone();
        params.temperature = self.temperature.unwrap_or(defaults.openai_temperature());
        params.top_p = self.top_p.unwrap_or(params.top_p);
        params.top_k = self.top_k.unwrap_or(params.top_k);
        let stop = self.stop_sequences.clone().unwrap_or_default();
        let end_user = self.metadata.as_ref().and_then(|m| m.user_id.as_deref());
        let (field, grammar) =
            crate::tools::turn_grammar(tools, "output_config.format", self.format()?)?;
        let options = GenOptions::new(Some(params), "", Some(max_tokens), stop, false)
            .map_err(|e| ApiError::from(e).with_param(renamed("stop", "stop_sequences")))?
            .with_grammar(field, grammar)?
            .with_tools(tools.cloned())
            .with_end_user(end_user)
            .map_err(|e| ApiError::from(e).with_param(renamed("user", "metadata.user_id")))?;
        Ok(ValidTurn::new(
            self.conversation(tools)?,
            options,
            self.stream,
        ))
    }

    /// The grammar `output_config.format` asks for, if any.
    fn format(&self) -> Result<Option<Grammar>, ApiError> {
        let Some(f) = self.output_config.as_ref().and_then(|c| c.format.as_ref()) else {
            return Ok(None);
        };
        if f.kind != "json_schema" {
            return Err(refuse("output_config.format.type", "only `json_schema`"));
        }
        Ok(Some(Grammar::JsonSchema {
            schema: f.schema.clone(),
        }))
    }

    /// The system prompt and messages as a conversation, each block checked (its field named
    /// in an error); tool results become user text that names the tool, and `tools`'
    /// description heads the system prompt.
    pub(super) fn conversation(&self, tools: Option<&Tools>) -> Result<Conversation, ApiError> {
        let mut out = Vec::with_capacity(self.messages.len() + 1);
        if let Some(system) = &self.system {
            out.push((ChatRole::System, text_of(system, "system")?));
        }
        let mut calls: Vec<(String, String)> = Vec::new();
        for (i, m) in self.messages.iter().enumerate() {
            let field = format!("messages[{i}]");
            let entry = match m.role.as_str() {
                "user" => (ChatRole::User, user_text(&m.content, &field, &calls)?),
                "assistant" => (
                    ChatRole::Assistant,
                    assistant(&m.content, &field, &mut calls)?,
                ),
                other => {
                    return Err(refuse(
                        &format!("{field}.role"),
                        format!("`{other}` is not one of user, assistant"),
                    ))
                }
            };
            out.push(entry);
        }
        let convo = Conversation::new(out)?;
        Ok(match tools.and_then(Tools::system_text) {
            Some(t) => convo.with_system_prefix(t),
            None => convo,
        })
    }
}

/// A field named `from` by a check (or a part of it: `from[0]`, `from.x`) as this API names
/// it, `to`.
fn renamed<'a>(from: &'a str, to: &'a str) -> impl Fn(&str) -> String + 'a {
    move |p: &str| match p.strip_prefix(from) {
        Some(rest) if rest.is_empty() || rest.starts_with(['[', '.']) => format!("{to}{rest}"),
        _ => p.to_string(),
    }
}

/// Anthropic's tool choice as Hearth's.
fn tool_choice(c: &InToolChoice) -> Result<ToolChoice, ApiError> {
    Ok(match c.kind.as_str() {
        "auto" => ToolChoice::Mode("auto".into()),
        "any" => ToolChoice::Mode("required".into()),
        "none" => ToolChoice::Mode("none".into()),
        "tool" => {
            let name = c
                .name
                .clone()
                .ok_or_else(|| refuse("tool_choice.name", "required with `tool`"))?;
            ToolChoice::named(name)
        }
        other => {
            return Err(refuse(
                "tool_choice.type",
                format!("`{other}` is not one of auto, any, tool, none"),
            ))
        }
    })
}

/// Text content: a string, or text blocks joined (`field` names it in errors).
fn text_of(content: &Content, field: &str) -> Result<String, ApiError> {
    match content {
        Content::Text(t) => Ok(t.clone()),
        Content::Blocks(blocks) => {
            let mut text = String::new();
            for (j, b) in blocks.iter().enumerate() {
                let at = format!("{field}[{j}]");
                match b.kind.as_str() {
                    "text" => join(&mut text, block_text(b, &at)?),
                    other => return Err(unreadable(&at, other, "text")),
                }
            }
            Ok(text)
        }
    }
}

/// A user message's text: its text blocks and its tool results, in order (`calls`: the calls
/// made before it, as (id, tool name)).
fn user_text(
    content: &Content,
    field: &str,
    calls: &[(String, String)],
) -> Result<String, ApiError> {
    let Content::Blocks(blocks) = content else {
        return text_of(content, &format!("{field}.content"));
    };
    let mut text = String::new();
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{field}.content[{j}]");
        match b.kind.as_str() {
            "text" => join(&mut text, block_text(b, &at)?),
            "tool_result" => join(&mut text, &tool_result(b, &at, calls)?),
            other => return Err(unreadable(&at, other, "text, tool_result")),
        }
    }
    Ok(text)
}

/// An assistant message's text, its calls written as the model writes them; the calls join
/// `calls` for the results after it.
fn assistant(
    content: &Content,
    field: &str,
    calls: &mut Vec<(String, String)>,
) -> Result<String, ApiError> {
    let Content::Blocks(blocks) = content else {
        return text_of(content, &format!("{field}.content"));
    };
    let mut text = String::new();
    let mut made = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{field}.content[{j}]");
        match b.kind.as_str() {
            "text" => join(&mut text, block_text(b, &at)?),
            "tool_use" => made.push(tool_use(b, &at)?),
            // What a model that thinks aloud thought: not part of what it said.
            "thinking" | "redacted_thinking" => {}
            other => return Err(unreadable(&at, other, "text, tool_use, thinking")),
        }
    }
    calls.extend(crate::tools::call_names(Some(made.as_slice())));
    Ok(assistant_text(field, text, Some(made.as_slice()))?)
}

fn block_text<'a>(b: &'a Block, at: &str) -> Result<&'a str, ApiError> {
    b.text
        .as_deref()
        .ok_or_else(|| refuse(&format!("{at}.text"), "required in a text block"))
}

/// A `tool_use` block as a call of the history.
fn tool_use(b: &Block, at: &str) -> Result<InToolCall, ApiError> {
    let need = |name: &str| refuse(&format!("{at}.{name}"), "required in a tool_use block");
    let id = b.id.clone().ok_or_else(|| need("id"))?;
    let name = b.name.clone().ok_or_else(|| need("name"))?;
    let input = b.input.as_ref().ok_or_else(|| need("input"))?;
    if !input.is_object() {
        return Err(refuse(&format!("{at}.input"), "must be an object"));
    }
    Ok(InToolCall::new(id, name, input.to_string()))
}

/// A `tool_result` block as the text the model reads: the result, naming the tool called.
fn tool_result(b: &Block, at: &str, calls: &[(String, String)]) -> Result<String, ApiError> {
    let mut content = match &b.content {
        None => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => {
            let blocks: Vec<Block> = serde_json::from_value(v.clone())
                .map_err(|_| refuse(&format!("{at}.content"), "a string or text blocks"))?;
            text_of(&Content::Blocks(blocks), &format!("{at}.content"))?
        }
    };
    if b.is_error == Some(true) {
        content = format!("(the tool failed) {content}");
    }
    // OpenAI's check of a tool message, which names its field `tool_call_id`.
    let id = b.tool_use_id.as_deref();
    tool_text(at, &content, id, calls)
        .map_err(|e| ApiError::from(e).with_param(|p| p.replace(".tool_call_id", ".tool_use_id")))
}

/// Appends `more` to `text`, a blank line between.
fn join(text: &mut String, more: &str) {
    if !text.is_empty() && !more.is_empty() {
        text.push_str("\n\n");
    }
    text.push_str(more);
}

/// A block Hearth cannot read, with the kinds it can there.
fn unreadable(at: &str, kind: &str, readable: &str) -> ApiError {
    let why = match kind {
        "image" | "document" => format!(
            "`{kind}` blocks are not supported: the served models read text only ({readable})"
        ),
        _ => format!("`{kind}` is not a block type Hearth reads here ({readable})"),
    };
    refuse(&format!("{at}.type"), why)
}

/// A finished message.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = AnthropicMessage)]
pub struct Message {
    pub id: String,
    /// `message`
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// `assistant`
    pub role: &'static str,
    pub model: String,
    pub content: Vec<OutBlock>,
    pub stop_reason: Option<StopReason>,
    /// The stop sequence that ended the reply, when one did.
    pub stop_sequence: Option<String>,
    pub usage: MessageUsage,
}

/// A block of the answer: its text, or a call.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[schema(as = AnthropicOutBlock)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutBlock {
    Text {
        text: String,
    },
    ToolUse {
        id: String,
        name: String,
        #[schema(value_type = Object)]
        input: Value,
    },
}

/// Why the reply ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[schema(as = AnthropicStopReason)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    EndTurn,
    MaxTokens,
    StopSequence,
    ToolUse,
}

#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[schema(as = AnthropicMessageUsage)]
pub struct MessageUsage {
    /// Prompt tokens the worker computed (those it held in its cache are apart).
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Prompt tokens the worker already held in its cache.
    pub cache_read_input_tokens: u64,
    /// Always 0: Hearth caches prompts without being asked to.
    pub cache_creation_input_tokens: u64,
}

impl MessageUsage {
    pub(super) fn of(o: &Outcome) -> Self {
        let cached = o.usage.cached_tokens.min(o.usage.prompt_tokens);
        Self {
            input_tokens: o.usage.prompt_tokens - cached,
            output_tokens: o.usage.completion_tokens,
            cache_read_input_tokens: cached,
            cache_creation_input_tokens: 0,
        }
    }
}

/// Why `o` ended, Anthropic's way (a failed reply is an error instead).
pub(super) fn stop_reason(o: &Outcome) -> Result<StopReason, ApiError> {
    let finish = o
        .end
        .openai_finish_reason()
        .map_err(|e| ApiError::from(e.clone()))?;
    Ok(match (finish, &o.tool_calls, &o.stop_sequence) {
        (_, Some(_), _) => StopReason::ToolUse,
        (crate::generate::OpenAiFinish::Length, ..) => StopReason::MaxTokens,
        (_, None, Some(_)) => StopReason::StopSequence,
        _ => StopReason::EndTurn,
    })
}

/// A call the reply makes, as a `tool_use` block.
pub(super) fn tool_use_block(c: &ToolCall) -> OutBlock {
    OutBlock::ToolUse {
        id: c.id.clone(),
        name: c.function.name.clone(),
        input: serde_json::from_str(&c.function.arguments).unwrap_or_default(),
    }
}

/// The blocks of a finished reply: its calls, or its text.
pub(super) fn blocks(o: &Outcome) -> Vec<OutBlock> {
    match &o.tool_calls {
        Some(calls) => calls.iter().map(tool_use_block).collect(),
        None => vec![OutBlock::Text {
            text: o.content.clone(),
        }],
    }
}

/// The answer to `POST /v1/messages/count_tokens`.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = AnthropicTokenCount)]
pub struct TokenCount {
    /// The prompt's tokens: what the message would count as its input.
    pub input_tokens: usize,
}
