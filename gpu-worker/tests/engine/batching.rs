//! How requests share the engine: a prompt alone and inside a batch, seeded sampling, cancels and
//! dropped streams, memory pressure (evict, then preempt, losing nothing), and one user's many
//! requests beside another's.

use std::time::Duration;

use hearth_shared::{FinishReason, SamplingParams, SessionId, UserId};
use hearth_worker::engine::{EngineConfig, EngineError, EngineEvent, GenerateRequest};

use crate::common::{collect, engine, greedy, prompt, tiny_model, VOCAB};

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
            ..SamplingParams::default()
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
    use std::time::Instant;
    let e = engine(
        tiny_model(),
        EngineConfig {
            max_batch: 2,
            ..Default::default()
        },
    );
    let h = e.handle();
    // When each request reached the engine lies between the instants around its `submit`; its
    // `Started` event says how long after that it was admitted. So its admission lies in
    // `[before + queue, after + queue]`, on the engine's own monotonic clock.
    let mut admitted = Vec::new();
    let mut submit = |id: u64, seed: u32, user: &str| {
        let mut r = greedy(id, prompt(10, seed, VOCAB), 30);
        r.user = UserId::from(user);
        let before = Instant::now();
        let rx = h.submit(r).unwrap();
        admitted.push((before, Instant::now()));
        rx
    };
    let heavy: Vec<_> = (0..8).map(|i| submit(i, i as u32, "heavy")).collect();
    let light = submit(100, 99, "light");
    let window = |(before, after): (Instant, Instant), o: &crate::common::Outcome| {
        let queue = Duration::from_secs_f64(o.queue_ms.expect("a Started event") / 1e3);
        (before + queue, after + queue)
    };
    let light_out = collect(light);
    assert_eq!(light_out.tokens.len(), 30);
    let heavy_out: Vec<_> = heavy.into_iter().map(collect).collect();
    assert!(heavy_out.iter().all(|o| o.tokens.len() == 30));
    // Ordered, not timed: with FIFO the light request would be admitted last (after all 8 heavy
    // ones, 4 batches of 30 steps in); with fair share it takes the slot freed by the first heavy
    // request, so at least the last four heavy requests are admitted after it. Counted only
    // where the order is certain (the windows do not overlap).
    let (_, light_admitted) = window(admitted[8], &light_out);
    let later = heavy_out
        .iter()
        .enumerate()
        .filter(|(i, o)| window(admitted[*i], o).0 > light_admitted)
        .count();
    println!("the light request was admitted before {later} of the 8 heavy ones");
    assert!(
        later >= 4,
        "the light request was admitted after {} of the 8 heavy ones",
        8 - later
    );
}
