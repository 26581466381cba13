//! Malformed requests over the HTTP API of a real stack, generated from the tests' seeded
//! deterministic RNG (`hearth_e2e::rng`; `HEARTH_TEST_SEED` replays another seed): broken and
//! wrongly typed JSON, unknown fields, out-of-range, NaN and huge numbers, huge strings and
//! bodies, invalid UTF-8, ids that are not ids, wrong methods and routes, and header abuse (wrong
//! or missing `Content-Type`, garbage `Authorization`, long header values).
//!
//! Every answer must be a 4xx of the expected family with the API's JSON error body, none may
//! hang, and none may change what is stored: the caller's sessions and messages (and another
//! user's) are snapshotted before and after and must be identical. Requests go over raw sockets so
//! the test controls every byte and header. Each kind of malformed request is its own test, on its
//! own stack, so a failure names its kind.
//!
//! Here: the tests and the [`probe`] each runs. [`case`] is the request model, [`generate`] makes
//! one request of a kind from the parts in [`bodies`], [`ranges`] and [`envelope`], and
//! [`contract`] judges the answers.

mod bodies;
mod case;
mod contract;
mod envelope;
mod generate;
mod ranges;

use hearth_e2e::http::Req;
use hearth_e2e::rng::{self, Rng};
use hearth_e2e::stack::{json_turn, new_session_with, Db, Stack};
use hearth_orchestrator::storage::{now_ms, Accounts};
use serde_json::json;

use case::{Case, Ctx};
use contract::{check, diff, snapshot};
use generate::{generate, pinned, Family};

/// Sends `n` generated requests of `family` (and, with `pinned`, the requests of [`pinned`]) to
/// a fresh stack, and checks that each gets its documented JSON 4xx, that what is stored is
/// unchanged, and that the server is still ready.
async fn probe(tag: &str, family: Family, n: usize, with_pinned: bool) {
    let s = Stack::start(tag, Db::Postgres, 1, &[]).await;
    let key = s.key("prober").await;
    let foreign_key = s.key("alice").await;
    // A key that existed and was revoked.
    let revoked = s.key("prober").await;
    let rows = s
        .store
        .api_keys_by_prefix(&revoked[..11])
        .await
        .expect("keys");
    let (record, _) = rows.first().expect("the new key");
    s.store
        .revoke_api_key(&record.id, now_ms())
        .await
        .expect("revoke");
    let addr = s.addr();

    // The caller's session with one finished turn, and another user's.
    let mut sids = Vec::new();
    for k in [&key, &foreign_key] {
        let body = json!({"title": "kept", "params": {"temperature": 0.5}});
        let sid = new_session_with(addr, k, &body).await;
        json_turn(addr, k, &sid, "Hello", 6).await;
        sids.push(sid);
    }
    let ctx = Ctx {
        key: key.clone(),
        sid: sids[0].clone(),
        foreign_sid: sids[1].clone(),
        revoked,
    };
    let before = snapshot(addr, &key, &ctx.sid, &foreign_key, &ctx.foreign_sid).await;

    let mut rng = Rng::for_stream(family as u64);
    let seed = rng::seed();
    let mut cases: Vec<Case> = (0..n).map(|_| generate(&mut rng, &ctx, family)).collect();
    if with_pinned {
        // Last, so that one getting through cannot disturb the generated ones.
        cases.extend(pinned(&ctx));
    }
    let started = std::time::Instant::now();
    let mut failures = Vec::new();
    let mut seen = std::collections::BTreeMap::<u16, usize>::new();
    for (i, c) in cases.iter().enumerate() {
        match c.send(addr).await {
            Ok(a) => {
                *seen.entry(a.status).or_default() += 1;
                if let Some(why) = check(c, &a) {
                    failures.push(format!("#{i} {}: {why}", c.label));
                }
            }
            Err(e) => failures.push(format!("#{i} {}: {e}", c.label)),
        }
    }
    let took = started.elapsed();
    let n = cases.len();
    eprintln!(
        "{n} malformed requests ({family:?}, seed {seed:#x}) in {took:.1?}: statuses {seen:?}"
    );

    let after = snapshot(addr, &key, &ctx.sid, &foreign_key, &ctx.foreign_sid).await;
    let ready = Req::new("GET", "/readyz").send(addr).await.status;
    // Drop the test database before judging, so a failure leaves nothing behind.
    s.finish().await;
    let changed = before != after;
    assert!(
        failures.is_empty() && !changed,
        "{} of {n} requests ({family:?}, seed {seed:#x}) broke the contract:\n{}\n{}",
        failures.len(),
        failures.join("\n"),
        if changed {
            format!("and what is stored changed: {}", diff(&before, &after))
        } else {
            "what is stored did not change".to_string()
        }
    );
    assert_eq!(
        ready, 200,
        "the server is not ready after the malformed requests"
    );
}

#[tokio::test]
async fn bodies_that_are_not_json_get_400_or_422() {
    probe("bad_notjson", Family::NotJson, 60, false).await;
}

#[tokio::test]
async fn json_of_the_wrong_shape_gets_422() {
    probe("bad_shape", Family::WrongShape, 60, false).await;
}

#[tokio::test]
async fn unknown_fields_get_422_on_the_native_routes() {
    probe("bad_unknown", Family::UnknownField, 32, false).await;
}

#[tokio::test]
async fn values_out_of_range_get_422() {
    probe("bad_range", Family::OutOfRange, 80, false).await;
}

#[tokio::test]
async fn bodies_over_the_limit_get_413() {
    probe("bad_large", Family::TooLarge, 16, false).await;
}

#[tokio::test]
async fn ids_that_are_not_ids_get_404_on_every_route() {
    probe("bad_id", Family::BadId, 48, false).await;
}

#[tokio::test]
async fn wrong_methods_and_unknown_routes_get_405_or_404() {
    probe("bad_route", Family::WrongRoute, 24, false).await;
}

#[tokio::test]
async fn garbage_authorization_gets_401() {
    probe("bad_auth", Family::BadAuth, 32, false).await;
}

#[tokio::test]
async fn a_wrong_or_missing_content_type_gets_415() {
    probe("bad_ctype", Family::BadContentType, 24, false).await;
}

#[tokio::test]
async fn bad_session_list_queries_get_422() {
    probe("bad_query", Family::BadQuery, 16, false).await;
}

#[tokio::test]
async fn long_headers_and_what_lenient_parsers_take_are_refused_as_json() {
    probe("bad_headers", Family::LongHeaders, 8, true).await;
}

/// A body too large is answered 413 from its header, before it is read; a client still sending
/// it, as clients do (the whole body, then the answer), must get that answer and not a reset
/// connection. Here the body follows its header only once the server has answered.
#[tokio::test]
async fn a_body_answered_before_it_is_read_still_gets_its_answer() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = Stack::start("bad_linger", Db::Sqlite, 1, &[]).await;
    let key = s.key("prober").await;
    let sid = new_session_with(s.addr(), &key, &json!({})).await;
    let body = vec![b'x'; 4 * case::BODY_LIMIT];
    for _ in 0..3 {
        let mut c = tokio::net::TcpStream::connect(s.addr())
            .await
            .expect("connect");
        let head = format!(
            "POST /v1/sessions/{sid}/messages HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer \
             {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            s.addr(),
            body.len()
        );
        c.write_all(head.as_bytes())
            .await
            .expect("write the header");
        // The server answers and closes its side meanwhile.
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        c.write_all(&body)
            .await
            .expect("the body goes out after the answer");
        let mut answer = Vec::new();
        c.read_to_end(&mut answer).await.expect("the answer");
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
        assert!(answer.contains("body_too_large"), "{answer}");
    }
    s.finish().await;
}
