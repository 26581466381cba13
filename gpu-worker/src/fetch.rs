//! Model files from HTTP(S) into the models cache.
//!
//! A model given as a URL is fetched into `<cache>/<key>/<file name>`, where the key is the
//! expected sha256 when one is given (`sha256-<hex>`) and a hash of the URL otherwise. The bytes
//! go to `<file name>.partial` first:
//! - a download that is cut (the connection drops, the server closes early, a 5xx) resumes from
//!   the bytes already written, with `Range`, a few times in a row and again on the next run;
//! - a server that ignores `Range` sends the whole file again, and the partial file starts over;
//! - the sha256 of the whole file is checked before it is renamed to its final name, so no
//!   partial or corrupt file is ever taken as ready. A mismatch removes the download.
//!
//! Processes that share the cache fetch a file one at a time (a lock file beside it).
//!
//! Progress is a bar on a terminal (indicatif), a log line every few seconds otherwise, and a
//! [`Progress`] that others can read while the fetch runs.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use reqwest::header::{CONTENT_RANGE, IF_RANGE, RANGE};
use reqwest::StatusCode;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Where a model file comes from: an HTTP(S) URL, and the sha256 its bytes must have. Its
/// `Debug` shows the URL as [`shown`] does: a configuration printed whole leaks no secret.
#[derive(Clone, PartialEq, Eq)]
pub struct Source {
    url: reqwest::Url,
    sha256: Option<String>,
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Source")
            .field("url", &shown(&self.url))
            .field("sha256", &self.sha256)
            .finish()
    }
}

/// What an HTTP client's error says, without the URL it carries (credentials and a signed
/// query included).
fn reason(e: reqwest::Error) -> String {
    e.without_url().to_string()
}

/// Whether `s` names a model by URL (`http://` or `https://`) rather than by path.
pub fn is_url(s: &str) -> bool {
    s.starts_with("http://") || s.starts_with("https://")
}

impl Source {
    /// `url` (http or https) and, if given, the file's sha256 as 64 hex digits.
    pub fn parse(url: &str, sha256: Option<&str>) -> Result<Self, FetchError> {
        let bad = |why: String| FetchError::BadSource(why);
        // The text is not shown back: a URL that does not parse may still hold a secret.
        let url = reqwest::Url::parse(url)
            .map_err(|e| bad(format!("the model URL does not parse: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(bad(format!(
                "{}: only http and https URLs can be fetched",
                shown(&url)
            )));
        }
        let sha256 = sha256
            .map(|h| {
                let h = h.trim().to_ascii_lowercase();
                if h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()) {
                    Ok(h)
                } else {
                    Err(bad(format!("sha256: `{h}` is not 64 hex digits")))
                }
            })
            .transpose()?;
        Ok(Self { url, sha256 })
    }

    pub fn url(&self) -> &reqwest::Url {
        &self.url
    }

    /// The URL's last path segment, as a safe file name (`model` when it has none).
    fn file_name(&self) -> String {
        let last = self
            .url
            .path_segments()
            .and_then(|mut s| s.next_back())
            .unwrap_or_default();
        let name: String = last
            .chars()
            .map(|c| match c {
                'a'..='z' | 'A'..='Z' | '0'..='9' | '.' | '_' | '-' => c,
                _ => '_',
            })
            .collect();
        match name.trim_start_matches('.') {
            "" => "model".into(),
            n => n.to_string(),
        }
    }

    /// The cache directory's name for this source.
    fn key(&self) -> String {
        match &self.sha256 {
            Some(h) => format!("sha256-{h}"),
            None => format!("url-{}", &hex(&Sha256::digest(self.url.as_str()))[..32]),
        }
    }
}

/// How far a fetch has come: bytes on disk, and the file's size once the server has said it.
#[derive(Debug, Default)]
pub struct Progress {
    done: AtomicU64,
    /// 0 until known.
    total: AtomicU64,
}

impl Progress {
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    pub fn total(&self) -> Option<u64> {
        match self.total.load(Ordering::Relaxed) {
            0 => None,
            t => Some(t),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FetchError {
    #[error("{0}")]
    BadSource(String),
    /// An answer that another try would not change (404, 403, …).
    #[error("{url}: the server answered {status}")]
    Status { url: String, status: u16 },
    /// Every try was cut or refused for a passing reason; what arrived is kept for the next run.
    #[error("{url}: {reason} (gave up after {attempts} tries; {kept} bytes kept, the next fetch resumes from them)")]
    Network {
        url: String,
        reason: String,
        attempts: u32,
        kept: u64,
    },
    #[error("{url}: sha256 mismatch: expected {expected}, got {got} over {bytes} bytes; the download was removed")]
    Checksum {
        url: String,
        expected: String,
        got: String,
        bytes: u64,
    },
    #[error("{path}: {reason}")]
    Io { path: String, reason: String },
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> FetchError + '_ {
    move |e| FetchError::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

/// Why one try ended early.
enum TryEnd {
    /// Worth another try (from where the file stands).
    Again(String),
    Fatal(FetchError),
}

/// Fetches sources into a cache directory.
#[derive(Debug, Clone)]
pub struct Fetcher {
    client: reqwest::Client,
    cache: PathBuf,
    attempts: u32,
    backoff: Duration,
}

/// The partial file of one fetch and what has been written to it.
struct Partial {
    path: PathBuf,
    bytes: u64,
    hasher: Sha256,
    /// What the server said of the file whose bytes these are (kept in `<partial>.meta`), so
    /// a resume asks for the rest of the same file (`If-Range`).
    meta: Meta,
}

/// The file's strong validator (an `ETag`, else `Last-Modified`) and size, as its server gave
/// them.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Meta {
    validator: Option<String>,
    total: Option<u64>,
}

impl Partial {
    /// The partial file an earlier run left, hashed so far (or an empty one).
    async fn open(path: PathBuf) -> Result<Self, FetchError> {
        let mut hasher = Sha256::new();
        let mut bytes = 0u64;
        match tokio::fs::File::open(&path).await {
            Ok(mut f) => {
                let mut buf = vec![0u8; 1 << 20];
                loop {
                    let n = f.read(&mut buf).await.map_err(io_err(&path))?;
                    if n == 0 {
                        break;
                    }
                    hasher.update(&buf[..n]);
                    bytes += n as u64;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&path)(e)),
        }
        let meta = tokio::fs::read(meta_path(&path))
            .await
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        Ok(Self {
            path,
            bytes,
            hasher,
            meta,
        })
    }

    /// Starts over: the server sends the whole file again.
    fn restart(&mut self) {
        self.bytes = 0;
        self.hasher = Sha256::new();
        self.meta = Meta::default();
    }

    async fn save_meta(&self) -> Result<(), FetchError> {
        let path = meta_path(&self.path);
        let text = serde_json::to_vec(&self.meta).unwrap_or_default();
        tokio::fs::write(&path, text).await.map_err(io_err(&path))
    }

    /// Removes the partial file and what is known of it.
    async fn remove(&self) {
        let _ = tokio::fs::remove_file(&self.path).await;
        let _ = tokio::fs::remove_file(meta_path(&self.path)).await;
    }
}

fn meta_path(partial: &Path) -> PathBuf {
    let mut p = partial.as_os_str().to_owned();
    p.push(".meta");
    PathBuf::from(p)
}

/// `url` as logs and errors show it: without credentials or a query (a signed URL's signature).
pub fn shown(url: &reqwest::Url) -> String {
    let mut u = url.clone();
    let _ = u.set_username("");
    let _ = u.set_password(None);
    if u.query().is_some() {
        u.set_query(Some("…"));
    }
    u.to_string()
}

/// The response's strong validator: an `ETag` that is not weak, else `Last-Modified`.
fn validator(resp: &reqwest::Response) -> Option<String> {
    let h = resp.headers();
    let etag = h
        .get(reqwest::header::ETAG)
        .and_then(|v| v.to_str().ok())
        .filter(|e| !e.starts_with("W/"));
    etag.or_else(|| {
        h.get(reqwest::header::LAST_MODIFIED)
            .and_then(|v| v.to_str().ok())
    })
    .map(str::to_string)
}

impl Fetcher {
    /// Fetches into `cache` (created when needed), with 4 tries per fetch.
    pub fn new(cache: &Path) -> Result<Self, FetchError> {
        let client = reqwest::Client::builder()
            .user_agent(concat!("hearth-worker/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(Duration::from_secs(10))
            .read_timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| FetchError::BadSource(format!("the HTTP client: {e}")))?;
        Ok(Self {
            client,
            cache: cache.to_path_buf(),
            attempts: 4,
            backoff: Duration::from_secs(1),
        })
    }

    /// `attempts` tries per fetch (at least 1), waiting `backoff` times the try's number
    /// between them.
    pub fn with_retries(mut self, attempts: u32, backoff: Duration) -> Self {
        self.attempts = attempts.max(1);
        self.backoff = backoff;
        self
    }

    /// Where `src`'s file is once fetched.
    pub fn cached_path(&self, src: &Source) -> PathBuf {
        self.cache.join(src.key()).join(src.file_name())
    }

    /// The file, fetched unless the cache holds it already, verified against the source's
    /// sha256 when it has one.
    pub async fn fetch(&self, src: &Source, progress: &Progress) -> Result<PathBuf, FetchError> {
        let done = self.cached_path(src);
        if tokio::fs::try_exists(&done).await.unwrap_or(false) {
            tracing::info!(url = %shown(&src.url), path = %done.display(), "model file already fetched");
            return Ok(done);
        }
        let dir = done.parent().unwrap_or(&self.cache).to_path_buf();
        tokio::fs::create_dir_all(&dir)
            .await
            .map_err(io_err(&dir))?;
        // One fetch of a file at a time, across processes sharing the cache: the others wait,
        // then find it fetched.
        let _lock = lock(dir.join(format!("{}.lock", src.file_name()))).await?;
        if tokio::fs::try_exists(&done).await.unwrap_or(false) {
            return Ok(done);
        }
        let mut part = Partial::open(dir.join(format!("{}.partial", src.file_name()))).await?;
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(src.file_name());
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.try_once(src, &mut part, progress, &bar).await {
                Ok(()) => break,
                Err(TryEnd::Fatal(e)) => {
                    bar.abandon();
                    return Err(e);
                }
                Err(TryEnd::Again(reason)) if attempt < self.attempts => {
                    tracing::warn!(url = %shown(&src.url), %reason, kept = part.bytes, attempt, "model download interrupted; resuming");
                    tokio::time::sleep(self.backoff * attempt).await;
                }
                Err(TryEnd::Again(reason)) => {
                    bar.abandon();
                    return Err(FetchError::Network {
                        url: shown(&src.url),
                        reason,
                        attempts: attempt,
                        kept: part.bytes,
                    });
                }
            }
        }
        bar.finish();
        self.finish(src, part, &done).await
    }

    /// Checks the whole file's sha256 and gives it its final name.
    async fn finish(
        &self,
        src: &Source,
        part: Partial,
        done: &Path,
    ) -> Result<PathBuf, FetchError> {
        let got = hex(&part.hasher.clone().finalize());
        if let Some(expected) = src.sha256.as_ref().filter(|e| **e != got) {
            part.remove().await;
            return Err(FetchError::Checksum {
                url: shown(&src.url),
                expected: expected.clone(),
                got,
                bytes: part.bytes,
            });
        }
        tokio::fs::rename(&part.path, done)
            .await
            .map_err(io_err(done))?;
        let _ = tokio::fs::remove_file(meta_path(&part.path)).await;
        tracing::info!(url = %shown(&src.url), path = %done.display(), bytes = part.bytes, sha256 = %got, "model file fetched");
        Ok(done.to_path_buf())
    }

    /// One request: from where the partial file stands to the end, or until it is cut.
    async fn try_once(
        &self,
        src: &Source,
        part: &mut Partial,
        progress: &Progress,
        bar: &ProgressBar,
    ) -> Result<(), TryEnd> {
        let mut req = self.client.get(src.url.clone());
        if part.bytes > 0 {
            match (&part.meta.validator, &src.sha256) {
                // The rest of the same file, or (the file changed) the whole new one.
                (Some(v), _) => {
                    req = req
                        .header(RANGE, format!("bytes={}-", part.bytes))
                        .header(IF_RANGE, v.as_str());
                }
                // The checksum will tell whether the pieces belong together.
                (None, Some(_)) => req = req.header(RANGE, format!("bytes={}-", part.bytes)),
                // Nothing would tell a changed file from the same one: start over.
                (None, None) => {
                    tracing::info!(url = %shown(&src.url), "the server gave no validator to resume against; fetching the whole file again");
                    part.restart();
                }
            }
        }
        let resp = req.send().await.map_err(|e| TryEnd::Again(reason(e)))?;
        let total = match resp.status() {
            StatusCode::PARTIAL_CONTENT => {
                let (start, total) = content_range(&resp).unwrap_or((u64::MAX, None));
                let resized = part.meta.total.is_some() && total != part.meta.total;
                if start != part.bytes || resized {
                    // Not the range asked for: start over with the whole file.
                    part.restart();
                    return Err(TryEnd::Again(format!(
                        "the server resumed at byte {start} of {total:?}, not {} of {:?}",
                        part.bytes, part.meta.total
                    )));
                }
                total
            }
            StatusCode::OK => {
                if part.bytes > 0 {
                    tracing::info!(url = %shown(&src.url), "the server ignored the range; fetching the whole file again");
                    part.restart();
                }
                resp.content_length()
            }
            StatusCode::RANGE_NOT_SATISFIABLE => {
                // The partial file holds the whole file already, or more than there is.
                let total = content_range(&resp).and_then(|(_, t)| t);
                if total == Some(part.bytes) {
                    return Ok(());
                }
                part.restart();
                return Err(TryEnd::Again("the kept bytes do not fit the file".into()));
            }
            s if s.is_server_error()
                || s == StatusCode::TOO_MANY_REQUESTS
                || s == StatusCode::REQUEST_TIMEOUT =>
            {
                return Err(TryEnd::Again(format!("the server answered {s}")));
            }
            s => {
                return Err(TryEnd::Fatal(FetchError::Status {
                    url: shown(&src.url),
                    status: s.as_u16(),
                }))
            }
        };
        part.meta = Meta {
            validator: validator(&resp),
            total,
        };
        part.save_meta().await.map_err(TryEnd::Fatal)?;
        self.receive(src, resp, part, total, progress, bar).await
    }

    /// Writes the response's body after the partial file's bytes.
    async fn receive(
        &self,
        src: &Source,
        mut resp: reqwest::Response,
        part: &mut Partial,
        total: Option<u64>,
        progress: &Progress,
        bar: &ProgressBar,
    ) -> Result<(), TryEnd> {
        let fatal = |e: std::io::Error| TryEnd::Fatal(io_err(&part.path)(e));
        let mut file = tokio::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(part.bytes > 0)
            .truncate(part.bytes == 0)
            .open(&part.path)
            .await
            .map_err(|e| TryEnd::Fatal(io_err(&part.path)(e)))?;
        if let Some(t) = total {
            progress.total.store(t, Ordering::Relaxed);
            bar.set_length(t);
        }
        bar.set_position(part.bytes);
        let mut logged = Instant::now();
        let cut = loop {
            match resp.chunk().await {
                Ok(Some(bytes)) => {
                    if let Err(e) = file.write_all(&bytes).await {
                        return Err(fatal(e));
                    }
                    part.hasher.update(&bytes);
                    part.bytes += bytes.len() as u64;
                    progress.done.store(part.bytes, Ordering::Relaxed);
                    bar.set_position(part.bytes);
                    if logged.elapsed() >= Duration::from_secs(5) && bar.is_hidden() {
                        logged = Instant::now();
                        tracing::info!(url = %shown(&src.url), done = part.bytes, total, "fetching the model file");
                    }
                }
                Ok(None) => break None,
                Err(e) => break Some(reason(e)),
            }
        };
        // What arrived stays on disk for the next try, even when the connection was cut.
        if let Err(e) = file.flush().await {
            return Err(fatal(e));
        }
        if let Err(e) = file.sync_data().await {
            return Err(fatal(e));
        }
        if let Some(reason) = cut {
            return Err(TryEnd::Again(format!(
                "cut after {} bytes: {reason}",
                part.bytes
            )));
        }
        match total {
            Some(t) if part.bytes < t => Err(TryEnd::Again(format!(
                "the connection closed at {} of {t} bytes",
                part.bytes
            ))),
            _ => Ok(()),
        }
    }
}

/// An exclusive lock on `path` (created if needed), held until the file is dropped.
async fn lock(path: PathBuf) -> Result<std::fs::File, FetchError> {
    tokio::task::spawn_blocking(move || {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(io_err(&path))?;
        f.lock().map_err(io_err(&path))?;
        Ok(f)
    })
    .await
    .map_err(|e| FetchError::Io {
        path: "the cache lock".into(),
        reason: e.to_string(),
    })?
}

/// A `Content-Range: bytes START-END/TOTAL` (or `bytes */TOTAL`) header's start and total.
fn content_range(resp: &reqwest::Response) -> Option<(u64, Option<u64>)> {
    let v = resp.headers().get(CONTENT_RANGE)?.to_str().ok()?;
    let rest = v.strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let total = total.trim().parse().ok();
    let start = match range.split_once('-') {
        Some((s, _)) => s.trim().parse().ok()?,
        None => 0,
    };
    Some((start, total))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_checked_and_named_safely() {
        let s = Source::parse("https://example.org/m/gemma%203.gguf?x=1", None).expect("ok");
        assert_eq!(s.file_name(), "gemma_203.gguf");
        assert!(s.key().starts_with("url-") && s.key().len() == 36);
        let sha = "AB".repeat(32);
        let pinned = Source::parse("http://h/x.gguf", Some(&sha)).expect("ok");
        assert_eq!(pinned.key(), format!("sha256-{}", "ab".repeat(32)));
        assert_eq!(
            Source::parse("http://h/", None).expect("ok").file_name(),
            "model"
        );
        assert_eq!(
            Source::parse("http://h/..", None).expect("ok").file_name(),
            "model"
        );
        for (url, sha) in [
            ("ftp://h/x", None),
            ("not a url", None),
            ("http://h/x", Some("abc")),
            ("http://h/x", Some(&*"g".repeat(64))),
        ] {
            assert!(
                matches!(Source::parse(url, sha), Err(FetchError::BadSource(_))),
                "{url} {sha:?}"
            );
        }
        assert!(is_url("https://h/x") && !is_url("/models/x.gguf"));
    }
}
