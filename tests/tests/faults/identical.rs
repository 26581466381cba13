//! A reply that is cut and continued is the reply it would have been uncut: greedy or seeded
//! sampling, failed over to another worker after its first one is killed, or preempted to give
//! its place to another user and resumed.

use hearth_e2e::http::{Req, Sse};
use hearth_e2e::stack::{finish, metric, new_session, serving_worker, slow_spec, Db, Stack};
use serde_json::{json, Value};

/// Starts a streamed 120-token reply to "A long story, please" in a new session, with
/// `params`, and reads its first `tokens` tokens: the stream and their text.
async fn begin_story(s: &Stack, key: &str, params: &Value, tokens: usize) -> (Sse, String) {
    let story = Story::begin(s, key, params, 120, tokens).await;
    (story.sse, story.text)
}

/// A story under way: its session, its stream, and the text read so far.
struct Story {
    sid: String,
    sse: Sse,
    text: String,
}

impl Story {
    /// Starts a streamed `max_tokens`-token reply to "A long story, please" in a new session,
    /// with `params`, and reads its first `tokens` tokens.
    async fn begin(s: &Stack, key: &str, params: &Value, max_tokens: u32, tokens: usize) -> Self {
        let sid = new_session(s.addr(), key).await;
        let sse = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
            .key(Some(key))
            .json(
                &json!({"content": "A long story, please", "max_tokens": max_tokens,
                          "ignore_eos": true, "params": params}),
            )
            .events(s.addr())
            .await;
        assert_eq!(sse.status, 200);
        let mut story = Self {
            sid,
            sse,
            text: String::new(),
        };
        for _ in 0..tokens {
            story.read_token().await;
        }
        story
    }

    /// Reads the stream up to and including its next token.
    async fn read_token(&mut self) {
        loop {
            let e = self.sse.next().await.expect("the reply ended early");
            if e.event == "token" {
                self.text += e.json()["text"].as_str().unwrap_or_default();
                return;
            }
        }
    }

    /// Reads on until the text is at least `len` bytes long, then stops the reply and reads
    /// its stream to the end; returns the text read.
    async fn stop_after(mut self, s: &Stack, key: &str, len: usize) -> String {
        while self.text.len() < len {
            self.read_token().await;
        }
        let r = Req::new("POST", &format!("/v1/sessions/{}/stop", self.sid))
            .key(Some(key))
            .send(s.addr())
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
        self.sse.rest().await;
        self.text
    }
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
    // bob, holding nothing, gets the place of her newest, which continues afterwards. Her
    // stories are long (900 tokens) so that neither can end before bob asks, however slowly
    // this client runs: one that ended would free a place and serve bob without a preemption.
    // Each is compared with an uncut story over the uncut one's first 120 tokens, then stopped.
    const LONG: u32 = 900;
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
    let uncut = Story::begin(&s, &alice, &params, LONG, 120).await;
    let whole_len = uncut.text.len();
    let whole = uncut.stop_after(&s, &alice, whole_len).await;
    assert_eq!(
        metric(s.addr(), "hearth_fair_share_preemptions_total").await,
        0.0
    );

    let first = Story::begin(&s, &alice, &params, LONG, 1).await;
    let newest = Story::begin(&s, &alice, &params, LONG, 20).await;
    let r = Req::new("POST", "/v1/chat/completions")
        .key(Some(&bob))
        .json(&json!({"messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 4, "ignore_eos": true}))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "bob was served: {}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 4, "{}", r.text());
    assert_eq!(
        metric(s.addr(), "hearth_fair_share_preemptions_total").await,
        1.0,
        "one of alice's replies gave bob its place"
    );
    let first = first.stop_after(&s, &alice, whole.len());
    let newest = newest.stop_after(&s, &alice, whole.len());
    let (first, newest) = tokio::join!(first, newest);
    assert!(
        first.starts_with(&whole),
        "alice's first reply: {first:?}\nuncut: {whole:?}"
    );
    assert!(
        newest.starts_with(&whole),
        "alice's preempted reply continued where it stopped: {newest:?}\nuncut: {whole:?}"
    );
    assert_eq!(metric(s.addr(), "hearth_queue_depth").await, 0.0);
    s.finish().await;
}
