//! Control of running replies and of the service: resuming a reply's stream (here or from
//! another replica's, through Redis), stopping it, and readiness.

use std::sync::Arc;
use std::time::Duration;

use tokio_stream::{Stream, StreamExt};

use super::{Caller, ChatError, ChatService};
use crate::generate::wire::NativeEvent;
use crate::generate::{Live, SharedReply};
use crate::ids::{MessageId, SessionId, UserId};
use crate::storage::{Message, MessageStatus, Role, Transcript};

/// What a stop found.
#[derive(Debug)]
pub enum StopOutcome {
    /// No reply was running in the session (or it ended before the stop reached it).
    NothingRunning,
    /// The reply as stored once it ended: `stopped`, or how it ended first.
    Ended(Box<Message>),
}

/// Where a session's running (or just finished) reply is read from.
#[derive(Debug)]
pub enum ReplySource {
    /// This replica runs it (or ran it).
    Local(Arc<Live>),
    /// Another replica runs it (or ran it): its events come from Redis.
    Shared(SharedReply),
}

/// Whether the service can answer, and each worker's state.
#[derive(Debug)]
pub struct Readiness {
    pub ready_workers: usize,
    pub workers: Vec<crate::workers::WorkerStatus>,
    /// Where a reply's stream can be resumed: `any_replica` (Redis holds its events) or
    /// `this_replica` (without Redis, or while it is down: only the replica running it).
    pub resume: &'static str,
}

/// How long a stop waits for the reply to end and be stored.
const STOP_WAIT: Duration = Duration::from_secs(10);

impl ChatService {
    // --- The service itself ---

    /// Ready when the database answers and at least one worker is ready.
    pub async fn readiness(&self) -> Result<Readiness, ChatError> {
        self.store.ping().await?;
        let shared = match &self.shared_replies {
            Some(s) => s.reachable().await,
            None => false,
        };
        Ok(Readiness {
            ready_workers: self.generator.pool.ready_count(),
            workers: self.generator.pool.describe(),
            resume: if shared {
                "any_replica"
            } else {
                "this_replica"
            },
        })
    }

    /// The session's running or just-finished reply, to resume: this replica's, else (with
    /// Redis) the one another replica runs.
    pub async fn reply_stream(
        &self,
        caller: &Caller,
        id: &SessionId,
    ) -> Result<ReplySource, ChatError> {
        self.store.get_session(&caller.user.id, id).await?;
        let local = self.generator.streams.get(id);
        if let Some(live) = &local {
            // Taken over from a replica that died: its first events are in Redis only, and
            // only the stream knows what a client that has fewer than them may be shown.
            if let (Some(shared), Some(ids)) = (&self.shared_replies, &live.ids) {
                if live.base() > 0 {
                    return Ok(ReplySource::Shared(shared.reply(&ids.message_id)));
                }
            }
            if !live.is_finished() {
                return Ok(ReplySource::Local(live.clone()));
            }
        }
        // A reply finished here may have been followed by one on another replica.
        let shared = match &self.shared_replies {
            Some(s) => match s.find(id).await {
                Some(found) => found,
                None if local.is_none() => return Err(self.unreachable_reply(caller, id).await),
                None => None,
            },
            None => None,
        };
        let local_id = local
            .as_ref()
            .and_then(|l| l.ids.as_ref())
            .map(|ids| ids.message_id.clone());
        match (local, shared) {
            (Some(live), Some(r)) if local_id.as_ref() == Some(&r.message_id) => {
                Ok(ReplySource::Local(live))
            }
            (_, Some(r)) => Ok(ReplySource::Shared(r)),
            (Some(live), None) => Ok(ReplySource::Local(live)),
            (None, None) => Err(ChatError::NotFound("stream")),
        }
    }

    /// Why a resume that Redis cannot answer fails: the reply runs on another replica, whose
    /// events only Redis holds (try again shortly), or no reply runs (read the history).
    async fn unreachable_reply(&self, caller: &Caller, id: &SessionId) -> ChatError {
        let running = self.store.last_message(&caller.user.id, id).await.map(|m| {
            m.is_some_and(|m| m.role == Role::Assistant && m.status == MessageStatus::Streaming)
        });
        match running {
            Ok(false) => ChatError::NotFound("stream"),
            Ok(true) => ChatError::Unavailable(
                "the reply runs on another replica, and Redis, which shares its events, cannot \
                 be reached now; try again shortly"
                    .into(),
            ),
            Err(e) => e.into(),
        }
    }

    /// The events of a reply another replica runs (or ran), from its shared stream, after the
    /// first `from`; None when the stream no longer holds them. The last event comes once the
    /// reply is stored (its replica publishes the end before it stores it, so that whoever
    /// stores the end stores what clients were shown), so a client that reads the history on
    /// seeing it finds the reply as it ended.
    pub async fn shared_events(
        &self,
        caller: &Caller,
        session_id: &SessionId,
        reply: SharedReply,
        from: usize,
    ) -> Result<Option<impl Stream<Item = NativeEvent> + Send + 'static>, ChatError> {
        let message_id = reply.message_id.clone();
        let events = reply.events(from).await.map_err(|e| {
            ChatError::Unavailable(format!("the reply's shared stream cannot be read: {e}"))
        })?;
        let Some(events) = events else {
            return Ok(None);
        };
        let store = self.store.clone();
        let (user, session) = (caller.user.id.clone(), session_id.clone());
        Ok(Some(async_stream::stream! {
            let mut events = std::pin::pin!(events);
            while let Some(e) = events.next().await {
                if e.ends_reply() {
                    wait_stored(&*store, &user, &session, &message_id).await;
                }
                yield e;
            }
        }))
    }

    /// Stops the session's running reply (on the worker within one engine step) and returns it
    /// once stored. A reply running on another replica is stopped through the stop bus. Stops
    /// count against their own rate limit.
    pub async fn stop(&self, caller: &Caller, id: &SessionId) -> Result<StopOutcome, ChatError> {
        let user_id = &caller.user.id;
        self.store.get_session(user_id, id).await?;
        self.limiter.admit_stop(&caller.quota).await?;
        let streaming =
            |m: &Message| m.role == Role::Assistant && m.status == MessageStatus::Streaming;
        let here = self
            .running(id)
            .and_then(|live| Some((live.ids.as_ref()?.message_id.clone(), live)));
        let reply_id = if let Some((reply_id, live)) = here {
            live.stop();
            // The outcome is stored before it is announced, so one read finds the final message.
            let _ = tokio::time::timeout(STOP_WAIT, live.outcome()).await;
            reply_id
        } else {
            let last = self.store.last_message(user_id, id).await?;
            let (Some(bus), Some(reply)) = (&self.stop_bus, last.filter(streaming)) else {
                return Ok(StopOutcome::NothingRunning);
            };
            let Some(sent) = bus.stop(id).await else {
                return Err(ChatError::Unavailable(
                    "the reply runs on another replica and Redis cannot be reached to stop it"
                        .into(),
                ));
            };
            // Unless it ended before the stop was sent (then no replica runs it to answer), the
            // replica running it says when it has stored the stopped reply.
            let m = self.store.get_message(user_id, id, &reply.id).await?;
            if streaming(&m) {
                sent.ended(STOP_WAIT).await;
            }
            reply.id
        };
        let m = self.store.get_message(user_id, id, &reply_id).await?;
        if streaming(&m) {
            // Its replica did not answer in time (it went away: the orphan sweep will end it).
            return Ok(StopOutcome::NothingRunning);
        }
        Ok(StopOutcome::Ended(Box::new(m)))
    }

    pub(super) fn running(&self, session_id: &SessionId) -> Option<Arc<Live>> {
        self.generator
            .streams
            .get(session_id)
            .filter(|l| !l.is_finished())
    }
}

/// Waits, at most [`STOP_WAIT`], until the reply is no longer `streaming` in the database.
async fn wait_stored(store: &dyn Transcript, user: &UserId, session: &SessionId, id: &MessageId) {
    let deadline = tokio::time::Instant::now() + STOP_WAIT;
    while tokio::time::Instant::now() < deadline {
        match store.get_message(user, session, id).await {
            Ok(m) if m.status == MessageStatus::Streaming => {}
            _ => return,
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
