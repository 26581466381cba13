//! Stateless requests (the OpenAI-compatible APIs): the whole conversation or a raw prompt
//! with each request, `n` choices from one prefill, nothing stored.

use crate::invalid::Invalid;
use std::sync::Arc;

use tracing::Instrument;

use super::prompt::{check_max_tokens, compile_grammars, owner, Planned};
use super::{
    Caller, ChatError, ChatService, Conversation, GenOptions, RawPrompt, Target, ValidTurn,
    MAX_CHOICES,
};
use crate::generate::{Generator, Job, Live, Persistence, Prompt};
use crate::limits::Budget;
use crate::workers::Tenant;
use hearth_shared::tokenizer::Tokenizer;

impl ChatService {
    /// Starts a stateless completion of a whole conversation (OpenAI's API), `n` choices of
    /// it (see [`Self::start_choices`]).
    pub async fn complete(
        &self,
        caller: &Caller,
        turn: ValidTurn<Conversation>,
        target: &Target,
        n: u32,
    ) -> Result<Vec<Arc<Live>>, ChatError> {
        let (convo, opts, arrived) = turn.into_parts();
        let max_tokens = opts.max_tokens();
        if let Some(n) = max_tokens {
            check_max_tokens(n, target)?;
        }
        let budget = self.charge_choices(caller, max_tokens, n).await?;
        compile_grammars(&opts).await?;
        let plan = self.plan(convo.into_messages(), max_tokens, target).await?;
        self.start_choices(caller, plan, opts, arrived, budget, n)
            .await
    }

    /// Starts a stateless completion of a prompt sent as it is (OpenAI's legacy completions),
    /// `n` choices of it.
    pub async fn complete_raw(
        &self,
        caller: &Caller,
        turn: ValidTurn<RawPrompt>,
        target: &Target,
        n: u32,
    ) -> Result<Vec<Arc<Live>>, ChatError> {
        let (raw, opts, arrived) = turn.into_parts();
        let ctx = target
            .context_length()
            .ok_or_else(|| ChatError::Unavailable("no worker is ready".into()))?;
        let max_tokens = opts.max_tokens();
        if let Some(n) = max_tokens {
            check_max_tokens(n, target)?;
        }
        let tokenizer = self.tokenizer(target);
        let prompt = raw_ids(&tokenizer.tok, raw)?;
        if prompt.len() >= ctx {
            return Err(ChatError::Invalid(Invalid::field(
                "prompt",
                format!(
                    "{} tokens do not fit the model's context of {ctx} (one position is \
                 needed to generate)",
                    prompt.len()
                ),
            )));
        }
        let want = max_tokens.unwrap_or(LEGACY_DEFAULT_MAX_TOKENS);
        let budget = self.charge_choices(caller, Some(want), n).await?;
        compile_grammars(&opts).await?;
        let plan = Planned {
            max_new_tokens: want.min((ctx - prompt.len()) as u32),
            prompt: Prompt {
                tokens: prompt,
                shared_prefix: 0,
            },
            model: target.key().cloned(),
            tokenizer,
        };
        self.start_choices(caller, plan, opts, arrived, budget, n)
            .await
    }

    /// Charges one request of `n` choices, each of up to `max_tokens` (else the server's
    /// default).
    async fn charge_choices(
        &self,
        caller: &Caller,
        max_tokens: Option<u32>,
        n: u32,
    ) -> Result<Option<Budget>, ChatError> {
        let n = n.clamp(1, MAX_CHOICES);
        let reserve = max_tokens.unwrap_or(self.limits.default_max_tokens);
        self.charge(caller, Some(reserve.saturating_mul(n))).await
    }

    /// Starts `n` choices of a planned prompt: nothing is stored, and the worker that likely
    /// holds the prompt's beginning is preferred. The first choice starts at once; the others
    /// once it has its first token, on the worker that holds its prompt's K/V by then (prefix
    /// affinity), so the prompt is prefilled once. A seed gives choice `i` the seed `seed + i`.
    async fn start_choices(
        &self,
        caller: &Caller,
        plan: Planned,
        opts: GenOptions,
        arrived: tokio::time::Instant,
        budget: Option<Budget>,
        n: u32,
    ) -> Result<Vec<Arc<Live>>, ChatError> {
        let n = n.clamp(1, MAX_CHOICES);
        let prompt = &plan.prompt;
        let keys = crate::workers::prefix_keys(
            &caller.user.id,
            &prompt.tokens,
            prompt.shared_prefix as usize,
        );
        let tenant = Tenant::within(&caller.user.id, opts.end_user());
        let pool = &self.generator.pool;
        let lease = pool
            .admit_prefix(&tenant, plan.model.as_ref(), &keys)
            .await?;
        let params = opts.params().cloned().unwrap_or_default();
        let request = self.gen_request(&plan, &opts, params).await?;
        let mut budgets = shares(budget, n);
        // Choice `i` is the same request with the seed `seed + i`.
        let job = |i: u32, budget: Option<Budget>| {
            let mut request = request.clone();
            let seed = &mut request.sampling.params.seed;
            *seed = seed.map(|s| s.wrapping_add(u64::from(i)));
            Job {
                request,
                owner: owner(caller, &opts, arrived, budget),
                placement: self.placement(caller, &plan, &opts, None),
                persistence: Persistence::Stateless,
            }
        };
        let first = Live::new(None);
        let mut lives = vec![first.clone()];
        let mut lead = job(0, budgets.remove(0));
        lead.placement.lease = Some(lease);
        self.generator.clone().spawn(lead, first.clone());
        for (i, budget) in (1..n).zip(budgets) {
            let live = Live::new(None);
            lives.push(live.clone());
            let (g, mut follower, user) = (self.generator.clone(), job(i, budget), tenant.clone());
            let (keys, first) = (keys.clone(), first.clone());
            let span = Generator::chat_span(&follower);
            let follow = async move {
                first.first_progress().await;
                // Failing here, the generation waits in the queue like a failover.
                let model = follower.placement.model.clone();
                follower.placement.lease =
                    g.pool.admit_prefix(&user, model.as_ref(), &keys).await.ok();
                g.run(follower, live).await;
            };
            tokio::spawn(follow.instrument(span));
        }
        Ok(lives)
    }
}

/// The caller's token budget split between `n` choices (none: none for each).
fn shares(budget: Option<Budget>, n: u32) -> Vec<Option<Budget>> {
    match budget {
        Some(b) => b.split(n as usize).into_iter().map(Some).collect(),
        None => (0..n).map(|_| None).collect(),
    }
}

/// OpenAI's default reply length on the legacy completions API.
const LEGACY_DEFAULT_MAX_TOKENS: u32 = 16;

/// A legacy completion's prompt as token ids: its text encoded after the beginning of
/// sequence, or its ids, each within the vocabulary.
fn raw_ids(tok: &Tokenizer, raw: RawPrompt) -> Result<Vec<u32>, ChatError> {
    match raw {
        RawPrompt::Text(text) => {
            let mut ids = vec![tok.bos_id];
            ids.extend(
                tok.encode(&text)
                    .map_err(|e| ChatError::Internal(e.to_string()))?,
            );
            Ok(ids)
        }
        RawPrompt::Tokens(ids) => {
            let vocab = tok.vocab_size();
            if let Some((i, id)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
                return Err(ChatError::Invalid(Invalid::field(
                    format!("prompt[{i}]"),
                    format!("token id {id} is outside the vocabulary of {vocab}"),
                )));
            }
            Ok(ids)
        }
    }
}
