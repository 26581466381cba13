//! Rate limits kept in a real Redis (127.0.0.1:6379, or `TEST_REDIS_URL`) are shared by every
//! orchestrator that uses it.

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
        Limiter::Redis(connect().await),
        Limiter::Redis(connect().await),
    );
    let q = Quota {
        bucket: format!("test-{}", uuid::Uuid::new_v4().simple()),
        requests_per_minute: Some(3),
        tokens_per_day: Some(100),
    };
    assert!(a.admit(&q).await.is_ok());
    assert!(b.admit(&q).await.is_ok());
    assert!(a.admit(&q).await.is_ok());
    let e = b
        .admit(&q)
        .await
        .expect_err("the fourth request across both");
    assert!((1..=60).contains(&e.retry_after_secs), "{e:?}");

    let q = Quota {
        bucket: format!("test-{}", uuid::Uuid::new_v4().simple()),
        requests_per_minute: None,
        tokens_per_day: Some(100),
    };
    a.charge_tokens(&q, 60).await;
    assert!(b.admit(&q).await.is_ok());
    b.charge_tokens(&q, 40).await;
    let e = a.admit(&q).await.expect_err("budget used across both");
    assert!(e.what.contains("100"), "{e}");
}

#[tokio::test]
async fn an_unreachable_redis_is_a_clear_start_up_error() {
    let e = connect_redis("redis://127.0.0.1:1")
        .await
        .expect_err("nothing listens on port 1");
    assert!(!e.to_string().is_empty());
}
