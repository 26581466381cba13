//! Rate limits kept in a real Redis (127.0.0.1:6379, or `TEST_REDIS_URL`) are shared by every
//! orchestrator that uses it.

use std::sync::Arc;

use hearth_orchestrator::limits::{connect_redis, Limiter, Quota};

fn redis_url() -> String {
    std::env::var("TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

#[tokio::test]
async fn two_replicas_share_request_and_token_counts() {
    let url = redis_url();
    let connect = || async {
        connect_redis(&url)
            .await
            .unwrap_or_else(|e| panic!("Redis at {url} is required for this test: {e}"))
    };
    let (a, b) = (
        Arc::new(Limiter::redis(connect().await)),
        Arc::new(Limiter::redis(connect().await)),
    );
    let q = Quota {
        bucket: format!("test-{}", uuid::Uuid::new_v4().simple()),
        requests_per_minute: Some(3),
        tokens_per_day: Some(100),
    };
    for (i, l) in [&a, &b, &a].into_iter().enumerate() {
        let budget = l
            .admit(&q, 1)
            .await
            .unwrap_or_else(|e| panic!("request {i}: {e}"));
        budget.expect("a budget").settle(0).await;
    }
    let e = b
        .admit(&q, 1)
        .await
        .expect_err("the fourth request across both");
    assert!((1..=60).contains(&e.retry_after_secs), "{e:?}");

    // Tokens set aside on one replica count on the other; settling charges what was used.
    let q = Quota {
        bucket: format!("test-{}", uuid::Uuid::new_v4().simple()),
        requests_per_minute: None,
        tokens_per_day: Some(100),
    };
    let on_a = a.admit(&q, 100).await.expect("a").expect("budget");
    b.admit(&q, 1)
        .await
        .expect_err("all 100 are set aside on a");
    on_a.settle(60).await;
    let on_b = b.admit(&q, 50).await.expect("40 left").expect("budget");
    on_b.settle(40).await;
    let e = a.admit(&q, 1).await.expect_err("budget used across both");
    assert!(e.what.contains("100"), "{e}");
}

#[tokio::test]
async fn an_unreachable_redis_is_a_clear_start_up_error() {
    let e = connect_redis("redis://127.0.0.1:1")
        .await
        .expect_err("nothing listens on port 1");
    assert!(!e.to_string().is_empty());
}
