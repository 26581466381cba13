//! A step's pass, once the scheduler has planned it: the batched forward pass over each planned
//! sequence's chunk, then each sequence's next token from its logit rows, under its grammar's
//! mask when it has one (waited for until a deadline), plain rows sampled in parallel on the
//! kernel pool, speculative drafts verified row by row.

use std::sync::Mutex;
use std::time::Instant;

use hearth_shared::{FinishReason, RequestId};
use llguidance::toktrie::SimpleVob;

use super::seq::Seq;
use super::Scheduler;
use crate::engine::constraint::Next;
use crate::engine::types::EngineEvent;
use crate::engine::EngineError;
use crate::kernels::SpinPool;
use crate::model::SeqChunk;
use crate::sampling::LogitSummary;

/// What one step's forward pass ran; the engine thread turns it into metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepSummary {
    /// Sequences that produced one new token from one input token.
    pub decode_seqs: usize,
    /// Sequences that ran a chunk of prompt (or recompute after preemption).
    pub prefill_seqs: usize,
    pub prefill_tokens: usize,
    /// Tokens the decoding sequences produced: one each, plus the draft tokens kept.
    pub decode_tokens: usize,
}

impl StepSummary {
    pub fn batch_size(&self) -> usize {
        self.decode_seqs + self.prefill_seqs
    }

    /// Takes back a position that runs again in a later step (its grammar's mask came late): a
    /// decoding sequence's token, or a prompt's last one.
    fn runs_again(&mut self, decoding: bool) {
        if decoding {
            self.decode_seqs -= 1;
            self.decode_tokens -= 1;
        } else {
            self.prefill_tokens -= 1;
        }
    }

    /// `decode`, `prefill`, or `mixed` when a step did both.
    pub fn phase(&self) -> &'static str {
        match (self.decode_seqs > 0, self.prefill_seqs > 0) {
            (true, true) => "mixed",
            (false, true) => "prefill",
            _ => "decode",
        }
    }
}

impl Scheduler {
    /// The forward pass over the plan (`order`: each planned sequence's index in `running`): its
    /// logits and summaries, what it ran, and each planned sequence's logit rows. On failure
    /// every running sequence fails, and the error is what it ran.
    pub(super) fn forward(
        &mut self,
        plan: &[(RequestId, usize)],
        order: &[usize],
        logits: &mut Vec<f32>,
        summaries: &mut Vec<LogitSummary>,
    ) -> Result<(StepSummary, Vec<usize>), StepSummary> {
        let bs = self.config.block_size;
        let chunks: Vec<SeqChunk<'_>> = order
            .iter()
            .zip(plan)
            .map(|(&ix, &(_, n))| {
                let s = &self.running[ix];
                let ends = s.kv_len + n == s.tokens.len();
                SeqChunk {
                    tokens: &s.tokens[s.kv_len..s.kv_len + n],
                    start_pos: s.kv_len,
                    blocks: &s.blocks,
                    packed: &s.packed,
                    logit_rows: if ends { 1 + s.draft } else { 0 },
                    summary_only: s.draft == 0 && !s.sampler.needs_row() && s.constraint.is_none(),
                }
            })
            .collect();
        let rows: Vec<usize> = chunks.iter().map(|c| c.logit_rows).collect();
        // Shared and registered blocks are immutable; only a table's own fresh blocks take writes.
        debug_assert!(chunks.iter().all(|c| {
            let (first, last) = (c.start_pos / bs, (c.start_pos + c.tokens.len() - 1) / bs);
            c.blocks[first..=last].iter().all(|&b| self.kv.writable(b))
        }));
        let mut summary = StepSummary::default();
        for c in &chunks {
            // A chunk that yields logits for each of its tokens is a decode (with its draft), or a
            // prompt's very last token.
            if c.logit_rows == c.tokens.len() {
                summary.decode_seqs += 1;
                summary.decode_tokens += 1;
            } else {
                summary.prefill_seqs += 1;
                summary.prefill_tokens += c.tokens.len();
            }
        }
        let result = self.backend.forward(&chunks, logits, summaries);
        drop(chunks);
        if let Err(e) = result {
            tracing::error!(error = %e, "forward pass failed");
            self.running.iter_mut().for_each(Seq::drop_draft);
            self.fail_running(&e.to_string());
            return Err(summary);
        }
        // Positions now in the cache; a draft's count only once it is verified.
        for (&ix, &(_, n)) in order.iter().zip(plan) {
            let s = &mut self.running[ix];
            s.kv_len += n - s.draft;
        }
        Ok((summary, rows))
    }

    /// Each planned sequence's next token from its rows: plain rows sampled in parallel (262k-wide
    /// rows), drafts verified one row after another (counting the kept tokens in `summary`).
    /// A sequence whose mask does not come in time samples in a later step instead.
    /// Returns the sequences that finished, with their reasons.
    pub(super) fn pick(
        &mut self,
        plan: &[(RequestId, usize)],
        order: &[usize],
        rows: &[usize],
        logits: &mut [f32],
        summaries: &[LogitSummary],
        summary: &mut StepSummary,
    ) -> Vec<(RequestId, Ending)> {
        let (vocab, ctx) = (self.info.vocab_size, self.info.context_length);
        let mut plain: Vec<Row<'_>> = Vec::new();
        let mut finished = Vec::new();
        let mut drafts: Vec<DraftRows<'_>> = Vec::new();
        let mut rest: &mut [f32] = logits;
        let mut rest_summaries: &[LogitSummary] = summaries;
        // A mask later than a quarter of the forward pass is not waited for (unless the step
        // runs only because of it): its sequence samples in a later step.
        let deadline = (!self.waits_for_masks).then(|| Instant::now() + self.last_forward / 4);
        for ((&ix, &r), &(_, n)) in order.iter().zip(rows).zip(plan) {
            if r == 0 {
                continue;
            }
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(r * vocab);
            rest = tail;
            let (my_summaries, tail) = rest_summaries.split_at(r.min(rest_summaries.len()));
            rest_summaries = tail;
            let s = &mut self.running[ix];
            if s.draft > 0 {
                drafts.push((ix, mine, my_summaries));
                continue;
            }
            let mask = match masked(s, deadline) {
                Masked::Free => None,
                Masked::Mask(m) => Some(m),
                Masked::Later => {
                    // Its last position runs again, the same, once the mask is there.
                    s.kv_len -= 1;
                    summary.runs_again(n == 1);
                    continue;
                }
                Masked::End(ending) => {
                    finished.push((s.id, ending));
                    continue;
                }
            };
            plain.push((ix, mine, my_summaries.first().copied(), mask));
        }
        for (ix, token, logprob, top) in sample_rows(&mut self.running, plain) {
            let s = &mut self.running[ix];
            if let Some(r) = take(s, (token, logprob, top), ctx) {
                finished.push((s.id, Ok(r)));
            }
        }
        self.verify_drafts(drafts, summary, &mut finished);
        finished
    }

    /// Verifies each drafting sequence's rows (see [`verify`]), counting the kept tokens in
    /// `summary` and the sequences that end in `finished`.
    fn verify_drafts(
        &mut self,
        drafts: Vec<DraftRows<'_>>,
        summary: &mut StepSummary,
        finished: &mut Vec<(RequestId, Ending)>,
    ) {
        let (vocab, ctx) = (self.info.vocab_size, self.info.context_length);
        let most = self.config.spec_tokens;
        for (ix, rows, summaries) in drafts {
            let (accepted, drafted, end) =
                verify(&mut self.running[ix], rows, summaries, vocab, ctx, most);
            self.spec_drafted += drafted;
            self.spec_accepted += accepted;
            summary.decode_tokens += accepted;
            if let Some(r) = end {
                finished.push((self.running[ix].id, Ok(r)));
            }
        }
    }
}

/// Sends `s` its sampled token and feeds it to its grammar; how the reply ends, if it does.
fn take(s: &mut Seq, pick: (u32, f32, Vec<(u32, f32)>), ctx: usize) -> Option<FinishReason> {
    let token = pick.0;
    let end = emit(s, pick, ctx);
    let Some(c) = s.constraint.as_mut() else {
        return end;
    };
    match end {
        None => {
            c.advance(token);
            None
        }
        // The token that used up the reply's length may be the one that completed its grammar:
        // then the reply is whole, and says so.
        Some(FinishReason::Length) => Some(if c.ends_with(token) {
            FinishReason::Stop
        } else {
            FinishReason::Length
        }),
        end => end,
    }
}

/// What a sequence's grammar says of the row it is about to sample.
enum Masked {
    /// No grammar.
    Free,
    Mask(SimpleVob),
    /// The mask did not come by the deadline.
    Later,
    /// The grammar ended the reply, or failed.
    End(Ending),
}

/// `s`'s mask for this step (computed during the forward pass), waited for until `deadline`, or
/// for as long as it takes without one.
fn masked(s: &mut Seq, deadline: Option<Instant>) -> Masked {
    let Some(c) = s.constraint.as_mut() else {
        return Masked::Free;
    };
    let next = match deadline {
        Some(d) => c.wait_for(d.saturating_duration_since(Instant::now())),
        None => Some(c.wait()),
    };
    match next {
        None => Masked::Later,
        Some(Next::Mask(m)) => Masked::Mask(m),
        Some(Next::Done) => Masked::End(Ok(FinishReason::Stop)),
        Some(Next::Failed(e)) => Masked::End(Err(EngineError::GrammarFailed(e))),
    }
}

/// A sequence's pick: its index in the batch, the token, its log-probability and its likeliest
/// alternatives (when asked for).
type Picked = (usize, u32, f32, Vec<(u32, f32)>);

/// A row to sample: the sequence's index in the batch, its logits, their summary where the
/// forward pass made one, and its grammar's mask.
type Row<'a> = (
    usize,
    &'a mut [f32],
    Option<LogitSummary>,
    Option<SimpleVob>,
);

/// A drafting sequence's rows to verify: its index in the batch, its logits and their summaries.
type DraftRows<'a> = (usize, &'a mut [f32], &'a [LogitSummary]);

/// How a sequence ends this step: finished, or failed.
pub(super) type Ending = Result<FinishReason, EngineError>;

/// Samples one token from each row, in parallel on the kernel pool (whose helpers are already
/// awake: handing this to another pool would leave a spinning helper competing for the cores).
fn sample_rows(running: &mut [Seq], rows: Vec<Row<'_>>) -> Vec<Picked> {
    let mut seqs: Vec<Option<&mut Seq>> = running.iter_mut().map(Some).collect();
    type Work<'a> = (
        usize,
        &'a mut Seq,
        &'a mut [f32],
        Option<LogitSummary>,
        Option<SimpleVob>,
    );
    let work: Vec<Mutex<Work<'_>>> = rows
        .into_iter()
        .filter_map(|(ix, row, summary, mask)| {
            seqs.get_mut(ix)
                .and_then(Option::take)
                .map(|s| Mutex::new((ix, s, row, summary, mask)))
        })
        .collect();
    let picks: Vec<Mutex<Picked>> = work
        .iter()
        .map(|_| Mutex::new((0, 0, 0.0, Vec::new())))
        .collect();
    SpinPool::global().run(work.len(), &|i| {
        if let (Ok(mut w), Ok(mut p)) = (work[i].lock(), picks[i].lock()) {
            let (ix, s, row, summary, mask) = &mut *w;
            let top = s.sampler.top_logprobs(row, *summary);
            let (t, lp) = s
                .sampler
                .sample_masked(row, &s.tokens, *summary, mask.as_ref());
            *p = (*ix, t, lp, top);
        }
    });
    picks
        .into_iter()
        .filter_map(|p| p.into_inner().ok())
        .collect()
}

/// Appends a sampled token to `s` and streams it; the reason it ends, if it does.
/// Emits a picked token: `(token, logprob, top)`, its likeliest alternatives when asked for.
fn emit(s: &mut Seq, pick: (u32, f32, Vec<(u32, f32)>), ctx: usize) -> Option<FinishReason> {
    let (token, logprob, top) = pick;
    s.tokens.push(token);
    s.generated += 1;
    if s.first_token.is_none() {
        s.first_token = Some(Instant::now());
    }
    if s.stop_ids.contains(&token) {
        return Some(FinishReason::Stop);
    }
    s.send(EngineEvent::Token {
        id: token,
        logprob,
        top,
    });
    if s.generated >= s.max_new {
        Some(FinishReason::Length)
    } else if s.tokens.len() >= ctx {
        Some(FinishReason::ContextFull)
    } else {
        None
    }
}

/// Verifies the draft at the end of `s.tokens` against `rows` (logits after its last real token
/// and after each draft token): picks each token exactly as a step of its own would have (the
/// same logits, history and sampler, one random draw per token when sampling) and keeps draft
/// tokens while they equal the pick. Every token emitted is thus drawn from the model's own
/// distribution, and a seeded reply is the same token for token with or without drafts; a draft
/// only decides whether the next row's logits, computed after the draft token, can be used. Returns the draft tokens kept,
/// those drafted, and the reason the sequence ends, if it does. Its next draft may be one token
/// longer than what it kept (at most `most`), so a sequence whose drafts keep failing risks one
/// row a step, and one whose drafts hold risks more.
fn verify(
    s: &mut Seq,
    rows: &mut [f32],
    summaries: &[LogitSummary],
    vocab: usize,
    ctx: usize,
    most: usize,
) -> (usize, usize, Option<FinishReason>) {
    let drafted = s.draft;
    let draft = s.tokens.split_off(s.tokens.len() - drafted);
    s.draft = 0;
    let mut kept = 0;
    let mut end = None;
    for (j, row) in rows.chunks_exact_mut(vocab).enumerate() {
        let summary = summaries.get(j).copied();
        let top = s.sampler.top_logprobs(row, summary);
        let (token, logprob) = s.sampler.sample(row, &s.tokens, summary);
        end = emit(s, (token, logprob, top), ctx);
        if end.is_some() || draft.get(j) != Some(&token) {
            break;
        }
        // The draft token at this position was the pick: its K/V, written this step, stands.
        kept += 1;
        s.kv_len += 1;
    }
    s.draft_cap = (kept + 1).min(most).max(1);
    (kept, drafted, end)
}
