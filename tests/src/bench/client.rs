//! One streamed chat request, timed: time to first token, the gaps between tokens, and the
//! usage the server reports. Speaks the OpenAI-compatible API (any such server) and Hearth's
//! native session API.

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::Value;

/// Which API a run speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// `POST /v1/chat/completions` with `stream: true` (Hearth, vLLM, llama.cpp, TGI…).
    Openai,
    /// Hearth's sessions: `POST /v1/sessions/{id}/messages`.
    Native,
}

/// Where requests go.
#[derive(Debug, Clone)]
pub struct Target {
    /// `host:port`, loopback only.
    pub authority: String,
    /// Path prefix before `/v1/…` (empty for most servers).
    pub prefix: String,
    pub api_key: Option<String>,
    pub timeout: Duration,
}

/// What one request measured.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Sample {
    pub ttft_s: Option<f64>,
    /// Gaps between consecutive token events.
    pub itl_s: Vec<f64>,
    pub latency_s: f64,
    pub output_tokens: u64,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub error: Option<String>,
    /// Text of the reply (kept only by the multi-turn workload, which sends it back).
    #[serde(skip)]
    pub text: String,
}

impl Target {
    /// Checks that `url` is `http://` on a loopback host and splits it.
    pub fn parse(url: &str, api_key: Option<String>, timeout: Duration) -> anyhow::Result<Self> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| anyhow!("--url: only http:// URLs are supported"))?;
        let (authority, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        let host = authority
            .rsplit_once(':')
            .map_or(authority, |(h, _)| h)
            .trim_matches(['[', ']']);
        let loopback = host == "localhost"
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback());
        if !loopback {
            bail!(
                "--url: {host} is not a loopback address; hearth-bench only targets this machine"
            );
        }
        let authority = if authority.contains(':') {
            authority.to_string()
        } else {
            format!("{authority}:80")
        };
        Ok(Self {
            authority,
            prefix: prefix.trim_end_matches("/v1").to_string(),
            api_key,
            timeout,
        })
    }

    async fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<hyper::Response<hyper::body::Incoming>> {
        let stream = tokio::net::TcpStream::connect(&self.authority)
            .await
            .with_context(|| format!("cannot connect to {}", self.authority))?;
        stream.set_nodelay(true)?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.prefix))
            .header("host", &self.authority)
            .header("accept", "text/event-stream, application/json");
        if let Some(k) = &self.api_key {
            req = req.header("authorization", format!("Bearer {k}"));
        }
        let payload = match body {
            Some(b) => {
                req = req.header("content-type", "application/json");
                Bytes::from(b.to_string())
            }
            None => Bytes::new(),
        };
        Ok(sender.send_request(req.body(Full::new(payload))?).await?)
    }

    /// A JSON request; the body of a 2xx answer.
    pub async fn json(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<Value> {
        let resp = tokio::time::timeout(self.timeout, async {
            let resp = self.send(method, path, body).await?;
            let status = resp.status();
            let bytes = resp.into_body().collect().await?.to_bytes();
            anyhow::Ok((status, bytes))
        })
        .await
        .map_err(|_| anyhow!("{method} {path}: no answer within {:?}", self.timeout))??;
        let (status, bytes) = resp;
        let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        if !status.is_success() {
            bail!(
                "{method} {path}: {status}: {}",
                String::from_utf8_lossy(&bytes)
            );
        }
        Ok(v)
    }

    /// Sends a streaming request and times its events.
    pub async fn stream(&self, api: Api, path: &str, body: &Value) -> Sample {
        let started = Instant::now();
        let mut sample = Sample::default();
        let run = self.stream_inner(api, path, body, started, &mut sample);
        match tokio::time::timeout(self.timeout, run).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => sample.error = Some(format!("{e:#}")),
            Err(_) => sample.error = Some(format!("timed out after {:?}", self.timeout)),
        }
        sample.latency_s = started.elapsed().as_secs_f64();
        sample
    }

    async fn stream_inner(
        &self,
        api: Api,
        path: &str,
        body: &Value,
        started: Instant,
        s: &mut Sample,
    ) -> anyhow::Result<()> {
        let resp = self.send("POST", path, Some(body)).await?;
        let status = resp.status();
        let mut body = resp.into_body();
        if !status.is_success() {
            let bytes = body.collect().await?.to_bytes();
            bail!("{status}: {}", String::from_utf8_lossy(&bytes));
        }
        let mut buf: Vec<u8> = Vec::new();
        let mut last_token: Option<Instant> = None;
        let mut counted = 0u64;
        while let Some(frame) = body.frame().await {
            let Ok(data) = frame?.into_data() else {
                continue;
            };
            buf.extend_from_slice(&data);
            while let Some(at) = buf.windows(2).position(|w| w == b"\n\n") {
                let raw: Vec<u8> = buf.drain(..at + 2).collect();
                let text = String::from_utf8_lossy(&raw);
                let (event, data) = parse_event(&text);
                let step = match api {
                    Api::Openai => openai_event(&data, s)?,
                    Api::Native => native_event(&event, &data, s)?,
                };
                match step {
                    Step::Token(t) => {
                        let now = Instant::now();
                        match last_token {
                            None => s.ttft_s = Some(now.duration_since(started).as_secs_f64()),
                            Some(prev) => s.itl_s.push(now.duration_since(prev).as_secs_f64()),
                        }
                        last_token = Some(now);
                        counted += 1;
                        s.text.push_str(&t);
                    }
                    Step::Done => {
                        if s.output_tokens == 0 {
                            s.output_tokens = counted;
                        }
                        return Ok(());
                    }
                    Step::Other => {}
                }
            }
        }
        bail!("the stream ended without a final event")
    }
}

enum Step {
    Token(String),
    Done,
    Other,
}

fn parse_event(text: &str) -> (String, String) {
    let mut event = String::new();
    let mut data = String::new();
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("event:") {
            event = v.trim().to_string();
        } else if let Some(v) = line.strip_prefix("data:") {
            if !data.is_empty() {
                data.push('\n');
            }
            data.push_str(v.strip_prefix(' ').unwrap_or(v));
        }
    }
    (event, data)
}

fn usage(u: &Value, s: &mut Sample) {
    if let Some(n) = u["completion_tokens"].as_u64() {
        s.output_tokens = n;
    }
    s.prompt_tokens = u["prompt_tokens"].as_u64().or(s.prompt_tokens);
    s.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .or(u["cached_tokens"].as_u64())
        .or(s.cached_tokens);
}

fn openai_event(data: &str, s: &mut Sample) -> anyhow::Result<Step> {
    if data.is_empty() {
        return Ok(Step::Other);
    }
    if data == "[DONE]" {
        return Ok(Step::Done);
    }
    let v: Value = serde_json::from_str(data).context("a chunk that is not JSON")?;
    if let Some(e) = v.get("error") {
        bail!("{}", e["message"].as_str().unwrap_or("error event"));
    }
    if v["usage"].is_object() {
        usage(&v["usage"], s);
    }
    match v["choices"][0]["delta"]["content"].as_str() {
        Some(t) if !t.is_empty() => Ok(Step::Token(t.to_string())),
        _ => Ok(Step::Other),
    }
}

fn native_event(event: &str, data: &str, s: &mut Sample) -> anyhow::Result<Step> {
    match event {
        "token" => {
            let v: Value = serde_json::from_str(data)?;
            Ok(Step::Token(
                v["text"].as_str().unwrap_or_default().to_string(),
            ))
        }
        "message_end" => {
            let v: Value = serde_json::from_str(data)?;
            usage(&v["usage"], s);
            Ok(Step::Done)
        }
        "error" => {
            let v: Value = serde_json::from_str(data).unwrap_or(Value::Null);
            bail!("{}", v["message"].as_str().unwrap_or(data))
        }
        _ => Ok(Step::Other),
    }
}
