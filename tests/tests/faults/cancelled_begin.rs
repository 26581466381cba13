//! A transaction whose caller goes away while PostgreSQL is slow to answer its `BEGIN` (a client
//! that disconnects during a network stall): the connection must not go back to the pool
//! inside a transaction nothing will end, where every later write would vanish uncommitted.

use std::time::Duration;

use hearth_e2e::pg::PgDatabase;
use hearth_e2e::proxy::Proxy;
use hearth_orchestrator::storage::{
    Accounts, NewSession, SessionId, Sessions, SqlStore, Transcript, UserId,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_begin_cancelled_mid_way_leaves_no_transaction_open() {
    let (db, url) = PgDatabase::create("cancelled_begin").await;
    let (host, name) = url.rsplit_once('/').expect("a database URL");
    let upstream = host
        .rsplit('@')
        .next()
        .and_then(|a| a.parse().ok())
        .expect("a loopback address");
    let proxy = Proxy::start(upstream).await;
    let store = SqlStore::connect(&format!("postgres://postgres@{}/{name}", proxy.addr))
        .await
        .expect("store");
    let user = store.create_user("alice").await.expect("user").id;
    let sid = store
        .create_session(&user, NewSession::default())
        .await
        .expect("session")
        .id;
    // Every pooled connection open (the pool keeps 16 at most).
    let warm: Vec<_> = (0..32)
        .map(|_| list(store.clone(), user.clone(), sid.clone()))
        .collect();
    for w in warm {
        w.await.expect("task").expect("listed");
    }
    // The link slows down (200 ms each way); readers give up after 50 ms to 1.6 s, so that
    // some do while their BEGIN is on the way; then the link is fast again.
    proxy.slow(Duration::from_millis(200));
    let cancelled: Vec<_> = (0..32)
        .map(|i| {
            let (s, u, id) = (store.clone(), user.clone(), sid.clone());
            tokio::spawn(async move {
                let patience = Duration::from_millis(50 * (i + 1));
                tokio::time::timeout(patience, s.list_messages(&u, &id)).await
            })
        })
        .collect();
    for c in cancelled {
        let _ = c.await.expect("task");
    }
    proxy.slow(Duration::ZERO);
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Writes on the pool's connections, then read on another connection: all committed.
    for i in 0..16 {
        store
            .create_session(
                &user,
                NewSession {
                    title: format!("after {i}"),
                    ..NewSession::default()
                },
            )
            .await
            .expect("a session after the stall");
    }
    let direct = SqlStore::connect(&url).await.expect("direct");
    assert_eq!(direct.count_sessions(&user).await.expect("count"), 17);
    direct.close().await;
    store.close().await;
    db.drop_db().await;
}

fn list(
    s: SqlStore,
    u: UserId,
    i: SessionId,
) -> tokio::task::JoinHandle<
    Result<Vec<hearth_orchestrator::storage::Message>, hearth_orchestrator::storage::StoreError>,
> {
    tokio::spawn(async move { s.list_messages(&u, &i).await })
}
