//! A generation in progress as its listeners see it: an append-only log of events that any
//! number of subscribers read from any position (so a client that reconnects with
//! `Last-Event-ID` gets exactly what it missed), plus a stop signal.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tokio::sync::watch;

pub use super::end::{End, GenerationError};
use crate::ids::{MessageId, SessionId};
use crate::storage::{Completion, Finish, ReplyTimings, ReplyUsage, ToolCall};

/// How a reply ended, with what it said and cost.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub content: String,
    pub end: End,
    /// The calls the reply makes, when it stopped and is nothing but calls of the offered
    /// tools.
    pub tool_calls: Option<Vec<ToolCall>>,
    pub usage: ReplyUsage,
    pub timings: ReplyTimings,
    /// The worker that finished the reply.
    pub worker: Option<String>,
}

impl Outcome {
    /// The reply's final state as stored: the same record, with the end as status and
    /// finish reason.
    pub fn completion(&self) -> Completion {
        Completion {
            content: self.content.clone(),
            status: self.end.status(),
            finish_reason: self.finish_reason(),
            usage: self.usage,
            timings: self.timings,
            worker: self.worker.clone(),
            tool_calls: self.tool_calls.clone(),
        }
    }

    /// The stored and native finish reason: `tool_calls` for a reply that is calls, else the
    /// generation's.
    pub fn finish_reason(&self) -> Finish {
        match self.tool_calls {
            Some(_) => Finish::ToolCalls,
            None => self.end.finish_reason(),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum RunEvent {
    /// The first event: the reply exists (and, on the native API, is stored).
    Begin,
    Text(String),
    /// The log-probabilities of tokens whose text comes in the next `Text` events (only when
    /// the request asked for them).
    Logprobs(Vec<TokenLogprob>),
    /// The last event.
    End(Box<Outcome>),
}

/// One generated token's log-probability and its likeliest alternatives (OpenAI's
/// `logprobs.content[]` entry; the native API's `logprobs` event).
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct TokenLogprob {
    /// The token's text, decoded alone.
    pub token: String,
    /// Under the model's distribution, before any penalty or bias.
    pub logprob: f32,
    /// The token's text as UTF-8 bytes (a token may hold part of a character).
    pub bytes: Vec<u8>,
    /// The likeliest tokens at this position, likeliest first (`top_logprobs` of them).
    pub top_logprobs: Vec<TopLogprob>,
}

/// An alternative token at a position.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// Ids that name a stored turn. On the native API it is the SSE `message_start` event's data.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[schema(as = MessageStart)]
pub struct TurnIds {
    #[schema(value_type = String)]
    pub session_id: SessionId,
    #[schema(value_type = Option<String>, required = true)]
    pub user_message_id: Option<MessageId>,
    #[schema(value_type = String)]
    pub message_id: MessageId,
}

#[derive(Debug)]
pub struct Live {
    /// The stored turn a native reply belongs to; `None` for a stateless (OpenAI) one.
    pub ids: Option<TurnIds>,
    /// The index of the first event this log holds: 0, or for a reply taken over from a
    /// replica that died, the events that replica published before (see [`super::takeover`]).
    base: usize,
    events: Mutex<Vec<Entry>>,
    /// Index of the next event (`base` + events held).
    len: watch::Sender<usize>,
    stop: watch::Sender<bool>,
    /// Another replica took the reply over: this one stops and stores nothing.
    disowned: std::sync::atomic::AtomicBool,
}

/// An event, with the generated tokens whose text it is the first to carry (text events only).
#[derive(Debug)]
struct Entry {
    event: RunEvent,
    tokens: Box<[u32]>,
}

impl Live {
    pub fn new(ids: Option<TurnIds>) -> Arc<Self> {
        Self::from_event(ids, 0)
    }

    /// The log of a reply that goes on from event `base`, the ones before it published by
    /// the replica that began it.
    pub fn from_event(ids: Option<TurnIds>, base: usize) -> Arc<Self> {
        Arc::new(Self {
            ids,
            base,
            events: Mutex::new(Vec::new()),
            len: watch::Sender::new(base),
            stop: watch::Sender::new(false),
            disowned: Default::default(),
        })
    }

    /// The index of the first event held here (0 unless the reply was taken over).
    pub fn base(&self) -> usize {
        self.base
    }

    fn events(&self) -> std::sync::MutexGuard<'_, Vec<Entry>> {
        self.events.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn push(&self, e: RunEvent) {
        self.push_with_tokens(e, Box::new([]));
    }

    /// Pushes `text` with the generated tokens it is the first text of (what another replica
    /// needs to continue the reply token for token).
    pub fn push_text(&self, text: String, tokens: &[u32]) {
        self.push_with_tokens(RunEvent::Text(text), tokens.into());
    }

    fn push_with_tokens(&self, event: RunEvent, tokens: Box<[u32]>) {
        let n = {
            let mut ev = self.events();
            ev.push(Entry { event, tokens });
            self.base + ev.len()
        };
        self.len.send_replace(n);
    }

    pub fn is_finished(&self) -> bool {
        matches!(
            self.events().last(),
            Some(Entry {
                event: RunEvent::End(_),
                ..
            })
        )
    }

    /// Another replica has taken the reply over, or this one hands it over as it shuts down:
    /// stop, and leave the stored reply to the next replica. Its listeners here get no last
    /// event: their streams just end, and they resume elsewhere.
    pub fn disown(&self) {
        self.disowned
            .store(true, std::sync::atomic::Ordering::Release);
        self.stop();
    }

    pub fn is_disowned(&self) -> bool {
        self.disowned.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Asks the generation to stop; it ends with what it has (`stopped`).
    pub fn stop(&self) {
        self.stop.send_replace(true);
    }

    pub fn stop_requested(&self) -> bool {
        *self.stop.borrow()
    }

    /// Resolves once [`Live::stop`] has been called.
    pub async fn stopped(&self) {
        let mut rx = self.stop.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// Waits until the reply has made progress past its start: a token, or its end.
    pub async fn first_progress(self: &Arc<Self>) {
        let mut events = std::pin::pin!(self.subscribe(self.base));
        while let Some((_, e)) = tokio_stream::StreamExt::next(&mut events).await {
            if !matches!(e, RunEvent::Begin) {
                return;
            }
        }
    }

    /// The events from index `from` on (0-based), each with its index, ending after `End`.
    pub fn subscribe(
        self: &Arc<Self>,
        from: usize,
    ) -> impl tokio_stream::Stream<Item = (usize, RunEvent)> + Send + 'static {
        let live = self.clone();
        async_stream::stream! {
            let mut next = from;
            loop {
                // Empty: resumed at or past the end of a finished log, nothing more will come.
                let batch = live.next_batch(next).await;
                if batch.is_empty() {
                    return;
                }
                for (n, e) in batch {
                    let end = matches!(e, RunEvent::End(_));
                    if end && live.is_disowned() {
                        return;
                    }
                    yield (n, e);
                    next = n + 1;
                    if end {
                        return;
                    }
                }
            }
        }
    }

    /// The events from index `from` on (from [`Live::base`] at the earliest), each with its
    /// index, once there is at least one; none once the log ended before `from`.
    pub async fn next_batch(&self, from: usize) -> Vec<(usize, RunEvent)> {
        self.next_entries(from, |e| e.event.clone()).await
    }

    /// As [`Live::next_batch`], each event with the tokens it is the first text of.
    pub async fn next_batch_with_tokens(&self, from: usize) -> Vec<(usize, RunEvent, Box<[u32]>)> {
        self.next_entries(from, |e| (e.event.clone(), e.tokens.clone()))
            .await
            .into_iter()
            .map(|(n, (e, t))| (n, e, t))
            .collect()
    }

    async fn next_entries<T>(&self, from: usize, f: impl Fn(&Entry) -> T) -> Vec<(usize, T)> {
        let from = from.max(self.base);
        let mut rx = self.len.subscribe();
        loop {
            {
                let ev = self.events();
                let held = from - self.base;
                if ev.len() > held {
                    return (from..).zip(ev[held..].iter().map(&f)).collect();
                }
                if matches!(ev.last().map(|e| &e.event), Some(RunEvent::End(_))) {
                    return Vec::new();
                }
            }
            if rx.changed().await.is_err() {
                return Vec::new();
            }
        }
    }

    /// The last event, once the generation has ended; None when it was disowned (the reply
    /// goes on on another replica).
    pub async fn outcome(self: &Arc<Self>) -> Option<Outcome> {
        let mut rx = self.len.subscribe();
        loop {
            if let Some(RunEvent::End(o)) = self.events().last().map(|e| &e.event) {
                return (!self.is_disowned()).then(|| (**o).clone());
            }
            rx.changed().await.ok()?;
        }
    }
}

/// The current or most recent generation of each session, kept a while after it ends so a
/// client can resume (or re-read) it. A session has at most one running generation; a
/// [`Reservation`] holds its place while the turn is being prepared.
#[derive(Debug, Default)]
pub struct Streams {
    /// `None`: reserved by a turn that has not started yet.
    by_session: Mutex<HashMap<SessionId, Option<Arc<Live>>>>,
}

/// How long a finished stream stays resumable.
pub const KEEP_FINISHED: Duration = Duration::from_secs(120);

/// A session's place, held while a turn is prepared; dropped unfilled, it frees the place.
#[derive(Debug)]
pub struct Reservation {
    streams: Arc<Streams>,
    session_id: SessionId,
    filled: bool,
}

impl Reservation {
    pub fn fill(mut self, live: &Arc<Live>) {
        self.streams
            .map()
            .insert(self.session_id.clone(), Some(live.clone()));
        self.filled = true;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.filled {
            let mut m = self.streams.map();
            if matches!(m.get(&self.session_id), Some(None)) {
                m.remove(&self.session_id);
            }
        }
    }
}

/// The session already has a reply in progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a reply is still being generated in this session; stop it or wait for it to finish")]
pub struct Busy;

impl Streams {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<SessionId, Option<Arc<Live>>>> {
        self.by_session.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Holds the session's place unless a turn is already running or being prepared there.
    pub fn reserve(self: &Arc<Self>, session_id: &SessionId) -> Result<Reservation, Busy> {
        let mut m = self.map();
        match m.get(session_id) {
            Some(None) => return Err(Busy),
            Some(Some(l)) if !l.is_finished() => return Err(Busy),
            _ => {}
        }
        m.insert(session_id.clone(), None);
        Ok(Reservation {
            streams: self.clone(),
            session_id: session_id.clone(),
            filled: false,
        })
    }

    pub fn get(&self, session_id: &SessionId) -> Option<Arc<Live>> {
        self.map().get(session_id).cloned().flatten()
    }

    /// Sessions with a reply in progress.
    pub fn running(&self) -> usize {
        self.map()
            .values()
            .filter(|l| l.as_ref().is_none_or(|l| !l.is_finished()))
            .count()
    }

    /// Disowns every running native reply (a shutdown that hands them to other replicas) and
    /// returns their message ids.
    pub fn hand_over_all(&self) -> Vec<MessageId> {
        let mut handed = Vec::new();
        for l in self.map().values().flatten() {
            if let Some(ids) = l.ids.as_ref().filter(|_| !l.is_finished()) {
                l.disown();
                handed.push(ids.message_id.clone());
            }
        }
        handed
    }

    /// Stops every running reply (shutdown).
    pub fn stop_all(&self) {
        for l in self.map().values().flatten() {
            l.stop();
        }
    }

    /// Forgets a finished stream after [`KEEP_FINISHED`] unless a newer one replaced it.
    pub fn expire_later(self: &Arc<Self>, live: Arc<Live>) {
        let Some(session_id) = live.ids.as_ref().map(|ids| ids.session_id.clone()) else {
            return;
        };
        let me = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(KEEP_FINISHED).await;
            let mut m = me.map();
            let same = matches!(m.get(&session_id), Some(Some(l)) if Arc::ptr_eq(l, &live));
            if same {
                m.remove(&session_id);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use hearth_shared::FinishReason;
    use tokio_stream::StreamExt;

    use super::*;

    fn finished() -> Arc<Live> {
        let live = Live::new(None);
        live.push(RunEvent::Begin);
        live.push(RunEvent::Text("hi".into()));
        live.push(RunEvent::End(Box::new(Outcome {
            content: "hi".into(),
            end: End::Finished(FinishReason::Stop),
            tool_calls: None,
            usage: ReplyUsage {
                prompt_tokens: 1,
                cached_tokens: 0,
                completion_tokens: 1,
            },
            timings: ReplyTimings::default(),
            worker: None,
        })));
        live
    }

    async fn collect(live: &Arc<Live>, from: usize) -> Vec<usize> {
        let s = live.subscribe(from).map(|(n, _)| n);
        tokio::time::timeout(Duration::from_secs(2), s.collect::<Vec<_>>())
            .await
            .unwrap_or_else(|_| panic!("resuming a finished stream at {from} did not end"))
    }

    #[tokio::test]
    async fn resuming_a_finished_stream_at_or_past_its_end_ends_at_once() {
        let live = finished();
        assert_eq!(collect(&live, 0).await, vec![0, 1, 2]);
        assert_eq!(collect(&live, 2).await, vec![2]);
        assert_eq!(collect(&live, 3).await, Vec::<usize>::new());
        assert_eq!(collect(&live, 1000).await, Vec::<usize>::new());
    }
}
