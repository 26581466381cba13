//! Connections that do not behave: 2,000 idle and half-open ones beside a chat and a shutdown,
//! more than `--max-connections`, a body that stops arriving, and requests that other sites make
//! (DNS rebinding, cross-site) to a server running without keys.

use std::time::{Duration, Instant};

use hearth_e2e::http::{Reply, Req};
use hearth_e2e::stack::{
    assets, history, json_turn, new_session, path, scripted_worker, signal, wait_exit, Db, Hearth,
    Stack,
};
use serde_json::json;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_half_open_connections_block_neither_chat_nor_shutdown() {
    let mut s = Stack::scripted(
        "slowloris",
        Db::Sqlite,
        1,
        40,
        &["--header-timeout-secs", "3", "--shutdown-timeout-secs", "2"],
    )
    .await;
    let k = s.key("alice").await;
    // This process holds the 2,000 client ends itself.
    hearth_orchestrator::http_server::raise_open_files_limit();
    // 2,000 connections without a key: half send nothing, half the start of a header.
    let mut idle = Vec::new();
    for i in 0..2000 {
        let mut c = TcpStream::connect(s.addr()).await.expect("connect");
        if i % 2 == 1 {
            c.write_all(b"GET /v1/sessions HTTP/1.1\r\nHost: x\r\n")
                .await
                .expect("write");
        }
        idle.push(c);
    }
    let sid = new_session(s.addr(), &k).await;
    let started = Instant::now();
    json_turn(s.addr(), &k, &sid, "still there?", 3).await;
    println!(
        "a turn beside 2,000 idle connections took {:?}",
        started.elapsed()
    );
    // SIGTERM with all of them still open: the server exits (after its shutdown timeout, 2 s,
    // plus the time open connections get to close, 5 s), not never. The 60 s deadline only
    // fails a server that hangs; how long it took is printed.
    signal(&s.hearth.child, libc::SIGTERM);
    let signalled = Instant::now();
    let status = wait_exit(&mut s.hearth.child, signalled + Duration::from_secs(60))
        .await
        .expect("hearth did not exit within 60 s of SIGTERM with idle connections open");
    println!("exited {:?} after SIGTERM", signalled.elapsed());
    assert!(status.success(), "{status}");
    drop(idle);
    s.finish().await;
}

/// Whether the peer has closed `c`, read without waiting: at end of file (after any bytes it
/// sent first) or reset, yes; open with nothing more to read ("would block"), no.
fn closed_by_peer(c: &mut std::net::TcpStream) -> bool {
    use std::io::{ErrorKind, Read};
    let mut buf = [0u8; 4096];
    loop {
        match c.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return true,
            Err(e) => panic!("reading a held connection: {e}"),
        }
    }
}

/// `--max-connections` holds connections past the cap in the backlog until one closes, and
/// `--header-timeout-secs` closes connections that send no complete header, so idle clients can
/// neither take every descriptor nor keep their places.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_wait_for_a_place_and_silent_ones_are_closed() {
    use tokio::io::AsyncReadExt;
    let s = Stack::scripted(
        "conn_cap",
        Db::Sqlite,
        1,
        40,
        &["--max-connections", "4", "--header-timeout-secs", "3"],
    )
    .await;
    // Four connections take every place: two send nothing, two half a header.
    let mut idle = Vec::new();
    for i in 0..4 {
        let mut c = TcpStream::connect(s.addr()).await.expect("connect");
        if i % 2 == 1 {
            c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
                .await
                .expect("write");
        }
        idle.push(c);
    }
    let opened = Instant::now();
    // A fifth connects (the kernel's backlog takes it) and sends a whole request, which is not
    // answered while the four hold their places.
    let mut fifth = TcpStream::connect(s.addr()).await.expect("connect");
    fifth
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .expect("write");
    // The header deadline (3 s) closes the four; only then does the fifth take a place and get
    // its answer. The deadline only fails a server that never answers.
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), fifth.read_to_end(&mut answer))
        .await
        .expect("the fifth connection was not answered within 60 s")
        .expect("read");
    println!(
        "the fifth connection was answered {:?} after the four opened",
        opened.elapsed()
    );
    // Ordered, not timed: the fifth took the place one of the four left, so when it has its
    // answer at least one of them has been closed by the server (its end of file is waiting to
    // be read; a connection still open reads as "would block"), and the fifth was not served
    // beside all four. Their deadlines fall within the same moment, so the others may close
    // just after; each of them is closed by its deadline.
    let mut idle: Vec<std::net::TcpStream> = idle
        .into_iter()
        .map(|c| {
            let c = c.into_std().expect("a std socket");
            c.set_nonblocking(true).expect("nonblocking");
            c
        })
        .collect();
    let open = idle
        .iter_mut()
        .map(closed_by_peer)
        .filter(|closed| !closed)
        .count();
    assert!(
        open < 4,
        "all four connections without a complete header were still open when the fifth, past \
         --max-connections 4, was answered"
    );
    for (i, c) in idle.iter_mut().enumerate() {
        let until = Instant::now() + Duration::from_secs(30);
        while !closed_by_peer(c) {
            assert!(
                Instant::now() < until,
                "connection {i} without a complete header was never closed"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_does_not_arrive_in_time_gets_408_and_stores_nothing() {
    use tokio::io::AsyncReadExt;
    let s = Stack::scripted(
        "body-timeout",
        Db::Sqlite,
        1,
        40,
        &["--body-timeout-secs", "3"],
    )
    .await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let body = json!({"content": "half a question", "max_tokens": 3, "stream": false}).to_string();
    let head = format!(
        "POST /v1/sessions/{sid}/messages HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {k}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    // The header and half the body, then nothing: answered 408 after the body deadline.
    let mut c = TcpStream::connect(s.addr()).await.expect("connect");
    c.write_all(head.as_bytes()).await.expect("write");
    c.write_all(&body.as_bytes()[..body.len() / 2])
        .await
        .expect("write");
    let started = Instant::now();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(60), c.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        read.is_ok(),
        "no answer 60 s after a stalled body: {answer:?}"
    );
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"body_timeout\""), "{answer}");
    // A lower bound only (no slowness can answer early): the 408 waited for the deadline.
    assert!(
        started.elapsed() >= Duration::from_millis(2900),
        "answered before the 3 s deadline: {:?}",
        started.elapsed()
    );
    println!(
        "a stalled body was answered 408 after {:?}",
        started.elapsed()
    );
    assert!(
        history(s.addr(), &k, &sid).await.is_empty(),
        "nothing stored"
    );
    // A body that arrives in pieces, all within the deadline, is served (four pieces 100 ms
    // apart: the 3 s deadline leaves room for a busy machine).
    let mut c = TcpStream::connect(s.addr()).await.expect("connect");
    c.write_all(head.as_bytes()).await.expect("write");
    for piece in body.as_bytes().chunks(body.len() / 4 + 1) {
        c.write_all(piece).await.expect("write");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut answer = vec![0u8; 12];
    tokio::time::timeout(Duration::from_secs(60), c.read_exact(&mut answer))
        .await
        .expect("no answer")
        .expect("read");
    assert_eq!(
        &answer,
        b"HTTP/1.1 200",
        "{}",
        String::from_utf8_lossy(&answer)
    );
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_keys_requests_naming_another_site_are_refused() {
    let a = assets("rebinding");
    let worker = scripted_worker(&a.model, 40);
    let db = a.sqlite_url();
    let hearth = Hearth::spawn(&[
        "--database-url".into(),
        db,
        "--tokenizer".into(),
        path(&a.tokenizer),
        "--auth".into(),
        "none".into(),
        "--worker".into(),
        worker.grpc.clone(),
    ]);
    hearth.wait_ready().await;
    let addr = hearth.addr;
    let refused = |r: &Reply| {
        assert_eq!(r.status, 403, "{}", r.text());
        assert_eq!(
            r.json()["error"]["type"],
            "permission_error",
            "{}",
            r.text()
        );
    };
    // A page on evil.example whose name now resolves to 127.0.0.1 (DNS rebinding).
    for (method, p) in [
        ("GET", "/v1/sessions"),
        ("POST", "/v1/sessions"),
        ("GET", "/"),
    ] {
        let mut req = Req::new(method, p).header("Host", "evil.example:8080");
        if method == "POST" {
            req = req.json(&json!({}));
        }
        refused(&req.send(addr).await);
    }
    // A cross-site request from a page elsewhere, to the right name.
    refused(
        &Req::new("POST", "/v1/sessions")
            .header("Origin", "http://evil.example")
            .json(&json!({}))
            .send(addr)
            .await,
    );
    let list = Req::new("GET", "/v1/sessions").send(addr).await;
    assert_eq!(list.status, 200, "{}", list.text());
    assert_eq!(
        list.json()["data"],
        json!([]),
        "a refused request changed nothing"
    );
    // Local names and local pages are served.
    let r = Req::new("POST", "/v1/sessions")
        .header("Host", format!("localhost:{}", addr.port()))
        .header("Origin", "http://localhost:3000")
        .json(&json!({}))
        .send(addr)
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = Req::new("GET", "/healthz")
        .header("Host", format!("[::1]:{}", addr.port()))
        .send(addr)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    drop(hearth);
    drop(worker);
    let _ = std::fs::remove_dir_all(&a.dir);
}
