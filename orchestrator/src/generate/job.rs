//! One generation's request, as the generator runs it: built once by the chat service from a
//! validated request and its planned prompt, then read, never rebuilt, by every attempt, by the
//! record another replica takes the reply over with, and by the reply's end.

use std::sync::Arc;

use hearth_shared::tokenizer::Tokenizer;
use hearth_shared::{Grammar, SamplingParams};
use tokio::time::Instant;

use crate::ids::{MessageId, SessionId, UserId};
use crate::limits::Budget;
use crate::storage::ReplyLease;
use crate::tools::Tools;
use crate::workers::{Lease, ModelKey};

/// A generation: what to generate, for whom, where, and where its reply is kept.
#[derive(Debug)]
pub struct Job {
    pub request: GenRequest,
    pub owner: Owner,
    pub placement: Placement,
    /// Where the reply is kept, if anywhere.
    pub persistence: Persistence,
}

/// What to generate, as every worker the reply goes to is asked for it.
#[derive(Debug, Clone)]
pub struct GenRequest {
    pub prompt: Prompt,
    pub sampling: Sampling,
    pub stopping: Stopping,
    pub output: Output,
}

/// The prompt's tokens, template applied.
#[derive(Debug, Clone, Default)]
pub struct Prompt {
    pub tokens: Vec<u32>,
    /// Leading tokens that are an operator's shared system prompt, whose prefix cache every
    /// user shares (see [`crate::service::SharedPrompts`]); 0 for none.
    pub shared_prefix: u32,
}

/// How each token is picked, and what is reported with it.
#[derive(Debug, Clone)]
pub struct Sampling {
    pub params: SamplingParams,
    /// Tokens that end a DRY run (`params.dry_sequence_breakers` as token ids).
    pub dry_breakers: Arc<[u32]>,
    /// Each token's log-probability as [`super::RunEvent::Logprobs`], with this many
    /// alternatives.
    pub logprobs: Option<u32>,
}

/// When the reply ends.
#[derive(Debug, Clone)]
pub struct Stopping {
    pub max_new_tokens: u32,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
}

/// What shape the reply takes.
#[derive(Debug, Clone, Default)]
pub struct Output {
    /// The grammar the reply follows (constrained decoding), checked already.
    pub grammar: Option<Grammar>,
    /// The tools offered: a reply that stops and is nothing but calls of them ends as
    /// `tool_calls`.
    pub tools: Option<Arc<Tools>>,
}

/// Whose generation it is: the fair queue's two levels, and what it is charged.
#[derive(Debug)]
pub struct Owner {
    pub user_id: UserId,
    /// The end user the client named (OpenAI's `user`): the fair queue's second level.
    pub end_user: Option<String>,
    /// When the HTTP request arrived (TTFT is measured from here).
    pub arrived: Instant,
    /// The tokens set aside for the reply from its key's daily budget.
    pub budget: Option<Budget>,
}

/// Where the generation runs.
#[derive(Debug)]
pub struct Placement {
    /// The exact version every worker of the reply must serve (a failover's continuation
    /// too); none while no worker has reported its model.
    pub model: Option<ModelKey>,
    /// That model's tokenizer, which reads the worker's tokens.
    pub tokenizer: Arc<Tokenizer>,
    /// How long the model stays loaded once idle, from this request on.
    pub keep_alive: Option<KeepAlive>,
    /// The worker already chosen at admission.
    pub lease: Option<Lease>,
}

/// A request's `keep_alive`, as its worker takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeepAlive {
    /// How long the model stays loaded once idle, in milliseconds; negative: for good.
    pub ms: i64,
    /// An operator's request: it may shorten the model's stay, or unload it. Any other only
    /// lengthens it (the worker ignores a shorter value): the model is every tenant's.
    pub may_shorten: bool,
}

/// Whether a generation belongs to a stored session or to no one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Persistence {
    /// A native turn: the worker keeps `session_id`'s KV cache between turns, and the reply is
    /// saved to its stored assistant message as it streams and when it ends, under `lease`.
    Stored {
        session_id: SessionId,
        lease: ReplyLease,
        /// What another replica needs to take the reply over (the service's `JobRecord`, as
        /// JSON), saved with the reply; None when it is saved already (a reply taken over).
        record: Option<String>,
    },
    /// An OpenAI request: nothing is stored, and the worker caches by prefix only.
    Stateless,
}

impl Persistence {
    pub(crate) fn session_id(&self) -> Option<&SessionId> {
        match self {
            Self::Stored { session_id, .. } => Some(session_id),
            Self::Stateless => None,
        }
    }

    pub(crate) fn message_id(&self) -> Option<&MessageId> {
        self.lease().map(|l| &l.message_id)
    }

    pub(super) fn record(&self) -> Option<String> {
        match self {
            Self::Stored { record, .. } => record.clone(),
            Self::Stateless => None,
        }
    }

    pub(crate) fn lease(&self) -> Option<&ReplyLease> {
        match self {
            Self::Stored { lease, .. } => Some(lease),
            Self::Stateless => None,
        }
    }
}
