//! A session's life beside its replies: a stream resumed at or past its end, a session deleted
//! while it replies, the orphan sweep when another replica's clock is behind, and the caps on a
//! session's history and a user's sessions.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use hearth_e2e::http::{Event, Req};
use hearth_e2e::stack::{
    finish, history, json_turn, new_session, read_tokens, slow_spec, stream_turn, wait_idle,
    wait_metric, worker_metric, Db, Stack,
};
use serde_json::json;

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
            tokio::time::timeout(Duration::from_secs(60), sse.rest())
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
    json_turn(s.addr(), &k, &sid, "hello", 3).await;
    let metrics: SocketAddr = w.metrics.parse().expect("metrics addr");
    let cached = wait_metric(
        metrics,
        "hearth_worker_cached_sessions",
        Duration::from_secs(60),
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
    let (_, end) = tokio::time::timeout(Duration::from_secs(60), finish(&mut sse))
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
        Duration::from_secs(60),
        |v| v == 0.0,
    )
    .await;
    assert_eq!(cached, 0.0, "the deleted session's KV stays on the worker");
    assert!(worker_metric(w, "hearth_worker_kv_blocks_used").await == 0.0);
    s.finish().await;
}

/// Another replica's live reply, saved by a machine whose clock is an hour behind this one's:
/// the orphan sweep must leave it alone while the saves continue (its stored times are an hour
/// "old" by this replica's clock), and so must a regenerate or a turn sent here, and the sweep
/// fails it once they stop, keeping its text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_orphan_sweep_fails_a_reply_only_when_its_saves_stop_whatever_the_clocks() {
    use hearth_orchestrator::storage::{now_ms, Accounts, SessionId, Transcript};
    let s = Stack::scripted(
        "orphan_clock",
        Db::Postgres,
        1,
        40,
        &["--orphan-after-secs", "5"],
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
        .begin_turn(
            &user.id,
            &SessionId::parse(&sid).expect("a session id"),
            "hello from another replica",
        )
        .await
        .expect("turn");
    let id = turn.assistant.id;
    let db = sqlx::AnyPool::connect(&s.db_url).await.expect("database");
    let behind = now_ms() - 3_600_000;
    let status = || async {
        let h = history(s.addr(), &k, &sid).await;
        (h[1]["status"].clone(), h[1]["content"].clone())
    };
    // Its progress saves, every 400 ms for 8 s (longer than --orphan-after-secs, so only the
    // saves keep it alive), stamped by its lagging clock. The 5 s window leaves 4.6 s between
    // two saves for a busy machine to fall behind before a save counts as missed.
    let mut last_save = Instant::now();
    for i in 0..20i64 {
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
    // The replica dies: no more saves. Failed once --orphan-after-secs has passed without
    // one; the 60 s deadline only fails a sweep that never comes.
    let (st, content) = loop {
        let (st, content) = status().await;
        if st != "streaming" || last_save.elapsed() > Duration::from_secs(60) {
            break (st, content);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let after = last_save.elapsed();
    println!("an abandoned reply was failed {after:?} after its last save");
    assert_eq!(st, "error", "an abandoned reply is failed");
    assert_eq!(content, "part 19", "and keeps its text");
    // A lower bound only (no slowness fails it early): the sweep waited for the window.
    assert!(
        after >= Duration::from_millis(4900),
        "failed before --orphan-after-secs had passed: {after:?}"
    );
    // Once failed, the session takes turns again.
    json_turn(s.addr(), &k, &sid, "again", 2).await;
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
