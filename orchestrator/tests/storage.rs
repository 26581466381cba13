//! One storage suite, run against SQLite (a temporary file) and PostgreSQL (a fresh database on
//! `TEST_DATABASE_URL`, default the local server). A missing PostgreSQL fails the test.

use hearth_orchestrator::storage::{
    Completion, Finish, KeyId, MessageId, MessageStatus, NewApiKey, NewSession, ReplyTimings,
    ReplyUsage, Role, SessionId, SessionPatch, SessionQuery, SqlStore, Store, StoreError, UserId,
};

use hearth_e2e::pg::PgDatabase;

fn sqlite_url(tag: &str) -> (std::path::PathBuf, String) {
    let dir = std::env::temp_dir().join(format!(
        "hearth-storage-{tag}-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let url = format!("sqlite://{}?mode=rwc", dir.join("hearth.db").display());
    (dir, url)
}

/// Runs `suite` on both databases.
macro_rules! both {
    ($name:ident, $suite:ident) => {
        mod $name {
            use super::*;

            #[tokio::test]
            async fn sqlite() {
                let (dir, url) = sqlite_url(stringify!($name));
                let store = SqlStore::connect(&url).await.expect("sqlite");
                assert_eq!(store.backend(), "sqlite");
                $suite(&store).await;
                store.close().await;
                let _ = std::fs::remove_dir_all(dir);
            }

            #[tokio::test]
            async fn postgres() {
                let (db, url) = PgDatabase::create(stringify!($name)).await;
                let store = SqlStore::connect(&url).await.expect("postgres");
                assert_eq!(store.backend(), "postgres");
                $suite(&store).await;
                store.close().await;
                db.drop_db().await;
            }
        }
    };
}

both!(users_and_keys, users_and_keys_suite);
both!(sessions, sessions_suite);
both!(turns, turns_suite);
both!(isolation, isolation_suite);
both!(concurrency, concurrency_suite);
both!(search_and_values, search_and_values_suite);
both!(edit, edit_suite);

async fn users_and_keys_suite(s: &SqlStore) {
    let alice = s.create_user("alice").await.expect("alice");
    assert_eq!(
        s.create_user("alice").await,
        Err(StoreError::Conflict("user"))
    );
    assert_eq!(
        s.user_by_name("alice").await.expect("lookup"),
        Some(alice.clone())
    );
    assert_eq!(s.user_by_name("nobody").await.expect("lookup"), None);

    let key = s
        .insert_api_key(NewApiKey {
            user_id: alice.id.clone(),
            prefix: "hk_abcd1234".into(),
            key_hash: "f".repeat(64),
            requests_per_minute: Some(60),
            tokens_per_day: None,
            expires_at: Some(4_000_000_000_000),
        })
        .await
        .expect("key");
    let found = s
        .api_keys_by_prefix("hk_abcd1234")
        .await
        .expect("by prefix");
    assert_eq!(found, vec![(key.clone(), alice.clone())]);
    assert!(s
        .api_keys_by_prefix("hk_other")
        .await
        .expect("none")
        .is_empty());
    // The same hash twice is refused (a key is stored once).
    let dup = s
        .insert_api_key(NewApiKey {
            user_id: alice.id.clone(),
            prefix: "hk_abcd1234".into(),
            key_hash: "f".repeat(64),
            requests_per_minute: None,
            tokens_per_day: None,
            expires_at: None,
        })
        .await;
    assert_eq!(dup, Err(StoreError::Conflict("api key")));
    s.revoke_api_key(&key.id, 123).await.expect("revoke");
    s.revoke_api_key(&key.id, 456)
        .await
        .expect("revoke again keeps the first time");
    let found = s
        .api_keys_by_prefix("hk_abcd1234")
        .await
        .expect("by prefix");
    assert_eq!(found[0].0.revoked_at, Some(123));
    assert_eq!(
        s.revoke_api_key(&KeyId::random(), 1).await,
        Err(StoreError::NotFound("api key"))
    );
}

async fn sessions_suite(s: &SqlStore) {
    let u = s.create_user("u").await.expect("user").id;
    let mut ids = Vec::new();
    for i in 0..5 {
        let sess = s
            .create_session(
                &u,
                NewSession {
                    title: format!("Chat {i} about {}", if i % 2 == 0 { "Rust" } else { "tea" }),
                    system_prompt: (i == 0).then(|| "Be brief.".to_string()),
                    params: (i == 1).then(|| serde_json::json!({"temperature": 0.7})),
                    max_tokens: (i == 2).then_some(300),
                },
            )
            .await
            .expect("create");
        ids.push(sess.id);
        // Distinct update times, so the order is certain.
        tokio::time::sleep(std::time::Duration::from_millis(3)).await;
    }
    let all = s
        .list_sessions(
            &u,
            &SessionQuery {
                limit: 50,
                ..Default::default()
            },
        )
        .await
        .expect("list");
    let listed: Vec<_> = all.iter().map(|x| x.id.clone()).collect();
    let mut newest_first = ids.clone();
    newest_first.reverse();
    assert_eq!(listed, newest_first);
    assert_eq!(all[3].params, Some(serde_json::json!({"temperature": 0.7})));
    assert_eq!(all[4].system_prompt.as_deref(), Some("Be brief."));

    // Pages of two, by cursor.
    let mut paged = Vec::new();
    let mut before = None;
    loop {
        let page = s
            .list_sessions(
                &u,
                &SessionQuery {
                    q: None,
                    limit: 2,
                    before: before.clone(),
                },
            )
            .await
            .expect("page");
        if page.is_empty() {
            break;
        }
        let last = page.last().expect("last");
        before = Some((last.updated_at, last.id.clone()));
        paged.extend(page.into_iter().map(|x| x.id));
    }
    assert_eq!(paged, newest_first);

    // Search is case-insensitive and LIKE wildcards in the query are plain characters.
    let rust = s
        .list_sessions(
            &u,
            &SessionQuery {
                q: Some("RUST".into()),
                limit: 50,
                before: None,
            },
        )
        .await
        .expect("search");
    assert_eq!(rust.len(), 3);
    for q in ["%", "_", "\\"] {
        let none = s
            .list_sessions(
                &u,
                &SessionQuery {
                    q: Some(q.into()),
                    limit: 50,
                    before: None,
                },
            )
            .await
            .expect("search wildcard");
        assert!(none.is_empty(), "`{q}` matched {none:?}");
    }

    // Rename, clear the system prompt, then the session is the most recent.
    let patched = s
        .update_session(
            &u,
            &ids[0],
            SessionPatch {
                title: Some("Renamed".into()),
                system_prompt: Some(None),
                params: None,
                max_tokens: Some(Some(64)),
            },
        )
        .await
        .expect("patch");
    assert_eq!(patched.title, "Renamed");
    assert_eq!(patched.system_prompt, None);
    assert_eq!(patched.max_tokens, Some(64));
    assert_eq!(
        s.get_session(&u, &ids[0]).await.expect("get").max_tokens,
        Some(64)
    );
    let top = s
        .list_sessions(
            &u,
            &SessionQuery {
                limit: 1,
                ..Default::default()
            },
        )
        .await
        .expect("list");
    assert_eq!(top[0].id, ids[0]);
    // The default reply length set at creation is stored; a patch that leaves it out keeps it,
    // and an explicit `None` clears it.
    assert_eq!(
        s.get_session(&u, &ids[2]).await.expect("get").max_tokens,
        Some(300)
    );
    let kept = s
        .update_session(
            &u,
            &ids[2],
            SessionPatch {
                system_prompt: Some(Some("Be kind.".into())),
                ..Default::default()
            },
        )
        .await
        .expect("patch system prompt");
    assert_eq!(kept.max_tokens, Some(300));
    let cleared = s
        .update_session(
            &u,
            &ids[2],
            SessionPatch {
                max_tokens: Some(None),
                ..Default::default()
            },
        )
        .await
        .expect("clear max_tokens");
    assert_eq!(cleared.max_tokens, None);

    // Soft delete: gone from every query, and deleting again is NotFound.
    s.delete_session(&u, &ids[1]).await.expect("delete");
    assert_eq!(
        s.get_session(&u, &ids[1]).await,
        Err(StoreError::NotFound("session"))
    );
    assert_eq!(
        s.delete_session(&u, &ids[1]).await,
        Err(StoreError::NotFound("session"))
    );
    assert_eq!(
        s.list_messages(&u, &ids[1]).await,
        Err(StoreError::NotFound("session"))
    );
    let left = s
        .list_sessions(
            &u,
            &SessionQuery {
                limit: 50,
                ..Default::default()
            },
        )
        .await
        .expect("list");
    assert_eq!(left.len(), 4);
}

async fn turns_suite(s: &SqlStore) {
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
    s.save_progress(&t1.assistant.id, "Hi")
        .await
        .expect("progress");
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
    };
    s.finish_message(&t1.assistant.id, &done)
        .await
        .expect("finish");
    // Progress after the end changes nothing.
    s.save_progress(&t1.assistant.id, "late")
        .await
        .expect("late progress");
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

    // A second turn left streaming by a crash is marked error at the next start-up, text kept.
    let t2 = s
        .begin_turn(&u, &sess.id, "And then?")
        .await
        .expect("turn 2");
    assert_eq!(t2.user.seq, 3);
    s.save_progress(&t2.assistant.id, "Partial ans")
        .await
        .expect("progress");
    // The sweep lists it with the time of its last save, and fails it only if no save has
    // landed since (a save in between means a live orchestrator: left alone).
    let streaming = s.streaming_replies().await.expect("streaming");
    let seen = streaming
        .iter()
        .find(|(id, _)| *id == t2.assistant.id)
        .map(|&(_, at)| at)
        .expect("the reply is listed as streaming");
    assert!(
        !s.fail_interrupted(&t2.assistant.id, seen - 1)
            .await
            .expect("saved since"),
        "a reply saved after it was seen is left alone"
    );
    assert!(s
        .fail_interrupted(&t2.assistant.id, seen)
        .await
        .expect("recover"));
    let msgs = s.list_messages(&u, &sess.id).await.expect("messages");
    assert_eq!(msgs[3].status, MessageStatus::Error);
    assert_eq!(msgs[3].content, "Partial ans");
    assert_eq!(msgs[3].finish_reason, Some(Finish::Interrupted));
    assert!(
        !s.streaming_replies()
            .await
            .expect("streaming")
            .iter()
            .any(|(id, _)| *id == t2.assistant.id),
        "nothing left streaming"
    );
    assert!(!s
        .fail_interrupted(&t2.assistant.id, seen)
        .await
        .expect("already failed"));

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
    s.finish_message(&again.id, &done).await.expect("finish");

    // Unicode and a long message survive the round trip.
    let text = "Zürich 東京 🙂 ".repeat(2000);
    let t3 = s.begin_turn(&u, &sess.id, &text).await.expect("turn 3");
    let msgs = s.list_messages(&u, &sess.id).await.expect("messages");
    assert_eq!(
        msgs.iter().find(|m| m.id == t3.user.id).map(|m| &m.content),
        Some(&text)
    );
    assert_eq!(
        s.finish_message(&MessageId::random(), &done).await,
        Err(StoreError::NotFound("message"))
    );
}

async fn isolation_suite(s: &SqlStore) {
    let a = s.create_user("a").await.expect("a").id;
    let b = s.create_user("b").await.expect("b").id;
    let sess = s
        .create_session(
            &a,
            NewSession {
                title: "secret".into(),
                ..Default::default()
            },
        )
        .await
        .expect("session");
    let turn = s.begin_turn(&a, &sess.id, "mine").await.expect("turn");
    let nf: Result<(), StoreError> = Err(StoreError::NotFound("session"));
    assert_eq!(s.get_session(&b, &sess.id).await.map(|_| ()), nf);
    assert_eq!(
        s.get_message(&b, &sess.id, &turn.user.id).await.map(|_| ()),
        nf
    );
    let mine = s
        .get_message(&a, &sess.id, &turn.user.id)
        .await
        .expect("a's message");
    assert_eq!(
        (mine.id.as_str(), mine.content.as_str()),
        (turn.user.id.as_str(), "mine")
    );
    assert_eq!(
        s.get_message(&a, &sess.id, &MessageId::random())
            .await
            .map(|_| ()),
        Err(StoreError::NotFound("message"))
    );
    assert_eq!(s.list_messages(&b, &sess.id).await.map(|_| ()), nf);
    assert_eq!(s.begin_turn(&b, &sess.id, "x").await.map(|_| ()), nf);
    assert_eq!(s.begin_regenerate(&b, &sess.id, 1).await.map(|_| ()), nf);
    assert_eq!(
        s.update_session(
            &b,
            &sess.id,
            SessionPatch {
                title: Some("x".into()),
                ..Default::default()
            }
        )
        .await
        .map(|_| ()),
        nf
    );
    assert_eq!(s.delete_session(&b, &sess.id).await, nf);
    assert!(s
        .list_sessions(
            &b,
            &SessionQuery {
                q: Some("secret".into()),
                limit: 50,
                before: None
            }
        )
        .await
        .expect("b's list")
        .is_empty());
    // Nothing of b's attempts changed a's data.
    let msgs = s.list_messages(&a, &sess.id).await.expect("a's messages");
    assert_eq!(msgs.len(), 2);
    assert_eq!(
        s.get_session(&a, &sess.id).await.expect("a's").title,
        "secret"
    );
}

#[tokio::test]
async fn a_bad_database_url_is_a_clear_error() {
    let e = SqlStore::connect("mysql://localhost/x")
        .await
        .expect_err("unsupported");
    assert!(e.to_string().contains("postgres:// or sqlite:"), "{e}");
    let e = SqlStore::connect("postgres://postgres@127.0.0.1:1/none")
        .await
        .expect_err("nothing listens on port 1");
    assert!(matches!(e, StoreError::Unavailable(_)), "{e:?}");
}

async fn concurrency_suite(s: &SqlStore) {
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
        s.save_progress(&streaming.assistant.id, &"x".repeat(k))
            .await
            .expect("progress");
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
    s.finish_message(&msgs[1].id, &complete("ok"))
        .await
        .expect("finish");
    let next = s.begin_turn(&u, &one, "next").await.expect("next turn");
    assert_eq!((next.user.seq, next.assistant.seq), (3, 4));
}

async fn search_and_values_suite(s: &SqlStore) {
    let u = s.create_user("u").await.expect("user").id;
    for title in ["Épée lessons", "100% juice", "snake_case"] {
        s.create_session(
            &u,
            NewSession {
                title: title.into(),
                ..Default::default()
            },
        )
        .await
        .expect("session");
    }
    assert_eq!(find(s, &u, "ÉPÉE").await, vec!["Épée lessons"]);
    assert_eq!(find(s, &u, "épée").await, vec!["Épée lessons"]);
    assert_eq!(find(s, &u, "%").await, vec!["100% juice"]);
    assert_eq!(find(s, &u, "_").await, vec!["snake_case"]);
    assert!(find(s, &u, "a_e").await.is_empty(), "`_` is not a wildcard");

    // An expired key is still found (the authenticator refuses it), with its expiry.
    let key = s
        .insert_api_key(NewApiKey {
            user_id: u.clone(),
            prefix: "hk_expired".into(),
            key_hash: "e".repeat(64),
            requests_per_minute: None,
            tokens_per_day: None,
            expires_at: Some(1),
        })
        .await
        .expect("key");
    assert_eq!(
        s.api_keys_by_prefix("hk_expired").await.expect("found")[0].0,
        key
    );

    // Text PostgreSQL cannot store is a clear `Invalid`, not an internal error; SQLite keeps it.
    let nul = s
        .create_session(
            &u,
            NewSession {
                title: "a\0b".into(),
                ..Default::default()
            },
        )
        .await;
    match s.backend() {
        "postgres" => assert!(matches!(nul, Err(StoreError::Invalid(_))), "{nul:?}"),
        _ => assert!(nul.is_ok(), "{nul:?}"),
    }
}

async fn find(s: &SqlStore, user: &UserId, q: &str) -> Vec<String> {
    let query = SessionQuery {
        q: Some(q.into()),
        limit: 50,
        before: None,
    };
    let found = s.list_sessions(user, &query).await.expect("search");
    found.into_iter().map(|x| x.title).collect()
}

/// A finished reply, for building history.
fn complete(text: &str) -> Completion {
    Completion {
        content: text.into(),
        status: MessageStatus::Complete,
        finish_reason: Finish::Stop,
        usage: ReplyUsage {
            prompt_tokens: 10,
            cached_tokens: 0,
            completion_tokens: 3,
        },
        timings: ReplyTimings {
            ttft_ms: Some(5),
            duration_ms: 20,
        },
        worker: Some("w".into()),
    }
}

async fn edit_suite(s: &SqlStore) {
    let u = s.create_user("u").await.expect("user").id;
    let other = s.create_user("other").await.expect("other").id;
    let sess = s
        .create_session(&u, NewSession::default())
        .await
        .expect("session");
    let mut turns = Vec::new();
    for (q, a) in [("one?", "One."), ("two?", "Two."), ("three?", "Three.")] {
        let t = s.begin_turn(&u, &sess.id, q).await.expect("turn");
        s.finish_message(&t.assistant.id, &complete(a))
            .await
            .expect("finish");
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
    s.finish_message(&edited.assistant.id, &complete("Two again."))
        .await
        .expect("finish");
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
    s.finish_message(&first.assistant.id, &complete("Done."))
        .await
        .expect("finish");
    let next = s.begin_turn(&u, &sess.id, "more").await.expect("turn");
    assert_eq!(next.user.seq, 3);
}
