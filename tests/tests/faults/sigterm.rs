//! SIGTERM on the orchestrator while 50 replies stream: each stream ends with a terminal event,
//! each reply is stored as it ended (the short ones complete, the long ones stopped at the
//! shutdown timeout), and the process exits 0.

use std::process::Command;
use std::time::{Duration, Instant};

use hearth_e2e::stack::{fold, new_session, stream_turn, wait_exit, Db, Stack, Streamed};
use hearth_orchestrator::storage::{Accounts, SessionId, SqlStore, Transcript};
use hearth_worker::fixtures::TinySpec;

use super::check_history;

const STREAMS: usize = 50;

const SHUTDOWN_TIMEOUT_SECS: u64 = 10;

const TOKEN_MS: u64 = 50;

/// Finishes within the shutdown timeout (3 s)…
const SHORT: u32 = 60;

/// …and does not (50 s): it is stopped when the timeout runs out.
const LONG: u32 = 1000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_fifty_streams_ends_each_cleanly_stores_each_and_exits_zero() {
    let shutdown = SHUTDOWN_TIMEOUT_SECS.to_string();
    let token_ms = TOKEN_MS.to_string();
    let mut s = Stack::start_full(
        "sigterm",
        &TinySpec::default(),
        Db::Postgres,
        1,
        &["--scripted-token-ms", &token_ms],
        &["--shutdown-timeout-secs", &shutdown],
    )
    .await;
    let key = s.key("user").await;
    let addr = s.addr();

    // Every stream is running (its turn is stored and `message_start` has arrived) before the
    // signal: even ones finish within the shutdown timeout, odd ones outlast it.
    let opening: Vec<_> = (0..STREAMS)
        .map(|i| {
            let key = key.clone();
            tokio::spawn(async move {
                let sid = new_session(addr, &key).await;
                let tokens = if i % 2 == 0 { SHORT } else { LONG };
                let mut sse = stream_turn(addr, &key, &sid, tokens).await;
                let first = sse.next().await.expect("message_start");
                assert_eq!(first.event, "message_start", "{first:?}");
                (sid, tokens, sse, vec![first])
            })
        })
        .collect();
    let mut open = Vec::new();
    for t in opening {
        open.push(t.await.expect("open a stream"));
    }

    let pid = s.hearth.child.id();
    let signalled = Instant::now();
    let sent = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(sent.success(), "kill -TERM {pid}: {sent}");

    let reading: Vec<_> = open
        .into_iter()
        .map(|(sid, tokens, mut sse, mut seen)| {
            tokio::spawn(async move {
                seen.extend(sse.rest().await);
                (sid, tokens, seen)
            })
        })
        .collect();
    let mut ended = Vec::new();
    for t in reading {
        ended.push(t.await.expect("read a stream"));
    }

    // The process exits 0 once the running replies are done: within the shutdown timeout, plus
    // the time to stop and store the ones that outlast it.
    let limit = Duration::from_secs(SHUTDOWN_TIMEOUT_SECS + 20);
    let status = wait_exit(&mut s.hearth.child, signalled + limit)
        .await
        .unwrap_or_else(|| {
            panic!(
                "hearth still running {:?} after SIGTERM",
                signalled.elapsed()
            )
        });
    let exited = signalled.elapsed();
    eprintln!("hearth exited {status} {exited:.1?} after SIGTERM");
    assert_eq!(status.code(), Some(0), "hearth exited with {status}");

    // Every stream ended with a terminal event, and the stored reply says the same.
    let store = SqlStore::connect(&s.db_url).await.expect("a fresh store");
    let user = store
        .user_by_name("user")
        .await
        .expect("user")
        .expect("the user exists");
    let mut statuses = std::collections::BTreeMap::<String, usize>::new();
    for (sid, tokens, seen) in &ended {
        let Streamed { text, last, .. } = fold(seen);
        assert!(
            last.event == "message_end" || last.event == "error",
            "{sid}: the stream ended without a terminal event: {last:?}"
        );
        let end = last.json();
        let status = end["status"].as_str().unwrap_or("error").to_string();
        *statuses.entry(status.clone()).or_default() += 1;
        let want = if *tokens == SHORT {
            "complete"
        } else {
            "stopped"
        };
        assert_eq!(status, want, "{sid} ({tokens} tokens): {end}");

        let id = SessionId::parse(sid).expect("a session id");
        let msgs = store.list_messages(&user.id, &id).await.expect("messages");
        check_history(sid, &msgs);
        assert_eq!(msgs.len(), 2, "{sid}: {msgs:#?}");
        let reply = &msgs[1];
        assert_eq!(reply.status.as_str(), status, "{sid}: {reply:?}");
        assert_eq!(reply.content, text, "{sid}");
        assert_eq!(
            reply.completion_tokens,
            end["usage"]["completion_tokens"].as_i64(),
            "{sid}"
        );
    }
    eprintln!("{STREAMS} streams ended: {statuses:?}");
    store.close().await;
    s.finish().await;
}
