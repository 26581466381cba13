//! Failure modes of a running stack that must neither lose nor hang a reply: a worker that stops
//! answering, a worker that drains with a reply longer than its deadline, queued clients that go
//! away, a user whose requests fill the queue, a stream resumed at or past its end, a session
//! deleted while it replies, and requests that other sites make to a server running without keys.
//!
//! Most workers here run in scripted mode (one token per tick, no model), so how long a reply
//! lasts is set by the test rather than by how busy the machine is.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use hearth_e2e::http::{Event, Req, Sse};
use hearth_e2e::stack::{
    assets, history, metric, new_session, path, serving_worker, signal, slow_spec, stream_turn,
    wait_idle, wait_metric, worker_bin, worker_metric, Db, Hearth, Stack,
};
use hearth_worker::fixtures::{TinySpec, WorkerProcess};
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// Scripted workers: a token every 40 ms, and a drain that gives up after 1 s.
const SCRIPTED: [&str; 4] = ["--scripted-token-ms", "40", "--drain-timeout-secs", "1"];

/// Reads until `n` token events have arrived; their text.
async fn read_tokens(sse: &mut Sse, n: usize) -> String {
    let mut tokens = 0;
    let mut text = String::new();
    while tokens < n {
        let e = sse.next().await.expect("the stream ended early");
        assert!(
            e.event == "token" || e.event == "message_start",
            "the reply ended before {n} tokens: {e:?}"
        );
        if e.event == "token" {
            tokens += 1;
            text += e.json()["text"].as_str().unwrap_or_default();
        }
    }
    text
}

/// The rest of a stream: its text and its last event.
async fn finish(sse: &mut Sse) -> (String, Event) {
    let events = sse.rest().await;
    let last = events.last().cloned().expect("the stream had no end");
    let text = events
        .iter()
        .filter(|e| e.event == "token")
        .map(|e| e.json()["text"].as_str().unwrap_or_default().to_string())
        .collect();
    (text, last)
}

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
    let head = read_tokens(&mut sse, 10).await;
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
    println!("the reply finished {took:?} after its worker froze (stall timeout 2 s)");
    // The 140 tokens left take 5.6 s; before them, the 2 s of silence that declare the worker
    // stalled. Far longer means the stall went unnoticed for a while.
    assert!(
        took < Duration::from_secs(11),
        "the reply finished {took:?} after the freeze: expected 2 s of stall and 5.6 s of tokens"
    );
    let failovers = metric(s.addr(), "hearth_worker_failovers_total").await;
    assert_eq!(failovers, 1.0);
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

/// An OpenAI completion request written on a raw connection, left open; dropping the stream
/// is a client that goes away.
async fn queued_client(addr: SocketAddr, key: &str) -> TcpStream {
    raw_completion(addr, key, 3).await
}

/// A streamed OpenAI completion of `max_tokens` tokens written on a raw connection, left open.
async fn raw_completion(addr: SocketAddr, key: &str, max_tokens: u32) -> TcpStream {
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": max_tokens, "ignore_eos": true, "stream": true})
    .to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut c = TcpStream::connect(addr).await.expect("connect");
    c.write_all(head.as_bytes()).await.expect("write");
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_leave_the_queue_give_their_places_back() {
    let s = Stack::scripted(
        "queue",
        Db::Sqlite,
        1,
        40,
        &[
            "--worker-capacity",
            "1",
            "--max-queue",
            "50",
            "--queue-timeout-secs",
            "120",
        ],
    )
    .await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    // The one worker place is taken for as long as the test needs it.
    let mut busy = stream_turn(s.addr(), &k, &sid, 900).await;
    read_tokens(&mut busy, 1).await;
    let wait = Duration::from_secs(20);
    for round in 0..10 {
        let mut clients = Vec::new();
        for _ in 0..50 {
            clients.push(queued_client(s.addr(), &k).await);
        }
        let depth = wait_metric(s.addr(), "hearth_queue_depth", wait, |v| v == 50.0).await;
        assert_eq!(depth, 50.0, "round {round}: 50 clients should be queued");
        drop(clients);
        let depth = wait_metric(s.addr(), "hearth_queue_depth", wait, |v| v == 0.0).await;
        assert_eq!(
            depth, 0.0,
            "round {round}: clients that left still hold queue places"
        );
    }
    // The queue still admits: a request waits for the place and gets it when the reply stops.
    let addr = s.addr();
    let key = k.clone();
    let queued = tokio::spawn(async move {
        Req::new("POST", "/v1/chat/completions")
            .key(Some(&key))
            .json(
                &json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 3}),
            )
            .send(addr)
            .await
    });
    let depth = wait_metric(s.addr(), "hearth_queue_depth", wait, |v| v == 1.0).await;
    assert_eq!(depth, 1.0, "the new request should wait in the queue");
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/stop"))
        .key(Some(&k))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = queued.await.expect("queued request");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(metric(s.addr(), "hearth_queue_depth").await, 0.0);
    drop(busy);
    s.finish().await;
}

/// Time to the first token of a streamed one-token OpenAI completion, and that it succeeded:
/// until the first event after the role chunk (the scripted worker echoes the prompt, whose
/// first token is a marker with no text, so that event is the finish chunk).
async fn ttft(addr: SocketAddr, key: &str) -> Duration {
    let started = Instant::now();
    let mut sse = Req::new("POST", "/v1/chat/completions")
        .key(Some(key))
        .json(
            &json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 1, "ignore_eos": true, "stream": true}),
        )
        .events(addr)
        .await;
    assert_eq!(
        sse.status, 200,
        "refused while another user filled the queue"
    );
    loop {
        let e = sse.next().await.expect("the stream ended before a token");
        let delta = &e.json()["choices"][0]["delta"];
        if delta.get("role").is_none() {
            let took = started.elapsed();
            let rest = sse.rest().await;
            assert!(rest.iter().any(|e| e.data == "[DONE]"), "{e:?} {rest:?}");
            return took;
        }
    }
}

fn p50(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_with_200_requests_in_flight_cannot_starve_another() {
    // One worker that takes 4 requests at a time from hearth, and a queue of 100: alice's 200
    // requests fill both, and 96 are refused. Each of her replies holds a place for about 0.8 s,
    // so her queue lasts about 20 s. Bob's TTFT must stay within 2x of his TTFT alone.
    let s = Stack::scripted(
        "fairness",
        Db::Sqlite,
        1,
        40,
        &[
            "--worker-capacity",
            "4",
            "--max-queue",
            "100",
            "--queue-timeout-secs",
            "120",
        ],
    )
    .await;
    let (alice, bob) = (s.key("alice").await, s.key("bob").await);
    let mut alone = Vec::new();
    for _ in 0..5 {
        alone.push(ttft(s.addr(), &bob).await);
    }
    let mut flood = Vec::new();
    for _ in 0..200 {
        flood.push(raw_completion(s.addr(), &alice, 20).await);
    }
    let wait = Duration::from_secs(30);
    let depth = wait_metric(s.addr(), "hearth_queue_depth", wait, |v| v == 100.0).await;
    assert_eq!(
        depth, 100.0,
        "alice's requests should fill the queue: {depth}"
    );
    let mut busy = Vec::new();
    for _ in 0..5 {
        busy.push(ttft(s.addr(), &bob).await);
    }
    let depth = metric(s.addr(), "hearth_queue_depth").await;
    let (alone, busy) = (p50(alone), p50(busy));
    println!(
        "bob's TTFT p50: {alone:?} alone, {busy:?} beside alice's 200 requests ({depth} still queued)"
    );
    // Without a shared queue bob is refused (alice holds every place); without fair order he
    // waits behind her queue (about 20 s); without preemption, for one of her replies to end
    // (about 0.8 s, twenty times his TTFT alone). Each of his requests takes one of her places.
    assert!(depth >= 60.0, "alice's queue should still be long: {depth}");
    assert!(
        busy <= alone * 2,
        "bob's TTFT p50 went from {alone:?} alone to {busy:?} beside alice's queue"
    );
    let preempted = metric(s.addr(), "hearth_fair_share_preemptions_total").await;
    assert!(
        preempted >= 5.0,
        "{preempted} preemptions for bob's 5 requests"
    );
    drop(flood);
    let depth = wait_metric(s.addr(), "hearth_queue_depth", wait, |v| v == 0.0).await;
    assert_eq!(depth, 0.0);
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resuming_at_or_past_the_end_of_a_finished_stream_closes_at_once() {
    let s = Stack::scripted("resume-end", Db::Sqlite, 1, 40, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let mut sse = stream_turn(s.addr(), &k, &sid, 5).await;
    let events = sse.rest().await;
    let last_id = events.last().and_then(|e| e.id.clone()).expect("event ids");
    let (message, n) = last_id.rsplit_once(':').expect("<message>:<n>");
    let n: usize = n.parse().expect("event number");
    let addr = s.addr();
    let resume = |from: usize| {
        let (k, sid) = (k.clone(), sid.clone());
        let id = format!("{message}:{from}");
        async move {
            let mut sse = Req::new("GET", &format!("/v1/sessions/{sid}/stream"))
                .key(Some(&k))
                .header("Last-Event-ID", id)
                .events(addr)
                .await;
            assert_eq!(sse.status, 200);
            tokio::time::timeout(Duration::from_secs(5), sse.rest())
                .await
                .unwrap_or_else(|_| panic!("resuming after event {from} of {n} did not close"))
        }
    };
    let tail = resume(n - 1).await;
    assert_eq!(tail.len(), 1, "only the last event is new: {tail:?}");
    assert_eq!(tail[0].event, "message_end");
    for from in [n, n + 1, n + 1000] {
        assert_eq!(
            resume(from).await,
            Vec::<Event>::new(),
            "after event {from}"
        );
    }
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_session_stops_its_reply_and_frees_its_cache_on_the_worker() {
    let s = Stack::start_with("delete", &slow_spec(), Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;
    let w = &s.workers[0];
    let sid = new_session(s.addr(), &k).await;
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&k))
        .json(&json!({"content": "hello", "max_tokens": 3, "stream": false}))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let metrics: SocketAddr = w.metrics.parse().expect("metrics addr");
    let cached = wait_metric(
        metrics,
        "hearth_worker_cached_sessions",
        Duration::from_secs(5),
        |v| v == 1.0,
    )
    .await;
    assert_eq!(cached, 1.0, "the finished turn's cache is kept");
    let mut sse = stream_turn(s.addr(), &k, &sid, 900).await;
    read_tokens(&mut sse, 2).await;
    let r = Req::new("DELETE", &format!("/v1/sessions/{sid}"))
        .key(Some(&k))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 204, "{}", r.text());
    let (_, end) = tokio::time::timeout(Duration::from_secs(10), finish(&mut sse))
        .await
        .expect("the deleted session's reply kept streaming");
    assert_eq!(end.json()["status"], "stopped", "{end:?}");
    assert_eq!(
        wait_idle(w).await,
        0.0,
        "the worker still generates for the deleted session"
    );
    let cached = wait_metric(
        metrics,
        "hearth_worker_cached_sessions",
        Duration::from_secs(10),
        |v| v == 0.0,
    )
    .await;
    assert_eq!(cached, 0.0, "the deleted session's KV stays on the worker");
    assert!(worker_metric(w, "hearth_worker_kv_blocks_used").await == 0.0);
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_keys_requests_naming_another_site_are_refused() {
    let a = assets("rebinding");
    let worker = WorkerProcess::spawn(&worker_bin(), &a.model, &SCRIPTED[..2]).expect("worker");
    let db = format!("sqlite://{}?mode=rwc", a.dir.join("hearth.db").display());
    let hearth = Hearth::spawn(&[
        "--database-url".into(),
        db,
        "--tokenizer".into(),
        path(&a.tokenizer),
        "--auth".into(),
        "none".into(),
        "--worker".into(),
        worker.grpc.clone(),
    ]);
    hearth.wait_ready().await;
    let addr = hearth.addr;
    let refused = |r: &hearth_e2e::http::Reply| {
        assert_eq!(r.status, 403, "{}", r.text());
        assert_eq!(
            r.json()["error"]["type"],
            "permission_error",
            "{}",
            r.text()
        );
    };
    // A page on evil.example whose name now resolves to 127.0.0.1 (DNS rebinding).
    for (method, p) in [
        ("GET", "/v1/sessions"),
        ("POST", "/v1/sessions"),
        ("GET", "/"),
    ] {
        let mut req = Req::new(method, p).header("Host", "evil.example:8080");
        if method == "POST" {
            req = req.json(&json!({}));
        }
        refused(&req.send(addr).await);
    }
    // A cross-site request from a page elsewhere, to the right name.
    refused(
        &Req::new("POST", "/v1/sessions")
            .header("Origin", "http://evil.example")
            .json(&json!({}))
            .send(addr)
            .await,
    );
    let list = Req::new("GET", "/v1/sessions").send(addr).await;
    assert_eq!(list.status, 200, "{}", list.text());
    assert_eq!(
        list.json()["data"],
        json!([]),
        "a refused request changed nothing"
    );
    // Local names and local pages are served.
    let r = Req::new("POST", "/v1/sessions")
        .header("Host", format!("localhost:{}", addr.port()))
        .header("Origin", "http://localhost:3000")
        .json(&json!({}))
        .send(addr)
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = Req::new("GET", "/healthz")
        .header("Host", format!("[::1]:{}", addr.port()))
        .send(addr)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    drop(hearth);
    drop(worker);
    let _ = std::fs::remove_dir_all(&a.dir);
}

/// Starts a streamed 120-token reply to "A long story, please" in a new session, with
/// `params`, and reads its first `tokens` tokens: the stream and their text.
async fn begin_story(s: &Stack, key: &str, params: &Value, tokens: usize) -> (Sse, String) {
    let sid = new_session(s.addr(), key).await;
    let mut sse = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(key))
        .json(
            &json!({"content": "A long story, please", "max_tokens": 120,
                      "ignore_eos": true, "params": params}),
        )
        .events(s.addr())
        .await;
    assert_eq!(sse.status, 200);
    let mut text = String::new();
    let mut read = 0;
    while read < tokens {
        let e = sse.next().await.expect("the reply ended early");
        if e.event == "token" {
            read += 1;
            text += e.json()["text"].as_str().unwrap_or_default();
        }
    }
    (sse, text)
}

/// The whole text of a story begun with [`begin_story`], once it has ended with all its tokens.
async fn end_story(mut sse: Sse, text: String) -> String {
    let (rest, end) = finish(&mut sse).await;
    assert_eq!(end.event, "message_end", "{end:?}");
    assert_eq!(end.json()["usage"]["completion_tokens"], 120, "{end:?}");
    text + &rest
}

/// The text of a story; when `cut`, the worker serving it is killed after 20 tokens so the
/// reply fails over.
async fn story(s: &mut Stack, key: &str, params: &Value, cut: bool) -> String {
    let (sse, text) = begin_story(s, key, params, if cut { 20 } else { 0 }).await;
    if cut {
        let victim = serving_worker(s).await;
        s.workers[victim].child.kill().expect("kill -9");
    }
    end_story(sse, text).await
}

async fn cut_and_uncut(tag: &str, params: Value) {
    let mut s = Stack::start_with(tag, &slow_spec(), Db::Sqlite, 2, &[]).await;
    let k = s.key("alice").await;
    let whole = story(&mut s, &k, &params, false).await;
    let cut = story(&mut s, &k, &params, true).await;
    assert_eq!(
        metric(s.addr(), "hearth_worker_failovers_total").await,
        1.0,
        "the second reply failed over"
    );
    assert_eq!(cut, whole, "a failover changed the reply ({params})");
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_greedy_reply_that_fails_over_is_identical_to_the_uncut_one() {
    cut_and_uncut("greedy-failover", json!({})).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeded_sampled_reply_that_fails_over_is_identical_to_the_uncut_one() {
    cut_and_uncut(
        "seeded-failover",
        json!({"temperature": 1.0, "top_p": 0.95, "seed": 7}),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_preempted_for_another_user_is_identical_to_the_uncut_one() {
    // One worker that takes 2 requests at a time from hearth: alice's two stories fill it, and
    // bob, holding nothing, gets the place of her newest, which continues afterwards.
    let s = Stack::start_with(
        "preempt",
        &slow_spec(),
        Db::Sqlite,
        1,
        &["--worker-capacity", "2", "--max-queue", "4"],
    )
    .await;
    let (alice, bob) = (s.key("alice").await, s.key("bob").await);
    let params = json!({"temperature": 1.0, "top_p": 0.95, "seed": 7});
    let (sse, text) = begin_story(&s, &alice, &params, 0).await;
    let whole = end_story(sse, text).await;
    assert_eq!(
        metric(s.addr(), "hearth_fair_share_preemptions_total").await,
        0.0
    );

    let first = begin_story(&s, &alice, &params, 1).await;
    let newest = begin_story(&s, &alice, &params, 20).await;
    let r = Req::new("POST", "/v1/chat/completions")
        .key(Some(&bob))
        .json(
            &json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 4, "ignore_eos": true}),
        )
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "bob was served: {}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 4, "{}", r.text());
    assert_eq!(
        metric(s.addr(), "hearth_fair_share_preemptions_total").await,
        1.0,
        "one of alice's replies gave bob its place"
    );
    let (first, newest) = (end_story(first.0, first.1), end_story(newest.0, newest.1));
    let (first, newest) = tokio::join!(first, newest);
    assert_eq!(first, whole, "alice's first reply");
    assert_eq!(
        newest, whole,
        "alice's preempted reply continued where it stopped"
    );
    assert_eq!(metric(s.addr(), "hearth_queue_depth").await, 0.0);
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_half_open_connections_block_neither_chat_nor_shutdown() {
    let mut s = Stack::scripted(
        "slowloris",
        Db::Sqlite,
        1,
        40,
        &["--header-timeout-secs", "3", "--shutdown-timeout-secs", "2"],
    )
    .await;
    let k = s.key("alice").await;
    // This process holds the 2,000 client ends itself.
    hearth_orchestrator::http_server::raise_open_files_limit();
    // 2,000 connections without a key: half send nothing, half the start of a header.
    let mut idle = Vec::new();
    for i in 0..2000 {
        let mut c = TcpStream::connect(s.addr()).await.expect("connect");
        if i % 2 == 1 {
            c.write_all(b"GET /v1/sessions HTTP/1.1\r\nHost: x\r\n")
                .await
                .expect("write");
        }
        idle.push(c);
    }
    let sid = new_session(s.addr(), &k).await;
    let started = Instant::now();
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&k))
        .json(&json!({"content": "still there?", "max_tokens": 3, "stream": false}))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    println!(
        "a turn beside 2,000 idle connections took {:?}",
        started.elapsed()
    );
    // SIGTERM with all of them still open: the server exits within its shutdown timeout (2 s)
    // plus the time open connections get to close (5 s), not never.
    signal(&s.hearth.child, libc::SIGTERM);
    let signalled = Instant::now();
    let status = loop {
        if let Some(st) = s.hearth.child.try_wait().expect("wait") {
            break st;
        }
        assert!(
            signalled.elapsed() < Duration::from_secs(10),
            "hearth did not exit within 2 s + 5 s (and a margin) of SIGTERM with idle \
             connections open"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    println!("exited {:?} after SIGTERM", signalled.elapsed());
    assert!(status.success(), "{status}");
    drop(idle);
    s.finish().await;
}

/// `--max-connections` holds connections past the cap in the backlog until one closes, and
/// `--header-timeout-secs` closes connections that send no complete header, so idle clients can
/// neither take every descriptor nor keep their places.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_wait_for_a_place_and_silent_ones_are_closed() {
    use tokio::io::AsyncReadExt;
    let s = Stack::scripted(
        "conn_cap",
        Db::Sqlite,
        1,
        40,
        &["--max-connections", "4", "--header-timeout-secs", "3"],
    )
    .await;
    // Four connections take every place: two send nothing, two half a header.
    let mut idle = Vec::new();
    for i in 0..4 {
        let mut c = TcpStream::connect(s.addr()).await.expect("connect");
        if i % 2 == 1 {
            c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
                .await
                .expect("write");
        }
        idle.push(c);
    }
    let opened = Instant::now();
    // A fifth connects (the kernel's backlog takes it) and sends a whole request, which is not
    // answered while the four hold their places.
    let mut fifth = TcpStream::connect(s.addr()).await.expect("connect");
    fifth
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .expect("write");
    let mut answer = Vec::new();
    let early = tokio::time::timeout(Duration::from_millis(1500), fifth.read_to_end(&mut answer));
    assert!(
        early.await.is_err(),
        "a fifth connection was served beside four with --max-connections 4: {:?}",
        String::from_utf8_lossy(&answer)
    );
    // The header deadline (3 s) closes the four; the fifth then takes a place and is answered.
    for (i, c) in idle.iter_mut().enumerate() {
        let mut buf = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(15), c.read_to_end(&mut buf)).await;
        assert!(
            closed.is_ok(),
            "connection {i} without a complete header was still open {:?} after it opened",
            opened.elapsed()
        );
    }
    println!(
        "silent connections closed {:?} after they opened",
        opened.elapsed()
    );
    tokio::time::timeout(Duration::from_secs(15), fifth.read_to_end(&mut answer))
        .await
        .expect("the fifth connection was answered once a place freed")
        .expect("read");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    s.finish().await;
}

/// Another replica's live reply, saved by a machine whose clock is an hour behind this one's:
/// the orphan sweep must leave it alone while the saves continue (its stored times are an hour
/// "old" by this replica's clock), and so must a regenerate or a turn sent here, and the sweep
/// fails it once they stop, keeping its text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_orphan_sweep_fails_a_reply_only_when_its_saves_stop_whatever_the_clocks() {
    use hearth_orchestrator::storage::{now_ms, Store};
    let s = Stack::scripted(
        "orphan_clock",
        Db::Postgres,
        1,
        40,
        &["--orphan-after-secs", "2"],
    )
    .await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let user = s
        .store
        .user_by_name("alice")
        .await
        .expect("user")
        .expect("alice exists");
    // The other replica starts a turn through the same database.
    let turn = s
        .store
        .begin_turn(&user.id, &sid, "hello from another replica")
        .await
        .expect("turn");
    let id = turn.assistant.id;
    let db = sqlx::AnyPool::connect(&s.db_url).await.expect("database");
    let behind = now_ms() - 3_600_000;
    let status = || async {
        let h = history(s.addr(), &k, &sid).await;
        (h[1]["status"].clone(), h[1]["content"].clone())
    };
    // Its progress saves, every 400 ms for 6 s (three times --orphan-after-secs), stamped by
    // its lagging clock.
    let mut last_save = Instant::now();
    for i in 0..15i64 {
        sqlx::query("UPDATE messages SET content = $1, updated_at = $2 WHERE id = $3")
            .bind(format!("part {i}"))
            .bind(behind + i * 400)
            .bind(&id)
            .execute(&db)
            .await
            .expect("save");
        last_save = Instant::now();
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(
            status().await.0,
            "streaming",
            "a reply saved 400 ms ago was failed as an orphan"
        );
        if i == 2 {
            // This replica must not take the session from it either: a regenerate would delete
            // the other replica's reply, and a new turn would run beside it.
            for (route, body) in [
                ("regenerate", json!({"stream": false})),
                ("messages", json!({"content": "me too", "stream": false})),
            ] {
                let r = Req::new("POST", &format!("/v1/sessions/{sid}/{route}"))
                    .key(Some(&k))
                    .json(&body)
                    .send(s.addr())
                    .await;
                assert_eq!(r.status, 409, "{route} beside a live reply: {}", r.text());
            }
            assert_eq!(
                history(s.addr(), &k, &sid).await.len(),
                2,
                "nothing changed"
            );
        }
    }
    // The replica dies: no more saves. Failed within --orphan-after-secs and a sweep or two.
    let (st, content) = loop {
        let (st, content) = status().await;
        if st != "streaming" || last_save.elapsed() > Duration::from_secs(15) {
            break (st, content);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let after = last_save.elapsed();
    println!("an abandoned reply was failed {after:?} after its last save");
    assert_eq!(st, "error", "an abandoned reply is failed");
    assert_eq!(content, "part 14", "and keeps its text");
    assert!(
        after >= Duration::from_millis(1900),
        "failed before --orphan-after-secs had passed: {after:?}"
    );
    // Once failed, the session takes turns again.
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&k))
        .json(&json!({"content": "again", "max_tokens": 2, "stream": false}))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_does_not_arrive_in_time_gets_408_and_stores_nothing() {
    use tokio::io::AsyncReadExt;
    let s = Stack::scripted(
        "body-timeout",
        Db::Sqlite,
        1,
        40,
        &["--body-timeout-secs", "1"],
    )
    .await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let body = json!({"content": "half a question", "max_tokens": 3, "stream": false}).to_string();
    let head = format!(
        "POST /v1/sessions/{sid}/messages HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {k}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    // The header and half the body, then nothing: answered 408 after the body deadline.
    let mut c = TcpStream::connect(s.addr()).await.expect("connect");
    c.write_all(head.as_bytes()).await.expect("write");
    c.write_all(&body.as_bytes()[..body.len() / 2])
        .await
        .expect("write");
    let started = Instant::now();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(15), c.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        read.is_ok(),
        "no answer 15 s after a stalled body: {answer:?}"
    );
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"body_timeout\""), "{answer}");
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "answered before the deadline: {:?}",
        started.elapsed()
    );
    println!(
        "a stalled body was answered 408 after {:?}",
        started.elapsed()
    );
    assert!(
        history(s.addr(), &k, &sid).await.is_empty(),
        "nothing stored"
    );
    // A body that arrives in pieces, all within the deadline, is served.
    let mut c = TcpStream::connect(s.addr()).await.expect("connect");
    c.write_all(head.as_bytes()).await.expect("write");
    for piece in body.as_bytes().chunks(body.len() / 4 + 1) {
        c.write_all(piece).await.expect("write");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut answer = vec![0u8; 12];
    tokio::time::timeout(Duration::from_secs(15), c.read_exact(&mut answer))
        .await
        .expect("no answer")
        .expect("read");
    assert_eq!(
        &answer,
        b"HTTP/1.1 200",
        "{}",
        String::from_utf8_lossy(&answer)
    );
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_history_and_session_caps_answer_422_and_change_nothing() {
    let s = Stack::scripted(
        "caps",
        Db::Sqlite,
        1,
        40,
        &[
            "--max-messages-per-session",
            "6",
            "--max-sessions-per-user",
            "3",
        ],
    )
    .await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let turn_path = format!("/v1/sessions/{sid}/messages");
    let turn = || {
        Req::new("POST", &turn_path)
            .key(Some(&k))
            .json(&json!({"content": "hello", "max_tokens": 2, "stream": false}))
    };
    for _ in 0..3 {
        let r = turn().send(s.addr()).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let r = turn().send(s.addr()).await;
    assert_eq!(r.status, 422, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "session_full", "{}", r.text());
    assert_eq!(
        history(s.addr(), &k, &sid).await.len(),
        6,
        "a refused turn stored nothing"
    );
    let create = || {
        Req::new("POST", "/v1/sessions")
            .key(Some(&k))
            .json(&json!({}))
    };
    for _ in 0..2 {
        assert_eq!(create().send(s.addr()).await.status, 201);
    }
    let r = create().send(s.addr()).await;
    assert_eq!(r.status, 422, "{}", r.text());
    assert_eq!(
        r.json()["error"]["type"],
        "too_many_sessions",
        "{}",
        r.text()
    );
    let other = s.key("bob").await;
    let r = Req::new("POST", "/v1/sessions")
        .key(Some(&other))
        .json(&json!({}))
        .send(s.addr())
        .await;
    assert_eq!(
        r.status,
        201,
        "another user's sessions are their own: {}",
        r.text()
    );
    let r = Req::new("DELETE", &format!("/v1/sessions/{sid}"))
        .key(Some(&k))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 204);
    assert_eq!(
        create().send(s.addr()).await.status,
        201,
        "a deleted session frees its place"
    );
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_replies_cannot_overspend_a_daily_token_budget() {
    let s = Stack::scripted("budget", Db::Sqlite, 1, 40, &[]).await;
    let k = s
        .key_with(
            "alice",
            hearth_orchestrator::auth::KeyOptions {
                tokens_per_day: Some(100),
                ..Default::default()
            },
        )
        .await;
    let ask = || {
        Req::new("POST", "/v1/chat/completions").key(Some(&k)).json(
            &json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 30, "ignore_eos": true}),
        )
    };
    let addr = s.addr();
    let tasks: Vec<_> =
        (0..10)
            .map(|_| {
                let k = k.clone();
                tokio::spawn(async move {
                    Req::new("POST", "/v1/chat/completions")
                    .key(Some(&k))
                    .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 30, "ignore_eos": true}))
                    .send(addr)
                    .await
                })
            })
            .collect();
    let mut replies = Vec::new();
    for t in tasks {
        replies.push(t.await.expect("task"));
    }
    let mut spent = 0;
    let mut refused = 0;
    for r in &replies {
        match r.status {
            200 => {
                spent += r.json()["usage"]["completion_tokens"]
                    .as_u64()
                    .expect("usage")
            }
            429 => refused += 1,
            other => panic!("unexpected {other}: {}", r.text()),
        }
    }
    println!(
        "10 concurrent replies of 30 tokens on a budget of 100: {spent} tokens, {refused} refused"
    );
    assert!(
        spent <= 100 + 30,
        "spent {spent}: more than one reply over the budget"
    );
    assert!(spent >= 100, "spent {spent}: refused while budget was left");
    let r = ask().send(s.addr()).await;
    assert_eq!(r.status, 429, "{}", r.text());
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
    let stuck = WorkerProcess::spawn(
        &worker_bin(),
        &a.model,
        &[
            "--scripted-token-ms",
            "40",
            "--scripted-freeze-after-tokens",
            &freeze,
            "--engine-stall-secs",
            "1",
        ],
    )
    .expect("worker");
    let healthy = WorkerProcess::spawn(&worker_bin(), &a.model, &SCRIPTED[..2]).expect("worker");
    let db = format!("sqlite://{}?mode=rwc", a.dir.join("hearth.db").display());
    let mut args: Vec<String> = [
        "--database-url",
        &db,
        "--tokenizer",
        &path(&a.tokenizer),
        "--auth",
        "none",
        "--health-interval-ms",
        "100",
        "--stall-timeout-secs",
        "2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for w in [&stuck, &healthy] {
        args.extend(["--worker".to_string(), w.grpc.clone()]);
    }
    let hearth = Hearth::spawn(&args);
    hearth.wait_ready().await;
    let sid = new_session(hearth.addr, "").await;
    // Both idle: the reply goes to the first worker, whose engine then freezes.
    let mut sse = stream_turn(hearth.addr, "", &sid, 100).await;
    let (text, end) = tokio::time::timeout(Duration::from_secs(30), finish(&mut sse))
        .await
        .expect("the reply did not end within 30 s of its worker's engine sticking");
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
