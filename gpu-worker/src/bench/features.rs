//! The benchmark's measurements of single features, each against the engine without it:
//! speculation by prompt lookup, warm session caches, the disk tier, constrained decoding.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::*;

/// Single-stream greedy decode of `--decode-tokens` without and with speculation by prompt
/// lookup, on two prompts: 16 arbitrary tokens (what the plain decode run measures; drafts come
/// only from the reply repeating itself), and a 256-token passage followed by its first 32
/// tokens again (a reply that quotes or edits its prompt: the model goes on copying).
pub(super) fn speculation(model: &Weights, o: &BenchOptions) -> anyhow::Result<Value> {
    let vocab = model.config().vocab_size;
    let passage = tokens(256, 7000, vocab);
    let mut quoting = passage.clone();
    quoting.extend_from_slice(&passage[..32]);
    let prompts = [("arbitrary", tokens(16, 3, vocab)), ("quoting", quoting)];
    let mut out = Vec::new();
    for (name, prompt) in &prompts {
        let mut row = json!({ "prompt": name, "prompt_tokens": prompt.len() });
        let mut replies = Vec::new();
        for spec in [0, o.spec_tokens] {
            let engine = start_engine_speculating(model, o, spec)?;
            let h = engine.handle();
            // Warm-up, then the measured run.
            run(
                h.submit(req(1, tokens(32, 1, vocab), 4, None))?,
                Instant::now(),
            );
            let t = Instant::now();
            let r = run(h.submit(req(2, prompt.clone(), o.decode_tokens, None))?, t);
            let tok_s = (r.tokens.len() - 1) as f64 / (r.total - r.ttft).as_secs_f64();
            let stats = h.stats();
            progress(&format!(
                "speculation {spec}, {name} prompt: {tok_s:.1} tok/s, drafted {}, kept {}",
                stats.spec_draft_tokens, stats.spec_accepted_tokens
            ));
            let key = if spec == 0 { "off" } else { "on" };
            row[key] = json!({
                "decode_tok_s": tok_s,
                "draft_tokens": stats.spec_draft_tokens,
                "accepted_tokens": stats.spec_accepted_tokens,
            });
            replies.push(r.tokens);
        }
        row["same_reply"] = json!(replies[0] == replies[1]);
        row["speedup"] = json!(
            row["on"]["decode_tok_s"].as_f64().unwrap_or(0.0)
                / row["off"]["decode_tok_s"].as_f64().unwrap_or(1.0).max(1e-9)
        );
        out.push(row);
    }
    Ok(json!({ "spec_tokens": o.spec_tokens, "runs": out }))
}

/// The KV memory one idle session of `--warm-tokens` tokens holds, as configured (element type,
/// sliding-window packing), against every layer of every position in f32 (the engine before f16
/// K/V and packing).
pub(super) fn warm_sessions(model: &Weights, o: &BenchOptions) -> anyhow::Result<Value> {
    use crate::kv::KvStore;
    let (n, c) = (o.warm_tokens, model.config());
    let engine = start_engine(model, o)?;
    let h = engine.handle();
    let bs = h.model_info().block_size;
    let t = Instant::now();
    run(
        h.submit(req(
            1,
            tokens(n, 7000, c.vocab_size),
            1,
            Some("warm".into()),
        ))?,
        t,
    );
    // Statistics are published after the step that finished the turn.
    let settle = Instant::now();
    while h.stats().cached_sessions == 0 && settle.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let held = h.stats().kv_blocks_used * h.model_info().kv_block_bytes;
    let f32_full = n.div_ceil(bs)
        * KvStore::block_bytes(c.num_layers, bs, c.kv_dim(), c.head_dim, KvDtype::F32);
    drop(engine);
    let per_gb = |bytes: usize| 1e9 / bytes.max(1) as f64;
    progress(&format!(
        "warm sessions: a {n}-token session holds {:.1} MB of KV ({:.1} MB as f32, every layer): {:.1}x the sessions per GB",
        held as f64 / 1e6,
        f32_full as f64 / 1e6,
        f32_full as f64 / held.max(1) as f64
    ));
    Ok(json!({
        "tokens": n,
        "kv_dtype": o.kv_dtype.name(),
        "window_margin": crate::engine::DEFAULT_WINDOW_MARGIN,
        "bytes_held": held,
        "bytes_f32_every_layer": f32_full,
        "sessions_per_gb": per_gb(held),
        "sessions_per_gb_f32_every_layer": per_gb(f32_full),
        "ratio": f32_full as f64 / held.max(1) as f64,
    }))
}

/// A session evicted to the disk tier and restored for its next turn, against the same turn
/// recomputed from scratch (a prompt of the same length that nothing has cached).
pub(super) fn disk_tier(model: &Weights, o: &BenchOptions) -> anyhow::Result<Value> {
    let vocab = model.config().vocab_size;
    let n = o.disk_tokens;
    let block = model.block_bytes(&EngineConfig {
        kv_dtype: o.kv_dtype,
        ..Default::default()
    })?;
    let dir = std::env::temp_dir().join(format!("hearth-bench-kv-{}", std::process::id()));
    // Memory for two such sessions: the third pushes the first out to disk.
    let bs = EngineConfig::default().block_size;
    let blocks = 2 * (n + 64).div_ceil(bs) + 8;
    let engine = Engine::start(
        model.clone(),
        EngineConfig {
            kv_budget_bytes: blocks * block,
            kv_dtype: o.kv_dtype,
            kv_disk: Some(crate::engine::DiskConfig {
                dir: dir.clone(),
                bytes: 4 * blocks as u64 * block as u64,
            }),
            ..Default::default()
        },
    )?;
    let h = engine.handle();
    let mut histories = Vec::new();
    for s in 0..3u64 {
        let p = tokens(n, 5000 + s, vocab);
        let r = run(
            h.submit(req(10 + s, p.clone(), 1, Some(format!("disk-{s}"))))?,
            Instant::now(),
        );
        histories.push((p, r.tokens));
    }
    let spilled = h.stats().disk_sessions;
    let (p, reply) = &histories[0];
    let mut next = p.clone();
    next.extend(reply);
    next.extend(tokens(16, 5999, vocab));
    let t = Instant::now();
    let restored = run(
        h.submit(req(20, next.clone(), 1, Some("disk-0".into())))?,
        t,
    );
    let cold_prompt = tokens(next.len(), 6000, vocab);
    let t = Instant::now();
    let cold = run(h.submit(req(21, cold_prompt, 1, None))?, t);
    let restores = h.stats().disk_restores;
    drop(engine);
    let _ = std::fs::remove_dir_all(&dir);
    let (a, b) = (
        restored.ttft.as_secs_f64() * 1e3,
        cold.ttft.as_secs_f64() * 1e3,
    );
    progress(&format!(
        "disk tier: {}-token turn restored in {a:.0} ms, recomputed in {b:.0} ms",
        next.len()
    ));
    Ok(json!({
        "prompt_tokens": next.len(),
        "sessions_spilled": spilled,
        "restores": restores,
        "restored_cached_tokens": restored.cached,
        "ttft_ms_restored": a,
        "ttft_ms_recomputed": b,
        "speedup": b / a.max(1e-9),
    }))
}

/// What constrained decoding and DRY cost: `--grammar-streams` sequences generate
/// `--batch-tokens` tokens each, greedy: free; each constrained to a JSON Schema that cannot be
/// complete before then (an array of at least 100 small objects), so every token is masked; and
/// with DRY on (`dry_multiplier` 0.8, its whole context searched every step).
pub(super) fn constrained(
    model: &Weights,
    model_path: &std::path::Path,
    o: &BenchOptions,
) -> anyhow::Result<Value> {
    use crate::engine::constraint::{Grammars, Vocabulary};
    use crate::engine::mask_threads;
    let vocab = Vocabulary::from_gguf(model_path).map_err(anyhow::Error::msg)?;
    let t = Instant::now();
    let grammars = Grammars::for_model(vocab, model, mask_threads()).map_err(anyhow::Error::msg)?;
    grammars.ready().map_err(anyhow::Error::msg)?;
    let setup_ms = t.elapsed().as_secs_f64() * 1e3;
    let engine = Engine::start(
        model.clone(),
        EngineConfig {
            kv_budget_bytes: o.kv_budget_mb << 20,
            kv_dtype: o.kv_dtype,
            spec_tokens: 0,
            grammars: Some(std::sync::Arc::new(grammars)),
            ..Default::default()
        },
    )?;
    let h = engine.handle();
    let schema = json!({"type": "array", "minItems": 100, "items": {"type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12}},
        "required": ["id", "name"], "additionalProperties": false}});
    let grammar = hearth_shared::Grammar::JsonSchema { schema };
    let vocab_n = model.config().vocab_size;
    let mut id = 0u64;
    let mut rows = Vec::new();
    const KEYS: [&str; 3] = ["free", "json_schema", "dry"];
    // The machine's noise is larger than the costs measured: three rounds, the variants
    // interleaved, and each variant's median.
    const ROUNDS: usize = 3;
    for &n in &o.grammar_streams {
        let mut row = json!({ "concurrency": n, "rounds": ROUNDS });
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); KEYS.len()];
        for (round, k) in (0..ROUNDS).flat_map(|r| (0..KEYS.len()).map(move |k| (r, k))) {
            let key = KEYS[k];
            let t = Instant::now();
            let streams = (0..n)
                .map(|i| {
                    id += 1;
                    let prompt = tokens(16, 300 + i as u64, vocab_n);
                    let mut r = req(id, prompt, o.batch_tokens, None);
                    match key {
                        "json_schema" => r.grammar = Some(grammar.clone()),
                        "dry" => r.params.dry_multiplier = 0.8,
                        _ => {}
                    }
                    h.submit(r)
                })
                .collect::<Result<Vec<_>, _>>()?;
            let runs = run_all(streams, t);
            let wall = t.elapsed().as_secs_f64();
            let generated: usize = runs.iter().map(|r| r.tokens.len()).sum();
            let tok_s = generated as f64 / wall;
            progress(&format!(
                "{n} streams, {key}, round {}: {tok_s:.1} tok/s",
                round + 1
            ));
            rates[k].push(tok_s);
            row[key] = json!({ "generated_tokens": generated });
        }
        for (k, key) in KEYS.iter().enumerate() {
            let median = percentile(&mut rates[k], 0.5);
            row[*key]["aggregate_tok_s"] = json!(median);
            row[*key]["rounds_tok_s"] = json!(rates[k]);
        }
        let free = row["free"]["aggregate_tok_s"]
            .as_f64()
            .unwrap_or(1.0)
            .max(1e-9);
        for key in ["json_schema", "dry"] {
            let ratio = row[key]["aggregate_tok_s"].as_f64().unwrap_or(0.0) / free;
            row[key]["throughput_ratio"] = json!(ratio);
            row[key]["cost_pct"] = json!((1.0 - ratio) * 100.0);
        }
        rows.push(row);
    }
    Ok(json!({ "mask_threads": mask_threads(), "setup_ms": setup_ms, "runs": rows }))
}
