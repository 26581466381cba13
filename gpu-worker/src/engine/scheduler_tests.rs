//! The scheduler driven step by step over a tiny model: prefix sharing, copy-on-write, eviction,
//! with the block bookkeeping audited after every step.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use hearth_shared::SessionId;
use tokio::sync::mpsc;

use super::*;
use crate::engine::constraint::{Grammars, Vocabulary};
use crate::engine::types::validate;
use crate::engine::work::StepTimes;
use crate::engine::GenerateRequest;
use crate::fixtures::{write_tiny_gguf, TinySpec};
use crate::kv::{BlockId, Chain, KvDtype, KvStore, NO_BLOCK};
use crate::model::{load_gguf, Model};

#[path = "scheduler/prefill_tests.rs"]
mod prefill_tests;

const VOCAB: u32 = 512;
const BS: usize = 16;

fn tiny() -> Arc<Model> {
    tiny_with_vocabulary().0
}

/// The tiny model and the vocabulary its file holds.
fn tiny_with_vocabulary() -> (Arc<Model>, Vocabulary) {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let dir = std::env::temp_dir().join(format!("hearth-sched-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny.gguf");
    write_tiny_gguf(&path, &TinySpec::default()).unwrap();
    let m = Arc::new(load_gguf(&path).unwrap());
    let vocab = Vocabulary::from_gguf(&path).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    (m, vocab)
}

/// A scheduler over the tiny model, and the grammar engine over its vocabulary.
fn tiny_constrained() -> (Scheduler, Grammars) {
    let (model, vocab) = tiny_with_vocabulary();
    let grammars = Grammars::for_model(vocab, &Weights::from(model.clone()), 2).unwrap();
    (
        Scheduler::new(model, EngineConfig::default()).unwrap(),
        grammars,
    )
}

/// Queues `r` constrained to `grammar`; its events.
fn submit_constrained(
    s: &mut Scheduler,
    g: &Grammars,
    mut r: GenerateRequest,
    grammar: &hearth_shared::Grammar,
) -> Events {
    r.grammar = Some(grammar.clone());
    let v = validate(r, &s.model_info())
        .unwrap()
        .constrain(Some(g))
        .unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    s.enqueue(v, tx);
    rx
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 200 + (i * 37 + seed * 101) % (VOCAB - 200))
        .collect()
}

type Events = mpsc::UnboundedReceiver<EngineEvent>;

fn submit(s: &mut Scheduler, id: u64, p: Vec<u32>, n: u32, session: Option<&str>) -> Events {
    let mut r = GenerateRequest::new(id, p, n);
    r.ignore_eos = true;
    r.session = session.map(SessionId::from);
    let v = validate(r, &s.model_info()).unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    s.enqueue(v, tx);
    rx
}

/// Queues request `id` of `user`: `n` tokens after prompt `p`; its events.
fn submit_as(s: &mut Scheduler, id: u64, user: &str, p: &[u32], n: u32) -> Events {
    submit_turn(s, id, user, None, p, n)
}

/// [`submit_as`], in `session` when given.
fn submit_turn(
    s: &mut Scheduler,
    id: u64,
    user: &str,
    session: Option<&str>,
    p: &[u32],
    n: u32,
) -> Events {
    let mut r = GenerateRequest::new(id, p.to_vec(), n);
    r.ignore_eos = true;
    r.user = hearth_shared::UserId::from(user);
    r.session = session.map(SessionId::from);
    let v = validate(r, &s.model_info()).unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    s.enqueue(v, tx);
    rx
}

/// Every block table the scheduler holds, packed blocks too.
fn tables(s: &Scheduler) -> Vec<&[BlockId]> {
    s.running
        .iter()
        .chain(&s.waiting)
        .flat_map(|q| [q.blocks.as_slice(), q.packed.as_slice()])
        .chain(
            s.kv.sessions()
                .values()
                .flat_map(|c| [c.blocks.as_slice(), c.packed.as_slice()]),
        )
        .collect()
}

fn audit(s: &Scheduler) {
    s.kv.alloc().audit(tables(s)).unwrap();
}

/// Steps until idle, auditing after every step and calling `each` too.
fn drain(s: &mut Scheduler, mut each: impl FnMut(&Scheduler)) {
    for _ in 0..10_000 {
        if s.is_idle() {
            return;
        }
        s.step();
        audit(s);
        each(s);
    }
    panic!("scheduler did not go idle");
}

/// (cached tokens, generated tokens) of a finished request.
fn outcome(rx: &mut Events) -> (usize, Vec<u32>) {
    let (mut cached, mut tokens) = (usize::MAX, Vec::new());
    while let Ok(e) = rx.try_recv() {
        match e {
            EngineEvent::Started { cached_tokens, .. } => cached = cached_tokens,
            EngineEvent::Token { id, .. } => tokens.push(id),
            EngineEvent::Finished { .. } => return (cached, tokens),
            EngineEvent::Error(e) => panic!("{e}"),
        }
    }
    panic!("request did not finish");
}

/// The K/V of every position of `blocks`, every layer, as stored.
fn contents(s: &Scheduler, blocks: &[BlockId]) -> Vec<(Vec<f32>, Vec<f32>)> {
    let layers = TinySpec::default().layers;
    let kv = s.backend.host_store().unwrap();
    (0..layers)
        .flat_map(|l| (0..blocks.len() * BS).map(move |p| (l, p)))
        .map(|(l, p)| kv.read(l, blocks, p))
        .collect()
}

/// Every layer of every position kept: the reference the packed history must match.
fn unpacked() -> EngineConfig {
    EngineConfig {
        kv_window_margin: None,
        ..Default::default()
    }
}

fn packing(margin: usize) -> EngineConfig {
    EngineConfig {
        kv_window_margin: Some(margin),
        ..Default::default()
    }
}

/// A scheduler over `model` (sessions unpacked) whose K/V pool holds `blocks` blocks.
fn with_blocks(model: &Arc<Model>, blocks: usize) -> Scheduler {
    let config = EngineConfig {
        kv_budget_bytes: blocks * block_bytes(model),
        ..unpacked()
    };
    Scheduler::new(model.clone(), config).unwrap()
}

/// A scheduler that prefills at most `chunk` prompt tokens a step.
fn with_chunk(model: &Arc<Model>, chunk: usize) -> Scheduler {
    let config = EngineConfig {
        prefill_chunk: chunk,
        ..unpacked()
    };
    Scheduler::new(model.clone(), config).unwrap()
}

/// Bytes of one KV block of `model` at the default element type.
fn block_bytes(model: &Model) -> usize {
    let c = &model.config;
    KvStore::block_bytes(c.num_layers, BS, c.kv_dim(), c.head_dim, KvDtype::default())
}

fn cold(model: &Arc<Model>, p: Vec<u32>, n: u32) -> Vec<u32> {
    let mut s = Scheduler::new(model.clone(), unpacked()).unwrap();
    let mut rx = submit(&mut s, 1, p, n, None);
    drain(&mut s, |_| {});
    outcome(&mut rx).1
}

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

// The tiny model slides a 16-token window in layers 0, 1, 3 and 4; layers 2 and 5 are global, so
// three blocks' global layers pack into one block.

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
fn a_prompt_arriving_beside_decoding_sequences_is_prefilled_in_shares_and_answers_as_cold() {
    let model = tiny();
    let long = prompt(400, 9);
    let want = cold(&model, long.clone(), 4);
    let mut s = Scheduler::new(model, unpacked()).unwrap();
    // Budgets by work counts: the steps' tokens, not this machine's times.
    s.times = StepTimes::off();
    let mut decoding: Vec<Events> = (0..4)
        .map(|i| submit(&mut s, 1 + i, prompt(8, i as u32), 40, None))
        .collect();
    // Every stream has its prompt in and decodes.
    while s.running.len() < 4 || s.running.iter().any(|q| q.tokens.len() - q.kv_len > 1) {
        s.step();
    }
    let mut rx = submit(&mut s, 10, long, 4, None);
    let (mut prefill_steps, mut done, mut chunks) = (0, 0, Vec::new());
    loop {
        // The budget the step's plan sees: the same four decoding sequences, one position on.
        let budget = s.prefill_budget(&HashSet::new());
        let Some(summary) = s.step() else { break };
        audit(&s);
        if summary.prefill_tokens > 0 {
            prefill_steps += 1;
            // Decoding sequences stream on in every step of the prefill.
            assert_eq!(summary.decode_seqs, 4, "step {prefill_steps}");
            let n = summary.prefill_tokens;
            let work = s.work.prefill(done, n);
            assert!(
                work <= budget.work,
                "{n} tokens from {done}: {work} over {budget:?}"
            );
            assert!(n <= budget.tokens, "{summary:?} over {budget:?}");
            (done, chunks) = (done + n, [chunks, vec![n]].concat());
        } else if prefill_steps > 0 {
            break;
        }
    }
    assert_eq!(done, 400);
    assert!(prefill_steps > 1, "the prompt was not split: {chunks:?}");
    // Each position attends to more than the last: the chunks shrink as the prompt goes on.
    assert!(chunks[0] > chunks[chunks.len() - 2], "{chunks:?}");
    drain(&mut s, audit);
    assert_eq!(outcome(&mut rx).1, want);
    for rx in &mut decoding {
        assert_eq!(outcome(rx).1.len(), 40);
    }
}

#[test]
fn speculative_drafts_change_no_reply_greedy_or_seeded_and_leave_the_cache_exact() {
    let model = tiny();
    // A prompt that repeats itself, so lookups find drafts from the first step.
    let mut looping = prompt(24, 5);
    looping.extend_from_within(..);
    looping.extend_from_within(..20);
    let run = |spec_tokens: usize| {
        let mut s = Scheduler::new(
            model.clone(),
            EngineConfig {
                spec_tokens,
                ..unpacked()
            },
        )
        .unwrap();
        let mut a = submit(&mut s, 1, looping.clone(), 70, Some("s"));
        // Seeded sampling: the same draws in the same order, so the same reply.
        let mut r = GenerateRequest::new(2, looping[4..].to_vec(), 70);
        r.ignore_eos = true;
        r.params = hearth_shared::SamplingParams {
            temperature: 0.8,
            seed: Some(11),
            ..Default::default()
        };
        let (tx, mut b) = mpsc::unbounded_channel();
        s.enqueue(validate(r, &s.model_info()).unwrap(), tx);
        // `drain` audits the block bookkeeping after every step: blocks grown for a draft that
        // was cut short must be given back.
        let mut steps = 0;
        drain(&mut s, |s| {
            steps += 1;
            for q in &s.running {
                assert_eq!(q.draft, 0);
                assert!(
                    q.blocks.len() <= q.tokens.len().div_ceil(BS),
                    "draft blocks kept"
                );
            }
        });
        let (a1, b1) = (outcome(&mut a).1, outcome(&mut b).1);
        // The session's next turn resumes from the K/V the drafted steps left behind.
        let mut next = looping.clone();
        next.extend(&a1);
        next.extend(prompt(6, 7));
        let mut c = submit(&mut s, 3, next, 40, Some("s"));
        drain(&mut s, |_| steps += 1);
        let (cached, c1) = outcome(&mut c);
        assert_eq!(
            cached,
            looping.len() + a1.len() - 1,
            "the session cache was kept"
        );
        (a1, b1, c1, steps, s.stats())
    };
    let (a0, b0, c0, steps0, off) = run(0);
    let (a1, b1, c1, steps1, on) = run(4);
    assert_eq!(a1, a0, "a drafted reply differs from the plain one");
    assert_eq!(b1, b0, "a drafted seeded reply differs from the plain one");
    assert_eq!(c1, c0, "a turn after drafted steps differs");
    assert_eq!((off.spec_draft_tokens, off.spec_accepted_tokens), (0, 0));
    println!(
        "drafted {} tokens, kept {}; {steps1} steps against {steps0}",
        on.spec_draft_tokens, on.spec_accepted_tokens
    );
    assert!(on.spec_accepted_tokens > 0, "no draft was kept: {on:?}");
    assert!(on.spec_accepted_tokens <= on.spec_draft_tokens);
    assert!(steps1 < steps0, "kept drafts should save steps");
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

/// Constrained sequences batched with a free one: every constrained reply is text the grammar
/// matches and ends with `Stop` once the grammar is complete; the free one is untouched.
#[test]
fn constrained_sequences_follow_their_grammar_in_a_mixed_batch() {
    let (mut s, grammars) = tiny_constrained();
    let grammar = hearth_shared::Grammar::Regex {
        pattern: "(yes|no)-[0-9]{2}".into(),
    };
    let mut streams = Vec::new();
    for (id, temperature) in [(1u64, 0.0f32), (2, 1.5), (3, 1.5)] {
        let mut r = GenerateRequest::new(id, prompt(20, id as u32), 30);
        r.params.temperature = temperature;
        r.params.seed = Some(id);
        streams.push(submit_constrained(&mut s, &grammars, r, &grammar));
    }
    let free = submit(&mut s, 4, prompt(20, 9), 30, None);
    drain(&mut s, |_| {});
    let names = crate::fixtures::tiny_vocab_text(VOCAB as usize);
    let text = |ids: &[u32]| {
        let mut bytes = Vec::new();
        for &t in ids {
            let n = &names[t as usize];
            match n.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')) {
                Some(h) => bytes.push(u8::from_str_radix(h, 16).unwrap()),
                None => bytes.extend_from_slice(n.as_bytes()),
            }
        }
        String::from_utf8(bytes).unwrap()
    };
    for mut rx in streams {
        let (mut ids, mut end) = (Vec::new(), None);
        while let Ok(e) = rx.try_recv() {
            match e {
                EngineEvent::Token { id, .. } => ids.push(id),
                EngineEvent::Finished { reason, .. } => end = Some(reason),
                other @ EngineEvent::Error(_) => panic!("{other:?}"),
                EngineEvent::Started { .. } => {}
            }
        }
        let t = text(&ids);
        let (word, digits) = t.split_once('-').unwrap_or_else(|| panic!("{t:?}"));
        assert!(word == "yes" || word == "no", "{t:?}");
        assert!(
            digits.len() == 2 && digits.bytes().all(|b| b.is_ascii_digit()),
            "{t:?}"
        );
        assert_eq!(end, Some(FinishReason::Stop), "{t:?}");
    }
    let mut free = free;
    let mut n = 0;
    while let Ok(e) = free.try_recv() {
        n += usize::from(matches!(e, EngineEvent::Token { .. }));
    }
    assert_eq!(n, 30, "the free sequence generates its 30 tokens");
}

/// A reply whose last allowed token completes its grammar is whole: `Stop`, not `Length`.
#[test]
fn a_grammar_completed_by_the_last_allowed_token_ends_with_stop() {
    let (mut s, grammars) = tiny_constrained();
    let abc = hearth_shared::Grammar::Regex {
        pattern: "abc".into(),
    };
    let mut ends = Vec::new();
    for (id, max_new) in [(1u64, 3u32), (2, 2)] {
        let r = GenerateRequest::new(id, prompt(12, id as u32), max_new);
        ends.push(submit_constrained(&mut s, &grammars, r, &abc));
    }
    drain(&mut s, |_| {});
    let mut got = Vec::new();
    for mut rx in ends {
        let mut end = None;
        while let Ok(e) = rx.try_recv() {
            if let EngineEvent::Finished {
                reason,
                completion_tokens,
                ..
            } = e
            {
                end = Some((reason, completion_tokens));
            }
        }
        got.push(end);
    }
    // "abc" takes three tokens of the tiny vocabulary (one per character).
    assert_eq!(
        got[0],
        Some((FinishReason::Stop, 3)),
        "completed at its limit"
    );
    assert_eq!(
        got[1],
        Some((FinishReason::Length, 2)),
        "cut before the end"
    );
}

/// Fair share of the K/V memory: Alice's two long replies fill the pool; Bob's short request,
/// which would wait for one of them to end, takes the place of her youngest at once (recomputed
/// later), and every reply is still the one a cold run gives.
#[test]
fn a_user_with_nothing_running_takes_kv_from_the_user_holding_the_most() {
    let model = tiny();
    let mut s = with_blocks(&model, 10);
    let (a1, a2, b) = (prompt(70, 1), prompt(70, 2), prompt(10, 3));
    let mut alice = vec![
        (a1.clone(), submit_as(&mut s, 1, "alice", &a1, 8)),
        (a2.clone(), submit_as(&mut s, 2, "alice", &a2, 8)),
    ];
    s.step();
    audit(&s);
    assert_eq!(s.running.len(), 2, "both of Alice's replies run");
    assert_eq!(s.kv.alloc().free(), 0, "and fill the pool");
    let before = s.preemptions;
    let mut bob = submit_as(&mut s, 3, "bob", &b, 4);
    s.step();
    audit(&s);
    let running: Vec<u64> = s.running.iter().map(|q| q.id.0).collect();
    assert!(running.contains(&3), "Bob waits behind Alice: {running:?}");
    assert_eq!(s.preemptions, before + 1, "one of Alice's gave way");
    drain(&mut s, |_| {});
    assert_eq!(outcome(&mut bob).1, cold(&model, b, 4));
    for (p, rx) in &mut alice {
        assert_eq!(outcome(rx).1, cold(&model, p.clone(), 8));
    }
}

/// Fair share of the prefill: Alice's two long prompts are being prefilled in chunks when Bob's
/// short one arrives. The next step prefills all of Bob's (he starts answering at once) and
/// gives the rest of the chunk's work to Alice's oldest; every reply is still a cold run's.
#[test]
fn a_short_prompt_is_prefilled_beside_another_users_long_ones_not_after_them() {
    let model = tiny();
    let chunk = 64;
    let mut s = with_chunk(&model, chunk);
    let (a1, a2, b) = (prompt(300, 1), prompt(300, 2), prompt(10, 3));
    let mut alice = vec![
        (a1.clone(), submit_as(&mut s, 1, "alice", &a1, 4)),
        (a2.clone(), submit_as(&mut s, 2, "alice", &a2, 4)),
    ];
    s.step();
    let kv = |s: &Scheduler, id: u64| s.running.iter().find(|q| q.id.0 == id).unwrap().kv_len;
    let (from, second) = (kv(&s, 1), kv(&s, 2));
    let mut bob = submit_as(&mut s, 3, "bob", &b, 4);
    let summary = s.step().unwrap();
    audit(&s);
    assert_eq!(kv(&s, 3), b.len(), "Bob's prompt waits behind Alice's");
    let (hers, next) = (kv(&s, 1) - from, kv(&s, 2) - second);
    assert_eq!(summary.prefill_tokens, b.len() + hers + next);
    let work =
        s.work.prefill(0, b.len()) + s.work.prefill(from, hers) + s.work.prefill(second, next);
    assert!(
        work <= s.work.prefill(0, chunk) && hers >= chunk - b.len() - 8 && next <= 1,
        "Alice's oldest takes most of the rest of a chunk's work: {hers} tokens from {from}, \
         her second {next}"
    );
    drain(&mut s, audit);
    assert_eq!(outcome(&mut bob).1, cold(&model, b, 4));
    for (p, rx) in &mut alice {
        assert_eq!(outcome(rx).1, cold(&model, p.clone(), 4));
    }
}

/// No step takes longer than a chunk at a prompt's start: deep in Alice's long prompt (each token
/// attending to hundreds before it), her chunks are shorter, so Bob's prompt that arrives then
/// waits for no more than a fresh chunk's work, and is prefilled whole in the next step.
#[test]
fn a_chunk_deep_in_a_long_prompt_is_held_to_a_fresh_chunks_work() {
    let model = tiny();
    let chunk = 64;
    let mut s = with_chunk(&model, chunk);
    let (a, b) = (prompt(900, 1), prompt(10, 3));
    let mut alice = submit_as(&mut s, 1, "alice", &a, 4);
    s.step();
    let kv = |s: &Scheduler, id: u64| s.running.iter().find(|q| q.id.0 == id).unwrap().kv_len;
    let budget = s.work.prefill(0, chunk);
    assert_eq!(kv(&s, 1), chunk, "a fresh chunk is whole");
    while kv(&s, 1) < 600 {
        let from = kv(&s, 1);
        let summary = s.step().unwrap();
        assert!(
            s.work.prefill(from, summary.prefill_tokens) <= budget,
            "a chunk from {from} of {} tokens",
            summary.prefill_tokens
        );
    }
    let from = kv(&s, 1);
    let deep = s.step().unwrap().prefill_tokens;
    assert!(deep < chunk * 3 / 4, "a chunk from {from}: {deep} tokens");
    let mut bob = submit_as(&mut s, 3, "bob", &b, 4);
    let from = kv(&s, 1);
    s.step().unwrap();
    audit(&s);
    assert_eq!(kv(&s, 3), b.len(), "Bob's whole prompt in the next step");
    let work = s.work.prefill(0, b.len()) + s.work.prefill(from, kv(&s, 1) - from);
    assert!(work <= budget, "the step: {work} of {budget}");
    drain(&mut s, audit);
    assert_eq!(outcome(&mut bob).1, cold(&model, b, 4));
    assert_eq!(outcome(&mut alice).1, cold(&model, a, 4));
}

/// Tokens received on `rx` since last asked, and how it finished if it did.
fn tokens_now(rx: &mut Events) -> (Vec<u32>, Option<FinishReason>) {
    let (mut n, mut end) = (Vec::new(), None);
    while let Ok(e) = rx.try_recv() {
        match e {
            EngineEvent::Token { id, .. } => n.push(id),
            EngineEvent::Finished { reason, .. } => end = Some(reason),
            other @ EngineEvent::Error(_) => panic!("{other:?}"),
            EngineEvent::Started { .. } => {}
        }
    }
    (n, end)
}

/// Occupies both mask threads (the tests' two) until the returned senders are dropped or sent
/// to (or 5 s pass).
fn busy_mask_threads(grammars: &Grammars) -> Vec<std::sync::mpsc::Sender<()>> {
    let (started_tx, started) = std::sync::mpsc::channel();
    let mut release = Vec::new();
    for _ in 0..2 {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let started_tx = started_tx.clone();
        release.push(tx);
        grammars.push_job(
            "someone else",
            Box::new(move || {
                started_tx.send(()).unwrap();
                let _ = rx.recv_timeout(std::time::Duration::from_secs(5));
            }),
        );
    }
    started.recv().unwrap();
    started.recv().unwrap();
    release
}

/// A scheduler decoding sequence 1, constrained to `grammar` with its next mask ready, beside
/// sequence 2, free; their events, and the grammar engine.
fn constrained_beside_free(
    grammar: &hearth_shared::Grammar,
) -> (Scheduler, Grammars, Events, Events) {
    let (mut s, grammars) = tiny_constrained();
    let r = GenerateRequest::new(1, prompt(20, 1), 30);
    let constrained = submit_constrained(&mut s, &grammars, r, grammar);
    let free = submit(&mut s, 2, prompt(20, 2), 30, None);
    s.step();
    while s.running.iter().any(|q| q.tokens.len() - q.kv_len > 1) {
        s.step();
    }
    while !mask_ready(&mut s) {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    (s, grammars, constrained, free)
}

fn mask_ready(s: &mut Scheduler) -> bool {
    let q = s.running.iter_mut().find(|q| q.id.0 == 1).unwrap();
    q.constraint.as_mut().unwrap().mask_ready()
}

fn twelve_letters() -> hearth_shared::Grammar {
    hearth_shared::Grammar::Regex {
        pattern: "[a-z]{12}".into(),
    }
}

/// The reply sequence 1 of the late-mask tests gives under `grammar` on its own.
fn constrained_alone(grammar: &hearth_shared::Grammar) -> Vec<u32> {
    let (mut s, grammars) = tiny_constrained();
    let r = GenerateRequest::new(1, prompt(20, 1), 30);
    let mut rx = submit_constrained(&mut s, &grammars, r, grammar);
    drain(&mut s, audit);
    outcome(&mut rx).1
}

/// A grammar's mask that does not come in time holds back its own sequence, not the step: with
/// the mask threads busy, the free sequence decodes on and the constrained one waits, then both
/// finish whole, the constrained reply the one it gives on its own.
#[test]
fn a_sequence_whose_mask_is_late_sits_the_step_out_and_others_decode_on() {
    let grammar = twelve_letters();
    let alone = constrained_alone(&grammar);
    let (mut s, grammars, mut constrained, mut free) = constrained_beside_free(&grammar);
    let release = busy_mask_threads(&grammars);
    let (mut c, mut f) = (tokens_now(&mut constrained).0, tokens_now(&mut free).0);
    // Its ready mask is used; the next one is queued behind the busy threads.
    s.step().unwrap();
    let (c1, f1) = (tokens_now(&mut constrained).0, tokens_now(&mut free).0);
    assert_eq!(c1.len(), 1);
    assert!(!mask_ready(&mut s));
    // Its grammar kept up so far: it runs, and its sampling gives up on the mask (its position
    // runs again later). Then its mask is later than a forward pass, and it sits out.
    s.last_forward = std::time::Duration::from_secs(3600);
    for round in 0..3 {
        let summary = s.step().unwrap();
        audit(&s);
        let (c2, f2) = (tokens_now(&mut constrained).0, tokens_now(&mut free).0);
        assert_eq!(summary.decode_seqs, 1, "step {round}: {summary:?}");
        assert!(c2.is_empty(), "step {round} waited for the late mask");
        assert_eq!(f2.len(), 1, "the free sequence decoded on");
        f.extend(f2);
    }
    drop(release);
    drain(&mut s, audit);
    let ((c3, c_end), (f3, f_end)) = (tokens_now(&mut constrained), tokens_now(&mut free));
    c.extend(c1.into_iter().chain(c3));
    f.extend(f1.into_iter().chain(f3));
    assert_eq!((f.len(), f_end), (30, Some(FinishReason::Length)));
    assert_eq!(
        c_end,
        Some(FinishReason::Stop),
        "the grammar ended it after {c:?}"
    );
    assert_eq!(c, alone, "the reply it gives on its own");
}

/// A prompt whose first mask does not come in time holds up no step either: its last prompt
/// position runs again once the mask is there, and its reply is the one it gives on its own.
#[test]
fn a_prompt_whose_first_mask_is_late_holds_up_no_step() {
    let grammar = twelve_letters();
    let alone = constrained_alone(&grammar);
    let (mut s, grammars) = tiny_constrained();
    let mut free = submit(&mut s, 2, prompt(20, 2), 30, None);
    s.step();
    assert_eq!(tokens_now(&mut free).0.len(), 1);
    let release = busy_mask_threads(&grammars);
    let r = GenerateRequest::new(1, prompt(20, 1), 30);
    let mut constrained = submit_constrained(&mut s, &grammars, r, &grammar);
    s.last_forward = std::time::Duration::from_secs(3600);
    for step in 0..3 {
        s.step().unwrap();
        audit(&s);
        assert!(tokens_now(&mut constrained).0.is_empty(), "step {step}");
        assert_eq!(
            tokens_now(&mut free).0.len(),
            1,
            "step {step}: the free one decodes on"
        );
    }
    drop(release);
    drain(&mut s, audit);
    let (c, c_end) = tokens_now(&mut constrained);
    assert_eq!(c_end, Some(FinishReason::Stop));
    assert_eq!(c, alone, "the reply it gives on its own");
}

/// A mask still on its way holds nothing back while its grammar keeps up with the forward pass
/// (the usual case: masks are computed during the forward pass); one later than a forward pass
/// makes its sequence sit out.
#[test]
fn only_a_grammar_slower_than_the_forward_pass_sits_out() {
    let grammar = twelve_letters();
    let (mut s, grammars, _constrained, _free) = constrained_beside_free(&grammar);
    let release = busy_mask_threads(&grammars);
    s.step().unwrap();
    assert!(!mask_ready(&mut s), "its next mask is on its way");
    s.last_forward = std::time::Duration::from_secs(3600);
    assert!(s.masks_pending().is_empty(), "a forward pass takes longer");
    s.last_forward = std::time::Duration::ZERO;
    let held = s.masks_pending();
    assert_eq!(held.into_iter().map(|id| id.0).collect::<Vec<_>>(), [1]);
    drop(release);
    while !mask_ready(&mut s) {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(s.masks_pending().is_empty(), "a mask that is there is used");
}

/// Fair share of the K/V memory held by one huge sequence: Alice's one long prompt fills the
/// pool; Bob's short request takes its place at once rather than wait for it to end. Hers is
/// recomputed (from the prefix cache, but for the blocks Bob took), and every reply is a cold
/// run's.
#[test]
fn a_user_with_nothing_running_takes_kv_from_one_sequence_holding_most_of_it() {
    let model = tiny();
    let mut s = with_blocks(&model, 12);
    let (a, b) = (prompt(180, 1), prompt(10, 3));
    let mut alice = submit_as(&mut s, 1, "alice", &a, 8);
    s.step();
    audit(&s);
    assert_eq!(s.kv.alloc().free(), 0, "Alice's one prompt fills the pool");
    let before = s.preemptions;
    let mut bob = submit_as(&mut s, 3, "bob", &b, 4);
    s.step();
    audit(&s);
    let running: Vec<u64> = s.running.iter().map(|q| q.id.0).collect();
    assert!(running.contains(&3), "Bob waits behind Alice: {running:?}");
    assert_eq!(s.preemptions, before + 1, "her sequence gave way");
    drain(&mut s, audit);
    assert_eq!(outcome(&mut bob).1, cold(&model, b, 4));
    assert_eq!(outcome(&mut alice).1, cold(&model, a, 8));
}

/// Each of the replies on `rxs` is the one a cold run of its prompt in `prompts` gives.
fn each_as_cold<const N: usize>(
    model: &Arc<Model>,
    rxs: &mut [Events; N],
    prompts: [Vec<u32>; N],
    n: u32,
) {
    for (rx, p) in rxs.iter_mut().zip(prompts) {
        assert_eq!(outcome(rx).1, cold(model, p, n));
    }
}

/// Runs `user`'s turn of `n` tokens after `p` in `session` to its end; the session's history.
fn turn(s: &mut Scheduler, id: u64, user: &str, session: &str, p: &[u32], n: u32) -> Vec<u32> {
    let mut rx = submit_turn(s, id, user, Some(session), p, n);
    drain(s, audit);
    [p.to_vec(), outcome(&mut rx).1].concat()
}

/// Fair share of idle session caches: Alice's long prompts, more than the pool holds at once,
/// do not evict Bob's idle session cache, which is within his share of the pool. Her second one
/// waits for her first instead, and Bob's next turn resumes from his cache.
#[test]
fn another_users_long_prompts_leave_an_idle_session_cache_within_its_share() {
    let model = tiny();
    let mut s = with_blocks(&model, 12);
    // Bob's cache: 47 positions, 3 blocks. Alice's prompts take 7 blocks each.
    let history = turn(&mut s, 1, "bob", "bob-s", &prompt(40, 1), 8);
    let (a1, a2) = (prompt(100, 2), prompt(100, 3));
    let mut alice = [
        submit_as(&mut s, 2, "alice", &a1, 8),
        submit_as(&mut s, 3, "alice", &a2, 8),
    ];
    s.step();
    audit(&s);
    let waiting: Vec<u64> = s.waiting.iter().map(|q| q.id.0).collect();
    assert_eq!(
        waiting,
        [3],
        "one of Alice's prompts fits beside Bob's cache"
    );
    assert_eq!(s.kv.counts().evictions, 0, "and Bob's cache stays");
    drain(&mut s, audit);
    assert_eq!(s.kv.counts().evictions, 0);
    let next = [history.clone(), prompt(10, 4)].concat();
    let mut bob = submit_turn(&mut s, 4, "bob", Some("bob-s"), &next, 4);
    drain(&mut s, audit);
    let (cached, tokens) = outcome(&mut bob);
    assert_eq!(
        cached,
        history.len() - 1,
        "Bob's turn resumes from his cache"
    );
    assert_eq!(tokens, cold(&model, next, 4));
    each_as_cold(&model, &mut alice, [a1, a2], 8);
}

/// A request that needs more than its user's share still runs when nothing else would free
/// memory: then another user's idle cache gives way rather than the request wait for ever.
#[test]
fn a_request_over_its_share_evicts_an_idle_cache_when_nothing_runs() {
    let model = tiny();
    let mut s = with_blocks(&model, 12);
    turn(&mut s, 1, "bob", "bob-s", &prompt(40, 1), 8);
    // 10 blocks: more than half the pool, and more than is free beside Bob's cache.
    let a = prompt(150, 2);
    let mut alice = submit_as(&mut s, 2, "alice", &a, 8);
    drain(&mut s, audit);
    assert_eq!(s.kv.counts().evictions, 1, "Bob's cache gave way");
    assert_eq!(outcome(&mut alice).1, cold(&model, a, 8));
}

/// A user within its share that must evict takes the caches of users over theirs first, even
/// ones used more recently than a modest user's.
#[test]
fn eviction_takes_the_idle_caches_of_users_over_their_share_first() {
    let model = tiny();
    let mut s = with_blocks(&model, 12);
    // Carol's 2 blocks, then Alice's 8: over a third of the pool.
    turn(&mut s, 1, "carol", "carol-s", &prompt(20, 1), 4);
    turn(&mut s, 2, "alice", "alice-s", &prompt(120, 2), 8);
    // Bob's 3 blocks, with 2 free: one cache must go.
    let b = prompt(40, 3);
    let mut bob = submit_as(&mut s, 3, "bob", &b, 4);
    drain(&mut s, audit);
    assert_eq!(s.kv.counts().evictions, 1);
    let cached: Vec<&str> = s.kv.sessions().keys().map(SessionId::as_str).collect();
    assert_eq!(
        cached,
        ["carol-s"],
        "Alice's cache went, Carol's older one stayed"
    );
    assert_eq!(outcome(&mut bob).1, cold(&model, b, 4));
}

/// Preemption for memory takes from the user holding the most beyond its share: Bob's reply,
/// the youngest, keeps running while Alice's two long ones grow past the pool, and one of hers
/// gives way instead. Every reply is still a cold run's.
#[test]
fn a_growing_sequence_preempts_the_heaviest_users_youngest_not_a_modest_users() {
    let model = tiny();
    let mut s = with_blocks(&model, 12);
    let (a1, a2, b) = (prompt(60, 1), prompt(60, 2), prompt(10, 3));
    let mut alice = [
        submit_as(&mut s, 1, "alice", &a1, 40),
        submit_as(&mut s, 2, "alice", &a2, 40),
    ];
    let mut bob = submit_as(&mut s, 3, "bob", &b, 40);
    drain(&mut s, |s| {
        let bob_preempted = s.waiting.iter().any(|q| q.id.0 == 3 && q.was_preempted());
        assert!(!bob_preempted, "Bob's reply was preempted");
    });
    assert!(s.preemptions > 0, "Alice's replies outgrew the pool");
    assert_eq!(outcome(&mut bob).1, cold(&model, b, 40));
    each_as_cold(&model, &mut alice, [a1, a2], 40);
}
