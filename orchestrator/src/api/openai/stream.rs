//! A chat completion streamed as OpenAI's chunks: one stream per choice, merged, each chunk
//! shaped for the chat or the legacy completions API.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::Event;
use axum::response::Response;
use serde_json::{json, Value};
use tokio_stream::StreamExt;

use super::chat::*;
use super::chunk::{data, error, Chunk, ChunkChoice, Delta};
use super::wire::*;
use crate::api::native::sse;
use crate::api::ApiError;
use crate::generate::{Live, OpenAiFinish, Outcome, RunEvent, TokenLogprob};
use crate::service::{Caller, ChatError, ChatService, Conversation, Target, ValidTurn};
use crate::tools::{HeldText, ToolCall, Tools};

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
    pub(super) fn echoed_len(&self) -> usize {
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
    pub(super) fn choice(
        &self,
        index: usize,
        text: Option<&str>,
        finish_reason: Option<OpenAiFinish>,
        logprobs: Value,
    ) -> ChunkChoice {
        match self {
            Self::Chat { .. } => {
                let delta = match (text, finish_reason) {
                    (Some(t), _) => Delta::text(t),
                    (None, None) => Delta::opening(),
                    (None, Some(_)) => Delta::default(),
                };
                ChunkChoice::Chat {
                    index,
                    delta,
                    logprobs,
                    finish_reason,
                }
            }
            Self::Text { .. } => ChunkChoice::Text {
                index,
                text: text.unwrap_or("").to_string(),
                logprobs,
                finish_reason,
            },
        }
    }

    /// The tools whose calls a streamed reply may be: its text is held back while it may
    /// still become one.
    fn tools(&self) -> Option<Arc<Tools>> {
        match self {
            Self::Chat { tools } => tools.clone(),
            Self::Text { .. } => None,
        }
    }

    /// A chunk's choice that carries a reply's calls.
    fn calls_choice(index: usize, calls: &[ToolCall], logprobs: Value) -> ChunkChoice {
        ChunkChoice::Chat {
            index,
            delta: Delta::calls(calls),
            logprobs,
            finish_reason: None,
        }
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
/// (legacy `text_offset`), and its text held back while it may still become tool calls.
struct ChoiceStream {
    index: usize,
    pending: Vec<TokenLogprob>,
    offset: usize,
    held: HeldText,
}

impl ChoiceStream {
    pub(super) fn new(index: usize, shape: &Shape) -> Self {
        Self {
            index,
            pending: Vec::new(),
            offset: shape.echoed_len(),
            held: HeldText::new(shape.tools()),
        }
    }

    /// The log-probabilities gathered since the last chunk, in `shape`'s form (null without
    /// `logprobs`).
    pub(super) fn logprobs(&mut self, shape: &Shape, logprobs: bool) -> Value {
        if logprobs {
            shape.logprobs(std::mem::take(&mut self.pending), &mut self.offset)
        } else {
            Value::Null
        }
    }

    /// The choice to send for new text, if any (none while it is held back).
    pub(super) fn text(&mut self, shape: &Shape, logprobs: bool, t: String) -> Option<ChunkChoice> {
        let t = self.held.pass(t)?;
        let lp = self.logprobs(shape, logprobs);
        Some(shape.choice(self.index, Some(&t), None, lp))
    }

    /// The choices that end it: the held text as the reply's calls or as content, what
    /// log-probabilities are left, and the finish.
    pub(super) fn end(
        &mut self,
        shape: &Shape,
        o: &Outcome,
        logprobs: bool,
        reason: OpenAiFinish,
    ) -> Vec<ChunkChoice> {
        let i = self.index;
        let text = self.held.take();
        // Held all along (else the text went out as words): the reply is its calls, if any.
        if let Some(calls) = o.tool_calls.as_ref().filter(|_| text.is_some()) {
            let lp = self.logprobs(shape, logprobs);
            return vec![
                Shape::calls_choice(i, calls, lp),
                shape.choice(i, None, Some(OpenAiFinish::ToolCalls), Value::Null),
            ];
        }
        let mut out = Vec::new();
        if let Some(t) = text.filter(|t| !t.is_empty()) {
            let lp = self.logprobs(shape, logprobs);
            out.push(shape.choice(i, Some(&t), None, lp));
        }
        if logprobs && !self.pending.is_empty() {
            // Tokens whose text the stop matcher held back or cut.
            let lp = self.logprobs(shape, logprobs);
            out.push(shape.choice(i, Some(""), None, lp));
        }
        out.push(shape.choice(i, None, Some(reason), Value::Null));
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

/// A chunk of `head`'s completion in `shape`'s form.
fn chunk_of<'a>(
    head: &'a Head,
    shape: &Shape,
    choices: Vec<ChunkChoice>,
    usage: Option<Usage>,
) -> Chunk<'a> {
    Chunk {
        id: &head.id,
        object: shape.object(),
        created: head.created,
        model: &head.model,
        choices,
        usage,
    }
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
        let chunk = |choices, usage| chunk_of(&head, &shape, choices, usage);
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
                    Shape::Chat { .. } => {
                        yield data(&chunk(vec![shape.choice(i, None, None, Value::Null)], None));
                    }
                    Shape::Text { echo: Some(p) } => {
                        yield data(&chunk(vec![shape.choice(i, Some(p), None, Value::Null)], None));
                    }
                    Shape::Text { echo: None } => {}
                },
                RunEvent::Logprobs(l) => choices[i].pending.extend(l),
                RunEvent::Text(t) => {
                    if let Some(c) = choices[i].text(&shape, logprobs, t) {
                        yield data(&chunk(vec![c], None));
                    }
                }
                RunEvent::End(o) => match o.end.openai_finish_reason() {
                    Err(e) => {
                        yield data(&error(e));
                        break;
                    }
                    Ok(reason) => {
                        for c in choices[i].end(&shape, &o, logprobs, reason) {
                            yield data(&chunk(vec![c], None));
                        }
                        outcomes.push(*o);
                    }
                },
            }
        }
        if include_usage && outcomes.len() == lives.len() {
            yield data(&chunk(Vec::new(), Some(Usage::of(&outcomes))));
        }
        yield Ok::<Event, Infallible>(Event::default().data("[DONE]"));
    }
}

/// A generation that stops when its answer is dropped (its client went away).
pub(in crate::api) struct StopOnDrop(pub(in crate::api) Arc<Live>);

impl StopOnDrop {
    /// Starts `turn`'s one stateless generation on `target` (the APIs that answer one choice).
    pub(in crate::api) async fn start(
        chat: &ChatService,
        caller: &Caller,
        turn: ValidTurn<Conversation>,
        target: &Target,
    ) -> Result<Self, ChatError> {
        let started = chat
            .complete(caller, turn, target, 1)
            .await?
            .into_iter()
            .next();
        started
            .map(Self)
            .ok_or_else(|| ChatError::Internal("no generation started".into()))
    }

    /// How the generation ended, once it has.
    pub(in crate::api) async fn outcome(&self) -> Result<Outcome, ApiError> {
        self.0
            .outcome()
            .await
            .ok_or_else(|| ApiError::Internal("the generation ended without an outcome".into()))
    }
}

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if !self.0.is_finished() {
            self.0.stop();
        }
    }
}
