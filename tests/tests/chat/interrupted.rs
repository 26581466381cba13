//! Replies cut short: stopped by the user, their worker killed (they move to another, or end in
//! an error when none is left), their client gone (it resumes), every worker full, and the
//! orchestrator crashed in the middle of one.

use std::time::Duration;

use hearth_e2e::http::Req;
use hearth_e2e::stack::{
    fold, history, new_session, read_tokens, serving_worker, settled_reply, slow_spec,
    stream_turn_with, wait_idle, Db, Hearth, Stack,
};
use serde_json::{json, Value};

/// A long, fixed-length reply (the tiny model would otherwise stop at random).
fn long_turn(content: &str) -> Value {
    json!({"content": content, "max_tokens": 900, "ignore_eos": true})
}

#[tokio::test]
async fn stop_cancels_and_keeps_the_partial_reply() {
    let s = Stack::start_with("stop", &slow_spec(), Db::Postgres, 1, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let mut sse = stream_turn_with(s.addr(), &k, &sid, &long_turn("Tell me everything")).await;
    let mut seen = read_tokens(&mut sse, 3).await;
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/stop"))
        .key(Some(&k))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["stopped"], true, "{}", r.text());
    seen.extend(sse.rest().await);
    let got = fold(&seen);
    let end = got.last.json();
    assert_eq!(got.last.event, "message_end");
    assert_eq!(end["status"], "stopped");
    let completion = end["usage"]["completion_tokens"].as_u64().expect("n");
    assert!(completion < 900, "the stop came too late: {end}");
    let stored = history(s.addr(), &k, &sid).await;
    assert_eq!(stored[1]["status"], "stopped");
    assert_eq!(stored[1]["content"], json!(got.text));
    assert!(!got.text.is_empty());
    // The cancel reached the worker: nothing is left running there.
    assert_eq!(wait_idle(&s.workers[0]).await, 0.0);
    s.finish().await;
}

#[tokio::test]
async fn killing_the_worker_mid_stream_moves_the_reply_to_another() {
    let mut s = Stack::start_with("failover", &slow_spec(), Db::Postgres, 2, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let turn = json!({"content": "A long story, please", "max_tokens": 300, "ignore_eos": true});
    let mut sse = stream_turn_with(s.addr(), &k, &sid, &turn).await;
    let mut seen = read_tokens(&mut sse, 5).await;
    let victim = serving_worker(&s).await;
    // Clients see a worker's place in the --worker list, never its address.
    let survivor = format!("worker-{}", 2 - victim);
    s.workers[victim].child.kill().expect("kill -9");
    seen.extend(sse.rest().await);
    let got = fold(&seen);
    assert_eq!(got.last.event, "message_end", "{:?}", got.last);
    let end = got.last.json();
    assert_eq!(end["status"], "complete");
    assert_eq!(end["usage"]["completion_tokens"], 300, "{end}");
    assert_eq!(end["worker"], json!(survivor));
    let stored = history(s.addr(), &k, &sid).await;
    assert_eq!(stored.len(), 2, "stored once");
    assert_eq!(stored[1]["content"], json!(got.text));
    assert_eq!(stored[1]["status"], "complete");
    assert_eq!(stored[1]["completion_tokens"], 300);
    // /readyz is public: it names the workers the same way, says which is down, and gives
    // neither their addresses nor their errors (which can hold addresses).
    let mut ready = Req::new("GET", "/readyz").send(s.addr()).await;
    for _ in 0..100 {
        if ready.json()["workers"][victim]["ready"] == false {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        ready = Req::new("GET", "/readyz").send(s.addr()).await;
    }
    let body = ready.text();
    for w in &s.workers {
        let port = w.grpc.rsplit(':').next().expect("port");
        assert!(
            !body.contains(port),
            "/readyz names a worker's address: {body}"
        );
    }
    let workers = ready.json()["workers"].clone();
    assert_eq!(
        workers[victim]["name"],
        json!(format!("worker-{}", victim + 1))
    );
    assert_eq!(workers[victim]["ready"], false, "{body}");
    assert_eq!(workers[1 - victim]["ready"], true, "{body}");
    s.finish().await;
}

#[tokio::test]
async fn with_no_worker_left_the_client_gets_an_error_and_the_partial_reply_is_kept() {
    let mut s = Stack::start_with("noworker", &slow_spec(), Db::Postgres, 1, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let mut sse = stream_turn_with(s.addr(), &k, &sid, &long_turn("Go on")).await;
    let mut seen = read_tokens(&mut sse, 5).await;
    s.workers[0].child.kill().expect("kill -9");
    seen.extend(sse.rest().await);
    let got = fold(&seen);
    assert_eq!(got.last.event, "error", "{:?}", got.last);
    let err = got.last.json();
    assert_eq!(err["error_type"], "service_unavailable");
    assert!(!got.text.is_empty());
    let stored = history(s.addr(), &k, &sid).await;
    assert_eq!(stored[1]["status"], "error");
    assert_eq!(stored[1]["content"], json!(got.text));
    // Until a worker is back, new turns get a clear 503 and store nothing.
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&k))
        .json(&json!({"content": "hello?"}))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(history(s.addr(), &k, &sid).await.len(), 2);
    s.finish().await;
}

#[tokio::test]
async fn a_dropped_client_can_resume_and_the_reply_is_finished_and_stored() {
    let s = Stack::start_with("resume", &slow_spec(), Db::Postgres, 1, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let turn = json!({"content": "Once upon a time", "max_tokens": 200, "ignore_eos": true});
    let mut sse = stream_turn_with(s.addr(), &k, &sid, &turn).await;
    let seen = read_tokens(&mut sse, 3).await;
    let before = fold(&seen).text;
    let last_id = seen.last().and_then(|e| e.id.clone()).expect("id");
    drop(sse);
    // Another turn cannot start while this one runs.
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(&k))
        .json(&json!({"content": "me too"}))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 409, "{}", r.text());
    let mut resumed = Req::new("GET", &format!("/v1/sessions/{sid}/stream"))
        .key(Some(&k))
        .header("Last-Event-ID", last_id.clone())
        .events(s.addr())
        .await;
    assert_eq!(resumed.status, 200);
    let rest = resumed.rest().await;
    let (msg, n) = last_id.rsplit_once(':').expect("id shape");
    let n: usize = n.parse().expect("n");
    assert_eq!(
        rest[0].id,
        Some(format!("{msg}:{}", n + 1)),
        "resumes right after"
    );
    let after: String = rest
        .iter()
        .filter(|e| e.event == "token")
        .map(|e| e.json()["text"].as_str().unwrap_or_default().to_string())
        .collect();
    let end = rest.last().expect("end");
    assert_eq!(end.event, "message_end");
    assert_eq!(end.json()["usage"]["completion_tokens"], 200);
    let stored = history(s.addr(), &k, &sid).await;
    assert_eq!(stored[1]["status"], "complete");
    assert_eq!(stored[1]["content"], json!(format!("{before}{after}")));
    s.finish().await;
}

#[tokio::test]
async fn when_every_worker_is_full_new_requests_get_503() {
    let s = Stack::start_with(
        "admission",
        &slow_spec(),
        Db::Postgres,
        1,
        &["--worker-capacity", "1", "--max-queue", "0"],
    )
    .await;
    let k = s.key("alice").await;
    let (one, two) = (
        new_session(s.addr(), &k).await,
        new_session(s.addr(), &k).await,
    );
    let mut sse = stream_turn_with(s.addr(), &k, &one, &long_turn("first")).await;
    read_tokens(&mut sse, 1).await;
    let r = Req::new("POST", &format!("/v1/sessions/{two}/messages"))
        .key(Some(&k))
        .json(&json!({"content": "second"}))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "service_unavailable");
    assert!(history(s.addr(), &k, &two).await.is_empty());
    let stop = format!("/v1/sessions/{one}/stop");
    let r = Req::new("POST", &stop).key(Some(&k)).send(s.addr()).await;
    assert_eq!(r.status, 200);
    s.finish().await;
}

#[tokio::test]
async fn a_reply_cut_off_by_an_orchestrator_crash_is_marked_error_after_restart() {
    let mut s = Stack::start_with("crash", &slow_spec(), Db::Postgres, 1, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let mut sse = stream_turn_with(s.addr(), &k, &sid, &long_turn("Talk")).await;
    // Read on (so the stream never backs up) until a save of the reply's progress shows; the
    // crash must cut a reply that has progress to keep, however fast the worker decodes.
    let mut seen = read_tokens(&mut sse, 20).await;
    for _ in 0..200 {
        let reply = &history(s.addr(), &k, &sid).await[1];
        if reply["content"].as_str().is_some_and(|c| !c.is_empty()) {
            break;
        }
        for _ in 0..5 {
            let e = sse.next().await.expect("stream ended early");
            assert_ne!(
                e.event, "message_end",
                "the reply finished before a save showed"
            );
            seen.push(e);
        }
    }
    s.hearth.kill();
    // What was already on its way to the client was streamed too.
    seen.extend(sse.rest().await);
    let streamed = fold(&seen).text;
    let args = Stack::args(
        &s.assets,
        &s.db_url,
        &s.workers,
        &["--orphan-after-secs", "1"],
    );
    s.hearth = Hearth::spawn(&args);
    s.hearth.wait_ready().await;
    let last = settled_reply(s.addr(), &k, &sid, Duration::from_secs(10)).await;
    assert_eq!(last["status"], "error", "{last}");
    assert_eq!(last["finish_reason"], "interrupted");
    let saved = last["content"].as_str().expect("content");
    assert!(!saved.is_empty(), "progress was saved while streaming");
    assert!(
        streamed.starts_with(saved),
        "saved text is what was streamed"
    );
    s.finish().await;
}
