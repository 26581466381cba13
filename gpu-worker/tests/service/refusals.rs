//! What the worker refuses, and how: malformed requests (INVALID_ARGUMENT, without disturbing
//! the others), requests beyond the waiting limit (RESOURCE_EXHAUSTED), and bad configuration at
//! start, with a message naming the flag.

use std::collections::HashMap;

use hearth_shared::proto::{self, FinishReason};
use tonic::Code;

use crate::common::worker::{
    connect, open, request, spawn_worker, wait_health, wait_ready, Outcome,
};
use crate::common::{prompt, VOCAB};
use crate::{expected, tiny_model_file};

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
    let mut good = Outcome::default();
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
    let mut first = Outcome::default();
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
