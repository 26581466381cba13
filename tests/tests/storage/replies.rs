//! A turn's messages: begin, stream, finish, fail an interrupted reply, regenerate and edit.

use super::*;
use hearth_orchestrator::storage::{Accounts, ReplyLog, Sessions, Transcript};

pub(crate) async fn turns_suite(s: &SqlStore) {
    let u = s.create_user("u").await.expect("user").id;
    let sess = s
        .create_session(&u, NewSession::default())
        .await
        .expect("session");
    assert_eq!(s.last_message(&u, &sess.id).await.expect("last"), None);
    let t1 = s.begin_turn(&u, &sess.id, "Hello?").await.expect("turn 1");
    assert_eq!((t1.user.seq, t1.assistant.seq), (1, 2));
    assert_eq!(
        s.last_message(&u, &sess.id).await.expect("last"),
        Some(t1.assistant.clone()),
        "the last message is the newest one"
    );
    assert_eq!(t1.assistant.status, MessageStatus::Streaming);
    assert!(progress(s, &t1.assistant.id, "Hi").await);
    let msgs = s.list_messages(&u, &sess.id).await.expect("messages");
    assert_eq!(msgs[1].content, "Hi");
    let done = Completion {
        content: "Hi there.".into(),
        status: MessageStatus::Complete,
        finish_reason: Finish::Stop,
        usage: ReplyUsage {
            prompt_tokens: 12,
            cached_tokens: 0,
            completion_tokens: 4,
        },
        timings: ReplyTimings {
            ttft_ms: Some(80),
            duration_ms: 300,
        },
        worker: Some("127.0.0.1:50051".into()),
        tool_calls: None,
    };
    finish(s, &t1.assistant.id, &done).await;
    // Progress after the end changes nothing, and says so; so does a second end.
    assert!(!progress(s, &t1.assistant.id, "late").await);
    let first = ReplyLease::first(t1.assistant.id.clone());
    assert!(!s
        .finish_message(&first, &complete("again"))
        .await
        .expect("finish"));
    let msgs = s.list_messages(&u, &sess.id).await.expect("messages");
    assert_eq!(msgs.len(), 2);
    assert_eq!(
        (msgs[0].role, msgs[0].content.as_str()),
        (Role::User, "Hello?")
    );
    let a = &msgs[1];
    assert_eq!(
        (a.role, a.status, a.content.as_str()),
        (Role::Assistant, MessageStatus::Complete, "Hi there.")
    );
    assert_eq!(
        (
            a.prompt_tokens,
            a.cached_tokens,
            a.completion_tokens,
            a.ttft_ms,
            a.duration_ms
        ),
        (Some(12), Some(0), Some(4), Some(80), Some(300))
    );
    assert_eq!(a.worker.as_deref(), Some("127.0.0.1:50051"));

    let t2 = s
        .begin_turn(&u, &sess.id, "And then?")
        .await
        .expect("turn 2");
    assert_eq!(t2.user.seq, 3);
    leases_suite(s, &u, &sess.id, &t2.assistant.id).await;

    // Regenerate: the last reply is replaced by a new placeholder at the same place.
    let again = s
        .begin_regenerate(&u, &sess.id, 4)
        .await
        .expect("regenerate");
    assert_eq!(again.seq, 4);
    let msgs = s.list_messages(&u, &sess.id).await.expect("messages");
    assert_eq!(msgs.len(), 4);
    assert_eq!(
        (msgs[3].id.as_str(), msgs[3].content.as_str()),
        (again.id.as_str(), "")
    );

    // While the new reply streams, no other turn starts in the session (from any replica).
    assert_eq!(
        s.begin_turn(&u, &sess.id, "meanwhile").await.map(|_| ()),
        Err(StoreError::ReplyRunning)
    );
    assert_eq!(
        s.begin_regenerate(&u, &sess.id, 4).await.map(|_| ()),
        Err(StoreError::ReplyRunning)
    );
    assert_eq!(
        s.list_messages(&u, &sess.id).await.expect("messages").len(),
        4
    );
    finish(s, &again.id, &done).await;

    // Unicode and a long message survive the round trip.
    let text = "Zürich 東京 🙂 ".repeat(2000);
    let t3 = s.begin_turn(&u, &sess.id, &text).await.expect("turn 3");
    let msgs = s.list_messages(&u, &sess.id).await.expect("messages");
    assert_eq!(
        msgs.iter().find(|m| m.id == t3.user.id).map(|m| &m.content),
        Some(&text)
    );
    assert_eq!(
        s.finish_message(&ReplyLease::first(MessageId::random()), &done)
            .await,
        Ok(false),
        "no such reply"
    );
}

/// The reply `id`, streaming, is saved with its checkpoint and job, kept alive by its owner's
/// heartbeat, claimed by another replica (one of two racing wins), after which the first
/// owner can write nothing, and finally failed by the claimer: error, interrupted, its text
/// kept.
async fn leases_suite(s: &SqlStore, u: &UserId, sid: &SessionId, id: &MessageId) {
    let owner = ReplyLease::first(id.clone());
    assert!(s.save_job(&owner, "{\"job\":1}").await.expect("job"));
    let cp = Checkpoint {
        content: "Partial ans".into(),
        tokens: vec![9, 10, 262_143],
        events: 4,
    };
    assert!(s.save_progress(&owner, &cp).await.expect("progress"));
    let saved = s.saved_reply(id).await.expect("saved").expect("streaming");
    assert_eq!(saved.checkpoint, cp);
    assert_eq!(saved.job.as_deref(), Some("{\"job\":1}"));
    assert_eq!(
        s.saved_reply(&MessageId::random()).await.expect("none"),
        None
    );

    // The sweep lists it with the time of its last write and its epoch.
    let listed = |all: Vec<StreamingReply>| all.into_iter().find(|r| r.id == *id);
    let seen = listed(s.streaming_replies().await.expect("streaming")).expect("listed");
    assert_eq!(seen.epoch, 0);
    // The heartbeat writes a new `updated_at` however fast it beats: a claim that saw the
    // reply before it finds it alive.
    assert_eq!(
        s.renew_leases(std::slice::from_ref(&owner))
            .await
            .expect("renew"),
        vec![]
    );
    assert_eq!(s.claim_reply(&seen, true).await.expect("claim"), None);
    let seen = listed(s.streaming_replies().await.expect("streaming")).expect("listed");
    // Of two replicas racing with the same sighting, one wins, with the next epoch.
    let claimed = s
        .claim_reply(&seen, true)
        .await
        .expect("claim")
        .expect("claimed");
    assert_eq!(
        claimed,
        ReplyLease {
            message_id: id.clone(),
            epoch: 1
        }
    );
    assert_eq!(s.claim_reply(&seen, true).await.expect("claim"), None);
    assert_eq!(
        s.claim_reply(&seen, false).await.expect("claim"),
        None,
        "its epoch moved on"
    );

    // The first owner, alive after all, can write nothing: not its heartbeat, its progress,
    // its job, its end, nor a failure.
    assert_eq!(
        s.renew_leases(&[owner.clone(), claimed.clone()])
            .await
            .expect("renew"),
        vec![id.clone()]
    );
    let late = Checkpoint {
        content: "Partial answer that the old owner saw".into(),
        ..cp.clone()
    };
    assert!(!s.save_progress(&owner, &late).await.expect("fenced"));
    assert!(!s.save_job(&owner, "{}").await.expect("fenced"));
    assert!(!s
        .finish_message(&owner, &complete("stale"))
        .await
        .expect("fenced"));
    assert!(!s.fail_interrupted(&owner).await.expect("fenced"));
    let msgs = s.list_messages(u, sid).await.expect("messages");
    assert_eq!(msgs[3].content, "Partial ans");
    assert_eq!(msgs[3].status, MessageStatus::Streaming);

    // A handed-over reply is claimed by its epoch alone (its `updated_at` may move meanwhile).
    let seen = listed(s.streaming_replies().await.expect("streaming")).expect("listed");
    assert!(s.save_progress(&claimed, &cp).await.expect("progress"));
    let handed = s
        .claim_reply(&seen, false)
        .await
        .expect("claim")
        .expect("claimed by its epoch");
    assert_eq!(handed.epoch, 2);

    // The claimer cannot continue it after all: it fails it, text kept.
    assert!(s.fail_interrupted(&handed).await.expect("fail"));
    let msgs = s.list_messages(u, sid).await.expect("messages");
    assert_eq!(msgs[3].status, MessageStatus::Error);
    assert_eq!(msgs[3].content, "Partial ans");
    assert_eq!(msgs[3].finish_reason, Some(Finish::Interrupted));
    assert_eq!(
        listed(s.streaming_replies().await.expect("streaming")),
        None
    );
    assert_eq!(s.saved_reply(id).await.expect("saved"), None, "over");
    assert!(!s.fail_interrupted(&handed).await.expect("already failed"));
}

pub(crate) async fn edit_suite(s: &SqlStore) {
    let u = s.create_user("u").await.expect("user").id;
    let other = s.create_user("other").await.expect("other").id;
    let sess = s
        .create_session(&u, NewSession::default())
        .await
        .expect("session");
    let mut turns = Vec::new();
    for (q, a) in [("one?", "One."), ("two?", "Two."), ("three?", "Three.")] {
        let t = s.begin_turn(&u, &sess.id, q).await.expect("turn");
        finish(s, &t.assistant.id, &complete(a)).await;
        turns.push(t);
    }
    let before = s.list_messages(&u, &sess.id).await.expect("messages");
    assert_eq!(before.len(), 6);

    // Refusals change nothing: another user's session, a message of another session, an
    // unknown message, an assistant message.
    let nf = |what| Err(StoreError::NotFound(what));
    assert_eq!(
        s.begin_edit(&other, &sess.id, &turns[0].user.id, "x")
            .await
            .map(|_| ()),
        nf("session")
    );
    let elsewhere = s
        .create_session(&u, NewSession::default())
        .await
        .expect("second session");
    let foreign = s
        .begin_turn(&u, &elsewhere.id, "elsewhere")
        .await
        .expect("turn elsewhere");
    assert_eq!(
        s.begin_edit(&u, &sess.id, &foreign.user.id, "x")
            .await
            .map(|_| ()),
        nf("message")
    );
    assert_eq!(
        s.begin_edit(&u, &sess.id, &MessageId::random(), "x")
            .await
            .map(|_| ()),
        nf("message")
    );
    match s
        .begin_edit(&u, &sess.id, &turns[1].assistant.id, "x")
        .await
    {
        Err(StoreError::NotAUserMessage(why)) => assert!(why.contains("assistant"), "{why}"),
        other => panic!("editing a reply: {other:?}"),
    }
    assert_eq!(
        s.list_messages(&u, &sess.id).await.expect("unchanged"),
        before
    );
    assert_eq!(
        s.list_messages(&u, &elsewhere.id)
            .await
            .expect("other")
            .len(),
        2
    );

    // Editing the second question keeps the first turn, replaces the question in place (same
    // id and seq), drops everything after it and adds a streaming placeholder.
    let edited = s
        .begin_edit(&u, &sess.id, &turns[1].user.id, "two, edited?")
        .await
        .expect("edit");
    assert_eq!(edited.user.id, turns[1].user.id);
    assert_eq!((edited.user.seq, edited.assistant.seq), (3, 4));
    assert_eq!(edited.user.content, "two, edited?");
    assert_eq!(edited.assistant.status, MessageStatus::Streaming);
    let after = s.list_messages(&u, &sess.id).await.expect("messages");
    let shape: Vec<(i64, Role, &str, MessageStatus)> = after
        .iter()
        .map(|m| (m.seq, m.role, m.content.as_str(), m.status))
        .collect();
    assert_eq!(
        shape,
        vec![
            (1, Role::User, "one?", MessageStatus::Complete),
            (2, Role::Assistant, "One.", MessageStatus::Complete),
            (3, Role::User, "two, edited?", MessageStatus::Complete),
            (4, Role::Assistant, "", MessageStatus::Streaming),
        ]
    );
    assert_eq!(after[..2], before[..2]);
    assert_eq!(after[3].id, edited.assistant.id);

    // The first message: one user message and its new placeholder remain; a turn after that
    // continues the sequence.
    finish(s, &edited.assistant.id, &complete("Two again.")).await;
    let first = s
        .begin_edit(&u, &sess.id, &turns[0].user.id, "Zürich 東京 🙂")
        .await
        .expect("edit first");
    let after = s.list_messages(&u, &sess.id).await.expect("messages");
    assert_eq!(after.len(), 2);
    assert_eq!(
        (after[0].id.as_str(), after[0].content.as_str()),
        (turns[0].user.id.as_str(), "Zürich 東京 🙂")
    );
    assert_eq!(after[1].id, first.assistant.id);
    assert_eq!(
        s.begin_edit(&u, &sess.id, &turns[0].user.id, "again")
            .await
            .map(|_| ()),
        Err(StoreError::ReplyRunning),
        "no edit while the edited turn's reply streams"
    );
    finish(s, &first.assistant.id, &complete("Done.")).await;
    let next = s.begin_turn(&u, &sess.id, "more").await.expect("turn");
    assert_eq!(next.user.seq, 3);
}

pub(crate) async fn purge_suite(s: &SqlStore) {
    let u = s.create_user("u").await.expect("user").id;
    let mut ids = Vec::new();
    for title in ["gone", "kept"] {
        let new = NewSession {
            title: title.into(),
            ..Default::default()
        };
        let id = s.create_session(&u, new).await.expect("session").id;
        let t = s.begin_turn(&u, &id, "hello").await.expect("turn");
        finish(s, &t.assistant.id, &complete("hi")).await;
        ids.push(id);
    }
    s.delete_session(&u, &ids[0]).await.expect("delete");
    // Within the grace period nothing goes.
    assert_eq!(s.purge_deleted(0).await.expect("purge"), (0, 0));
    let later = hearth_orchestrator::storage::now_ms() + 1_000;
    assert_eq!(
        s.purge_deleted(later).await.expect("purge"),
        (1, 2),
        "the deleted session and its two messages"
    );
    assert_eq!(s.purge_deleted(later).await.expect("again"), (0, 0));
    let kept = s.list_messages(&u, &ids[1]).await.expect("kept");
    assert_eq!(kept.len(), 2, "a live session keeps its messages");
}

/// A reply that makes tool calls keeps them beside its text; the results are stored as `tool`
/// messages with the reply that answers them, in one transaction.
pub(crate) async fn tools_suite(s: &SqlStore) {
    let u = s.create_user("u").await.expect("user").id;
    let other = s.create_user("other").await.expect("other").id;
    let sess = s
        .create_session(&u, NewSession::default())
        .await
        .expect("session");
    let t = s.begin_turn(&u, &sess.id, "Weather?").await.expect("turn");
    let call = |id: &str, name: &str, args: &str| ToolCall {
        id: id.into(),
        kind: "function".into(),
        function: FunctionCall {
            name: name.into(),
            arguments: args.into(),
        },
    };
    let calls = vec![
        call("call_a", "get_weather", r#"{"city":"Oslo"}"#),
        call("call_b", "now", "{}"),
    ];
    let text = r#"[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "now"}]"#;
    let done = Completion {
        finish_reason: Finish::ToolCalls,
        tool_calls: Some(calls.clone()),
        ..complete(text)
    };
    finish(s, &t.assistant.id, &done).await;
    let results = [
        NewToolResult {
            tool_call_id: "call_a".into(),
            content: r#"{"temp_c": 12}"#.into(),
        },
        NewToolResult {
            tool_call_id: "call_b".into(),
            content: String::new(),
        },
    ];
    // Another user's session: nothing is written.
    assert_eq!(
        s.begin_tool_results(&other, &sess.id, &results)
            .await
            .map(|_| ()),
        Err(StoreError::NotFound("session"))
    );
    let (tool, reply) = s
        .begin_tool_results(&u, &sess.id, &results)
        .await
        .expect("results");
    assert_eq!(
        tool.iter()
            .map(|m| (m.seq, m.role, m.tool_call_id.as_deref()))
            .collect::<Vec<_>>(),
        vec![
            (3, Role::Tool, Some("call_a")),
            (4, Role::Tool, Some("call_b"))
        ]
    );
    assert_eq!((reply.seq, reply.status), (5, MessageStatus::Streaming));
    // One reply at a time: more results while this one streams are refused.
    assert_eq!(
        s.begin_tool_results(&u, &sess.id, &results)
            .await
            .map(|_| ()),
        Err(StoreError::ReplyRunning)
    );
    let msgs = s.list_messages(&u, &sess.id).await.expect("messages");
    assert_eq!(msgs.len(), 5);
    assert_eq!(msgs[1].finish_reason, Some(Finish::ToolCalls));
    assert_eq!(msgs[1].tool_calls.as_deref(), Some(calls.as_slice()));
    assert_eq!(
        msgs[1].content, text,
        "the text that made the calls is kept"
    );
    assert_eq!(
        (msgs[2].content.as_str(), msgs[3].content.as_str()),
        (r#"{"temp_c": 12}"#, "")
    );
    assert!(msgs[0].tool_calls.is_none() && msgs[0].tool_call_id.is_none());
}

/// A database made by the migrations before tool messages keeps its messages when the next
/// migration changes the table (SQLite rebuilds it), and can then hold `tool` messages.
pub(crate) async fn migration_keeps_messages(url: &str, backend: &str) {
    sqlx::any::install_default_drivers();
    let pool = sqlx::AnyPool::connect(url).await.expect("connect");
    let mut before = match backend {
        "sqlite" => sqlx::migrate!("../migrations/sqlite"),
        _ => sqlx::migrate!("../migrations/postgres"),
    };
    before.migrations = before
        .migrations
        .iter()
        .filter(|m| m.version <= 2)
        .cloned()
        .collect::<Vec<_>>()
        .into();
    before.run(&pool).await.expect("the first two migrations");
    for q in [
        "INSERT INTO users (id, name, created_at) VALUES ('00000000000000000000000000000001', 'u', 1)",
        "INSERT INTO sessions (id, user_id, title, title_lower, created_at, updated_at) \
         VALUES ('00000000000000000000000000000002', '00000000000000000000000000000001', 't', 't', 1, 1)",
        "INSERT INTO messages (id, session_id, seq, role, content, status, finish_reason, \
         completion_tokens, created_at, updated_at) VALUES \
         ('00000000000000000000000000000003', '00000000000000000000000000000002', 1, 'user', 'q', 'complete', NULL, NULL, 1, 1), \
         ('00000000000000000000000000000004', '00000000000000000000000000000002', 2, 'assistant', 'a', 'complete', 'stop', 7, 1, 2)",
    ] {
        sqlx::query(q).execute(&pool).await.expect(q);
    }
    pool.close().await;
    let s = SqlStore::connect(url).await.expect("migrated");
    let user = s.user_by_name("u").await.expect("user").expect("kept");
    let sess = SessionId::parse("00000000000000000000000000000002").expect("id");
    let msgs = s.list_messages(&user.id, &sess).await.expect("messages");
    assert_eq!(
        msgs.iter()
            .map(|m| (m.seq, m.role, m.content.as_str(), m.finish_reason))
            .collect::<Vec<_>>(),
        vec![
            (1, Role::User, "q", None),
            (2, Role::Assistant, "a", Some(Finish::Stop))
        ]
    );
    assert_eq!(msgs[1].completion_tokens, Some(7));
    assert_eq!((msgs[1].created_at, msgs[1].updated_at), (1, 2));
    // The rebuilt table still ties messages to their session, and takes tool messages.
    s.delete_session(&user.id, &sess).await.expect("delete");
    assert_eq!(s.purge_deleted(i64::MAX).await.expect("purge"), (1, 2));
    let sess = s
        .create_session(&user.id, NewSession::default())
        .await
        .expect("session");
    s.begin_turn(&user.id, &sess.id, "q").await.expect("turn");
    s.close().await;
}
