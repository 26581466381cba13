//! What a request sends the worker, fitted: the prompt rendered and cut to the model's context,
//! the reply's length, DRY's breakers, and grammars compiled within a budget.

use crate::invalid::Invalid;
use std::sync::Arc;
use std::time::Duration;

use hearth_shared::chat::{render, ChatError as TemplateError, Message as ChatMessage};
use hearth_shared::SamplingParams;

use tokio::time::Instant;

use super::{Caller, ChatError, ChatService, GenOptions, ModelTokenizer, Target};
use crate::generate::{GenRequest, Output, Owner, Placement, Prompt, Sampling, Stopping};
use crate::limits::Budget;
use crate::workers::Lease;

/// Largest default reply length a session may store when no worker has reported its context yet.
const MAX_SESSION_MAX_TOKENS: u32 = 1 << 20;

impl ChatService {
    /// The tokens that end a DRY run for `params` (none when DRY is off).
    pub(super) async fn dry_breakers(
        &self,
        params: &SamplingParams,
        tokenizer: &ModelTokenizer,
    ) -> Result<Arc<[u32]>, ChatError> {
        if !params.dry_enabled() || params.dry_sequence_breakers.is_empty() {
            return Ok(Arc::from([]));
        }
        let (tok, wanted) = (tokenizer.clone(), params.dry_sequence_breakers.clone());
        let cache = self.breakers.clone();
        tokio::task::spawn_blocking(move || cache.ids(&tok, &wanted))
            .await
            .map_err(|e| ChatError::Internal(format!("resolving DRY breakers failed: {e}")))
    }

    /// The prompt for `convo` on `target` (with how many leading tokens are an operator's
    /// shared prompt, see [`SharedPrompts`]) and the number of tokens to generate: the oldest
    /// whole turns are dropped until the prompt leaves room for the reply. Tokenizing runs on
    /// the blocking pool, so a long history never holds up the runtime's other requests (or
    /// its health checks).
    #[tracing::instrument(name = "template", skip_all)]
    pub(super) async fn plan(
        &self,
        convo: Vec<ChatMessage>,
        max_tokens: Option<u32>,
        target: &Target,
    ) -> Result<Planned, ChatError> {
        let ctx = target
            .context_length()
            .ok_or_else(|| ChatError::Unavailable("no worker is ready".into()))?;
        // The server's default shrinks to fit a small model; an explicit value must fit as asked.
        let want = max_tokens.unwrap_or_else(|| self.limits.default_max_tokens.min(ctx as u32 / 2));
        check_max_tokens(want, target)?;
        let reserve = (want as usize).min(ctx / 2);
        let tokenizer = self.tokenizer(target);
        let default = self.tokenizers.is_default(&tokenizer);
        let tok = tokenizer.tok.clone();
        let rendered = tokio::task::spawn_blocking(move || render(&tok, &convo, ctx - reserve))
            .await
            .map_err(|e| ChatError::Internal(format!("prompt rendering failed: {e}")))?;
        let prompt = rendered.map_err(|e| match e {
            TemplateError::Tokenizer(e) => ChatError::Internal(e.to_string()),
            other => ChatError::Invalid(Invalid::request(other.to_string())),
        })?;
        let room = (ctx - prompt.tokens.len()) as u32;
        // Shared prompts are rendered with the default tokenizer: a model with its own shares
        // none.
        let leading = default.then(|| self.shared_prompts.leading(&prompt.tokens));
        let shared = match leading.flatten() {
            Some((name, n)) => {
                tracing::debug!(
                    shared_prompt = name,
                    tokens = n,
                    "prompt begins with a shared prompt"
                );
                n as u32
            }
            None => 0,
        };
        Ok(Planned {
            prompt: Prompt {
                tokens: prompt.tokens,
                shared_prefix: shared,
            },
            max_new_tokens: want.min(room),
            model: target.key().cloned(),
            tokenizer,
        })
    }

    /// The generation request for `plan`, sampled with `params`, as `opts` asks: built once,
    /// for every worker the reply goes to.
    pub(super) async fn gen_request(
        &self,
        plan: &Planned,
        opts: &GenOptions,
        params: SamplingParams,
    ) -> Result<GenRequest, ChatError> {
        let dry_breakers = self.dry_breakers(&params, &plan.tokenizer).await?;
        Ok(GenRequest {
            prompt: plan.prompt.clone(),
            sampling: Sampling {
                params,
                dry_breakers,
                logprobs: opts.logprobs(),
            },
            stopping: Stopping {
                max_new_tokens: plan.max_new_tokens,
                stop: opts.stop().to_vec(),
                ignore_eos: opts.ignore_eos(),
            },
            output: Output {
                grammar: opts.grammar().cloned(),
                tools: opts.tools().cloned(),
            },
        })
    }

    /// Where `caller`'s generation of `plan` runs: on `plan`'s model, on the worker `lease`
    /// holds if one was chosen.
    pub(super) fn placement(
        &self,
        caller: &Caller,
        plan: &Planned,
        opts: &GenOptions,
        lease: Option<Lease>,
    ) -> Placement {
        Placement {
            model: plan.model.clone(),
            tokenizer: plan.tokenizer.tok.clone(),
            keep_alive: self.keep_alive(caller, opts.keep_alive_ms()),
            lease,
        }
    }
}

/// Whose generation it is: `caller`'s, for the end user `opts` names, charged `budget`.
pub(super) fn owner(
    caller: &Caller,
    opts: &GenOptions,
    arrived: Instant,
    budget: Option<Budget>,
) -> Owner {
    Owner {
        user_id: caller.user.id.clone(),
        end_user: opts.end_user().map(str::to_string),
        arrived,
        budget,
    }
}

pub(super) fn check_max_tokens(n: u32, target: &Target) -> Result<u32, ChatError> {
    let ctx = target.context_length();
    let limit = ctx.map_or(MAX_SESSION_MAX_TOKENS, |ctx| {
        u32::try_from(ctx).unwrap_or(u32::MAX).saturating_sub(1)
    });
    if n == 0 || n > limit {
        let why = ctx.map_or_else(String::new, |ctx| {
            format!(" (the model's context is {ctx} tokens)")
        });
        return Err(ChatError::Invalid(Invalid::field(
            "max_tokens",
            format!("must be between 1 and {limit}{why}"),
        )));
    }
    Ok(n)
}

/// Longest the grammars of one request may take to compile.
const GRAMMAR_COMPILE_BUDGET: Duration = Duration::from_secs(10);

/// Compiles every grammar `opts` brings (see [`GenOptions::to_compile`]) on the blocking pool,
/// a few requests at a time (half the cores), within [`GRAMMAR_COMPILE_BUDGET`]: a tenant's
/// huge grammars cost its own requests' time, not the async threads every request shares nor
/// all the cores. A compile past its budget keeps its place until it really ends. Called once
/// the request is charged.
pub(super) async fn compile_grammars(opts: &GenOptions) -> Result<(), ChatError> {
    static COMPILING: std::sync::OnceLock<Arc<tokio::sync::Semaphore>> = std::sync::OnceLock::new();
    let pending = opts.to_compile();
    if pending.is_empty() {
        return Ok(());
    }
    let slots = COMPILING.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(2, usize::from);
        Arc::new(tokio::sync::Semaphore::new((cores / 2).max(1)))
    });
    let slot = slots
        .clone()
        .acquire_owned()
        .await
        .map_err(|e| ChatError::Internal(format!("the grammar compiler: {e}")))?;
    let work = tokio::task::spawn_blocking(move || {
        let _slot = slot;
        pending
            .iter()
            .try_for_each(|(field, g)| g.check().map_err(|e| Invalid::field(field, e.to_string())))
    });
    match tokio::time::timeout(GRAMMAR_COMPILE_BUDGET, work).await {
        Ok(Ok(Ok(()))) => Ok(()),
        Ok(Ok(Err(why))) => Err(ChatError::InvalidGrammar(why)),
        Ok(Err(e)) => Err(ChatError::Internal(format!(
            "a grammar's compile failed: {e}"
        ))),
        Err(_) => Err(ChatError::InvalidGrammar(Invalid::request(format!(
            "the request's grammars take longer than {} s to compile; send simpler ones",
            GRAMMAR_COMPILE_BUDGET.as_secs()
        )))),
    }
}

/// A prompt ready for a worker.
pub(super) struct Planned {
    pub(super) prompt: Prompt,
    pub(super) max_new_tokens: u32,
    /// The exact version every worker of it must serve.
    pub(super) model: Option<crate::workers::ModelKey>,
    /// That model's tokenizer.
    pub(super) tokenizer: ModelTokenizer,
}
