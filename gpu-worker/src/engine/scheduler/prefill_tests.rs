//! The prefill beside decoding sequences, held to a share of their measured pass.

use super::*;
use crate::engine::scheduler::prefill::MIN_PREFILL_WITH_DECODES;
use crate::engine::work::StepWork;

/// A scheduler prefilling up to 256 tokens a step, with Bob's reply of `n` tokens decoding.
fn bob_decoding(model: &Arc<Model>, n: u32) -> (Scheduler, Events) {
    let mut s = with_chunk(model, 256);
    let bob = submit_as(&mut s, 1, "bob", &prompt(8, 1), n);
    s.step();
    let q = &s.running[0];
    assert_eq!(q.tokens.len() - q.kv_len, 1, "Bob decodes");
    (s, bob)
}

/// Beside decoding sequences, a prompt gets the work that adds a share of a decode-only pass's
/// measured time, not a share of the decoding sequences' work: where a pass has fixed costs, a
/// few prompt tokens beside one sequence cost almost nothing, or a lot on a slow machine.
#[test]
fn the_prefill_beside_decoding_is_a_share_of_the_measured_time() {
    let model = tiny();
    let (mut s, mut bob) = bob_decoding(&model, 30);
    // Decode-only passes of 1 ms, and prompt work costing 1 ms per 20 shallow tokens' worth.
    let shallow = s.work.shallow_token();
    let mut times = StepTimes::default();
    let (decoding, prefill) = (1, 20.0 * shallow);
    let only = StepWork {
        decoding,
        prefill: 0.0,
    };
    times.record(true, only, 1e-3);
    times.record(true, StepWork { decoding, prefill }, 2e-3);
    for share in [0.5, 1.0, 2.0] {
        s.config.prefill_share = share;
        s.times = times;
        let work = s.prefill_budget(&HashSet::new()).work;
        let want = share * 20.0 * shallow;
        assert!(
            (work - want).abs() <= 1e-9 * want,
            "share {share}: {work} for {want}"
        );
    }
    // Twice a decode-only pass's time: 40 shallow tokens' work (fewer tokens: each attends to
    // those before it). The work counts would allow 32 tokens' (the floor beside one sequence).
    let a = prompt(100, 2);
    let mut alice = submit_as(&mut s, 2, "alice", &a, 4);
    let summary = s.step().unwrap();
    audit(&s);
    assert_eq!(summary.decode_seqs, 1);
    let want = s.work.tokens_within(0, a.len(), 40.0 * shallow);
    assert!(want > MIN_PREFILL_WITH_DECODES, "{want}");
    assert_eq!(summary.prefill_tokens, want, "Alice's tokens beside Bob's");
    drain(&mut s, audit);
    assert_eq!(outcome(&mut alice).1, cold(&model, a, 4));
    assert_eq!(outcome(&mut bob).1.len(), 30);
}

/// A prompt token that costs more than a step's share beside decoding sequences does not
/// lengthen every step: the allowance carries over until it pays for the token, so the share
/// holds on average and most of the decoding steps run at their own pace.
#[test]
fn a_prompt_token_dearer_than_a_steps_share_waits_for_the_allowance_to_add_up() {
    let model = tiny();
    let (mut s, mut bob) = bob_decoding(&model, 300);
    // Each step beside Bob may add 0.3 of a shallow token's work.
    let allowance = 0.3 * s.work.shallow_token();
    s.times = StepTimes::fixed(1e-3, 1e-3 / allowance);
    let a = prompt(20, 2);
    let mut alice = submit_as(&mut s, 2, "alice", &a, 4);
    let (mut steps, mut spent, mut idle) = (0, 0.0, 0);
    loop {
        let from = s
            .running
            .iter()
            .find(|q| q.id.0 == 2)
            .map_or(0, |q| q.kv_len);
        let summary = s.step().unwrap();
        audit(&s);
        assert_eq!(summary.decode_seqs, 1, "Bob decodes in every step");
        steps += 1;
        spent += s.work.prefill(from, summary.prefill_tokens);
        idle += usize::from(summary.prefill_tokens == 0);
        assert!(
            spent <= steps as f64 * allowance * (1.0 + 1e-9),
            "{spent} of prompt work in {steps} steps, allowed {allowance} a step"
        );
        if from + summary.prefill_tokens >= a.len() - 1 {
            break;
        }
    }
    assert!(
        idle > steps / 2,
        "{idle} of {steps} steps ran no prompt token"
    );
    drain(&mut s, audit);
    assert_eq!(outcome(&mut alice).1, cold(&model, a, 4));
    assert_eq!(outcome(&mut bob).1.len(), 300);
}
