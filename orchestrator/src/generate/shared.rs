//! Native replies any replica can serve a resume of, and take over. The replica running a
//! reply publishes its events, as clients receive them, to a Redis stream of their own
//! (`hearth:reply:<message id>`, entry `0-<n>` for the event `<message id>:<n>`; a text event
//! also carries, as `t`, the tokens it is the first text of), and points the session at it
//! (`hearth:reply-of:<session id>`). A replica asked to resume a session whose reply it does
//! not run reads that stream: first what it holds after `Last-Event-ID`, then each event as it
//! is added, until the reply's last one.
//!
//! - **Bounded.** A stream keeps at most [`MAX_EVENTS`] entries (about two a token). Its
//!   expiry is [`LIVE_TTL`] while the reply runs (renewed every [`REFRESH_EVERY`]) and
//!   [`KEEP_FINISHED`] once it ended: what a replica keeps of its own finished replies.
//! - **No gap.** Events go in batches (whatever arrived since the last write), each with its
//!   explicit entry id, through one script ([`PUBLISH`]) that skips what the stream already
//!   holds; a batch that fails is sent again, whole, with the next, so the stream never skips
//!   an event or holds one twice. A resume that finds the events it needs trimmed away is
//!   refused (404), as a resume past a replica's own log is.
//! - **One owner.** The script writes only for the replica that owns the reply
//!   (`hearth:reply-owner:<message id>`): the one that began it, until another takes it over
//!   after it died (see [`crate::service`]'s takeover). A replica that finds itself no longer
//!   the owner stops the reply and stores nothing. With the first events goes the reply's job
//!   (`hearth:reply-job:<message id>`), which the taker continues; it is deleted at the end.
//! - **Redis down.** Publishing waits for Redis to come back; meanwhile, and for any reply
//!   without Redis, a resume is served by the replica running it only (`/readyz` says so),
//!   and a reply whose replica dies cannot be taken over.

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

/// The replica that runs the reply (its [`SharedReplies::replica`] token).
fn owner_key(message_id: &MessageId) -> String {
    format!("hearth:reply-owner:{message_id}")
}

/// What another replica needs to take the running reply over.
fn job_key(message_id: &MessageId) -> String {
    format!("hearth:reply-job:{message_id}")
}

/// [`PUBLISH`]'s answer when the events went in.
const OWNED: i64 = 1;

/// Adds a batch of a reply's events to its stream, unless another replica owns the reply now
/// (then 0). Entries the stream already holds (a batch sent again after a lost answer) are
/// skipped, so a stream never holds an event twice or out of order. KEYS: stream, session
/// pointer, owner, job. ARGV: owner token, TTL (ms), most events, message id, job (or empty),
/// refresh (1/0), ended (1/0), then each event's entry number, name, data and tokens.
const PUBLISH: &str = r"
local owner = redis.call('GET', KEYS[3])
if owner and owner ~= ARGV[1] then return 0 end
local top = 0
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #last > 0 then top = tonumber(string.sub(last[1][1], 3)) end
for i = 8, #ARGV, 4 do
  local n = tonumber(ARGV[i])
  if n > top then
    local entry = {'XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '0-' .. n, 'e', ARGV[i + 1], 'd', ARGV[i + 2]}
    if ARGV[i + 3] ~= '' then
      table.insert(entry, 't')
      table.insert(entry, ARGV[i + 3])
    end
    redis.call(unpack(entry))
  end
end
if ARGV[5] ~= '' then redis.call('SET', KEYS[4], ARGV[5], 'PX', ARGV[2]) end
if ARGV[6] == '1' or not owner then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[2])
  redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[2])
  if ARGV[7] == '1' then
    redis.call('DEL', KEYS[4])
  else
    redis.call('PEXPIRE', KEYS[4], ARGV[2])
  end
end
return 1
";

/// The `n` of an entry id `0-<n>`.
fn entry_number(id: &str) -> Option<usize> {
    id.strip_prefix("0-")?.parse().ok()
}

/// Token ids as a stream entry's `t` field: decimal, space-separated.
fn token_list(tokens: &[u32]) -> String {
    let mut s = String::with_capacity(tokens.len() * 6);
    for (i, t) in tokens.iter().enumerate() {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(&t.to_string());
    }
    s
}

/// A running reply's events as its stream holds them, for a replica that takes it over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// How many events: the next one's index.
    pub events: usize,
    /// The tokens generated so far, whose text the events showed (the taker replays them to
    /// get that text back).
    pub tokens: Vec<u32>,
}

impl Published {
    /// None unless the entries are `0-1`, `0-2`, … in order, their tokens well formed, and
    /// the reply not over.
    fn of(entries: Entries) -> Option<Self> {
        let mut p = Self {
            events: 0,
            tokens: Vec::new(),
        };
        for (id, fields) in entries {
            if entry_number(&id) != Some(p.events + 1) {
                return None;
            }
            p.events += 1;
            if let Some(t) = fields.get("t") {
                for token in t.split_ascii_whitespace() {
                    p.tokens.push(token.parse().ok()?);
                }
            }
            if matches!(
                fields.get("e").map(String::as_str),
                Some("message_end" | "error")
            ) {
                return None;
            }
        }
        (p.events > 0).then_some(p)
    }
}

/// The replies' shared streams, over the orchestrators' Redis.
#[derive(Debug, Clone)]
pub struct SharedReplies {
    redis: Redis,
    /// For readers: a blocking read takes a connection of its own.
    client: redis::Client,
    /// This replica, as owner of the replies it runs: random, new each start.
    replica: Arc<str>,
    publish: Arc<redis::Script>,
    /// How many replies' events are being published.
    publishing: Arc<tokio::sync::watch::Sender<usize>>,
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
            replica: uuid::Uuid::new_v4().simple().to_string().into(),
            publish: Arc::new(redis::Script::new(PUBLISH)),
            publishing: Arc::new(tokio::sync::watch::Sender::new(0)),
        })
    }

    /// Publishes `live`'s events (a native reply's) as they come, until its last one, while
    /// this replica owns the reply. `job` (the first publish only) is what another replica
    /// needs to take the reply over (see [`crate::service`]'s takeover).
    pub fn publish(&self, live: Arc<Live>, job: Option<String>) {
        let Some(ids) = live.ids.clone() else {
            return;
        };
        let me = self.clone();
        self.publishing.send_modify(|n| *n += 1);
        tokio::spawn(async move {
            me.publish_all(&live, &ids, job).await;
            me.publishing.send_modify(|n| *n -= 1);
        });
    }

    /// Waits, at most `limit`, until every reply this replica publishes has written its last
    /// event (a shutdown, before it hands its replies over).
    pub async fn published_all(&self, limit: Duration) {
        let mut rx = self.publishing.subscribe();
        let _ = tokio::time::timeout(limit, rx.wait_for(|n| *n == 0)).await;
    }

    async fn publish_all(&self, live: &Arc<Live>, ids: &TurnIds, mut job: Option<String>) {
        let mut next = live.base();
        let mut failing_since: Option<tokio::time::Instant> = None;
        let mut refreshed: Option<tokio::time::Instant> = None;
        loop {
            let mut batch = live.next_batch_with_tokens(next).await;
            // A disowned reply's end is not the reply's: the next replica goes on from here.
            if live.is_disowned() {
                batch.retain(|(_, e, _)| !matches!(e, RunEvent::End(_)));
            }
            let Some(&(last_n, _, _)) = batch.last() else {
                return;
            };
            let ended = matches!(batch.last(), Some((_, RunEvent::End(_), _)));
            // The expiries and the session's pointer are set with the first batch, renewed now
            // and then, and set for good with the last.
            let refresh = ended || refreshed.is_none_or(|t| t.elapsed() >= REFRESH_EVERY);
            let run = self.batch(ids, batch, job.as_deref(), refresh, ended);
            match self
                .redis
                .script::<i64>(&run, "publishing a reply's events")
                .await
            {
                Some(OWNED) => {
                    next = last_n + 1;
                    failing_since = None;
                    job = None;
                    if refresh {
                        refreshed = Some(tokio::time::Instant::now());
                    }
                    if ended {
                        return;
                    }
                    continue;
                }
                Some(_) => {
                    tracing::warn!(message_id = %ids.message_id, "another replica took this reply over; stopping it here");
                    live.disown();
                    return;
                }
                None => {}
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

    /// One call of [`PUBLISH`]: the events (entry `0-<n + 1>` for event `n`, with the tokens a
    /// text event is the first to carry), the job when it is new, and the expiries.
    fn batch<'a>(
        &'a self,
        ids: &TurnIds,
        batch: Vec<(usize, RunEvent, Box<[u32]>)>,
        job: Option<&str>,
        refresh: bool,
        ended: bool,
    ) -> redis::ScriptInvocation<'a> {
        let ttl = if ended { KEEP_FINISHED } else { LIVE_TTL };
        let id = &ids.message_id;
        let mut run = self.publish.prepare_invoke();
        run.key(stream_key(id))
            .key(pointer_key(&ids.session_id))
            .key(owner_key(id))
            .key(job_key(id))
            .arg(&*self.replica)
            .arg(ttl.as_millis() as u64)
            .arg(MAX_EVENTS)
            .arg(id.as_str())
            .arg(job.unwrap_or_default())
            .arg(u8::from(refresh))
            .arg(u8::from(ended));
        for (n, e, tokens) in batch {
            let e = NativeEvent::new(ids, n, e);
            run.arg(n + 1)
                .arg(&*e.name)
                .arg(e.data)
                .arg(token_list(&tokens));
        }
        run
    }

    /// Makes this replica the reply's owner: the replica that ran it can publish no more.
    pub async fn take(&self, message_id: &MessageId) -> Option<()> {
        let cmd = redis::cmd("SET")
            .arg(owner_key(message_id))
            .arg(&*self.replica)
            .arg("PX")
            .arg(LIVE_TTL.as_millis() as u64)
            .clone();
        self.redis.cmd(&cmd, "taking a reply over").await
    }

    /// The index of the next event of a reply's stream (how many it had, trimmed or not); None
    /// when it has none, or Redis cannot say.
    pub async fn next_event(&self, message_id: &MessageId) -> Option<usize> {
        let cmd = redis::cmd("XREVRANGE")
            .arg(stream_key(message_id))
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(1)
            .clone();
        let top: Entries = self.redis.cmd(&cmd, "reading a reply's last event").await?;
        top.first().and_then(|(id, _)| entry_number(id))
    }

    /// The job of a running reply, as its replica published it (None once it ended, or when
    /// Redis cannot say).
    pub async fn job(&self, message_id: &MessageId) -> Option<String> {
        let cmd = redis::cmd("GET").arg(job_key(message_id)).clone();
        self.redis.cmd(&cmd, "reading a reply's job").await?
    }

    /// Every event of a reply's stream, whole from its first: how many, and the tokens their
    /// text is. None when the stream is gone, trimmed or broken, or Redis cannot say.
    pub async fn published(&self, message_id: &MessageId) -> Option<Published> {
        let cmd = redis::cmd("XRANGE")
            .arg(stream_key(message_id))
            .arg("-")
            .arg("+")
            .clone();
        let entries: Entries = self.redis.cmd(&cmd, "reading a reply's events").await?;
        Published::of(entries)
    }

    /// The reply the session's stream points at, when Redis has one (None: no such reply, or
    /// Redis cannot say).
    pub async fn find(&self, session_id: &SessionId) -> Option<SharedReply> {
        let cmd = redis::cmd("GET").arg(pointer_key(session_id)).clone();
        let id: Option<String> = self.redis.cmd(&cmd, "finding a shared reply").await?;
        Some(self.reply(&MessageId::parse(&id?)?))
    }

    /// The shared stream of the reply `message_id`.
    pub fn reply(&self, message_id: &MessageId) -> SharedReply {
        SharedReply {
            message_id: message_id.clone(),
            client: self.client.clone(),
        }
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
    /// client reads the stored message instead). The client may hold events the stream has not
    /// (yet) got: its replica sent them before publishing them, then died; the replica that
    /// took the reply over sends them again, the same, and they are skipped here.
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
        let oldest: Entries = redis::cmd("XRANGE")
            .arg(&key)
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(1)
            .query_async(&mut conn)
            .await?;
        let held = oldest
            .first()
            .and_then(|(id, _)| entry_number(id))
            .is_some_and(|n| n <= from + 1);
        if !held {
            return Ok(None);
        }
        let first: Entries = redis::cmd("XRANGE")
            .arg(&key)
            .arg(format!("0-{}", from + 1))
            .arg("+")
            .query_async(&mut conn)
            .await?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(
        n: usize,
        name: &str,
        data: &str,
        tokens: &[u32],
    ) -> (String, HashMap<String, String>) {
        let mut fields = HashMap::from([
            ("e".to_string(), name.to_string()),
            ("d".to_string(), data.to_string()),
        ]);
        if !tokens.is_empty() {
            fields.insert("t".into(), token_list(tokens));
        }
        (format!("0-{n}"), fields)
    }

    #[test]
    fn a_whole_running_stream_gives_its_tokens_and_nothing_else_does() {
        let start = entry(1, "message_start", "{}", &[]);
        let hello = entry(2, "token", r#"{"text":"Hel"}"#, &[9, 10]);
        let rest = entry(3, "token", r#"{"text":"lo"}"#, &[11]);
        let p = Published::of(vec![start.clone(), hello.clone(), rest.clone()]).expect("whole");
        assert_eq!(
            p,
            Published {
                events: 3,
                tokens: vec![9, 10, 11],
            }
        );
        assert_eq!(Published::of(vec![]), None, "nothing published");
        assert_eq!(
            Published::of(vec![hello.clone(), rest.clone()]),
            None,
            "trimmed: its first event is gone"
        );
        assert_eq!(
            Published::of(vec![start.clone(), rest.clone()]),
            None,
            "a gap"
        );
        let end = entry(4, "message_end", "{}", &[]);
        assert_eq!(
            Published::of(vec![start.clone(), hello.clone(), rest.clone(), end]),
            None,
            "over: nothing to take over"
        );
        let mut bad = hello;
        bad.1.insert("t".into(), "9 x".into());
        assert_eq!(Published::of(vec![start, bad]), None, "a malformed token");
        assert_eq!(token_list(&[]), "");
        assert_eq!(token_list(&[7, 262_143]), "7 262143");
    }
}
