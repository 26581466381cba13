//! Orchestrator replicas sharing PostgreSQL and Redis, with no load balancer in front: either
//! serves any session, a stop reaches the replica running the reply, rate limits hold across
//! both, a client that moves to the other replica mid-reply resumes it there with
//! `Last-Event-ID`, with no gap and no event twice, and a reply whose replica is killed, or shut
//! down, goes on on another, the same reply (its takeover's trace linked to the one it began in).

use futures_util::{SinkExt, StreamExt};
use hearth_e2e::http::Req;
use hearth_e2e::redis::redis_url;
use hearth_e2e::stack::{
    event_seq as seq, metric, new_session, signal, slow_spec, token_text, wait_exit, wait_metric,
    Db, Hearth, Stack,
};
use serde_json::json;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;

/// A stack (replica A, one slow worker, PostgreSQL) and a second replica B on the same
/// database, both with Redis.
async fn two_replicas(tag: &str) -> (Stack, Hearth) {
    let redis = redis_url();
    let extra = ["--redis-url", redis.as_str()];
    let s = Stack::start_with(tag, &slow_spec(), Db::Postgres, 1, &extra).await;
    let b = Hearth::spawn(&Stack::args(&s.assets, &s.db_url, &s.workers, &extra));
    b.wait_ready().await;
    (s, b)
}

#[tokio::test]
async fn two_replicas_share_sessions_stops_and_limits() {
    let (s, b) = two_replicas("replicas").await;
    let (a, b_addr) = (s.addr(), b.addr);
    let k = s.key("alice").await;

    // Created on A, served on B, visible on A.
    let r = Req::new("POST", "/v1/sessions")
        .key(Some(&k))
        .json(&json!({}))
        .send(a)
        .await;
    let sid = r.json()["id"].as_str().expect("id").to_string();
    let turn = json!({"content": "Hi", "max_tokens": 4, "stream": false});
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&k))
        .json(&turn)
        .send(b_addr)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let msgs = Req::new("GET", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&k))
        .send(a)
        .await
        .json();
    assert_eq!(msgs["data"].as_array().map(Vec::len), Some(2));

    // A long reply runs on A; a stop sent to B stops it.
    let mut sse = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&k))
        .json(&json!({"content": "Go on", "max_tokens": 900, "ignore_eos": true}))
        .events(a)
        .await;
    let mut tokens = 0;
    while tokens < 3 {
        let e = sse.next().await.expect("event");
        tokens += usize::from(e.event == "token");
    }
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/stop"))
        .key(Some(&k))
        .send(b_addr)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["stopped"], true, "{}", r.text());
    assert_eq!(r.json()["message"]["status"], "stopped");
    let end = sse.rest().await.pop().expect("last event");
    assert_eq!(end.event, "message_end");
    assert_eq!(end.json()["status"], "stopped");

    // Two requests a minute for this key, whichever replica gets them (all four in one minute:
    // the limiter's windows are UTC minutes).
    let limited = s.limited_key("bob", 2).await;
    hearth_e2e::stack::clear_of_a_minute_boundary(std::time::Duration::from_secs(20)).await;
    let body =
        json!({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]});
    let mut statuses = Vec::new();
    for addr in [a, b_addr, a, b_addr] {
        let r = Req::new("POST", "/v1/chat/completions")
            .key(Some(&limited))
            .json(&body)
            .send(addr)
            .await;
        statuses.push(r.status);
    }
    assert_eq!(statuses, vec![200, 200, 429, 429]);
    drop(b);
    s.finish().await;
}

/// A new message on one replica and a regenerate on another, at the same moment, ten times:
/// each time exactly one is refused with 409, and every acknowledged reply is in the history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_and_a_regenerate_racing_on_two_replicas_lose_nothing() {
    let s = Stack::scripted("replica_race", Db::Postgres, 1, 20, &[]).await;
    let b = Hearth::spawn(&Stack::args(&s.assets, &s.db_url, &s.workers, &[]));
    b.wait_ready().await;
    let (a, b_addr) = (s.addr(), b.addr);
    let k = s.key("alice").await;
    let sid = new_session(a, &k).await;
    let body = |content: Option<&str>| {
        // 100 tokens at 20 ms: each reply lasts 2 s, so the racing pair always overlaps.
        let mut v = json!({"max_tokens": 100, "ignore_eos": true, "stream": false});
        if let Some(c) = content {
            v["content"] = json!(c);
        }
        v
    };
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&k))
        .json(&body(Some("first")))
        .send(a)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let (turn_path, regen_path) = (
        format!("/v1/sessions/{sid}/messages"),
        format!("/v1/sessions/{sid}/regenerate"),
    );
    for round in 0..10 {
        let turn = Req::new("POST", &turn_path)
            .key(Some(&k))
            .json(&body(Some(&format!("round {round}"))));
        let regen = Req::new("POST", &regen_path)
            .key(Some(&k))
            .json(&body(None));
        let (t, g) = tokio::join!(turn.send(a), regen.send(b_addr));
        let mut statuses = [t.status, g.status];
        statuses.sort_unstable();
        assert_eq!(
            statuses,
            [200, 409],
            "round {round}: {} / {}",
            t.text(),
            g.text()
        );
        let acked = if t.status == 200 { t.json() } else { g.json() };
        let history = Req::new("GET", &format!("/v1/sessions/{sid}/messages"))
            .key(Some(&k))
            .send(a)
            .await
            .json();
        let msgs = history["data"].as_array().cloned().expect("messages");
        let last = msgs.last().expect("a reply");
        assert_eq!(
            last["id"], acked["message_id"],
            "round {round}: the acknowledged reply was lost"
        );
        assert_eq!(last["status"], "complete", "round {round}");
        assert_eq!(last["content"], acked["content"], "round {round}");
    }
    drop(b);
    s.finish().await;
}

/// The rest of session `sid`'s reply from `addr`, after the last of `head` (`Last-Event-ID`).
async fn resume_after(
    addr: std::net::SocketAddr,
    key: &str,
    sid: &str,
    head: &[hearth_e2e::http::Event],
) -> Vec<hearth_e2e::http::Event> {
    let last = head.last().and_then(|e| e.id.clone()).expect("an id");
    let mut moved = Req::new("GET", &format!("/v1/sessions/{sid}/stream"))
        .key(Some(key))
        .header("Last-Event-ID", last.clone())
        .events(addr)
        .await;
    assert_eq!(moved.status, 200, "{last}");
    moved.rest().await
}

/// A reply streams from A; its client goes away after a few tokens and comes back on B with
/// `Last-Event-ID`. B, which does not run the reply, serves the rest from Redis as it comes:
/// every event once, in order, the text whole. Once the reply is over, B replays it whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_moves_to_another_replica_resumes_the_reply_there() {
    let (s, b) = two_replicas("replica_resume").await;
    let (a, b_addr) = (s.addr(), b.addr);
    let k = s.key("alice").await;
    let ready = Req::new("GET", "/readyz").send(b_addr).await;
    assert_eq!(ready.json()["resume"], "any_replica", "{}", ready.text());
    let sid = new_session(a, &k).await;
    let path = format!("/v1/sessions/{sid}/stream");

    let mut sse = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&k))
        .json(&json!({"content": "Go on", "max_tokens": 40, "ignore_eos": true}))
        .events(a)
        .await;
    let mut head = Vec::new();
    while head
        .iter()
        .filter(|e: &&hearth_e2e::http::Event| e.event == "token")
        .count()
        < 5
    {
        head.push(sse.next().await.expect("event"));
    }
    drop(sse);
    let rest = resume_after(b_addr, &k, &sid, &head).await;
    assert!(
        rest.len() > 5 && rest.last().is_some_and(|e| e.event == "message_end"),
        "{rest:?}"
    );
    let seqs: Vec<u64> = head.iter().chain(&rest).map(seq).collect();
    let want: Vec<u64> = (1..=seqs.len() as u64).collect();
    assert_eq!(seqs, want, "every event once, in order");
    let text = token_text;
    let streamed = text(&head) + &text(&rest);
    let msgs = Req::new("GET", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&k))
        .send(a)
        .await
        .json();
    assert_eq!(msgs["data"][1]["content"], json!(streamed), "{msgs}");
    assert_eq!(
        rest.last().expect("end").json()["usage"]["completion_tokens"],
        40
    );

    // Over, it is still resumable on B from its start, whole.
    let mut again = Req::new("GET", &path).key(Some(&k)).events(b_addr).await;
    let all = again.rest().await;
    assert_eq!(all.first().map(|e| e.event.as_str()), Some("message_start"));
    assert_eq!(text(&all), streamed);
    // An event number past any reply's names none of its events: from its start again (it
    // once overflowed counting the next event, a panic).
    let any_id = all.last().and_then(|e| e.id.clone()).expect("an id");
    let msg_id = any_id
        .rsplit_once(':')
        .expect("<message>:<n>")
        .0
        .to_string();
    for n in [u64::MAX.to_string(), (1u64 << 32).to_string()] {
        let mut far = Req::new("GET", &path)
            .key(Some(&k))
            .header("Last-Event-ID", format!("{msg_id}:{n}"))
            .events(b_addr)
            .await;
        assert_eq!(far.status, 200, "{n}");
        assert_eq!(text(&far.rest().await), streamed, "{n}");
    }
    // And over B's WebSocket, after the third event.
    let third = all[2].id.clone().expect("an id");
    let mut req = format!("ws://{b_addr}/v1/sessions/{sid}/ws")
        .into_client_request()
        .expect("request");
    let bearer = format!("Bearer {k}");
    req.headers_mut().insert(
        "authorization",
        HeaderValue::from_str(&bearer).expect("header"),
    );
    let (mut ws, _) = tokio_tungstenite::connect_async(req)
        .await
        .expect("upgrade");
    let resume = json!({"type": "resume", "last_event_id": third});
    ws.send(Message::Text(resume.to_string().into()))
        .await
        .expect("send");
    let mut frames: Vec<serde_json::Value> = Vec::new();
    while frames.last().is_none_or(|f| f["event"] != "message_end") {
        let m = tokio::time::timeout(std::time::Duration::from_secs(30), ws.next())
            .await
            .expect("a frame within 30 s")
            .expect("open")
            .expect("frame");
        if let Message::Text(t) = m {
            frames.push(serde_json::from_str(t.as_str()).expect("JSON"));
        }
    }
    let ids: Vec<String> = frames
        .iter()
        .map(|f| f["id"].as_str().expect("id").to_string())
        .collect();
    let want: Vec<String> = all[3..].iter().map(|e| e.id.clone().expect("id")).collect();
    assert_eq!(ids, want);
    let ws_text: String = frames
        .iter()
        .filter(|f| f["event"] == "token")
        .map(|f| f["data"]["text"].as_str().expect("text"))
        .collect();
    assert_eq!(text(&all[3..]), ws_text);

    // Another user cannot read it.
    let mallory = s.key("mallory").await;
    let r = Req::new("GET", &path)
        .key(Some(&mallory))
        .send(b_addr)
        .await;
    assert_eq!(r.status, 404, "{}", r.text());
    drop(b);
    s.finish().await;
}

/// The turn of the takeover tests: 120 tokens, whatever the model says.
fn story_turn() -> serde_json::Value {
    json!({"content": "A long story, please", "max_tokens": 120, "ignore_eos": true})
}

/// The text of the story told whole, uncut, by `addr` in a new session.
async fn whole_story(addr: std::net::SocketAddr, key: &str) -> String {
    let sid = new_session(addr, key).await;
    let events = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(key))
        .json(&story_turn())
        .events(addr)
        .await
        .rest()
        .await;
    assert_eq!(events.last().map(|e| e.event.as_str()), Some("message_end"));
    token_text(&events)
}

/// Begins the story in a new session on `addr` and reads it up to its `tokens`-th token: the
/// session, the stream and the events read.
/// The trace a story's request is part of (its client's `traceparent`).
const STORY_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

async fn begin_story(
    addr: std::net::SocketAddr,
    key: &str,
    tokens: usize,
) -> (String, hearth_e2e::http::Sse, Vec<hearth_e2e::http::Event>) {
    let sid = new_session(addr, key).await;
    let mut sse = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(key))
        .header(
            "traceparent",
            format!("00-{STORY_TRACE}-00f067aa0ba902b7-01"),
        )
        .json(&story_turn())
        .events(addr)
        .await;
    let mut head: Vec<hearth_e2e::http::Event> = Vec::new();
    while head.iter().filter(|e| e.event == "token").count() < tokens {
        head.push(sse.next().await.expect("event"));
    }
    (sid, sse, head)
}

/// `head` then `rest` are the whole story: every event once, in order, to its end, the text
/// `whole`'s.
fn assert_story_whole(
    head: &[hearth_e2e::http::Event],
    rest: &[hearth_e2e::http::Event],
    whole: &str,
) {
    let end = rest.last().expect("events after the cut");
    assert_eq!(end.event, "message_end", "{rest:?}");
    assert_eq!(end.json()["usage"]["completion_tokens"], 120, "{end:?}");
    let seqs: Vec<u64> = head.iter().chain(rest).map(seq).collect();
    let want: Vec<u64> = (1..=seqs.len() as u64).collect();
    assert_eq!(seqs, want, "every event once, in order");
    let cut = token_text(head) + &token_text(rest);
    assert_eq!(cut, whole, "the continued reply is the uncut one");
}

/// The session holds the question and the story, stored once, whole, complete.
async fn assert_stored_once(addr: std::net::SocketAddr, key: &str, sid: &str, whole: &str) {
    let msgs = Req::new("GET", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(key))
        .send(addr)
        .await
        .json();
    let data = msgs["data"].as_array().expect("messages");
    assert_eq!(data.len(), 2, "{msgs}");
    assert_eq!(data[1]["content"], json!(whole), "{msgs}");
    assert_eq!(data[1]["status"], "complete", "{msgs}");
}

/// Three replicas (A, B, C) and two workers on PostgreSQL and Redis. A reply streams from A,
/// which is killed (`kill -9`) at its 40th token. Its client comes back on B with
/// `Last-Event-ID`; B or C finds the reply silent, takes it over and continues it on a worker
/// from the tokens A published. The client sees every event once, the reply is stored once,
/// and it is token for token the reply the same request gets uncut. The workers are scripted
/// (a token every 20 ms, echoing the prompt, and continuing a cut reply as a greedy model
/// does): the reply is still running when A dies, and its text varies token by token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_whose_replica_is_killed_goes_on_on_another_one() {
    let redis = redis_url();
    let (traces, at, receiving) = hearth_e2e::otlp::receiver().await;
    let otlp = format!("http://{at}");
    let extra = [
        "--redis-url",
        redis.as_str(),
        "--orphan-after-secs",
        "1",
        "--otlp-endpoint",
        otlp.as_str(),
    ];
    let mut s = Stack::scripted("replica_takeover", Db::Postgres, 2, 20, &extra).await;
    let args = Stack::args(&s.assets, &s.db_url, &s.workers, &extra);
    let (b, c) = (Hearth::spawn(&args), Hearth::spawn(&args));
    b.wait_ready().await;
    c.wait_ready().await;
    let (a, b_addr) = (s.addr(), b.addr);
    let k = s.key("alice").await;

    // Uncut, on C.
    let whole = whole_story(c.addr, &k).await;

    // Cut: A dies at the 40th token.
    let (sid, sse, head) = begin_story(a, &k, 40).await;
    s.hearth.kill();
    drop(sse);
    let rest = resume_after(b_addr, &k, &sid, &head).await;
    assert_story_whole(&head, &rest, &whole);
    assert_stored_once(b_addr, &k, &sid, &whole).await;
    let takeovers = metric(b_addr, "hearth_replica_takeovers_total").await
        + metric(c.addr, "hearth_replica_takeovers_total").await;
    assert_eq!(takeovers, 1.0, "one replica took the reply over");
    // The takeover's trace links to the one the reply began in (A's spans died with it).
    let mut linked = false;
    for _ in 0..200 {
        let spans = traces.spans.lock().expect("spans").clone();
        linked = spans
            .iter()
            .any(|t| t.name == "takeover" && t.links.iter().any(|l| l == STORY_TRACE));
        if linked {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(linked, "no takeover span links to the story's trace");
    receiving.now().await;
    drop((b, c));
    s.finish().await;
}

/// A replica asked to shut down (SIGTERM) with a reply still running past its shutdown timeout
/// hands the reply over: its client's stream ends without a last event, the replica exits 0,
/// and the other replica takes the reply over at once (its orphan sweep would wait ten minutes:
/// only the hand-over notice can explain the takeover). The client resuming there with
/// `Last-Event-ID` gets the rest: the uncut reply, stored once. The worker is scripted (a token
/// every 20 ms, continuing a cut reply as a greedy model does), so the reply outlasts the
/// one-second shutdown timeout on any machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_shuts_down_hands_its_running_reply_over() {
    let redis = redis_url();
    let extra = [
        "--redis-url",
        redis.as_str(),
        "--orphan-after-secs",
        "600",
        "--shutdown-timeout-secs",
        "1",
    ];
    let mut s = Stack::scripted("replica_handover", Db::Postgres, 1, 20, &extra).await;
    let b = Hearth::spawn(&Stack::args(&s.assets, &s.db_url, &s.workers, &extra));
    b.wait_ready().await;
    let (a, b_addr) = (s.addr(), b.addr);
    let k = s.key("alice").await;
    let whole = whole_story(b_addr, &k).await;

    let (sid, mut sse, mut head) = begin_story(a, &k, 20).await;
    let signalled = std::time::Instant::now();
    signal(&s.hearth.child, libc::SIGTERM);
    head.extend(sse.rest().await);
    assert!(
        head.iter()
            .all(|e| e.event == "message_start" || e.event == "token"),
        "no last event on the replica that left: {head:?}"
    );
    let status = wait_exit(
        &mut s.hearth.child,
        signalled + std::time::Duration::from_secs(30),
    )
    .await
    .expect("the replica exits");
    assert!(status.success(), "{status:?}");

    let rest = resume_after(b_addr, &k, &sid, &head).await;
    assert_story_whole(&head, &rest, &whole);
    assert_stored_once(b_addr, &k, &sid, &whole).await;
    assert_eq!(metric(b_addr, "hearth_replica_takeovers_total").await, 1.0);
    drop(b);
    s.finish().await;
}

/// A replica that handed a reply over as it shuts down never takes it back: not when it hears
/// its own hand-over notice, nor when its orphan sweep, still running while the replica waits
/// for a stateless reply to end, finds the reply silent for longer than `--orphan-after-secs`.
/// The other replica (asleep meanwhile, SIGSTOP) claims it once, when it wakes, and the reply
/// goes on there, whole. (A replica that took it back would run it until it exits, leaving it
/// to be claimed a second time.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_never_takes_back_a_reply_it_handed_over() {
    let redis = redis_url();
    let extra = [
        "--redis-url",
        redis.as_str(),
        "--orphan-after-secs",
        "1",
        "--shutdown-timeout-secs",
        "1",
    ];
    let mut s = Stack::scripted("replica_handed", Db::Postgres, 1, 20, &extra).await;
    let b = Hearth::spawn(&Stack::args(&s.assets, &s.db_url, &s.workers, &extra));
    b.wait_ready().await;
    let (a, b_addr) = (s.addr(), b.addr);
    let k = s.key("alice").await;
    // A stateless reply of 6 s keeps A up for a while after it hands the story over.
    let body = json!({"max_tokens": 300, "ignore_eos": true, "stream": true,
                      "messages": [{"role": "user", "content": "keep A busy"}]});
    let mut busy = Req::new("POST", "/v1/chat/completions")
        .key(Some(&k))
        .json(&body)
        .events(a)
        .await;
    assert_eq!(busy.status, 200);
    let busy = tokio::spawn(async move { busy.rest().await });
    // 600 tokens: 12 s, longer than A stays up.
    let sid = new_session(a, &k).await;
    let turn = json!({"content": "A long story, please", "max_tokens": 600, "ignore_eos": true});
    let mut sse = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&k))
        .json(&turn)
        .events(a)
        .await;
    let mut head = vec![sse.next().await.expect("message_start")];
    signal(&b.child, libc::SIGSTOP);
    let signalled = std::time::Instant::now();
    signal(&s.hearth.child, libc::SIGTERM);
    head.extend(sse.rest().await);
    let status = wait_exit(
        &mut s.hearth.child,
        signalled + std::time::Duration::from_secs(30),
    )
    .await
    .expect("the replica exits");
    assert!(status.success(), "{status:?}");
    let lasted = signalled.elapsed();
    assert!(
        lasted > std::time::Duration::from_secs(3),
        "A stayed up a while after it handed the story over ({lasted:?})"
    );
    drop(busy);
    signal(&b.child, libc::SIGCONT);

    let rest = resume_after(b_addr, &k, &sid, &head).await;
    let end = rest.last().expect("events after the cut");
    assert_eq!(end.event, "message_end", "{rest:?}");
    assert_eq!(end.json()["usage"]["completion_tokens"], 600, "{end:?}");
    let seqs: Vec<u64> = head.iter().chain(&rest).map(seq).collect();
    let want: Vec<u64> = (1..=seqs.len() as u64).collect();
    assert_eq!(seqs, want, "every event once, in order");
    let text = token_text(&head) + &token_text(&rest);
    assert_stored_once(b_addr, &k, &sid, &text).await;
    // Claimed once, by B.
    let message_id = head[0].json()["message_id"]
        .as_str()
        .expect("id")
        .to_string();
    assert_eq!(lease_epoch(&s.db_url, &message_id).await, 1);
    drop(b);
    s.finish().await;
}

/// A reply that gives its worker's place to another user (fair share) and waits to get one
/// back writes nothing for longer than `--orphan-after-secs`, yet its replica is alive: its
/// heartbeat keeps the reply its own, and the other replica takes nothing over. Once the place
/// is free the reply goes on where it began, and its client's text is what is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_waiting_for_a_place_stays_with_its_live_replica() {
    let redis = redis_url();
    let extra = [
        "--redis-url",
        redis.as_str(),
        "--orphan-after-secs",
        "1",
        "--worker-capacity",
        "2",
    ];
    let s = Stack::scripted("replica_waiting", Db::Postgres, 1, 20, &extra).await;
    let b = Hearth::spawn(&Stack::args(&s.assets, &s.db_url, &s.workers, &extra));
    b.wait_ready().await;
    let (a, b_addr) = (s.addr(), b.addr);
    let (alice, bob) = (s.key("alice").await, s.key("bob").await);
    // Alice's two stories fill A's two places on the worker.
    let (_, mut first, _) = begin_story(a, &alice, 1).await;
    let (sid, mut story, mut head) = begin_story(a, &alice, 5).await;
    // On A, bob holds no place: he takes the place of alice's newest story for his 100 tokens
    // (2 s at 20 ms), and her story waits meanwhile.
    let bobs = new_session(a, &bob).await;
    let r = Req::new("POST", &format!("/v1/sessions/{bobs}/messages"))
        .key(Some(&bob))
        .json(
            &json!({"content": "Me first", "max_tokens": 100, "ignore_eos": true,
                      "stream": false}),
        )
        .send(a)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    head.extend(story.rest().await);
    first.rest().await;
    assert_eq!(
        head.last().map(|e| e.event.as_str()),
        Some("message_end"),
        "{head:?}"
    );
    assert_eq!(
        metric(a, "hearth_fair_share_preemptions_total").await,
        1.0,
        "alice's reply gave its place to bob"
    );
    for addr in [a, b_addr] {
        assert_eq!(metric(addr, "hearth_replica_takeovers_total").await, 0.0);
    }
    let msgs = Req::new("GET", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&alice))
        .send(b_addr)
        .await
        .json();
    assert_eq!(msgs["data"][1]["status"], "complete", "{msgs}");
    assert_eq!(
        msgs["data"][1]["content"],
        json!(token_text(&head)),
        "{msgs}"
    );
    drop(b);
    s.finish().await;
}

/// A reply whose replica is killed while Redis loses its stream (here: its keys deleted, as a
/// restart without persistence does) goes on from the checkpoint in the database, under a
/// stream begun again there. A client that has exactly the checkpoint's events resumes it
/// seamlessly; one ahead of it, or behind, is told so with an `error` event (`stream_lost`) under
/// the id it already has, never shown other text under ids it has seen. The reply is stored
/// once, complete: the uncut story.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_whose_stream_is_lost_with_its_replica_goes_on_from_its_checkpoint() {
    let redis = redis_url();
    let extra = ["--redis-url", redis.as_str(), "--orphan-after-secs", "1"];
    let mut s = Stack::scripted("replica_lost", Db::Postgres, 1, 20, &extra).await;
    let b = Hearth::spawn(&Stack::args(&s.assets, &s.db_url, &s.workers, &extra));
    b.wait_ready().await;
    let (a, b_addr) = (s.addr(), b.addr);
    let k = s.key("alice").await;
    let whole = whole_story(b_addr, &k).await;

    // 70 tokens: past A's first checkpoint (a second in).
    let (sid, mut sse, mut head) = begin_story(a, &k, 70).await;
    let message_id = head[0].json()["message_id"]
        .as_str()
        .expect("message_start names the reply")
        .to_string();
    s.hearth.kill();
    // Whatever A sent before it died.
    head.extend(sse.rest().await);
    let keys = ["reply", "reply-job", "reply-owner"].map(|k| format!("hearth:{k}:{message_id}"));
    let deleted = std::process::Command::new("redis-cli")
        .args(["-u", &redis, "DEL"])
        .args(&keys)
        .arg(format!("hearth:reply-of:{sid}"))
        .output()
        .expect("redis-cli");
    assert_eq!(String::from_utf8_lossy(&deleted.stdout).trim(), "4");
    let takeovers = "hearth_replica_takeovers_total";
    let wait = std::time::Duration::from_secs(30);
    assert_eq!(
        wait_metric(b_addr, takeovers, wait, |v| v == 1.0).await,
        1.0
    );
    // The stream begun again: its first entry follows the checkpoint B went on from.
    let at = begun_again_after(&redis, &keys[0]).await;
    assert!(
        (2..=head.len()).contains(&at),
        "A's last checkpoint ({at} events) is among what its client was shown ({})",
        head.len()
    );
    let rest = resume_after(b_addr, &k, &sid, &head[..at]).await;
    assert_story_whole(&head[..at], &rest, &whole);
    for client in [&head[..at - 1], &head[..(at + 1).min(head.len())]] {
        if client.len() == at {
            continue;
        }
        let told = resume_after(b_addr, &k, &sid, client).await;
        assert_eq!(told.len(), 1, "{told:?}");
        assert_eq!(told[0].event, "error");
        assert_eq!(told[0].json()["error_type"], "stream_lost", "{told:?}");
        assert_eq!(told[0].id, client.last().and_then(|e| e.id.clone()));
    }
    assert_stored_once(b_addr, &k, &sid, &whole).await;
    drop(b);
    s.finish().await;
}

/// How many events come before the first entry of the stream at `key`, once it has one, which
/// must be marked as the start of a stream begun again.
async fn begun_again_after(redis: &str, key: &str) -> usize {
    for _ in 0..200 {
        let out = std::process::Command::new("redis-cli")
            .args(["-u", redis, "XRANGE", key, "-", "+", "COUNT", "1"])
            .output()
            .expect("redis-cli");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let mut lines = text.lines();
        if let Some(n) = lines.next().and_then(|id| id.strip_prefix("0-")) {
            assert!(
                lines.any(|l| l == "r"),
                "the first entry marks a stream begun again: {text}"
            );
            return n.parse::<usize>().expect("an entry number") - 1;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    panic!("the stream was never begun again");
}

/// The stored reply's lease epoch: how many times a replica claimed it.
async fn lease_epoch(db_url: &str, message_id: &str) -> i64 {
    use sqlx::Connection;
    let mut db = sqlx::PgConnection::connect(db_url).await.expect("database");
    sqlx::query_scalar("SELECT lease_epoch FROM messages WHERE id = $1")
        .bind(message_id)
        .fetch_one(&mut db)
        .await
        .expect("the reply")
}
