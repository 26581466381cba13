//! A native client that goes away: its reply finishes and is stored (the default), or with
//! `--cancel-on-disconnect` is stopped on the worker and stored as `stopped`. The worker's
//! decoded-token counter tells the two apart; a wait for the worker to be idle would pass both.

use std::time::Duration;

use hearth_e2e::http::Req;
use hearth_e2e::stack::{
    assert_cancelled_before, new_session, settled_reply, slow_spec, wait_idle, wait_metric, Db,
    Stack, DECODED,
};
use serde_json::json;

/// Starts a long reply in a new session, reads three tokens and goes away; the session id.
async fn leave_mid_reply(s: &Stack, key: &str, max_tokens: u32) -> String {
    let sid = new_session(s.addr(), key).await;
    let turn = json!({"content": "Talk", "max_tokens": max_tokens, "ignore_eos": true});
    let mut sse = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(key))
        .json(&turn)
        .events(s.addr())
        .await;
    assert_eq!(sse.status, 200);
    let mut tokens = 0;
    while tokens < 3 {
        let e = sse.next().await.expect("an event");
        tokens += usize::from(e.event == "token");
    }
    drop(sse);
    sid
}

#[tokio::test]
async fn a_reply_outlives_its_client_unless_the_server_cancels_on_disconnect() {
    // The default: the reply runs to its end and is stored whole.
    let s = Stack::start_with("keepgoing", &slow_spec(), Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;
    let sid = leave_mid_reply(&s, &k, 60).await;
    let reply = settled_reply(s.addr(), &k, &sid, Duration::from_secs(30)).await;
    assert_eq!(reply["status"], "complete", "{reply}");
    assert_eq!(reply["finish_reason"], "length", "{reply}");
    assert_eq!(reply["completion_tokens"], 60, "{reply}");
    // The worker counts a step's tokens once the step is over, maybe after the reply is stored.
    let metrics = s.workers[0].metrics.parse().expect("metrics address");
    let decoded = wait_metric(metrics, DECODED, Duration::from_secs(10), |v| v >= 59.0).await;
    assert!(decoded >= 59.0, "the worker decoded {decoded} tokens");
    s.finish().await;

    // --cancel-on-disconnect: the worker stops decoding and the partial reply is kept.
    let s = Stack::start_with(
        "cancelgone",
        &slow_spec(),
        Db::Sqlite,
        1,
        &["--cancel-on-disconnect"],
    )
    .await;
    let k = s.key("alice").await;
    let sid = leave_mid_reply(&s, &k, 900).await;
    let reply = settled_reply(s.addr(), &k, &sid, Duration::from_secs(30)).await;
    assert_eq!(reply["status"], "stopped", "{reply}");
    assert!(!reply["content"].as_str().unwrap_or_default().is_empty());
    assert_eq!(wait_idle(&s.workers[0]).await, 0.0);
    assert_cancelled_before(&s.workers[0], 900).await;
    s.finish().await;
}
