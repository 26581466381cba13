//! Native replies any replica can serve a resume of. The replica running a reply publishes its
//! events, as clients receive them, to a Redis stream of their own (`hearth:reply:<message
//! id>`, entry `0-<n>` for the event `<message id>:<n>`), and points the session at it
//! (`hearth:reply-of:<session id>`). A replica asked to resume a session whose reply it does
//! not run reads that stream: first what it holds after `Last-Event-ID`, then each event as it
//! is added, until the reply's last one.
//!
//! - **Bounded.** A stream keeps at most [`MAX_EVENTS`] entries (about two a token). Its
//!   expiry is [`LIVE_TTL`] while the reply runs (renewed every [`REFRESH_EVERY`]) and
//!   [`KEEP_FINISHED`] once it ended: what a replica keeps of its own finished replies.
//! - **No gap.** Events go in batches (whatever arrived since the last write; one `MULTI`/`EXEC`
//!   when that is more than one command), each with its explicit entry id; a batch that fails
//!   is sent again, whole, with the next, so the stream never skips an event. A resume that
//!   finds the events it needs trimmed away is refused (404), as a resume past a replica's own
//!   log is.
//! - **Redis down.** Publishing waits for Redis to come back; meanwhile, and for any reply
//!   without Redis, a resume is served by the replica running it only (`/readyz` says so).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio_stream::Stream;

use super::live::KEEP_FINISHED;
use super::wire::NativeEvent;
use super::{Live, RunEvent, TurnIds};
use crate::ids::{MessageId, SessionId};
use crate::limits::Redis;

/// Most events one reply's stream keeps.
pub const MAX_EVENTS: usize = 100_000;

/// How long a running reply's stream lives after its last write: a reply whose replica died
/// mid-way leaves nothing behind for longer.
pub const LIVE_TTL: Duration = Duration::from_secs(600);

/// How often a running reply's expiry and its session's pointer are renewed.
const REFRESH_EVERY: Duration = Duration::from_secs(10);

/// How long a reader blocks for the next event before it checks again (and how long a stream
/// may go without an event before its reader gives up, [`QUIET_LIMIT`]).
const BLOCK: Duration = Duration::from_secs(2);
const QUIET_LIMIT: Duration = Duration::from_secs(120);

/// How long a failed publish waits before it is tried again, and how long a finished reply's
/// events are tried for in all.
const RETRY_EVERY: Duration = Duration::from_millis(500);
const GIVE_UP_AFTER: Duration = Duration::from_secs(60);

fn stream_key(message_id: &MessageId) -> String {
    format!("hearth:reply:{message_id}")
}

fn pointer_key(session_id: &SessionId) -> String {
    format!("hearth:reply-of:{session_id}")
}

/// The replies' shared streams, over the orchestrators' Redis.
#[derive(Debug, Clone)]
pub struct SharedReplies {
    redis: Redis,
    /// For readers: a blocking read takes a connection of its own.
    client: redis::Client,
}

/// A reply another replica runs (or ran), found through its session.
#[derive(Debug, Clone)]
pub struct SharedReply {
    pub message_id: MessageId,
    client: redis::Client,
}

impl SharedReplies {
    pub fn new(redis: Redis, url: &str) -> Result<Self, redis::RedisError> {
        Ok(Self {
            redis,
            client: redis::Client::open(url)?,
        })
    }

    /// Publishes `live`'s events (a native reply's) as they come, until its last one.
    pub fn publish(&self, live: Arc<Live>) {
        let Some(ids) = live.ids.clone() else {
            return;
        };
        let me = self.clone();
        tokio::spawn(async move { me.publish_all(&live, &ids).await });
    }

    async fn publish_all(&self, live: &Arc<Live>, ids: &TurnIds) {
        let (key, pointer) = (stream_key(&ids.message_id), pointer_key(&ids.session_id));
        let mut next = 0;
        let mut failing_since: Option<tokio::time::Instant> = None;
        let mut refreshed: Option<tokio::time::Instant> = None;
        loop {
            let batch = live.next_batch(next).await;
            let Some(&(last_n, _)) = batch.last() else {
                return;
            };
            let ended = matches!(batch.last(), Some((_, RunEvent::End(_))));
            // The expiry and the session's pointer are set with the first batch, renewed now
            // and then, and set for good with the last.
            let refresh = ended || refreshed.is_none_or(|t| t.elapsed() >= REFRESH_EVERY);
            let ttl = if ended { KEEP_FINISHED } else { LIVE_TTL };
            let mut pipe = redis::pipe();
            // One command is atomic by itself; several go in one MULTI/EXEC.
            if batch.len() > 1 || refresh {
                pipe.atomic();
            }
            for (n, e) in batch {
                let e = NativeEvent::new(ids, n, e);
                pipe.cmd("XADD")
                    .arg(&key)
                    .arg("MAXLEN")
                    .arg("~")
                    .arg(MAX_EVENTS)
                    .arg(format!("0-{}", n + 1))
                    .arg("e")
                    .arg(&*e.name)
                    .arg("d")
                    .arg(e.data)
                    .ignore();
            }
            if refresh {
                pipe.cmd("PEXPIRE")
                    .arg(&key)
                    .arg(ttl.as_millis() as u64)
                    .ignore();
                pipe.cmd("SET")
                    .arg(&pointer)
                    .arg(ids.message_id.as_str())
                    .arg("PX")
                    .arg(ttl.as_millis() as u64)
                    .ignore();
            }
            if self
                .redis
                .pipe::<()>(&pipe, "publishing a reply's events")
                .await
                .is_some()
            {
                next = last_n + 1;
                failing_since = None;
                if refresh {
                    refreshed = Some(tokio::time::Instant::now());
                }
                if ended {
                    return;
                }
                continue;
            }
            // Not written: the same events go again, with whatever comes meanwhile.
            let since = *failing_since.get_or_insert_with(tokio::time::Instant::now);
            if ended && since.elapsed() > GIVE_UP_AFTER {
                tracing::warn!(message_id = %ids.message_id, "a reply's events could not be shared: only its own replica resumes it");
                return;
            }
            tokio::time::sleep(RETRY_EVERY).await;
        }
    }

    /// The reply the session's stream points at, when Redis has one (None: no such reply, or
    /// Redis cannot say).
    pub async fn find(&self, session_id: &SessionId) -> Option<SharedReply> {
        let cmd = redis::cmd("GET").arg(pointer_key(session_id)).clone();
        let id: Option<String> = self.redis.cmd(&cmd, "finding a shared reply").await?;
        Some(SharedReply {
            message_id: MessageId::parse(&id?)?,
            client: self.client.clone(),
        })
    }

    /// Whether Redis answers now (`/readyz`: without it, a resume is served by the replica
    /// running the reply only).
    pub async fn reachable(&self) -> bool {
        self.redis
            .cmd::<String>(&redis::cmd("PING"), "checking the shared reply streams")
            .await
            .is_some()
    }
}

/// `XRANGE`'s and `XREAD`'s entries: id and fields.
type Entries = Vec<(String, HashMap<String, String>)>;

impl SharedReply {
    /// The events after the first `from` (0-based), then each as it comes, until the reply's
    /// last. None when the stream is gone or no longer holds event `from + 1` (trimmed: the
    /// client reads the stored message instead).
    pub async fn events(
        self,
        from: usize,
    ) -> Result<Option<impl Stream<Item = NativeEvent> + Send + 'static>, redis::RedisError> {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Duration::from_millis(500))
            .set_response_timeout(BLOCK + Duration::from_secs(2));
        let mut conn = self
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        let key = stream_key(&self.message_id);
        let first: Entries = redis::cmd("XRANGE")
            .arg(&key)
            .arg(format!("0-{}", from + 1))
            .arg("+")
            .query_async(&mut conn)
            .await?;
        let complete = first
            .first()
            .is_some_and(|(id, _)| *id == format!("0-{}", from + 1));
        if !complete {
            return Ok(None);
        }
        let message_id = self.message_id.clone();
        Ok(Some(async_stream::stream! {
            let mut last = format!("0-{from}");
            let mut entries = first;
            let mut quiet = tokio::time::Instant::now();
            loop {
                for (id, mut fields) in entries {
                    let n = id.strip_prefix("0-").unwrap_or_default();
                    let e = NativeEvent {
                        id: format!("{message_id}:{n}"),
                        name: fields.remove("e").unwrap_or_default().into(),
                        data: fields.remove("d").unwrap_or_default(),
                    };
                    last = id;
                    quiet = tokio::time::Instant::now();
                    let end = e.is_last();
                    yield e;
                    if end {
                        return;
                    }
                }
                if quiet.elapsed() > QUIET_LIMIT {
                    return;
                }
                let read: redis::RedisResult<Option<Vec<(String, Entries)>>> = redis::cmd("XREAD")
                    .arg("BLOCK")
                    .arg(BLOCK.as_millis() as u64)
                    .arg("STREAMS")
                    .arg(&key)
                    .arg(&last)
                    .query_async(&mut conn)
                    .await;
                entries = match read {
                    Ok(r) => r.into_iter().flatten().flat_map(|(_, e)| e).collect(),
                    // Redis went away: the client reconnects, and is served where it can be.
                    Err(_) => return,
                };
            }
        }))
    }
}
