//! TLS to PostgreSQL and Redis, against servers of the test's own that speak TLS only, with a
//! certificate from the test's own authority: a client that verifies the server against that
//! authority connects, a plain one is refused, and one that trusts another authority is too.

use hearth_e2e::pg::PgServer;
use hearth_e2e::redis::RedisServer;
use hearth_e2e::tls::TestCa;
use hearth_orchestrator::limits::connect_redis;
use hearth_orchestrator::storage::{Accounts, SqlStore, Store};

#[tokio::test]
async fn postgres_over_tls_verifies_the_server() {
    let ca = TestCa::new("pg");
    let other = TestCa::new("pg-other");
    let pg = PgServer::start_tls("tls", &ca);
    let url = pg.url("postgres");
    let verified = format!("{url}?sslmode=verify-full&sslrootcert={}", ca.ca.display());
    let store = SqlStore::connect(&verified)
        .await
        .expect("a verified TLS connection");
    store.ping().await.expect("ping over TLS");
    store
        .create_user("over-tls")
        .await
        .expect("a write over TLS");
    store.close().await;

    let plain = SqlStore::connect(&format!("{url}?sslmode=disable")).await;
    assert!(plain.is_err(), "the server takes TLS connections only");
    let spoofed = format!(
        "{url}?sslmode=verify-full&sslrootcert={}",
        other.ca.display()
    );
    assert!(
        SqlStore::connect(&spoofed).await.is_err(),
        "a server certificate from an authority the client does not trust is refused"
    );
}

#[tokio::test]
async fn redis_over_tls_verifies_the_server() {
    let ca = TestCa::new("redis");
    let (_server, url) = RedisServer::start_tls(&ca);
    // Without the test's authority among its roots the client refuses the server.
    assert!(connect_redis(&url).await.is_err(), "an untrusted server");
    // The system's roots, extended the usual way for a private authority.
    std::env::set_var("SSL_CERT_FILE", &ca.ca);
    let redis = connect_redis(&url)
        .await
        .expect("a verified TLS connection");
    let pong: Option<String> = redis.cmd(&redis::cmd("PING"), "ping").await;
    assert_eq!(pong.as_deref(), Some("PONG"));
    let plain = connect_redis(&url.replacen("rediss://", "redis://", 1)).await;
    assert!(plain.is_err(), "the server speaks TLS only");
}
