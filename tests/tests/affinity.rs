//! Session affinity that a test can tell from chance: a session's first turn is made to land on
//! the second worker (the first is busy), so its next turn, with both workers idle, goes there
//! only because of affinity (without it, ties go to the first worker). The same holds across two
//! orchestrator replicas, through Redis, and on the replica that routed the session while Redis
//! is down.

use std::net::SocketAddr;

use hearth_e2e::http::Req;
use hearth_e2e::redis::{redis_url, RedisServer};
use hearth_e2e::stack::{json_turn, new_session, stream_turn, Db, Hearth, Stack};

/// A short turn answered as JSON; the worker that served it.
async fn turn_worker(addr: SocketAddr, key: &str, sid: &str) -> String {
    let r = json_turn(addr, key, sid, "hello", 3).await;
    r["worker"].as_str().expect("worker").to_string()
}

/// Runs `sid`'s first turn on `first` while another session's long reply keeps worker-1 busy,
/// then stops that reply; returns where the first turn went.
async fn first_turn_beside_a_busy_worker(first: SocketAddr, key: &str, sid: &str) -> String {
    let other = new_session(first, key).await;
    let mut busy = stream_turn(first, key, &other, 500).await;
    let started = busy.next().await.expect("message_start");
    assert_eq!(started.event, "message_start");
    let went = turn_worker(first, key, sid).await;
    let r = Req::new("POST", &format!("/v1/sessions/{other}/stop"))
        .key(Some(key))
        .send(first)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    drop(busy);
    went
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_returns_to_its_worker_when_another_is_free() {
    let s = Stack::scripted("affinity", Db::Sqlite, 2, 10, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let first = first_turn_beside_a_busy_worker(s.addr(), &k, &sid).await;
    assert_eq!(first, "worker-2", "worker-1 was busy");
    // Both idle now: only affinity sends the session back to worker-2.
    for _ in 0..3 {
        assert_eq!(turn_worker(s.addr(), &k, &sid).await, "worker-2");
    }
    // A new session, with nothing cached anywhere, takes the first idle worker.
    let fresh = new_session(s.addr(), &k).await;
    assert_eq!(turn_worker(s.addr(), &k, &fresh).await, "worker-1");
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn affinity_is_shared_between_replicas_through_redis() {
    let redis = redis_url();
    let extra = ["--redis-url", redis.as_str()];
    let s = Stack::scripted("affinity_redis", Db::Postgres, 2, 10, &extra).await;
    let b = Hearth::spawn(&Stack::args(&s.assets, &s.db_url, &s.workers, &extra));
    b.wait_ready().await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let first = first_turn_beside_a_busy_worker(s.addr(), &k, &sid).await;
    assert_eq!(first, "worker-2", "worker-1 was busy");
    // Replica B has served nothing: only the affinity A wrote to Redis sends it to worker-2.
    assert_eq!(turn_worker(b.addr, &k, &sid).await, "worker-2");
    drop(b);
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_down_a_replica_still_sends_its_sessions_back_to_their_workers() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    let extra = ["--redis-url", url.as_str()];
    let s = Stack::scripted("affinity_noredis", Db::Sqlite, 2, 10, &extra).await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let first = first_turn_beside_a_busy_worker(s.addr(), &k, &sid).await;
    assert_eq!(first, "worker-2", "worker-1 was busy");
    redis.kill();
    // Redis cannot say where the session's cache is; this replica remembers it routed it there.
    for _ in 0..3 {
        assert_eq!(turn_worker(s.addr(), &k, &sid).await, "worker-2");
    }
    // New sessions are still served, by the least loaded worker.
    let fresh = new_session(s.addr(), &k).await;
    assert_eq!(turn_worker(s.addr(), &k, &fresh).await, "worker-1");
    s.finish().await;
}
