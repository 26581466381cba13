//! Replies' shared streams in a real Redis (127.0.0.1:6379, or `TEST_REDIS_URL`): what one
//! replica publishes another reads whole, with the tokens its text is; once a second replica
//! takes the reply over, the first can publish no more and stops, and the stream goes on from
//! the second one's events.

use std::time::Duration;

use hearth_orchestrator::generate::{Live, RunEvent, SharedReplies, TurnIds};
use hearth_orchestrator::ids::{MessageId, SessionId};
use hearth_orchestrator::limits::connect_redis;
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

#[tokio::test]
async fn a_reply_taken_over_is_published_by_its_new_owner_only() {
    let (a, b) = (replica().await, replica().await);
    let ids = TurnIds {
        session_id: SessionId::random(),
        user_message_id: Some(MessageId::random()),
        message_id: MessageId::random(),
    };
    let id = ids.message_id.clone();
    let live = Live::new(Some(ids.clone()));
    a.publish(live.clone(), Some("{\"job\":1}".into()));
    live.push(RunEvent::Begin);
    live.push_text("Hel".into(), &[9, 10]);
    live.push_text("lo".into(), &[11]);
    until("three events published", || async {
        b.published(&id).await.is_some_and(|p| p.events == 3)
    })
    .await;
    let p = b.published(&id).await.expect("published");
    assert_eq!(p.tokens, vec![9, 10, 11]);
    assert_eq!(b.job(&id).await.as_deref(), Some("{\"job\":1}"));

    // B takes it over: A's next event is not published, and A stops, disowned.
    b.take(&id).await.expect("taken");
    live.push_text(" there".into(), &[12]);
    until("A disowned", || async { live.is_disowned() }).await;
    assert!(live.stop_requested());
    assert_eq!(b.published(&id).await.map(|p| p.events), Some(3));

    // B goes on from event 3; a reader that had event 2 gets B's events, in order.
    let reader = b.reply(&id).events(2).await.expect("redis").expect("held");
    let on_b = Live::from_event(Some(ids), 3);
    b.publish(on_b.clone(), None);
    on_b.push_text(" there".into(), &[12]);
    on_b.push(RunEvent::End(Box::new(
        hearth_orchestrator::generate::Outcome {
            content: "Hello there".into(),
            end: hearth_orchestrator::generate::End::Finished(hearth_shared::FinishReason::Length),
            tool_calls: None,
            usage: Default::default(),
            timings: Default::default(),
            worker: None,
        },
    )));
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
    until("the job is gone once the reply ended", || async {
        b.job(&id).await.is_none()
    })
    .await;
}
