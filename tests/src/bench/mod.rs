//! `hearth-bench`: a load generator for chat serving, in the spirit of vLLM's `bench serve` and
//! its multi-round chat benchmark. It speaks the OpenAI-compatible API (so one run can measure
//! Hearth and any other OpenAI-compatible server) and Hearth's native session API.
//!
//! Workloads: a fixed-concurrency sweep, multi-turn chat (sessions × turns, interleaved), and a
//! Poisson request rate. Prompts are deterministic from a seed; every run is bounded in requests
//! and time, and only loopback targets are accepted.

pub mod client;
pub mod report;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use client::{Api, Sample, Target};
use report::Summary;

/// What every request of a run shares.
#[derive(Debug, Clone)]
pub struct Shape {
    pub api: Api,
    pub model: String,
    /// Prompt length in words (about 1.3 tokens each for Gemma).
    pub input_words: usize,
    pub output_tokens: u32,
    /// Ask for exactly `output_tokens` (`ignore_eos`), so runs compare.
    pub fixed_length: bool,
    pub seed: u64,
}

/// A small deterministic word source (xorshift), so the same seed gives the same prompts.
#[derive(Debug, Clone)]
pub struct Words(u64);

const VOCAB: &[&str] = &[
    "the",
    "river",
    "light",
    "morning",
    "city",
    "old",
    "window",
    "quiet",
    "story",
    "bread",
    "winter",
    "garden",
    "music",
    "stone",
    "bridge",
    "letter",
    "forest",
    "train",
    "coffee",
    "harbor",
    "mountain",
    "lamp",
    "paper",
    "street",
    "friend",
    "summer",
    "clock",
    "field",
    "market",
    "rain",
    "kitchen",
    "road",
    "island",
    "evening",
    "book",
    "door",
    "cloud",
    "school",
    "voice",
    "table",
    "song",
    "ship",
    "snow",
    "wind",
    "house",
    "painting",
    "candle",
    "village",
    "and",
    "under",
    "across",
    "slowly",
    "bright",
    "small",
    "green",
    "warm",
    "tired",
    "curious",
    "remembers",
    "builds",
    "carries",
    "finds",
    "opens",
    "writes",
];

impl Words {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    pub fn text(&mut self, words: usize) -> String {
        let mut out = String::with_capacity(words * 7);
        for i in 0..words {
            if i > 0 {
                out.push(' ');
            }
            out.push_str(VOCAB[(self.next() % VOCAB.len() as u64) as usize]);
        }
        out
    }

    /// Exponentially distributed, mean `1/rate` seconds.
    pub fn exp_interval(&mut self, rate: f64) -> Duration {
        let u = ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        Duration::from_secs_f64(-u.ln() / rate)
    }
}

/// The prompt source of request (or session) `i` of a run.
fn words_for(seed: u64, i: usize, salt: u64) -> Words {
    Words::new(seed ^ ((i as u64 + 1).wrapping_mul(salt)))
}

fn prompt(words: &mut Words, n: usize) -> String {
    format!("Continue this story: {}", words.text(n))
}

/// Progress on stderr while a run goes (a bar, overwritten in place).
#[derive(Debug)]
pub struct Progress {
    done: Arc<AtomicUsize>,
    ticker: Option<tokio::task::JoinHandle<()>>,
}

impl Progress {
    pub fn start(name: &str, total: usize, show: bool) -> Self {
        let done = Arc::new(AtomicUsize::new(0));
        let ticker = show.then(|| {
            let (done, name) = (done.clone(), name.to_string());
            tokio::spawn(async move {
                let started = Instant::now();
                loop {
                    let d = done.load(Ordering::Relaxed).min(total);
                    let filled = d * 30 / total.max(1);
                    eprint!(
                        "\r{name:<18} [{}{}] {d}/{total} {:.0}s",
                        "#".repeat(filled),
                        ".".repeat(30 - filled),
                        started.elapsed().as_secs_f64()
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            })
        });
        Self { done, ticker }
    }

    pub fn tick(&self) {
        self.done.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(t) = self.ticker.take() {
            t.abort();
            eprint!("\r{:<80}\r", "");
        }
    }
}

impl Shape {
    fn openai_body(&self, messages: Value) -> Value {
        json!({
            "model": self.model,
            "messages": messages,
            "max_tokens": self.output_tokens,
            "ignore_eos": self.fixed_length,
            "temperature": 0,
            "seed": self.seed,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
    }

    fn native_body(&self, content: &str) -> Value {
        json!({
            "content": content,
            "max_tokens": self.output_tokens,
            "ignore_eos": self.fixed_length,
            "params": {"temperature": 0.0, "seed": self.seed},
        })
    }

    /// One single-turn request with a fresh prompt (a fresh session on the native API).
    async fn one_shot(&self, target: &Target, text: String) -> Sample {
        match self.api {
            Api::Openai => {
                let body = self.openai_body(json!([{"role": "user", "content": text}]));
                target
                    .stream(Api::Openai, "/v1/chat/completions", &body)
                    .await
            }
            Api::Native => match target.json("POST", "/v1/sessions", Some(&json!({}))).await {
                Ok(s) => {
                    let id = s["id"].as_str().unwrap_or_default();
                    let path = format!("/v1/sessions/{id}/messages");
                    target
                        .stream(Api::Native, &path, &self.native_body(&text))
                        .await
                }
                Err(e) => Sample {
                    error: Some(format!("{e:#}")),
                    ..Sample::default()
                },
            },
        }
    }
}

/// `requests` single-turn requests, `concurrency` at a time.
pub async fn concurrency_level(
    target: &Target,
    shape: &Shape,
    concurrency: usize,
    requests: usize,
    deadline: Instant,
    show: bool,
) -> Summary {
    let name = format!("concurrency {concurrency}");
    let progress = Arc::new(Progress::start(&name, requests, show));
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency.min(requests) {
        let (target, shape, next, progress) = (
            target.clone(),
            shape.clone(),
            next.clone(),
            progress.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= requests || Instant::now() >= deadline {
                    return out;
                }
                let mut words = words_for(shape.seed, i, 7919);
                let text = prompt(&mut words, shape.input_words);
                out.push(shape.one_shot(&target, text).await);
                progress.tick();
            }
        }));
    }
    let mut samples = Vec::new();
    for t in tasks {
        samples.extend(t.await.unwrap_or_default());
    }
    let summary = Summary::new(name, &samples, started.elapsed().as_secs_f64());
    Summary {
        concurrency: Some(concurrency),
        ..summary
    }
}

/// Poisson arrivals at `rate` requests per second, `requests` in all.
pub async fn request_rate(
    target: &Target,
    shape: &Shape,
    rate: f64,
    requests: usize,
    deadline: Instant,
    show: bool,
) -> Summary {
    let name = format!("rate {rate}/s");
    let progress = Arc::new(Progress::start(&name, requests, show));
    let mut clock = Words::new(shape.seed ^ 0xA11CE);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..requests {
        if Instant::now() >= deadline {
            break;
        }
        let (target, shape, progress) = (target.clone(), shape.clone(), progress.clone());
        tasks.push(tokio::spawn(async move {
            let mut words = words_for(shape.seed, i, 7919);
            let text = prompt(&mut words, shape.input_words);
            let s = shape.one_shot(&target, text).await;
            progress.tick();
            s
        }));
        tokio::time::sleep(clock.exp_interval(rate)).await;
    }
    let mut samples = Vec::new();
    for t in tasks {
        samples.extend(t.await.ok());
    }
    let summary = Summary::new(name, &samples, started.elapsed().as_secs_f64());
    Summary {
        request_rate: Some(rate),
        ..summary
    }
}

/// `sessions` conversations of `turns` turns each, their turns interleaved on the server, with
/// at most `clients` requests in flight (turns are served in arrival order, so with fewer
/// clients than sessions the sessions take turns round-robin); each turn adds `turn_words` of
/// user text.
#[allow(clippy::too_many_arguments)]
pub async fn multi_turn(
    target: &Target,
    shape: &Shape,
    sessions: usize,
    turns: usize,
    turn_words: usize,
    clients: usize,
    deadline: Instant,
    show: bool,
) -> Summary {
    let name = format!("{sessions}x{turns} turns, {clients} cl");
    let permits = Arc::new(tokio::sync::Semaphore::new(clients.max(1)));
    let progress = Arc::new(Progress::start(&name, sessions * turns, show));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for session in 0..sessions {
        let (target, shape, progress, permits) = (
            target.clone(),
            shape.clone(),
            progress.clone(),
            permits.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut words = words_for(shape.seed, session, 104_729);
            let mut out: Vec<(usize, Sample)> = Vec::new();
            let mut history: Vec<Value> = Vec::new();
            let sid = match shape.api {
                Api::Native => match target.json("POST", "/v1/sessions", Some(&json!({}))).await {
                    Ok(s) => s["id"].as_str().unwrap_or_default().to_string(),
                    Err(e) => {
                        let failed = Sample {
                            error: Some(format!("{e:#}")),
                            ..Sample::default()
                        };
                        return vec![(1, failed)];
                    }
                },
                Api::Openai => String::new(),
            };
            for turn in 1..=turns {
                if Instant::now() >= deadline {
                    break;
                }
                let text = prompt(&mut words, turn_words);
                let Ok(_permit) = permits.acquire().await else {
                    break;
                };
                let sample = match shape.api {
                    Api::Native => {
                        let path = format!("/v1/sessions/{sid}/messages");
                        target
                            .stream(Api::Native, &path, &shape.native_body(&text))
                            .await
                    }
                    Api::Openai => {
                        history.push(json!({"role": "user", "content": text}));
                        let body = shape.openai_body(Value::Array(history.clone()));
                        let s = target
                            .stream(Api::Openai, "/v1/chat/completions", &body)
                            .await;
                        history.push(json!({"role": "assistant", "content": s.text}));
                        s
                    }
                };
                let failed = sample.error.is_some();
                out.push((turn, sample));
                progress.tick();
                if failed {
                    break;
                }
            }
            out
        }));
    }
    let mut samples = Vec::new();
    let mut turn_of = Vec::new();
    for t in tasks {
        for (turn, s) in t.await.unwrap_or_default() {
            turn_of.push(turn);
            samples.push(s);
        }
    }
    Summary::new(name, &samples, started.elapsed().as_secs_f64()).with_turns(&samples, &turn_of)
}
