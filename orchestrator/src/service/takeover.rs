//! Replies that survive their replica. A replica that begins a native reply saves, with it,
//! the reply's job (prompt tokens, sampling, model, limits: a [`JobRecord`]), in the database
//! and with the first events of its shared stream, where each text event carries the tokens it
//! is the first text of (see [`crate::generate`]'s shared streams). When the replica dies, its
//! heartbeat stops; the orphan sweep of another one finds the reply silent and claims it: a
//! compare-and-set on its lease's epoch and `updated_at` (no clocks compared: see
//! [`crate::server`]'s sweep), which one replica wins and which fences the dead one's writes
//! out. The winner makes its lease the owner of the stream in Redis, then reads the stream:
//!
//! - still running: it sends a worker the prompt plus the tokens published so far, as worker
//!   failover does, goes on publishing from the next event, and stores the reply. A client
//!   that reconnects anywhere with `Last-Event-ID` sees every event once, and what it was
//!   shown is what is stored;
//! - ended (the dead replica published the end but did not store it): it stores the end the
//!   stream carries;
//! - lost (Redis restarted meanwhile): it continues from the checkpoint the database holds and
//!   begins the stream again there (clients ahead of it are told, see the shared streams).
//!
//! A replica that shuts down (SIGTERM) with replies still running after its shutdown timeout
//! hands them over the same way ([`ChatService::hand_over`]): it stops them without storing
//! them and announces them, and the other replicas take them over at once rather than after
//! `--orphan-after-secs`. It never claims them back itself.
//!
//! Without Redis, or when no job was saved, the reply is marked `error`/`interrupted` with its
//! text, as before; a replica that claimed it then ends its stream with an `error` event, so
//! that its clients learn it ended. Redis configured but not answering at that moment is no
//! such case: the sweep leaves the reply to a later sweep, which asks again.
//!
//! The owner saves the job in the database with its first checkpoint, and again with each
//! later one while the database refuses it (down at the reply's start), so that a reply whose
//! replica dies after Redis lost the job can still be continued.

use std::ops::ControlFlow;
use std::sync::Arc;

use tracing::Instrument;

use hearth_shared::{Grammar, SamplingParams};
use serde::{Deserialize, Serialize};

use super::{ChatError, ChatService};
use crate::generate::{
    Before, End, GenRequest, GenerationError, Job, KeepAlive, Live, Outcome, Output, Owner,
    Persistence, Placement, Prompt, RunEvent, Sampling, SharedReplies, Stopping, StreamState,
    TurnIds,
};
use crate::ids::{MessageId, SessionId, UserId};
use crate::storage::{ReplyLease, ReplyTimings, ReplyUsage, StoreError, StreamingReply};
use crate::tools::Tools;

/// How long a replica that took a reply over tries to find a worker for its model.
const TAKEOVER_PATIENCE: std::time::Duration = std::time::Duration::from_secs(60);

/// How long a shutdown waits for the events of the replies it hands over to be published.
const HAND_OVER_FLUSH: std::time::Duration = std::time::Duration::from_secs(3);

/// What another replica needs to continue a running native reply: its [`Job`], less what is
/// made again there (tokenizer, DRY breakers, the worker's place, timing).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    user_id: String,
    session_id: String,
    user_message_id: Option<String>,
    message_id: String,
    prompt: Vec<u32>,
    shared_prefix: u32,
    params: SamplingParams,
    max_new_tokens: u32,
    logprobs: Option<u32>,
    grammar: Option<Grammar>,
    tools: Option<Tools>,
    end_user: Option<String>,
    stop: Vec<String>,
    ignore_eos: bool,
    /// The exact version (`id@version`), as every worker of the reply must serve it.
    model: Option<String>,
    keep_alive_ms: Option<i64>,
    /// An operator's `keep_alive` (absent in older records: then an ordinary one).
    #[serde(default)]
    keep_alive_may_shorten: bool,
    /// The W3C `traceparent` of the request that began the reply, when it was traced: a
    /// takeover's spans link to that trace.
    #[serde(default)]
    traceparent: Option<String>,
}

impl JobRecord {
    /// The record of a native reply's job, as JSON; None for a stateless one.
    pub fn of(job: &Job, ids: &TurnIds) -> Option<String> {
        let GenRequest {
            prompt,
            sampling,
            stopping,
            output,
        } = &job.request;
        let keep_alive = job.placement.keep_alive;
        let record = Self {
            user_id: job.owner.user_id.as_str().to_string(),
            session_id: ids.session_id.as_str().to_string(),
            user_message_id: ids.user_message_id.as_ref().map(|m| m.as_str().to_string()),
            message_id: job.persistence.message_id()?.as_str().to_string(),
            prompt: prompt.tokens.clone(),
            shared_prefix: prompt.shared_prefix,
            params: sampling.params.clone(),
            max_new_tokens: stopping.max_new_tokens,
            logprobs: sampling.logprobs,
            grammar: output.grammar.clone(),
            tools: output.tools.as_deref().cloned(),
            end_user: job.owner.end_user.clone(),
            stop: stopping.stop.clone(),
            ignore_eos: stopping.ignore_eos,
            model: job.placement.model.as_ref().map(ToString::to_string),
            keep_alive_ms: keep_alive.map(|k| k.ms),
            keep_alive_may_shorten: keep_alive.is_some_and(|k| k.may_shorten),
            traceparent: hearth_shared::tracing_export::current_traceparent(),
        };
        serde_json::to_string(&record).ok()
    }

    /// The reply's ids, when each is well formed and the reply is `message_id`.
    fn ids(&self, message_id: &MessageId) -> Option<(UserId, TurnIds)> {
        let user_message_id = match &self.user_message_id {
            Some(m) => Some(MessageId::parse(m)?),
            None => None,
        };
        let ids = TurnIds {
            session_id: SessionId::parse(&self.session_id)?,
            user_message_id,
            message_id: MessageId::parse(&self.message_id)?,
        };
        (ids.message_id == *message_id).then_some((UserId::parse(&self.user_id)?, ids))
    }
}

/// What the orphan sweep did with a silent reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Swept {
    /// It was saved since it was seen, or another replica claimed it first, or it runs here
    /// (or this replica handed it over).
    Alive,
    /// This replica continues it.
    TakenOver,
    /// Its stream had ended: this replica stored the end.
    Finished,
    /// It could not be continued: it is stored as `error` / `interrupted`, with its text.
    Failed,
}

/// What a reply whose stream was lost goes on from.
enum FromCheckpoint {
    Resume(Resume),
    /// No checkpoint was saved: it cannot go on.
    Missing,
    /// Redis cannot say now, or a later lease owns the reply: a later sweep sees to it.
    Later,
}

/// Where a reply taken over goes on from.
struct Resume {
    /// The events clients may have seen: the taker's log begins after them.
    events: usize,
    tokens: Vec<u32>,
    before: Before,
}

impl ChatService {
    /// Takes over a reply left `streaming` as `seen` by a replica that died (`silent`: its
    /// `updated_at` stood still) or handed it over, or marks it interrupted when it cannot be
    /// continued.
    pub async fn sweep_reply(
        self: &Arc<Self>,
        seen: &StreamingReply,
        silent: bool,
    ) -> Result<Swept, StoreError> {
        let id = &seen.id;
        if self.handed_over(id) {
            return Ok(Swept::Alive);
        }
        let Some(shared) = &self.shared_replies else {
            return self.claim_and_fail(seen, silent, "without Redis").await;
        };
        let published = shared.job(id).await;
        let job = match &published {
            Some(Some(job)) => Some(job.clone()),
            _ => self.store.saved_reply(id).await?.and_then(|r| r.job),
        };
        let Some((record, user_id, ids)) = job.as_deref().and_then(|j| parse(j, id)) else {
            // Redis, which may hold the job, does not answer now: a later sweep asks again.
            if published.is_none() {
                return Ok(Swept::Alive);
            }
            let why = "its job is neither in Redis nor in the database";
            return self.claim_and_fail(seen, silent, why).await;
        };
        // A reply of a session running here is this replica's own: a slow database held its
        // heartbeat back.
        let Ok(reservation) = self.generator.streams.reserve(&ids.session_id) else {
            return Ok(Swept::Alive);
        };
        let Some(lease) = self.store.claim_reply(seen, silent).await? else {
            return Ok(Swept::Alive);
        };
        // Unless the stream is this lease's, a later sweep tries again (this claim renewed
        // the reply's `updated_at`, and nothing renews it after).
        if shared.take(&lease, false).await.is_none() {
            return Ok(Swept::Alive);
        }
        let resume = match self.resume_point(shared, &lease, (&user_id, &ids)).await? {
            ControlFlow::Continue(resume) => resume,
            ControlFlow::Break(swept) => return Ok(swept),
        };
        // Finding the model's tokenizer (or loading the model) may take a while: the sweep
        // goes on meanwhile.
        let me = self.clone();
        tokio::spawn(async move {
            me.continue_reply(record, user_id, ids, lease, resume, reservation)
                .await;
        });
        Ok(Swept::TakenOver)
    }

    /// Where claimed reply `lease` goes on from: its shared stream, else its checkpoint. `Break`
    /// with how the sweep ends instead: it ended already (now stored), Redis does not answer
    /// (a later sweep tries again), or nothing is left to go on from (it fails).
    async fn resume_point(
        &self,
        shared: &SharedReplies,
        lease: &ReplyLease,
        (user_id, ids): (&UserId, &TurnIds),
    ) -> Result<ControlFlow<Swept, Resume>, StoreError> {
        // Redis not answering now is no reason to give the reply up: a later sweep tries again.
        Ok(match shared.read(&lease.message_id).await {
            None => ControlFlow::Break(Swept::Alive),
            Some(Some(StreamState::Ended(done))) => {
                ControlFlow::Break(match self.store.finish_message(lease, &done).await? {
                    true => Swept::Finished,
                    false => Swept::Alive,
                })
            }
            Some(Some(StreamState::Running(p))) => ControlFlow::Continue(Resume {
                events: p.events,
                tokens: p.tokens,
                before: Before::Entries(p.entries),
            }),
            Some(None) => match self.resume_from_checkpoint(shared, lease).await? {
                FromCheckpoint::Resume(r) => ControlFlow::Continue(r),
                FromCheckpoint::Later => ControlFlow::Break(Swept::Alive),
                FromCheckpoint::Missing => {
                    let why = "its events are no longer in Redis, and no checkpoint was saved";
                    ControlFlow::Break(self.fail_taken(shared, user_id, ids, lease, why).await?)
                }
            },
        })
    }

    /// The stream was lost (Redis restarted) with the replica that ran the reply: the reply
    /// goes on from the checkpoint its owner saved last, in a stream begun again there.
    async fn resume_from_checkpoint(
        &self,
        shared: &SharedReplies,
        lease: &ReplyLease,
    ) -> Result<FromCheckpoint, StoreError> {
        let saved = self.store.saved_reply(&lease.message_id).await?;
        let Some(saved) = saved.filter(|s| s.checkpoint.events > 0) else {
            return Ok(FromCheckpoint::Missing);
        };
        // Redis not answering, or a later lease owning the reply now: not this sweep's to end.
        if shared.take(lease, true).await.is_none() {
            return Ok(FromCheckpoint::Later);
        }
        tracing::warn!(message_id = %lease.message_id, events = saved.checkpoint.events, "a reply's stream was lost in Redis; continuing it from its checkpoint");
        let tokens = saved.checkpoint.tokens;
        Ok(FromCheckpoint::Resume(Resume {
            events: saved.checkpoint.events as usize,
            before: Before::Lost(tokens.clone()),
            tokens,
        }))
    }

    /// Runs a reply taken over, on from `resume`.
    async fn continue_reply(
        self: Arc<Self>,
        record: JobRecord,
        user_id: UserId,
        ids: TurnIds,
        lease: ReplyLease,
        resume: Resume,
        reservation: crate::generate::Reservation,
    ) {
        let id = ids.message_id.clone();
        // Held from now on: finding a worker for the model may take a while (every worker may
        // be restarting), and the reply must not fall silent meanwhile.
        let live = Live::shared(ids.clone(), resume.events);
        self.generator.leases.hold(&lease, &live);
        let job = match self.patiently(&record, &user_id, &ids, &lease, &live).await {
            Ok(job) => job,
            Err(e) => {
                self.generator.leases.release(&id);
                if live.is_disowned() {
                    return;
                }
                if let Some(shared) = self.shared_replies.as_ref() {
                    let why = e.to_string();
                    if let Err(e) = self.fail_taken(shared, &user_id, &ids, &lease, &why).await {
                        tracing::warn!(message_id = %id, error = %e, "could not mark an interrupted reply");
                    }
                }
                return;
            }
        };
        tracing::info!(message_id = %id, epoch = lease.epoch, events = resume.events, tokens = resume.tokens.len(), "continuing a reply whose replica stopped");
        metrics::counter!(crate::telemetry::REPLICA_TAKEOVERS).increment(1);
        reservation.fill(&live);
        if let Some(shared) = &self.shared_replies {
            shared.publish(live.clone(), &lease, None, resume.before);
        }
        let g = self.generator.clone();
        let span = tracing::info_span!("hearth.takeover", otel.name = "takeover", hearth.message_id = %id, hearth.epoch = lease.epoch);
        hearth_shared::tracing_export::link_to(&span, record.traceparent.as_deref());
        let chat = span.in_scope(|| crate::generate::Generator::chat_span(&job));
        let run = g.clone().run_from(job, live.clone(), resume.tokens);
        run.instrument(chat).instrument(span).await;
        g.streams.expire_later(live);
    }

    /// The job again ([`Self::resumed_job`]), tried for [`TAKEOVER_PATIENCE`] while it cannot
    /// be made (no worker serves the model now: they may all be restarting), unless the reply
    /// is lost meanwhile.
    async fn patiently(
        &self,
        record: &JobRecord,
        user_id: &UserId,
        ids: &TurnIds,
        lease: &ReplyLease,
        live: &Live,
    ) -> Result<Job, ChatError> {
        let deadline = tokio::time::Instant::now() + TAKEOVER_PATIENCE;
        loop {
            let tried = self
                .resumed_job(record.clone(), user_id.clone(), ids, lease)
                .await;
            match tried {
                Err(_) if !live.is_disowned() && tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                }
                done => return done,
            }
        }
    }

    /// At shutdown, with Redis reachable: hands every running native reply over to the other
    /// replicas (disowned here, not stored: their streams end without a last event and their
    /// clients resume elsewhere), once their events are all published, and tells the others to
    /// take them over now. Returns how many; 0 without Redis (they are stopped instead).
    pub async fn hand_over(&self) -> usize {
        let Some(shared) = &self.shared_replies else {
            return 0;
        };
        if !shared.reachable().await {
            return 0;
        }
        let handed = self.generator.streams.hand_over_all();
        if handed.is_empty() {
            return 0;
        }
        self.handed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(handed.iter().cloned());
        // Nothing may write to them once the others are told: their claim needs the epoch
        // they read.
        shared.published_all(HAND_OVER_FLUSH).await;
        self.generator.saves_done(HAND_OVER_FLUSH).await;
        if let Some(bus) = &self.stop_bus {
            bus.release(&handed).await;
        }
        tracing::info!(
            replies = handed.len(),
            "running replies handed over to the other replicas"
        );
        handed.len()
    }

    /// Whether this replica handed the reply over (it never claims it back).
    fn handed_over(&self, id: &MessageId) -> bool {
        self.handed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(id)
    }

    /// Marks a reply this replica claimed, and owns in Redis, interrupted, and ends its stream
    /// with an `error` event (with the text stored), so that a client resuming it anywhere
    /// learns that it ended.
    async fn fail_taken(
        &self,
        shared: &SharedReplies,
        user_id: &UserId,
        ids: &TurnIds,
        lease: &ReplyLease,
        why: &str,
    ) -> Result<Swept, StoreError> {
        let id = &ids.message_id;
        if !self.store.fail_interrupted(lease).await? {
            return Ok(Swept::Alive);
        }
        tracing::warn!(message_id = %id, why, "a reply whose replica stopped cannot be continued");
        if let Some(n) = shared.next_event(id).await {
            let stored = self.store.get_message(user_id, &ids.session_id, id).await;
            let live = Live::from_event(Some(ids.clone()), n);
            shared.publish(live.clone(), lease, None, Before::Nothing);
            live.push(RunEvent::End(Box::new(Outcome {
                content: stored.map(|m| m.content).unwrap_or_default(),
                end: End::Failed(GenerationError::Unavailable(format!(
                    "the replica running this reply stopped, and the reply cannot be \
                     continued: {why}"
                ))),
                tool_calls: None,
                usage: ReplyUsage::default(),
                timings: ReplyTimings::default(),
                worker: None,
                stop_sequence: None,
            })));
            live.settle();
        }
        Ok(Swept::Failed)
    }

    /// Without Redis (or without the reply's job), a silent reply cannot be continued: it is
    /// claimed, so that its replica can store nothing more, and marked interrupted.
    async fn claim_and_fail(
        &self,
        seen: &StreamingReply,
        silent: bool,
        why: &str,
    ) -> Result<Swept, StoreError> {
        let Some(lease) = self.store.claim_reply(seen, silent).await? else {
            return Ok(Swept::Alive);
        };
        tracing::warn!(message_id = %seen.id, why, "a reply whose replica stopped cannot be continued");
        Ok(match self.store.fail_interrupted(&lease).await? {
            true => Swept::Failed,
            false => Swept::Alive,
        })
    }

    /// The job again, on this replica: its model's tokenizer and DRY breakers, a new place
    /// on a worker (taken when it runs), no budget (the first replica charged the reply).
    async fn resumed_job(
        &self,
        r: JobRecord,
        user_id: UserId,
        ids: &TurnIds,
        lease: &ReplyLease,
    ) -> Result<Job, ChatError> {
        let target = self.target_for(None, r.model.as_deref()).await?;
        let tokenizer = self.tokenizer(&target);
        let dry_breakers = self.dry_breakers(&r.params, &tokenizer).await?;
        Ok(Job {
            request: GenRequest {
                prompt: Prompt {
                    tokens: r.prompt,
                    shared_prefix: r.shared_prefix,
                },
                sampling: Sampling {
                    params: r.params,
                    dry_breakers,
                    logprobs: r.logprobs,
                },
                stopping: Stopping {
                    max_new_tokens: r.max_new_tokens,
                    stop: r.stop,
                    ignore_eos: r.ignore_eos,
                },
                output: Output {
                    grammar: r.grammar,
                    tools: r.tools.map(Arc::new),
                },
            },
            owner: Owner {
                user_id,
                end_user: r.end_user,
                arrived: tokio::time::Instant::now(),
                budget: None,
            },
            placement: Placement {
                model: target.key().cloned(),
                tokenizer: tokenizer.tok,
                keep_alive: r.keep_alive_ms.map(|ms| KeepAlive {
                    ms,
                    may_shorten: r.keep_alive_may_shorten,
                }),
                lease: None,
            },
            persistence: Persistence::Stored {
                session_id: ids.session_id.clone(),
                lease: lease.clone(),
                record: None,
            },
        })
    }
}

fn parse(job: &str, id: &MessageId) -> Option<(JobRecord, UserId, TurnIds)> {
    let record: JobRecord = serde_json::from_str(job).ok()?;
    let (user_id, ids) = record.ids(id)?;
    Some((record, user_id, ids))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(message_id: &MessageId) -> JobRecord {
        JobRecord {
            user_id: UserId::random().as_str().into(),
            session_id: SessionId::random().as_str().into(),
            user_message_id: Some(MessageId::random().as_str().into()),
            message_id: message_id.as_str().into(),
            prompt: vec![2, 105, 7],
            shared_prefix: 0,
            params: SamplingParams::default(),
            max_new_tokens: 40,
            logprobs: None,
            grammar: Some(Grammar::Regex {
                pattern: "[a-z]+".into(),
            }),
            tools: None,
            end_user: Some("u1".into()),
            stop: vec!["\n\n".into()],
            ignore_eos: true,
            model: Some("gemma@2".into()),
            keep_alive_ms: Some(-1),
            keep_alive_may_shorten: false,
            traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
        }
    }

    #[test]
    fn a_job_reads_back_as_written_and_only_for_its_own_reply() {
        let id = MessageId::random();
        let r = record(&id);
        let json = serde_json::to_string(&r).expect("json");
        let (back, user, ids) = parse(&json, &id).expect("parsed");
        assert_eq!(back, r);
        assert_eq!(user.as_str(), r.user_id);
        assert_eq!(ids.message_id, id);
        assert_eq!(
            parse(&json, &MessageId::random()),
            None,
            "another reply's job"
        );
        let mut bad = r.clone();
        bad.session_id = "not an id".into();
        let json = serde_json::to_string(&bad).expect("json");
        assert_eq!(parse(&json, &id), None, "a malformed id");
        assert_eq!(parse("{", &id), None);
    }
}
