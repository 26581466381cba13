//! Rows as the rest of the orchestrator sees them, with typed ids and enums for what is stored
//! as text. The record of how a reply ended ([`Finish`], [`ReplyUsage`], [`ReplyTimings`]) is
//! the one the live log, storage and the API share.

use serde::{Deserialize, Serialize};

pub use crate::ids::{KeyId, MessageId, SessionId, UserId};

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct User {
    pub id: UserId,
    pub name: String,
    pub created_at: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewApiKey {
    pub user_id: UserId,
    pub prefix: String,
    pub key_hash: String,
    pub requests_per_minute: Option<i64>,
    pub tokens_per_day: Option<i64>,
    pub expires_at: Option<i64>,
    pub role: KeyRole,
}

/// What a key may do beyond its user's own sessions and requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KeyRole {
    /// Its user's sessions and requests only.
    #[default]
    User,
    /// Also what every tenant shares: the admin API (loading and unloading models), and a
    /// `keep_alive` that may shorten a model's stay or unload it.
    Admin,
}

impl KeyRole {
    pub fn is_admin(self) -> bool {
        self == Self::Admin
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKey {
    pub id: KeyId,
    pub user_id: UserId,
    pub prefix: String,
    pub key_hash: String,
    pub requests_per_minute: Option<i64>,
    pub tokens_per_day: Option<i64>,
    pub created_at: i64,
    pub expires_at: Option<i64>,
    pub revoked_at: Option<i64>,
    pub role: KeyRole,
}

/// A chat session. Timestamps are Unix milliseconds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Session {
    #[schema(value_type = String, pattern = "^[0-9a-f]{32}$")]
    pub id: SessionId,
    pub title: String,
    #[schema(required = true)]
    pub system_prompt: Option<String>,
    /// Default sampling parameters (JSON object), if the session has any.
    #[schema(value_type = Option<hearth_shared::SamplingParams>, required = true)]
    pub params: Option<serde_json::Value>,
    /// Default reply length for the session's turns, if set.
    #[schema(required = true)]
    pub max_tokens: Option<i64>,
    /// The model the session's turns need (`null`: whichever is served).
    #[schema(required = true)]
    pub model: Option<String>,
    pub created_at: i64,
    pub updated_at: i64,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct NewSession {
    pub title: String,
    pub system_prompt: Option<String>,
    pub params: Option<serde_json::Value>,
    pub max_tokens: Option<i64>,
    pub model: Option<String>,
}

/// Fields to change; `None` leaves a field as it is.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SessionPatch {
    pub title: Option<String>,
    /// `Some(None)` clears the system prompt.
    pub system_prompt: Option<Option<String>>,
    pub params: Option<Option<serde_json::Value>>,
    /// `Some(None)` clears the default reply length.
    pub max_tokens: Option<Option<i64>>,
    /// `Some(None)`: the session follows the default model.
    pub model: Option<Option<String>>,
}

/// A page of sessions: newest first, optionally matching `q` in the title, strictly older than
/// the `before` cursor (`updated_at`, `id`) of the previous page's last row.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionQuery {
    pub q: Option<String>,
    pub limit: u32,
    pub before: Option<(i64, SessionId)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    User,
    Assistant,
    /// The result of a tool call the reply before it made.
    Tool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum MessageStatus {
    Complete,
    Streaming,
    Stopped,
    Error,
}

macro_rules! text_enum {
    ($t:ty { $($v:ident => $s:literal),+ $(,)? }) => {
        impl $t {
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$v => $s),+ }
            }
            pub fn parse(s: &str) -> Option<Self> {
                match s { $($s => Some(Self::$v),)+ _ => None }
            }
        }
    };
}
/// Why a reply ended: how its generation finished (`stop`: end of turn or a stop string,
/// `length`, `context_full`, `cancelled`: stopped), `tool_calls` (the reply is calls of the
/// turn's tools), `error`, or `interrupted` (its orchestrator went away while it streamed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    Stop,
    Length,
    ContextFull,
    Cancelled,
    ToolCalls,
    Error,
    Interrupted,
}

text_enum!(Role { User => "user", Assistant => "assistant", Tool => "tool" });
text_enum!(Finish {
    Stop => "stop",
    Length => "length",
    ContextFull => "context_full",
    Cancelled => "cancelled",
    ToolCalls => "tool_calls",
    Error => "error",
    Interrupted => "interrupted",
});
text_enum!(MessageStatus {
    Complete => "complete",
    Streaming => "streaming",
    Stopped => "stopped",
    Error => "error",
});

/// A stored message. Timestamps are Unix milliseconds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Message {
    #[schema(value_type = String, pattern = "^[0-9a-f]{32}$")]
    pub id: MessageId,
    pub seq: i64,
    pub role: Role,
    pub content: String,
    pub status: MessageStatus,
    #[schema(required = true)]
    pub finish_reason: Option<Finish>,
    #[schema(required = true)]
    pub prompt_tokens: Option<i64>,
    #[schema(required = true)]
    pub cached_tokens: Option<i64>,
    #[schema(required = true)]
    pub completion_tokens: Option<i64>,
    #[schema(required = true)]
    pub ttft_ms: Option<i64>,
    #[schema(required = true)]
    pub duration_ms: Option<i64>,
    #[schema(required = true)]
    pub worker: Option<String>,
    /// The tool calls an assistant message makes (its `content` is the text the model wrote
    /// for them).
    #[schema(required = true)]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// The call a `tool` message answers.
    #[schema(required = true)]
    pub tool_call_id: Option<String>,
    pub created_at: i64,
    pub updated_at: i64,
}

/// A call a reply makes, in OpenAI's form.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ToolCall {
    /// `call_` and 24 hex digits.
    pub id: String,
    /// `function`
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCall,
}

impl ToolCall {
    /// A call of the function `name` with `arguments` (a JSON text).
    pub fn function(id: String, name: String, arguments: String) -> Self {
        Self {
            id,
            kind: "function".into(),
            function: FunctionCall { name, arguments },
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as a JSON text.
    pub arguments: String,
}

/// A tool's result to store: the call it answers and what the tool returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewToolResult {
    pub tool_call_id: String,
    pub content: String,
}

/// What `begin_turn` wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    pub user: Message,
    pub assistant: Message,
}

/// What a reply used, in tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReplyUsage {
    pub prompt_tokens: u64,
    /// Prompt tokens the worker already held in its cache.
    pub cached_tokens: u64,
    pub completion_tokens: u64,
}

/// A reply's timings, in milliseconds from the request's arrival.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReplyTimings {
    /// Until the first token (`null` when none came).
    #[schema(required = true)]
    pub ttft_ms: Option<u64>,
    pub duration_ms: u64,
}

/// A reply's final state, as stored (and, as JSON, with the last event of the reply's shared
/// stream: a replica that finds the stream ended stores this).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Completion {
    pub content: String,
    pub status: MessageStatus,
    pub finish_reason: Finish,
    pub usage: ReplyUsage,
    pub timings: ReplyTimings,
    /// The worker that finished the reply.
    pub worker: Option<String>,
    /// The calls the reply makes, when it is nothing but calls of the turn's tools.
    pub tool_calls: Option<Vec<ToolCall>>,
}

/// The right to write a streaming reply: the replica that began it holds epoch 0, and each
/// claim by another replica makes the next one. Every write of the reply names its lease and
/// holds only while the reply is still streaming at that epoch (a fencing token), so a replica
/// that lost the reply, alive after all, changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ReplyLease {
    pub message_id: MessageId,
    pub epoch: i64,
}

impl ReplyLease {
    /// The lease of a reply its replica has just begun.
    pub fn first(message_id: MessageId) -> Self {
        Self {
            message_id,
            epoch: 0,
        }
    }
}

/// A reply in `streaming` state, as the orphan sweep sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamingReply {
    pub id: MessageId,
    /// Its last write (a save or its owner's heartbeat), by whichever replica's clock: the
    /// sweep compares it only with itself.
    pub updated_at: i64,
    pub epoch: i64,
}

/// How far a streaming reply has got, saved with its text: the generated tokens whose text the
/// saved content is, and how many of the reply's events (its stream's ids) carried them. A
/// replica that takes the reply over without its Redis stream continues from here.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Checkpoint {
    pub content: String,
    pub tokens: Vec<u32>,
    pub events: u64,
}

/// What the database holds of a streaming reply for a replica that takes it over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedReply {
    pub checkpoint: Checkpoint,
    /// The job that makes the reply (see the service's takeover), once its owner saved it.
    pub job: Option<String>,
}

/// Token ids as text (stored with a checkpoint, and carried by a shared stream's events):
/// decimal, space-separated.
pub fn encode_tokens(tokens: &[u32]) -> String {
    let mut s = String::with_capacity(tokens.len() * 6);
    for (i, t) in tokens.iter().enumerate() {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(&t.to_string());
    }
    s
}

/// The token ids of [`encode_tokens`]' text; None when it is malformed.
pub fn decode_tokens(s: &str) -> Option<Vec<u32>> {
    s.split_ascii_whitespace().map(|t| t.parse().ok()).collect()
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
