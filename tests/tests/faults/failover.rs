//! Replies whose worker fails them: a worker frozen with its connection open (the stall
//! timeout), a worker draining past its deadline, and an engine that sticks while its process
//! stays up. Each reply continues on another worker and ends whole, stored once.

use std::time::{Duration, Instant};

use hearth_e2e::http::Event;
use hearth_e2e::stack::{
    assets, finish, history, metric, new_session, read_tokens, scripted_worker, serving_worker,
    signal, stream_turn, token_text, worker_with, Db, Hearth, Stack,
};
use hearth_worker::fixtures::TinySpec;
use serde_json::json;

/// Scripted workers: a token every 40 ms, and a drain that gives up after 1 s.
const SCRIPTED: [&str; 4] = ["--scripted-token-ms", "40", "--drain-timeout-secs", "1"];

/// A reply that ended with `length` after `tokens` tokens, stored once with the streamed text.
async fn assert_completed_once(
    s: &Stack,
    key: &str,
    sid: &str,
    text: &str,
    end: &Event,
    tokens: u64,
) {
    assert_eq!(end.event, "message_end", "{end:?}");
    let e = end.json();
    assert_eq!(e["status"], "complete", "{e}");
    assert_eq!(e["finish_reason"], "length", "{e}");
    assert_eq!(e["usage"]["completion_tokens"], tokens, "{e}");
    let msgs = history(s.addr(), key, sid).await;
    assert_eq!(msgs.len(), 2, "one user message and one reply: {msgs:#?}");
    assert_eq!(msgs[1]["role"], "assistant");
    assert_eq!(msgs[1]["status"], "complete");
    assert_eq!(
        msgs[1]["content"], text,
        "the stored reply is what was streamed"
    );
}

/// Two scripted workers; a 150-token reply (6 s) that, after 10 tokens, gets `sig` sent to the
/// worker serving it. Checks the reply still completes, once, with everything it streamed; the
/// stack, the signalled worker and how long the rest took.
async fn reply_outlives(tag: &str, sig: i32, extra: &[&str]) -> (Stack, usize, Duration) {
    let s = Stack::start_full(tag, &TinySpec::default(), Db::Postgres, 2, &SCRIPTED, extra).await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let mut sse = stream_turn(s.addr(), &k, &sid, 150).await;
    let head = token_text(&read_tokens(&mut sse, 10).await);
    let home = serving_worker(&s).await;
    signal(&s.workers[home].child, sig);
    let signalled = Instant::now();
    let (rest, end) = finish(&mut sse).await;
    let took = signalled.elapsed();
    assert_completed_once(&s, &k, &sid, &(head + &rest), &end, 150).await;
    (s, home, took)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_worker_s_reply_continues_on_another_after_the_stall_timeout() {
    // The worker process freezes with its connection open: no error, no more tokens.
    let (s, home, took) =
        reply_outlives("stall", libc::SIGSTOP, &["--stall-timeout-secs", "2"]).await;
    signal(&s.workers[home].child, libc::SIGCONT);
    // The 140 tokens left take 5.6 s; before them, the 2 s of silence that declare the worker
    // stalled. Printed, not asserted: the machine is shared. That the stall was noticed at all
    // (the frozen worker never answers, so the reply could not have ended otherwise) is the
    // completed reply above and the one failover below.
    println!("the reply finished {took:?} after its worker froze (stall timeout 2 s)");
    let failovers = metric(s.addr(), "hearth_worker_failovers_total").await;
    assert_eq!(failovers, 1.0, "the frozen worker's reply moved once");
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_worker_s_reply_fails_over_and_finishes_with_length() {
    // The worker's drain gives up after 1 s, long before the reply's 6 s.
    let (mut s, home, _) = reply_outlives("drain", libc::SIGTERM, &[]).await;
    let status = s.workers[home].child.wait().expect("drained worker exits");
    assert!(status.success(), "{status}");
    // It moved once, to the other worker, rather than ending where the drain cut it.
    let failovers = metric(s.addr(), "hearth_worker_failovers_total").await;
    assert_eq!(failovers, 1.0);
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_on_a_stuck_engine_continues_on_another_worker() {
    reply_on_an_engine_stuck_after("engine_stall", 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_whose_engine_sticks_before_its_first_token_is_served_by_another_worker() {
    reply_on_an_engine_stuck_after("engine_stall_0", 0).await;
}

/// worker-1's engine thread stops for good after `tokens` tokens while its process, its gRPC
/// server and its health checks stay up; it reports the stall after 1 s. The reply must still
/// end whole, from worker-2, after exactly one failover.
async fn reply_on_an_engine_stuck_after(tag: &str, tokens: u64) {
    let a = assets(tag);
    let freeze = tokens.to_string();
    let stuck = worker_with(
        &a.model,
        &[
            "--scripted-token-ms",
            "40",
            "--scripted-freeze-after-tokens",
            &freeze,
            "--engine-stall-secs",
            "1",
        ],
    );
    let healthy = scripted_worker(&a.model, 40);
    let mut args = a.open_args(&["--stall-timeout-secs", "2"]);
    for w in [&stuck, &healthy] {
        args.extend(["--worker".to_string(), w.grpc.clone()]);
    }
    let hearth = Hearth::spawn(&args);
    hearth.wait_ready().await;
    let sid = new_session(hearth.addr, "").await;
    // Both idle: the reply goes to the first worker, whose engine then freezes.
    let mut sse = stream_turn(hearth.addr, "", &sid, 100).await;
    let (text, end) = tokio::time::timeout(Duration::from_secs(60), finish(&mut sse))
        .await
        .expect("the reply did not end within 60 s of its worker's engine sticking");
    assert_eq!(end.event, "message_end", "{end:?}");
    let e = end.json();
    assert_eq!(
        (e["finish_reason"].clone(), e["worker"].clone()),
        (json!("length"), json!("worker-2")),
        "{e}"
    );
    assert_eq!(e["usage"]["completion_tokens"], 100, "{e}");
    let msgs = history(hearth.addr, "", &sid).await;
    assert_eq!(msgs.len(), 2);
    assert_eq!(msgs[1]["content"], text.as_str());
    assert_eq!(
        metric(hearth.addr, "hearth_worker_failovers_total").await,
        1.0
    );
    drop(hearth);
    drop((stuck, healthy));
    let _ = std::fs::remove_dir_all(&a.dir);
}
