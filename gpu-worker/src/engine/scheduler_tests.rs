//! The scheduler driven step by step over a tiny model: prefix sharing, copy-on-write, eviction,
//! with the block bookkeeping audited after every step.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use hearth_shared::SessionId;
use tokio::sync::mpsc;

use super::*;
use crate::engine::types::validate;
use crate::engine::GenerateRequest;
use crate::fixtures::{write_tiny_gguf, TinySpec};
use crate::kv::KvDtype;
use crate::model::load_gguf;

const VOCAB: u32 = 512;
const BS: usize = 16;

fn tiny() -> Arc<Model> {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let dir = std::env::temp_dir().join(format!("hearth-sched-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny.gguf");
    write_tiny_gguf(&path, &TinySpec::default()).unwrap();
    let m = Arc::new(load_gguf(&path).unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    m
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

/// Every block table the scheduler holds.
fn tables(s: &Scheduler) -> Vec<&[BlockId]> {
    s.running
        .iter()
        .chain(&s.waiting)
        .map(|q| q.blocks.as_slice())
        .chain(s.sessions.values().map(|c| c.blocks.as_slice()))
        .collect()
}

fn audit(s: &Scheduler) {
    s.alloc.audit(tables(s)).unwrap();
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
    let layers = s.model.config.num_layers;
    (0..layers)
        .flat_map(|l| (0..blocks.len() * BS).map(move |p| (l, p)))
        .map(|(l, p)| s.kv.read(l, blocks, p))
        .collect()
}

fn cold(model: &Arc<Model>, p: Vec<u32>, n: u32) -> Vec<u32> {
    let mut s = Scheduler::new(model.clone(), EngineConfig::default()).unwrap();
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
    assert_eq!((s.alloc.used(), s.alloc.cached()), (0, 2));
    let shared = s.alloc.lookup_prefix(&base[..32], BS);
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
            assert!(shared.iter().all(|&b| s.alloc.refs(b) == 2));
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
    assert_eq!(s.alloc.used(), 0);
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
    let shared = s.alloc.lookup_prefix(&base[..32], BS);
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
    let c = &model.config;
    let block_bytes =
        KvStore::block_bytes(c.num_layers, BS, c.kv_dim(), c.head_dim, KvDtype::default());
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
            assert!(q.blocks.iter().all(|&b| s.alloc.refs(b) > 0));
        }
    });
    assert!(s.preemptions > 0 || s.evictions > 0);
    for (p, mut rx) in streams {
        let (_, tokens) = outcome(&mut rx);
        assert_eq!(tokens, cold(&model, p, 30));
    }
}
