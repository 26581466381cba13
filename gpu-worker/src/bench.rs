//! `hearth-worker bench`: load time, memory, prefill, single-stream and batched decode, and
//! multi-turn time to first token with and without session reuse. Prints one JSON document.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use hearth_shared::SessionId;
use serde_json::{json, Value};

use crate::engine::{Engine, EngineConfig, EngineEvent, EventStream, GenerateRequest, Weights};
use crate::kv::KvDtype;
use crate::server::config::RunOn;
use features::{constrained, disk_tier, speculation, warm_sessions};

mod features;

/// Options of a benchmark run (also the `hearth-worker bench` flags).
#[derive(Debug, Clone, clap::Args)]
pub struct BenchOptions {
    /// GGUF model file (default: the fetched Gemma 3 270M in the models directory).
    #[arg(long, env = "HEARTH_MODEL")]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub run_on: RunOn,
    /// Prompt length of the prefill measurement.
    #[arg(long, default_value_t = 512)]
    pub prefill_tokens: usize,
    /// Tokens generated in the single-stream decode measurement.
    #[arg(long, default_value_t = 128)]
    pub decode_tokens: u32,
    /// Concurrent sequences for the batched decode runs.
    #[arg(long, default_value = "1,4,16,64", value_delimiter = ',')]
    pub concurrency: Vec<usize>,
    /// Tokens generated per sequence in the batched runs.
    #[arg(long, default_value_t = 64)]
    pub batch_tokens: u32,
    /// Sequences decoding while a prompt of `--prefill-tokens` arrives (the interference run:
    /// their inter-token gaps before and during its prefill); 0 skips it.
    #[arg(long, default_value_t = 8)]
    pub interference_streams: usize,
    /// The engine's `--prefill-share` (prompt work per step beside decoding sequences).
    #[arg(long, default_value_t = 1.0)]
    pub prefill_share: f64,
    /// Interleaved session counts for the multi-turn runs.
    #[arg(long, default_value = "1,32", value_delimiter = ',')]
    pub sessions: Vec<usize>,
    /// Turns per session in the multi-turn runs.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    pub turns: u32,
    /// New user tokens per turn.
    #[arg(long, default_value_t = 120)]
    pub turn_tokens: usize,
    /// Reply tokens per turn.
    #[arg(long, default_value_t = 32)]
    pub reply_tokens: u32,
    /// Length of the idle session whose KV memory is measured (warm sessions per GB); 0 skips it.
    #[arg(long, default_value_t = 4000)]
    pub warm_tokens: usize,
    /// History length of the disk-tier measurement (restore vs recompute); 0 skips it.
    #[arg(long, default_value_t = 2000)]
    pub disk_tokens: usize,
    /// Element type of stored K/V.
    #[arg(long, value_enum, default_value_t = KvDtype::F16)]
    pub kv_dtype: KvDtype,
    /// KV budget in MiB.
    #[arg(long, env = "HEARTH_KV_BUDGET_MB", default_value_t = 4096)]
    pub kv_budget_mb: usize,
    /// Concurrent sequences of the constrained-decoding and DRY runs (each against the same
    /// number of free ones); `--grammar-streams` with no value skips them.
    #[arg(long, default_value = "1,16", value_delimiter = ',', num_args = 0..)]
    pub grammar_streams: Vec<usize>,
    /// Draft tokens of the speculation runs (the engine's `--spec-tokens`); 0 skips them. The
    /// other measurements run without speculation, like llama-bench.
    #[arg(long, default_value_t = 4)]
    pub spec_tokens: usize,
}

/// Deterministic "ordinary" token ids (clear of the special tokens at the start of the vocabulary).
fn tokens(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    crate::fixtures::xorshift(seed)
        .take(n)
        .map(|s| (1000 + s % (vocab as u64 / 2)) as u32)
        .collect()
}

struct Run {
    tokens: Vec<u32>,
    ttft: Duration,
    total: Duration,
    cached: usize,
}

fn run(rx: EventStream, start: Instant) -> Run {
    let mut rx = rx;
    let mut out = Run {
        tokens: Vec::new(),
        ttft: Duration::ZERO,
        total: Duration::ZERO,
        cached: 0,
    };
    while let Some(e) = rx.blocking_recv() {
        match e {
            EngineEvent::Started { cached_tokens, .. } => out.cached = cached_tokens,
            EngineEvent::Token { id, .. } => {
                if out.tokens.is_empty() {
                    out.ttft = start.elapsed();
                }
                out.tokens.push(id);
            }
            EngineEvent::Finished { .. } | EngineEvent::Error(_) => break,
        }
    }
    out.total = start.elapsed();
    out
}

/// Reads every stream at once, so each one's first-token time is when it was produced.
fn run_all(streams: Vec<EventStream>, start: Instant) -> Vec<Run> {
    std::thread::scope(|scope| {
        let readers: Vec<_> = streams
            .into_iter()
            .map(|s| scope.spawn(move || run(s, start)))
            .collect();
        readers.into_iter().filter_map(|r| r.join().ok()).collect()
    })
}

/// A request that generates exactly `n` tokens.
fn req(id: u64, prompt: Vec<u32>, n: u32, session: Option<String>) -> GenerateRequest {
    let mut r = GenerateRequest::new(id, prompt, n);
    r.ignore_eos = true;
    r.session = session.map(SessionId::new);
    r
}

fn percentile(xs: &mut [f64], p: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    xs[((xs.len() - 1) as f64 * p).round() as usize]
}

fn progress(msg: &str) {
    eprintln!("bench: {msg}");
}

/// Runs every measurement on the model at `model` and returns the JSON report.
pub fn run_bench(model_path: &std::path::Path, o: &BenchOptions) -> anyhow::Result<Value> {
    let turns = o.turns as usize;
    o.run_on.check(o.kv_dtype)?;
    let device = o.run_on.select_device()?;
    let rss_before = crate::device::rss_bytes();
    let t = Instant::now();
    let model = crate::server::load_weights(model_path, &o.run_on, &device)?;
    let load_s = t.elapsed().as_secs_f64();
    let rss_loaded = crate::device::rss_bytes();
    let memory_loaded = device.memory();
    progress(&format!(
        "loaded {} in {load_s:.2}s on {}:{} ({}) for the {} forward pass, rss {} MB",
        model_path.display(),
        device.kind,
        device.ordinal,
        device.name,
        model.forward_pass(),
        rss_loaded >> 20
    ));
    let vocab = model.config().vocab_size;
    let engine = start_engine(&model, o)?;
    // With the engine started, its KV budget reserved and nothing run yet: a worker at idle.
    let rss_idle = crate::device::rss_bytes();
    progress(&format!(
        "engine started ({} MiB KV budget), rss {} MB",
        o.kv_budget_mb,
        rss_idle >> 20
    ));
    let h = engine.handle();
    let mut id = 0u64;
    let mut next = || {
        id += 1;
        id
    };

    // Warm-up: first touches of weights and thread pools.
    run(
        h.submit(req(next(), tokens(32, 1, vocab), 4, None))?,
        Instant::now(),
    );

    let t = Instant::now();
    let r = run(
        h.submit(req(next(), tokens(o.prefill_tokens, 2, vocab), 1, None))?,
        t,
    );
    let prefill_tok_s = o.prefill_tokens as f64 / r.ttft.as_secs_f64();
    progress(&format!(
        "prefill {} tokens: {prefill_tok_s:.0} tok/s",
        o.prefill_tokens
    ));

    // The device pass's operations per decode step: a request of one token (one step, its
    // prompt's) against one of `decode_tokens` (that step and the decode steps).
    let ops_before = model.device_ops();
    run(
        h.submit(req(next(), tokens(16, 4, vocab), 1, None))?,
        Instant::now(),
    );
    let ops_prompt = model.device_ops();
    let t = Instant::now();
    let r = run(
        h.submit(req(next(), tokens(16, 3, vocab), o.decode_tokens, None))?,
        t,
    );
    let decode_tok_s = (r.tokens.len() - 1) as f64 / (r.total - r.ttft).as_secs_f64();
    progress(&format!("single-stream decode: {decode_tok_s:.1} tok/s"));
    let device_ops = match (ops_before, ops_prompt, model.device_ops()) {
        (Some(a), Some(b), Some(c)) if r.tokens.len() > 1 => {
            let (prompt, whole) = (b.since(a), c.since(b));
            let steps = (r.tokens.len() - 1) as f64;
            let per = |x: usize, y: usize| x.saturating_sub(y) as f64 / steps;
            Some(json!({
                "per_decode_step": per(whole.total(), prompt.total()),
                "kernels_per_decode_step": per(whole.kernels, prompt.kernels),
                "copies_per_decode_step": per(whole.copies, prompt.copies),
                "per_decode_step_per_layer":
                    per(whole.total(), prompt.total()) / model.config().num_layers as f64,
            }))
        }
        _ => None,
    };

    let mut batched = Vec::new();
    for &n in &o.concurrency {
        let t = Instant::now();
        let streams: Vec<_> = (0..n)
            .map(|i| {
                h.submit(req(
                    next(),
                    tokens(16, 100 + i as u64, vocab),
                    o.batch_tokens,
                    None,
                ))
            })
            .collect::<Result<_, _>>()?;
        let runs = run_all(streams, t);
        let wall = t.elapsed().as_secs_f64();
        let generated: usize = runs.iter().map(|r| r.tokens.len()).sum();
        let last_first = runs
            .iter()
            .map(|r| r.ttft)
            .max()
            .unwrap_or_default()
            .as_secs_f64();
        let agg = generated as f64 / wall;
        progress(&format!("{n} concurrent: {agg:.1} tok/s aggregate"));
        batched.push(json!({
            "concurrency": n,
            "generated_tokens": generated,
            "wall_s": wall,
            "aggregate_tok_s": agg,
            "decode_phase_tok_s": (generated - n) as f64 / (wall - last_first).max(1e-9),
        }));
    }

    let interference = if o.interference_streams > 0 {
        Some(interference(&h, o, vocab, &mut next)?)
    } else {
        None
    };

    let mut multi = Vec::new();
    for &sessions in &o.sessions {
        progress(&format!(
            "multi-turn: {sessions} sessions x {} turns, reuse on",
            turns
        ));
        let mut history: Vec<Vec<u32>> = vec![Vec::new(); sessions];
        let mut last_turn_prompts = Vec::new();
        let (mut ttft_by_turn, mut cached_last) = (vec![Vec::new(); turns], Vec::new());
        for (turn, turn_ttfts) in ttft_by_turn.iter_mut().enumerate() {
            for (s, hist) in history.iter_mut().enumerate() {
                hist.extend(tokens(o.turn_tokens, (s * 1000 + turn) as u64, vocab));
                if turn + 1 == turns {
                    last_turn_prompts.push(hist.clone());
                }
                let t = Instant::now();
                let session = format!("bench-{sessions}-{s}");
                let r = run(
                    h.submit(req(next(), hist.clone(), o.reply_tokens, Some(session)))?,
                    t,
                );
                turn_ttfts.push(r.ttft.as_secs_f64() * 1e3);
                if turn + 1 == turns {
                    cached_last.push(r.cached as f64 / hist.len() as f64);
                }
                hist.extend(&r.tokens);
            }
        }
        // Without reuse the turn's whole history is prefilled: prompts of the same length that
        // nothing has cached (the last turns' own prompts would be served by the prefix cache).
        // The cost does not depend on how many sessions exist, so a few suffice.
        progress("multi-turn: reuse off");
        let mut cold = Vec::new();
        for (i, p) in last_turn_prompts.iter().take(4).enumerate() {
            let fresh = tokens(p.len(), (90_000 + sessions * 10 + i) as u64, vocab);
            let t = Instant::now();
            cold.push(
                run(h.submit(req(next(), fresh, 1, None))?, t)
                    .ttft
                    .as_secs_f64()
                    * 1e3,
            );
        }
        let last = &mut ttft_by_turn[turns - 1];
        let prompt_len =
            last_turn_prompts.iter().map(Vec::len).sum::<usize>() / last_turn_prompts.len().max(1);
        multi.push(json!({
            "sessions": sessions,
            "turns": turns,
            "last_turn_prompt_tokens": prompt_len,
            "last_turn_cached_ratio": cached_last.iter().sum::<f64>() / cached_last.len().max(1) as f64,
            "last_turn_ttft_ms_reuse_on": { "p50": percentile(last, 0.5), "p95": percentile(last, 0.95), "max": percentile(last, 1.0) },
            "last_turn_ttft_ms_reuse_off": { "p50": percentile(&mut cold, 0.5), "max": percentile(&mut cold, 1.0) },
            "ttft_ms_p50_by_turn_reuse_on": ttft_by_turn.iter_mut().map(|v| percentile(v, 0.5)).collect::<Vec<_>>(),
            "session_evictions": h.stats().session_evictions,
        }));
    }

    let stats = h.stats();
    drop(engine);
    let speculation = if o.spec_tokens > 0 {
        Some(speculation(&model, o)?)
    } else {
        None
    };
    let warm = if o.warm_tokens > 0 {
        Some(warm_sessions(&model, o)?)
    } else {
        None
    };
    let disk = if o.disk_tokens > 0 {
        Some(disk_tier(&model, o)?)
    } else {
        None
    };
    let constrained = if o.grammar_streams.is_empty() {
        None
    } else {
        Some(constrained(&model, model_path, o)?)
    };
    Ok(json!({
        "model": model_path.display().to_string(),
        "architecture": model.config().architecture,
        "device": {
            "kind": device.kind,
            "ordinal": device.ordinal,
            "name": device.name,
            "compute_capability": device.compute_capability,
            // Process memory on the CPU, device memory on a GPU, once the weights are loaded.
            "memory_total_mb": memory_loaded.total_bytes >> 20,
            "memory_used_mb_loaded": memory_loaded.used_bytes >> 20,
        },
        "forward": model.forward_pass(),
        "dense_gemm_tokens": o.run_on.dense_gemm_tokens,
        "kernel_isa": format!("{:?}", crate::kernels::kernel_isa()),
        "amx": crate::kernels::amx().to_string(),
        "compiled_with_avx512": cfg!(target_feature = "avx512f"),
        "compiled_with_avx2": cfg!(target_feature = "avx2"),
        "threads": rayon::current_num_threads(),
        "load_s": load_s,
        "rss_mb_before_load": rss_before >> 20,
        "rss_mb_loaded": rss_loaded >> 20,
        "rss_mb_engine_idle": rss_idle >> 20,
        "weights_mb": model.weights_bytes() >> 20,
        "prefill": { "prompt_tokens": o.prefill_tokens, "tok_s": prefill_tok_s },
        "decode_single_stream_tok_s": decode_tok_s,
        "device_ops": device_ops,
        "batched_decode": batched,
        "prefill_interference": interference,
        "multi_turn": multi,
        "speculation": speculation,
        "warm_sessions": warm,
        "disk_tier": disk,
        "constrained": constrained,
        "engine": {
            "kv_dtype": o.kv_dtype.name(),
            "kv_blocks_total": stats.kv_blocks_total,
            "kv_block_bytes": h.model_info().kv_block_bytes,
            "preemptions": stats.preemptions,
            "prefix_cache_queries_tokens": stats.prefix_cache_queries_tokens,
            "prefix_cache_hits_tokens": stats.prefix_cache_hits_tokens,
        },
    }))
}

/// What a long prompt arriving does to sequences already decoding: `interference_streams`
/// sequences decode; once each has streamed 8 tokens a `prefill_tokens` prompt arrives. Reports
/// their inter-token gaps before it arrived and while it was prefilled (until its first token),
/// and its time to first token.
fn interference(
    h: &crate::engine::EngineHandle,
    o: &BenchOptions,
    vocab: usize,
    next: &mut impl FnMut() -> u64,
) -> anyhow::Result<Value> {
    let n = o.interference_streams;
    progress(&format!(
        "interference: {n} decoding, a {}-token prompt arrives",
        o.prefill_tokens
    ));
    let streams: Vec<_> = (0..n)
        .map(|i| {
            h.submit(req(
                next(),
                tokens(16, 500 + i as u64, vocab),
                100_000,
                None,
            ))
        })
        .collect::<Result<_, _>>()?;
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (arrival, first) = std::thread::scope(|scope| -> anyhow::Result<_> {
        let readers: Vec<_> = streams
            .into_iter()
            .map(|mut s| {
                let (tx, stop) = (tx.clone(), &stop);
                scope.spawn(move || {
                    let mut times = Vec::new();
                    while let Some(e) = s.blocking_recv() {
                        match e {
                            EngineEvent::Token { .. } => {
                                times.push(Instant::now());
                                if times.len() == 8 {
                                    let _ = tx.send(());
                                }
                                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                                    break;
                                }
                            }
                            EngineEvent::Finished { .. } | EngineEvent::Error(_) => break,
                            EngineEvent::Started { .. } => {}
                        }
                    }
                    times
                })
            })
            .collect();
        drop(tx);
        for _ in 0..n {
            rx.recv()?;
        }
        let arrival = Instant::now();
        let long = run(
            h.submit(req(next(), tokens(o.prefill_tokens, 7, vocab), 1, None))?,
            arrival,
        );
        let first = arrival + long.ttft;
        // One more gap after the prefill, then the decoding streams are dropped (cancelled).
        std::thread::sleep(Duration::from_millis(200));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let times: Vec<Vec<Instant>> = readers.into_iter().filter_map(|r| r.join().ok()).collect();
        Ok(((arrival, first, long.ttft), times))
    })?;
    let ((arrival, done, ttft), times) = (arrival, first);
    let (mut before, mut during) = (Vec::new(), Vec::new());
    for t in &times {
        for w in t.windows(2) {
            let gap = (w[1] - w[0]).as_secs_f64() * 1e3;
            if w[1] <= arrival {
                before.push(gap);
            } else if w[0] < done {
                during.push(gap);
            }
        }
    }
    let p50 = percentile(&mut before, 0.5);
    let worst = percentile(&mut during, 1.0);
    progress(&format!(
        "interference: gaps {p50:.0} ms before, up to {worst:.0} ms during; TTFT {:.0} ms",
        ttft.as_secs_f64() * 1e3
    ));
    Ok(json!({
        "decoding_streams": n,
        "prompt_tokens": o.prefill_tokens,
        "itl_ms_before_p50": p50,
        "itl_ms_during_p50": percentile(&mut during, 0.5),
        "itl_ms_during_max": worst,
        "max_over_p50_before": worst / p50.max(1e-9),
        "prompt_ttft_ms": ttft.as_secs_f64() * 1e3,
    }))
}

/// An engine with the benchmark's KV budget and element type, no speculation, other settings at
/// their defaults.
fn start_engine(model: &Weights, o: &BenchOptions) -> anyhow::Result<Engine> {
    start_engine_speculating(model, o, 0)
}

fn start_engine_speculating(
    model: &Weights,
    o: &BenchOptions,
    spec_tokens: usize,
) -> anyhow::Result<Engine> {
    Ok(Engine::start(
        model.clone(),
        EngineConfig {
            kv_budget_bytes: o.kv_budget_mb << 20,
            kv_dtype: o.kv_dtype,
            prefill_share: o.prefill_share,
            spec_tokens,
            ..Default::default()
        },
    )?)
}
