//! The worker service end to end: the real `hearth-worker` binary on loopback ports with a tiny
//! generated model, driven through the generated gRPC client.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use common::worker::{
    connect, health, open, request, spawn_worker, wait_health, wait_ready, GenStream,
};
use common::{collect, prompt, temp_dir};
use hearth_shared::proto::{self, FinishReason};
use hearth_worker::engine::{Engine, EngineConfig, GenerateRequest};
use hearth_worker::fixtures::{write_tiny_gguf, TinySpec};
use hearth_worker::model::load_gguf;
use tonic::Code;

const VOCAB: u32 = 512;

fn tiny_model_file() -> PathBuf {
    let path = temp_dir("svc").join("tiny.gguf");
    write_tiny_gguf(&path, &TinySpec::default()).expect("write tiny gguf");
    path
}

/// What the engine produces in-process for each prompt on its own: the reference every streamed
/// result must match token for token.
fn expected(model: &std::path::Path, prompts: &[(Vec<u32>, u32)]) -> Vec<Vec<u32>> {
    // On its own thread: the engine's blocking receive must not run on the test's runtime.
    let (model, prompts) = (model.to_path_buf(), prompts.to_vec());
    std::thread::spawn(move || expected_blocking(&model, &prompts))
        .join()
        .expect("reference run")
}

fn expected_blocking(model: &std::path::Path, prompts: &[(Vec<u32>, u32)]) -> Vec<Vec<u32>> {
    let engine = Engine::start(
        std::sync::Arc::new(load_gguf(model).expect("load")),
        EngineConfig::default(),
    )
    .expect("engine");
    let h = engine.handle();
    prompts
        .iter()
        .enumerate()
        .map(|(i, (p, n))| {
            let mut r = GenerateRequest::new(i as u64, p.clone(), *n);
            r.ignore_eos = true;
            collect(h.submit(r).expect("submit")).tokens
        })
        .collect()
}

fn signal(w: &common::worker::WorkerProc, sig: i32) {
    // SAFETY: kill(2) on a child we own; no memory is touched.
    let rc = unsafe { libc::kill(w.child.id() as i32, sig) };
    assert_eq!(rc, 0, "kill failed");
}

async fn wait_exit(w: &mut common::worker::WorkerProc) -> std::process::ExitStatus {
    for _ in 0..1000 {
        if let Some(status) = w.child.try_wait().expect("try_wait") {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("worker did not exit within 20 s");
}

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
    let (status, text) = common::worker::http_get(&w.metrics, "/metrics").await;
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
        common::worker::metric(&w, "hearth_worker_prefix_cache_queries_tokens_total").await,
        Some(20.0)
    );
    assert_eq!(
        common::worker::metric(&w, "hearth_worker_prefix_cache_hits_tokens_total").await,
        Some(0.0)
    );
    // 23 tokens decoded after the prompt's prefill (the last step is recorded just after the
    // request's last event goes out, so allow it a moment).
    let mut decoded = None;
    for _ in 0..100 {
        decoded = common::worker::metric(&w, "hearth_worker_decode_tokens_total").await;
        if decoded >= Some(23.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(decoded, Some(23.0));
    let rss = common::worker::metric(&w, "hearth_worker_device_memory_used_bytes").await;
    assert!(rss > Some(1e6), "{rss:?}");
    assert_eq!(common::worker::http_get(&w.metrics, "/readyz").await.0, 200);
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
    let mut out = common::worker::Outcome::default();
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
    let decoded_before = common::worker::metric(&w, "hearth_worker_decode_tokens_total")
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
    let decoded = common::worker::metric(&w, "hearth_worker_decode_tokens_total")
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
async fn malformed_requests_get_invalid_argument_and_do_not_disturb_others() {
    let model = tiny_model_file();
    let w = spawn_worker(&model, &[]);
    let mut c = connect(&w).await;
    wait_ready(&mut c).await;
    let good = prompt(16, 3, VOCAB);
    let want = expected(&model, &[(good.clone(), 200)]);
    let mut s = open(&mut c).await;
    s.send(vec![request(1, good.clone(), 200)]).await;
    // The same good request on another connection, running while this stream gets bad input.
    let mut c2 = connect(&w).await;
    let mut other = open(&mut c2).await;
    other.send(vec![request(1, good, 200)]).await;

    let with = |id: u64, f: &dyn Fn(&mut proto::GenerateRequest)| {
        let mut r = request(id, prompt(8, id as u32, VOCAB), 4);
        f(&mut r);
        r
    };
    let sampling = |f: &dyn Fn(&mut proto::SamplingParams)| {
        let mut p = proto::SamplingParams::default();
        f(&mut p);
        Some(p)
    };
    let bad: Vec<(proto::GenerateRequest, &str)> = vec![
        (
            with(10, &|r| r.prompt_token_ids.clear()),
            "prompt_token_ids",
        ),
        (
            with(11, &|r| r.prompt_token_ids[3] = 9_999),
            "prompt_token_ids[3]",
        ),
        (
            with(12, &|r| r.prompt_token_ids = vec![5; 2000]),
            "prompt_token_ids",
        ),
        (
            with(13, &|r| {
                r.sampling = sampling(&|p| p.temperature = Some(f32::NAN))
            }),
            "temperature",
        ),
        (
            with(14, &|r| r.sampling = sampling(&|p| p.top_p = Some(2.0))),
            "top_p",
        ),
        (
            with(15, &|r| r.sampling = sampling(&|p| p.min_p = Some(-1.0))),
            "min_p",
        ),
        (with(16, &|r| r.max_new_tokens = 0), "max_new_tokens"),
        (
            with(17, &|r| r.stop_token_ids = vec![70_000]),
            "stop_token_ids",
        ),
        (with(18, &|r| r.session_id = "s".repeat(1000)), "session_id"),
        (with(1, &|_| {}), "request_id"),
    ];
    let ids: Vec<u64> = bad.iter().map(|(r, _)| r.request_id).collect();
    s.send(bad.iter().map(|(r, _)| r.clone()).collect()).await;
    // Every refused request gets exactly one event, an error; the good request (id 1, which the
    // duplicate also names) never errs, so an error for id 1 is the duplicate's.
    let mut refused: HashMap<u64, proto::Error> = HashMap::new();
    let mut good = common::worker::Outcome::default();
    let mut good_done = false;
    while refused.len() < ids.len() || !good_done {
        let e = s.next().await;
        match e.kind {
            Some(proto::worker_event::Kind::Error(err)) => {
                assert!(
                    refused.insert(e.request_id, err).is_none(),
                    "two errors for request {}",
                    e.request_id
                );
            }
            _ => {
                assert_eq!(e.request_id, 1, "only request 1 streams: {e:?}");
                good_done = good.apply(e);
            }
        }
    }
    for (r, field) in &bad {
        let err = &refused[&r.request_id];
        assert_eq!(
            Code::from(err.code),
            Code::InvalidArgument,
            "{field}: {err:?}"
        );
        assert!(
            err.message.contains(field),
            "`{}` should name `{field}`",
            err.message
        );
    }
    let elsewhere = other.collect(&[1]).await.remove(&1).expect("other stream");
    assert_eq!(elsewhere.tokens, want[0]);
    assert_eq!(good.tokens, want[0]);
    assert_eq!(good.reason(), FinishReason::Length);
    let h = wait_health(&mut c, "idle", |h| h.in_flight == 0).await;
    assert!(h.ready);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_the_waiting_limit_requests_get_resource_exhausted() {
    let model = tiny_model_file();
    let w = spawn_worker(&model, &["--max-batch", "1", "--max-waiting", "2"]);
    let mut c = connect(&w).await;
    wait_ready(&mut c).await;
    let mut s = open(&mut c).await;
    s.send(vec![request(1, prompt(8, 1, VOCAB), 1000)]).await;
    let mut first = common::worker::Outcome::default();
    first.apply(s.next().await);
    assert_eq!(first.cached_tokens, Some(0), "the first request is running");
    s.send(
        (2..=4)
            .map(|i| request(i, prompt(8, i as u32, VOCAB), 2))
            .collect(),
    )
    .await;
    let refused = loop {
        let e = s.next().await;
        if e.request_id == 4 {
            break e;
        }
    };
    match refused.kind {
        Some(proto::worker_event::Kind::Error(e)) => {
            assert_eq!(Code::from(e.code), Code::ResourceExhausted, "{e:?}");
        }
        other => panic!("expected RESOURCE_EXHAUSTED, got {other:?}"),
    }
    wait_health(&mut c, "one running and two waiting", |h| {
        (h.running, h.waiting) == (1, 2)
    })
    .await;
    s.cancel(1).await;
    let mut rest = HashMap::from([(1, first)]);
    s.collect_into(&mut rest, &[1, 2, 3]).await;
    assert_eq!(rest[&1].reason(), FinishReason::Cancelled);
    assert_eq!(rest[&2].tokens.len(), 2);
    assert_eq!(rest[&3].tokens.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_refuses_new_work_finishes_in_flight_and_exits_zero() {
    let model = tiny_model_file();
    let mut w = spawn_worker(&model, &[]);
    let mut c = connect(&w).await;
    wait_ready(&mut c).await;
    let prompts: Vec<(Vec<u32>, u32)> = (0..3).map(|i| (prompt(10, i, VOCAB), 900)).collect();
    let want = expected(&model, &prompts);
    let mut s = open(&mut c).await;
    s.send(
        prompts
            .iter()
            .enumerate()
            .map(|(i, (p, n))| request(i as u64, p.clone(), *n))
            .collect(),
    )
    .await;
    let mut outs: HashMap<u64, common::worker::Outcome> = HashMap::new();
    while outs.values().map(|o| o.tokens.len()).sum::<usize>() < 6 {
        let e = s.next().await;
        outs.entry(e.request_id).or_default().apply(e);
    }
    signal(&w, libc::SIGTERM);
    wait_health(&mut c, "draining", |h| {
        h.state == proto::ServingState::Draining as i32 && !h.ready
    })
    .await;
    // New work is refused, on this stream and as a new stream.
    s.send(vec![request(50, prompt(5, 5, VOCAB), 3)]).await;
    let fresh = c
        .generate(tokio_stream::iter(Vec::<proto::WorkerRequest>::new()))
        .await
        .err()
        .map(|e| e.code());
    assert_eq!(fresh, Some(Code::Unavailable));
    // Still serving the drain: the refusal came from the worker, not from a dead socket.
    assert!(!health(&mut c).await.ready);
    let mut refused = None;
    let mut done = 0;
    while done < 3 || refused.is_none() {
        let e = s.next().await;
        if e.request_id == 50 {
            refused = Some(e);
            continue;
        }
        if outs.entry(e.request_id).or_default().apply(e) {
            done += 1;
        }
    }
    match refused.and_then(|e| e.kind) {
        Some(proto::worker_event::Kind::Error(e)) => {
            assert_eq!(Code::from(e.code), Code::Unavailable);
            assert!(e.message.contains("shutting down"), "{e:?}");
        }
        other => panic!("expected UNAVAILABLE, got {other:?}"),
    }
    for i in 0..3u64 {
        assert_eq!(
            outs[&i].tokens, want[i as usize],
            "in-flight request {i} finished whole"
        );
    }
    // The stream then ends with UNAVAILABLE so the client reconnects elsewhere.
    let end = s
        .events
        .message()
        .await
        .expect_err("the stream ends with a status");
    assert_eq!(end.code(), Code::Unavailable);
    assert!(end.message().contains("shutting down"), "{end:?}");
    let status = wait_exit(&mut w).await;
    assert!(status.success(), "exit status {status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_past_its_deadline_ends_replies_unavailable_and_still_exits_zero() {
    let model = tiny_model_file();
    let mut w = spawn_worker(&model, &["--drain-timeout-secs", "0"]);
    let mut c = connect(&w).await;
    wait_ready(&mut c).await;
    let mut s: GenStream = open(&mut c).await;
    s.send(vec![request(1, prompt(10, 1, VOCAB), 1000)]).await;
    let mut out = common::worker::Outcome::default();
    while out.tokens.is_empty() {
        out.apply(s.next().await);
    }
    signal(&w, libc::SIGTERM);
    while !out.apply(s.next().await) {}
    // Not a stop: the caller is told the worker went away, so it continues the reply elsewhere.
    assert!(out.finished.is_none(), "{out:?}");
    assert_eq!(out.error_code(), Code::Unavailable, "{out:?}");
    assert!(wait_exit(&mut w).await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_ready_while_loading_and_a_sigterm_then_exits_at_once() {
    // A FIFO with no writer: opening it blocks, so the worker stays in its loading phase.
    let dir = temp_dir("fifo");
    let fifo = dir.join("model.gguf");
    let c_path = std::ffi::CString::new(fifo.to_str().expect("utf-8 path")).expect("path");
    // SAFETY: mkfifo with a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
    let mut w = spawn_worker(&fifo, &[]);
    let mut c = connect(&w).await;
    let h = health(&mut c).await;
    assert!(!h.ready);
    assert_eq!(h.state, proto::ServingState::Loading as i32);
    let info = c
        .info(proto::InfoRequest {})
        .await
        .expect_err("no info yet");
    assert_eq!(info.code(), Code::Unavailable);
    let gen = c
        .generate(tokio_stream::iter(Vec::<proto::WorkerRequest>::new()))
        .await
        .err()
        .map(|e| e.code());
    assert_eq!(gen, Some(Code::Unavailable));
    assert_eq!(common::worker::http_get(&w.metrics, "/readyz").await.0, 503);
    signal(&w, libc::SIGTERM);
    assert!(wait_exit(&mut w).await.success());
}

#[test]
fn bad_configuration_is_refused_at_start_with_a_message_naming_the_flag() {
    let model = tiny_model_file();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_hearth-worker"))
            .arg("serve")
            .env("HEARTH_MODEL", &model)
            .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
            .args(args)
            .env("RUST_BACKTRACE", "0")
            .output()
            .expect("run hearth-worker");
        assert!(!out.status.success(), "{args:?} was accepted");
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for (args, needle) in [
        (&["--max-batch", "0"][..], "--max-batch"),
        (&["--max-waiting", "0"], "--max-waiting"),
        (&["--prefill-chunk", "0"], "--prefill-chunk"),
        (&["--kv-budget", "lots"], "--kv-budget"),
        (&["--kv-budget", "0"], "--kv-budget"),
        (&["--device", "gpu"], "--device"),
        (&["--device", "cuda:0"], "cuda:0"),
        (
            &["--model", "/nonexistent/model.gguf"],
            "/nonexistent/model.gguf",
        ),
        (
            &["--tokenizer", "/nonexistent/tokenizer.json"],
            "--tokenizer",
        ),
    ] {
        let (out, err) = run(args);
        assert!(
            err.contains(needle),
            "{args:?}: `{err}` should name `{needle}`"
        );
        assert!(out.is_empty(), "{args:?} was refused only after listening");
    }
    // A KV budget smaller than one block of this model is refused (once the model's shape is
    // known), not served with no memory.
    let (_, err) = run(&["--kv-budget", "1KiB"]);
    assert!(err.contains("KV budget"), "{err}");
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
