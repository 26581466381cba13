//! The contract every answer to a malformed request must meet ([`check`]): a 4xx of the
//! expected family with the API's JSON error body; and what must not change, snapshotted before
//! and after ([`snapshot`], [`diff`]).

use std::net::SocketAddr;

use hearth_e2e::http::{Reply, Req};
use serde_json::{json, Value};

use super::case::{trim, trim_to, Case};

/// What must not change: the caller's sessions, the used session and its messages, and another
/// user's session and messages.
pub(crate) async fn snapshot(
    addr: SocketAddr,
    key: &str,
    sid: &str,
    foreign_key: &str,
    foreign_sid: &str,
) -> Value {
    let get = |path: String, key: String| async move {
        let r = Req::new("GET", &path).key(Some(&key)).send(addr).await;
        assert_eq!(r.status, 200, "GET {path}: {}", r.text());
        r.json()
    };
    let sessions = get("/v1/sessions?limit=100".into(), key.into()).await;
    let session = get(format!("/v1/sessions/{sid}"), key.into()).await;
    let messages = get(format!("/v1/sessions/{sid}/messages"), key.into()).await;
    let foreign_sessions = get("/v1/sessions?limit=100".into(), foreign_key.into()).await;
    let foreign_messages = get(
        format!("/v1/sessions/{foreign_sid}/messages"),
        foreign_key.into(),
    )
    .await;
    json!({
        "sessions": sessions,
        "session": session,
        "messages": messages,
        "foreign_sessions": foreign_sessions,
        "foreign_messages": foreign_messages,
    })
}

/// The parts of two snapshots that differ, briefly.
pub(crate) fn diff(before: &Value, after: &Value) -> String {
    let (Some(b), Some(a)) = (before.as_object(), after.as_object()) else {
        return format!("{before} -> {after}");
    };
    b.iter()
        .filter(|(k, v)| a.get(*k) != Some(*v))
        .map(|(k, v)| {
            let then = v.to_string();
            let now = a.get(k).map(Value::to_string).unwrap_or_default();
            format!("\n  {k}: {} -> {}", trim_to(&then, 600), trim_to(&now, 600))
        })
        .collect()
}

/// Why an answer does not meet the contract, if it does not.
pub(crate) fn check(c: &Case, a: &Reply) -> Option<String> {
    let body = String::from_utf8_lossy(&a.body);
    let shown = trim(&body);
    if !(400..500).contains(&a.status) {
        return Some(format!("status {} (not a 4xx): {shown}", a.status));
    }
    if !c.expect.contains(&a.status) {
        return Some(format!(
            "status {}, expected {:?}: {shown}",
            a.status, c.expect
        ));
    }
    if !a
        .header("content-type")
        .is_some_and(|t| t.starts_with("application/json"))
    {
        return Some(format!(
            "status {} with Content-Type {:?}: {shown}",
            a.status,
            a.header("content-type")
        ));
    }
    let v: Value = match serde_json::from_slice(&a.body) {
        Ok(v) => v,
        Err(e) => {
            return Some(format!(
                "status {}, body is not JSON ({e}): {shown}",
                a.status
            ))
        }
    };
    let message = v["error"]["message"].as_str();
    if message.is_none_or(str::is_empty) || !v["error"]["type"].is_string() {
        return Some(format!(
            "status {}, not an API error body: {shown}",
            a.status
        ));
    }
    None
}
