//! A reply that is cut and continued is the reply it would have been uncut: greedy or seeded
//! sampling, failed over to another worker after its first one is killed, or preempted to give
//! its place to another user and resumed.

use hearth_e2e::http::{Req, Sse};
use hearth_e2e::stack::{finish, metric, new_session, serving_worker, slow_spec, Db, Stack};
use serde_json::{json, Value};

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
        .json(&json!({"messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 4, "ignore_eos": true}))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "bob was served: {}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 4, "{}", r.text());
    // Should bob get a place without a preemption (seen on a starved machine), the failure
    // says whether one of alice's replies freed it by failing over.
    let failovers = metric(s.addr(), "hearth_worker_failovers_total").await;
    assert_eq!(
        metric(s.addr(), "hearth_fair_share_preemptions_total").await,
        1.0,
        "one of alice's replies gave bob its place (worker failovers meanwhile: {failovers})"
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
