//! Generation over the worker's stream: info and health, a streamed generation, concurrent
//! requests that each get exactly their own tokens, cancels and dropped streams, a session's cache
//! across turns, and request ids reused as soon as they are done.

use std::time::Duration;

use hearth_shared::proto::{self, FinishReason};
use tonic::Code;

use crate::common::worker::{
    connect, health, open, request, spawn_worker, wait_health, wait_ready, Outcome,
};
use crate::common::{prompt, VOCAB};
use crate::{expected, tiny_model_file};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_health_and_a_streamed_generation() {
    let model = tiny_model_file();
    let w = spawn_worker(&model, &[]);
    let mut c = connect(&w).await;
    let h = wait_ready(&mut c).await;
    assert_eq!(h.state, proto::ServingState::Ready as i32);
    assert!(h.kv_blocks_total > 0);
    assert_eq!((h.running, h.waiting, h.kv_blocks_used), (0, 0, 0));

    let info = c
        .info(proto::InfoRequest {})
        .await
        .expect("info")
        .into_inner();
    assert_eq!(info.model_id, "tiny");
    assert_eq!(info.architecture, "gemma3");
    assert_eq!((info.vocab_size, info.context_length), (VOCAB, 1024));
    let special = info.special_tokens.expect("special tokens");
    assert_eq!(
        (special.bos, special.eos, special.end_of_turn),
        (Some(2), Some(1), Some(106))
    );
    assert_eq!(info.device.expect("device").kind, "cpu");
    let kv = info.kv.expect("kv");
    assert_eq!(kv.block_size, 16);
    assert_eq!(kv.blocks_total, h.kv_blocks_total);
    assert!(
        kv.budget_bytes <= 64 << 20 && kv.budget_bytes > 60 << 20,
        "{kv:?}"
    );

    let p = prompt(20, 1, VOCAB);
    let want = expected(&model, &[(p.clone(), 24)]);
    let mut s = open(&mut c).await;
    s.send(vec![request(7, p, 24)]).await;
    let out = s.collect(&[7]).await.remove(&7).expect("outcome");
    assert_eq!(out.cached_tokens, Some(0));
    assert_eq!(out.tokens, want[0]);
    assert_eq!(out.reason(), FinishReason::Length);
    let f = out.finished.expect("finished");
    assert_eq!((f.prompt_tokens, f.completion_tokens), (20, 24));
    assert!(f.timings.expect("timings").total_ms > 0.0);

    // The metrics endpoint has the worker metrics named in DESIGN.md.
    let (status, text) = crate::common::worker::http_get(&w.metrics, "/metrics").await;
    assert_eq!(status, 200);
    for name in [
        "hearth_worker_batch_size",
        "hearth_worker_batch_utilization",
        "hearth_worker_step_duration_seconds",
        "hearth_worker_kv_blocks_used",
        "hearth_worker_kv_blocks_total",
        "hearth_worker_cached_sessions",
        "hearth_worker_session_evictions_total",
        "hearth_worker_device_memory_used_bytes",
        "hearth_worker_device_memory_total_bytes",
        "hearth_worker_prefix_cache_queries_tokens_total",
        "hearth_worker_prefix_cache_hits_tokens_total",
        "hearth_worker_spec_draft_tokens_total",
        "hearth_worker_spec_accepted_tokens_total",
    ] {
        assert!(text.contains(name), "/metrics lacks {name}:\n{text}");
    }
    // The one request looked up its 20 prompt tokens and found none cached.
    assert_eq!(
        crate::common::worker::metric(&w, "hearth_worker_prefix_cache_queries_tokens_total").await,
        Some(20.0)
    );
    assert_eq!(
        crate::common::worker::metric(&w, "hearth_worker_prefix_cache_hits_tokens_total").await,
        Some(0.0)
    );
    // 23 tokens decoded after the prompt's prefill (the last step is recorded just after the
    // request's last event goes out, so allow it a moment).
    let mut decoded = None;
    for _ in 0..100 {
        decoded = crate::common::worker::metric(&w, "hearth_worker_decode_tokens_total").await;
        if decoded >= Some(23.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(decoded, Some(23.0));
    let rss = crate::common::worker::metric(&w, "hearth_worker_device_memory_used_bytes").await;
    assert!(rss > Some(1e6), "{rss:?}");
    assert_eq!(
        crate::common::worker::http_get(&w.metrics, "/readyz")
            .await
            .0,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_requests_each_get_exactly_their_own_tokens() {
    let model = tiny_model_file();
    let w = spawn_worker(&model, &[]);
    let mut c = connect(&w).await;
    wait_ready(&mut c).await;
    let prompts: Vec<(Vec<u32>, u32)> = (0..20)
        .map(|i| (prompt(5 + i * 3, i as u32, VOCAB), 8 + i as u32))
        .collect();
    let want = expected(&model, &prompts);

    // All twenty on one stream, in two batches.
    let mut s = open(&mut c).await;
    let reqs: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, (p, n))| request(100 + i as u64, p.clone(), *n))
        .collect();
    s.send(reqs[..10].to_vec()).await;
    s.send(reqs[10..].to_vec()).await;
    let ids: Vec<u64> = (100..120).collect();
    let got = s.collect(&ids).await;
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(got[id].tokens, want[i], "request {id} on one stream");
        assert_eq!(got[id].reason(), FinishReason::Length);
    }

    // Twenty across four connections, five each, all in flight at once; the same request ids on
    // every connection, since ids are per stream.
    let mut tasks = Vec::new();
    for conn in 0..4 {
        let mut c = connect(&w).await;
        let mine: Vec<(u64, usize)> = (0..5).map(|k| (k as u64, conn * 5 + k)).collect();
        let reqs: Vec<_> = mine
            .iter()
            .map(|&(id, i)| request(id, prompts[i].0.clone(), prompts[i].1))
            .collect();
        tasks.push(tokio::spawn(async move {
            let mut s = open(&mut c).await;
            s.send(reqs).await;
            let ids: Vec<u64> = mine.iter().map(|m| m.0).collect();
            (mine, s.collect(&ids).await)
        }));
    }
    for t in tasks {
        let (mine, got) = t.await.expect("task");
        for (id, i) in mine {
            assert_eq!(got[&id].tokens, want[i], "prompt {i} across connections");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_frees_the_slot_and_dropping_a_stream_cancels_all_of_it() {
    let model = tiny_model_file();
    let w = spawn_worker(&model, &[]);
    let mut c = connect(&w).await;
    wait_ready(&mut c).await;

    let mut s = open(&mut c).await;
    s.send(vec![request(1, prompt(10, 1, VOCAB), 1000)]).await;
    let mut out = Outcome::default();
    while out.tokens.len() < 3 {
        out.apply(s.next().await);
    }
    let h = health(&mut c).await;
    assert_eq!((h.running, h.in_flight), (1, 1));
    assert!(h.kv_blocks_used > 0);
    s.cancel(1).await;
    while !out.apply(s.next().await) {}
    assert_eq!(out.reason(), FinishReason::Cancelled);
    assert!(out.tokens.len() < 1000);
    wait_health(&mut c, "the slot freed", |h| {
        h.running == 0 && h.in_flight == 0 && h.kv_blocks_used == 0
    })
    .await;

    // Five long requests, then the client goes away without a word.
    let decoded_before = crate::common::worker::metric(&w, "hearth_worker_decode_tokens_total")
        .await
        .unwrap_or(0.0);
    let mut s = open(&mut c).await;
    s.send(
        (0..5)
            .map(|i| request(i, prompt(12, i as u32, VOCAB), 1000))
            .collect(),
    )
    .await;
    let mut seen = 0;
    while seen < 10 {
        if let Some(proto::worker_event::Kind::Tokens(t)) = s.next().await.kind {
            seen += t.ids.len();
        }
    }
    drop(s);
    wait_health(&mut c, "the dropped stream's requests gone", |h| {
        h.running == 0 && h.waiting == 0 && h.in_flight == 0 && h.kv_blocks_used == 0
    })
    .await;
    let decoded = crate::common::worker::metric(&w, "hearth_worker_decode_tokens_total")
        .await
        .unwrap_or(0.0)
        - decoded_before;
    assert!(
        decoded < 2500.0,
        "the dropped requests ran on: {decoded} tokens decoded"
    );
    // The worker is unharmed.
    let mut s = open(&mut c).await;
    s.send(vec![request(9, prompt(5, 9, VOCAB), 4)]).await;
    assert_eq!(s.collect(&[9]).await[&9].tokens.len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_turn_reuses_the_session_cache_until_the_session_is_dropped() {
    let model = tiny_model_file();
    let w = spawn_worker(&model, &[]);
    let mut c = connect(&w).await;
    wait_ready(&mut c).await;
    let mut s = open(&mut c).await;
    let session = |mut r: proto::GenerateRequest| {
        r.session_id = "chat-1".into();
        r
    };
    let turn1 = prompt(30, 1, VOCAB);
    s.send(vec![session(request(1, turn1.clone(), 10))]).await;
    let first = s.collect(&[1]).await.remove(&1).expect("turn 1");
    assert_eq!(first.cached_tokens, Some(0));
    wait_health(&mut c, "the session cached", |h| h.cached_sessions == 1).await;

    let mut turn2 = turn1.clone();
    turn2.extend(&first.tokens);
    turn2.extend(prompt(6, 2, VOCAB));
    s.send(vec![session(request(2, turn2.clone(), 5))]).await;
    let second = s.collect(&[2]).await.remove(&2).expect("turn 2");
    // Everything the first turn ran through the model: its prompt and all but its last token.
    assert_eq!(second.cached_tokens, Some(30 + 10 - 1));
    assert_eq!(second.finished.as_ref().map(|f| f.cached_tokens), Some(39));
    let cold = expected(&model, &[(turn2.clone(), 5)]);
    assert_eq!(second.tokens, cold[0]);

    c.drop_session(proto::DropSessionRequest {
        session_id: "chat-1".into(),
    })
    .await
    .expect("drop session");
    let h = health(&mut c).await;
    assert_eq!((h.cached_sessions, h.kv_blocks_used), (0, 0));
    let again = c
        .drop_session(proto::DropSessionRequest {
            session_id: "chat-1".into(),
        })
        .await
        .expect_err("already dropped");
    assert_eq!(again.code(), Code::NotFound);
    // The session's cache is gone; what is left is the prefix cache's full blocks (two of 16).
    s.send(vec![session(request(3, turn2, 5))]).await;
    assert_eq!(s.collect(&[3]).await[&3].cached_tokens, Some(32));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_can_be_reused_as_soon_as_its_last_event_arrives() {
    let model = tiny_model_file();
    let w = spawn_worker(&model, &[]);
    let mut c = connect(&w).await;
    wait_ready(&mut c).await;
    let mut s = open(&mut c).await;
    for round in 0..30u32 {
        s.send(vec![request(5, prompt(4, round, VOCAB), 1)]).await;
        let out = s.collect(&[5]).await.remove(&5).expect("outcome");
        assert!(out.error.is_none(), "round {round}: {out:?}");
        assert_eq!(out.tokens.len(), 1);
    }
}

/// A schema that takes long to compile against a vocabulary: any of 512 objects, each with
/// an integer bounded below by a number of its own.
fn heavy_schema() -> String {
    let any: Vec<serde_json::Value> = (0..512)
        .map(|i| {
            serde_json::json!({"type": "object", "properties": {
                "name": {"const": format!("t{i}")},
                "a": {"type": "integer", "minimum": i * 7919}},
                "required": ["name", "a"], "additionalProperties": false})
        })
        .collect();
    serde_json::json!({ "anyOf": any }).to_string()
}

/// The orchestrator sends every tenant's requests down one stream, so a request whose grammar
/// compiles for seconds must not hold up those behind it: they are served meanwhile, and a cancel
/// of the compiling request ends it at once, before it ever reaches the engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compiling_grammar_holds_up_neither_the_stream_nor_its_cancel() {
    let model = tiny_model_file();
    let p = prompt(8, 2, VOCAB);
    let want = expected(&model, &[(p.clone(), 6)]);
    let w = spawn_worker(&model, &[]);
    let mut c = connect(&w).await;
    wait_ready(&mut c).await;

    let constrained = |id| {
        let mut r = request(id, prompt(8, 1, VOCAB), 200);
        r.ignore_eos = false;
        r.grammar = Some(proto::Grammar {
            kind: Some(proto::grammar::Kind::JsonSchema(heavy_schema())),
        });
        r
    };
    let mut s = open(&mut c).await;
    s.send(vec![constrained(1), request(2, p.clone(), 6)]).await;
    let mut out: std::collections::HashMap<u64, Outcome> = Default::default();
    let mut order = Vec::new();
    while out.get(&2).is_none_or(|o| o.finished.is_none()) {
        let e = s.next().await;
        order.push(e.request_id);
        out.entry(e.request_id).or_default().apply(e);
    }
    assert!(
        !order.contains(&1),
        "the plain request waited for the grammar: events in order {order:?}"
    );
    assert_eq!(out[&2].tokens, want[0]);

    // A cancel reaches the request whose grammar is still compiling.
    s.send(vec![constrained(3)]).await;
    s.cancel(3).await;
    let got = s.collect(&[1, 3]).await;
    let cancelled = &got[&3];
    assert_eq!(cancelled.reason(), FinishReason::Cancelled, "{cancelled:?}");
    assert_eq!(
        (cancelled.cached_tokens, cancelled.tokens.len()),
        (None, 0),
        "cancelled before it started: {cancelled:?}"
    );
    let f = cancelled.finished.as_ref().expect("finished");
    assert_eq!((f.prompt_tokens, f.completion_tokens), (8, 0));
    // The first one compiled and ran, constrained.
    let first = &got[&1];
    assert!(first.error.is_none(), "{first:?}");
    assert!(!first.tokens.is_empty(), "{first:?}");
    // The id of the cancelled request is free again at once.
    s.send(vec![request(3, p, 6)]).await;
    assert_eq!(s.collect(&[3]).await[&3].tokens, want[0]);
    wait_health(&mut c, "nothing left in flight", |h| {
        h.running == 0 && h.in_flight == 0 && h.kv_blocks_used == 0
    })
    .await;
}
