//! Keys made with `hearth keys create` and its limit flags, checked where they matter: over
//! HTTP against a running server on the same PostgreSQL database.

use std::time::Duration;

use hearth_e2e::http::Reply;
use hearth_e2e::stack::{clear_of_a_minute_boundary, completion, hearth_bin, Db, Stack};
use hearth_orchestrator::storage::{now_ms, Accounts};
use serde_json::json;

/// `hearth --database-url <the stack's> keys …`; its stdout (the key) on success.
fn keys(s: &Stack, args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new(hearth_bin())
        .args(["--database-url", &s.db_url, "keys"])
        .args(args)
        .output()
        .expect("run hearth keys");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        Err(stderr)
    }
}

/// A completion of exactly `max_tokens` tokens, whatever the answer.
async fn ask(s: &Stack, key: &str, max_tokens: u32) -> Reply {
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": max_tokens, "ignore_eos": true});
    completion(s.addr(), key, &body).await
}

#[tokio::test]
async fn keys_created_with_limits_and_an_expiry_are_enforced_over_http() {
    let s = Stack::start("keyscli", Db::Postgres, 1, &[]).await;

    // --requests-per-minute 2: the third request in the minute is refused.
    let rpm = keys(
        &s,
        &["create", "--user", "carol", "--requests-per-minute", "2"],
    )
    .expect("key");
    clear_of_a_minute_boundary(Duration::from_secs(20)).await;
    for _ in 0..2 {
        let r = ask(&s, &rpm, 1).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let r = ask(&s, &rpm, 1).await;
    assert_eq!(r.status, 429, "{}", r.text());
    let message = r.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(message.contains("2 requests"), "{message}");

    // --tokens-per-day 6: two 4-token replies spend it (the second may overrun), the third is
    // refused until the next UTC day.
    let tpd = keys(&s, &["create", "--user", "dave", "--tokens-per-day", "6"]).expect("key");
    for _ in 0..2 {
        let r = ask(&s, &tpd, 4).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["usage"]["completion_tokens"], 4);
    }
    let r = ask(&s, &tpd, 4).await;
    assert_eq!(r.status, 429, "{}", r.text());
    let message = r.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(message.contains("daily limit of 6"), "{message}");
    let retry = r.retry_after_secs() as i64;
    let to_midnight = (86_400_000 - now_ms().rem_euclid(86_400_000)) / 1000;
    assert!(
        (retry - to_midnight).abs() <= 2,
        "{retry} s, {to_midnight} s to midnight"
    );
    // The other key's limits are its own.
    assert_eq!(ask(&s, &rpm, 1).await.status, 429);

    // --expires-in-days 1: valid now, stored to expire a day from now; once that time has
    // passed it is refused.
    let expiring = keys(&s, &["create", "--user", "erin", "--expires-in-days", "1"]).expect("key");
    assert_eq!(ask(&s, &expiring, 1).await.status, 200);
    let (record, _) = s
        .store
        .api_keys_by_prefix(&expiring[..11])
        .await
        .expect("store")
        .pop()
        .expect("the key");
    let expires = record.expires_at.expect("an expiry");
    assert!(
        (expires - (now_ms() + 86_400_000)).abs() < 60_000,
        "expires at {expires}"
    );
    sqlx::any::install_default_drivers();
    let db = sqlx::AnyPool::connect(&s.db_url).await.expect("database");
    sqlx::query("UPDATE api_keys SET expires_at = $1 WHERE id = $2")
        .bind(now_ms() - 1)
        .bind(&record.id)
        .execute(&db)
        .await
        .expect("age the key");
    db.close().await;
    let r = ask(&s, &expiring, 1).await;
    assert_eq!(r.status, 401, "{}", r.text());

    // Revoked by its prefix: refused from then on.
    keys(&s, &["revoke", "--prefix", &rpm[..11]]).expect("revoke");
    assert_eq!(ask(&s, &rpm, 1).await.status, 401);

    // Bad flags are refused with the flag named.
    let err = keys(&s, &["create", "--user", "", "--tokens-per-day", "5"]).expect_err("empty user");
    assert!(err.contains("--user"), "{err}");
    let err = keys(
        &s,
        &["create", "--user", "x", "--requests-per-minute", "lots"],
    )
    .expect_err("not a number");
    assert!(err.contains("--requests-per-minute"), "{err}");
    s.finish().await;
}
