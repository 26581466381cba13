//! Sessions: create, page, update, delete, and search titles with LIKE's wildcards escaped.

use super::*;
use hearth_orchestrator::storage::{Accounts, Sessions, Transcript};

pub(crate) async fn sessions_suite(s: &SqlStore) {
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
                    model: (i == 3).then(|| "tiny".to_string()),
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
    assert_eq!(all[1].model.as_deref(), Some("tiny"));
    assert_eq!(all[0].model, None);

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
                model: Some(Some("gemma".into())),
            },
        )
        .await
        .expect("patch");
    assert_eq!(patched.title, "Renamed");
    assert_eq!(patched.system_prompt, None);
    assert_eq!(patched.max_tokens, Some(64));
    assert_eq!(patched.model.as_deref(), Some("gemma"));
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
    let unpinned = s
        .update_session(
            &u,
            &ids[3],
            SessionPatch {
                model: Some(None),
                ..Default::default()
            },
        )
        .await
        .expect("clear model");
    assert_eq!(unpinned.model, None);

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

pub(crate) async fn search_and_values_suite(s: &SqlStore) {
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
            role: KeyRole::User,
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
