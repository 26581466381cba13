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
    /// The stop string that ended the reply, when one did.
    pub stop_sequence: Option<String>,
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
    /// Moves whenever listeners may see more: the index of the next event (`base` + events
    /// held), sent again when a gate opens.
    len: watch::Sender<usize>,
    stop: watch::Sender<bool>,
    /// Another replica took the reply over: this one stops and stores nothing.
    disowned: std::sync::atomic::AtomicBool,
    gate: Mutex<Gate>,
}

/// What this replica's listeners may see of the log so far. A native reply shared through
/// Redis is shown only as far as its shared stream holds it: the stream is what every replica
/// serves and what a replica taking the reply over continues, so no client is ever shown an
/// event that another replica could later tell differently. And a reply's last event is shown
/// only once its outcome is stored (or the reply was disowned), so a client that reads the
/// history on seeing it finds the reply as it ended.
#[derive(Debug)]
struct Gate {
    /// Events before this index are in the shared stream; `None`: not gated by it (no Redis,
    /// or Redis has been unreachable too long for clients to wait).
    published: Option<usize>,
    /// The generation is done with the log: its outcome stored, or the reply disowned.
    settled: bool,
}

/// An event, with the generated tokens whose text it is the first to carry (text events only).
#[derive(Debug)]
struct Entry {
    event: RunEvent,
    tokens: Box<[u32]>,
}

impl Live {
    /// A log that shows each event as it comes (a stateless reply, or one without Redis).
    pub fn new(ids: Option<TurnIds>) -> Arc<Self> {
        Self::with_gate(ids, 0, None)
    }

    /// The log of a native reply shared through Redis, from event `base` (events before it
    /// were published by the replica that began the reply): its events are shown here once
    /// published (see [`Live::published`]).
    pub fn shared(ids: TurnIds, base: usize) -> Arc<Self> {
        Self::with_gate(Some(ids), base, Some(base))
    }

    /// The log of a reply that goes on from event `base`, not shared through Redis.
    pub fn from_event(ids: Option<TurnIds>, base: usize) -> Arc<Self> {
        Self::with_gate(ids, base, None)
    }

    fn with_gate(ids: Option<TurnIds>, base: usize, published: Option<usize>) -> Arc<Self> {
        Arc::new(Self {
            ids,
            base,
            events: Mutex::new(Vec::new()),
            len: watch::Sender::new(base),
            stop: watch::Sender::new(false),
            disowned: Default::default(),
            gate: Mutex::new(Gate {
                published,
                settled: false,
            }),
        })
    }

    /// The index of the first event held here (0 unless the reply was taken over).
    pub fn base(&self) -> usize {
        self.base
    }

    /// The index the next event pushed will have.
    pub fn next_index(&self) -> usize {
        self.base + self.events().len()
    }

    /// The events listeners may have been shown so far (as far as published, when the reply
    /// is shared): the index of the next one, and the text and tokens those from `base` carry.
    pub fn shown_so_far(&self) -> (usize, String, Vec<u32>) {
        let ev = self.events();
        let n = match self.gate().published {
            Some(p) => ev.len().min(p.saturating_sub(self.base)),
            None => ev.len(),
        };
        let (mut text, mut tokens) = (String::new(), Vec::new());
        for e in &ev[..n] {
            if let RunEvent::Text(t) = &e.event {
                text.push_str(t);
            }
            tokens.extend_from_slice(&e.tokens);
        }
        (self.base + n, text, tokens)
    }

    fn events(&self) -> std::sync::MutexGuard<'_, Vec<Entry>> {
        self.events.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn gate(&self) -> std::sync::MutexGuard<'_, Gate> {
        self.gate.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes every listener to look again (an event was pushed, or a gate opened).
    fn wake(&self) {
        let n = self.base + self.events().len();
        self.len.send_replace(n);
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
        self.events().push(Entry { event, tokens });
        self.wake();
    }

    /// The events before `upto` are in the reply's shared stream.
    pub fn published(&self, upto: usize) {
        {
            let mut g = self.gate();
            if let Some(p) = &mut g.published {
                *p = (*p).max(upto);
            }
        }
        self.wake();
    }

    /// Waits, at most `limit`, until every event pushed so far is in the shared stream (at
    /// once when the reply is not shared, or no longer is, or was disowned).
    pub async fn wait_published(&self, limit: Duration) {
        let all = self.next_index();
        let mut rx = self.len.subscribe();
        let done = || self.is_disowned() || self.gate().published.is_none_or(|p| p >= all);
        let _ = tokio::time::timeout(limit, async {
            while !done() {
                if rx.changed().await.is_err() {
                    return;
                }
            }
        })
        .await;
    }

    /// Shows every event as it comes from now on: the shared stream cannot be written (Redis
    /// is unreachable), and clients are not made to wait for it any longer.
    pub fn unshared(&self) {
        self.gate().published = None;
        self.wake();
    }

    /// The generation is done with the log: its outcome is stored, or it stored nothing
    /// (disowned, or nothing to store). Its last event may be shown now.
    pub fn settle(&self) {
        self.gate().settled = true;
        self.wake();
    }

    /// Whether the reply has ended here: its last event is in the log and shown.
    pub fn is_finished(&self) -> bool {
        let settled = self.gate().settled;
        settled
            && matches!(
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
        self.wake();
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

    /// The events from index `from` on (0-based), each with its index, ending after `End`, as
    /// far as they may be shown (see [`Gate`]). A disowned reply's stream just ends.
    pub fn subscribe(
        self: &Arc<Self>,
        from: usize,
    ) -> impl tokio_stream::Stream<Item = (usize, RunEvent)> + Send + 'static {
        let live = self.clone();
        async_stream::stream! {
            let mut next = from;
            loop {
                // Empty: resumed at or past the end of a finished log, nothing more will come.
                let batch = live.next_entries(next, true, |e| e.event.clone()).await;
                if batch.is_empty() {
                    return;
                }
                for (n, e) in batch {
                    let end = matches!(e, RunEvent::End(_));
                    yield (n, e);
                    next = n + 1;
                    if end {
                        return;
                    }
                }
            }
        }
    }

    /// The events from index `from` on (from [`Live::base`] at the earliest), each with the
    /// tokens it is the first text of, once there is at least one, whether shown yet or not:
    /// what the replica publishes. None once the log ended before `from`.
    pub async fn next_batch_with_tokens(&self, from: usize) -> Vec<(usize, RunEvent, Box<[u32]>)> {
        self.next_entries(from, false, |e| (e.event.clone(), e.tokens.clone()))
            .await
            .into_iter()
            .map(|(n, (e, t))| (n, e, t))
            .collect()
    }

    /// How many events (from `base`) listeners may see now, and whether the log is over for
    /// them (its last event among those, or the reply disowned).
    fn shown(&self, ev: &[Entry]) -> (usize, bool) {
        let g = self.gate();
        let mut n = ev.len();
        if let Some(p) = g.published {
            n = n.min(p.saturating_sub(self.base));
        }
        let ends = matches!(ev.get(..n).and_then(<[Entry]>::last), Some(e) if matches!(e.event, RunEvent::End(_)));
        if ends && !g.settled {
            n -= 1;
        }
        let over = self.is_disowned() || (ends && g.settled);
        (n, over)
    }

    async fn next_entries<T>(
        &self,
        from: usize,
        gated: bool,
        f: impl Fn(&Entry) -> T,
    ) -> Vec<(usize, T)> {
        let from = from.max(self.base);
        let mut rx = self.len.subscribe();
        loop {
            {
                let ev = self.events();
                let (n, over) = if gated {
                    let (n, over) = self.shown(&ev);
                    // A disowned reply's listeners see nothing more here.
                    (if self.is_disowned() { 0 } else { n }, over)
                } else {
                    let ended = matches!(ev.last().map(|e| &e.event), Some(RunEvent::End(_)));
                    (ev.len(), ended)
                };
                let held = from - self.base;
                if n > held {
                    return (from..).zip(ev[held..n].iter().map(&f)).collect();
                }
                if over {
                    return Vec::new();
                }
            }
            if rx.changed().await.is_err() {
                return Vec::new();
            }
        }
    }

    /// The last event, once the generation is done with the log (its outcome stored); None
    /// when it was disowned (the reply goes on on another replica).
    pub async fn outcome(self: &Arc<Self>) -> Option<Outcome> {
        let mut rx = self.len.subscribe();
        loop {
            if self.is_finished() {
                if let Some(RunEvent::End(o)) = self.events().last().map(|e| &e.event) {
                    return (!self.is_disowned()).then(|| (**o).clone());
                }
            }
            if self.is_disowned() && self.gate().settled {
                return None;
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
            stop_sequence: None,
        })));
        live.settle();
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

    fn end() -> RunEvent {
        RunEvent::End(Box::new(Outcome {
            content: "ab".into(),
            end: End::Finished(FinishReason::Stop),
            tool_calls: None,
            usage: ReplyUsage::default(),
            timings: ReplyTimings::default(),
            worker: None,
            stop_sequence: None,
        }))
    }

    /// The indices a listener from `from` has been shown within 100 ms.
    async fn shown(live: &Arc<Live>, from: usize) -> Vec<usize> {
        let mut s = std::pin::pin!(live.subscribe(from).map(|(n, _)| n));
        let mut got = Vec::new();
        while let Ok(Some(n)) = tokio::time::timeout(Duration::from_millis(100), s.next()).await {
            got.push(n);
        }
        got
    }

    fn ids() -> TurnIds {
        TurnIds {
            session_id: SessionId::random(),
            user_message_id: None,
            message_id: MessageId::random(),
        }
    }

    #[tokio::test]
    async fn a_shared_reply_shows_only_what_is_published_and_its_end_once_stored() {
        let live = Live::shared(ids(), 0);
        live.push(RunEvent::Begin);
        live.push_text("a".into(), &[7]);
        assert_eq!(
            shown(&live, 0).await,
            Vec::<usize>::new(),
            "nothing published"
        );
        live.published(1);
        assert_eq!(shown(&live, 0).await, vec![0]);
        live.push_text("b".into(), &[8]);
        live.push(end());
        live.published(4);
        assert!(!live.is_finished(), "the end is not stored yet");
        assert_eq!(
            shown(&live, 0).await,
            vec![0, 1, 2],
            "the end waits for the store"
        );
        let outcome = live.clone();
        let outcome = tokio::spawn(async move { outcome.outcome().await });
        live.settle();
        assert_eq!(shown(&live, 1).await, vec![1, 2, 3]);
        assert!(live.is_finished());
        let o = outcome.await.expect("task").expect("an outcome");
        assert_eq!(o.content, "ab");

        // Redis unreachable for too long: everything is shown as it comes.
        let live = Live::shared(ids(), 5);
        live.push_text("c".into(), &[9]);
        assert_eq!(shown(&live, 5).await, Vec::<usize>::new());
        live.unshared();
        assert_eq!(shown(&live, 5).await, vec![5]);
    }

    #[tokio::test]
    async fn a_disowned_reply_shows_nothing_more_and_has_no_outcome_here() {
        let live = Live::shared(ids(), 0);
        live.push(RunEvent::Begin);
        live.push_text("a".into(), &[7]);
        live.published(1);
        let listener = live.clone();
        let seen = tokio::spawn(async move {
            listener
                .subscribe(0)
                .map(|(n, _)| n)
                .collect::<Vec<_>>()
                .await
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        live.disown();
        live.push(end());
        live.published(3);
        live.settle();
        let seen = tokio::time::timeout(Duration::from_secs(2), seen)
            .await
            .expect("the listener's stream ended")
            .expect("task");
        assert_eq!(seen, vec![0], "only what was shown before");
        assert_eq!(live.outcome().await, None);
    }
}
