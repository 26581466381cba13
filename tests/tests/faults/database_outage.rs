//! PostgreSQL stopped in the middle of a streaming reply and brought back: requests that need it
//! get a 503 meanwhile, the reply streams on and is stored whole, and service resumes.

use std::time::{Duration, Instant};

use hearth_e2e::http::{Reply, Req};
use hearth_e2e::pg::PgServer;
use hearth_e2e::stack::{
    assets_with, fold, json_turn, new_session, read_tokens, scripted_worker, stream_turn, Hearth,
    Stack, Streamed,
};
use hearth_orchestrator::auth::{issue_key, KeyOptions};
use hearth_orchestrator::storage::{
    Accounts, Finish, MessageStatus, SessionId, SqlStore, Transcript,
};
use hearth_worker::fixtures::TinySpec;
use serde_json::json;

use super::check_history;

/// Fails unless `r` is a 503 with the API's error body.
fn assert_unavailable(what: &str, r: &Reply) {
    assert_eq!(r.status, 503, "{what}: {}", r.text());
    let v = r.json();
    assert_eq!(v["error"]["type"], "service_unavailable", "{what}: {v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{what}: {v}"
    );
}

/// The orchestrator's final write of a reply is retried through a short outage (`finish` in
/// `orchestrator/src/generate/mod.rs`: 8 attempts, 250 ms doubling to 5 s between them, each
/// attempt waiting up to the pool's 3 s acquire timeout: roughly 20 to 40 s in all).
///
/// What happens to the reply that is streaming when the database goes away: generation does
/// not need the database, so tokens keep streaming to the client (the per-second progress
/// saves fail and are logged; each failed save holds the loop for up to the 3 s acquire
/// timeout, so tokens arrive in bursts). When the reply ends, the client gets its
/// `message_end`; if the database is back within the retry window, the final write lands and
/// the stored reply is `complete` with exactly the streamed text, which is what this test
/// asserts (its outage is a few seconds). Past the window the final write is given up: the
/// stored reply stays `streaming` with the text of its last successful save until the orphan
/// sweep (`--orphan-after-secs`) marks it `error` / `interrupted`, while the client was told it
/// completed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_mid_stream_is_a_503_and_service_resumes_with_nothing_half_written() {
    let pg = PgServer::start("outage");
    let url = pg.create_database("hearth").await;
    let assets = assets_with("outage", &TinySpec::default());
    // 900 tokens at 20 ms: the reply streams for about 18 s, through the outage.
    let workers = vec![scripted_worker(&assets.model, 20)];
    let mut hearth = Hearth::spawn(&Stack::args(&assets, &url, &workers, &[]));
    hearth.wait_ready().await;
    let addr = hearth.addr;
    let store = SqlStore::connect(&url).await.expect("store");
    let key = issue_key(&store, "user", KeyOptions::default())
        .await
        .expect("key")
        .key;
    let user = store
        .user_by_name("user")
        .await
        .expect("user")
        .expect("the user exists");

    let busy = new_session(addr, &key).await;
    let quiet = new_session(addr, &key).await;
    let (busy_id, quiet_id) = (
        SessionId::parse(&busy).expect("a session id"),
        SessionId::parse(&quiet).expect("a session id"),
    );
    json_turn(addr, &key, &busy, "Hello", 5).await;
    let mut sse = stream_turn(addr, &key, &busy, 900).await;
    let mut seen = read_tokens(&mut sse, 3).await;
    // The rest of the reply, each event with the time it arrived.
    let reader = tokio::spawn(async move {
        let mut timed = Vec::new();
        while let Some(e) = sse.next().await {
            timed.push((Instant::now(), e));
        }
        timed
    });

    pg.stop();
    let down = Instant::now();
    let turn = json!({"content": "during the outage", "max_tokens": 5, "stream": false});
    let (post, get) = (
        format!("/v1/sessions/{quiet}/messages"),
        format!("/v1/sessions/{busy}/messages"),
    );
    let tries = [
        Req::new("GET", "/v1/sessions").key(Some(&key)),
        Req::new("POST", &post).key(Some(&key)).json(&turn),
        Req::new("GET", &get).key(Some(&key)),
        Req::new("GET", "/readyz"),
    ];
    for r in &tries {
        let t = Instant::now();
        let reply = r.send(addr).await;
        assert_unavailable(
            &format!("{} {} with the database down", r.method, r.path),
            &reply,
        );
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{} {} took {:?} to say 503",
            r.method,
            r.path,
            t.elapsed()
        );
    }

    pg.resume();
    let up = Instant::now();
    eprintln!("database outage: {:.1?}", up - down);
    // Service resumes as soon as the pool reconnects.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = Req::new("GET", "/v1/sessions")
            .key(Some(&key))
            .send(addr)
            .await;
        if r.status == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no recovery 60 s after the database came back: {} {}",
            r.status,
            r.text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let after = json_turn(addr, &key, &quiet, "after the outage", 5).await;
    assert_eq!(after["status"], "complete", "{after}");

    // The reply streamed on through the outage (generation does not need the database) and
    // ended normally…
    let timed = reader.await.expect("the reply's reader");
    let during = timed
        .iter()
        .filter(|(t, e)| e.event == "token" && *t > down && *t < up)
        .count();
    assert!(during > 0, "no token arrived during the outage");
    let longest_gap = timed
        .windows(2)
        .map(|w| w[1].0 - w[0].0)
        .max()
        .unwrap_or_default();
    eprintln!("{during} tokens arrived during the outage; longest gap {longest_gap:.1?}");
    seen.extend(timed.into_iter().map(|(_, e)| e));
    let Streamed { text, last, .. } = fold(&seen);
    assert_eq!(last.event, "message_end", "{last:?}");
    let end = last.json();
    assert_eq!(end["status"], "complete", "{end}");
    assert_eq!(end["usage"]["completion_tokens"], 900, "{end}");
    let reply_id = end["message_id"].as_str().expect("message id").to_string();
    // …and its final write, retried until the database was back, stored what was streamed.
    let deadline = Instant::now() + Duration::from_secs(60);
    let stored = loop {
        let msgs = store
            .list_messages(&user.id, &busy_id)
            .await
            .expect("messages");
        let reply = msgs.iter().find(|m| m.id.as_str() == reply_id).cloned();
        match reply {
            Some(m) if m.status != MessageStatus::Streaming => break m,
            other => assert!(
                Instant::now() < deadline,
                "the reply was not finalized 60 s after the stream ended: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(stored.status, MessageStatus::Complete, "{stored:?}");
    assert_eq!(stored.content, text);
    assert_eq!(stored.completion_tokens, Some(900));
    assert_eq!(stored.finish_reason.map(Finish::as_str), Some("length"));

    // Nothing half-written: every session's history is whole and final, and the turn refused
    // during the outage left no trace.
    let sessions = Req::new("GET", "/v1/sessions?limit=100")
        .key(Some(&key))
        .send(addr)
        .await
        .json();
    let ids: Vec<String> = sessions["data"]
        .as_array()
        .expect("sessions")
        .iter()
        .map(|s| s["id"].as_str().expect("id").to_string())
        .collect();
    assert_eq!(ids.len(), 2, "{sessions}");
    for sid in &ids {
        let id = SessionId::parse(sid).expect("a session id");
        let msgs = store.list_messages(&user.id, &id).await.expect("messages");
        check_history(sid, &msgs);
    }
    let busy_msgs = store
        .list_messages(&user.id, &busy_id)
        .await
        .expect("messages");
    assert_eq!(busy_msgs.len(), 4, "{busy_msgs:#?}");
    let quiet_msgs = store
        .list_messages(&user.id, &quiet_id)
        .await
        .expect("messages");
    let contents: Vec<&str> = quiet_msgs.iter().map(|m| m.content.as_str()).collect();
    assert_eq!(quiet_msgs.len(), 2, "{quiet_msgs:#?}");
    assert_eq!(contents[0], "after the outage");

    hearth.kill();
    drop(workers);
    store.close().await;
    drop(pg);
    let _ = std::fs::remove_dir_all(&assets.dir);
}
