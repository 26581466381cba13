//! SIGTERM and the drain: new work refused while in-flight replies finish, a drain past its
//! deadline ending replies UNAVAILABLE, and a worker still loading its model exiting at once;
//! each exits 0.

use std::collections::HashMap;

use hearth_shared::proto;
use tonic::Code;

use crate::common::worker::{
    connect, health, open, request, signal, spawn_worker, wait_exit, wait_health, wait_ready,
    GenStream, Outcome,
};
use crate::common::{prompt, temp_dir, VOCAB};
use crate::{expected, tiny_model_file};

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
    let mut outs: HashMap<u64, Outcome> = HashMap::new();
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
    let mut out = Outcome::default();
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
    // Info answers while loading: no default model yet, and whatever it lists is loading.
    let info = c
        .info(proto::InfoRequest {})
        .await
        .expect("info while loading")
        .into_inner();
    assert_eq!(info.model_id, "", "{info:?}");
    assert!(
        info.models
            .iter()
            .all(|m| m.state == proto::ModelState::Loading as i32),
        "{info:?}"
    );
    let gen = c
        .generate(tokio_stream::iter(Vec::<proto::WorkerRequest>::new()))
        .await
        .err()
        .map(|e| e.code());
    assert_eq!(gen, Some(Code::Unavailable));
    assert_eq!(
        crate::common::worker::http_get(&w.metrics, "/readyz")
            .await
            .0,
        503
    );
    signal(&w, libc::SIGTERM);
    assert!(wait_exit(&mut w).await.success());
}
