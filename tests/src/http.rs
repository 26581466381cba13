//! A small HTTP/1.1 client over a real socket: whole responses (chunked or not) and
//! Server-Sent Event streams read event by event ([`Req`]), and requests written byte for byte,
//! malformed ones included, whose failures are reported rather than panicked on ([`RawRequest`]).

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }

    /// `Retry-After` in seconds; panics when the answer has none.
    pub fn retry_after_secs(&self) -> u64 {
        self.header("retry-after")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no Retry-After seconds on {}: {}", self.status, self.text()))
    }
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// A request on a fresh connection.
#[derive(Debug, Clone)]
pub struct Req<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub key: Option<&'a str>,
    pub headers: Vec<(&'a str, String)>,
    pub body: Option<Vec<u8>>,
}

impl<'a> Req<'a> {
    pub fn new(method: &'a str, path: &'a str) -> Self {
        Self {
            method,
            path,
            key: None,
            headers: Vec::new(),
            body: None,
        }
    }

    pub fn key(mut self, key: Option<&'a str>) -> Self {
        self.key = key;
        self
    }

    pub fn json(mut self, v: &Value) -> Self {
        self.body = Some(v.to_string().into_bytes());
        self
    }

    pub fn raw(mut self, b: Vec<u8>) -> Self {
        self.body = Some(b);
        self
    }

    pub fn header(mut self, k: &'a str, v: impl Into<String>) -> Self {
        self.headers.push((k, v.into()));
        self
    }

    async fn open(&self, addr: SocketAddr) -> (BufReader<TcpStream>, u16, Vec<(String, String)>) {
        self.try_open(addr)
            .await
            .unwrap_or_else(|e| panic!("{} {} at {addr}: {e}", self.method, self.path))
    }

    /// Sends the request and reads the answer's status line and headers; an error for a
    /// connection that fails (for the tests that break servers on purpose).
    async fn try_open(
        &self,
        addr: SocketAddr,
    ) -> std::io::Result<(BufReader<TcpStream>, u16, Vec<(String, String)>)> {
        let mut c = TcpStream::connect(addr).await?;
        let mut head = format!(
            "{} {} HTTP/1.1\r\nConnection: close\r\n",
            self.method, self.path
        );
        // The address connected to, as real clients send it, unless the test names its own.
        if !self
            .headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("host"))
        {
            head += &format!("Host: {addr}\r\n");
        }
        if let Some(k) = self.key {
            head += &format!("Authorization: Bearer {k}\r\n");
        }
        for (k, v) in &self.headers {
            head += &format!("{k}: {v}\r\n");
        }
        if let Some(b) = &self.body {
            head += &format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                b.len()
            );
        }
        head += "\r\n";
        c.write_all(head.as_bytes()).await?;
        if let Some(b) = &self.body {
            c.write_all(b).await?;
        }
        let mut r = BufReader::new(c);
        let mut line = String::new();
        r.read_line(&mut line).await?;
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("no status in `{line}`")))?;
        let mut headers = Vec::new();
        loop {
            line.clear();
            if r.read_line(&mut line).await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                headers.push((k.trim().to_string(), v.trim().to_string()));
            }
        }
        Ok((r, status, headers))
    }

    /// The response as an event stream, or the error of a connection that failed.
    pub async fn try_events(&self, addr: SocketAddr) -> std::io::Result<Sse> {
        let (r, status, headers) = self.try_open(addr).await?;
        let chunked = header(&headers, "transfer-encoding").is_some_and(|v| v.contains("chunked"));
        Ok(Sse {
            r,
            chunked,
            status,
            headers,
            buf: Vec::new(),
            done: false,
        })
    }

    /// The whole response, or the error of a connection that failed; at most `within`.
    pub async fn try_send(&self, addr: SocketAddr, within: Duration) -> std::io::Result<Reply> {
        let fut = async {
            let mut sse = self.try_events(addr).await?;
            let body = sse.body().await;
            Ok(Reply {
                status: sse.status,
                headers: std::mem::take(&mut sse.headers),
                body: body.into_bytes(),
            })
        };
        tokio::time::timeout(within, fut)
            .await
            .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
    }

    /// The whole response.
    pub async fn send(&self, addr: SocketAddr) -> Reply {
        let fut = async {
            let (mut r, status, headers) = self.open(addr).await;
            let chunked =
                header(&headers, "transfer-encoding").is_some_and(|v| v.contains("chunked"));
            let mut body = Vec::new();
            if chunked {
                while let Some(c) = read_chunk(&mut r).await {
                    body.extend(c);
                }
            } else {
                r.read_to_end(&mut body).await.expect("body");
            }
            Reply {
                status,
                headers,
                body,
            }
        };
        tokio::time::timeout(Duration::from_secs(60), fut)
            .await
            .unwrap_or_else(|_| panic!("{} {} took over 60 s", self.method, self.path))
    }

    /// The response as an event stream.
    pub async fn events(&self, addr: SocketAddr) -> Sse {
        let (r, status, headers) = self.open(addr).await;
        let chunked = header(&headers, "transfer-encoding").is_some_and(|v| v.contains("chunked"));
        Sse {
            r,
            chunked,
            status,
            headers,
            buf: Vec::new(),
            done: false,
        }
    }
}

async fn read_chunk(r: &mut BufReader<TcpStream>) -> Option<Vec<u8>> {
    let mut line = String::new();
    if r.read_line(&mut line).await.ok()? == 0 {
        return None;
    }
    let size = usize::from_str_radix(line.trim(), 16).ok()?;
    if size == 0 {
        return None;
    }
    let mut data = vec![0u8; size + 2];
    r.read_exact(&mut data).await.ok()?;
    data.truncate(size);
    Some(data)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub id: Option<String>,
    pub event: String,
    pub data: String,
}

impl Event {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.data).unwrap_or(Value::Null)
    }
}

#[derive(Debug)]
pub struct Sse {
    r: BufReader<TcpStream>,
    chunked: bool,
    pub status: u16,
    pub headers: Vec<(String, String)>,
    buf: Vec<u8>,
    done: bool,
}

impl Sse {
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }

    /// The next event (keep-alive comments skipped); `None` when the stream ends. Panics if
    /// nothing arrives for 60 s.
    pub async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(at) = find(&self.buf, b"\n\n") {
                let raw: Vec<u8> = self.buf.drain(..at + 2).collect();
                let text = String::from_utf8(raw).expect("events are UTF-8");
                if let Some(e) = parse(&text) {
                    return Some(e);
                }
                continue;
            }
            if self.done {
                return None;
            }
            let more = tokio::time::timeout(Duration::from_secs(60), self.read())
                .await
                .expect("no event for 60 s");
            match more {
                Some(b) => self.buf.extend(b),
                None => self.done = true,
            }
        }
    }

    async fn read(&mut self) -> Option<Vec<u8>> {
        if self.chunked {
            return read_chunk(&mut self.r).await;
        }
        let mut b = vec![0u8; 4096];
        let n = self.r.read(&mut b).await.ok()?;
        (n > 0).then(|| {
            b.truncate(n);
            b
        })
    }

    /// The rest of the body as text: what a response that is not a stream says (an error).
    pub async fn body(&mut self) -> String {
        let mut all = std::mem::take(&mut self.buf);
        while !self.done {
            match self.read().await {
                Some(b) => all.extend(b),
                None => self.done = true,
            }
        }
        String::from_utf8_lossy(&all).into_owned()
    }

    /// Every remaining event.
    pub async fn rest(&mut self) -> Vec<Event> {
        let mut out = Vec::new();
        while let Some(e) = self.next().await {
            out.push(e);
        }
        out
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn parse(text: &str) -> Option<Event> {
    let mut e = Event {
        id: None,
        event: "message".into(),
        data: String::new(),
    };
    let mut any = false;
    for line in text.lines() {
        if line.starts_with(':') || line.is_empty() {
            continue;
        }
        let (k, v) = line.split_once(':').unwrap_or((line, ""));
        let v = v.strip_prefix(' ').unwrap_or(v);
        any = true;
        match k {
            "id" => e.id = Some(v.to_string()),
            "event" => e.event = v.to_string(),
            "data" => {
                if !e.data.is_empty() {
                    e.data.push('\n');
                }
                e.data.push_str(v);
            }
            _ => {}
        }
    }
    any.then_some(e)
}

/// A request sent exactly as given: any method and path, header values of any bytes but CR and
/// LF, and the body with `Content-Length` or chunked. Nothing is added but `Host: test` and
/// `Connection: close`.
#[derive(Debug, Clone, Copy)]
pub struct RawRequest<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub headers: &'a [(String, Vec<u8>)],
    pub body: Option<&'a [u8]>,
    /// Send the body with `Transfer-Encoding: chunked` instead of `Content-Length`.
    pub chunked: bool,
}

impl RawRequest<'_> {
    fn bytes(&self) -> Vec<u8> {
        let mut head = format!(
            "{} {} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n",
            self.method, self.path
        )
        .into_bytes();
        for (k, v) in self.headers {
            head.extend_from_slice(k.as_bytes());
            head.extend_from_slice(b": ");
            head.extend_from_slice(v);
            head.extend_from_slice(b"\r\n");
        }
        let mut payload = Vec::new();
        if let Some(b) = self.body {
            if self.chunked {
                head.extend_from_slice(b"Transfer-Encoding: chunked\r\n");
                for piece in b.chunks(64 << 10) {
                    payload.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
                    payload.extend_from_slice(piece);
                    payload.extend_from_slice(b"\r\n");
                }
                payload.extend_from_slice(b"0\r\n\r\n");
            } else {
                head.extend_from_slice(format!("Content-Length: {}\r\n", b.len()).as_bytes());
                payload.extend_from_slice(b);
            }
        }
        head.extend_from_slice(b"\r\n");
        head.extend(payload);
        head
    }

    /// Sends it on a fresh connection and reads the answer, within 20 s. The body is written
    /// while the answer is read, so a server that answers before reading all of it (413, 415,
    /// 401) is heard. A connection closed before a whole answer, or no answer, is an `Err`.
    pub async fn send(&self, addr: SocketAddr) -> Result<Reply, String> {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let (mut rd, mut wr) = stream.into_split();
        let bytes = self.bytes();
        let writer = tokio::spawn(async move {
            // The server may close early (it answered already): that is not the test's failure.
            let _ = wr.write_all(&bytes).await;
            let _ = wr.flush().await;
            wr
        });
        let read = async {
            let mut buf = Vec::new();
            let mut chunk = vec![0u8; 64 << 10];
            loop {
                if let Some(a) = parse_reply(&buf, false) {
                    return Ok(a);
                }
                match rd.read(&mut chunk).await {
                    Ok(0) => return parse_reply(&buf, true).ok_or_else(|| closed(&buf)),
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    Err(e) => {
                        return parse_reply(&buf, true)
                            .ok_or_else(|| format!("{e} after {}", closed(&buf)))
                    }
                }
            }
        };
        let answer = tokio::time::timeout(Duration::from_secs(20), read)
            .await
            .map_err(|_| "no complete answer within 20 s (hung)".to_string())?;
        writer.abort();
        answer
    }
}

/// A chunked body, decoded; `None` until the last chunk has arrived.
fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = find(b, b"\r\n")?;
        let size_text = std::str::from_utf8(&b[..eol]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        b = &b[eol + 2..];
        if size == 0 {
            return Some(out);
        }
        if b.len() < size + 2 {
            return None;
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

/// The response in `buf`, once all of it has arrived (`eof`: the server closed the connection).
fn parse_reply(buf: &[u8], eof: bool) -> Option<Reply> {
    let end = find(buf, b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let rest = &buf[end + 4..];
    let body = if header(&headers, "transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        dechunk(rest)?
    } else if let Some(n) = header(&headers, "content-length").and_then(|v| v.parse().ok()) {
        if rest.len() < n {
            return None;
        }
        rest[..n].to_vec()
    } else if eof {
        rest.to_vec()
    } else {
        return None;
    };
    Some(Reply {
        status,
        headers,
        body,
    })
}

fn closed(buf: &[u8]) -> String {
    format!(
        "connection closed with an incomplete answer: {:?}",
        String::from_utf8_lossy(&buf[..buf.len().min(300)])
    )
}
