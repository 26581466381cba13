//! Requests, their validated form, events and configuration.

use std::time::Instant;

use std::sync::Arc;

use hearth_shared::{FinishReason, Grammar, RequestId, SamplingParams, SessionId, UserId};

use super::constraint::{Constraint, Grammars};

use super::{EngineError, ModelInfo};
use crate::kv::KvDtype;

/// Engine tuning; the worker binary fills it from flags.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Bytes of KV memory (K and V, all layers); divided into blocks of `block_size` tokens.
    pub kv_budget_bytes: usize,
    pub block_size: usize,
    /// Most sequences decoded in one step.
    pub max_batch: usize,
    /// Most requests waiting for admission; more get `QueueFull`.
    pub max_waiting: usize,
    /// Prompt tokens prefilled per step across all sequences, so decoding sequences keep streaming
    /// while a long prompt is processed.
    pub prefill_chunk: usize,
    /// While sequences decode, a step prefills the prompt work (multiply-adds, attention
    /// included) that adds at most this many times a decode-only step's measured time (until
    /// measured, this many times their work, at least 32 tokens' at a prompt's start; at most
    /// `prefill_chunk` tokens), so their replies keep streaming while a long prompt is prefilled
    /// over several steps. 0: `prefill_chunk` in every step.
    pub prefill_share: f64,
    /// Capacity of the command channel to the engine thread.
    pub command_queue: usize,
    /// Element type of stored K/V.
    pub kv_dtype: KvDtype,
    /// Where idle sessions evicted from memory go instead of being dropped; `None`: nowhere.
    pub kv_disk: Option<DiskConfig>,
    /// Positions beyond the sliding window whose sliding-layer K/V are kept, so that rewinding a
    /// session that far (regenerating its last reply) resumes from its cache; older positions
    /// keep only their global layers (packed). `None` keeps every layer of every position.
    pub kv_window_margin: Option<usize>,
    /// Speculative decoding by prompt lookup: most draft tokens verified beside a sequence's
    /// next token in one step (see `lookup`); 0 turns it off.
    pub spec_tokens: usize,
    /// Drafts are only tried in steps with at most this many decoding sequences and no prompt
    /// being prefilled: there a step is bound by reading the weights, so verifying a few more
    /// rows is nearly free. In larger batches it is bound by arithmetic and would not pay.
    pub spec_max_batch: usize,
    /// Called on the engine thread after each step that did work (the worker records it in its
    /// metrics); `None`: nothing is told.
    pub on_step: Option<StepObserver>,
    /// The grammar engine over the model's vocabulary; `None`: requests with a grammar are
    /// refused.
    pub grammars: Option<Arc<Grammars>>,
    /// Most tokens of context to serve, below the model's own (a repository manifest's
    /// `context_length`); `None`: the model's.
    pub max_context: Option<usize>,
}

/// What a step reports: the step, how long it took, and the engine's batch limit.
pub type StepObserver = fn(&super::StepSummary, std::time::Duration, usize);

/// The disk tier's file location and size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskConfig {
    pub dir: std::path::PathBuf,
    pub bytes: u64,
}

/// Default of [`EngineConfig::kv_window_margin`]: a regenerated reply of up to this many tokens
/// (with its turn markers) resumes from the session cache.
pub const DEFAULT_WINDOW_MARGIN: usize = 512;

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kv_budget_bytes: 2 << 30,
            block_size: 16,
            max_batch: 64,
            max_waiting: 1024,
            prefill_chunk: 512,
            prefill_share: 1.0,
            command_queue: 4096,
            kv_dtype: KvDtype::default(),
            kv_disk: None,
            kv_window_margin: Some(DEFAULT_WINDOW_MARGIN),
            spec_tokens: 4,
            spec_max_batch: 2,
            on_step: None,
            grammars: None,
            max_context: None,
        }
    }
}

/// A generation request as clients send it.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub id: RequestId,
    /// Requests of one session share its cached KV between turns.
    pub session: Option<SessionId>,
    pub user: UserId,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub max_new_tokens: u32,
    /// Empty means the model's defaults (EOS and `<end_of_turn>`).
    pub stop_token_ids: Vec<u32>,
    /// Generate exactly `max_new_tokens` (unless the context fills): no default stop tokens. For
    /// benchmarks that need fixed output lengths, like vLLM's and llama.cpp's `ignore_eos`.
    pub ignore_eos: bool,
    /// Tokens of this reply sampled before (a continuation after a failover): the seeded RNG
    /// skips that many draws first, so a seed reproduces the uncut reply.
    pub sampled_before: u32,
    /// Leading prompt tokens that are an operator's shared system prompt, whose whole blocks
    /// are cached for every user (see [`crate::kv::Chain`]); 0: the prompt is the user's alone.
    pub shared_prefix: u32,
    /// Tokens that end a DRY run (see [`crate::sampling::dry_runs`]).
    pub dry_breakers: Vec<u32>,
    /// With each token, this many of the likeliest (at most [`MAX_TOP_LOGPROBS`]).
    pub top_logprobs: u32,
    /// The grammar the reply follows (constrained decoding).
    pub grammar: Option<Grammar>,
}

/// Most alternatives a token reports (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

impl GenerateRequest {
    /// A greedy request with default stop tokens; handy in tests and benchmarks.
    pub fn new(id: u64, prompt: Vec<u32>, max_new_tokens: u32) -> Self {
        Self {
            id: RequestId(id),
            session: None,
            user: UserId::from("anonymous"),
            prompt,
            params: SamplingParams::default(),
            max_new_tokens,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            sampled_before: 0,
            shared_prefix: 0,
            dry_breakers: Vec::new(),
            top_logprobs: 0,
            grammar: None,
        }
    }
}

/// A request that passed [`validate`]; the only kind the scheduler accepts.
#[derive(Debug)]
pub struct ValidRequest {
    pub(crate) inner: GenerateRequest,
    pub(crate) stop_ids: Vec<u32>,
    pub(crate) arrived: Instant,
    /// The compiled grammar, with its first mask on the way ([`ValidRequest::constrain`]).
    pub(crate) constraint: Option<Constraint>,
}

impl ValidRequest {
    /// Compiles the request's grammar, if it has one, with `grammars` (a continuation's reply
    /// so far, the prompt's last `sampled_before` tokens, is fed to it first).
    pub fn constrain(mut self, grammars: Option<&Grammars>) -> Result<Self, EngineError> {
        let Some(grammar) = &self.inner.grammar else {
            return Ok(self);
        };
        let grammars = grammars.ok_or_else(|| {
            EngineError::InvalidGrammar(
                "this worker cannot constrain replies: its model file carries no vocabulary".into(),
            )
        })?;
        let p = &self.inner.prompt;
        let reply = &p[p.len().saturating_sub(self.inner.sampled_before as usize)..];
        let user = self.inner.user.as_str();
        self.constraint = Some(grammars.start(grammar, reply, user)?);
        Ok(self)
    }
}

/// Checks a request against the model; errors name the offending field.
pub fn validate(req: GenerateRequest, info: &ModelInfo) -> Result<ValidRequest, EngineError> {
    if req.prompt.is_empty() {
        return Err(EngineError::EmptyPrompt);
    }
    if req.prompt.len() >= info.context_length {
        return Err(EngineError::PromptTooLong {
            len: req.prompt.len(),
            max: info.context_length - 1,
        });
    }
    check_token_ids(&req, info.vocab_size)?;
    req.params.validate()?;
    check_sampling_limits(&req, info.vocab_size)?;
    if req.max_new_tokens == 0 {
        return Err(EngineError::InvalidMaxNewTokens);
    }
    if req.prompt.len() + 1 > info.kv_capacity_tokens {
        return Err(EngineError::KvBudgetTooSmall {
            need: req.prompt.len() + 1,
            capacity: info.kv_capacity_tokens,
        });
    }
    let stop_ids = if req.stop_token_ids.is_empty() && !req.ignore_eos {
        info.default_stop_ids.clone()
    } else {
        req.stop_token_ids.clone()
    };
    Ok(ValidRequest {
        inner: req,
        stop_ids,
        arrived: Instant::now(),
        constraint: None,
    })
}

/// Every token id the request names (its prompt's, its stop tokens) is in the vocabulary.
fn check_token_ids(req: &GenerateRequest, vocab: usize) -> Result<(), EngineError> {
    if let Some((index, &id)) = req
        .prompt
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab)
    {
        return Err(EngineError::TokenOutOfRange { index, id, vocab });
    }
    if let Some(&id) = req.stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(EngineError::StopTokenOutOfRange { id, vocab });
    }
    Ok(())
}

/// The sampling options that depend on the model or the engine's limits: logit biases of
/// tokens in the vocabulary, and at most [`MAX_TOP_LOGPROBS`] alternatives.
fn check_sampling_limits(req: &GenerateRequest, vocab: usize) -> Result<(), EngineError> {
    if let Some(&id) = req.params.logit_bias.keys().find(|&&t| t as usize >= vocab) {
        return Err(EngineError::InvalidSampling(hearth_shared::SamplingError {
            field: "logit_bias",
            reason: format!("token {id} is not in the model's vocabulary of {}", vocab),
        }));
    }
    if req.top_logprobs > MAX_TOP_LOGPROBS {
        return Err(EngineError::InvalidSampling(hearth_shared::SamplingError {
            field: "top_logprobs",
            reason: format!("at most {MAX_TOP_LOGPROBS}, got {}", req.top_logprobs),
        }));
    }
    Ok(())
}

/// Wall-clock timings of a finished request, in milliseconds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timings {
    pub queue_ms: f64,
    pub time_to_first_token_ms: f64,
    pub total_ms: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// Admitted: `cached_tokens` prompt tokens came from the session cache.
    Started {
        cached_tokens: usize,
        queue_ms: f64,
    },
    Token {
        id: u32,
        logprob: f32,
        /// The likeliest tokens at this position with their log-probabilities, likeliest
        /// first, when the request asked for them.
        top: Vec<(u32, f32)>,
    },
    Finished {
        reason: FinishReason,
        prompt_tokens: usize,
        cached_tokens: usize,
        completion_tokens: usize,
        timings: Timings,
    },
    Error(EngineError),
}

/// A snapshot of the engine's load.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    /// Unreferenced blocks kept for the prefix cache (reclaimable, not counted as used).
    pub kv_blocks_cached: usize,
    pub cached_sessions: usize,
    /// Sessions held in the disk tier, and sessions brought back from it.
    pub disk_sessions: usize,
    pub disk_restores: usize,
    pub session_evictions: usize,
    pub preemptions: usize,
    pub steps: usize,
    /// Prompt tokens looked up in the KV cache at admission (each request counted once).
    pub prefix_cache_queries_tokens: usize,
    /// Of those, tokens served from cached KV instead of being prefilled.
    pub prefix_cache_hits_tokens: usize,
    /// Speculative decoding: draft tokens verified, and those accepted (emitted without a step
    /// of their own).
    pub spec_draft_tokens: usize,
    pub spec_accepted_tokens: usize,
}
