//! Engine behaviour over a tiny generated Gemma-3-shaped model: batching equivalence, session
//! caches, errors, cancellation, memory pressure.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use hearth_shared::{FinishReason, SamplingParams, SessionId, UserId};
use hearth_worker::engine::{EngineConfig, EngineError, EngineEvent, GenerateRequest};

const VOCAB: u32 = 512;

fn greedy(id: u64, prompt: Vec<u32>, n: u32) -> GenerateRequest {
    let mut r = GenerateRequest::new(id, prompt, n);
    // Generate exactly `n` tokens.
    r.ignore_eos = true;
    r
}

#[test]
fn a_prompt_alone_and_inside_a_batch_of_eight_gives_identical_tokens() {
    let model = tiny_model();
    let e = engine(model, EngineConfig::default());
    let h = e.handle();
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| prompt(5 + i * 7, i as u32, VOCAB)).collect();
    let solo: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| collect(h.submit(greedy(i as u64, p.clone(), 24)).unwrap()))
        .collect();
    let solo_err: Vec<_> = solo
        .iter()
        .map(|o| (o.error.clone(), o.finish.clone()))
        .collect();
    let alone: Vec<_> = solo.into_iter().map(|o| o.tokens).collect();
    // Submit all eight before reading any: they share the engine's steps.
    let streams: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| h.submit(greedy(100 + i as u64, p.clone(), 24)).unwrap())
        .collect();
    let batched: Vec<_> = streams.into_iter().map(|s| collect(s).tokens).collect();
    for (i, (a, b)) in alone.iter().zip(&batched).enumerate() {
        assert_eq!(a.len(), 24, "solo {i}: {:?}", solo_err[i]);
        assert_eq!(
            a, b,
            "sequence {i} differs between solo and batched decoding"
        );
    }
    // The model's output depends on its input (otherwise this test would prove nothing).
    let distinct: std::collections::HashSet<_> = alone.iter().flatten().collect();
    assert!(
        distinct.len() >= 8,
        "random model output is degenerate: {alone:?}"
    );
    // The prompts (up to 54 tokens) cross the 16-token sliding window of the local layers.
    assert!(prompts[7].len() > 16);
}

#[test]
fn a_turn_served_from_the_session_cache_matches_the_same_prompt_served_cold() {
    let model = tiny_model();
    let e = engine(model.clone(), EngineConfig::default());
    let h = e.handle();
    let session = SessionId::from("s1");
    let turn1 = prompt(30, 1, VOCAB);
    let mut r1 = greedy(1, turn1.clone(), 10);
    r1.session = Some(session.clone());
    let out1 = collect(h.submit(r1).unwrap());
    assert_eq!(out1.cached_tokens, Some(0));

    // Turn 2 extends turn 1's prompt and reply.
    let mut turn2 = turn1.clone();
    turn2.extend(&out1.tokens);
    turn2.extend(prompt(12, 2, VOCAB));
    let mut r2 = greedy(2, turn2.clone(), 10);
    r2.session = Some(session.clone());
    let warm = collect(h.submit(r2).unwrap());
    // Everything but the last generated token (whose K/V was never computed) is reused.
    assert_eq!(
        warm.cached_tokens,
        Some(turn1.len() + out1.tokens.len() - 1)
    );

    // The prefix-cache counters saw both prompts and the reused tokens.
    let stats = h.stats();
    assert_eq!(stats.prefix_cache_queries_tokens, turn1.len() + turn2.len());
    assert_eq!(
        stats.prefix_cache_hits_tokens,
        turn1.len() + out1.tokens.len() - 1
    );

    let cold_engine = engine(model, EngineConfig::default());
    let cold = collect(cold_engine.handle().submit(greedy(3, turn2, 10)).unwrap());
    assert_eq!(cold.cached_tokens, Some(0));
    assert_eq!(warm.tokens, cold.tokens);
    match warm.finish {
        Some(EngineEvent::Finished {
            cached_tokens,
            prompt_tokens,
            completion_tokens,
            ..
        }) => {
            assert_eq!(
                (cached_tokens, completion_tokens),
                (turn1.len() + out1.tokens.len() - 1, 10)
            );
            assert_eq!(prompt_tokens, turn1.len() + out1.tokens.len() + 12);
        }
        other => panic!("expected Finished, got {other:?}"),
    }
}

#[test]
fn a_diverging_prompt_rewinds_to_the_common_prefix() {
    let model = tiny_model();
    let e = engine(model.clone(), EngineConfig::default());
    let h = e.handle();
    let s = SessionId::from("rewind");
    let base = prompt(40, 3, VOCAB);
    let mut r = greedy(1, base.clone(), 4);
    r.session = Some(s.clone());
    collect(h.submit(r).unwrap());
    // Same first 25 tokens, then different: a regenerate/edit of an earlier turn.
    let mut edited = base[..25].to_vec();
    edited.extend(prompt(10, 9, VOCAB));
    let mut r = greedy(2, edited.clone(), 8);
    r.session = Some(s);
    let warm = collect(h.submit(r).unwrap());
    assert_eq!(warm.cached_tokens, Some(25));
    let cold = collect(
        engine(model, EngineConfig::default())
            .handle()
            .submit(greedy(3, edited, 8))
            .unwrap(),
    );
    assert_eq!(warm.tokens, cold.tokens);
}

#[test]
fn bad_requests_get_typed_errors_and_the_engine_keeps_serving() {
    let e = engine(tiny_model(), EngineConfig::default());
    let h = e.handle();
    let cases: Vec<(GenerateRequest, &str)> = vec![
        (greedy(1, vec![], 4), "prompt_token_ids"),
        (greedy(2, vec![5; 1024], 4), "context window"),
        (greedy(3, vec![5, VOCAB + 3], 4), "prompt_token_ids[1]"),
        (
            GenerateRequest {
                params: SamplingParams {
                    temperature: f32::NAN,
                    ..Default::default()
                },
                ..greedy(4, vec![5], 4)
            },
            "temperature",
        ),
        (
            GenerateRequest {
                params: SamplingParams {
                    top_p: 2.0,
                    ..Default::default()
                },
                ..greedy(5, vec![5], 4)
            },
            "top_p",
        ),
        (greedy(6, vec![5], 0), "max_new_tokens"),
        (
            GenerateRequest {
                stop_token_ids: vec![99_999],
                ..greedy(7, vec![5], 4)
            },
            "stop_token_ids",
        ),
    ];
    for (req, needle) in cases {
        let err = h.submit(req).expect_err(needle);
        assert_eq!(
            hearth_worker::server::status::code(&err),
            tonic::Code::InvalidArgument,
            "{err:?}"
        );
        assert!(
            err.to_string().contains(needle),
            "`{err}` should mention `{needle}`"
        );
    }
    let ok = collect(h.submit(greedy(10, prompt(8, 1, VOCAB), 5)).unwrap());
    assert_eq!(ok.tokens.len(), 5);
}

#[test]
fn cancel_and_dropped_streams_free_the_slot() {
    let e = engine(tiny_model(), EngineConfig::default());
    let h = e.handle();
    let rx = h.submit(greedy(1, prompt(10, 1, VOCAB), 100_000)).unwrap();
    let dropped = h.submit(greedy(2, prompt(10, 2, VOCAB), 100_000)).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    drop(dropped);
    h.cancel(hearth_shared::RequestId(1));
    let out = collect(rx);
    assert!(
        matches!(
            out.finish,
            Some(EngineEvent::Finished {
                reason: FinishReason::Cancelled,
                ..
            })
        ),
        "{:?}",
        out.finish
    );
    // The engine notices the dropped stream at its next step.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while h.stats().running > 0 || h.stats().kv_blocks_used > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "slots not freed: {:?}",
            h.stats()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn seeded_sampling_is_reproducible_and_sessions_can_be_dropped() {
    let e = engine(tiny_model(), EngineConfig::default());
    let h = e.handle();
    let req = |id, seed| GenerateRequest {
        params: SamplingParams {
            temperature: 1.0,
            top_p: 0.95,
            top_k: 50,
            min_p: 0.01,
            repetition_penalty: 1.1,
            seed: Some(seed),
        },
        session: Some(SessionId::from("seeded")),
        ..greedy(id, prompt(12, 4, VOCAB), 20)
    };
    let a = collect(h.submit(req(1, 5)).unwrap());
    let b = collect(h.submit(req(2, 5)).unwrap());
    let c = collect(h.submit(req(3, 6)).unwrap());
    assert_eq!(a.tokens, b.tokens);
    assert_ne!(a.tokens, c.tokens);
    assert!(a.logprobs.iter().all(|lp| *lp <= 0.0 && lp.is_finite()));
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        h.drop_session(SessionId::from("seeded")).await.unwrap();
        let err = h.drop_session(SessionId::from("seeded")).await.unwrap_err();
        assert_eq!(err, EngineError::UnknownSession(SessionId::from("seeded")));
    });
}

#[test]
fn memory_pressure_evicts_idle_sessions_then_preempts_and_loses_nothing() {
    let model = tiny_model();
    let block_bytes = hearth_worker::kv::KvStore::block_bytes(
        model.config.num_layers,
        16,
        model.config.kv_dim(),
        model.config.head_dim,
        hearth_worker::kv::KvDtype::default(),
    );
    // Room for 12 blocks (192 tokens): far less than 6 concurrent 60-token sequences need.
    let small = EngineConfig {
        kv_budget_bytes: 12 * block_bytes,
        ..Default::default()
    };
    let reference = engine(model.clone(), EngineConfig::default());
    let e = engine(model, small);
    let h = e.handle();
    // Idle session caches first.
    for i in 0..4 {
        let mut r = greedy(i, prompt(30, i as u32, VOCAB), 2);
        r.session = Some(SessionId::new(format!("idle-{i}")));
        collect(h.submit(r).unwrap());
    }
    assert!(h.stats().cached_sessions >= 1);
    let prompts: Vec<_> = (0..6).map(|i| prompt(20, 50 + i, VOCAB)).collect();
    let streams: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| h.submit(greedy(100 + i as u64, p.clone(), 40)).unwrap())
        .collect();
    let outs: Vec<_> = streams.into_iter().map(collect).collect();
    for (i, (o, p)) in outs.iter().zip(&prompts).enumerate() {
        let want = collect(
            reference
                .handle()
                .submit(greedy(1000 + i as u64, p.clone(), 40))
                .unwrap(),
        );
        assert_eq!(
            o.tokens, want.tokens,
            "sequence {i} changed under memory pressure"
        );
    }
    let s = h.stats();
    assert!(s.session_evictions >= 1, "{s:?}");
    assert!(s.preemptions >= 1, "{s:?}");
    assert!(s.kv_blocks_used <= s.kv_blocks_total);
}

#[test]
fn one_user_with_many_requests_does_not_starve_another() {
    let e = engine(
        tiny_model(),
        EngineConfig {
            max_batch: 2,
            ..Default::default()
        },
    );
    let h = e.handle();
    let mut greedy_user = Vec::new();
    for i in 0..8 {
        let mut r = greedy(i, prompt(10, i as u32, VOCAB), 30);
        r.user = UserId::from("heavy");
        greedy_user.push(h.submit(r).unwrap());
    }
    let mut r = greedy(100, prompt(10, 99, VOCAB), 30);
    r.user = UserId::from("light");
    let light = h.submit(r).unwrap();
    let t0 = std::time::Instant::now();
    let light_out = collect(light);
    let light_done = t0.elapsed();
    assert_eq!(light_out.tokens.len(), 30);
    let heavy_done: Vec<_> = greedy_user.into_iter().map(collect).collect();
    let all_done = t0.elapsed();
    assert!(heavy_done.iter().all(|o| o.tokens.len() == 30));
    // With FIFO the light request would finish last (after all 8 heavy ones); with fair share it
    // takes the slot freed by the first heavy request, long before the heavy queue drains.
    assert!(
        light_done < all_done.mul_f32(0.6),
        "light {light_done:?} vs all {all_done:?}"
    );
}

#[test]
fn safetensors_and_gguf_checkpoints_of_the_same_weights_agree() {
    use hearth_worker::fixtures::{write_tiny_gguf, write_tiny_safetensors, TinySpec};
    use hearth_worker::model::{load_gguf, load_safetensors};
    let spec = TinySpec {
        quantized: false,
        ..TinySpec::default()
    };
    let dir = temp_dir("st");
    write_tiny_safetensors(&dir.join("ckpt"), &spec).unwrap();
    write_tiny_gguf(&dir.join("f32.gguf"), &spec).unwrap();
    let st = std::sync::Arc::new(load_safetensors(&dir.join("ckpt")).unwrap());
    let gg = std::sync::Arc::new(load_gguf(&dir.join("f32.gguf")).unwrap());
    assert_eq!(st.config.num_layers, gg.config.num_layers);
    assert_eq!(st.config.sliding_window, gg.config.sliding_window);
    let p = prompt(30, 5, VOCAB);
    let a = collect(
        engine(st, EngineConfig::default())
            .handle()
            .submit(greedy(1, p.clone(), 16))
            .unwrap(),
    );
    let b = collect(
        engine(gg, EngineConfig::default())
            .handle()
            .submit(greedy(2, p, 16))
            .unwrap(),
    );
    assert_eq!(a.tokens, b.tokens);
    for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
        assert!((x - y).abs() < 1e-3, "{x} vs {y}");
    }
}

#[test]
fn missing_or_corrupt_model_files_are_clear_errors() {
    use hearth_worker::model::{load_gguf, load_safetensors};
    let dir = temp_dir("bad");
    let err = load_gguf(&dir.join("nope.gguf")).unwrap_err().to_string();
    assert!(err.contains("nope.gguf"), "{err}");
    std::fs::write(dir.join("junk.gguf"), b"definitely not gguf").unwrap();
    let err = load_gguf(&dir.join("junk.gguf")).unwrap_err().to_string();
    assert!(err.contains("junk.gguf") && err.contains("GGUF"), "{err}");
    let err = load_safetensors(&dir).unwrap_err().to_string();
    assert!(err.contains("config.json"), "{err}");
}

#[test]
fn stats_account_session_blocks_exactly() {
    let e = engine(tiny_model(), EngineConfig::default());
    let h = e.handle();
    let total = h.stats().kv_blocks_total;
    assert!(total > 0);
    let mut r = greedy(1, prompt(30, 1, VOCAB), 10);
    r.session = Some(SessionId::from("acct"));
    let out = collect(h.submit(r).unwrap());
    assert_eq!(out.tokens.len(), 10);
    // The cache holds the prompt and every generated token but the last: 39 positions, 3 blocks.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = h.stats();
        if s.running == 0 && s.cached_sessions == 1 && s.kv_blocks_used == 3 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{s:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(h.drop_session(SessionId::from("acct")))
        .unwrap();
    let s = h.stats();
    assert_eq!(
        (s.cached_sessions, s.kv_blocks_used, s.kv_blocks_total),
        (0, 0, total)
    );
}

/// The engine's counters once `ok` holds (they are published after each step).
fn settled(
    h: &hearth_worker::engine::EngineHandle,
    ok: impl Fn(&hearth_worker::engine::EngineStats) -> bool,
) -> hearth_worker::engine::EngineStats {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = h.stats();
        if ok(&s) {
            return s;
        }
        assert!(std::time::Instant::now() < deadline, "{s:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_stateless_client_resending_its_history_gets_it_from_the_prefix_cache() {
    let model = tiny_model();
    let e = engine(model.clone(), EngineConfig::default());
    let h = e.handle();
    let turn1 = prompt(50, 11, VOCAB);
    let out1 = collect(h.submit(greedy(1, turn1.clone(), 8)).unwrap());
    assert_eq!(out1.cached_tokens, Some(0));
    // Turn 2 resends turn 1 and its reply, then a new message; no session.
    let mut turn2 = turn1.clone();
    turn2.extend(&out1.tokens);
    turn2.extend(prompt(20, 12, VOCAB));
    let warm = collect(h.submit(greedy(2, turn2.clone(), 10)).unwrap());
    // Every full block of the 57 positions turn 1 computed: 3 blocks of 16.
    assert_eq!(warm.cached_tokens, Some(48));
    let cold = collect(
        engine(model, EngineConfig::default())
            .handle()
            .submit(greedy(3, turn2.clone(), 10))
            .unwrap(),
    );
    assert_eq!(cold.cached_tokens, Some(0));
    assert_eq!(warm.tokens, cold.tokens);
    assert_eq!(warm.logprobs, cold.logprobs);
    // Nothing is referenced once both are done; the cached blocks stay available.
    let s = settled(&h, |s| s.kv_blocks_used == 0 && s.kv_blocks_cached >= 3);
    assert_eq!(s.prefix_cache_queries_tokens, turn1.len() + turn2.len());
    assert_eq!(s.prefix_cache_hits_tokens, 48);
}

#[test]
fn a_new_session_skips_the_system_prompt_another_session_computed() {
    let model = tiny_model();
    let e = engine(model.clone(), EngineConfig::default());
    let h = e.handle();
    let system = prompt(40, 21, VOCAB);
    let ask = |id: u64, session: &str, seed: u32| {
        let mut p = system.clone();
        p.extend(prompt(9, seed, VOCAB));
        let mut r = greedy(id, p.clone(), 6);
        r.session = Some(SessionId::new(session));
        (p, collect(h.submit(r).unwrap()))
    };
    let (_, first) = ask(1, "alice", 22);
    assert_eq!(first.cached_tokens, Some(0));
    let (p, second) = ask(2, "bob", 23);
    // The two full blocks of the shared 40-token system prompt.
    assert_eq!(second.cached_tokens, Some(32));
    let cold = collect(
        engine(model, EngineConfig::default())
            .handle()
            .submit(greedy(3, p, 6))
            .unwrap(),
    );
    assert_eq!(second.tokens, cold.tokens);
    // Both sessions hold the shared blocks: counted once in the used blocks.
    // 49 + 5 = 54 positions each: 4 blocks per session, 2 of them shared and counted once.
    settled(&h, |s| s.cached_sessions == 2 && s.kv_blocks_used == 6);
}

#[test]
fn an_evicted_session_comes_back_from_the_disk_tier_with_the_same_answer() {
    use hearth_worker::engine::DiskConfig;
    let model = tiny_model();
    let c = &model.config;
    let block_bytes = hearth_worker::kv::KvStore::block_bytes(
        c.num_layers,
        16,
        c.kv_dim(),
        c.head_dim,
        hearth_worker::kv::KvDtype::default(),
    );
    let dir = temp_dir("disk");
    let config = EngineConfig {
        // Room for two of the three sessions below (3 blocks each).
        kv_budget_bytes: 8 * block_bytes,
        kv_disk: Some(DiskConfig {
            dir: dir.clone(),
            bytes: 64 * block_bytes as u64,
        }),
        ..Default::default()
    };
    let e = engine(model.clone(), config);
    let h = e.handle();
    let mut history = Vec::new();
    for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
        let p = prompt(40, 30 + i as u32, VOCAB);
        let mut r = greedy(i as u64, p.clone(), 4);
        r.session = Some(SessionId::new(name));
        let out = collect(h.submit(r).unwrap());
        history.push((p, out.tokens));
    }
    let s = settled(&h, |s| s.disk_sessions >= 1);
    assert!(s.session_evictions >= 1, "{s:?}");
    assert!(dir.join("kv-tier.bin").is_file());
    // Session "a" (evicted first) asks its next turn.
    let (p, reply) = &history[0];
    let mut turn2 = p.clone();
    turn2.extend(reply);
    turn2.extend(prompt(10, 39, VOCAB));
    let mut r = greedy(10, turn2.clone(), 8);
    r.session = Some(SessionId::new("a"));
    let warm = collect(h.submit(r).unwrap());
    // All 43 computed positions come back, more than the 2 full blocks the prefix cache could
    // still hold.
    assert_eq!(warm.cached_tokens, Some(43));
    assert_eq!(h.stats().disk_restores, 1);
    let cold = collect(
        engine(model, EngineConfig::default())
            .handle()
            .submit(greedy(11, turn2, 8))
            .unwrap(),
    );
    assert_eq!(warm.tokens, cold.tokens);
    assert_eq!(warm.logprobs, cold.logprobs);
    // Dropping sessions works wherever they live (memory or disk) and forgets them.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    for name in ["b", "c"] {
        rt.block_on(h.drop_session(SessionId::new(name))).unwrap();
    }
    assert_eq!(h.stats().disk_sessions, 0);
    drop(e);
    let _ = std::fs::remove_dir_all(&dir);
}
