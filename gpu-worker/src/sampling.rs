//! Choosing the next token from a row of logits, per request: greedy, temperature, top-k, top-p,
//! min-p, the repetition, presence and frequency penalties, logit bias and DRY, with the
//! request's own seeded RNG so a seed reproduces the output.

use std::collections::HashMap;
use std::sync::Arc;

use hearth_shared::SamplingParams;
use llguidance::toktrie::SimpleVob;

use crate::math::exp;

/// xoshiro256**: small, fast, and fully determined by its seed.
#[derive(Clone, Debug)]
pub struct Rng([u64; 4]);

impl Rng {
    pub fn seeded(seed: u64) -> Self {
        // splitmix64 spreads any seed (0 included) over the state.
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^ (x >> 31)
        };
        Self([next(), next(), next(), next()])
    }

    pub fn from_entropy() -> Self {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        Self::seeded(h.finish())
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A request's sampler: its parameters and RNG, and what its penalties need to know of the
/// sequence.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// Where the reply begins in the sequence's tokens (presence and frequency penalties count
    /// the reply's tokens only, as OpenAI's do).
    reply_from: usize,
    /// Tokens that end a DRY run, sorted.
    breakers: Arc<[u32]>,
    /// Alternatives reported with each token ([`Sampler::top_logprobs`]).
    top_n: usize,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = params.seed.map_or_else(Rng::from_entropy, Rng::seeded);
        Self {
            params,
            rng,
            reply_from: 0,
            breakers: Arc::from([]),
            top_n: 0,
        }
    }

    /// A sampler for a reply of which `sampled` tokens were already drawn elsewhere (a
    /// failover's continuation): every stochastic pick takes exactly one draw, so skipping
    /// `sampled` draws makes a seeded reply continue exactly as if it had not been cut.
    pub fn continuing(params: SamplingParams, sampled: u32) -> Self {
        let mut s = Self::new(params);
        if !s.params.is_greedy() {
            for _ in 0..sampled {
                s.rng.next_f64();
            }
        }
        s
    }

    /// Says where the reply begins among the sequence's tokens (its prompt's length, less the
    /// tokens of it a continuation already holds), and which tokens end a DRY run.
    pub fn for_sequence(mut self, reply_from: usize, mut breakers: Vec<u32>) -> Self {
        breakers.sort_unstable();
        breakers.dedup();
        self.reply_from = reply_from;
        self.breakers = breakers.into();
        self
    }

    /// Reports the `n` likeliest tokens with each pick ([`Sampler::top_logprobs`]).
    pub fn with_top_logprobs(mut self, n: usize) -> Self {
        self.top_n = n;
        self
    }

    /// The likeliest tokens of `logits` under the model's own distribution (before any penalty
    /// or bias), likeliest first, with their log-probabilities: as many as the request asked
    /// for, none by default. Call it before [`Sampler::sample`], which changes the row.
    pub fn top_logprobs(&self, logits: &[f32], summary: Option<LogitSummary>) -> Vec<(u32, f32)> {
        let n = self.top_n.min(logits.len());
        if n == 0 {
            return Vec::new();
        }
        let lse = summary.unwrap_or_else(|| LogitSummary::of(logits)).lse;
        let mut cand: Vec<(f32, u32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (l, i as u32))
            .collect();
        let desc = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        cand.select_nth_unstable_by(n - 1, desc);
        cand.truncate(n);
        cand.sort_unstable_by(desc);
        cand.into_iter().map(|(l, t)| (t, l - lse)).collect()
    }

    /// Picks a token from `logits` (modified in place); `history` holds the tokens seen so far
    /// (for the penalties), `summary` the row's [`LogitSummary`] where the forward pass made it
    /// (it is made here otherwise). Returns the token and its log-probability under the model's
    /// unmodified distribution. A greedy sampler without a penalty or bias reads only the
    /// summary ([`Sampler::needs_row`]), so its row may be left on the device.
    pub fn sample(
        &mut self,
        logits: &mut [f32],
        history: &[u32],
        summary: Option<LogitSummary>,
    ) -> (u32, f32) {
        self.sample_masked(logits, history, summary, None)
    }

    /// [`Sampler::sample`] among the tokens `mask` allows (a grammar's, which the caller has
    /// checked allows at least one): the others are never picked. The log-probability is still
    /// the model's own.
    pub fn sample_masked(
        &mut self,
        logits: &mut [f32],
        history: &[u32],
        summary: Option<LogitSummary>,
        mask: Option<&SimpleVob>,
    ) -> (u32, f32) {
        let LogitSummary { argmax, max, lse } = summary.unwrap_or_else(|| LogitSummary::of(logits));
        // Adjusted tokens' unmodified logits.
        let original = self.adjust(logits, history);
        let token = if self.params.is_greedy() {
            // The first maximum is already known unless an adjustment moved logits; a mask
            // changes it only when it disallows that token. Greedy never writes the mask into
            // the row: one pass over the allowed tokens finds their maximum.
            match mask {
                None if original.is_empty() => argmax,
                None => first_index_of(logits, max_of(logits)),
                Some(m) if original.is_empty() && allows(m, argmax) => argmax,
                Some(m) => masked_argmax(m, logits).unwrap_or(argmax),
            }
        } else {
            if let Some(m) = mask {
                apply_mask(m, logits);
            }
            self.sample_stochastic(logits)
        };
        let raw = match original.get(&token) {
            Some(&l) => l,
            None if token == argmax => max,
            None => logits[token as usize],
        };
        (token, raw - lse)
    }

    /// Applies the penalties and the bias to `logits`; returns each changed token's logit as
    /// the model gave it.
    fn adjust(&self, logits: &mut [f32], history: &[u32]) -> HashMap<u32, f32> {
        let mut original = HashMap::new();
        let p = &self.params;
        if !p.modifies_logits() {
            return original;
        }
        let mut change = |t: u32, f: &dyn Fn(f32) -> f32| {
            if let Some(l) = logits.get_mut(t as usize) {
                original.entry(t).or_insert(*l);
                *l = f(*l);
            }
        };
        let penalty = p.repetition_penalty;
        if penalty != 1.0 {
            let mut seen = std::collections::HashSet::new();
            for &t in history {
                if seen.insert(t) {
                    change(t, &|l| if l > 0.0 { l / penalty } else { l * penalty });
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            let mut counts: HashMap<u32, u32> = HashMap::new();
            for &t in history.get(self.reply_from..).unwrap_or_default() {
                *counts.entry(t).or_default() += 1;
            }
            for (t, n) in counts {
                let by = p.presence_penalty + p.frequency_penalty * n as f32;
                change(t, &|l| l - by);
            }
        }
        for (&t, &b) in &p.logit_bias {
            change(t, &|l| l + b);
        }
        if p.dry_enabled() {
            let window = match usize::try_from(p.dry_penalty_last_n) {
                Ok(n) => history.len().saturating_sub(n),
                Err(_) => 0,
            };
            let runs = dry_runs(&history[window..], &self.breakers, p.dry_allowed_length);
            for (t, len) in runs {
                let exponent = (len - p.dry_allowed_length).min(64) as i32;
                let by = (p.dry_multiplier * p.dry_base.powi(exponent)).min(1e30);
                change(t, &|l| l - by);
            }
        }
        original
    }

    /// Whether [`Sampler::sample`] reads the row of logits, not only its summary.
    pub fn needs_row(&self) -> bool {
        !self.params.is_greedy() || self.params.modifies_logits() || self.top_n > 0
    }

    fn sample_stochastic(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let mut cand: Vec<(f32, u32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (l, i as u32))
            .collect();
        let desc = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0);
        if p.top_k > 0 && (p.top_k as usize) < cand.len() {
            cand.select_nth_unstable_by(p.top_k as usize - 1, desc);
            cand.truncate(p.top_k as usize);
        }
        let max = cand.iter().map(|c| c.0).fold(f32::NEG_INFINITY, f32::max);
        let inv_t = 1.0 / p.temperature;
        // Weights relative to the most likely token (which has weight 1).
        for c in cand.iter_mut() {
            c.0 = exp((c.0 - max) * inv_t);
        }
        if p.min_p > 0.0 {
            cand.retain(|c| c.0 >= p.min_p);
        }
        if p.top_p < 1.0 {
            let total: f32 = cand.iter().map(|c| c.0).sum();
            let target = p.top_p * total;
            // Sort only as much of the head as the mass needs: usually a few dozen tokens.
            let mut m = 64usize;
            loop {
                let m_eff = m.min(cand.len());
                if m_eff < cand.len() {
                    cand.select_nth_unstable_by(m_eff - 1, |a, b| b.0.total_cmp(&a.0));
                }
                cand[..m_eff].sort_unstable_by(|a, b| b.0.total_cmp(&a.0));
                let mut cum = 0.0;
                let cut = cand[..m_eff].iter().position(|c| {
                    cum += c.0;
                    cum >= target
                });
                if let Some(i) = cut {
                    cand.truncate(i + 1);
                    break;
                }
                if m_eff == cand.len() {
                    break;
                }
                m *= 8;
            }
        }
        let total: f64 = cand.iter().map(|c| c.0 as f64).sum();
        let mut r = self.rng.next_f64() * total;
        for c in &cand {
            r -= c.0 as f64;
            if r < 0.0 {
                return c.1;
            }
        }
        cand.last().map_or(0, |c| c.1)
    }
}

/// Sets every logit the mask does not allow to minus infinity.
pub fn apply_mask(mask: &SimpleVob, logits: &mut [f32]) {
    for (w, chunk) in mask.as_slice().iter().zip(logits.chunks_mut(32)) {
        match *w {
            u32::MAX => {}
            0 => chunk.fill(f32::NEG_INFINITY),
            w => {
                for (j, l) in chunk.iter_mut().enumerate() {
                    if w & (1 << j) == 0 {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
    let covered = mask.as_slice().len() * 32;
    if let Some(rest) = logits.get_mut(covered..) {
        rest.fill(f32::NEG_INFINITY);
    }
}

/// DRY's repeated runs in `ctx`: for each token that would continue a run of at least
/// `allowed` tokens that `ctx` ends with and that also occurs earlier, followed by that token,
/// the longest such run. Runs never hold a token of `breakers` (sorted), so none reaches back
/// past the last one in `ctx`.
///
/// The run ending at an earlier position is the common suffix of `ctx` and `ctx` cut there: in
/// `ctx` reversed, the common prefix of the whole and the part from that position on, which the
/// Z-algorithm finds for every position in one pass.
pub fn dry_runs(ctx: &[u32], breakers: &[u32], allowed: u32) -> Vec<(u32, u32)> {
    let cap = ctx
        .iter()
        .rev()
        .take_while(|t| breakers.binary_search(t).is_err())
        .count();
    let allowed = allowed as usize;
    if cap < allowed.max(1) {
        return Vec::new();
    }
    let r: Vec<u32> = ctx.iter().rev().copied().collect();
    let n = r.len();
    let mut z = vec![0usize; n];
    let (mut left, mut right) = (0usize, 0usize);
    for k in 1..n {
        let mut len = if k < right {
            z[k - left].min(right - k)
        } else {
            0
        };
        while k + len < n && r[len] == r[k + len] {
            len += 1;
        }
        z[k] = len;
        if k + len > right {
            (left, right) = (k, k + len);
        }
    }
    let mut longest: HashMap<u32, u32> = HashMap::new();
    for k in 1..n {
        // The run ending just before r[k - 1] (in ctx order: followed by it).
        let len = z[k].min(cap);
        if len >= allowed {
            let e = longest.entry(r[k - 1]).or_default();
            *e = (*e).max(len as u32);
        }
    }
    longest.into_iter().collect()
}

/// What sampling needs of a row of logits besides the logits: where the largest first occurs,
/// its value, and the log of the sum of their exponentials. The CPU pass makes it a [`Piece`] at
/// a time, while the output projection's results are still in cache, so sampling need not read
/// the 262k-wide row from memory again (three times: for the maximum, the sum and the argmax).
/// The device pass makes it on the device, and a greedy pick without a penalty then needs no
/// more: the row itself never leaves the device (hence the maximum here, which is otherwise the
/// row's value at `argmax`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogitSummary {
    /// The first position of the largest logit.
    pub argmax: u32,
    /// The largest logit.
    pub max: f32,
    /// `ln Σ e^x`.
    pub lse: f32,
}

/// Columns of a [`Piece`]: pieces start at multiples of it, whatever the batch, so a row's summary
/// does not depend on the rows beside it.
pub const PIECE: usize = 1024;

/// One piece of a row of logits: its first column, its largest value and `Σ e^(x - max)` over it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Piece {
    pub start: usize,
    pub max: f32,
    pub sum: f32,
}

impl Piece {
    pub fn of(start: usize, xs: &[f32]) -> Self {
        let max = max_of(xs);
        Self {
            start,
            max,
            sum: sum_exp(xs, max),
        }
    }

    /// The pieces of `row`, whose first column is `start` (a multiple of [`PIECE`]).
    pub fn all_of(start: usize, row: &[f32]) -> impl Iterator<Item = Self> + '_ {
        row.chunks(PIECE)
            .enumerate()
            .map(move |(i, xs)| Self::of(start + i * PIECE, xs))
    }
}

impl LogitSummary {
    /// The summary of a whole row.
    pub fn of(row: &[f32]) -> Self {
        let pieces: Vec<Piece> = Piece::all_of(0, row).collect();
        Self::combine(&pieces, row)
    }

    /// The summaries of rows of `vocab` logits from their pieces, each with its row's index, in
    /// any order (as a forward pass's tasks finish).
    pub fn of_pieces(mut pieces: Vec<(usize, Piece)>, logits: &[f32], vocab: usize) -> Vec<Self> {
        pieces.sort_unstable_by_key(|&(r, p)| (r, p.start));
        let mut rest = pieces.as_slice();
        logits
            .chunks_exact(vocab.max(1))
            .enumerate()
            .map(|(r, row)| {
                let (mine, tail) = rest.split_at(rest.partition_point(|&(pr, _)| pr == r));
                rest = tail;
                let mine: Vec<Piece> = mine.iter().map(|&(_, p)| p).collect();
                Self::combine(&mine, row)
            })
            .collect()
    }

    /// The summary of `row` from its pieces, in column order; `row` is read only in the piece
    /// whose maximum is the row's, for the first position of it.
    pub fn combine(pieces: &[Piece], row: &[f32]) -> Self {
        let max = pieces
            .iter()
            .fold(f32::NEG_INFINITY, |m, p| if p.max > m { p.max } else { m });
        let sum: f32 = pieces.iter().map(|p| p.sum * exp(p.max - max)).sum();
        let argmax = pieces.iter().position(|p| p.max == max).map_or(0, |i| {
            let (start, end) = (
                pieces[i].start,
                pieces.get(i + 1).map_or(row.len(), |p| p.start),
            );
            start as u32 + first_index_of(&row[start..end], max)
        });
        Self {
            argmax,
            max,
            lse: max + sum.ln(),
        }
    }
}

/// Lanes of the vectorized reductions below: independent accumulators that LLVM keeps in SIMD
/// registers (a single running value would serialize the 262k-wide loops).
const LANES: usize = 16;

/// Largest value (`-inf` for an empty slice; NaN-free input assumed).
fn max_of(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..LANES {
            acc[i] = if c[i] > acc[i] { c[i] } else { acc[i] };
        }
    }
    rest.iter()
        .chain(&acc)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

/// `Σ e^(x - max)`.
fn sum_exp(xs: &[f32], max: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..LANES {
            acc[i] += exp(c[i] - max);
        }
    }
    acc.iter().sum::<f32>() + rest.iter().map(|&v| exp(v - max)).sum::<f32>()
}

/// Index of the first value equal to `max`, the largest (0 if none is).
/// Whether `mask` allows `token` (tokens past its words are not allowed).
fn allows(mask: &SimpleVob, token: u32) -> bool {
    let t = token as usize;
    mask.as_slice()
        .get(t / 32)
        .is_some_and(|w| (w >> (t % 32)) & 1 == 1)
}

/// The first position of the largest logit among the tokens `mask` allows; `None` if it
/// allows none of `logits`.
fn masked_argmax(mask: &SimpleVob, logits: &[f32]) -> Option<u32> {
    let mut best: Option<(u32, f32)> = None;
    for (wi, (&w, chunk)) in mask.as_slice().iter().zip(logits.chunks(32)).enumerate() {
        let mut bits = w;
        while bits != 0 {
            let j = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if let Some(&l) = chunk.get(j) {
                if best.is_none_or(|(_, b)| l > b) {
                    best = Some(((wi * 32 + j) as u32, l));
                }
            }
        }
    }
    best.map(|(t, _)| t)
}

fn first_index_of(xs: &[f32], max: f32) -> u32 {
    xs.iter().position(|&v| v == max).map_or(0, |i| i as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_masked_greedy_pick_is_the_first_maximum_among_allowed_tokens() {
        let n = 1000;
        let row: Vec<f32> = crate::fixtures::noise(n, 5, 3.0);
        let mut rng = Rng::seeded(9);
        for case in 0..50 {
            let mut mask = SimpleVob::alloc(n);
            for t in 0..n {
                if rng.next_u64().is_multiple_of(7) || case == 0 {
                    mask.allow_token(t as u32);
                }
            }
            let mut masked = row.clone();
            apply_mask(&mask, &mut masked);
            let want = first_index_of(&masked, max_of(&masked));
            let mut s = Sampler::new(SamplingParams::default());
            let got = s.sample_masked(&mut row.clone(), &[], None, Some(&mask)).0;
            assert_eq!(got, want, "case {case}");
            assert!(mask.is_allowed(got));
        }
    }

    fn logits() -> Vec<f32> {
        (0..1000)
            .map(|i| ((i * 7919) % 1000) as f32 / 100.0)
            .collect()
    }

    #[test]
    fn greedy_takes_the_argmax_with_its_logprob() {
        let mut s = Sampler::new(SamplingParams::greedy());
        let mut l = vec![0.0, 2.0, 1.0];
        let (t, lp) = s.sample(&mut l, &[], None);
        assert_eq!(t, 1);
        let want = 2.0 - (1f32 + 2f32.exp() + 1f32.exp()).ln();
        assert!((lp - want).abs() < 1e-5);
    }

    #[test]
    fn same_seed_same_tokens_different_seed_different_tokens() {
        let params = |seed| SamplingParams {
            temperature: 1.5,
            seed: Some(seed),
            ..Default::default()
        };
        let run = |seed| {
            let mut s = Sampler::new(params(seed));
            (0..50)
                .map(|_| s.sample(&mut logits(), &[], None).0)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
        // A continuation that skips the first 20 draws picks what the uncut run picked next.
        let mut cont = Sampler::continuing(params(42), 20);
        let rest: Vec<u32> = (0..30)
            .map(|_| cont.sample(&mut logits(), &[], None).0)
            .collect();
        assert_eq!(rest, run(42)[20..]);
    }

    #[test]
    fn top_k_one_is_greedy_and_top_k_limits_choices() {
        let l = logits();
        let best = first_index_of(&l, max_of(&l));
        let mut s = Sampler::new(SamplingParams {
            temperature: 5.0,
            top_k: 1,
            seed: Some(1),
            ..Default::default()
        });
        assert_eq!(s.sample(&mut l.clone(), &[], None).0, best);
        let mut sorted = l.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let threshold = sorted[4];
        let mut s = Sampler::new(SamplingParams {
            temperature: 5.0,
            top_k: 5,
            seed: Some(2),
            ..Default::default()
        });
        for _ in 0..200 {
            let (t, _) = s.sample(&mut l.clone(), &[], None);
            assert!(l[t as usize] >= threshold);
        }
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        // One dominant token holds > 90% of the mass.
        let mut l = vec![0.0f32; 100];
        l[7] = 10.0;
        for params in [
            SamplingParams {
                temperature: 1.0,
                top_p: 0.9,
                seed: Some(3),
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.0,
                min_p: 0.01,
                seed: Some(3),
                ..Default::default()
            },
        ] {
            let mut s = Sampler::new(params);
            for _ in 0..200 {
                assert_eq!(s.sample(&mut l.clone(), &[], None).0, 7);
            }
        }
    }

    #[test]
    fn a_summary_made_piece_by_piece_is_the_rows_maximum_first_argmax_and_log_sum_exp() {
        // Three pieces and a short fourth; the maximum appears first in the third piece, again
        // later in it and in the last, and the pieces arrive out of order and mixed with another
        // row's.
        let vocab = 3 * PIECE + 100;
        let row = |shift: f32| -> Vec<f32> {
            (0..vocab)
                .map(|i| ((i * 7919) % 1000) as f32 / 100.0 - shift)
                .collect()
        };
        let (mut a, b) = (row(0.0), row(3.0));
        for at in [2 * PIECE + 17, 2 * PIECE + 900, 3 * PIECE + 5] {
            a[at] = 12.5;
        }
        let logits: Vec<f32> = a.iter().chain(&b).copied().collect();
        let mut pieces: Vec<(usize, Piece)> = [(1, &b), (0, &a)]
            .iter()
            .flat_map(|&(r, xs)| Piece::all_of(0, xs).map(move |p| (r, p)))
            .collect();
        pieces.reverse();
        let got = LogitSummary::of_pieces(pieces, &logits, vocab);
        for (s, xs) in got.iter().zip([&a, &b]) {
            assert_eq!(*s, LogitSummary::of(xs));
            let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(xs[s.argmax as usize], max);
            assert_eq!(
                s.argmax as usize,
                xs.iter().position(|&v| v == max).unwrap()
            );
            let lse = max as f64
                + xs.iter()
                    .map(|&v| ((v - max) as f64).exp())
                    .sum::<f64>()
                    .ln();
            assert!((s.lse as f64 - lse).abs() < 1e-5, "{} vs {lse}", s.lse);
        }
        assert_eq!(got[0].argmax as usize, 2 * PIECE + 17);
        // Sampling with the summary picks and scores as it does without one; greedy needs only
        // the summary (its row may stay on the device: here, an empty one).
        let mut with = Sampler::new(SamplingParams::greedy());
        let mut without = Sampler::new(SamplingParams::greedy());
        assert!(!with.needs_row());
        let want = without.sample(&mut a.clone(), &[], None);
        assert_eq!(with.sample(&mut a.clone(), &[], Some(got[0])), want);
        assert_eq!(with.sample(&mut [], &[], Some(got[0])), want);
        let penalized = Sampler::new(SamplingParams {
            repetition_penalty: 1.1,
            ..SamplingParams::greedy()
        });
        assert!(penalized.needs_row());
    }

    #[test]
    fn repetition_penalty_steers_greedy_away_from_seen_tokens() {
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        });
        let mut l = vec![1.0, 3.0, 2.0];
        let (t, lp) = s.sample(&mut l, &[1], None);
        assert_eq!(t, 2);
        // The logprob is the model's, before the penalty.
        let want = 2.0 - (1f32.exp() + 3f32.exp() + 2f32.exp()).ln();
        assert!((lp - want).abs() < 1e-5);
    }

    #[test]
    fn presence_and_frequency_penalties_count_the_reply_only() {
        let params = SamplingParams {
            presence_penalty: 1.0,
            frequency_penalty: 0.5,
            ..Default::default()
        };
        // Token 1 twice in the reply, token 2 only in the prompt.
        let s = Sampler::new(params).for_sequence(2, Vec::new());
        let mut l = vec![0.0, 3.0, 3.0, 0.0];
        s.adjust(&mut l, &[2, 2, 1, 1]);
        assert_eq!(l, vec![0.0, 1.0, 3.0, 0.0]);
    }

    #[test]
    fn logit_bias_bans_and_forces_tokens_and_reports_the_models_logprob() {
        let mut s = Sampler::new(SamplingParams {
            logit_bias: [(1, -100.0), (0, 5.0)].into(),
            ..Default::default()
        });
        assert!(s.needs_row());
        let mut l = vec![1.0, 3.0, 2.0];
        let (t, lp) = s.sample(&mut l, &[], None);
        assert_eq!(t, 0);
        let want = 1.0 - (1f32.exp() + 3f32.exp() + 2f32.exp()).ln();
        assert!((lp - want).abs() < 1e-5);
    }

    #[test]
    fn dry_finds_the_longest_run_each_token_would_continue() {
        // "a b c x a b c ?": continuing with x repeats "a b c x" (run of 3 before it).
        let ctx = [1, 2, 3, 9, 1, 2, 3];
        assert_eq!(dry_runs(&ctx, &[], 2), vec![(9, 3)]);
        assert!(dry_runs(&ctx, &[], 4).is_empty(), "3 is below 4");
        // Two earlier continuations: the longer run counts for each token.
        let mut runs = dry_runs(&[5, 1, 2, 7, 3, 1, 2, 8, 1, 2], &[], 2);
        runs.sort_unstable();
        assert_eq!(runs, vec![(7, 2), (8, 2)]);
        // A breaker inside the ending run caps it: nothing reaches back past the 3.
        assert!(dry_runs(&ctx, &[3], 1).is_empty());
        assert_eq!(dry_runs(&[1, 2, 4, 1, 2], &[4], 2), vec![(4, 2)]);
        // A repeated token: the run is as long as the repeat allows.
        assert_eq!(dry_runs(&[6, 6, 6, 6], &[], 2), vec![(6, 3)]);
    }

    #[test]
    fn dry_steers_greedy_off_a_loop_that_the_model_would_repeat() {
        let params = SamplingParams {
            dry_multiplier: 0.8,
            dry_base: 2.0,
            dry_allowed_length: 2,
            ..Default::default()
        };
        let mut s = Sampler::new(params).for_sequence(0, Vec::new());
        // The model prefers 9, which would repeat "1 2 3 9" for the third time.
        let history = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3];
        let mut l = vec![0.0; 10];
        l[9] = 2.0;
        l[4] = 1.0;
        let (t, _) = s.sample(&mut l, &history, None);
        // The run before 9 is 7 tokens: 0.8 * 2^5 = 25.6 off its logit.
        assert_eq!(t, 4);
        assert!((l[9] - (2.0 - 25.6)).abs() < 1e-4, "{}", l[9]);
        // Limited to the last 3 tokens, the loop is out of sight, and 9 stays first.
        let mut s = Sampler::new(SamplingParams {
            dry_penalty_last_n: 3,
            ..s.params.clone()
        });
        let mut l = vec![0.0; 10];
        l[9] = 2.0;
        l[4] = 1.0;
        assert_eq!(s.sample(&mut l, &history, None).0, 9);
    }

    #[test]
    fn top_logprobs_are_the_likeliest_tokens_of_the_models_own_distribution() {
        let s = Sampler::new(SamplingParams {
            logit_bias: [(0, 50.0)].into(),
            ..Default::default()
        })
        .with_top_logprobs(2);
        assert!(s.needs_row());
        let l = vec![1.0, 3.0, 2.0, -1.0];
        let top = s.top_logprobs(&l, None);
        let lse = l.iter().map(|x: &f32| x.exp()).sum::<f32>().ln();
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!((top[0].1 - (3.0 - lse)).abs() < 1e-5 && (top[1].1 - (2.0 - lse)).abs() < 1e-5);
        assert!(Sampler::new(SamplingParams::default())
            .top_logprobs(&l, None)
            .is_empty());
    }
}
