//! The engine's scheduler on the candle pass: greedy tokens as on the kernels, alone, batched
//! and in fixed-shape steps; session caches and the disk tier in device memory; and the KV type
//! it cannot hold refused.

use hearth_shared::SessionId;
use hearth_worker::engine::{DiskConfig, Engine, EngineConfig};
use hearth_worker::fixtures::TinySpec;
use hearth_worker::generic::{DeviceKv, LoadOptions};
use hearth_worker::kv::KvDtype;

use crate::common::{collect, greedy, prompt, temp_dir, VOCAB};
use crate::{both, both_with};

#[test]
fn the_engine_on_the_candle_pass_decodes_as_on_the_kernels_and_batches_exactly() {
    let (native, generic) = both(&TinySpec {
        quantized: false,
        ..Default::default()
    });
    let config = EngineConfig {
        kv_dtype: KvDtype::F32,
        kv_window_margin: None,
        ..Default::default()
    };
    let on_kernels = Engine::start(native, config.clone()).unwrap();
    let on_candle = Engine::start(generic, config).unwrap();
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| prompt(5 + i * 9, i as u32, VOCAB)).collect();
    let solo = |e: &Engine| -> Vec<Vec<u32>> {
        prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                collect(e.handle().submit(greedy(i as u64, p.clone(), 24)).unwrap()).tokens
            })
            .collect()
    };
    let want = solo(&on_kernels);
    assert_eq!(
        solo(&on_candle),
        want,
        "greedy tokens differ between the two passes"
    );
    // All six at once share the candle engine's steps and give the same tokens.
    let streams: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            on_candle
                .handle()
                .submit(greedy(50 + i as u64, p.clone(), 24))
                .unwrap()
        })
        .collect();
    let batched: Vec<_> = streams.into_iter().map(|s| collect(s).tokens).collect();
    assert_eq!(batched, want, "batched decoding on the candle pass differs");
    // Fixed-shape decode steps (what a GPU replays from graphs): six sequences padded to
    // eight, fewer as they finish, the same tokens.
    let (_, fixed) = both_with(
        &TinySpec {
            quantized: false,
            ..Default::default()
        },
        LoadOptions {
            step_graphs: true,
            ..Default::default()
        },
    );
    let on_fixed = Engine::start(
        fixed,
        EngineConfig {
            kv_dtype: KvDtype::F32,
            kv_window_margin: None,
            ..Default::default()
        },
    )
    .unwrap();
    let streams: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            on_fixed
                .handle()
                .submit(greedy(80 + i as u64, p.clone(), 24 - i as u32))
                .unwrap()
        })
        .collect();
    let fixed: Vec<_> = streams.into_iter().map(|s| collect(s).tokens).collect();
    for (i, (got, want)) in fixed.iter().zip(&want).enumerate() {
        assert_eq!(got[..], want[..24 - i], "fixed-shape steps, sequence {i}");
    }
    let distinct: std::collections::HashSet<_> = want.iter().flatten().collect();
    assert!(distinct.len() >= 8, "degenerate output: {want:?}");
}

#[test]
fn session_caches_and_the_disk_tier_work_on_device_memory() {
    let (_, generic) = both(&TinySpec::default());
    let c = &generic.config;
    let block_bytes = DeviceKv::block_bytes(c.num_layers, 16, c.kv_dim(), KvDtype::F16).unwrap();
    let dir = temp_dir("generic-disk");
    let config = EngineConfig {
        // Room for two of the three sessions below (3 blocks each).
        kv_budget_bytes: 8 * block_bytes,
        kv_disk: Some(DiskConfig {
            dir: dir.clone(),
            bytes: 64 * block_bytes as u64,
        }),
        ..Default::default()
    };
    let e = Engine::start(generic.clone(), config).unwrap();
    let h = e.handle();
    let mut history = Vec::new();
    for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
        let p = prompt(40, 30 + i as u32, VOCAB);
        let mut r = greedy(i as u64, p.clone(), 4);
        r.session = Some(SessionId::new(name));
        let out = collect(h.submit(r).unwrap());
        assert_eq!(out.tokens.len(), 4, "{:?}", out.error);
        history.push((p, out.tokens));
    }
    assert!(h.stats().session_evictions >= 1, "{:?}", h.stats());
    // Session "c" is still in device memory; "a" was evicted to disk. Both resume from cache
    // and answer as a cold engine does.
    let cold = Engine::start(generic, EngineConfig::default()).unwrap();
    for (n, (name, at)) in [("c", 2), ("a", 0)].into_iter().enumerate() {
        let (p, reply) = &history[at];
        let mut turn2 = p.clone();
        turn2.extend(reply);
        turn2.extend(prompt(10, 39, VOCAB));
        let mut r = greedy(10 + n as u64, turn2.clone(), 8);
        r.session = Some(SessionId::new(name));
        let warm = collect(h.submit(r).unwrap());
        assert_eq!(warm.cached_tokens, Some(43), "session {name}");
        let fresh = collect(
            cold.handle()
                .submit(greedy(20 + n as u64, turn2, 8))
                .unwrap(),
        );
        assert_eq!(fresh.cached_tokens, Some(0));
        assert_eq!(warm.tokens, fresh.tokens, "session {name}");
    }
    assert_eq!(h.stats().disk_restores, 1);
}

#[test]
fn int8_kv_on_the_candle_pass_is_refused_with_a_clear_error() {
    let (_, generic) = both(&TinySpec::default());
    let err = Engine::start(
        generic,
        EngineConfig {
            kv_dtype: KvDtype::Int8,
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("int8"), "{err}");
}
