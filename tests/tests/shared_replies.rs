//! Replies' shared streams in a real Redis (127.0.0.1:6379, or `TEST_REDIS_URL`): what one
//! replica publishes another reads whole, with the tokens its text is, and its clients see an
//! event only once it is published; once a second replica takes the reply over (a higher lease
//! epoch), the first can publish no more and stops, and the stream goes on from the second one's
//! events, its end carrying the record to store. A stream Redis lost is written again whole by
//! its owner; one begun again from a checkpoint serves only the clients it can serve truly.

use std::time::Duration;

use hearth_orchestrator::generate::{
    Before, End, Live, Outcome, RunEvent, SharedReplies, StreamState, TurnIds,
};
use hearth_orchestrator::ids::{MessageId, SessionId};
use hearth_orchestrator::limits::connect_redis;
use hearth_orchestrator::storage::{MessageStatus, ReplyLease};
use hearth_shared::FinishReason;
use tokio_stream::StreamExt;

fn redis_url() -> String {
    std::env::var("TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

async fn replica() -> SharedReplies {
    let url = redis_url();
    let redis = connect_redis(&url)
        .await
        .unwrap_or_else(|e| panic!("Redis at {url} is required for this test: {e}"));
    SharedReplies::new(redis, &url).expect("client")
}

/// Polls until `f` holds (Redis is written by background tasks).
async fn until<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..200 {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("never: {what}");
}

fn turn() -> TurnIds {
    TurnIds {
        session_id: SessionId::random(),
        user_message_id: Some(MessageId::random()),
        message_id: MessageId::random(),
    }
}

fn lease(ids: &TurnIds, epoch: i64) -> ReplyLease {
    ReplyLease {
        message_id: ids.message_id.clone(),
        epoch,
    }
}

fn end(content: &str) -> RunEvent {
    RunEvent::End(Box::new(Outcome {
        content: content.into(),
        end: End::Finished(FinishReason::Length),
        tool_calls: None,
        usage: Default::default(),
        timings: Default::default(),
        worker: Some("w1".into()),
        stop_sequence: None,
    }))
}

/// How many events and which tokens the stream holds while it runs (None: not whole, or over).
async fn running(r: &SharedReplies, id: &MessageId) -> Option<(usize, Vec<u32>)> {
    match r.read(id).await?? {
        StreamState::Running(p) => Some((p.events, p.tokens)),
        StreamState::Ended(_) => None,
    }
}

/// The indices a listener of `live` from 0 is shown within 200 ms.
async fn shown(live: &std::sync::Arc<Live>) -> Vec<usize> {
    let mut s = std::pin::pin!(live.subscribe(0).map(|(n, _)| n));
    let mut got = Vec::new();
    while let Ok(Some(n)) = tokio::time::timeout(Duration::from_millis(200), s.next()).await {
        got.push(n);
    }
    got
}

#[tokio::test]
async fn a_reply_taken_over_is_published_by_its_new_owner_only() {
    let (a, b) = (replica().await, replica().await);
    let ids = turn();
    let id = ids.message_id.clone();
    let live = Live::shared(ids.clone(), 0);
    a.publish(
        live.clone(),
        &lease(&ids, 0),
        Some("{\"job\":1}".into()),
        Before::Nothing,
    );
    live.push(RunEvent::Begin);
    live.push_text("Hel".into(), &[9, 10]);
    live.push_text("lo".into(), &[11]);
    until("three events published", || async {
        running(&b, &id).await.is_some_and(|(n, _)| n == 3)
    })
    .await;
    assert_eq!(running(&b, &id).await, Some((3, vec![9, 10, 11])));
    assert_eq!(b.job(&id).await.flatten().as_deref(), Some("{\"job\":1}"));
    assert_eq!(shown(&live).await, vec![0, 1, 2], "published, so shown");

    // B claims epoch 1 and takes it over: A's next event is not published, A stops,
    // disowned, and its listeners are shown nothing more.
    b.take(&lease(&ids, 1), false).await.expect("taken");
    assert_eq!(
        a.take(&lease(&ids, 0), false).await,
        None,
        "an older lease cannot take it back"
    );
    live.push_text(" there".into(), &[12]);
    until("A disowned", || async { live.is_disowned() }).await;
    assert!(live.stop_requested());
    assert_eq!(shown(&live).await, Vec::<usize>::new());
    assert_eq!(running(&b, &id).await.map(|(n, _)| n), Some(3));

    // B goes on from event 3; a reader that had event 2 gets B's events, in order, and the
    // end carries the record to store.
    let reader = b.reply(&id).events(2).await.expect("redis").expect("held");
    let on_b = Live::shared(ids.clone(), 3);
    b.publish(on_b.clone(), &lease(&ids, 1), None, Before::Nothing);
    on_b.push_text(" there".into(), &[12]);
    on_b.push(end("Hello there"));
    let read: Vec<_> = tokio::time::timeout(Duration::from_secs(10), reader.collect::<Vec<_>>())
        .await
        .expect("the reader ends with the reply");
    let names: Vec<(&str, &str)> = read.iter().map(|e| (e.id.as_str(), &*e.name)).collect();
    let (t3, t4, t5) = (format!("{id}:3"), format!("{id}:4"), format!("{id}:5"));
    assert_eq!(
        names,
        vec![
            (t3.as_str(), "token"),
            (t4.as_str(), "token"),
            (t5.as_str(), "message_end")
        ]
    );
    assert!(read[1].data.contains(" there"), "{:?}", read[1]);
    let Some(Some(StreamState::Ended(done))) = b.read(&id).await else {
        panic!("the stream has ended");
    };
    assert_eq!(done.content, "Hello there");
    assert_eq!(done.status, MessageStatus::Complete);
    assert_eq!(done.worker.as_deref(), Some("w1"));
    until("the job is gone once the reply ended", || async {
        b.job(&id).await == Some(None)
    })
    .await;
}

/// Deletes the reply's keys, as a Redis restart without persistence does.
fn forget(ids: &TurnIds) {
    let id = &ids.message_id;
    let out = std::process::Command::new("redis-cli")
        .args(["-u", &redis_url(), "DEL"])
        .args([
            format!("hearth:reply:{id}"),
            format!("hearth:reply-owner:{id}"),
            format!("hearth:reply-job:{id}"),
        ])
        .output()
        .expect("redis-cli");
    assert!(out.status.success(), "{out:?}");
}

#[tokio::test]
async fn a_stream_redis_lost_is_written_again_whole_by_its_owner() {
    let (a, b) = (replica().await, replica().await);
    let ids = turn();
    let id = ids.message_id.clone();
    let live = Live::shared(ids.clone(), 0);
    a.publish(
        live.clone(),
        &lease(&ids, 0),
        Some("{\"job\":2}".into()),
        Before::Nothing,
    );
    live.push(RunEvent::Begin);
    live.push_text("a".into(), &[1]);
    until("two events published", || async {
        running(&b, &id).await.is_some_and(|(n, _)| n == 2)
    })
    .await;
    forget(&ids);
    live.push_text("b".into(), &[2]);
    until("the stream written again from its start", || async {
        running(&b, &id).await.is_some_and(|(n, _)| n == 3)
    })
    .await;
    assert_eq!(running(&b, &id).await, Some((3, vec![1, 2])));
    assert_eq!(b.job(&id).await.flatten().as_deref(), Some("{\"job\":2}"));
    assert!(!live.is_disowned());
    live.push(end("ab"));
    live.settle();
}

#[tokio::test]
async fn a_stream_begun_again_serves_only_the_clients_it_can_serve_truly() {
    let (a, b) = (replica().await, replica().await);
    let ids = turn();
    let id = ids.message_id.clone();
    // The owner died with Redis: B goes on from a checkpoint of 4 events (tokens 1 2 3).
    b.take(&lease(&ids, 1), true).await.expect("taken");
    let on_b = Live::shared(ids.clone(), 4);
    b.publish(
        on_b.clone(),
        &lease(&ids, 1),
        None,
        Before::Lost(vec![1, 2, 3]),
    );
    on_b.push_text("d".into(), &[4]);
    until("begun again", || async {
        running(&a, &id).await.is_some_and(|(n, _)| n == 5)
    })
    .await;
    assert_eq!(
        running(&a, &id).await,
        Some((5, vec![1, 2, 3, 4])),
        "the first entry carries the tokens before it"
    );

    // A client with exactly the first four events goes on; one ahead of them, or behind, is
    // told the stream was lost, under the id it already has.
    let exact = a.reply(&id).events(4).await.expect("redis").expect("held");
    let mut exact = std::pin::pin!(exact);
    let next = tokio::time::timeout(Duration::from_secs(5), exact.next())
        .await
        .expect("an event")
        .expect("one");
    assert_eq!((next.id, &*next.name), (format!("{id}:5"), "token"));
    for from in [2, 6] {
        let lost: Vec<_> = a
            .reply(&id)
            .events(from)
            .await
            .expect("redis")
            .expect("an answer")
            .collect()
            .await;
        assert_eq!(lost.len(), 1, "{lost:?}");
        assert_eq!(lost[0].name, "error");
        assert_eq!(lost[0].id, format!("{id}:{from}"));
        assert!(lost[0].data.contains("stream_lost"), "{:?}", lost[0]);
    }
    on_b.push(end("abcd"));
    on_b.settle();
}

/// What Redis does not hold is told apart from Redis not answering (`Some(None)` against
/// `None`): a sweep gives a reply up for the first only, and leaves it to a later sweep for
/// the second; a resume answers 404 for the first only.
#[tokio::test]
async fn redis_not_answering_is_told_apart_from_what_it_does_not_hold() {
    let mut server = hearth_e2e::redis::RedisServer::start();
    let url = server.url();
    let redis = connect_redis(&url).await.expect("Redis");
    let r = SharedReplies::new(redis, &url).expect("client");
    let ids = turn();
    let id = &ids.message_id;
    assert_eq!(r.read(id).await, Some(None));
    assert_eq!(r.job(id).await, Some(None));
    assert!(matches!(r.find(&ids.session_id).await, Some(None)));
    server.kill();
    assert_eq!(r.read(id).await, None);
    assert_eq!(r.job(id).await, None);
    assert!(r.find(&ids.session_id).await.is_none());
}
