//! Who gives up K/V memory, driven through the scheduler: a user with nothing running takes a
//! place from the user holding the most, idle session caches give way by users' shares, and a
//! growing sequence preempts the heaviest user's youngest. Every reply stays a cold run's.

use super::*;

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
