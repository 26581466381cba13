//! What a step's tokens cost, in multiply-adds, so that the prefill beside decoding sequences
//! can be held to a share of their work at any depth.
//!
//! A token runs the layers' matrices (the same at every position) and attends to every earlier
//! position in the global layers and to at most the window in the sliding ones; a sampled token
//! also runs the output projection. Counting tokens alone, a chunk deep in a long prompt (each
//! of its tokens attending to tens of thousands of positions) would cost many times the same
//! chunk at the prompt's start, and every decoding sequence beside it would wait that long.

use crate::model::GemmaConfig;

/// Multiply-adds per token of one model, by part.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WorkModel {
    /// The layers' matrices, for any token.
    dense: f64,
    /// The output projection, for a token whose logits are sampled.
    head: f64,
    /// Attention per position attended, over the global layers (scores and values).
    global: f64,
    /// The same over the sliding layers, which attend to at most `window` positions.
    local: f64,
    window: usize,
}

impl WorkModel {
    pub(crate) fn new(c: &GemmaConfig) -> Self {
        let q_dim = c.num_heads * c.head_dim;
        let per_layer = c.hidden_size * (q_dim + 2 * c.kv_dim())
            + q_dim * c.hidden_size
            + 3 * c.hidden_size * c.ffn_size;
        let sliding = (0..c.num_layers).filter(|&l| c.is_sliding(l)).count();
        let per_position = 2.0 * q_dim as f64;
        Self {
            dense: (c.num_layers * per_layer) as f64,
            head: (c.vocab_size * c.hidden_size) as f64,
            global: per_position * (c.num_layers - sliding) as f64,
            local: per_position * sliding as f64,
            window: c.sliding_window.unwrap_or(usize::MAX),
        }
    }

    /// `n` prompt tokens at positions `from..from + n`, each attending to itself and every
    /// position before it.
    pub(crate) fn prefill(&self, from: usize, n: usize) -> f64 {
        if n == 0 {
            return 0.0;
        }
        // Spans `from + 1 ..= from + n`.
        let (a, b) = (from as f64 + 1.0, (from + n) as f64);
        let all = (a + b) * n as f64 / 2.0;
        n as f64 * self.dense
            + self.global * all
            + self.local * capped_sum(from + 1, from + n, self.window)
    }

    /// A decoding sequence's next token, at position `pos`.
    pub(crate) fn decode(&self, pos: usize) -> f64 {
        self.prefill(pos, 1) + self.head
    }

    /// One token's layers at the start of a prompt: the unit of the prefill's floor.
    pub(crate) fn shallow_token(&self) -> f64 {
        self.prefill(0, 1)
    }

    /// The most prompt tokens from position `from`, at most `max`, whose work is within
    /// `budget`.
    pub(crate) fn tokens_within(&self, from: usize, max: usize, budget: f64) -> usize {
        let (mut lo, mut hi) = (0, max);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if self.prefill(from, mid) <= budget {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }
}

/// Weight of the newest observation in [`StepTimes`]' moving averages: about the last eight
/// steps count.
const SMOOTHING: f64 = 0.25;

/// What a step ran: how many sequences it decoded, and its prompt work in multiply-adds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct StepWork {
    pub(crate) decoding: usize,
    pub(crate) prefill: f64,
}

/// Batch-size classes of decode-only passes: 1, 2–3, 4–7, … and 128 or more sequences.
const CLASSES: usize = 8;

/// Decode-only passes' time by how many sequences they decoded: per power-of-two class, a
/// moving average of the time and of the batch size. A batch between two classes seen is read
/// between them; below the smallest seen, as that one; above the largest, along the slope of the
/// two largest (as that one where only one was seen). Unlike one line fitted through every pass,
/// a few slow passes at one batch size never move the estimate at another.
#[derive(Debug, Clone, Copy, Default)]
struct ByBatch {
    /// `(mean batch size, mean seconds)` of each class seen.
    classes: [Option<(f64, f64)>; CLASSES],
}

impl ByBatch {
    /// A pass of `secs` whatever the batch.
    #[cfg(test)]
    fn flat(secs: f64) -> Self {
        let mut b = ByBatch::default();
        b.classes[0] = Some((1.0, secs));
        b
    }

    fn class(n: usize) -> usize {
        (n.max(1).ilog2() as usize).min(CLASSES - 1)
    }

    fn add(&mut self, n: usize, secs: f64) {
        let slot = &mut self.classes[Self::class(n)];
        let (mut size, mut time) = (slot.map(|c| c.0), slot.map(|c| c.1));
        smooth(&mut size, n as f64);
        smooth(&mut time, secs);
        *slot = size.zip(time);
    }

    /// A decode-only pass of `n` sequences; `None` before any was seen.
    fn at(&self, n: usize) -> Option<f64> {
        let seen: Vec<(f64, f64)> = self.classes.iter().flatten().copied().collect();
        let n = n as f64;
        let (&first, &last) = (seen.first()?, seen.last()?);
        let line = |(x0, y0): (f64, f64), (x1, y1): (f64, f64)| {
            let slope = if x1 > x0 {
                ((y1 - y0) / (x1 - x0)).max(0.0)
            } else {
                0.0
            };
            y0 + slope * (n - x0)
        };
        if n <= first.0 {
            return Some(first.1);
        }
        if n >= last.0 {
            return Some(match seen.len() {
                1 => last.1,
                k => line(seen[k - 2], last).max(last.1),
            });
        }
        let k = seen.iter().position(|c| c.0 >= n).unwrap_or(seen.len() - 1);
        Some(
            line(seen[k - 1], seen[k])
                .clamp(seen[k - 1].1.min(seen[k].1), seen[k - 1].1.max(seen[k].1)),
        )
    }
}

/// What forward passes take on this machine, learned from the steps run: a decode-only pass, by
/// how many sequences it decodes ([`ByBatch`]: a pass has fixed costs, reading every weight
/// once, and grows with its batch), and the time a multiply-add of prompt work adds to a pass
/// beside decoding sequences. Work counts alone mislead where a step has fixed costs: they make
/// a few prompt tokens look free beside one decoding sequence or dear beside many. A decode-only
/// time that ignored the batch would charge a larger batch's decoding to the prompt beside it,
/// and admit new prompts the more slowly the more sequences decode. Off, it records nothing.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepTimes {
    on: bool,
    decode_only: ByBatch,
    per_prefill_work: Option<f64>,
}

impl Default for StepTimes {
    fn default() -> Self {
        Self {
            on: true,
            decode_only: ByBatch::default(),
            per_prefill_work: None,
        }
    }
}

impl StepTimes {
    /// Learns nothing: budgets by work counts alone (tests that count a step's tokens).
    #[cfg(test)]
    pub(crate) fn off() -> Self {
        Self {
            on: false,
            ..Self::default()
        }
    }

    /// Times that stay as given: `decode_only` seconds a decode-only pass (whatever it decodes),
    /// and `per_prefill_work` seconds per unit of prompt work beside it.
    #[cfg(test)]
    pub(crate) fn fixed(decode_only: f64, per_prefill_work: f64) -> Self {
        Self {
            on: false,
            decode_only: ByBatch::flat(decode_only),
            per_prefill_work: Some(per_prefill_work),
        }
    }

    /// Records a forward pass of `secs` seconds that decoded (or not) and ran `work`.
    pub(crate) fn record(&mut self, decoded: bool, work: StepWork, secs: f64) {
        if !self.on || !decoded {
            return;
        }
        if work.prefill <= 0.0 {
            self.decode_only.add(work.decoding, secs);
        } else if let Some(decode) = self.decode_only.at(work.decoding) {
            // A noisy pass may take less than the decode-only estimate: the prompt work still
            // cost something.
            let added = (secs - decode).max(secs * 0.05);
            smooth(&mut self.per_prefill_work, added / work.prefill);
        }
    }

    /// The prompt work a pass beside `decoding` sequences may add for it to take `share` times
    /// longer than their decode-only pass; `None` until both were measured.
    pub(crate) fn prefill_work(&self, share: f64, decoding: usize) -> Option<f64> {
        Some(share * self.decode_only.at(decoding)? / self.per_prefill_work?)
    }
}

fn smooth(avg: &mut Option<f64>, x: f64) {
    *avg = Some(avg.map_or(x, |a| a + SMOOTHING * (x - a)));
}

/// `min(x, cap)` summed over `x` in `a..=b`.
fn capped_sum(a: usize, b: usize, cap: usize) -> f64 {
    let (a, b, cap) = (a as f64, b as f64, cap as f64);
    let top = b.min(cap);
    let below = if top >= a {
        (a + top) * (top - a + 1.0) / 2.0
    } else {
        0.0
    };
    let above = (b - a.max(cap + 1.0) + 1.0).max(0.0) * cap;
    below + above
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gemma3_270m() -> GemmaConfig {
        GemmaConfig {
            architecture: "gemma3".into(),
            vocab_size: 262_144,
            hidden_size: 640,
            num_layers: 18,
            num_heads: 4,
            num_kv_heads: 1,
            head_dim: 256,
            ffn_size: 2048,
            rms_eps: 1e-6,
            context_length: 32_768,
            rope_base_global: 1e6,
            rope_base_local: 1e4,
            rope_scale_global: 1.0,
            sliding_window: Some(512),
            sliding_window_pattern: 6,
            query_pre_attn_scalar: 256.0,
            attn_logit_softcap: None,
            final_logit_softcap: None,
        }
    }

    #[test]
    fn sums_match_counting_token_by_token() {
        let w = WorkModel::new(&gemma3_270m());
        for (from, n) in [(0, 1), (0, 700), (300, 400), (5_000, 64), (511, 2)] {
            let one_by_one: f64 = (from..from + n).map(|p| w.prefill(p, 1)).sum();
            let whole = w.prefill(from, n);
            assert!(
                (whole - one_by_one).abs() <= 1e-9 * whole,
                "{from}+{n}: {whole} {one_by_one}"
            );
        }
        assert_eq!(capped_sum(3, 10, 5), (3 + 4 + 5 + 5 * 5) as f64);
        assert_eq!(capped_sum(7, 9, 5), 15.0);
        assert_eq!(capped_sum(1, 4, usize::MAX), 10.0);
    }

    /// A step of `decoding` sequences and `prefill` prompt work.
    fn ran(decoding: usize, prefill: f64) -> StepWork {
        StepWork { decoding, prefill }
    }

    #[test]
    fn the_prefill_allowance_follows_measured_times() {
        let mut t = StepTimes::default();
        assert_eq!(t.prefill_work(1.0, 4), None, "nothing measured");
        // Decode-only passes of 10 ms; passes with 1e6 of prompt work beside them take 30 ms:
        // 2e-8 s per unit of work.
        t.record(true, ran(4, 0.0), 0.010);
        assert_eq!(t.prefill_work(1.0, 4), None, "no prompt work measured");
        t.record(true, ran(4, 1e6), 0.030);
        let w = t.prefill_work(1.0, 4).unwrap();
        assert!((w - 5e5).abs() < 1.0, "10 ms of prompt work: {w}");
        assert!((t.prefill_work(0.5, 4).unwrap() - 2.5e5).abs() < 1.0);
        // Prefill-only passes say nothing about either.
        t.record(false, ran(0, 1e9), 5.0);
        assert!((t.prefill_work(1.0, 4).unwrap() - w).abs() < 1e-6);
        // Slower prompt work shrinks the allowance, gradually.
        for _ in 0..40 {
            t.record(true, ran(4, 1e6), 0.110);
        }
        let slower = t.prefill_work(1.0, 4).unwrap();
        assert!((slower - 1e5).abs() < 1e3, "{slower}");
        let mut off = StepTimes::off();
        off.record(true, ran(4, 0.0), 0.010);
        off.record(true, ran(4, 1e6), 0.030);
        assert_eq!(off.prefill_work(1.0, 4), None);
    }

    /// Decode-only passes seen at a few sequences, then a prompt beside many: the decoding of
    /// the many is not charged to the prompt, and the prompt's allowance is a share of the many's
    /// pass. Before, one decode-only average stood for every batch: the larger batch's extra
    /// decoding (here 32 of 50 ms) was charged to the prompt, its allowance shrank as the batch
    /// grew, and 64 streams arriving behind 16 were admitted about ten at a time.
    #[test]
    fn a_larger_batch_s_decoding_is_not_charged_to_the_prompt_beside_it() {
        let mut t = StepTimes::default();
        // A pass: 8 ms of fixed costs and 1 ms per sequence decoded.
        let decode = |n: usize| 0.008 + 0.001 * n as f64;
        for n in [16, 12, 8, 6, 4, 3, 2, 1] {
            t.record(true, ran(n, 0.0), decode(n));
        }
        // 40 units of prompt work beside 40 sequences add 20 ms: 0.5 ms a unit.
        for _ in 0..8 {
            t.record(true, ran(40, 40.0), decode(40) + 0.020);
        }
        let per = t.per_prefill_work.unwrap();
        assert!((per - 5e-4).abs() < 5e-5, "{per} s a unit of prompt work");
        // Beside 40 sequences (48 ms a pass) the prompt may add about 48 ms: 96 units.
        let many = t.prefill_work(1.0, 40).unwrap();
        assert!((many - 96.0).abs() < 8.0, "{many}");
        let few = t.prefill_work(1.0, 1).unwrap();
        assert!((few - 18.0).abs() < 1.0, "{few}");
    }

    /// Slow decode-only passes at one batch size (a grammar's masks, a busy machine) do not
    /// change what a pass at another size is taken to cost: a prompt beside one sequence is
    /// measured against that sequence's own passes. A line fitted through every pass let a few
    /// slow large batches raise the estimate for one sequence, under-charge the prompt, and let
    /// whole chunks run beside it.
    #[test]
    fn slow_passes_at_one_batch_size_leave_the_others_alone() {
        let mut b = ByBatch::default();
        for _ in 0..4 {
            b.add(1, 0.001);
        }
        for n in [16, 17, 16, 17] {
            b.add(n, 0.030);
        }
        assert_eq!(b.at(1), Some(0.001));
        let mid = b.at(8).unwrap();
        assert!(mid > 0.001 && mid < 0.030, "{mid}");
        assert!(b.at(64).unwrap() >= 0.030);
        // Between two classes: on the line between their means.
        let mut two = ByBatch::default();
        two.add(2, 0.002);
        two.add(8, 0.008);
        assert!((two.at(5).unwrap() - 0.005).abs() < 1e-9);
        assert_eq!(two.at(1), Some(0.002));
        assert!((two.at(16).unwrap() - 0.016).abs() < 1e-9);
        assert_eq!(ByBatch::default().at(3), None);
    }

    #[test]
    fn a_chunk_deep_in_a_prompt_gets_fewer_tokens_for_the_same_work() {
        let w = WorkModel::new(&gemma3_270m());
        let budget = 4.0 * w.decode(100);
        let shallow = w.tokens_within(0, 10_000, budget);
        let deep = w.tokens_within(30_000, 10_000, budget);
        assert!(deep < shallow, "{deep} at depth, {shallow} at the start");
        assert!(w.prefill(30_000, deep) <= budget && w.prefill(30_000, deep + 1) > budget);
        assert_eq!(w.tokens_within(0, 3, f64::INFINITY), 3);
        assert_eq!(w.tokens_within(0, 10, 0.0), 0);
    }
}
