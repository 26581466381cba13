//! The wire types of the OpenAI chat completions API: the request as clients send it (checked
//! into a turn, fields Hearth cannot honour refused by name) and the answer as they get it.

use crate::invalid::Invalid;
use hearth_shared::chat::Role as ChatRole;
use hearth_shared::{Grammar, SamplingParams};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use utoipa::ToSchema;

use crate::api::ApiError;
use crate::generate::{OpenAiFinish, Outcome};
use crate::service::{Conversation, GenOptions, ModelDefaults, ValidTurn, MAX_CHOICES};
use crate::tools::{
    assistant_text, call_names, tool_text, turn_grammar, InToolCall, Tool, ToolCall, ToolChoice,
    Tools,
};

/// OpenAI's chat completion request. Fields that do not change the output (`metadata`, …) are
/// accepted and ignored; those Hearth cannot honour are refused by name.
#[derive(Debug, Deserialize, ToSchema)]
pub struct ChatRequest {
    /// A served model's name, as `/v1/models` lists it (its newest ready version), or
    /// `name@version` for one version; another is a 404 `model_not_found`. Absent: the default
    /// model (the first `/v1/models` lists).
    #[serde(default)]
    pub(super) model: Option<String>,
    #[schema(min_items = 1)]
    pub(super) messages: Vec<InMessage>,
    #[serde(default)]
    pub(super) stream: bool,
    #[serde(default)]
    pub(super) stream_options: Option<StreamOptions>,
    /// Longest reply: at least 1 and less than the model's context.
    #[serde(default)]
    #[schema(minimum = 1)]
    pub(super) max_tokens: Option<u32>,
    /// Takes precedence over `max_tokens`.
    #[serde(default)]
    #[schema(minimum = 1)]
    max_completion_tokens: Option<u32>,
    /// OpenAI's default, 1, when absent; 0 is greedy.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 100)]
    pub(super) temperature: Option<f32>,
    #[serde(default)]
    #[schema(exclusive_minimum = 0, maximum = 1)]
    pub(super) top_p: Option<f32>,
    #[serde(default)]
    pub(super) top_k: Option<u32>,
    #[serde(default)]
    #[schema(minimum = 0, maximum = 1)]
    pub(super) min_p: Option<f32>,
    #[serde(default)]
    #[schema(exclusive_minimum = 0, maximum = 10)]
    pub(super) repetition_penalty: Option<f32>,
    #[serde(default)]
    pub(super) seed: Option<u64>,
    #[serde(default)]
    pub(super) stop: Option<StopField>,
    /// Non-standard (vLLM, llama.cpp): generate exactly `max_tokens`.
    #[serde(default)]
    pub(super) ignore_eos: bool,
    /// Choices to generate (1 to 16); the prompt is prefilled once and counted once in usage.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 16)]
    pub(super) n: Option<u32>,
    #[serde(default)]
    #[schema(minimum = -2, maximum = 2)]
    pub(super) frequency_penalty: Option<f32>,
    #[serde(default)]
    #[schema(minimum = -2, maximum = 2)]
    pub(super) presence_penalty: Option<f32>,
    /// Token id (as a string key) to a bias in [-100, 100] added to its logit; at most 300.
    #[serde(default)]
    pub(super) logit_bias: Option<std::collections::BTreeMap<u32, f32>>,
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
    pub(super) dry_sequence_breakers: Option<Vec<String>>,
    /// Each token's log-probability in `choices[].logprobs.content`.
    #[serde(default)]
    pub(super) logprobs: Option<bool>,
    /// With `logprobs`: this many likeliest alternatives per token.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 20)]
    pub(super) top_logprobs: Option<u32>,
    /// Functions the model may call (at most 128); see `tool_choice`.
    #[serde(default)]
    pub(super) tools: Option<Vec<Tool>>,
    /// `auto` (the default with tools: the model answers or calls), `none`, `required` (a
    /// call to any tool), or a named function; the last two constrain the reply to a call.
    #[serde(default)]
    pub(super) tool_choice: Option<ToolChoice>,
    /// The end user the request is for (at most 256 bytes): within the API key's share of the
    /// workers, each end user gets a fair share of its own.
    #[serde(default)]
    pub(super) user: Option<String>,
    /// Non-standard (Ollama): how long, in seconds, the model stays loaded once idle, from
    /// this request on; negative keeps it for good, 0 unloads it as soon as it is idle. It
    /// applies to models from a worker's repository, which load again on demand.
    #[serde(default)]
    pub(super) keep_alive: Option<f64>,
    /// Accepted: the model may make several calls in one reply (a JSON array of them).
    #[serde(default)]
    #[allow(dead_code)]
    parallel_tool_calls: Option<bool>,
    /// `text` (the default), `json_object` (any JSON object) or `json_schema` (JSON that
    /// validates against `json_schema.schema`): the reply is constrained to it as it is sampled.
    #[serde(default)]
    pub(super) response_format: Option<ResponseFormat>,
    /// Non-standard: a Lark grammar or a regular expression the reply follows (or a JSON
    /// Schema, as on the native API). Not with a `response_format` other than `text`.
    #[serde(default)]
    pub(super) grammar: Option<Grammar>,
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
    pub(super) fn grammar(&self) -> Result<Option<Grammar>, ApiError> {
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
pub(super) struct StreamOptions {
    #[serde(default)]
    pub(super) include_usage: bool,
}

/// One stop string or up to 16, each of 1 to 256 characters.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(in crate::api) enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize, ToSchema)]
pub(super) struct InMessage {
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
pub(super) enum Content {
    Text(String),
    Parts(Vec<Part>),
}

/// A content part; only `text` parts are supported.
#[derive(Debug, Deserialize, ToSchema)]
pub(super) struct Part {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

pub(super) fn refuse(field: &str, why: &str) -> ApiError {
    ApiError::Validation(Invalid::field(field, why))
}

impl InMessage {
    /// The message's text: its content, or its text parts joined.
    pub(super) fn text(&self, field: &str) -> Result<String, ApiError> {
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
    pub(super) fn tools(&self) -> Result<Option<Tools>, ApiError> {
        Ok(Tools::new(
            self.tools.as_deref(),
            self.tool_choice.as_ref(),
        )?)
    }

    pub(super) fn check_supported(&self) -> Result<(), ApiError> {
        if let Some(n) = self.n.filter(|n| !(1..=MAX_CHOICES).contains(n)) {
            return Err(refuse(
                "n",
                &format!("must be 1 to {MAX_CHOICES} choices, got {n}"),
            ));
        }
        Ok(())
    }

    /// The request's sampling fields over the model's defaults.
    pub(super) fn params(&self, defaults: &ModelDefaults) -> SamplingParams {
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
        conversation(&self.messages, tools)
    }

    /// The request as a validated turn: every field checked once, here.
    pub(super) fn turn(
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

/// Chat messages as a conversation, each checked (its field named in an error); tool messages
/// become user messages holding their results, and `tools`' description heads the system
/// prompt.
pub(super) fn conversation(
    messages: &[InMessage],
    tools: Option<&Tools>,
) -> Result<Conversation, ApiError> {
    let mut out = Vec::with_capacity(messages.len());
    let mut calls: Vec<(String, String)> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
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
    pub finish_reason: OpenAiFinish,
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
