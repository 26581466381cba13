//! Model files fetched over HTTP from a local test server (a real socket, HTTP/1.1 written by
//! hand so that it can misbehave exactly): a download cut halfway resumes with `Range`, in the
//! same fetch and in the next one; a server that ignores `Range` starts the file over; a wrong
//! checksum is refused and leaves nothing behind; a slow server's progress can be watched; a
//! 404 is not retried; a fetched file is not fetched again.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hearth_worker::fetch::{FetchError, Fetcher, Progress, Source};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// How the test server behaves.
#[derive(Debug, Clone, Default)]
struct Behaviour {
    /// Close the connection after this many body bytes, on the first request only.
    cut_first_at: Option<usize>,
    /// Answer every request with the whole file (200), whatever its `Range`.
    ignore_range: bool,
    /// Wait this long after each 16 KiB written.
    delay: Option<Duration>,
    /// Answer 404 to everything.
    missing: bool,
    /// Send this `ETag`, and honour `If-Range` against it.
    etag: Option<String>,
}

#[derive(Debug, Default)]
struct Log {
    /// Each request's `Range` header (None without one).
    ranges: Vec<Option<String>>,
    /// Each request's `If-Range` header.
    if_ranges: Vec<Option<String>>,
    /// Body bytes written in all.
    served: usize,
}

/// What the server serves now: the file and its behaviour (a test may replace both).
type Served = Arc<Mutex<(Arc<Vec<u8>>, Behaviour)>>;

struct Server {
    addr: SocketAddr,
    log: Arc<Mutex<Log>>,
    served: Served,
}

impl Server {
    async fn start(body: Vec<u8>, how: Behaviour) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let log = Arc::new(Mutex::new(Log::default()));
        let served: Served = Arc::new(Mutex::new((Arc::new(body), how)));
        let (l, now) = (log.clone(), served.clone());
        tokio::spawn(async move {
            loop {
                let Ok((sock, _)) = listener.accept().await else {
                    return;
                };
                let (body, how) = now.lock().expect("served").clone();
                let log = l.clone();
                tokio::spawn(async move {
                    let _ = answer(sock, &body, &how, &log).await;
                });
            }
        });
        Self { addr, log, served }
    }

    /// Serves another file from now on.
    fn replace(&self, body: Vec<u8>, how: Behaviour) {
        *self.served.lock().expect("served") = (Arc::new(body), how);
    }

    fn if_ranges(&self) -> Vec<Option<String>> {
        self.log.lock().expect("log").if_ranges.clone()
    }

    fn url(&self, name: &str) -> String {
        format!("http://{}/models/{name}", self.addr)
    }

    fn ranges(&self) -> Vec<Option<String>> {
        self.log.lock().expect("log").ranges.clone()
    }

    fn served(&self) -> usize {
        self.log.lock().expect("log").served
    }
}

async fn answer(
    mut sock: tokio::net::TcpStream,
    body: &[u8],
    how: &Behaviour,
    log: &Mutex<Log>,
) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if sock.read(&mut byte).await? == 0 {
            return Ok(());
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).to_string();
    let header = |name: &str| {
        head.lines().find_map(|l| {
            let (k, v) = l.split_once(": ")?;
            k.eq_ignore_ascii_case(name).then(|| v.to_string())
        })
    };
    let (range, if_range) = (header("range"), header("if-range"));
    let first = {
        let mut log = log.lock().expect("log");
        log.ranges.push(range.clone());
        log.if_ranges.push(if_range.clone());
        log.ranges.len() == 1
    };
    // `If-Range` naming another version of the file: the whole file, as RFC 9110 says.
    let stale = if_range.is_some() && if_range != how.etag;
    if how.missing {
        sock.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .await?;
        return Ok(());
    }
    let start = match (&range, how.ignore_range || stale) {
        (Some(r), false) => r
            .trim_start_matches("bytes=")
            .trim_end_matches('-')
            .parse::<usize>()
            .unwrap_or(0),
        _ => 0,
    };
    let part = &body[start.min(body.len())..];
    let status = if start > 0 {
        format!(
            "206 Partial Content\r\nContent-Range: bytes {start}-{}/{}",
            body.len() - 1,
            body.len()
        )
    } else {
        "200 OK".to_string()
    };
    let etag = match &how.etag {
        Some(e) => format!("ETag: {e}\r\n"),
        None => String::new(),
    };
    sock.write_all(
        format!(
            "HTTP/1.1 {status}\r\n{etag}Content-Length: {}\r\nConnection: close\r\n\r\n",
            part.len()
        )
        .as_bytes(),
    )
    .await?;
    let limit = match how.cut_first_at {
        Some(n) if first => n.min(part.len()),
        _ => part.len(),
    };
    for chunk in part[..limit].chunks(16 << 10) {
        sock.write_all(chunk).await?;
        log.lock().expect("log").served += chunk.len();
        if let Some(d) = how.delay {
            tokio::time::sleep(d).await;
        }
    }
    sock.flush().await?;
    Ok(())
}

/// Deterministic bytes that are not a repeating pattern.
fn file_bytes(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn sha(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn cache_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "hearth-fetch-{tag}-{}-{:?}",
        std::process::id(),
        std::time::SystemTime::now()
    ));
    std::fs::create_dir_all(&d).expect("dir");
    d
}

fn fetcher(cache: &Path, attempts: u32) -> Fetcher {
    Fetcher::new(cache)
        .expect("client")
        .with_retries(attempts, Duration::from_millis(10))
}

/// Every file under `dir`, recursively, but the fetch's lock files (a partial file's `.meta`
/// counts).
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).expect("dir").flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files(&p));
        } else if p.extension().is_none_or(|x| x != "lock") {
            out.push(p);
        }
    }
    out
}

#[tokio::test]
async fn a_download_cut_halfway_resumes_with_range_and_is_verified() {
    let body = file_bytes(1 << 20);
    let server = Server::start(
        body.clone(),
        Behaviour {
            cut_first_at: Some(400_000),
            ..Behaviour::default()
        },
    )
    .await;
    let cache = cache_dir("resume");
    let src = Source::parse(&server.url("tiny.gguf"), Some(&sha(&body))).expect("source");
    let progress = Progress::default();
    let path = fetcher(&cache, 3)
        .fetch(&src, &progress)
        .await
        .expect("fetched");
    assert_eq!(std::fs::read(&path).expect("read"), body);
    assert_eq!(path.file_name().and_then(|n| n.to_str()), Some("tiny.gguf"));
    let ranges = server.ranges();
    assert_eq!(ranges.len(), 2, "{ranges:?}");
    assert_eq!(ranges[0], None);
    let resumed_at: usize = ranges[1]
        .as_deref()
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse().ok())
        .expect("a range");
    assert!(resumed_at > 0 && resumed_at <= 400_000, "{ranges:?}");
    assert_eq!(server.served(), 400_000 + body.len() - resumed_at);
    assert_eq!(
        (progress.done(), progress.total()),
        (1 << 20, Some(1 << 20))
    );
    assert_eq!(files(&cache), vec![path], "no partial file is left");
    let _ = std::fs::remove_dir_all(cache);
}

#[tokio::test]
async fn a_download_left_by_a_failed_fetch_resumes_in_the_next_one() {
    let body = file_bytes(300_000);
    let cut = Server::start(
        body.clone(),
        Behaviour {
            cut_first_at: Some(100_000),
            etag: Some("\"v1\"".into()),
            ..Behaviour::default()
        },
    )
    .await;
    let cache = cache_dir("next-run");
    let src = Source::parse(&cut.url("m.gguf"), None).expect("source");
    // One try only: the fetch fails, and keeps what arrived.
    let e = fetcher(&cache, 1)
        .fetch(&src, &Progress::default())
        .await
        .expect_err("cut");
    let FetchError::Network { kept, attempts, .. } = &e else {
        panic!("{e:?}");
    };
    assert_eq!(*attempts, 1);
    assert!(*kept > 0 && *kept <= 100_000, "{e}");
    assert!(e.to_string().contains("the next fetch resumes"), "{e}");
    let mut left: Vec<String> = files(&cache)
        .iter()
        .filter_map(|p| p.file_name()?.to_str().map(str::to_string))
        .collect();
    left.sort();
    assert_eq!(left, ["m.gguf.partial", "m.gguf.partial.meta"]);

    // The next fetch (a new process would do the same) asks for the rest only.
    let path = fetcher(&cache, 1)
        .fetch(&src, &Progress::default())
        .await
        .expect("resumed");
    assert_eq!(std::fs::read(&path).expect("read"), body);
    assert_eq!(cut.ranges()[1], Some(format!("bytes={kept}-")));
    assert_eq!(cut.if_ranges()[1].as_deref(), Some("\"v1\""));
    let _ = std::fs::remove_dir_all(cache);
}

#[tokio::test]
async fn a_server_that_ignores_range_sends_the_file_again_and_it_starts_over() {
    let body = file_bytes(200_000);
    let server = Server::start(
        body.clone(),
        Behaviour {
            cut_first_at: Some(50_000),
            ignore_range: true,
            ..Behaviour::default()
        },
    )
    .await;
    let cache = cache_dir("ignore-range");
    let src = Source::parse(&server.url("m.gguf"), Some(&sha(&body))).expect("source");
    let path = fetcher(&cache, 3)
        .fetch(&src, &Progress::default())
        .await
        .expect("fetched");
    assert_eq!(std::fs::read(&path).expect("read"), body);
    assert!(server.ranges()[1].is_some(), "it asked for the rest");
    let _ = std::fs::remove_dir_all(cache);
}

#[tokio::test]
async fn a_wrong_checksum_is_refused_and_nothing_is_kept() {
    let body = file_bytes(100_000);
    let server = Server::start(body.clone(), Behaviour::default()).await;
    let cache = cache_dir("checksum");
    let wrong = sha(b"another file");
    let src = Source::parse(&server.url("m.gguf"), Some(&wrong)).expect("source");
    let e = fetcher(&cache, 3)
        .fetch(&src, &Progress::default())
        .await
        .expect_err("mismatch");
    assert_eq!(
        e,
        FetchError::Checksum {
            url: server.url("m.gguf"),
            expected: wrong.clone(),
            got: sha(&body),
            bytes: 100_000,
        }
    );
    assert!(e.to_string().contains("the download was removed"), "{e}");
    assert!(files(&cache).is_empty(), "{:?}", files(&cache));
    let _ = std::fs::remove_dir_all(cache);
}

#[tokio::test]
async fn a_slow_download_shows_its_progress_and_a_fetched_file_is_not_fetched_again() {
    let body = file_bytes(256 << 10);
    let server = Server::start(
        body.clone(),
        Behaviour {
            delay: Some(Duration::from_millis(30)),
            ..Behaviour::default()
        },
    )
    .await;
    let cache = cache_dir("progress");
    let src = Source::parse(&server.url("m.gguf"), Some(&sha(&body))).expect("source");
    let progress = Arc::new(Progress::default());
    let (f, p, s) = (fetcher(&cache, 1), progress.clone(), src.clone());
    let running = tokio::spawn(async move { f.fetch(&s, &p).await });
    let mut seen = Vec::new();
    while !running.is_finished() {
        seen.push((progress.done(), progress.total()));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let path = running.await.expect("task").expect("fetched");
    let total = body.len() as u64;
    assert!(
        seen.iter()
            .any(|&(d, t)| d > 0 && d < total && t == Some(total)),
        "no progress between start and end: {seen:?}"
    );
    // Cached: no second request.
    let again = fetcher(&cache, 1)
        .fetch(&src, &Progress::default())
        .await
        .expect("cached");
    assert_eq!(again, path);
    assert_eq!(server.ranges().len(), 1);
    let _ = std::fs::remove_dir_all(cache);
}

#[tokio::test]
async fn a_missing_file_is_an_error_at_once() {
    let server = Server::start(
        Vec::new(),
        Behaviour {
            missing: true,
            ..Behaviour::default()
        },
    )
    .await;
    let cache = cache_dir("missing");
    let src = Source::parse(&server.url("nope.gguf"), None).expect("source");
    let e = fetcher(&cache, 4)
        .fetch(&src, &Progress::default())
        .await
        .expect_err("404");
    assert_eq!(
        e,
        FetchError::Status {
            url: server.url("nope.gguf"),
            status: 404
        }
    );
    assert_eq!(server.ranges().len(), 1, "not retried");
    let _ = std::fs::remove_dir_all(cache);
}

/// The worker binary, serving `--model URL`: it fetches the file into `<models dir>/fetched/`
/// (once it listens, so its progress shows) and loads it; with a wrong `--model-sha256` it
/// stops, says why, and leaves no model file behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_serves_a_model_given_by_url() {
    use hearth_worker::fixtures::{write_tiny_gguf, TinySpec, WorkerProcess};
    let models = cache_dir("serve");
    let file = models.join("source.gguf");
    write_tiny_gguf(&file, &TinySpec::default()).expect("tiny model");
    let body = std::fs::read(&file).expect("read");
    let server = Server::start(body.clone(), Behaviour::default()).await;
    let bin = Path::new(env!("CARGO_BIN_EXE_hearth-worker"));
    let url = server.url("tiny.gguf");

    let wrong = sha(b"x");
    let out = std::process::Command::new(bin)
        .args(["serve", "--model", &url, "--model-sha256", &wrong])
        .arg("--models-dir")
        .arg(&models)
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("sha256 mismatch"), "{err}");
    let kept: Vec<_> = walk(&models.join("fetched"))
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    assert!(kept.is_empty(), "a refused download was kept: {kept:?}");

    let dir = models.to_string_lossy().to_string();
    let good = sha(&body);
    let args = [
        "--model-sha256",
        &good,
        "--models-dir",
        &dir,
        "--kv-budget",
        "64MiB",
    ];
    let worker = WorkerProcess::spawn(bin, Path::new(&url), &args).expect("worker");
    let mut c = hearth_shared::proto::worker_client::WorkerClient::connect(format!(
        "http://{}",
        worker.grpc
    ))
    .await
    .expect("connect");
    for _ in 0..500 {
        let h = c
            .health(hearth_shared::proto::HealthRequest {})
            .await
            .expect("health")
            .into_inner();
        if h.ready {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let info = c
        .info(hearth_shared::proto::InfoRequest {})
        .await
        .expect("info")
        .into_inner();
    assert_eq!(info.model_id, "tiny", "{info:?}");
    assert!(info.vocab_size > 0, "{info:?}");
    let fetched = models.join(format!("fetched/sha256-{good}/tiny.gguf"));
    assert_eq!(std::fs::read(&fetched).expect("fetched file"), body);
    drop(worker);
    let _ = std::fs::remove_dir_all(models);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_fetches_of_one_file_download_it_once() {
    let body = file_bytes(128 << 10);
    let server = Server::start(
        body.clone(),
        Behaviour {
            delay: Some(Duration::from_millis(20)),
            ..Behaviour::default()
        },
    )
    .await;
    let cache = cache_dir("together");
    let src = Source::parse(&server.url("m.gguf"), Some(&sha(&body))).expect("source");
    let run = |f: Fetcher, s: Source| {
        tokio::spawn(async move { f.fetch(&s, &Progress::default()).await })
    };
    let a = run(fetcher(&cache, 1), src.clone());
    let b = run(fetcher(&cache, 1), src);
    let (a, b) = (a.await.expect("a"), b.await.expect("b"));
    assert_eq!(a.expect("first"), b.expect("second"));
    assert_eq!(
        server.ranges().len(),
        1,
        "the second waited, then found it fetched"
    );
    let _ = std::fs::remove_dir_all(cache);
}

#[tokio::test]
async fn a_file_that_changed_since_the_cut_is_fetched_whole_not_spliced() {
    let (old, new) = (file_bytes(200_000), file_bytes(210_000)[10_000..].to_vec());
    let cut = Behaviour {
        cut_first_at: Some(80_000),
        etag: Some("\"old\"".into()),
        ..Behaviour::default()
    };
    let server = Server::start(old, cut).await;
    let cache = cache_dir("changed");
    let src = Source::parse(&server.url("m.gguf"), None).expect("source");
    fetcher(&cache, 1)
        .fetch(&src, &Progress::default())
        .await
        .expect_err("cut");
    let etag = Some("\"new\"".to_string());
    server.replace(
        new.clone(),
        Behaviour {
            etag,
            ..Behaviour::default()
        },
    );
    let path = fetcher(&cache, 1)
        .fetch(&src, &Progress::default())
        .await
        .expect("fetched");
    assert_eq!(
        std::fs::read(&path).expect("read"),
        new,
        "the new file, whole"
    );
    assert_eq!(server.if_ranges()[1].as_deref(), Some("\"old\""));
    assert_eq!(files(&cache), vec![path], "nothing else is left");
    let _ = std::fs::remove_dir_all(cache);
}

#[tokio::test]
async fn without_a_validator_or_a_checksum_a_cut_download_starts_over() {
    let body = file_bytes(150_000);
    let cut = Behaviour {
        cut_first_at: Some(50_000),
        ..Behaviour::default()
    };
    let server = Server::start(body.clone(), cut).await;
    let cache = cache_dir("no-validator");
    let src = Source::parse(&server.url("m.gguf"), None).expect("source");
    fetcher(&cache, 1)
        .fetch(&src, &Progress::default())
        .await
        .expect_err("cut");
    let path = fetcher(&cache, 1)
        .fetch(&src, &Progress::default())
        .await
        .expect("fetched");
    assert_eq!(std::fs::read(&path).expect("read"), body);
    assert_eq!(
        server.ranges()[1],
        None,
        "nothing tells the kept bytes are of this file"
    );
    let _ = std::fs::remove_dir_all(cache);
}

#[test]
fn urls_are_shown_without_credentials_or_signatures() {
    let u =
        reqwest::Url::parse("https://user:secret@host/m.gguf?X-Amz-Signature=abc").expect("url");
    let s = hearth_worker::fetch::shown(&u);
    assert!(
        !s.contains("secret") && !s.contains("abc") && !s.contains("user"),
        "{s}"
    );
    assert!(s.starts_with("https://host/m.gguf"), "{s}");
}

/// A worker given a model URL with credentials and a signed query, whose server cannot be
/// reached (every try fails; the HTTP client's errors carry the URL) and whose other fetch is
/// cut halfway: nothing the worker prints, at the most verbose log level, holds a secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_log_or_error_shows_a_model_urls_secrets() {
    let bin = Path::new(env!("CARGO_BIN_EXE_hearth-worker"));
    let models = cache_dir("secrets");
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr")
    };
    let body = file_bytes(256 << 10);
    let cut = Behaviour {
        cut_first_at: Some(64 << 10),
        etag: Some("\"v1\"".into()),
        ..Behaviour::default()
    };
    let server = Server::start(body, cut).await;
    for addr in [closed, server.addr] {
        let url = format!("http://alice:pa55word@{addr}/models/m.gguf?X-Amz-Signature=s1gnature");
        // Blocking here is fine: the test server runs on the runtime's worker threads.
        let out = std::process::Command::new(bin)
            .args(["serve", "--model", &url, "--model-sha256", &sha(b"x")])
            .arg("--models-dir")
            .arg(&models)
            .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
            .env("RUST_LOG", "trace")
            .output()
            .expect("run");
        assert!(!out.status.success(), "the fetch cannot succeed");
        let printed = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // The worker did try (and say so), so the lines checked are the ones at stake.
        assert!(printed.contains("model download interrupted"), "{printed}");
        for secret in ["alice", "pa55word", "s1gnature"] {
            let leaks: Vec<&str> = printed.lines().filter(|l| l.contains(secret)).collect();
            assert!(leaks.is_empty(), "{secret} printed: {leaks:#?}");
        }
    }
    let _ = std::fs::remove_dir_all(models);
}

/// Every file under `dir`.
fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}
