//! Native replies any replica can serve a resume of, and take over. The replica running a
//! reply publishes its events to a Redis stream of their own (`hearth:reply:<message id>`,
//! entry `0-<n>` for the event `<message id>:<n>`; a text event also carries, as `t`, the tokens
//! it is the first text of), and points the session at it (`hearth:reply-of:<session id>`). A
//! replica asked to resume a session whose reply it does not run reads that stream: first what
//! it holds after `Last-Event-ID`, then each event as it is added, until the reply's last one.
//!
//! - **The stream is the truth.** Until a reply ends, its stream is what its clients were
//!   shown: the replica running it shows its own clients an event only once the event is in
//!   the stream (see [`Live`]'s gate), a replica taking the reply over continues after the
//!   stream's last event, and the reply's last event carries its stored record (`c`), so
//!   whoever stores the end stores what the stream says.
//! - **Bounded.** A stream keeps at most [`MAX_EVENTS`] entries (about two a token). Its
//!   expiry is [`LIVE_TTL`] while the reply runs (renewed every [`REFRESH_EVERY`]) and
//!   [`KEEP_FINISHED`] once it ended: what a replica keeps of its own finished replies.
//! - **No gap.** Events go in batches (whatever arrived since the last write), each with its
//!   explicit entry id, through one script ([`PUBLISH`]) that skips what the stream already
//!   holds; a batch that fails is sent again, whole, with the next, so the stream never skips
//!   an event or holds one twice.
//! - **Fenced.** The script writes only for the reply's owner: the replica holding its lease
//!   at the highest epoch (`hearth:reply-owner:<message id>`, see
//!   [`crate::storage::ReplyLease`]). A replica that takes a reply over raises the owner to its
//!   new epoch ([`TAKE`]) before it reads the stream, so it continues from everything the old
//!   owner wrote, and the old owner, should it be alive after all, writes nothing more: it
//!   finds itself stale and stops the reply (disowned). With the first events goes the reply's
//!   job (`hearth:reply-job:<message id>`), which the taker continues; it is deleted at the end.
//! - **Redis restarted.** A stream that vanished under its owner (the script finds it shorter
//!   than what the owner wrote) is written again, whole, from the owner's own log. If the
//!   owner is gone too, the taker continues from the checkpoint the database holds, and begins
//!   the stream again after it, its first entry marked (`r`, with the tokens before it): a
//!   client whose events are then ahead of, or behind, that point gets an `error` event
//!   (`stream_lost`), never other text under ids it has seen.
//! - **Redis down.** Publishing waits for Redis, and the reply's clients wait with it, for
//!   [`UNGATE_AFTER`] at most; then they are shown events without it. Meanwhile, and for any
//!   reply without Redis, a resume is served by the replica running it only (`/readyz` says
//!   so).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::live::KEEP_FINISHED;
use super::wire::NativeEvent;
use super::{Live, RunEvent, TurnIds};

mod reader;
use crate::ids::{MessageId, SessionId};
use crate::limits::Redis;
use crate::storage::{decode_tokens, encode_tokens, Completion, ReplyLease};

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

/// How long a failed publish waits before it is tried again, how long the reply's clients
/// wait for Redis before they are shown events without it, and how long a finished reply's
/// events are tried for in all.
const RETRY_EVERY: Duration = Duration::from_millis(250);
pub const UNGATE_AFTER: Duration = Duration::from_secs(10);
const GIVE_UP_AFTER: Duration = Duration::from_secs(60);

fn stream_key(message_id: &MessageId) -> String {
    format!("hearth:reply:{message_id}")
}

fn pointer_key(session_id: &SessionId) -> String {
    format!("hearth:reply-of:{session_id}")
}

/// The epoch of the lease whose holder may write the reply's stream.
fn owner_key(message_id: &MessageId) -> String {
    format!("hearth:reply-owner:{message_id}")
}

/// What another replica needs to take the running reply over.
fn job_key(message_id: &MessageId) -> String {
    format!("hearth:reply-job:{message_id}")
}

/// [`PUBLISH`]'s answers: the events went in; another replica owns the reply now; the stream
/// holds less than its owner wrote (Redis lost it).
const OWNED: i64 = 1;
const STALE: i64 = 0;
const LOST: i64 = 2;

/// Adds a batch of a reply's events to its stream for the lease at epoch `ARGV[1]`, unless a
/// higher epoch owns the reply (then 0), or the stream has lost events its owner wrote (then
/// 2: the batch begins after entries the stream does not hold, and does not begin the stream).
/// Entries the stream already holds (a batch sent again after a lost answer) are skipped, so a
/// stream never holds an event twice or out of order. KEYS: stream, session pointer, owner,
/// job. ARGV: epoch, TTL (ms), most events, message id, job (or empty), refresh (1/0), ended
/// (1/0), the stream's first entry number, then per event: entry number, name, data, tokens,
/// `r` (the tokens before a stream begun again, prefixed `=`; or empty), `c` (or empty).
const PUBLISH: &str = r"
local epoch = tonumber(ARGV[1])
local owner = tonumber(redis.call('GET', KEYS[3]) or '-1') or 0
if owner > epoch then return 0 end
local top = 0
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #last > 0 then top = tonumber(string.sub(last[1][1], 3)) end
local first = tonumber(ARGV[9])
if first > top + 1 and not (top == 0 and first == tonumber(ARGV[8])) then return 2 end
for i = 9, #ARGV, 6 do
  local n = tonumber(ARGV[i])
  if n > top then
    local entry = {'XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '0-' .. n, 'e', ARGV[i + 1], 'd', ARGV[i + 2]}
    if ARGV[i + 3] ~= '' then
      table.insert(entry, 't')
      table.insert(entry, ARGV[i + 3])
    end
    if ARGV[i + 4] ~= '' then
      table.insert(entry, 'r')
      table.insert(entry, string.sub(ARGV[i + 4], 2))
    end
    if ARGV[i + 5] ~= '' then
      table.insert(entry, 'c')
      table.insert(entry, ARGV[i + 5])
    end
    redis.call(unpack(entry))
  end
end
if ARGV[5] ~= '' then redis.call('SET', KEYS[4], ARGV[5], 'PX', ARGV[2]) end
if ARGV[6] == '1' or owner < epoch then
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

/// Makes the lease at epoch `ARGV[1]` the reply's owner unless a higher one is already (then
/// 0); with `ARGV[3]` = 1, also empties the stream (the taker begins it
/// again). KEYS: owner, stream. ARGV: epoch, TTL (ms), reset (1/0).
const TAKE: &str = r"
local owner = tonumber(redis.call('GET', KEYS[1]) or '-1') or 0
if owner > tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if ARGV[3] == '1' then redis.call('DEL', KEYS[2]) end
return 1
";

/// The `n` of an entry id `0-<n>`.
fn entry_number(id: &str) -> Option<usize> {
    id.strip_prefix("0-")?.parse().ok()
}

/// `XRANGE`'s and `XREAD`'s entries: id and fields.
type Entries = Vec<(String, HashMap<String, String>)>;

/// What a reply's stream holds before the events of this replica's own log: what it writes
/// again, first, if Redis loses the stream.
#[derive(Debug, Clone, Default)]
pub enum Before {
    /// Nothing: this replica began the reply.
    #[default]
    Nothing,
    /// The entries another replica published, as this one read them when it took the reply
    /// over.
    Entries(Entries),
    /// The stream was lost with the replica that ran the reply; this one begins it again at
    /// its first event, marked, with the tokens generated before it.
    Lost(Vec<u32>),
}

/// A running reply's events as its stream holds them, for a replica that takes it over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// How many events: the next one's index.
    pub events: usize,
    /// The tokens generated so far, whose text the events showed (the taker replays them to
    /// get that text back).
    pub tokens: Vec<u32>,
    /// The entries themselves, which the taker writes again if Redis loses the stream.
    pub entries: Entries,
}

/// What a reply's stream says, for a replica that claimed the reply.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamState {
    /// The reply runs: continue it after these events.
    Running(Published),
    /// The reply ended, and this is how: store it.
    Ended(Completion),
}

impl StreamState {
    /// None unless the entries are whole (from `0-1`, or from a stream begun again, in order),
    /// their tokens well formed, and an end carries its record.
    fn of(entries: Entries) -> Option<Self> {
        let mut p = Published {
            events: 0,
            tokens: Vec::new(),
            entries: Vec::with_capacity(entries.len()),
        };
        for (id, fields) in entries {
            let n = entry_number(&id)?;
            match (p.entries.is_empty(), fields.get("r")) {
                (true, Some(before)) => {
                    p.events = n - 1;
                    p.tokens = decode_tokens(before)?;
                }
                (false, Some(_)) => return None,
                (_, None) if n != p.events + 1 => return None,
                _ => {}
            }
            p.events = n;
            if let Some(t) = fields.get("t") {
                p.tokens.extend(decode_tokens(t)?);
            }
            if matches!(
                fields.get("e").map(String::as_str),
                Some("message_end" | "error")
            ) {
                let done = serde_json::from_str(fields.get("c")?).ok()?;
                return Some(Self::Ended(done));
            }
            p.entries.push((id, fields));
        }
        (p.events > 0).then_some(Self::Running(p))
    }
}

/// The replies' shared streams, over the orchestrators' Redis.
#[derive(Debug, Clone)]
pub struct SharedReplies {
    redis: Redis,
    /// For readers: a blocking read takes a connection of its own.
    client: redis::Client,
    publish: Arc<redis::Script>,
    take: Arc<redis::Script>,
    /// How many replies' events are being published.
    publishing: Arc<tokio::sync::watch::Sender<usize>>,
}

/// A reply another replica runs (or ran), found through its session.
#[derive(Debug, Clone)]
pub struct SharedReply {
    pub message_id: MessageId,
    client: redis::Client,
}

/// One reply's publishing: what it writes, for which lease.
struct Publisher {
    live: Arc<Live>,
    ids: TurnIds,
    epoch: i64,
    /// What another replica needs to take the reply over; written with the first batch, and
    /// again with a stream written again.
    job: Option<String>,
    before: Before,
}

impl SharedReplies {
    pub fn new(redis: Redis, url: &str) -> Result<Self, redis::RedisError> {
        Ok(Self {
            redis,
            client: redis::Client::open(url)?,
            publish: Arc::new(redis::Script::new(PUBLISH)),
            take: Arc::new(redis::Script::new(TAKE)),
            publishing: Arc::new(tokio::sync::watch::Sender::new(0)),
        })
    }

    /// Publishes `live`'s events (a native reply's, held under `lease`) as they come, until
    /// its last one, while the lease owns the reply, and marks them published in `live` as
    /// they go in. `job` is what another replica needs to take the reply over (see
    /// [`crate::service`]'s takeover); `before`, what the stream holds before `live`'s first
    /// event.
    pub fn publish(
        &self,
        live: Arc<Live>,
        lease: &ReplyLease,
        job: Option<String>,
        before: Before,
    ) {
        let Some(ids) = live.ids.clone() else {
            return;
        };
        let me = self.clone();
        let mut p = Publisher {
            live,
            ids,
            epoch: lease.epoch,
            job,
            before,
        };
        self.publishing.send_modify(|n| *n += 1);
        tokio::spawn(async move {
            me.publish_all(&mut p).await;
            me.publishing.send_modify(|n| *n -= 1);
        });
    }

    /// Waits, at most `limit`, until every reply this replica publishes has written its last
    /// event (a shutdown, before it hands its replies over).
    pub async fn published_all(&self, limit: Duration) {
        let mut rx = self.publishing.subscribe();
        let _ = tokio::time::timeout(limit, rx.wait_for(|n| *n == 0)).await;
    }

    async fn publish_all(&self, p: &mut Publisher) {
        let base = p.live.base();
        let mut next = base;
        // Whether the next batch writes the stream from its start (the first, or after Redis
        // lost it): then it carries what comes before this replica's events, and the job.
        let mut from_start = true;
        let mut failing_since: Option<tokio::time::Instant> = None;
        let mut refreshed: Option<tokio::time::Instant> = None;
        loop {
            let mut batch = p.live.next_batch_with_tokens(next).await;
            // A disowned reply's end is not the reply's: the next replica goes on from here.
            if p.live.is_disowned() {
                batch.retain(|(_, e, _)| !matches!(e, RunEvent::End(_)));
            }
            let Some(&(last_n, _, _)) = batch.last() else {
                return;
            };
            let ended = matches!(batch.last(), Some((_, RunEvent::End(_), _)));
            // The expiries and the session's pointer are set with the first batch, renewed now
            // and then, and set for good with the last.
            let refresh =
                ended || from_start || refreshed.is_none_or(|t| t.elapsed() >= REFRESH_EVERY);
            let run = self.batch(p, batch, from_start, refresh, ended);
            match self
                .redis
                .script_now::<i64>(&run, "publishing a reply's events")
                .await
            {
                Some(OWNED) => {
                    p.live.published(last_n + 1);
                    next = last_n + 1;
                    failing_since = None;
                    from_start = false;
                    refreshed = refresh.then(tokio::time::Instant::now).or(refreshed);
                    if ended {
                        return;
                    }
                    continue;
                }
                Some(STALE) => {
                    tracing::warn!(message_id = %p.ids.message_id, "another replica took this reply over; stopping it here");
                    p.live.disown();
                    return;
                }
                Some(LOST) => {
                    tracing::warn!(message_id = %p.ids.message_id, "the reply's stream was lost in Redis; writing it again");
                    next = base;
                    from_start = true;
                    continue;
                }
                _ => {}
            }
            // Not written: the same events go again, with whatever comes meanwhile.
            let since = *failing_since.get_or_insert_with(tokio::time::Instant::now);
            if !retry_after_failing(p, since.elapsed(), ended).await {
                return;
            }
        }
    }

    /// One call of [`PUBLISH`]: the events (entry `0-<n + 1>` for event `n`, with the tokens a
    /// text event is the first to carry, and its record with the end), preceded by what the
    /// stream holds before them when it is written from its start; the job then too; and the
    /// expiries.
    fn batch<'a>(
        &'a self,
        p: &Publisher,
        batch: Vec<(usize, RunEvent, Box<[u32]>)>,
        from_start: bool,
        refresh: bool,
        ended: bool,
    ) -> redis::ScriptInvocation<'a> {
        let ttl = if ended { KEEP_FINISHED } else { LIVE_TTL };
        let ids = &p.ids;
        let id = &ids.message_id;
        let base = p.live.base();
        let origin = match &p.before {
            Before::Lost(_) => base + 1,
            Before::Nothing | Before::Entries(_) => 1,
        };
        let job = p.job.as_deref().filter(|_| from_start).unwrap_or_default();
        let mut run = self.publish.prepare_invoke();
        run.key(stream_key(id))
            .key(pointer_key(&ids.session_id))
            .key(owner_key(id))
            .key(job_key(id))
            .arg(p.epoch)
            .arg(ttl.as_millis() as u64)
            .arg(MAX_EVENTS)
            .arg(id.as_str())
            .arg(job)
            .arg(u8::from(refresh))
            .arg(u8::from(ended))
            .arg(origin);
        if let (true, Before::Entries(entries)) = (from_start, &p.before) {
            for (entry, fields) in entries {
                let field = |k: &str| fields.get(k).cloned().unwrap_or_default();
                run.arg(entry_number(entry).unwrap_or_default())
                    .arg(field("e"))
                    .arg(field("d"))
                    .arg(field("t"))
                    .arg(fields.get("r").map(|r| format!("={r}")).unwrap_or_default())
                    .arg("");
            }
        }
        for (n, e, tokens) in batch {
            let record = match &e {
                RunEvent::End(o) => serde_json::to_string(&o.completion()).unwrap_or_default(),
                _ => String::new(),
            };
            let restart = match &p.before {
                Before::Lost(before) if n == base => format!("={}", encode_tokens(before)),
                _ => String::new(),
            };
            let e = NativeEvent::new(ids, n, e);
            run.arg(n + 1)
                .arg(&*e.name)
                .arg(e.data)
                .arg(encode_tokens(&tokens))
                .arg(restart)
                .arg(record);
        }
        run
    }

    /// Makes `lease` the reply's owner in Redis, after which the replica that held it before
    /// can publish no more; with `reset`, empties the reply's stream too (it is begun again).
    /// None when Redis cannot say, or when a more recent lease owns the reply.
    pub async fn take(&self, lease: &ReplyLease, reset: bool) -> Option<()> {
        let mut run = self.take.prepare_invoke();
        run.key(owner_key(&lease.message_id))
            .key(stream_key(&lease.message_id))
            .arg(lease.epoch)
            .arg(LIVE_TTL.as_millis() as u64)
            .arg(u8::from(reset));
        let taken: i64 = self.redis.script(&run, "taking a reply over").await?;
        (taken == 1).then_some(())
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

    /// The job of a running reply, as its replica published it: None when Redis cannot say,
    /// `Some(None)` when it has none (the reply ended, or Redis lost it).
    pub async fn job(&self, message_id: &MessageId) -> Option<Option<String>> {
        let cmd = redis::cmd("GET").arg(job_key(message_id)).clone();
        self.redis.cmd(&cmd, "reading a reply's job").await
    }

    /// What a reply's stream says, read whole: None when Redis cannot say, `Some(None)` when
    /// the stream is gone, trimmed or broken.
    pub async fn read(&self, message_id: &MessageId) -> Option<Option<StreamState>> {
        let cmd = redis::cmd("XRANGE")
            .arg(stream_key(message_id))
            .arg("-")
            .arg("+")
            .clone();
        let entries: Entries = self.redis.cmd(&cmd, "reading a reply's events").await?;
        Some(StreamState::of(entries))
    }

    /// The reply the session's stream points at: None when Redis cannot say, `Some(None)`
    /// when it has none (no reply shared lately, or Redis lost it).
    pub async fn find(&self, session_id: &SessionId) -> Option<Option<SharedReply>> {
        let cmd = redis::cmd("GET").arg(pointer_key(session_id)).clone();
        let id: Option<String> = self.redis.cmd(&cmd, "finding a shared reply").await?;
        Some(id.and_then(|id| Some(self.reply(&MessageId::parse(&id)?))))
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

/// After writing `p`'s events has failed for `failing`: its clients stop waiting for the
/// stream past [`UNGATE_AFTER`], and an ended reply gives up past [`GIVE_UP_AFTER`] (false);
/// else waits [`RETRY_EVERY`] before the next try (true).
async fn retry_after_failing(p: &Publisher, failing: Duration, ended: bool) -> bool {
    if failing > UNGATE_AFTER {
        p.live.unshared();
    }
    if ended && failing > GIVE_UP_AFTER {
        tracing::warn!(message_id = %p.ids.message_id, "a reply's events could not be shared: only its own replica resumes it");
        return false;
    }
    tokio::time::sleep(RETRY_EVERY).await;
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::{Finish, MessageStatus, ReplyTimings, ReplyUsage};

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
            fields.insert("t".into(), encode_tokens(tokens));
        }
        (format!("0-{n}"), fields)
    }

    fn running(s: Option<StreamState>) -> Option<(usize, Vec<u32>)> {
        match s? {
            StreamState::Running(p) => Some((p.events, p.tokens)),
            StreamState::Ended(_) => None,
        }
    }

    #[test]
    fn a_whole_running_stream_gives_its_tokens_and_an_ended_one_its_record() {
        let start = entry(1, "message_start", "{}", &[]);
        let hello = entry(2, "token", r#"{"text":"Hel"}"#, &[9, 10]);
        let rest = entry(3, "token", r#"{"text":"lo"}"#, &[11]);
        let whole = vec![start.clone(), hello.clone(), rest.clone()];
        let Some(StreamState::Running(p)) = StreamState::of(whole.clone()) else {
            panic!("a running stream");
        };
        assert_eq!((p.events, p.tokens), (3, vec![9, 10, 11]));
        assert_eq!(p.entries, whole, "kept, to be written again");
        assert_eq!(StreamState::of(vec![]), None, "nothing published");
        assert_eq!(
            StreamState::of(vec![hello.clone(), rest.clone()]),
            None,
            "trimmed: its first event is gone"
        );
        assert_eq!(
            StreamState::of(vec![start.clone(), rest.clone()]),
            None,
            "a gap"
        );
        let mut bad = hello.clone();
        bad.1.insert("t".into(), "9 x".into());
        assert_eq!(
            StreamState::of(vec![start.clone(), bad]),
            None,
            "a malformed token"
        );

        // Ended: its record says how, and is what gets stored.
        let done = Completion {
            content: "Hello".into(),
            status: MessageStatus::Complete,
            finish_reason: Finish::Stop,
            usage: ReplyUsage::default(),
            timings: ReplyTimings::default(),
            worker: Some("w1".into()),
            tool_calls: None,
        };
        let mut end = entry(4, "message_end", "{}", &[]);
        let mut ended = whole.clone();
        ended.push(end.clone());
        assert_eq!(
            StreamState::of(ended.clone()),
            None,
            "an end without its record"
        );
        end.1
            .insert("c".into(), serde_json::to_string(&done).expect("json"));
        ended.pop();
        ended.push(end);
        assert_eq!(StreamState::of(ended), Some(StreamState::Ended(done)));
    }

    #[test]
    fn a_stream_begun_again_goes_on_from_the_tokens_its_first_entry_carries() {
        let mut first = entry(7, "token", r#"{"text":"lo"}"#, &[11]);
        first.1.insert("r".into(), encode_tokens(&[9, 10]));
        let next = entry(8, "token", r#"{"text":"!"}"#, &[12]);
        assert_eq!(
            running(StreamState::of(vec![first.clone(), next.clone()])),
            Some((8, vec![9, 10, 11, 12]))
        );
        assert_eq!(
            running(StreamState::of(vec![
                entry(1, "message_start", "{}", &[]),
                first
            ])),
            None,
            "begun again in the middle"
        );
        assert_eq!(encode_tokens(&[]), "");
        assert_eq!(encode_tokens(&[7, 262_143]), "7 262143");
        assert_eq!(decode_tokens("7 262143"), Some(vec![7, 262_143]));
    }
}
