//! Faults around a running stack: PostgreSQL stopped in the middle of a streaming reply and
//! brought back, Redis gone, and SIGTERM on the orchestrator while 50 replies stream.
//!
//! The workers run in scripted mode (one token per tick of a timer, no model), so how long a
//! reply lasts is set by the test rather than by how busy the machine is. PostgreSQL for the
//! outage test is a private server on a free port (`initdb` + `pg_ctl`, run as the `postgres` OS
//! user when the tests run as root, since PostgreSQL refuses root); Redis is a private
//! `redis-server` on a free port.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use hearth_e2e::http::{Event, Req, Sse};
use hearth_e2e::redis::RedisServer;
use hearth_e2e::stack::{assets_with, new_session, stream_turn, worker_bin, Db, Hearth, Stack};
use hearth_orchestrator::auth::{issue_key, KeyOptions};
use hearth_orchestrator::storage::{Message, MessageStatus, Role, SqlStore, Store};
use hearth_worker::fixtures::{TinySpec, WorkerProcess};
use serde_json::{json, Value};
use sqlx::Connection;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A worker that gives every request one token per `token_ms` milliseconds.
fn scripted_worker(model: &Path, token_ms: u64) -> WorkerProcess {
    let ms = token_ms.to_string();
    WorkerProcess::spawn(&worker_bin(), model, &["--scripted-token-ms", &ms])
        .expect("start scripted worker")
}

/// A turn answered as JSON once it is finished.
async fn json_turn(addr: SocketAddr, key: &str, sid: &str, content: &str) -> Value {
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(key))
        .json(&json!({"content": content, "max_tokens": 5, "stream": false}))
        .send(addr)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// Reads until `n` token events have arrived (fails if the reply ends first).
async fn read_tokens(sse: &mut Sse, n: usize) -> Vec<Event> {
    let mut seen = Vec::new();
    let mut tokens = 0;
    while tokens < n {
        let e = sse.next().await.expect("the stream ended early");
        assert!(
            e.event == "token" || e.event == "message_start",
            "the reply ended before {n} more tokens: {e:?}"
        );
        tokens += usize::from(e.event == "token");
        seen.push(e);
    }
    seen
}

/// The streamed text and the last event.
fn fold(events: &[Event]) -> (String, Event) {
    let text = events
        .iter()
        .filter(|e| e.event == "token")
        .map(|e| e.json()["text"].as_str().expect("text").to_string())
        .collect();
    (text, events.last().expect("events").clone())
}

/// Nothing half-written: `seq` is 1, 2, 3… without gaps or duplicates, messages alternate user
/// and assistant, every user message has its reply, and every reply is final with the
/// accounting its status implies.
fn check_history(sid: &str, msgs: &[Message]) {
    assert_eq!(
        msgs.len() % 2,
        0,
        "{sid}: a user message without a reply: {msgs:#?}"
    );
    for (i, m) in msgs.iter().enumerate() {
        assert_eq!(m.seq, i as i64 + 1, "{sid}: seq out of order: {msgs:#?}");
        let role = if i % 2 == 0 {
            Role::User
        } else {
            Role::Assistant
        };
        assert_eq!(m.role, role, "{sid}: roles do not alternate: {msgs:#?}");
        match m.role {
            Role::User => {
                assert_eq!(m.status, MessageStatus::Complete, "{sid}: {m:?}");
                assert!(!m.content.is_empty(), "{sid}: empty user message {m:?}");
            }
            Role::Assistant => match m.status {
                MessageStatus::Complete | MessageStatus::Stopped => {
                    assert!(
                        m.finish_reason.is_some()
                            && m.prompt_tokens.is_some()
                            && m.completion_tokens.is_some()
                            && m.duration_ms.is_some()
                            && m.worker.is_some(),
                        "{sid}: a final reply without its accounting: {m:?}"
                    );
                }
                MessageStatus::Error => {
                    assert!(m.finish_reason.is_some(), "{sid}: {m:?}");
                }
                MessageStatus::Streaming => panic!("{sid}: a reply left streaming: {m:?}"),
            },
        }
    }
}

/// Fails unless `r` is a 503 with the API's error body.
fn assert_unavailable(what: &str, r: &hearth_e2e::http::Reply) {
    assert_eq!(r.status, 503, "{what}: {}", r.text());
    let v = r.json();
    assert_eq!(v["error"]["type"], "service_unavailable", "{what}: {v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{what}: {v}"
    );
}

// --- A private PostgreSQL --------------------------------------------------------------------

/// A directory holding `initdb`, `pg_ctl` and `postgres`: `$PATH` first, then the Debian layout.
fn pg_bin_dir() -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .find(|d| d.join("initdb").is_file() && d.join("pg_ctl").is_file());
    if let Some(d) = on_path {
        return d;
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|entries| entries.flatten().map(|e| e.path().join("bin")).collect())
        .unwrap_or_default();
    versions.retain(|d| d.join("initdb").is_file());
    versions.sort();
    versions.pop().expect(
        "PostgreSQL's initdb and pg_ctl are required for this test \
         (not on $PATH nor in /usr/lib/postgresql/*/bin)",
    )
}

fn command_output(program: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// PostgreSQL's tools refuse to run as root; as root they run as the `postgres` OS user.
fn postgres_user_ids() -> Option<(u32, u32)> {
    if command_output("id", &["-u"])? != "0" {
        return None;
    }
    let uid = command_output("id", &["-u", "postgres"]).and_then(|s| s.parse().ok());
    let gid = command_output("id", &["-g", "postgres"]).and_then(|s| s.parse().ok());
    match (uid, gid) {
        (Some(u), Some(g)) => Some((u, g)),
        _ => panic!(
            "this test runs as root, which PostgreSQL refuses, and there is no `postgres` OS user \
             to run initdb and pg_ctl as (create one, or run the tests as another user)"
        ),
    }
}

/// A PostgreSQL server of this test's own, on a free port, that the test stops and starts.
#[derive(Debug)]
struct PgServer {
    base: PathBuf,
    bin: PathBuf,
    port: u16,
    /// Run the tools as the `postgres` OS user.
    as_postgres: bool,
}

impl PgServer {
    fn start(tag: &str) -> Self {
        let bin = pg_bin_dir();
        let ids = postgres_user_ids();
        let base = std::env::temp_dir().join(format!(
            "hearth-pg-{tag}-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&base).expect("temp dir");
        if let Some((uid, gid)) = ids {
            std::os::unix::fs::chown(&base, Some(uid), Some(gid)).expect("chown to postgres");
        }
        let pg = Self {
            base,
            bin,
            port: free_port(),
            as_postgres: ids.is_some(),
        };
        pg.tool(
            "initdb",
            &[
                "-D",
                &pg.data(),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
            ],
        );
        pg.resume();
        pg
    }

    fn data(&self) -> String {
        self.base.join("data").display().to_string()
    }

    fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// Runs one of PostgreSQL's tools (as `postgres` if need be) and fails the test if it fails.
    fn tool(&self, name: &str, args: &[&str]) {
        let program = self.bin.join(name);
        let mut cmd = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&program);
            c
        } else {
            Command::new(&program)
        };
        // The test's own directory may not be readable by `postgres`.
        cmd.args(args)
            .current_dir(&self.base)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let out = match cmd.output() {
            Err(e) if self.as_postgres && e.kind() == std::io::ErrorKind::NotFound => {
                // No runuser: `su` does the same.
                let line = std::iter::once(program.display().to_string())
                    .chain(args.iter().map(|a| a.to_string()))
                    .map(|a| format!("'{}'", a.replace('\'', r"'\''")))
                    .collect::<Vec<_>>()
                    .join(" ");
                Command::new("su")
                    .args(["postgres", "-s", "/bin/sh", "-c", &line])
                    .current_dir(&self.base)
                    .stdin(Stdio::null())
                    .output()
            }
            other => other,
        }
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
        let log = std::fs::read_to_string(self.base.join("server.log")).unwrap_or_default();
        assert!(
            out.status.success(),
            "{name} {args:?} failed ({}):\n{}{}\nserver log:\n{log}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
    }

    /// Starts the server and waits until it accepts connections.
    fn resume(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.base.display()
        );
        let log = self.base.join("server.log").display().to_string();
        self.tool(
            "pg_ctl",
            &[
                "-D",
                &self.data(),
                "-l",
                &log,
                "-o",
                &options,
                "-w",
                "-t",
                "120",
                "start",
            ],
        );
    }

    /// Stops the server (`-m fast`: open connections are terminated) and waits until it is down.
    fn stop(&self) {
        self.tool(
            "pg_ctl",
            &["-D", &self.data(), "-m", "fast", "-w", "-t", "120", "stop"],
        );
    }

    async fn create_database(&self, name: &str) -> String {
        let mut c = sqlx::PgConnection::connect(&self.url("postgres"))
            .await
            .expect("connect to the private PostgreSQL");
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut c)
            .await
            .expect("create database");
        c.close().await.expect("close");
        self.url(name)
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let data = self.data();
        let program = self.bin.join("pg_ctl");
        let args = ["-D", data.as_str(), "-m", "immediate", "-w", "stop"];
        let _ = if self.as_postgres {
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(&program)
                .args(args)
                .current_dir(&self.base)
                .output()
        } else {
            Command::new(&program).args(args).output()
        };
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

/// The orchestrator's final write of a reply is retried through a short outage (`finish` in
/// `orchestrator/src/generate/mod.rs`: 8 attempts, 250 ms doubling to 5 s between them, each
/// attempt waiting up to the pool's 3 s acquire timeout: roughly 20 to 40 s in all).
///
/// What happens to the reply that is streaming when the database goes away: generation does
/// not need the database, so tokens keep streaming to the client (the per-second progress
/// saves fail and are logged; each failed save holds the loop for up to the 3 s acquire
/// timeout, so tokens arrive in bursts). When the reply ends, the client gets its
/// `message_end`; if the database is back within the retry window, the final write lands and
/// the stored reply is `complete` with exactly the streamed text, which is what this test
/// asserts (its outage is a few seconds). Past the window the final write is given up: the
/// stored reply stays `streaming` with the text of its last successful save until the orphan
/// sweep (`--orphan-after-secs`) marks it `error` / `interrupted`, while the client was told it
/// completed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_mid_stream_is_a_503_and_service_resumes_with_nothing_half_written() {
    let pg = PgServer::start("outage");
    let url = pg.create_database("hearth").await;
    let assets = assets_with("outage", &TinySpec::default());
    // 900 tokens at 20 ms: the reply streams for about 18 s, through the outage.
    let workers = vec![scripted_worker(&assets.model, 20)];
    let mut hearth = Hearth::spawn(&Stack::args(&assets, &url, &workers, &[]));
    hearth.wait_ready().await;
    let addr = hearth.addr;
    let store = SqlStore::connect(&url).await.expect("store");
    let key = issue_key(&store, "user", KeyOptions::default())
        .await
        .expect("key")
        .key;
    let user = store
        .user_by_name("user")
        .await
        .expect("user")
        .expect("the user exists");

    let busy = new_session(addr, &key).await;
    let quiet = new_session(addr, &key).await;
    json_turn(addr, &key, &busy, "Hello").await;
    let mut sse = stream_turn(addr, &key, &busy, 900).await;
    let mut seen = read_tokens(&mut sse, 3).await;
    // The rest of the reply, each event with the time it arrived.
    let reader = tokio::spawn(async move {
        let mut timed = Vec::new();
        while let Some(e) = sse.next().await {
            timed.push((Instant::now(), e));
        }
        timed
    });

    pg.stop();
    let down = Instant::now();
    let turn = json!({"content": "during the outage", "max_tokens": 5, "stream": false});
    let (post, get) = (
        format!("/v1/sessions/{quiet}/messages"),
        format!("/v1/sessions/{busy}/messages"),
    );
    let tries = [
        Req::new("GET", "/v1/sessions").key(Some(&key)),
        Req::new("POST", &post).key(Some(&key)).json(&turn),
        Req::new("GET", &get).key(Some(&key)),
        Req::new("GET", "/readyz"),
    ];
    for r in &tries {
        let t = Instant::now();
        let reply = r.send(addr).await;
        assert_unavailable(
            &format!("{} {} with the database down", r.method, r.path),
            &reply,
        );
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{} {} took {:?} to say 503",
            r.method,
            r.path,
            t.elapsed()
        );
    }

    pg.resume();
    let up = Instant::now();
    eprintln!("database outage: {:.1?}", up - down);
    // Service resumes as soon as the pool reconnects.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = Req::new("GET", "/v1/sessions")
            .key(Some(&key))
            .send(addr)
            .await;
        if r.status == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no recovery 60 s after the database came back: {} {}",
            r.status,
            r.text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let after = json_turn(addr, &key, &quiet, "after the outage").await;
    assert_eq!(after["status"], "complete", "{after}");

    // The reply streamed on through the outage (generation does not need the database) and
    // ended normally…
    let timed = reader.await.expect("the reply's reader");
    let during = timed
        .iter()
        .filter(|(t, e)| e.event == "token" && *t > down && *t < up)
        .count();
    assert!(during > 0, "no token arrived during the outage");
    let longest_gap = timed
        .windows(2)
        .map(|w| w[1].0 - w[0].0)
        .max()
        .unwrap_or_default();
    eprintln!("{during} tokens arrived during the outage; longest gap {longest_gap:.1?}");
    seen.extend(timed.into_iter().map(|(_, e)| e));
    let (text, last) = fold(&seen);
    assert_eq!(last.event, "message_end", "{last:?}");
    let end = last.json();
    assert_eq!(end["status"], "complete", "{end}");
    assert_eq!(end["usage"]["completion_tokens"], 900, "{end}");
    let reply_id = end["message_id"].as_str().expect("message id").to_string();
    // …and its final write, retried until the database was back, stored what was streamed.
    let deadline = Instant::now() + Duration::from_secs(60);
    let stored = loop {
        let msgs = store
            .list_messages(&user.id, &busy)
            .await
            .expect("messages");
        let reply = msgs.iter().find(|m| m.id == reply_id).cloned();
        match reply {
            Some(m) if m.status != MessageStatus::Streaming => break m,
            other => assert!(
                Instant::now() < deadline,
                "the reply was not finalized 60 s after the stream ended: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(stored.status, MessageStatus::Complete, "{stored:?}");
    assert_eq!(stored.content, text);
    assert_eq!(stored.completion_tokens, Some(900));
    assert_eq!(stored.finish_reason.as_deref(), Some("length"));

    // Nothing half-written: every session's history is whole and final, and the turn refused
    // during the outage left no trace.
    let sessions = Req::new("GET", "/v1/sessions?limit=100")
        .key(Some(&key))
        .send(addr)
        .await
        .json();
    let ids: Vec<String> = sessions["data"]
        .as_array()
        .expect("sessions")
        .iter()
        .map(|s| s["id"].as_str().expect("id").to_string())
        .collect();
    assert_eq!(ids.len(), 2, "{sessions}");
    for sid in &ids {
        let msgs = store.list_messages(&user.id, sid).await.expect("messages");
        check_history(sid, &msgs);
    }
    let busy_msgs = store
        .list_messages(&user.id, &busy)
        .await
        .expect("messages");
    assert_eq!(busy_msgs.len(), 4, "{busy_msgs:#?}");
    let quiet_msgs = store
        .list_messages(&user.id, &quiet)
        .await
        .expect("messages");
    let contents: Vec<&str> = quiet_msgs.iter().map(|m| m.content.as_str()).collect();
    assert_eq!(quiet_msgs.len(), 2, "{quiet_msgs:#?}");
    assert_eq!(contents[0], "after the outage");

    hearth.kill();
    drop(workers);
    store.close().await;
    drop(pg);
    let _ = std::fs::remove_dir_all(&assets.dir);
}

// --- A private Redis -------------------------------------------------------------------------

async fn completion(addr: SocketAddr, key: &str) -> hearth_e2e::http::Reply {
    Req::new("POST", "/v1/chat/completions")
        .key(Some(key))
        .json(
            &json!({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}),
        )
        .send(addr)
        .await
}

/// Sends completions until one is refused by the rate limit (at most `tries`); returns the
/// statuses. A minute boundary may reset the count once, hence more tries than the limit + 1.
async fn until_limited(addr: SocketAddr, key: &str, tries: usize) -> Vec<u16> {
    let mut statuses = Vec::new();
    for _ in 0..tries {
        let r = completion(addr, key).await;
        statuses.push(r.status);
        if r.status == 429 {
            assert!(r.header("retry-after").is_some(), "429 without Retry-After");
            break;
        }
        assert_eq!(r.status, 200, "{}", r.text());
    }
    statuses
}

#[tokio::test]
async fn with_redis_down_chat_keeps_working_limits_lapse_and_stop_still_works() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    let s = Stack::start_full(
        "noredis",
        &TinySpec::default(),
        Db::Postgres,
        1,
        &["--scripted-token-ms", "20"],
        &["--redis-url", &url],
    )
    .await;
    let addr = s.addr();
    let limited = s.limited_key("bob", 2).await;

    // With Redis up the limit holds.
    let statuses = until_limited(addr, &limited, 6).await;
    assert_eq!(statuses.last(), Some(&429), "{statuses:?}");

    redis.kill();
    // Chat keeps working, and the limit (already used up in this minute) is not enforced
    // while Redis is unreachable.
    let mut took = Vec::new();
    for i in 0..4 {
        let t = Instant::now();
        let r = completion(addr, &limited).await;
        assert_eq!(r.status, 200, "request {i} with Redis down: {}", r.text());
        took.push(t.elapsed());
    }
    let sid = new_session(addr, &limited).await;
    let t = Instant::now();
    let m = json_turn(addr, &limited, &sid, "one").await;
    assert_eq!(m["status"], "complete", "{m}");
    took.push(t.elapsed());
    eprintln!("with Redis down: 4 completions and a native turn took {took:.1?}");
    assert!(
        took.iter().all(|t| *t < Duration::from_secs(30)),
        "{took:?}"
    );

    // A stop reaches a reply running on the same replica without Redis.
    let mut sse = stream_turn(addr, &limited, &sid, 900).await;
    let mut seen = read_tokens(&mut sse, 3).await;
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/stop"))
        .key(Some(&limited))
        .send(addr)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["stopped"], true, "{}", r.text());
    assert_eq!(r.json()["message"]["status"], "stopped", "{}", r.text());
    seen.extend(sse.rest().await);
    let (text, last) = fold(&seen);
    assert_eq!(last.event, "message_end", "{last:?}");
    let end = last.json();
    assert_eq!(end["status"], "stopped", "{end}");
    assert!(
        end["usage"]["completion_tokens"]
            .as_u64()
            .is_some_and(|n| n < 900),
        "{end}"
    );
    let user = s
        .store
        .user_by_name("bob")
        .await
        .expect("user")
        .expect("bob");
    let msgs = s
        .store
        .list_messages(&user.id, &sid)
        .await
        .expect("messages");
    check_history(&sid, &msgs);
    let reply = msgs.last().expect("reply");
    assert_eq!(reply.status, MessageStatus::Stopped);
    assert_eq!(reply.content, text);

    // Redis back: the limit holds again once the connection is re-established.
    redis.resume();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut statuses = Vec::new();
    while statuses.last() != Some(&429) {
        assert!(
            Instant::now() < deadline,
            "the limit was not enforced again within 60 s of Redis coming back: {statuses:?}"
        );
        let r = completion(addr, &limited).await;
        assert!(
            r.status == 200 || r.status == 429,
            "{}: {}",
            r.status,
            r.text()
        );
        statuses.push(r.status);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    s.finish().await;
}

// --- SIGTERM ---------------------------------------------------------------------------------

const STREAMS: usize = 50;
const SHUTDOWN_TIMEOUT_SECS: u64 = 10;
const TOKEN_MS: u64 = 50;
/// Finishes within the shutdown timeout (3 s)…
const SHORT: u32 = 60;
/// …and does not (50 s): it is stopped when the timeout runs out.
const LONG: u32 = 1000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_fifty_streams_ends_each_cleanly_stores_each_and_exits_zero() {
    let shutdown = SHUTDOWN_TIMEOUT_SECS.to_string();
    let token_ms = TOKEN_MS.to_string();
    let mut s = Stack::start_full(
        "sigterm",
        &TinySpec::default(),
        Db::Postgres,
        1,
        &["--scripted-token-ms", &token_ms],
        &["--shutdown-timeout-secs", &shutdown],
    )
    .await;
    let key = s.key("user").await;
    let addr = s.addr();

    // Every stream is running (its turn is stored and `message_start` has arrived) before the
    // signal: even ones finish within the shutdown timeout, odd ones outlast it.
    let opening: Vec<_> = (0..STREAMS)
        .map(|i| {
            let key = key.clone();
            tokio::spawn(async move {
                let sid = new_session(addr, &key).await;
                let tokens = if i % 2 == 0 { SHORT } else { LONG };
                let mut sse = stream_turn(addr, &key, &sid, tokens).await;
                let first = sse.next().await.expect("message_start");
                assert_eq!(first.event, "message_start", "{first:?}");
                (sid, tokens, sse, vec![first])
            })
        })
        .collect();
    let mut open = Vec::new();
    for t in opening {
        open.push(t.await.expect("open a stream"));
    }

    let pid = s.hearth.child.id();
    let signalled = Instant::now();
    let sent = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(sent.success(), "kill -TERM {pid}: {sent}");

    let reading: Vec<_> = open
        .into_iter()
        .map(|(sid, tokens, mut sse, mut seen)| {
            tokio::spawn(async move {
                seen.extend(sse.rest().await);
                (sid, tokens, seen)
            })
        })
        .collect();
    let mut ended = Vec::new();
    for t in reading {
        ended.push(t.await.expect("read a stream"));
    }

    // The process exits 0 once the running replies are done: within the shutdown timeout, plus
    // the time to stop and store the ones that outlast it.
    let limit = Duration::from_secs(SHUTDOWN_TIMEOUT_SECS + 20);
    let status = loop {
        if let Some(st) = s.hearth.child.try_wait().expect("wait for hearth") {
            break st;
        }
        assert!(
            signalled.elapsed() < limit,
            "hearth still running {:?} after SIGTERM",
            signalled.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let exited = signalled.elapsed();
    eprintln!("hearth exited {status} {exited:.1?} after SIGTERM");
    assert_eq!(status.code(), Some(0), "hearth exited with {status}");

    // Every stream ended with a terminal event, and the stored reply says the same.
    let store = SqlStore::connect(&s.db_url).await.expect("a fresh store");
    let user = store
        .user_by_name("user")
        .await
        .expect("user")
        .expect("the user exists");
    let mut statuses = std::collections::BTreeMap::<String, usize>::new();
    for (sid, tokens, seen) in &ended {
        let (text, last) = fold(seen);
        assert!(
            last.event == "message_end" || last.event == "error",
            "{sid}: the stream ended without a terminal event: {last:?}"
        );
        let end = last.json();
        let status = end["status"].as_str().unwrap_or("error").to_string();
        *statuses.entry(status.clone()).or_default() += 1;
        let want = if *tokens == SHORT {
            "complete"
        } else {
            "stopped"
        };
        assert_eq!(status, want, "{sid} ({tokens} tokens): {end}");

        let msgs = store.list_messages(&user.id, sid).await.expect("messages");
        check_history(sid, &msgs);
        assert_eq!(msgs.len(), 2, "{sid}: {msgs:#?}");
        let reply = &msgs[1];
        assert_eq!(reply.status.as_str(), status, "{sid}: {reply:?}");
        assert_eq!(reply.content, text, "{sid}");
        assert_eq!(
            reply.completion_tokens,
            end["usage"]["completion_tokens"].as_i64(),
            "{sid}"
        );
    }
    eprintln!("{STREAMS} streams ended: {statuses:?}");
    store.close().await;
    s.finish().await;
}
