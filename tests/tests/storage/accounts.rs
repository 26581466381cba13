//! Users and API keys, and isolation: another user's session and messages are not found.

use super::*;
use hearth_orchestrator::storage::{Accounts, Sessions, Transcript};

pub(crate) async fn users_and_keys_suite(s: &SqlStore) {
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
    // Replicas starting at once all get the one local user.
    assert_eq!(s.ensure_user("alice").await.expect("ensure"), alice);
    let starting: Vec<_> = (0..8)
        .map(|_| {
            let s = s.clone();
            tokio::spawn(async move { s.ensure_user("local").await })
        })
        .collect();
    let mut locals = Vec::new();
    for t in starting {
        locals.push(t.await.expect("task").expect("ensure"));
    }
    assert!(locals.iter().all(|u| *u == locals[0]), "{locals:?}");

    let key = s
        .insert_api_key(NewApiKey {
            user_id: alice.id.clone(),
            prefix: "hk_abcd1234".into(),
            key_hash: "f".repeat(64),
            requests_per_minute: Some(60),
            tokens_per_day: None,
            expires_at: Some(4_000_000_000_000),
            role: KeyRole::Admin,
        })
        .await
        .expect("key");
    let found = s
        .api_keys_by_prefix("hk_abcd1234")
        .await
        .expect("by prefix");
    assert_eq!(found, vec![(key.clone(), alice.clone())]);
    assert_eq!(
        found[0].0.role,
        KeyRole::Admin,
        "an admin key reads back as one"
    );
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
            role: KeyRole::User,
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

pub(crate) async fn isolation_suite(s: &SqlStore) {
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
