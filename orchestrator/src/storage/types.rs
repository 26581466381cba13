//! Rows as the rest of the orchestrator sees them.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct User {
    pub id: String,
    pub name: String,
    pub created_at: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewApiKey {
    pub user_id: String,
    pub prefix: String,
    pub key_hash: String,
    pub requests_per_minute: Option<i64>,
    pub tokens_per_day: Option<i64>,
    pub expires_at: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKey {
    pub id: String,
    pub user_id: String,
    pub prefix: String,
    pub key_hash: String,
    pub requests_per_minute: Option<i64>,
    pub tokens_per_day: Option<i64>,
    pub created_at: i64,
    pub expires_at: Option<i64>,
    pub revoked_at: Option<i64>,
}

/// A chat session. Timestamps are Unix milliseconds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Session {
    #[schema(pattern = "^[0-9a-f]{32}$")]
    pub id: String,
    pub title: String,
    #[schema(required = true)]
    pub system_prompt: Option<String>,
    /// Default sampling parameters (JSON object), if the session has any.
    #[schema(value_type = Option<hearth_shared::SamplingParams>, required = true)]
    pub params: Option<serde_json::Value>,
    /// Default reply length for the session's turns, if set.
    #[schema(required = true)]
    pub max_tokens: Option<i64>,
    pub created_at: i64,
    pub updated_at: i64,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct NewSession {
    pub title: String,
    pub system_prompt: Option<String>,
    pub params: Option<serde_json::Value>,
    pub max_tokens: Option<i64>,
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
}

/// A page of sessions: newest first, optionally matching `q` in the title, strictly older than
/// the `before` cursor (`updated_at`, `id`) of the previous page's last row.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionQuery {
    pub q: Option<String>,
    pub limit: u32,
    pub before: Option<(i64, String)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    User,
    Assistant,
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
text_enum!(Role { User => "user", Assistant => "assistant" });
text_enum!(MessageStatus {
    Complete => "complete",
    Streaming => "streaming",
    Stopped => "stopped",
    Error => "error",
});

/// A stored message. Timestamps are Unix milliseconds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Message {
    #[schema(pattern = "^[0-9a-f]{32}$")]
    pub id: String,
    pub seq: i64,
    pub role: Role,
    pub content: String,
    pub status: MessageStatus,
    #[schema(required = true)]
    pub finish_reason: Option<String>,
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
    pub created_at: i64,
    pub updated_at: i64,
}

/// What `begin_turn` wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    pub user: Message,
    pub assistant: Message,
}

/// A reply's final state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    pub content: String,
    pub status: MessageStatus,
    pub finish_reason: Option<String>,
    pub prompt_tokens: Option<i64>,
    pub cached_tokens: Option<i64>,
    pub completion_tokens: Option<i64>,
    pub ttft_ms: Option<i64>,
    pub duration_ms: Option<i64>,
    pub worker: Option<String>,
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
