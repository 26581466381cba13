//! `hearth keys …` on a real database, and the keys it prints checked by the authenticator.

use std::process::Command;

use hearth_orchestrator::auth::{authenticate, issue_key, AuthError, KeyOptions};
use hearth_orchestrator::storage::SqlStore;

fn hearth(data_dir: &std::path::Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_hearth"))
        .args(args)
        .env_remove("HEARTH_DATABASE_URL")
        .env("HEARTH_DATA_DIR", data_dir)
        .output()
        .expect("run hearth");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn created_keys_authenticate_until_revoked_and_wrong_keys_never_do() {
    let dir = std::env::temp_dir().join(format!(
        "hearth-keys-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    let (ok, key, err) = hearth(&dir, &["keys", "create", "--user", "alice"]);
    assert!(ok, "{err}");
    assert!(key.starts_with("hk_") && key.len() == 67, "{key}");
    assert!(
        err.contains(&key[..11]) && !err.contains(&key),
        "the key goes to stdout only: {err}"
    );
    let (ok, other, _) = hearth(
        &dir,
        &[
            "keys",
            "create",
            "--user",
            "alice",
            "--expires-in-days",
            "1",
        ],
    );
    assert!(ok);
    assert_ne!(key, other);

    let url = format!("sqlite://{}?mode=rwc", dir.join("hearth.db").display());
    let store = SqlStore::connect(&url)
        .await
        .expect("open the same database");
    let caller = authenticate(&store, &key).await.expect("valid key");
    assert_eq!(caller.user.name, "alice");
    assert_eq!(
        authenticate(&store, &other)
            .await
            .expect("second key")
            .user
            .id,
        caller.user.id
    );

    // Wrong, truncated, altered and malformed keys are all the same error.
    let mut altered = key.clone().into_bytes();
    altered[40] = if altered[40] == b'a' { b'b' } else { b'a' };
    let altered = String::from_utf8(altered).expect("ascii");
    for bad in [
        &altered[..],
        &key[..66],
        "",
        "hk_",
        "Bearer x",
        &key.to_uppercase(),
        "hk_zz",
    ] {
        assert_eq!(
            authenticate(&store, bad).await,
            Err(AuthError::InvalidKey),
            "{bad:?}"
        );
    }

    let (ok, _, err) = hearth(&dir, &["keys", "revoke", "--prefix", &key[..11]]);
    assert!(ok, "{err}");
    assert_eq!(authenticate(&store, &key).await, Err(AuthError::InvalidKey));
    assert!(
        authenticate(&store, &other).await.is_ok(),
        "only the one key is revoked"
    );

    let (ok, _, err) = hearth(&dir, &["keys", "revoke", "--prefix", "hk_00000000"]);
    assert!(!ok && err.contains("--prefix"), "{err}");
    let (ok, _, err) = hearth(&dir, &["keys", "create", "--user", ""]);
    assert!(!ok && err.contains("--user"), "{err}");
    // Without auth the server refuses any address but loopback.
    let (ok, _, err) = hearth(&dir, &["--listen", "0.0.0.0:0"]);
    assert!(!ok && err.contains("non-loopback"), "{err}");
    // A whole key names exactly one key, even where prefixes collide.
    let third = issue_key(&store, "carol", KeyOptions::default())
        .await
        .expect("key");
    let (ok, _, err) = hearth(&dir, &["keys", "revoke", "--prefix", &third.key]);
    assert!(ok, "{err}");
    assert_eq!(
        authenticate(&store, &third.key).await,
        Err(AuthError::InvalidKey)
    );
    // An expired key is refused like an unknown one.
    let expired = issue_key(
        &store,
        "alice",
        KeyOptions {
            expires_at: Some(1),
            ..KeyOptions::default()
        },
    )
    .await
    .expect("expired key");
    assert_eq!(
        authenticate(&store, &expired.key).await,
        Err(AuthError::InvalidKey)
    );
    store.close().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// A thousand requests presenting one key at once all get its owner, from shared lookups;
/// what is shared is only a lookup in flight, so the key, once revoked, is refused by the next
/// request, and a wrong key presented beside a good one shares nothing with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_checks_of_one_key_share_a_lookup_and_never_outlive_a_revocation() {
    use hearth_orchestrator::auth::KeyChecks;
    use hearth_orchestrator::storage::{now_ms, Accounts};
    use std::sync::Arc;
    let dir = std::env::temp_dir().join(format!(
        "hearth-keychecks-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir).expect("dir");
    let url = format!("sqlite://{}?mode=rwc", dir.join("hearth.db").display());
    let store = Arc::new(SqlStore::connect(&url).await.expect("store"));
    let issued = issue_key(store.as_ref(), "alice", KeyOptions::default())
        .await
        .expect("key");
    let checks = Arc::new(KeyChecks::default());
    let mut tasks = Vec::new();
    for i in 0..1000 {
        let (checks, store, key) = (checks.clone(), store.clone(), issued.key.clone());
        let wrong = format!("hk_{}", "0".repeat(64));
        tasks.push(tokio::spawn(async move {
            let presented = if i % 100 == 7 { wrong } else { key };
            checks.authenticate(store.as_ref(), &presented).await
        }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        let r = t.await.expect("task");
        if i % 100 == 7 {
            assert_eq!(r, Err(AuthError::InvalidKey));
        } else {
            assert_eq!(r.expect("alice").user.name, "alice");
        }
    }
    store
        .revoke_api_key(&issued.record.id, now_ms())
        .await
        .expect("revoke");
    assert_eq!(
        checks.authenticate(store.as_ref(), &issued.key).await,
        Err(AuthError::InvalidKey)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
