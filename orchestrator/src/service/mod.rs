//! The chat service: the one thing the HTTP handlers call. It owns the store, the worker pool,
//! the limiter, the running replies and the stop bus, all private, so every rule about them
//! (who may see a session, what is charged and when, one running reply per session, what a
//! stop or a delete does on other replicas) lives here and nowhere else.
//!
//! Requests reach it validated ([`ValidTurn`]); it answers with stored records or a running
//! reply's [`crate::generate::Live`] log, which the API turns into JSON or Server-Sent Events.
//!
//! This file holds the service's parts and what every use case shares (callers, charging);
//! each use case is a file of its own, an `impl ChatService` block with its helpers:
//! - `session`: sessions, their fields checked and stored;
//! - `native`: native turns, stored with their replies;
//! - `stateless`: the OpenAI-compatible requests, nothing stored;
//! - `models`: which model serves a request, loaded on demand;
//! - `prompt`: the prompt fitted to the model's context, and what else goes to the worker;
//! - `control`: resuming and stopping replies, and readiness;
//! - `takeover`: replies whose replica died.

mod breakers;
mod control;
mod error;
mod models;
mod native;
mod prompt;
mod responses;
mod session;
mod shared_prompt;
mod stateless;
mod takeover;
mod tokenize;
mod tokenizers;
mod turn;

pub use control::{Readiness, ReplySource, StopOutcome};
pub use error::{ChatError, LoadRefusal};
pub use models::{ModelDefaults, Target};
pub use session::{next_cursor, session_query, MessagePage, ValidPatch, ValidSession};
pub use shared_prompt::{SharedPromptText, SharedPrompts};
pub use takeover::{JobRecord, Swept};
pub use tokenize::{ToTokenize, Tokenized};
pub use tokenizers::{ModelTokenizer, Tokenizers};

pub use turn::{
    check_params, Conversation, GenOptions, NativeTurn, RawPrompt, ToolResult, UserText, ValidTurn,
    MAX_CONTENT_BYTES, MAX_TOOL_RESULTS,
};

use std::sync::Arc;

use crate::auth::{AuthError, KeyChecks};
use crate::bus::StopBus;
use crate::generate::{Generator, Leases, SharedReplies, Streams};
use crate::ids::MessageId;
use crate::limits::{Budget, Limiter, Quota};
use crate::storage::{KeyRole, Store, User};
use crate::workers::WorkerPool;

/// Server-wide limits and defaults of the chat service.
#[derive(Debug, Clone)]
pub struct ChatLimits {
    /// Reply length when a request (and its session) names none.
    pub default_max_tokens: u32,
    /// Limits for keys that have none of their own (and for the local user without auth).
    pub requests_per_minute: Option<i64>,
    pub tokens_per_day: Option<i64>,
    /// Sessions one user may keep (deleted ones do not count).
    pub max_sessions_per_user: u64,
    /// Messages one session may hold; a longer conversation continues in a new session.
    pub max_messages_per_session: usize,
    /// Bytes of text one session may hold (its messages together), checked when a turn starts.
    pub max_session_bytes: usize,
    /// Longest stay an ordinary key's `keep_alive` may give a model, in milliseconds.
    pub max_keep_alive_ms: i64,
    /// Loads on demand one ordinary key may start in an hour (admin keys: any).
    pub max_loads_per_hour: i64,
}

impl Default for ChatLimits {
    fn default() -> Self {
        Self {
            default_max_tokens: 1024,
            requests_per_minute: None,
            tokens_per_day: None,
            max_sessions_per_user: 10_000,
            max_messages_per_session: 10_000,
            max_session_bytes: 16 << 20,
            max_keep_alive_ms: 3_600_000,
            max_loads_per_hour: 20,
        }
    }
}

/// What the service is made of; [`ChatService::new`] takes them all.
#[derive(Debug)]
pub struct ServiceParts {
    pub store: Arc<dyn Store>,
    pub pool: Arc<WorkerPool>,
    /// The default tokenizer (`--tokenizer`) and the models' own ones.
    pub tokenizers: Tokenizers,
    pub limiter: Limiter,
    /// Shared with the stop bus's listener and with shutdown, which stops what still runs.
    pub streams: Arc<Streams>,
    /// Relays stops to the replica running a reply (with Redis).
    pub stop_bus: Option<StopBus>,
    pub limits: ChatLimits,
    /// Operators' system prompts whose prefix cache every user shares.
    pub shared_prompts: SharedPrompts,
    /// Native replies' events in Redis, so any replica can serve a resume (with Redis).
    pub shared_replies: Option<SharedReplies>,
}

#[derive(Debug)]
pub struct ChatService {
    store: Arc<dyn Store>,
    generator: Arc<Generator>,
    limiter: Arc<Limiter>,
    stop_bus: Option<StopBus>,
    limits: ChatLimits,
    shared_prompts: SharedPrompts,
    breakers: Arc<breakers::Breakers>,
    tokenizers: Tokenizers,
    shared_replies: Option<SharedReplies>,
    /// Replies this replica handed over as it shut down: it never claims them back.
    handed: std::sync::Mutex<std::collections::HashSet<MessageId>>,
    key_checks: KeyChecks,
    /// One gate per model being loaded on demand, so that one load serves every request
    /// waiting for it.
    loads: std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// Most choices (`n`) one request may ask for.
pub const MAX_CHOICES: u32 = 16;

/// The authenticated user of a request and the limits that apply to it.
#[derive(Debug, Clone)]
pub struct Caller {
    pub user: User,
    pub quota: Quota,
    /// [`KeyRole::Admin`] (the admin API, a `keep_alive` that shortens) for an admin key's
    /// owner, and for the local user of a server without keys (which listens on loopback only).
    pub role: KeyRole,
}

impl ChatService {
    pub fn new(p: ServiceParts) -> Self {
        Self {
            generator: Arc::new(Generator {
                pool: p.pool,
                store: p.store.clone(),
                streams: p.streams,
                savers: tokio::sync::watch::Sender::new(0),
                leases: Arc::default(),
            }),
            store: p.store,
            limiter: Arc::new(p.limiter),
            stop_bus: p.stop_bus,
            limits: p.limits,
            shared_prompts: p.shared_prompts,
            breakers: Arc::default(),
            tokenizers: p.tokenizers,
            shared_replies: p.shared_replies,
            handed: std::sync::Mutex::default(),
            key_checks: KeyChecks::default(),
            loads: std::sync::Mutex::default(),
        }
    }

    /// The leases of the replies running here, for the server's heartbeat to renew.
    pub(crate) fn leases(&self) -> Arc<Leases> {
        self.generator.leases.clone()
    }

    // --- Who is asking ---

    /// The local user of a server without keys, with the server's limits.
    pub fn local_caller(&self, user: &User) -> Caller {
        Caller {
            role: KeyRole::Admin,
            user: user.clone(),
            quota: Quota {
                bucket: user.id.to_string(),
                requests_per_minute: self.limits.requests_per_minute,
                tokens_per_day: self.limits.tokens_per_day,
            },
        }
    }

    /// The owner of an API key, with the key's limits (the server's where it has none).
    pub async fn key_caller(&self, token: &str) -> Result<Caller, ChatError> {
        match self
            .key_checks
            .authenticate(self.store.as_ref(), token)
            .await
        {
            Ok(c) => Ok(Caller {
                role: c.key.role,
                quota: Quota {
                    bucket: c.key.id.to_string(),
                    requests_per_minute: c
                        .key
                        .requests_per_minute
                        .or(self.limits.requests_per_minute),
                    tokens_per_day: c.key.tokens_per_day.or(self.limits.tokens_per_day),
                },
                user: c.user,
            }),
            Err(AuthError::InvalidKey) => Err(ChatError::InvalidKey),
            Err(AuthError::Store(e)) => Err(e.into()),
        }
    }

    /// Charges the request to the caller's rate limit and sets its reply's tokens aside from
    /// the caller's daily budget.
    async fn charge(
        &self,
        caller: &Caller,
        max_tokens: Option<u32>,
    ) -> Result<Option<Budget>, ChatError> {
        let reserve = max_tokens.unwrap_or(self.limits.default_max_tokens);
        Ok(self
            .limiter
            .admit(&caller.quota, u64::from(reserve))
            .await?)
    }
}
