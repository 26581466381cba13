//! A generation request as the chat service takes it: validated once, at the API's edge, and
//! the same type for both APIs. Each part can only be built through its checks, so the service
//! never sees an unchecked stop list, sampling parameter or message.
//!
//! What needs the served model (whether `max_tokens` fits its context) or the stored session
//! (its defaults, whether the edited message exists) is checked by the service, before anything
//! is charged or stored.

use crate::invalid::Invalid;
use std::sync::Arc;

use hearth_shared::chat::{Message as ChatMessage, Role as ChatRole};
use hearth_shared::{Grammar, SamplingParams};
use tokio::time::Instant;

use super::ChatError;
use crate::ids::MessageId;
use crate::storage::NewResponse;
use crate::tools::Tools;

/// Largest message a user may post.
pub const MAX_CONTENT_BYTES: usize = 256 << 10;
const MAX_STOPS: usize = 16;
const MAX_STOP_CHARS: usize = 256;

/// A validated generation request: what to answer (`I`: a [`NativeTurn`] or a
/// [`Conversation`]) and how.
#[derive(Debug, Clone)]
pub struct ValidTurn<I> {
    input: I,
    options: GenOptions,
    stream: bool,
    arrived: Instant,
}

impl<I> ValidTurn<I> {
    /// A request that arrived now (its time to first token counts from here).
    pub fn new(input: I, options: GenOptions, stream: bool) -> Self {
        Self {
            input,
            options,
            stream,
            arrived: Instant::now(),
        }
    }

    /// Whether the answer streams as Server-Sent Events (else it is the finished reply).
    pub fn stream(&self) -> bool {
        self.stream
    }

    pub(super) fn into_parts(self) -> (I, GenOptions, Instant) {
        (self.input, self.options, self.arrived)
    }
}

impl ValidTurn<NativeTurn> {
    /// A kept response's turn that no longer expects the response it continues to be its
    /// session's last message: it runs in a copy of that session.
    pub(super) fn without_previous(mut self) -> Self {
        if let NativeTurn::Response(r) = &mut self.input {
            r.previous = None;
        }
        self
    }
}

/// The options of one generation, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct GenOptions {
    params: Option<SamplingParams>,
    max_tokens: Option<u32>,
    stop: Vec<String>,
    ignore_eos: bool,
    /// Log-probabilities with each token, with this many alternatives.
    logprobs: Option<u32>,
    /// The grammar the reply follows, and the request's field that holds it.
    grammar: Option<Grammar>,
    grammar_field: String,
    /// The tools the model may call: a reply that is calls of them becomes `tool_calls`.
    tools: Option<Arc<Tools>>,
    /// The end user the client named (OpenAI's `user`), whom the fair queue tells apart from
    /// the key's other end users.
    end_user: Option<String>,
    /// How long the model stays loaded once idle, from this request on (`keep_alive`), in
    /// milliseconds; negative: for good.
    keep_alive_ms: Option<i64>,
}

/// Longest `keep_alive` a request may set, in seconds (a week).
pub const MAX_KEEP_ALIVE_SECS: f64 = 7.0 * 86_400.0;

/// Most bytes of an end user's name (OpenAI's `user`).
pub const MAX_END_USER_BYTES: usize = 256;

/// Most alternatives per token (`top_logprobs`), as OpenAI's.
pub const MAX_TOP_LOGPROBS: u32 = 20;

impl GenOptions {
    /// Checks each option. `params_prefix` is how the request names the sampling parameters'
    /// fields in errors (`params.` on the native API, nothing on OpenAI's). Absent `params`
    /// mean the session's defaults, or the defaults of [`SamplingParams`] without a session.
    pub fn new(
        params: Option<SamplingParams>,
        params_prefix: &str,
        max_tokens: Option<u32>,
        stop: Vec<String>,
        ignore_eos: bool,
    ) -> Result<Self, ChatError> {
        Ok(Self {
            params: params.map(|p| check_params(p, params_prefix)).transpose()?,
            max_tokens,
            stop: check_stops(stop, "stop")?,
            ignore_eos,
            logprobs: None,
            grammar: None,
            grammar_field: String::new(),
            tools: None,
            end_user: None,
            keep_alive_ms: None,
        })
    }

    /// Offers `tools` (checked already): their description heads a native turn's system
    /// prompt, and a reply that is calls of them ends as `tool_calls`.
    pub fn with_tools(mut self, tools: Option<Tools>) -> Self {
        self.tools = tools.map(Arc::new);
        self
    }

    pub(super) fn tools(&self) -> Option<&Arc<Tools>> {
        self.tools.as_ref()
    }

    /// Names the end user the request is for (OpenAI's `user`): at most
    /// [`MAX_END_USER_BYTES`], no NUL characters; an empty name is no name.
    pub fn with_end_user(mut self, user: Option<&str>) -> Result<Self, ChatError> {
        if let Some(u) = user.filter(|u| !u.is_empty()) {
            if u.len() > MAX_END_USER_BYTES {
                return Err(ChatError::Invalid(Invalid::field(
                    "user",
                    format!("longer than {MAX_END_USER_BYTES} bytes"),
                )));
            }
            check_text("user", u)?;
            self.end_user = Some(u.to_string());
        }
        Ok(self)
    }

    pub(super) fn end_user(&self) -> Option<&str> {
        self.end_user.as_deref()
    }

    /// `keep_alive` (seconds; negative: for good), as Ollama takes it.
    pub fn with_keep_alive(mut self, secs: Option<f64>) -> Result<Self, ChatError> {
        if let Some(s) = secs {
            if !s.is_finite() || s > MAX_KEEP_ALIVE_SECS {
                return Err(ChatError::Invalid(Invalid::field(
                    "keep_alive",
                    format!(
                        "seconds up to {MAX_KEEP_ALIVE_SECS} (a week), or negative to keep \
                     the model loaded for good"
                    ),
                )));
            }
            self.keep_alive_ms = Some(if s < 0.0 { -1 } else { (s * 1000.0) as i64 });
        }
        Ok(self)
    }

    pub(super) fn keep_alive_ms(&self) -> Option<i64> {
        self.keep_alive_ms
    }

    /// Constrains the reply to `grammar`; `field` names it in errors (`response_format`,
    /// `grammar`). Only its shape is checked here: it compiles once the request is charged
    /// ([`Self::to_compile`]).
    pub fn with_grammar(
        mut self,
        field: &str,
        grammar: Option<Grammar>,
    ) -> Result<Self, ChatError> {
        if let Some(g) = &grammar {
            g.check_shape()
                .map_err(|e| ChatError::InvalidGrammar(Invalid::field(field, e.to_string())))?;
        }
        self.grammar = grammar;
        self.grammar_field = field.to_string();
        Ok(self)
    }

    /// Every grammar the request brings, with the field that holds it: its own, and its
    /// tools' parameters schemas. Each must compile before the request runs.
    pub(super) fn to_compile(&self) -> Vec<(String, Grammar)> {
        let own = self
            .grammar
            .iter()
            .map(|g| (self.grammar_field.clone(), g.clone()));
        let tools = self.tools.iter().flat_map(|t| t.schemas());
        own.chain(tools).collect()
    }

    pub(super) fn grammar(&self) -> Option<&Grammar> {
        self.grammar.as_ref()
    }

    /// Asks for each token's log-probability (`logprobs`), with `top` alternatives (0 to 20;
    /// OpenAI's `top_logprobs`, which needs `logprobs`).
    pub fn with_logprobs(mut self, logprobs: bool, top: Option<u32>) -> Result<Self, ChatError> {
        match (logprobs, top) {
            (_, Some(n)) if n > MAX_TOP_LOGPROBS => Err(ChatError::Invalid(Invalid::field(
                "top_logprobs",
                format!("at most {MAX_TOP_LOGPROBS}, got {n}"),
            ))),
            (false, Some(n)) if n > 0 => Err(ChatError::Invalid(Invalid::field(
                "top_logprobs",
                "needs `logprobs: true`",
            ))),
            (true, top) => {
                self.logprobs = Some(top.unwrap_or(0));
                Ok(self)
            }
            (false, _) => Ok(self),
        }
    }

    pub(super) fn logprobs(&self) -> Option<u32> {
        self.logprobs
    }

    pub(super) fn params(&self) -> Option<&SamplingParams> {
        self.params.as_ref()
    }

    pub(super) fn max_tokens(&self) -> Option<u32> {
        self.max_tokens
    }

    pub(super) fn stop(&self) -> &[String] {
        &self.stop
    }

    pub(super) fn ignore_eos(&self) -> bool {
        self.ignore_eos
    }
}

/// What a native turn answers, in a stored session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NativeTurn {
    /// A new user message.
    Post(UserText),
    /// The results of the last reply's tool calls, one for each call.
    ToolResults(Vec<ToolResult>),
    /// The last user message again, replacing the last reply.
    Regenerate,
    /// An earlier user message with new text; everything after it is replaced.
    Edit {
        message_id: MessageId,
        content: UserText,
    },
    /// A kept response of OpenAI's Responses API: its input items added to the session, whose
    /// system prompt and model it sets (made with [`NativeTurn::response`]).
    Response(Box<NewResponse>),
}

impl NativeTurn {
    /// Bytes of new text the turn adds to its session (an edit's replaces text, counted whole).
    pub(super) fn text_len(&self) -> usize {
        match self {
            Self::Post(t) | Self::Edit { content: t, .. } => t.as_str().len(),
            Self::ToolResults(r) => r.iter().map(|r| r.content.len()).sum(),
            Self::Response(r) => r.items.iter().map(|i| i.content.len()).sum(),
            Self::Regenerate => 0,
        }
    }

    /// Messages the turn may add to its session (a regenerate or an edit counts as two, as a
    /// post does).
    pub(super) fn new_messages(&self) -> usize {
        match self {
            Self::ToolResults(r) => r.len() + 1,
            Self::Response(r) => r.items.len() + 1,
            Self::Post(_) | Self::Regenerate | Self::Edit { .. } => 2,
        }
    }
}

impl NativeTurn {
    /// A kept response's turn, its texts checked as a message's are (errors name `input` and
    /// `instructions`).
    pub fn response(new: NewResponse) -> Result<Self, ChatError> {
        for (i, item) in new.items.iter().enumerate() {
            check_storable(&format!("input[{i}]"), &item.content)?;
        }
        if let Some(system) = &new.system_prompt {
            check_storable("instructions", system)?;
        }
        Ok(Self::Response(Box::new(new)))
    }
}

/// Most results one turn may post: as many calls as one reply may make.
pub const MAX_TOOL_RESULTS: usize = crate::tools::MAX_CALLS;

/// A tool's result, posted on a native turn: the call it answers and what the tool returned
/// (at most [`MAX_CONTENT_BYTES`], no NUL characters; it may be empty).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolResult {
    pub(super) call_id: String,
    pub(super) content: String,
}

impl ToolResult {
    /// `field` names the result in errors (`tool_results[0]`).
    pub fn new(field: &str, call_id: &str, content: &str) -> Result<Self, ChatError> {
        if call_id.is_empty() {
            return Err(ChatError::Invalid(Invalid::field(
                format!("{field}.tool_call_id"),
                "must not be empty",
            )));
        }
        check_text(&format!("{field}.tool_call_id"), call_id)?;
        check_storable(&format!("{field}.content"), content)?;
        Ok(Self {
            call_id: call_id.to_string(),
            content: content.to_string(),
        })
    }
}

/// A user message's text: not blank, at most [`MAX_CONTENT_BYTES`], no NUL characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserText(String);

impl UserText {
    /// `field` names the text in the error (`content`, `messages[2].content`).
    pub fn new(field: &str, text: &str) -> Result<Self, ChatError> {
        if text.trim().is_empty() {
            return Err(ChatError::Invalid(Invalid::field(
                field,
                "must not be empty",
            )));
        }
        check_storable(field, text)?;
        Ok(Self(text.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A whole conversation sent with the request (OpenAI's API): nothing is stored.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation(Vec<ChatMessage>);

impl Conversation {
    /// Checks the messages (at least one; each at most [`MAX_CONTENT_BYTES`], without NUL
    /// characters; an empty one is allowed, as OpenAI allows it) and joins leading system
    /// messages into one system prompt. Errors name `messages[i].content`.
    pub fn new(messages: Vec<(ChatRole, String)>) -> Result<Self, ChatError> {
        if messages.is_empty() {
            return Err(ChatError::Invalid(Invalid::field(
                "messages",
                "must not be empty",
            )));
        }
        let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len());
        for (i, (role, text)) in messages.into_iter().enumerate() {
            check_storable(&format!("messages[{i}].content"), &text)?;
            match out.last_mut() {
                Some(prev) if role == ChatRole::System && prev.role == ChatRole::System => {
                    prev.content.push_str("\n\n");
                    prev.content.push_str(&text);
                }
                _ => out.push(ChatMessage::new(role, text)),
            }
        }
        Ok(Self(out))
    }

    /// Puts `text` (the tools' description) first in the system prompt, which it starts if
    /// there is none.
    pub fn with_system_prefix(mut self, text: String) -> Self {
        prefix_system(&mut self.0, text);
        self
    }

    pub(super) fn into_messages(self) -> Vec<ChatMessage> {
        self.0
    }
}

/// Puts `text` first in the system prompt of `messages`, or starts one with it.
pub(super) fn prefix_system(messages: &mut Vec<ChatMessage>, text: String) {
    match messages.first_mut() {
        Some(m) if m.role == ChatRole::System => {
            m.content = format!("{text}\n\n{}", m.content);
        }
        _ => messages.insert(0, ChatMessage::new(ChatRole::System, text)),
    }
}

/// A prompt sent as it is, without the chat template (OpenAI's legacy `/v1/completions`): text,
/// which is tokenized after a BOS token as the model was trained, or token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RawPrompt {
    Text(String),
    Tokens(Vec<u32>),
}

impl RawPrompt {
    /// Text (at most [`MAX_CONTENT_BYTES`], no NUL, not empty) as the prompt.
    pub fn text(text: String) -> Result<Self, ChatError> {
        check_storable("prompt", &text)?;
        if text.is_empty() {
            return Err(ChatError::Invalid(Invalid::field(
                "prompt",
                "must not be empty",
            )));
        }
        Ok(Self::Text(text))
    }

    /// Token ids (at least one; the service checks them against the vocabulary) as the prompt.
    pub fn tokens(ids: Vec<u32>) -> Result<Self, ChatError> {
        if ids.is_empty() {
            return Err(ChatError::Invalid(Invalid::field(
                "prompt",
                "must not be empty",
            )));
        }
        Ok(Self::Tokens(ids))
    }
}

/// Text a message may hold: at most [`MAX_CONTENT_BYTES`], without NUL characters (which
/// PostgreSQL cannot store).
fn check_storable(field: &str, c: &str) -> Result<(), ChatError> {
    if c.len() > MAX_CONTENT_BYTES {
        return Err(ChatError::Invalid(Invalid::field(
            field,
            format!("longer than {MAX_CONTENT_BYTES} bytes"),
        )));
    }
    check_text(field, c)
}

/// Text a database column can hold: PostgreSQL refuses NUL characters.
pub(super) fn check_text(field: &str, t: &str) -> Result<(), ChatError> {
    if t.contains('\0') {
        return Err(ChatError::Invalid(Invalid::field(
            field,
            "must not contain NUL characters",
        )));
    }
    Ok(())
}

fn check_stops(stop: Vec<String>, field: &str) -> Result<Vec<String>, ChatError> {
    if stop.len() > MAX_STOPS {
        return Err(ChatError::Invalid(Invalid::field(
            field,
            format!("at most {MAX_STOPS} stop strings"),
        )));
    }
    for s in &stop {
        if s.is_empty() || s.chars().count() > MAX_STOP_CHARS {
            return Err(ChatError::Invalid(Invalid::field(
                field,
                format!("each stop string must be 1 to {MAX_STOP_CHARS} characters"),
            )));
        }
    }
    Ok(stop)
}

/// Sampling parameters in range; `prefix` goes before the field's name in the error.
pub fn check_params(p: SamplingParams, prefix: &str) -> Result<SamplingParams, ChatError> {
    p.validate().map_err(|e| {
        ChatError::Invalid(Invalid::field(format!("{prefix}{}", e.field), e.reason))
    })?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(e: ChatError) -> String {
        match e {
            ChatError::Invalid(m) => m.to_string(),
            other => panic!("not a validation error: {other:?}"),
        }
    }

    #[test]
    fn each_part_is_checked_and_the_error_names_its_field() {
        let blank = UserText::new("content", " \n").expect_err("blank");
        assert_eq!(message(blank), "content: must not be empty");
        let nul = UserText::new("content", "a\0b").expect_err("nul");
        assert_eq!(message(nul), "content: must not contain NUL characters");
        let long = "x".repeat(MAX_CONTENT_BYTES + 1);
        assert!(message(UserText::new("content", &long).expect_err("long")).contains("longer"));
        assert_eq!(UserText::new("content", "hi").expect("ok").as_str(), "hi");

        let hot = SamplingParams {
            temperature: -1.0,
            ..SamplingParams::default()
        };
        let e = GenOptions::new(Some(hot.clone()), "params.", None, vec![], false).expect_err("t");
        assert!(message(e).starts_with("params.temperature: "));
        let e = GenOptions::new(Some(hot), "", None, vec![], false).expect_err("t");
        assert!(message(e).starts_with("temperature: "));
        let e = GenOptions::new(None, "", None, vec![String::new()], false).expect_err("stop");
        assert_eq!(
            message(e),
            "stop: each stop string must be 1 to 256 characters"
        );
        let many = vec!["s".to_string(); MAX_STOPS + 1];
        let e = GenOptions::new(None, "", None, many, false).expect_err("stops");
        assert_eq!(message(e), "stop: at most 16 stop strings");
    }

    #[test]
    fn a_system_prefix_goes_first_in_the_system_prompt_or_starts_one() {
        let with = Conversation::new(vec![
            (ChatRole::System, "be brief".into()),
            (ChatRole::User, "hi".into()),
        ])
        .expect("ok")
        .with_system_prefix("tools".into())
        .into_messages();
        assert_eq!(with[0].content, "tools\n\nbe brief");
        let without = Conversation::new(vec![(ChatRole::User, "hi".into())])
            .expect("ok")
            .with_system_prefix("tools".into())
            .into_messages();
        assert_eq!(
            (without[0].role, without[0].content.as_str()),
            (ChatRole::System, "tools")
        );
        assert_eq!(without.len(), 2);
    }

    #[test]
    fn a_conversation_needs_a_message_and_joins_leading_system_messages() {
        let e = Conversation::new(vec![]).expect_err("empty");
        assert_eq!(message(e), "messages: must not be empty");
        let e = Conversation::new(vec![
            (ChatRole::User, "hi".into()),
            (ChatRole::Assistant, "a\0".into()),
        ])
        .expect_err("nul");
        assert_eq!(
            message(e),
            "messages[1].content: must not contain NUL characters"
        );
        let c = Conversation::new(vec![
            (ChatRole::System, "be brief".into()),
            (ChatRole::System, "be kind".into()),
            (ChatRole::User, String::new()),
        ])
        .expect("ok")
        .into_messages();
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].content, "be brief\n\nbe kind");
        assert_eq!(c[1].role, ChatRole::User);
    }
}
