//! The Gemma chat template, rendered straight to token ids.
//!
//! ```text
//! <bos><start_of_turn>user
//! {system}\n\n{first user message}<end_of_turn>
//! <start_of_turn>model
//! {reply}<end_of_turn>
//! <start_of_turn>user
//! {next message}<end_of_turn>
//! <start_of_turn>model
//! ```
//!
//! Gemma has no system role, so the system prompt is folded into the first user turn that is kept.
//! Control tokens are inserted by id and message text is tokenized with special-token parsing off,
//! so a message that *contains* the text `<end_of_turn>` cannot forge a turn boundary. Each turn is
//! tokenized on its own: a conversation's prompt for turn N+1 starts with exactly the tokens of
//! turn N's prompt followed by its reply, which is what lets the worker reuse the session's KV.

use serde::{Deserialize, Serialize};

use crate::tokenizer::{Tokenizer, TokenizerError};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::System => "system",
            Self::User => "user",
            Self::Assistant => "assistant",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    pub content: String,
}

impl Message {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("messages: the conversation must end with a user message")]
    NoUserMessage,
    #[error("messages[{index}]: a system message may only come first")]
    MisplacedSystem { index: usize },
    #[error("messages: the last user message needs {need} tokens with the system prompt, more than the {budget} the context leaves for the prompt")]
    TooLong { need: usize, budget: usize },
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// A rendered prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prompt {
    pub tokens: Vec<u32>,
    /// How many of the oldest messages were left out to fit the budget.
    pub dropped_messages: usize,
}

/// A user turn and the reply that followed it (none for the turn being answered).
#[derive(Default)]
struct Turn {
    /// `None` only when a conversation opens with an assistant message.
    user: Option<String>,
    reply: Option<String>,
}

fn append(slot: &mut Option<String>, text: &str) {
    match slot {
        // Consecutive messages of one role (some clients send them) become paragraphs of one.
        Some(s) => {
            s.push_str("\n\n");
            s.push_str(text);
        }
        None => *slot = Some(text.to_string()),
    }
}

/// Renders `messages` (an optional leading system message, then user and assistant messages,
/// ending with a user message) into at most `budget` tokens, dropping the oldest whole turns
/// first. The last user message and the system prompt are never dropped.
pub fn render(tok: &Tokenizer, messages: &[Message], budget: usize) -> Result<Prompt, ChatError> {
    let (system, rest) = match messages.split_first() {
        Some((m, rest)) if m.role == Role::System => (Some(m.content.as_str()), rest),
        _ => (None, messages),
    };
    let mut turns: Vec<Turn> = Vec::new();
    for (i, m) in rest.iter().enumerate() {
        match m.role {
            Role::System => {
                return Err(ChatError::MisplacedSystem {
                    index: i + usize::from(system.is_some()),
                })
            }
            Role::User => match turns.last_mut() {
                Some(t) if t.reply.is_none() && t.user.is_some() => append(&mut t.user, &m.content),
                _ => turns.push(Turn {
                    user: Some(m.content.clone()),
                    reply: None,
                }),
            },
            Role::Assistant => match turns.last_mut() {
                Some(t) => append(&mut t.reply, &m.content),
                None => turns.push(Turn {
                    user: None,
                    reply: Some(m.content.clone()),
                }),
            },
        }
    }
    if rest.last().map(|m| m.role) != Some(Role::User) {
        return Err(ChatError::NoUserMessage);
    }
    // Tokenize each turn once, newest first, and stop once the newer turns alone fill the
    // budget: every older turn would be dropped anyway, so a long history costs only what fits.
    let mut encoded: Vec<Vec<u32>> = vec![Vec::new(); turns.len()];
    let mut oldest_encoded = turns.len();
    let mut newer_len = 0usize;
    while oldest_encoded > 0 && newer_len < budget {
        oldest_encoded -= 1;
        let e = encode_turn(tok, &turns[oldest_encoded])?;
        newer_len += e.len();
        encoded[oldest_encoded] = e;
    }
    let system_tokens = match system {
        Some(s) if !s.is_empty() => tok.encode(&format!("{s}\n\n"))?,
        _ => Vec::new(),
    };
    let user_head = 1 + tok.encode("user\n")?.len();
    // Where the system prompt goes: after "<start_of_turn>user\n" of the first kept turn, or, if
    // that turn has no user part, in a user turn of its own.
    let system_cost = |first: usize| match (system_tokens.is_empty(), turns[first].user.is_some()) {
        (true, _) => 0,
        (false, true) => system_tokens.len(),
        (false, false) => user_head + system_tokens.len() + 1,
    };
    let mut first = oldest_encoded;
    let mut turns_len: usize = newer_len;
    let total = |first: usize, turns_len: usize| 1 + system_cost(first) + turns_len;
    while total(first, turns_len) > budget && first + 1 < encoded.len() {
        turns_len -= encoded[first].len();
        first += 1;
    }
    let need = total(first, turns_len);
    if need > budget {
        return Err(ChatError::TooLong { need, budget });
    }
    let mut tokens = Vec::with_capacity(need);
    tokens.push(tok.bos_id);
    for (i, turn) in encoded[first..].iter().enumerate() {
        if i > 0 || system_tokens.is_empty() {
            tokens.extend_from_slice(turn);
        } else if turns[first].user.is_some() {
            tokens.extend_from_slice(&turn[..user_head]);
            tokens.extend_from_slice(&system_tokens);
            tokens.extend_from_slice(&turn[user_head..]);
        } else {
            tokens.push(tok.start_of_turn_id);
            tokens.extend(tok.encode("user\n")?);
            tokens.extend_from_slice(&system_tokens);
            tokens.push(tok.end_of_turn_id);
            tokens.extend_from_slice(turn);
        }
    }
    debug_assert_eq!(tokens.len(), need);
    let dropped_messages = turns[..first]
        .iter()
        .map(|t| usize::from(t.user.is_some()) + usize::from(t.reply.is_some()))
        .sum();
    Ok(Prompt {
        tokens,
        dropped_messages,
    })
}

/// `<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n{reply}<end_of_turn>\n`, or,
/// for the turn being answered (no reply yet), up to and including `<start_of_turn>model\n`.
fn encode_turn(tok: &Tokenizer, t: &Turn) -> Result<Vec<u32>, TokenizerError> {
    let mut out = Vec::new();
    if let Some(user) = &t.user {
        out.push(tok.start_of_turn_id);
        out.extend(tok.encode(&format!("user\n{user}"))?);
        out.push(tok.end_of_turn_id);
        out.extend(tok.encode("\n")?);
    }
    out.push(tok.start_of_turn_id);
    out.extend(tok.encode("model\n")?);
    if let Some(reply) = &t.reply {
        out.extend(tok.encode(reply)?);
        out.push(tok.end_of_turn_id);
        out.extend(tok.encode("\n")?);
    }
    Ok(out)
}
