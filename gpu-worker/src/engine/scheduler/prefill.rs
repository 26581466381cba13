//! What a step prefills: the budget beside decoding sequences (a share of their measured pass,
//! [`StepTimes`]), that budget shared between users, and the work a planned step runs.

use super::{RequestId, Scheduler};
use crate::engine::work::StepWork;
use hearth_shared::UserId;
use std::collections::{HashMap, HashSet};

#[cfg(doc)]
use crate::engine::work::StepTimes;

/// Fewest prompt tokens' work (at a prompt's start) a step with decoding sequences prefills when
/// prompts wait, so a prompt arriving beside one or two streams is not cut into tiny steps.
pub(super) const MIN_PREFILL_WITH_DECODES: usize = 32;

/// A step's prefill budget: prompt tokens, and their work in multiply-adds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PrefillBudget {
    pub tokens: usize,
    pub work: f64,
    /// The work is a whole chunk's: a prompt's next token runs even if it costs more.
    pub full: bool,
}

impl Scheduler {
    /// What this step may prefill: `prefill_chunk` tokens, and work of at most what those tokens
    /// take at a prompt's start (attention over each one's positions included), so a chunk deep
    /// in a long prompt is shorter and no step takes longer than a fresh chunk: another user's
    /// prompt that arrives meanwhile waits for no more. While sequences decode, the prompt work
    /// is what adds `prefill_share` times a decode-only pass's time (see [`StepTimes`]): a step
    /// with a prefill then takes about `1 + prefill_share` times a decode-only step, however
    /// deep in its prompt the chunk is. Until the times are known, `prefill_share` times the
    /// decoding sequences' work (at least `MIN_PREFILL_WITH_DECODES` tokens' at a prompt's
    /// start). What earlier steps could not spend adds to it (see `prefill_credit`). The
    /// sequences `held` sit this step out.
    pub(crate) fn prefill_budget(&self, held: &HashSet<RequestId>) -> PrefillBudget {
        let (tokens, share) = (self.config.prefill_chunk, self.config.prefill_share);
        let decoding: Vec<f64> = self
            .running
            .iter()
            .filter(|s| s.tokens.len() - s.kv_len == 1 && !held.contains(&s.id))
            .map(|s| self.work.decode(s.kv_len))
            .collect();
        let decode: f64 = decoding.iter().sum();
        let chunk = self.work.prefill(0, tokens);
        if decode == 0.0 || share <= 0.0 {
            return PrefillBudget {
                tokens,
                work: chunk,
                full: true,
            };
        }
        let floor = MIN_PREFILL_WITH_DECODES as f64 * self.work.shallow_token();
        let counted = || (share * decode).max(floor);
        let work = self
            .times
            .prefill_work(share, decoding.len())
            .unwrap_or_else(counted);
        let work = work + self.prefill_credit;
        PrefillBudget {
            tokens,
            work: work.min(chunk),
            full: work >= chunk,
        }
    }

    /// This step's prompt tokens for each prefilling sequence: `budget` shared max-min fairly
    /// between users, so one user's long prompts never hold back another's short one. The user
    /// with the least prompt left goes first and takes at most an equal part of what is left
    /// (tokens and work); what a user does not need goes to the next. Within a user, the oldest
    /// first. With a whole chunk's budget, some prompt always moves: one token, when even one
    /// costs more.
    pub(super) fn prefill_shares(&self, budget: PrefillBudget) -> HashMap<RequestId, usize> {
        type Prompts = Vec<(RequestId, usize, usize)>;
        let mut users: Vec<(&UserId, usize, Prompts)> = Vec::new();
        for s in self.running.iter() {
            let pending = s.tokens.len() - s.kv_len;
            if pending <= 1 {
                continue;
            }
            let prompt = (s.id, s.kv_len, pending);
            match users.iter_mut().find(|(u, ..)| *u == &s.user) {
                Some((_, total, prompts)) => {
                    *total += pending;
                    prompts.push(prompt);
                }
                None => users.push((&s.user, pending, vec![prompt])),
            }
        }
        // Stable: equal needs keep the order of their oldest sequences.
        users.sort_by_key(|(_, total, _)| *total);
        let first = users.first().and_then(|(_, _, p)| p.first()).map(|p| p.0);
        let (mut tokens_left, mut work_left, count) = (budget.tokens, budget.work, users.len());
        let mut shares = HashMap::new();
        for (k, (_, _, prompts)) in users.into_iter().enumerate() {
            let mut tokens = tokens_left.div_ceil(count - k);
            let mut work = work_left / (count - k) as f64;
            for (id, from, pending) in prompts {
                let n = self.work.tokens_within(from, pending.min(tokens), work);
                let cost = self.work.prefill(from, n);
                (tokens, work) = (tokens - n, work - cost);
                (tokens_left, work_left) = (tokens_left - n, work_left - cost);
                shares.insert(id, n);
            }
        }
        if let Some(id) = first.filter(|_| budget.full && shares.values().all(|&n| n == 0)) {
            shares.insert(id, 1);
        }
        shares
    }

    /// The decoding and prompt work of the plan (`order`: each planned sequence's index in
    /// `running`).
    pub(super) fn step_work(&self, plan: &[(RequestId, usize)], order: &[usize]) -> StepWork {
        let mut work = StepWork::default();
        for (s, n) in order
            .iter()
            .zip(plan)
            .map(|(&i, &(_, n))| (&self.running[i], n))
        {
            match s.draft == 0 && s.tokens.len() - s.kv_len > 1 {
                true => work.prefill += self.work.prefill(s.kv_len, n),
                false => work.decoding += 1,
            }
        }
        work
    }
}
