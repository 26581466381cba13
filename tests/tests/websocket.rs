//! A session over a WebSocket, through the whole stack: turns, regenerate, edit and stop as
//! commands, the reply's events as the SSE stream has them (ids included), resuming after a
//! reconnect from an event id, the key as a subprotocol, and refusals that leave the socket open
//! and store nothing; a key's sockets are capped, and closed once it is revoked or once their
//! client stops reading.

use std::net::SocketAddr;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use hearth_e2e::stack::{history, new_session, slow_spec, stream_turn, Db, Stack};
use hearth_worker::fixtures::TinySpec;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Opens the session's socket with the key as a bearer header, or as a subprotocol.
async fn open(addr: SocketAddr, sid: &str, key: &str, as_protocol: bool) -> Socket {
    let mut req = format!("ws://{addr}/v1/sessions/{sid}/ws")
        .into_client_request()
        .expect("request");
    let h = req.headers_mut();
    if as_protocol {
        let p = format!("hearth.v1, hearth.key.{key}");
        h.insert(
            "sec-websocket-protocol",
            HeaderValue::from_str(&p).expect("header"),
        );
    } else {
        let b = format!("Bearer {key}");
        h.insert("authorization", HeaderValue::from_str(&b).expect("header"));
    }
    let (ws, resp) = tokio_tungstenite::connect_async(req)
        .await
        .expect("upgrade");
    if as_protocol {
        assert_eq!(
            resp.headers()
                .get("sec-websocket-protocol")
                .map(|v| v.as_bytes()),
            Some(&b"hearth.v1"[..])
        );
    }
    ws
}

async fn send(ws: &mut Socket, v: Value) {
    ws.send(Message::Text(v.to_string().into()))
        .await
        .expect("send");
}

/// The next JSON message (pings are answered by the client itself).
async fn next(ws: &mut Socket) -> Value {
    loop {
        let m = tokio::time::timeout(Duration::from_secs(30), ws.next())
            .await
            .expect("a message within 30 s")
            .expect("open")
            .expect("message");
        if let Message::Text(t) = m {
            return serde_json::from_str(t.as_str()).expect("JSON");
        }
    }
}

/// Messages up to and including the reply's end (`message_end` or `error`).
async fn until_end(ws: &mut Socket) -> Vec<Value> {
    let mut out = Vec::new();
    loop {
        let v = next(ws).await;
        let end = v["event"] == "message_end" || v["event"] == "error";
        out.push(v);
        if end {
            return out;
        }
    }
}

fn tokens(events: &[Value]) -> String {
    events
        .iter()
        .filter(|e| e["event"] == "token")
        .map(|e| e["data"]["text"].as_str().expect("text"))
        .collect()
}

/// The `n` of an event id `<message id>:<n>`.
fn seq(e: &Value) -> usize {
    let id = e["id"].as_str().expect("id");
    id.rsplit_once(':').expect(":").1.parse().expect("n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_runs_over_a_websocket_and_resumes_after_a_reconnect() {
    let s = Stack::start("websocket", Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let mut ws = open(s.addr(), &sid, &k, false).await;

    send(
        &mut ws,
        json!({"type": "message", "content": "Hello", "max_tokens": 6}),
    )
    .await;
    let events = until_end(&mut ws).await;
    assert_eq!(events[0]["event"], "message_start", "{events:?}");
    let mid = events[0]["data"]["message_id"]
        .as_str()
        .expect("id")
        .to_string();
    let ns: Vec<usize> = events.iter().map(seq).collect();
    assert_eq!(ns, (1..=events.len()).collect::<Vec<_>>(), "ids in order");
    assert!(events
        .iter()
        .all(|e| e["id"].as_str().expect("id").starts_with(&mid)));
    let end = events.last().expect("end");
    assert_eq!(end["event"], "message_end");
    assert_eq!(end["data"]["usage"]["completion_tokens"], 6);
    let stored = history(s.addr(), &k, &sid).await;
    assert_eq!(stored.len(), 2);
    assert_eq!(stored[1]["content"], tokens(&events).as_str());

    // Regenerate and edit, as commands.
    send(&mut ws, json!({"type": "regenerate", "max_tokens": 3})).await;
    let again = until_end(&mut ws).await;
    assert_eq!(
        again.last().expect("end")["data"]["usage"]["completion_tokens"],
        3
    );
    let user_id = stored[0]["id"].as_str().expect("id");
    send(
        &mut ws,
        json!({"type": "edit", "message_id": user_id, "content": "Hi again", "max_tokens": 2}),
    )
    .await;
    until_end(&mut ws).await;
    let stored = history(s.addr(), &k, &sid).await;
    assert_eq!(stored[0]["content"], "Hi again");
    assert_eq!(stored.len(), 2);
    drop(ws);

    // Another socket, the key as a subprotocol: the last reply from after its second event.
    let mut ws = open(s.addr(), &sid, &k, true).await;
    send(
        &mut ws,
        json!({"type": "message", "content": "More", "max_tokens": 5}),
    )
    .await;
    let whole = until_end(&mut ws).await;
    let last_id = whole[1]["id"].as_str().expect("id").to_string();
    drop(ws);
    let mut ws = open(s.addr(), &sid, &k, true).await;
    send(&mut ws, json!({"type": "resume", "last_event_id": last_id})).await;
    let rest = until_end(&mut ws).await;
    assert_eq!(
        rest,
        whole[2..].to_vec(),
        "the events after the last one seen, once each"
    );
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_and_refusals_keep_the_socket_open_and_store_nothing_wrong() {
    let s = Stack::start_with("websocket_stop", &slow_spec(), Db::Sqlite, 1, &[]).await;
    let (k, other) = (s.key("alice").await, s.key("bob").await);
    let sid = new_session(s.addr(), &k).await;

    // No key, a wrong key, another user's session: no socket.
    let url = format!("ws://{}/v1/sessions/{sid}/ws", s.addr());
    let no_key = tokio_tungstenite::connect_async(url.as_str()).await;
    assert!(
        matches!(&no_key, Err(tokio_tungstenite::tungstenite::Error::Http(r)) if r.status() == 401),
        "{no_key:?}"
    );
    let mut req = url.as_str().into_client_request().expect("request");
    let b = HeaderValue::from_str(&format!("Bearer {other}")).expect("header");
    req.headers_mut().insert("authorization", b);
    let theirs = tokio_tungstenite::connect_async(req).await;
    assert!(
        matches!(&theirs, Err(tokio_tungstenite::tungstenite::Error::Http(r)) if r.status() == 404),
        "{theirs:?}"
    );

    let mut ws = open(s.addr(), &sid, &k, false).await;
    for (command, status, says) in [
        (Message::Text("{".into()), 400, "not JSON"),
        (Message::Binary(vec![1, 2].into()), 400, "JSON text"),
        (
            Message::Text(json!({"type": "dance"}).to_string().into()),
            422,
            "`dance`",
        ),
        (
            Message::Text(json!({"content": "x"}).to_string().into()),
            422,
            "type: required",
        ),
        (
            Message::Text(
                json!({"type": "message", "content": " "})
                    .to_string()
                    .into(),
            ),
            422,
            "content: must not be empty",
        ),
        (
            Message::Text(
                json!({"type": "message", "content": "x", "stream": false})
                    .to_string()
                    .into(),
            ),
            422,
            "always stream",
        ),
        (
            Message::Text(
                json!({"type": "message", "contnet": "x"})
                    .to_string()
                    .into(),
            ),
            422,
            "contnet",
        ),
        (
            Message::Text(json!({"type": "regenerate"}).to_string().into()),
            409,
            "no reply",
        ),
        (
            Message::Text(json!({"type": "stop", "now": true}).to_string().into()),
            422,
            "now",
        ),
    ] {
        ws.send(command).await.expect("send");
        let v = next(&mut ws).await;
        assert_eq!(v["event"], "refused", "{v}");
        assert_eq!(v["status"], status, "{v}");
        let m = v["error"]["message"].as_str().expect("message");
        assert!(m.contains(says), "{says}: {v}");
    }
    assert!(
        history(s.addr(), &k, &sid).await.is_empty(),
        "nothing stored"
    );

    // A long reply, stopped from the socket.
    send(
        &mut ws,
        json!({"type": "message", "content": "Talk", "max_tokens": 900, "ignore_eos": true}),
    )
    .await;
    let mut seen = Vec::new();
    while seen.len() < 4 {
        seen.push(next(&mut ws).await);
    }
    // A second turn while it runs is refused, and the reply goes on.
    send(&mut ws, json!({"type": "message", "content": "And?"})).await;
    send(&mut ws, json!({"type": "stop"})).await;
    let mut refused = None;
    let mut stopped = None;
    let mut end = None;
    while stopped.is_none() || end.is_none() {
        let v = next(&mut ws).await;
        match v["event"].as_str() {
            Some("refused") => refused = Some(v),
            Some("stopped") => stopped = Some(v),
            Some("message_end") => end = Some(v),
            _ => {}
        }
    }
    assert_eq!(refused.expect("the second turn")["status"], 409);
    let stopped = stopped.expect("stopped");
    assert_eq!(stopped["data"]["stopped"], true, "{stopped}");
    assert_eq!(end.expect("end")["data"]["finish_reason"], "cancelled");
    let stored = history(s.addr(), &k, &sid).await;
    assert_eq!(stored.len(), 2);
    assert_eq!(stored[1]["status"], "stopped");

    // Over the size limit: the socket is closed (1009), the server stays up.
    let big = "x".repeat((1 << 20) + 1);
    let _ = ws
        .send(Message::Text(
            json!({"type": "message", "content": big})
                .to_string()
                .into(),
        ))
        .await;
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match ws.next().await {
                Some(Ok(Message::Close(f))) => return f.map(|f| u16::from(f.code)),
                Some(Ok(_)) => continue,
                _ => return None,
            }
        }
    })
    .await
    .expect("closed within 10 s");
    if let Some(code) = closed {
        assert_eq!(code, 1009, "message too big");
    }
    let again = open(s.addr(), &sid, &k, false).await;
    drop(again);
    s.finish().await;
}

/// Tries to open the session's socket; the HTTP status of a refused upgrade.
async fn try_open(addr: SocketAddr, sid: &str, key: &str) -> Result<Socket, u16> {
    let mut req = format!("ws://{addr}/v1/sessions/{sid}/ws")
        .into_client_request()
        .expect("request");
    let b = HeaderValue::from_str(&format!("Bearer {key}")).expect("header");
    req.headers_mut().insert("authorization", b);
    match tokio_tungstenite::connect_async(req).await {
        Ok((ws, _)) => Ok(ws),
        Err(tokio_tungstenite::tungstenite::Error::Http(r)) => Err(r.status().as_u16()),
        Err(e) => panic!("the upgrade failed: {e}"),
    }
}

/// Opens the socket until it opens, for up to `secs` (a closed socket's place comes back once
/// the server has seen it go).
async fn open_within(addr: SocketAddr, sid: &str, key: &str, secs: u64) -> Socket {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        match try_open(addr, sid, key).await {
            Ok(ws) => return ws,
            Err(429) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(status) => panic!("no socket within {secs} s: {status}"),
        }
    }
}

/// The socket's close frame's code, waited for (other messages skipped).
async fn close_code(ws: &mut Socket) -> Option<u16> {
    loop {
        let m = tokio::time::timeout(Duration::from_secs(30), ws.next())
            .await
            .expect("closed within 30 s");
        match m {
            Some(Ok(Message::Close(frame))) => return frame.map(|f| f.code.into()),
            Some(Ok(_)) => continue,
            Some(Err(_)) | None => return None,
        }
    }
}

/// Opens the session's socket over a connection whose receive buffer is small, so that a
/// client that reads nothing soon fills what the kernels buffer between it and the server.
async fn open_small(addr: SocketAddr, sid: &str, key: &str) -> Socket {
    let sock = tokio::net::TcpSocket::new_v4().expect("socket");
    sock.set_recv_buffer_size(4096).expect("buffer");
    let stream = sock.connect(addr).await.expect("connect");
    let mut req = format!("ws://{addr}/v1/sessions/{sid}/ws")
        .into_client_request()
        .expect("request");
    let b = HeaderValue::from_str(&format!("Bearer {key}")).expect("header");
    req.headers_mut().insert("authorization", b);
    let stream = tokio_tungstenite::MaybeTlsStream::Plain(stream);
    let (ws, _) = tokio_tungstenite::client_async(req, stream)
        .await
        .expect("upgrade");
    ws
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_s_sockets_are_capped_and_closed_when_it_is_revoked_or_stops_reading() {
    let flags = [
        "--max-sockets-per-key",
        "2",
        "--socket-write-timeout-secs",
        "1",
    ];
    // A context long enough for a reply larger than the kernels buffer (a few MiB).
    let spec = TinySpec {
        context: 8192,
        ..TinySpec::default()
    };
    let s = Stack::start_with("websocket_limits", &spec, Db::Sqlite, 1, &flags).await;
    let (k, bob) = (s.key("alice").await, s.key("bob").await);
    let sid = new_session(s.addr(), &k).await;
    let bsid = new_session(s.addr(), &bob).await;

    // Two sockets for Alice's key, and no third; Bob has his own.
    let _first = open(s.addr(), &sid, &k, false).await;
    let mut deaf = open_small(s.addr(), &sid, &k).await;
    assert_eq!(try_open(s.addr(), &sid, &k).await.err(), Some(429));
    let _bobs = open(s.addr(), &bsid, &bob, false).await;

    // One of them asks for a long reply (each token with its 20 likeliest alternatives: some
    // 9 MB of events) and reads none of it: the server gives up on it once a message waits
    // past the write timeout, and its place comes back (well before the 60 s a silent client
    // is given).
    let long = json!({"type": "message", "content": "Go on", "max_tokens": 8000,
                      "ignore_eos": true, "logprobs": true, "top_logprobs": 20});
    deaf.send(Message::Text(long.to_string().into()))
        .await
        .expect("send");
    let mut third = open_within(s.addr(), &sid, &k, 30).await;
    drop(deaf);

    // The key is revoked: its open socket's next command closes it (1008).
    use hearth_orchestrator::storage::Accounts as _;
    let caller = hearth_orchestrator::auth::authenticate(&s.store, &k)
        .await
        .expect("the key");
    s.store
        .revoke_api_key(&caller.key.id, hearth_orchestrator::storage::now_ms())
        .await
        .expect("revoke");
    send(&mut third, json!({"type": "stop"})).await;
    assert_eq!(close_code(&mut third).await, Some(1008));
    s.finish().await;
}

/// Idleness is judged on what the client sends: a turn that waits in the queue longer than the
/// idle time (the one worker place is taken) is served on a socket that stays open; a client
/// that then sends nothing, not even a pong, is closed as idle (1001).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_that_waits_longer_than_the_idle_time_keeps_its_socket() {
    let flags = [
        "--worker-capacity",
        "1",
        "--queue-timeout-secs",
        "60",
        "--socket-idle-secs",
        "2",
    ];
    let s = Stack::scripted("websocket_idle", Db::Sqlite, 1, 40, &flags).await;
    let k = s.key("alice").await;
    let (busy_sid, sid) = (
        new_session(s.addr(), &k).await,
        new_session(s.addr(), &k).await,
    );
    // The one place, for some 4 s (100 tokens of 40 ms).
    let mut busy = stream_turn(s.addr(), &k, &busy_sid, 100).await;
    busy.next().await.expect("message_start");

    let mut ws = open(s.addr(), &sid, &k, false).await;
    let started = std::time::Instant::now();
    send(
        &mut ws,
        json!({"type": "message", "content": "Hi", "max_tokens": 4, "ignore_eos": true}),
    )
    .await;
    let events = until_end(&mut ws).await;
    let waited = started.elapsed();
    assert_eq!(
        events.last().map(|e| e["event"].clone()),
        Some(json!("message_end")),
        "{events:?}"
    );
    assert!(!tokens(&events).is_empty(), "{events:?}");
    // A lower bound only: the command really took longer than the idle time.
    assert!(waited > Duration::from_secs(2), "served after {waited:?}");
    while busy.next().await.is_some() {}

    // Silent now, not even answering pings: closed as idle.
    assert_eq!(close_code_unanswered(&mut ws).await, Some(1001));
    s.finish().await;
}

/// The code of the close frame the server sends, read from the connection itself so that the
/// client answers nothing (a WebSocket client answers pings as it reads); `None` when the
/// connection ends without one.
async fn close_code_unanswered(ws: &mut Socket) -> Option<u16> {
    use tokio::io::AsyncReadExt;
    let mut bytes = Vec::new();
    let read = ws.get_mut().read_to_end(&mut bytes);
    tokio::time::timeout(Duration::from_secs(30), read)
        .await
        .expect("closed within 30 s")
        .expect("read");
    // Server frames are unmasked: opcode, length (7 bits, or 16 or 64 more), payload.
    let mut at = 0;
    while at + 2 <= bytes.len() {
        let (opcode, short) = (bytes[at] & 0x0f, usize::from(bytes[at + 1] & 0x7f));
        let (len, head) = match short {
            126 => (
                usize::from(u16::from_be_bytes([bytes[at + 2], bytes[at + 3]])),
                4,
            ),
            127 => (
                usize::try_from(u64::from_be_bytes(bytes[at + 2..at + 10].try_into().ok()?))
                    .ok()?,
                10,
            ),
            n => (n, 2),
        };
        let payload = bytes.get(at + head..at + head + len)?;
        if opcode == 0x8 {
            return (payload.len() >= 2).then(|| u16::from_be_bytes([payload[0], payload[1]]));
        }
        at += head + len;
    }
    None
}
