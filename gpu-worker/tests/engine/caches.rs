//! What the engine keeps between requests: a session's cache (reused, rewound to a common
//! prefix, accounted block by block), the prefix cache a stateless client or another session
//! reuses, and the disk tier an evicted session comes back from.

use hearth_shared::SessionId;
use hearth_worker::engine::{EngineConfig, EngineEvent};

use crate::common::{collect, engine, greedy, prompt, temp_dir, tiny_model, VOCAB};
use crate::settled;

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
    settled(&h, |s| {
        s.running == 0 && s.cached_sessions == 1 && s.kv_blocks_used == 3
    });
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
