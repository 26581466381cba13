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
#[path = "sampling_tests.rs"]
mod tests;
