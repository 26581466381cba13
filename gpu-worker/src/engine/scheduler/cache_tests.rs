//! The K/V cache through whole steps over the tiny model: shared prefix blocks never written,
//! copy-on-write on a rewind, eviction under pressure, packed history, the disk tier, and the
//! prefix cache kept per user. Each answer is checked against a cold run's.

use super::*;

#[test]
fn shared_prefix_blocks_are_never_written_and_answers_match_cold_ones() {
    let model = tiny();
    let mut s = Scheduler::new(model.clone(), EngineConfig::default()).unwrap();
    let base = prompt(40, 1);
    let mut a = submit(&mut s, 1, base.clone(), 4, None);
    drain(&mut s, |_| {});
    assert_eq!(outcome(&mut a).0, 0);
    // A stateless request leaves its full blocks (43 positions computed: two) in the prefix
    // cache, unreferenced; its partial last block is freed.
    assert_eq!((s.kv.alloc().used(), s.kv.alloc().cached()), (0, 2));
    let shared =
        s.kv.alloc()
            .lookup_prefix(&Chain::private("anonymous"), &base[..32], BS);
    assert_eq!(shared.len(), 2);
    let before = contents(&s, &shared);

    // Two requests at once share those blocks and write only their own.
    let prompts: Vec<Vec<u32>> = (0..2)
        .map(|i| {
            let mut p = base[..32].to_vec();
            p.extend(prompt(20, 10 + i));
            p
        })
        .collect();
    let mut rx: Vec<Events> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| submit(&mut s, 10 + i as u64, p.clone(), 12, None))
        .collect();
    let mut saw_sharing = false;
    drain(&mut s, |s| {
        if s.running.len() == 2 {
            for q in &s.running {
                assert_eq!(q.blocks[..2], shared[..]);
            }
            assert!(shared.iter().all(|&b| s.kv.alloc().refs(b) == 2));
            saw_sharing = true;
        }
        assert!(contents(s, &shared) == before, "a shared block was written");
    });
    assert!(saw_sharing);
    for (p, rx) in prompts.iter().zip(&mut rx) {
        let (cached, tokens) = outcome(rx);
        assert_eq!(cached, 32);
        assert_eq!(tokens, cold(&model, p.clone(), 12));
    }
    assert_eq!(s.kv.alloc().used(), 0);
    assert_eq!(s.stats().prefix_cache_hits_tokens, 64);
}

#[test]
fn rewinding_a_session_into_a_registered_block_copies_it_first() {
    let model = tiny();
    let mut s = Scheduler::new(model.clone(), EngineConfig::default()).unwrap();
    let base = prompt(40, 3);
    let mut a = submit(&mut s, 1, base.clone(), 4, Some("s"));
    drain(&mut s, |_| {});
    outcome(&mut a);
    let shared =
        s.kv.alloc()
            .lookup_prefix(&Chain::private("anonymous"), &base[..32], BS);
    assert_eq!(shared.len(), 2);
    let before = contents(&s, &shared);
    // An edit at token 25 rewinds into the second (registered) block.
    let mut edited = base[..25].to_vec();
    edited.extend(prompt(10, 9));
    let mut b = submit(&mut s, 2, edited.clone(), 8, Some("s"));
    s.step();
    audit(&s);
    let q = &s.running[0];
    assert_eq!(q.blocks[0], shared[0], "the untouched first block is kept");
    assert_ne!(q.blocks[1], shared[1], "the block written into is a copy");
    drain(&mut s, |s| assert!(contents(s, &shared) == before));
    let (cached, tokens) = outcome(&mut b);
    assert_eq!(cached, 25);
    assert_eq!(tokens, cold(&model, edited, 8));
    // The original chain is still in the prefix cache and still right.
    let mut again = base[..32].to_vec();
    again.extend(prompt(5, 4));
    let mut c = submit(&mut s, 3, again.clone(), 6, None);
    drain(&mut s, |_| {});
    let (cached, tokens) = outcome(&mut c);
    assert_eq!(cached, 32);
    assert_eq!(tokens, cold(&model, again, 6));
}

#[test]
fn under_memory_pressure_eviction_never_frees_a_referenced_block() {
    let model = tiny();
    let block_bytes = block_bytes(&model);
    let mut s = Scheduler::new(
        model.clone(),
        EngineConfig {
            kv_budget_bytes: 14 * block_bytes,
            ..Default::default()
        },
    )
    .unwrap();
    let system = prompt(32, 7);
    let mut streams = Vec::new();
    // Sessions and stateless requests sharing a system prompt, more than memory holds at once.
    for i in 0..8u32 {
        let mut p = system.clone();
        p.extend(prompt(10 + i as usize, 20 + i));
        let session = (i % 2 == 0).then(|| format!("s{i}"));
        streams.push((
            p.clone(),
            submit(&mut s, i as u64, p, 30, session.as_deref()),
        ));
    }
    drain(&mut s, |s| {
        for q in &s.running {
            // Every block a running sequence reads is referenced (never free, never cached).
            let held = q.blocks.iter().chain(&q.packed).filter(|&&b| b != NO_BLOCK);
            assert!(held.into_iter().all(|&b| s.kv.alloc().refs(b) > 0));
        }
    });
    assert!(s.preemptions > 0 || s.kv.counts().evictions > 0);
    for (p, mut rx) in streams {
        let (_, tokens) = outcome(&mut rx);
        assert_eq!(tokens, cold(&model, p, 30));
    }
}

#[test]
fn packed_history_answers_like_the_full_history_in_fewer_blocks() {
    let model = tiny();
    let run = |config: EngineConfig| {
        let mut s = Scheduler::new(model.clone(), config).unwrap();
        let first = prompt(300, 5);
        let mut a = submit(&mut s, 1, first.clone(), 60, Some("s"));
        drain(&mut s, |_| {});
        let (_, reply) = outcome(&mut a);
        let held = s.kv.alloc().used();
        let packed = s.kv.sessions()[&SessionId::from("s")].packed.len();
        let mut second = first;
        second.extend(&reply);
        second.extend(prompt(20, 6));
        let mut b = submit(&mut s, 2, second, 30, Some("s"));
        drain(&mut s, |_| {});
        let (cached, reply2) = outcome(&mut b);
        (reply, held, packed, cached, reply2)
    };
    let full = run(unpacked());
    let packed = run(packing(8));
    // 359 positions: 23 blocks whole; packed, positions below 336 (21 blocks) become 7 packed
    // blocks, and 2 blocks stay whole.
    assert_eq!((full.1, full.2), (23, 0));
    assert_eq!((packed.1, packed.2), (9, 7));
    assert_eq!(packed.0, full.0, "first reply");
    assert_eq!(
        (packed.3, full.3),
        (359, 359),
        "the second turn resumes from the cache"
    );
    assert_eq!(packed.4, full.4, "second reply");
}

#[test]
fn rewinds_within_the_margin_resume_and_deeper_ones_recompute_the_same_answer() {
    let model = tiny();
    let mut s = Scheduler::new(model.clone(), packing(48)).unwrap();
    let first = prompt(300, 8);
    let mut a = submit(&mut s, 1, first.clone(), 40, Some("s"));
    drain(&mut s, |_| {});
    let (_, reply) = outcome(&mut a);
    assert_eq!(s.kv.sessions()[&SessionId::from("s")].packed.len(), 5);
    // Regenerating the reply rewinds 40 tokens, within the 48-token margin.
    let mut b = submit(&mut s, 2, first.clone(), 40, Some("s"));
    drain(&mut s, |_| {});
    assert_eq!(outcome(&mut b), (299, reply));
    // An edit at token 100 is inside the packed history: the session cache cannot serve it, but
    // the blocks packing let go are still in the prefix cache.
    let mut edited = first[..100].to_vec();
    edited.extend(prompt(30, 9));
    let mut c = submit(&mut s, 3, edited.clone(), 20, Some("s"));
    drain(&mut s, |_| {});
    let (cached, tokens) = outcome(&mut c);
    assert_eq!(cached, 96);
    assert_eq!(tokens, cold(&model, edited, 20));
}

#[test]
fn a_packed_session_spills_to_disk_and_comes_back_whole() {
    let model = tiny();
    let block_bytes = block_bytes(&model);
    let dir = std::env::temp_dir().join(format!("hearth-sched-disk-{}", std::process::id()));
    let mut s = Scheduler::new(
        model.clone(),
        EngineConfig {
            // Two idle packed sessions (9 blocks each) and a third one's prefill (19 blocks) do
            // not fit: the oldest goes to disk.
            kv_budget_bytes: 30 * block_bytes,
            kv_disk: Some(crate::engine::DiskConfig {
                dir: dir.clone(),
                bytes: 100 * block_bytes as u64,
            }),
            ..packing(8)
        },
    )
    .unwrap();
    let mut history = Vec::new();
    for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
        let p = prompt(300, 40 + i as u32);
        let mut rx = submit(&mut s, i as u64, p.clone(), 4, Some(name));
        drain(&mut s, |_| {});
        history.push((p, outcome(&mut rx).1));
    }
    assert_eq!(s.stats().disk_sessions, 1);
    let (p, reply) = &history[0];
    let mut turn2 = p.clone();
    turn2.extend(reply);
    turn2.extend(prompt(10, 49));
    let mut rx = submit(&mut s, 10, turn2.clone(), 8, Some("a"));
    drain(&mut s, |_| {});
    let (cached, tokens) = outcome(&mut rx);
    assert_eq!(s.stats().disk_restores, 1);
    assert_eq!(cached, 303, "every computed position came back");
    assert_eq!(tokens, cold(&model, turn2, 8));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_prefix_cache_never_matches_another_users_prompt() {
    let model = tiny();
    let mut s = Scheduler::new(model.clone(), EngineConfig::default()).unwrap();
    let run = |s: &mut Scheduler, id: u64, user: &str, p: &[u32]| {
        let mut r = GenerateRequest::new(id, p.to_vec(), 4);
        r.ignore_eos = true;
        r.user = hearth_shared::UserId::from(user);
        let v = validate(r, &s.model_info()).unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        s.enqueue(v, tx);
        drain(s, |_| {});
        outcome(&mut rx)
    };
    let secret = prompt(40, 21);
    let (cached, alice_tokens) = run(&mut s, 1, "alice", &secret);
    assert_eq!(cached, 0);
    // Bob sends Alice's exact prompt: nothing of hers is his, so nothing is cached for him.
    let (cached, bob_tokens) = run(&mut s, 2, "bob", &secret);
    assert_eq!(cached, 0, "another user's prompt matched the prefix cache");
    assert_eq!(bob_tokens, alice_tokens, "the same answer, computed afresh");
    // Alice again: her own blocks are still there for her.
    let (cached, _) = run(&mut s, 3, "alice", &secret);
    assert_eq!(cached, 32);
    audit(&s);
}
