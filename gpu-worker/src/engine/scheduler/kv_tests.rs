//! [`KvManager`] without a model: a [`BlockStore`] in memory whose position `p` of a table holds
//! token `p` of its sequence (what a forward pass would have written there), so every placement
//! is checked by reading back what each table's positions hold.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;

use hearth_shared::{SessionId, UserId};
use tokio::sync::mpsc;

use super::super::seq::SeqState;
use super::*;
use crate::engine::types::{validate, EngineConfig};
use crate::engine::{GenerateRequest, ModelInfo};

const BS: usize = 4;
/// Bytes a position takes in [`Mem`].
const ROW: usize = 4;

/// Block contents in memory, a token per position.
#[derive(Default)]
struct Mem {
    blocks: HashMap<BlockId, Vec<u8>>,
    /// `copy_block` fails (a device copy that errs).
    copies_fail: bool,
}

impl Mem {
    fn block(&mut self, b: BlockId) -> &mut Vec<u8> {
        self.blocks.entry(b).or_insert_with(|| vec![0xEE; BS * ROW])
    }

    /// A forward pass over `s`'s pending tokens: their positions are written, and are its KV.
    fn run(&mut self, s: &mut Seq) {
        for p in s.kv_len..s.tokens.len() {
            let at = (p % BS) * ROW;
            let row = s.tokens[p].to_le_bytes();
            self.block(s.blocks[p / BS])[at..at + ROW].copy_from_slice(&row);
        }
        s.kv_len = s.tokens.len();
    }

    /// The tokens `s`'s table holds at its first `kv_len` positions.
    fn held(&mut self, s: &Seq) -> Vec<u32> {
        (0..s.kv_len)
            .map(|p| {
                let at = (p % BS) * ROW;
                let row = &self.block(s.blocks[p / BS])[at..at + ROW];
                u32::from_le_bytes(row.try_into().unwrap())
            })
            .collect()
    }

    /// Overwrites every block, as other sequences reusing them would.
    fn scribble(&mut self) {
        self.blocks.values_mut().for_each(|b| b.fill(0xAB));
    }
}

impl BlockStore for Mem {
    fn pack(&mut self, src: &[BlockId], dst: BlockId) {
        let packed: Vec<u8> = src.iter().flat_map(|&b| self.block(b).clone()).collect();
        self.blocks.insert(dst, packed);
    }

    fn copy_block(&mut self, src: BlockId, dst: BlockId, n: usize) -> Result<(), ModelError> {
        if self.copies_fail {
            return Err(ModelError::Unsupported("copies fail in this test".into()));
        }
        let rows = self.block(src)[..n * ROW].to_vec();
        self.block(dst)[..n * ROW].copy_from_slice(&rows);
        Ok(())
    }

    fn save_block(&self, b: BlockId, n: usize, out: &mut Vec<u8>) -> Result<(), ModelError> {
        out.extend_from_slice(&self.blocks[&b][..n * ROW]);
        Ok(())
    }

    fn load_block(&mut self, b: BlockId, n: usize, src: &[u8]) -> Result<(), ModelError> {
        self.block(b)[..n * ROW].copy_from_slice(&src[..n * ROW]);
        Ok(())
    }
}

fn manager(blocks: usize, disk: Option<DiskTier>) -> KvManager {
    let layout = KvLayout {
        block_size: BS,
        pack_per: None,
        sliding_window: None,
        window_margin: None,
    };
    KvManager::new(blocks, layout, disk)
}

/// A sequence of `user` in `session`, its prompt `tokens`.
fn seq(user: &str, session: Option<&str>, tokens: &[u32]) -> Seq {
    let info = ModelInfo {
        architecture: "test".into(),
        context_length: 1024,
        vocab_size: 1000,
        bos_id: None,
        eos_id: None,
        end_of_turn_id: None,
        default_stop_ids: Vec::new(),
        kv_capacity_tokens: 1024,
        block_size: BS,
        kv_block_bytes: BS * ROW,
        max_batch: 8,
        max_waiting: 8,
        command_queue: 8,
    };
    let mut r = GenerateRequest::new(1, tokens.to_vec(), 4);
    r.user = UserId::from(user);
    r.session = session.map(SessionId::from);
    let config = EngineConfig {
        block_size: BS,
        ..EngineConfig::default()
    };
    let (tx, _) = mpsc::unbounded_channel();
    Seq::new(validate(r, &info).unwrap(), tx, &config, SeqState::Live)
}

/// Places `s` as the scheduler does when memory is free: its cached prefix, then the rest.
fn place(kv: &mut KvManager, mem: &mut Mem, s: &mut Seq) {
    kv.attach_cached_prefix(mem, &[], s);
    assert!(kv.free() >= kv.blocks_to_run(s), "the test's pool holds it");
    assert!(matches!(kv.place_attached(mem, s), Placement::Ready));
}

/// One turn: `s` placed, run, its full blocks offered to the prefix cache, and retired.
fn turn(kv: &mut KvManager, mem: &mut Mem, mut s: Seq) {
    place(kv, mem, &mut s);
    mem.run(&mut s);
    kv.register_full_blocks(&mut s);
    kv.retire(&mut s);
}

fn tokens(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

#[test]
fn a_finished_turn_is_its_sessions_cache_and_the_next_turn_resumes_from_it() {
    let (mut kv, mut mem) = (manager(16, None), Mem::default());
    let first = tokens(10..20);
    turn(&mut kv, &mut mem, seq("alice", Some("s"), &first));
    let cache = &kv.sessions()[&SessionId::from("s")];
    assert_eq!(cache.tokens, first);
    assert_eq!(kv.alloc().used(), 3, "10 positions in blocks of 4");

    let mut next = seq(
        "alice",
        Some("s"),
        &[first.clone(), tokens(50..55)].concat(),
    );
    kv.attach_cached_prefix(&mut mem, &[], &mut next);
    assert_eq!(next.kv_len, 10, "the whole first turn is reused");
    assert!(
        kv.sessions().is_empty(),
        "the cache became the sequence's K/V"
    );
    assert_eq!(mem.held(&next), first);
}

#[test]
fn full_blocks_are_shared_with_the_users_later_prompts_and_never_with_another_users() {
    let (mut kv, mut mem) = (manager(16, None), Mem::default());
    let prompt = tokens(100..112);
    turn(&mut kv, &mut mem, seq("alice", None, &prompt));
    assert_eq!((kv.alloc().used(), kv.alloc().cached()), (0, 3));

    let longer = [prompt.clone(), tokens(7..10)].concat();
    let mut again = seq("alice", None, &longer);
    kv.attach_cached_prefix(&mut mem, &[], &mut again);
    assert_eq!(again.kv_len, 12);
    assert_eq!(mem.held(&again), prompt);

    let mut bob = seq("bob", None, &longer);
    kv.attach_cached_prefix(&mut mem, &[], &mut bob);
    assert_eq!(bob.kv_len, 0, "another user's prompt never matches");
}

#[test]
fn rewinding_into_a_shared_block_copies_it_before_anything_writes_there() {
    let (mut kv, mut mem) = (manager(16, None), Mem::default());
    let first = tokens(10..22);
    turn(&mut kv, &mut mem, seq("alice", Some("s"), &first));
    let registered = kv.sessions()[&SessionId::from("s")].blocks[2];

    // A regenerated reply: the first 10 positions again, then other tokens.
    let mut rewound = seq("alice", Some("s"), &[&first[..10], &[1, 2, 3]].concat());
    kv.attach_cached_prefix(&mut mem, &[], &mut rewound);
    assert_eq!(rewound.kv_len, 10);
    assert_eq!(
        kv.blocks_to_run(&rewound),
        1 + 1,
        "a copy and one block more"
    );
    assert!(matches!(
        kv.place_attached(&mut mem, &mut rewound),
        Placement::Ready
    ));
    assert_ne!(
        rewound.blocks[2], registered,
        "the shared block is not written"
    );
    assert!(kv.writable(rewound.blocks[2]));
    assert_eq!(mem.held(&rewound), first[..10]);
    mem.run(&mut rewound);
    let mut other = seq("alice", None, &[first.clone(), vec![5]].concat());
    kv.attach_cached_prefix(&mut mem, &[], &mut other);
    assert_eq!(
        mem.held(&other),
        first,
        "the prefix cache still holds the first turn"
    );
}

#[test]
fn a_block_that_cannot_be_copied_starts_the_prompt_cold() {
    let (mut kv, mut mem) = (manager(16, None), Mem::default());
    let first = tokens(10..22);
    turn(&mut kv, &mut mem, seq("alice", Some("s"), &first));
    mem.copies_fail = true;
    let mut rewound = seq("alice", Some("s"), &[&first[..10], &[1, 2, 3]].concat());
    kv.attach_cached_prefix(&mut mem, &[], &mut rewound);
    assert!(matches!(
        kv.place_attached(&mut mem, &mut rewound),
        Placement::Ready
    ));
    assert_eq!(rewound.kv_len, 0);
    assert_eq!(
        rewound.blocks.len(),
        4,
        "blocks for all 13 tokens and the next"
    );
    assert!(rewound.blocks.iter().all(|&b| kv.writable(b)));
}

#[test]
fn an_evicted_session_spills_to_disk_and_comes_back_as_it_was() {
    let dir = std::env::temp_dir().join(format!("hearth-kv-{}", std::process::id()));
    let disk = DiskTier::create(&dir, 64 * (BS * ROW) as u64, BS * ROW).unwrap();
    let (mut kv, mut mem) = (manager(16, Some(disk)), Mem::default());
    let first = tokens(30..40);
    turn(&mut kv, &mut mem, seq("alice", Some("s"), &first));
    assert!(kv.evict_one_idle(&mem, &[], None));
    assert!(!kv.evict_one_idle(&mem, &[], None), "nothing else is idle");
    let counts = kv.counts();
    assert_eq!(
        (
            counts.evictions,
            counts.cached_sessions,
            counts.disk_sessions
        ),
        (1, 0, 1)
    );
    assert_eq!(kv.alloc().used(), 0);
    mem.scribble();

    let mut next = seq("alice", Some("s"), &[first.clone(), vec![7]].concat());
    kv.attach_cached_prefix(&mut mem, &[], &mut next);
    assert_eq!(next.kv_len, 10);
    assert_eq!(mem.held(&next), first, "restored from the disk tier");
    assert_eq!(
        (kv.counts().disk_restores, kv.counts().disk_sessions),
        (1, 0)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn idle_caches_of_a_user_over_its_share_go_before_older_ones() {
    let (mut kv, mut mem) = (manager(8, None), Mem::default());
    turn(&mut kv, &mut mem, seq("bob", Some("b"), &tokens(0..3)));
    turn(&mut kv, &mut mem, seq("alice", Some("a1"), &tokens(10..22)));
    turn(&mut kv, &mut mem, seq("alice", Some("a2"), &tokens(30..41)));
    // Bob's one block is the least recently used, but Alice holds 6 of 8 blocks.
    assert!(kv.evict_one_idle(&mem, &[], Some((&UserId::from("bob"), 2))));
    let left: Vec<&str> = kv.sessions().keys().map(SessionId::as_str).collect();
    assert!(left.contains(&"b"), "bob's cache stays: {left:?}");
    assert_eq!(left.len(), 2);
}

#[test]
fn a_prompt_larger_than_the_pool_is_refused_with_its_size() {
    let (mut kv, _) = (manager(4, None), Mem::default());
    let mut s = seq("alice", None, &tokens(0..20));
    assert!(matches!(kv.place_cold(&mut s), Placement::TooBig(21)));
    assert!(s.blocks.is_empty());
    assert_eq!(kv.free(), 4, "nothing was taken");
}

#[test]
fn a_waiting_request_detached_keeps_its_session_cache_for_later() {
    let (mut kv, mut mem) = (manager(16, None), Mem::default());
    let first = tokens(10..19);
    turn(&mut kv, &mut mem, seq("alice", Some("s"), &first));
    let mut next = seq("alice", Some("s"), &[first.clone(), vec![3, 4]].concat());
    kv.attach_cached_prefix(&mut mem, &[], &mut next);
    kv.detach(&mut next);
    assert_eq!((next.kv_len, next.blocks.len()), (0, 0));
    assert_eq!(kv.sessions()[&SessionId::from("s")].tokens, first);
    place(&mut kv, &mut mem, &mut next);
    assert_eq!(mem.held(&next), first);
}
