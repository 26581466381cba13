//! Summaries of samples: percentiles, throughput, the terminal table and the JSON report.

use serde::Serialize;

use super::client::Sample;

#[derive(Debug, Clone, Default, Serialize)]
pub struct Percentiles {
    pub mean: f64,
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
}

/// Percentiles in milliseconds of values in seconds (nearest rank).
pub fn percentiles_ms(values: &[f64]) -> Option<Percentiles> {
    if values.is_empty() {
        return None;
    }
    let mut v: Vec<f64> = values.iter().map(|s| s * 1000.0).collect();
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    Some(Percentiles {
        mean: v.iter().sum::<f64>() / v.len() as f64,
        p50: at(0.50),
        p95: at(0.95),
        p99: at(0.99),
    })
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct TurnSummary {
    pub turn: usize,
    pub requests: usize,
    pub ttft_ms: Option<Percentiles>,
    pub prompt_tokens_mean: Option<f64>,
    pub cached_ratio: Option<f64>,
}

/// One row of results: a concurrency level, a rate, or a multi-turn run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    pub name: String,
    pub concurrency: Option<usize>,
    pub request_rate: Option<f64>,
    pub requests: usize,
    pub errors: usize,
    pub duration_s: f64,
    pub request_throughput: f64,
    pub output_tokens: u64,
    pub output_tokens_per_s: f64,
    /// Output tokens per second of one stream (its tokens after the first over the time
    /// they took), averaged over requests.
    pub per_stream_tokens_per_s: Option<f64>,
    pub ttft_ms: Option<Percentiles>,
    pub itl_ms: Option<Percentiles>,
    pub latency_ms: Option<Percentiles>,
    /// Prompt tokens served from cache over all prompt tokens, where the server reports both.
    pub cached_ratio: Option<f64>,
    pub turns: Vec<TurnSummary>,
    pub error_examples: Vec<String>,
}

fn cached_ratio<'a>(samples: impl Iterator<Item = &'a Sample>) -> Option<f64> {
    let (mut cached, mut prompt) = (0u64, 0u64);
    for s in samples {
        if let (Some(c), Some(p)) = (s.cached_tokens, s.prompt_tokens) {
            cached += c;
            prompt += p;
        }
    }
    (prompt > 0).then(|| cached as f64 / prompt as f64)
}

impl Summary {
    pub fn new(name: String, samples: &[Sample], duration_s: f64) -> Self {
        let ok: Vec<&Sample> = samples.iter().filter(|s| s.error.is_none()).collect();
        let output_tokens: u64 = ok.iter().map(|s| s.output_tokens).sum();
        let ttft: Vec<f64> = ok.iter().filter_map(|s| s.ttft_s).collect();
        let itl: Vec<f64> = ok.iter().flat_map(|s| s.itl_s.iter().copied()).collect();
        let latency: Vec<f64> = ok.iter().map(|s| s.latency_s).collect();
        let per_stream: Vec<f64> = ok
            .iter()
            .filter_map(|s| {
                let decode = s.latency_s - s.ttft_s?;
                (s.output_tokens > 1 && decode > 0.0).then(|| (s.output_tokens - 1) as f64 / decode)
            })
            .collect();
        let mut errors: Vec<String> = samples.iter().filter_map(|s| s.error.clone()).collect();
        errors.dedup();
        errors.truncate(5);
        Self {
            name,
            requests: samples.len(),
            errors: samples.len() - ok.len(),
            duration_s,
            request_throughput: ok.len() as f64 / duration_s.max(1e-9),
            output_tokens,
            output_tokens_per_s: output_tokens as f64 / duration_s.max(1e-9),
            per_stream_tokens_per_s: (!per_stream.is_empty())
                .then(|| per_stream.iter().sum::<f64>() / per_stream.len() as f64),
            ttft_ms: percentiles_ms(&ttft),
            itl_ms: percentiles_ms(&itl),
            latency_ms: percentiles_ms(&latency),
            cached_ratio: cached_ratio(ok.iter().copied()),
            error_examples: errors,
            ..Self::default()
        }
    }

    /// Per-turn figures for a multi-turn run; `turn_of[i]` is sample i's turn (1-based).
    pub fn with_turns(mut self, samples: &[Sample], turn_of: &[usize]) -> Self {
        let last = turn_of.iter().copied().max().unwrap_or(0);
        for turn in 1..=last {
            let of_turn: Vec<&Sample> = samples
                .iter()
                .zip(turn_of)
                .filter(|(s, &t)| t == turn && s.error.is_none())
                .map(|(s, _)| s)
                .collect();
            let ttft: Vec<f64> = of_turn.iter().filter_map(|s| s.ttft_s).collect();
            let prompts: Vec<u64> = of_turn.iter().filter_map(|s| s.prompt_tokens).collect();
            self.turns.push(TurnSummary {
                turn,
                requests: of_turn.len(),
                ttft_ms: percentiles_ms(&ttft),
                prompt_tokens_mean: (!prompts.is_empty())
                    .then(|| prompts.iter().sum::<u64>() as f64 / prompts.len() as f64),
                cached_ratio: cached_ratio(of_turn.iter().copied()),
            });
        }
        self
    }
}

fn ms(p: &Option<Percentiles>, f: impl Fn(&Percentiles) -> f64) -> String {
    p.as_ref()
        .map_or_else(|| "-".into(), |p| format!("{:.0}", f(p)))
}

/// The results as a table for the terminal.
pub fn table(rows: &[Summary]) -> String {
    let mut out = format!(
        "{:<18} {:>5} {:>5} {:>8} {:>9} {:>9} {:>8} {:>8} {:>8} {:>7} {:>7} {:>7}\n",
        "run",
        "reqs",
        "errs",
        "req/s",
        "out tok/s",
        "tok/s/str",
        "ttft p50",
        "ttft p95",
        "ttft p99",
        "itl p50",
        "itl p99",
        "cached"
    );
    for r in rows {
        out += &format!(
            "{:<18} {:>5} {:>5} {:>8.2} {:>9.1} {:>9} {:>8} {:>8} {:>8} {:>7} {:>7} {:>7}\n",
            r.name,
            r.requests,
            r.errors,
            r.request_throughput,
            r.output_tokens_per_s,
            r.per_stream_tokens_per_s
                .map_or_else(|| "-".into(), |v| format!("{v:.1}")),
            ms(&r.ttft_ms, |p| p.p50),
            ms(&r.ttft_ms, |p| p.p95),
            ms(&r.ttft_ms, |p| p.p99),
            ms(&r.itl_ms, |p| p.p50),
            ms(&r.itl_ms, |p| p.p99),
            r.cached_ratio
                .map_or_else(|| "-".into(), |c| format!("{:.0}%", c * 100.0)),
        );
        for t in &r.turns {
            out += &format!(
                "  turn {:<3} {:>5} reqs  prompt {:>6}  ttft p50 {:>6} ms  p95 {:>6} ms  cached {:>5}\n",
                t.turn,
                t.requests,
                t.prompt_tokens_mean
                    .map_or_else(|| "-".into(), |v| format!("{v:.0}")),
                ms(&t.ttft_ms, |p| p.p50),
                ms(&t.ttft_ms, |p| p.p95),
                t.cached_ratio
                    .map_or_else(|| "-".into(), |c| format!("{:.0}%", c * 100.0)),
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(|i| f64::from(i) / 1000.0).collect();
        let p = percentiles_ms(&v).expect("values");
        assert!((p.p50 - 50.0).abs() < 1e-9, "{p:?}");
        assert!((p.p95 - 95.0).abs() < 1e-9, "{p:?}");
        assert!((p.p99 - 99.0).abs() < 1e-9, "{p:?}");
        assert!((p.mean - 50.5).abs() < 1e-9, "{p:?}");
        assert!(percentiles_ms(&[]).is_none());
    }

    #[test]
    fn summaries_count_errors_and_cached_share() {
        let ok = Sample {
            ttft_s: Some(0.1),
            itl_s: vec![0.01, 0.02],
            latency_s: 0.13,
            output_tokens: 3,
            prompt_tokens: Some(100),
            cached_tokens: Some(75),
            ..Sample::default()
        };
        let bad = Sample {
            error: Some("503".into()),
            ..Sample::default()
        };
        let s = Summary::new("x".into(), &[ok.clone(), ok, bad], 2.0);
        assert_eq!((s.requests, s.errors, s.output_tokens), (3, 1, 6));
        assert!((s.output_tokens_per_s - 3.0).abs() < 1e-9);
        assert_eq!(s.cached_ratio, Some(0.75));
        assert_eq!(s.error_examples, vec!["503".to_string()]);
    }
}
