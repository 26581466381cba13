//! Redis gone while the stack runs: chat keeps working, rate limits lapse, a stop still reaches
//! its reply; and the limits hold again once Redis is back.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use hearth_e2e::http::{Reply, Req};
use hearth_e2e::redis::RedisServer;
use hearth_e2e::stack::{
    completion, event_seq as seq, fold, json_turn, new_session, read_tokens, stream_turn, Db,
    Hearth, Stack, Streamed,
};
use hearth_orchestrator::storage::{Accounts, Message, MessageStatus, SessionId, Transcript};
use hearth_worker::fixtures::TinySpec;
use serde_json::json;

use super::check_history;

/// The session `sid` of user `name` as stored, checked to be whole ([`check_history`]).
async fn stored_history(s: &Stack, name: &str, sid: &str) -> Vec<Message> {
    let user = s
        .store
        .user_by_name(name)
        .await
        .expect("user")
        .unwrap_or_else(|| panic!("{name} exists"));
    let msgs = s
        .store
        .list_messages(&user.id, &SessionId::parse(sid).expect("a session id"))
        .await
        .expect("messages");
    check_history(sid, &msgs);
    msgs
}

/// A two-token completion, whatever the answer.
async fn ask(addr: SocketAddr, key: &str) -> Reply {
    let body = json!({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}]});
    completion(addr, key, &body).await
}

/// Sends completions until one is refused by the rate limit (at most `tries`); returns the
/// statuses. A minute boundary may reset the count once, hence more tries than the limit + 1.
async fn until_limited(addr: SocketAddr, key: &str, tries: usize) -> Vec<u16> {
    let mut statuses = Vec::new();
    for _ in 0..tries {
        let r = ask(addr, key).await;
        statuses.push(r.status);
        if r.status == 429 {
            assert!(r.header("retry-after").is_some(), "429 without Retry-After");
            break;
        }
        assert_eq!(r.status, 200, "{}", r.text());
    }
    statuses
}

#[tokio::test]
async fn with_redis_down_chat_keeps_working_limits_lapse_and_stop_still_works() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    let s = Stack::start_full(
        "noredis",
        &TinySpec::default(),
        Db::Postgres,
        1,
        &["--scripted-token-ms", "20"],
        &["--redis-url", &url],
    )
    .await;
    let addr = s.addr();
    let limited = s.limited_key("bob", 2).await;

    // With Redis up the limit holds.
    let statuses = until_limited(addr, &limited, 6).await;
    assert_eq!(statuses.last(), Some(&429), "{statuses:?}");

    redis.kill();
    // Chat keeps working, and the limit (already used up in this minute) is not enforced
    // while Redis is unreachable.
    let mut took = Vec::new();
    for i in 0..4 {
        let t = Instant::now();
        let r = ask(addr, &limited).await;
        assert_eq!(r.status, 200, "request {i} with Redis down: {}", r.text());
        took.push(t.elapsed());
    }
    let sid = new_session(addr, &limited).await;
    let t = Instant::now();
    let m = json_turn(addr, &limited, &sid, "one", 5).await;
    assert_eq!(m["status"], "complete", "{m}");
    took.push(t.elapsed());
    eprintln!("with Redis down: 4 completions and a native turn took {took:.1?}");
    assert!(
        took.iter().all(|t| *t < Duration::from_secs(30)),
        "{took:?}"
    );

    // A stop reaches a reply running on the same replica without Redis.
    let mut sse = stream_turn(addr, &limited, &sid, 900).await;
    let mut seen = read_tokens(&mut sse, 3).await;
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/stop"))
        .key(Some(&limited))
        .send(addr)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["stopped"], true, "{}", r.text());
    assert_eq!(r.json()["message"]["status"], "stopped", "{}", r.text());
    seen.extend(sse.rest().await);
    let Streamed { text, last, .. } = fold(&seen);
    assert_eq!(last.event, "message_end", "{last:?}");
    let end = last.json();
    assert_eq!(end["status"], "stopped", "{end}");
    assert!(
        end["usage"]["completion_tokens"]
            .as_u64()
            .is_some_and(|n| n < 900),
        "{end}"
    );
    let msgs = stored_history(&s, "bob", &sid).await;
    let reply = msgs.last().expect("reply");
    assert_eq!(reply.status, MessageStatus::Stopped);
    assert_eq!(reply.content, text);

    // Redis back: the limit holds again once the connection is re-established.
    redis.resume();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut statuses = Vec::new();
    while statuses.last() != Some(&429) {
        assert!(
            Instant::now() < deadline,
            "the limit was not enforced again within 60 s of Redis coming back: {statuses:?}"
        );
        let r = ask(addr, &limited).await;
        assert!(
            r.status == 200 || r.status == 429,
            "{}: {}",
            r.status,
            r.text()
        );
        statuses.push(r.status);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    s.finish().await;
}

/// A replica started while Redis is down (restarting, or not up yet in a deployment that starts
/// everything at once) waits for it, then shares its limits through it, rather than exiting.
#[tokio::test]
async fn a_replica_started_while_redis_is_down_waits_for_it() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    redis.kill();
    // A thread of its own: starting the stack blocks this test's thread until hearth listens.
    let back = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(3));
        redis.resume();
        redis
    });
    let s = Stack::start_full(
        "redislate",
        &TinySpec::default(),
        Db::Sqlite,
        1,
        &["--scripted-token-ms", "20"],
        &["--redis-url", &url],
    )
    .await;
    let _redis = back.join().expect("redis back");
    let limited = s.limited_key("carol", 2).await;
    let statuses = until_limited(s.addr(), &limited, 6).await;
    assert_eq!(statuses.last(), Some(&429), "{statuses:?}");
    s.finish().await;
}

/// With Redis down, a replica asked to resume a reply that another replica runs cannot read
/// its events: it answers 503 (try again shortly), not 404, which tells a client that nothing
/// runs and to read the reply from the history. A session with nothing running still answers
/// 404. Once Redis is back the resume serves the rest, every event once, and the reply is
/// stored as its client was shown it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_down_a_resume_on_another_replica_is_503_until_it_is_back() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    let extra = ["--redis-url", url.as_str()];
    let s = Stack::scripted("noredis_resume", Db::Postgres, 1, 20, &extra).await;
    let b = Hearth::spawn(&Stack::args(&s.assets, &s.db_url, &s.workers, &extra));
    b.wait_ready().await;
    let (a, k) = (s.addr(), s.key("alice").await);
    let (sid, idle) = (new_session(a, &k).await, new_session(a, &k).await);
    let mut sse = stream_turn(a, &k, &sid, 400).await;
    let head = read_tokens(&mut sse, 3).await;
    drop(sse);
    let last = head.last().and_then(|e| e.id.clone()).expect("an id");
    let (path, idle_path) = (
        format!("/v1/sessions/{sid}/stream"),
        format!("/v1/sessions/{idle}/stream"),
    );
    let resume = |path| {
        Req::new("GET", path)
            .key(Some(&k))
            .header("Last-Event-ID", last.clone())
    };

    redis.kill();
    let r = resume(&path).send(b.addr).await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.text().contains("Redis"), "{}", r.text());
    let r = resume(&idle_path).send(b.addr).await;
    assert_eq!(r.status, 404, "nothing runs in {idle}: {}", r.text());

    redis.resume();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut rest = loop {
        let sse = resume(&path).events(b.addr).await;
        if sse.status == 200 {
            break sse;
        }
        assert_eq!(sse.status, 503, "only while Redis is not back");
        assert!(
            Instant::now() < deadline,
            "still 503 30 s after Redis came back"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut events = head.clone();
    events.extend(rest.rest().await);
    let Streamed { text, last, .. } = fold(&events);
    assert_eq!(last.event, "message_end", "{last:?}");
    let seqs: Vec<u64> = events.iter().map(seq).collect();
    assert_eq!(seqs, (1..=events.len() as u64).collect::<Vec<_>>());
    let msgs = stored_history(&s, "alice", &sid).await;
    assert_eq!(msgs.last().map(|m| m.content.as_str()), Some(text.as_str()));
    drop(b);
    s.finish().await;
}
