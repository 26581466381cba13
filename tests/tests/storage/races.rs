//! Concurrent turns: on each session exactly one is written, whatever races it.

use super::*;
use hearth_orchestrator::storage::{Accounts, Sessions, Transcript};

pub(crate) async fn concurrency_suite(s: &SqlStore) {
    let u = s.create_user("u").await.expect("user").id;
    let one = s
        .create_session(&u, NewSession::default())
        .await
        .expect("session")
        .id;
    let others: Vec<SessionId> = {
        let mut v = Vec::new();
        for _ in 0..4 {
            v.push(
                s.create_session(&u, NewSession::default())
                    .await
                    .expect("session")
                    .id,
            );
        }
        v
    };
    // Eight turns on one session and eight spread over others, all at once, while a reply
    // streams progress: on each session exactly one turn is written and the others are refused
    // (one reply per session, however many replicas race), with sequence numbers intact.
    let streaming = s
        .begin_turn(&u, &others[0], "streaming")
        .await
        .expect("turn");
    let mut tasks = Vec::new();
    for i in 0..16 {
        let (s, u) = (s.clone(), u.clone());
        let session = if i % 2 == 0 {
            one.clone()
        } else {
            others[i % 4].clone()
        };
        tasks.push(tokio::spawn(async move {
            (
                session.clone(),
                s.begin_turn(&u, &session, &format!("turn {i}")).await,
            )
        }));
    }
    for k in 0..20 {
        assert!(progress(s, &streaming.assistant.id, &"x".repeat(k)).await);
    }
    let mut written = std::collections::HashMap::<SessionId, usize>::new();
    for t in tasks {
        let (session, r) = t.await.expect("task");
        match r {
            Ok(_) => *written.entry(session).or_default() += 1,
            Err(StoreError::ReplyRunning) => {}
            Err(e) => panic!("a concurrent turn failed: {e}"),
        }
    }
    assert_eq!(written.get(&one), Some(&1), "{written:?}");
    assert_eq!(written.get(&others[1]), Some(&1), "{written:?}");
    assert_eq!(written.get(&others[3]), Some(&1), "{written:?}");
    assert_eq!(
        s.begin_turn(&u, &others[0], "no").await.map(|_| ()),
        Err(StoreError::ReplyRunning)
    );
    let msgs = s.list_messages(&u, &one).await.expect("messages");
    let seqs: Vec<i64> = msgs.iter().map(|m| m.seq).collect();
    assert_eq!(seqs, vec![1, 2]);
    finish(s, &msgs[1].id, &complete("ok")).await;
    let next = s.begin_turn(&u, &one, "next").await.expect("next turn");
    assert_eq!((next.user.seq, next.assistant.seq), (3, 4));
}
