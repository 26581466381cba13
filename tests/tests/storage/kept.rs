//! Kept responses: begun with their input items in one transaction, read by their user only,
//! continued only from a session's last message, copied into a fork, and gone with their
//! session or with a regenerate that drops their reply.

use super::*;
use hearth_orchestrator::storage::{
    Accounts, NewItem, NewResponse, Responses, Sessions, Transcript,
};

fn item(role: Role, content: &str) -> NewItem {
    NewItem {
        role,
        content: content.into(),
        tool_calls: None,
        tool_call_id: None,
    }
}

fn response(items: Vec<NewItem>, previous: Option<MessageId>) -> NewResponse {
    NewResponse {
        items,
        system_prompt: Some("Be brief.".into()),
        model: Some("tiny".into()),
        previous,
        request: r#"{"metadata":{}}"#.into(),
    }
}

pub(crate) async fn responses_suite(s: &SqlStore) {
    let u = s.create_user("u").await.expect("user").id;
    let other = s.create_user("other").await.expect("other").id;
    let sid = s
        .create_session(&u, NewSession::default())
        .await
        .expect("session")
        .id;
    let call = ToolCall {
        id: "call_1".into(),
        kind: "function".into(),
        function: FunctionCall {
            name: "now".into(),
            arguments: "{}".into(),
        },
    };
    let items = vec![
        item(Role::User, "What time is it?"),
        NewItem {
            tool_calls: Some(vec![call.clone()]),
            ..item(Role::Assistant, r#"{"name": "now"}"#)
        },
        NewItem {
            tool_call_id: Some("call_1".into()),
            ..item(Role::Tool, "noon")
        },
    ];
    let first = s
        .begin_response(&u, &sid, &response(items, None))
        .await
        .expect("begin");
    assert_eq!(first.status, MessageStatus::Streaming);
    let session = s.get_session(&u, &sid).await.expect("session");
    assert_eq!(session.system_prompt.as_deref(), Some("Be brief."));
    assert_eq!(session.model.as_deref(), Some("tiny"));
    let kept = s.get_response(&u, &first.id).await.expect("kept");
    assert_eq!((kept.session_id.clone(), kept.first_seq), (sid.clone(), 1));
    assert_eq!(kept.reply.seq, 4);
    assert_eq!(kept.request, r#"{"metadata":{}}"#);
    let history = s.list_messages(&u, &sid).await.expect("history");
    assert_eq!(history[1].tool_calls.as_deref(), Some(&[call][..]));
    assert_eq!(history[2].tool_call_id.as_deref(), Some("call_1"));
    let missing = s.get_response(&other, &first.id).await;
    assert_eq!(missing, Err(StoreError::NotFound("response")));

    // Continued while the reply streams: refused; once it ended, from it only.
    let more = response(vec![item(Role::User, "And now?")], Some(first.id.clone()));
    let busy = s.begin_response(&u, &sid, &more).await;
    assert_eq!(busy, Err(StoreError::ReplyRunning));
    finish(s, &first.id, &complete("It is noon.")).await;
    let second = s.begin_response(&u, &sid, &more).await.expect("continued");
    finish(s, &second.id, &complete("Still noon.")).await;
    let again = s.begin_response(&u, &sid, &more).await;
    assert!(
        matches!(again, Err(StoreError::Conflict(_))),
        "the first is no longer last: {again:?}"
    );
    assert_eq!(
        s.get_response(&u, &second.id)
            .await
            .expect("second")
            .first_seq,
        5
    );

    // A fork holds the history up to the first reply, under new ids.
    let fork = s.fork_session(&u, &sid, first.seq).await.expect("fork");
    let copied = s.list_messages(&u, &fork.id).await.expect("copied");
    let original = s.list_messages(&u, &sid).await.expect("original");
    assert_eq!(copied.len(), 4);
    for (c, o) in copied.iter().zip(&original) {
        assert_eq!(
            (c.seq, c.role, &c.content, &c.tool_calls),
            (o.seq, o.role, &o.content, &o.tool_calls)
        );
        assert_ne!(c.id, o.id);
    }
    assert_eq!(
        s.fork_session(&other, &sid, 4).await.err(),
        Some(StoreError::NotFound("session"))
    );

    // A regenerate that drops the second reply drops its response.
    let replaced = s
        .begin_regenerate(&u, &sid, second.seq)
        .await
        .expect("regenerate");
    finish(s, &replaced.id, &complete("Noon.")).await;
    assert_eq!(
        s.get_response(&u, &second.id).await.err(),
        Some(StoreError::NotFound("response"))
    );

    // Deleting the last response of a session deletes the session.
    let gone = s.delete_response(&u, &first.id).await.expect("delete");
    assert_eq!(gone, Some(sid.clone()), "its session went with it");
    assert_eq!(
        s.get_session(&u, &sid).await.err(),
        Some(StoreError::NotFound("session"))
    );
    assert_eq!(
        s.delete_response(&u, &first.id).await,
        Err(StoreError::NotFound("response"))
    );
    let later = hearth_orchestrator::storage::now_ms() + 1_000;
    let (sessions, messages) = s.purge_deleted(later).await.expect("purge");
    assert_eq!((sessions, messages), (1, 6));
}
