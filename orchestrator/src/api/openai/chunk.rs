//! The streamed chunks of OpenAI's chat and legacy completions APIs, as types: what a chunk holds
//! is spelled once here rather than in `json!` wherever one is sent.

use serde::Serialize;
use serde_json::Value;

use super::wire::Usage;
use crate::api::ErrorBody;
use crate::generate::OpenAiFinish;
use crate::tools::ToolCall;

/// One `chat.completion.chunk` or `text_completion` chunk.
#[derive(Debug, Serialize)]
pub(super) struct Chunk<'a> {
    pub(super) id: &'a str,
    pub(super) object: &'static str,
    pub(super) created: i64,
    pub(super) model: &'a str,
    /// One choice's news; none in the closing usage chunk.
    pub(super) choices: Vec<ChunkChoice>,
    /// With `stream_options.include_usage`, in a last chunk of its own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) usage: Option<Usage>,
}

/// A choice's news in a chunk: a chat completion's `delta`, or a legacy completion's `text`.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub(super) enum ChunkChoice {
    Chat {
        index: usize,
        delta: Delta,
        /// In the shape's form with `logprobs`, else null.
        logprobs: Value,
        finish_reason: Option<OpenAiFinish>,
    },
    Text {
        index: usize,
        text: String,
        logprobs: Value,
        finish_reason: Option<OpenAiFinish>,
    },
}

/// What a chat chunk adds to the reply: the role first, then text or the reply's calls.
#[derive(Debug, Default, Serialize)]
pub(super) struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) tool_calls: Option<Vec<CallDelta>>,
}

impl Delta {
    /// The opening delta: the assistant's role and empty text.
    pub(super) fn opening() -> Self {
        Self {
            role: Some("assistant"),
            content: Some(String::new()),
            tool_calls: None,
        }
    }

    pub(super) fn text(t: &str) -> Self {
        Self {
            content: Some(t.to_string()),
            ..Self::default()
        }
    }

    /// A reply's calls, whole, in one delta.
    pub(super) fn calls(calls: &[ToolCall]) -> Self {
        let calls = calls
            .iter()
            .enumerate()
            .map(|(index, c)| CallDelta {
                index,
                call: c.clone(),
            })
            .collect();
        Self {
            tool_calls: Some(calls),
            ..Self::default()
        }
    }
}

/// A tool call in a delta: its place in the reply's calls, and the call.
#[derive(Debug, Serialize)]
pub(super) struct CallDelta {
    pub(super) index: usize,
    #[serde(flatten)]
    pub(super) call: ToolCall,
}

/// A chunk's JSON as an event's data.
pub(super) fn data<T: Serialize>(
    chunk: &T,
) -> Result<axum::response::sse::Event, std::convert::Infallible> {
    let text = serde_json::to_string(chunk).unwrap_or_else(|e| {
        // Only a map with non-string keys fails to serialize; no chunk has one.
        tracing::error!(%e, "a chunk did not serialize");
        String::from("{}")
    });
    Ok(axum::response::sse::Event::default().data(text))
}

/// The error a stream ends with when a choice fails after it started: the body the same
/// failure gets before a stream starts.
pub(super) fn error(e: &crate::generate::GenerationError) -> ErrorBody {
    crate::api::ApiError::from(e.clone()).body()
}
