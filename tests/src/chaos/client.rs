//! A chaos run's client: one session, a few turns in it, through whichever replica it picks,
//! as a careful real client would. A stream that breaks, or falls silent for [`STALL`], is
//! resumed on another replica with `Last-Event-ID`; a resume answered 404 (no replica has the
//! reply's stream any more) looks for the reply in the history, and a reply found ended there
//! ends the turn, as the web UI does; a turn whose post failed is looked for in the session's
//! history before it is posted again (so a turn the server stored is not sent twice).
//! Everything it receives is logged, with the time, for the history checker.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::time::Instant;

use crate::http::{Req, Sse};
use crate::rng::Rng;

/// A stream with no event for this long is taken for broken: its replica may be stopped.
pub const STALL: Duration = Duration::from_secs(4);

/// How many resumes a turn's log describes.
pub const KEPT_RESUMES: usize = 6;

/// One event as a client received it.
#[derive(Debug, Clone)]
pub struct Received {
    /// The `<n>` of its id `<message id>:<n>`.
    pub n: u64,
    pub name: String,
    pub data: String,
    /// Since the run began.
    pub at: Duration,
    /// It came on a stream the client resumed (not on the turn's first one).
    pub resumed: bool,
}

/// How a turn ended for its client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// `message_end`.
    Complete,
    /// An `error` event, with its `error_type`.
    Error(String),
    /// No replica had the reply's stream any more (404), and the history held the reply as
    /// ended: the client shows it from there, as the web UI does.
    ReadStored,
    /// The client gave up (its deadline passed).
    GaveUp,
}

/// One turn as its client saw it.
#[derive(Debug, Clone)]
pub struct TurnLog {
    /// The user message's text, unique in the run.
    pub content: String,
    pub message_id: Option<String>,
    /// Every event received, in order, repeats included.
    pub events: Vec<Received>,
    pub ending: Option<Ending>,
    /// Streams opened to resume it.
    pub resumes: usize,
    /// How each resume went (the latest [`KEPT_RESUMES`]), for the report of a turn whose
    /// client gave up.
    pub resume_log: Vec<String>,
    /// Posts of the turn that failed before it was known to be stored.
    pub retries: usize,
}

/// One client's session and turns.
#[derive(Debug, Clone)]
pub struct ClientLog {
    pub key: String,
    pub session_id: String,
    pub turns: Vec<TurnLog>,
}

/// What each client does.
#[derive(Debug, Clone)]
pub struct Plan {
    pub turns: usize,
    pub tokens: u32,
    /// The latest a turn may end; past it, the client gives up.
    pub turn_deadline: Duration,
}

struct Client {
    id: usize,
    key: String,
    replicas: Vec<SocketAddr>,
    rng: Rng,
    start: Instant,
}

/// Runs one client to its end.
pub async fn run(
    id: usize,
    key: String,
    replicas: Vec<SocketAddr>,
    seed: u64,
    start: Instant,
    plan: Plan,
) -> ClientLog {
    let mut c = Client {
        id,
        key,
        replicas,
        rng: Rng::new(seed),
        start,
    };
    let session_id = c.session().await;
    let mut turns = Vec::new();
    for t in 0..plan.turns {
        turns.push(c.turn(&session_id, t, &plan).await);
    }
    ClientLog {
        key: c.key,
        session_id,
        turns,
    }
}

impl Client {
    fn replica(&mut self) -> SocketAddr {
        *self.rng.pick(&self.replicas)
    }

    async fn pause(&mut self) {
        let ms = self.rng.range(100, 400) as u64;
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }

    /// A new session, on whichever replica answers.
    async fn session(&mut self) -> String {
        let body = json!({"title": format!("chaos client {}", self.id)});
        loop {
            let addr = self.replica();
            let r = Req::new("POST", "/v1/sessions")
                .key(Some(&self.key))
                .json(&body)
                .try_send(addr, Duration::from_secs(10))
                .await;
            if let Some(r) = r.ok().filter(|r| r.status == 201 || r.status == 200) {
                if let Some(id) = r.json()["id"].as_str() {
                    return id.to_string();
                }
            }
            self.pause().await;
        }
    }

    async fn turn(&mut self, sid: &str, t: usize, plan: &Plan) -> TurnLog {
        let mut log = TurnLog {
            content: format!(
                "[client {} turn {t}] Tell me a long story, please.",
                self.id
            ),
            message_id: None,
            events: Vec::new(),
            ending: None,
            resumes: 0,
            resume_log: Vec::new(),
            retries: 0,
        };
        let deadline = Instant::now() + plan.turn_deadline;
        let body = json!({"content": log.content, "max_tokens": plan.tokens,
                          "ignore_eos": true, "params": {"temperature": 0.0}});
        // Posted, or found stored after a post that failed.
        let mut started = false;
        while !started && Instant::now() < deadline {
            let addr = self.replica();
            let path = format!("/v1/sessions/{sid}/messages");
            match Req::new("POST", &path)
                .key(Some(&self.key))
                .json(&body)
                .try_events(addr)
                .await
            {
                Ok(mut sse) if sse.status == 200 => {
                    started = true;
                    self.read(&mut sse, &mut log, false).await;
                }
                _ => match self.stored(sid, &log.content).await {
                    Some(reply) => {
                        log.message_id = Some(reply);
                        started = true;
                    }
                    None => {
                        log.retries += 1;
                        self.pause().await;
                    }
                },
            }
        }
        while log.ending.is_none() && Instant::now() < deadline {
            self.pause().await;
            // A stream that broke before its first event: which reply is this turn's comes from
            // the history first, or the session's stream could serve the previous turn's reply,
            // still there, as if it were this one.
            if log.message_id.is_none() {
                log.message_id = self.stored(sid, &log.content).await;
                if log.message_id.is_none() {
                    continue;
                }
            }
            self.resume(sid, &mut log).await;
        }
        log.ending.get_or_insert(Ending::GaveUp);
        log
    }

    /// The session's messages, from whichever replica answers (None when it does not).
    async fn history(&mut self, sid: &str) -> Option<Vec<Value>> {
        let addr = self.replica();
        let path = format!("/v1/sessions/{sid}/messages");
        let r = Req::new("GET", &path)
            .key(Some(&self.key))
            .try_send(addr, Duration::from_secs(10))
            .await
            .ok()
            .filter(|r| r.status == 200)?;
        r.json()["data"].as_array().cloned()
    }

    /// The reply to the user message `content`, when the session's history holds it (a post
    /// that failed on the way back, after the turn was stored).
    async fn stored(&mut self, sid: &str, content: &str) -> Option<String> {
        let messages = self.history(sid).await?;
        let at = messages.iter().position(|m| m["content"] == content)?;
        messages.get(at + 1)?["id"].as_str().map(str::to_string)
    }

    /// Whether the history holds the turn's reply as ended (not `streaming`).
    async fn ended(&mut self, sid: &str, log: &TurnLog) -> bool {
        let Some(id) = &log.message_id else {
            return false;
        };
        let messages = self.history(sid).await.unwrap_or_default();
        messages
            .iter()
            .find(|m| m["id"] == id.as_str())
            .is_some_and(|m| m["status"] != "streaming")
    }

    /// Opens the session's stream on a replica, after the last event received.
    async fn resume(&mut self, sid: &str, log: &mut TurnLog) {
        let addr = self.replica();
        let path = format!("/v1/sessions/{sid}/stream");
        let mut req = Req::new("GET", &path).key(Some(&self.key));
        if let (Some(m), Some(last)) = (&log.message_id, log.events.last()) {
            req = req.header("Last-Event-ID", format!("{m}:{}", last.n));
        }
        log.resumes += 1;
        let (at, had) = (self.start.elapsed(), log.events.len());
        let status = match req.try_events(addr).await {
            Ok(mut sse) if sse.status == 200 => {
                self.read(&mut sse, log, true).await;
                "200".to_string()
            }
            Ok(sse) => {
                if sse.status == 404 && self.ended(sid, log).await {
                    log.ending = Some(Ending::ReadStored);
                }
                sse.status.to_string()
            }
            Err(e) => e.kind().to_string(),
        };
        if log.resume_log.len() == KEPT_RESUMES {
            log.resume_log.remove(0);
        }
        let last = log.events.last().map(|e| e.n);
        log.resume_log.push(format!(
            "{:.1} s {addr}: {status}, {} events (last {last:?})",
            at.as_secs_f64(),
            log.events.len() - had,
        ));
    }

    /// Reads events until the turn ends, the stream ends, or it falls silent.
    async fn read(&mut self, sse: &mut Sse, log: &mut TurnLog, resumed: bool) {
        while let Ok(Some(e)) = tokio::time::timeout(STALL, sse.next()).await {
            let Some((message, n)) = e.id.as_deref().and_then(|id| id.rsplit_once(':')) else {
                continue;
            };
            let Ok(n) = n.parse::<u64>() else {
                continue;
            };
            // Another reply of the session (the previous turn's, resumed from its start).
            if log.message_id.as_deref().is_some_and(|m| m != message) {
                return;
            }
            if e.event == "message_start" {
                let ids: Value = serde_json::from_str(&e.data).unwrap_or(Value::Null);
                if ids["message_id"].as_str() != Some(message) {
                    continue;
                }
            }
            log.message_id.get_or_insert_with(|| message.to_string());
            log.events.push(Received {
                n,
                name: e.event.clone(),
                data: e.data.clone(),
                at: self.start.elapsed(),
                resumed,
            });
            match e.event.as_str() {
                "message_end" => {
                    log.ending = Some(Ending::Complete);
                    return;
                }
                "error" => {
                    let v: Value = serde_json::from_str(&e.data).unwrap_or(Value::Null);
                    let kind = v["error_type"].as_str().unwrap_or_default().to_string();
                    log.ending = Some(Ending::Error(kind));
                    return;
                }
                _ => {}
            }
        }
    }
}
