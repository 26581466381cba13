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

#[path = "scheduler/cache_tests.rs"]
mod cache_tests;
#[path = "scheduler/grammar_tests.rs"]
mod grammar_tests;
#[path = "scheduler/memory_tests.rs"]
mod memory_tests;
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

// The tiny model slides a 16-token window in layers 0, 1, 3 and 4; layers 2 and 5 are global, so
// three blocks' global layers pack into one block.

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

/// Queues request `id`: `n` tokens after `p`, sampled at temperature 0.8 with `seed`.
fn submit_seeded(s: &mut Scheduler, id: u64, p: &[u32], n: u32, seed: u64) -> Events {
    let mut r = GenerateRequest::new(id, p.to_vec(), n);
    r.ignore_eos = true;
    r.params = hearth_shared::SamplingParams {
        temperature: 0.8,
        seed: Some(seed),
        ..Default::default()
    };
    let (tx, rx) = mpsc::unbounded_channel();
    s.enqueue(validate(r, &s.model_info()).unwrap(), tx);
    rx
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
        let mut b = submit_seeded(&mut s, 2, &looping[4..], 70, 11);
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
