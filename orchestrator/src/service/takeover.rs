//! Replies that survive their replica. A replica that begins a native reply publishes, with its
//! first events, the reply's job (prompt tokens, sampling, model, limits: a [`JobRecord`]), and
//! each text event carries the tokens it is the first text of (see [`crate::generate`]'s
//! shared streams). When the replica dies, the orphan sweep of another one finds the reply
//! silent and claims it with a compare-and-set on its `updated_at` (no clocks compared: see
//! [`crate::server`]'s sweep); only one replica wins. The winner makes itself the reply's
//! owner in Redis, after which the dead replica (should it be alive after all) can publish no
//! more and stops, then reads the stream, and sends a worker the prompt plus the tokens
//! published so far, as worker failover does. It goes on publishing to the same stream from
//! the next event, and stores the reply. A client that reconnects anywhere with
//! `Last-Event-ID` sees every event once; a greedy (or seeded) reply stays token for token the
//! reply it would have been.
//!
//! A replica that shuts down (SIGTERM) with replies still running after its shutdown timeout
//! hands them over the same way ([`ChatService::hand_over`]): it stops them without storing
//! them and announces them, and the other replicas take them over at once rather than after
//! `--orphan-after-secs`.
//!
//! Without Redis, or when the job or the whole stream is not there (trimmed, expired), the
//! reply is marked `error`/`interrupted` with its text, as before; a replica that claimed it
//! then ends its stream with an `error` event, so that its clients learn it ended.

use std::sync::Arc;

use hearth_shared::{Grammar, SamplingParams};
use serde::{Deserialize, Serialize};

use super::{ChatError, ChatService};
use crate::generate::{
    End, GenerationError, Job, Live, Outcome, Persistence, RunEvent, SharedReplies, TurnIds,
};
use crate::ids::{MessageId, SessionId, UserId};
use crate::storage::{ReplyTimings, ReplyUsage, StoreError};
use crate::tools::Tools;

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
}

impl JobRecord {
    /// The record of a native reply's job, as JSON; None for a stateless one.
    pub fn of(job: &Job, ids: &TurnIds) -> Option<String> {
        let record = Self {
            user_id: job.user_id.as_str().to_string(),
            session_id: ids.session_id.as_str().to_string(),
            user_message_id: ids.user_message_id.as_ref().map(|m| m.as_str().to_string()),
            message_id: job.persistence.message_id()?.as_str().to_string(),
            prompt: job.prompt.clone(),
            shared_prefix: job.shared_prefix,
            params: job.params.clone(),
            max_new_tokens: job.max_new_tokens,
            logprobs: job.logprobs,
            grammar: job.grammar.clone(),
            tools: job.tools.as_deref().cloned(),
            end_user: job.end_user.clone(),
            stop: job.stop.clone(),
            ignore_eos: job.ignore_eos,
            model: job.model.as_ref().map(ToString::to_string),
            keep_alive_ms: job.keep_alive_ms,
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
    /// It was saved since it was seen, or another replica claimed it first, or it runs here.
    Alive,
    /// This replica continues it.
    TakenOver,
    /// It could not be continued: it is stored as `error` / `interrupted`, with its text.
    Failed,
}

impl ChatService {
    /// Takes over a reply left `streaming` (its `updated_at` unchanged at `seen`) by a
    /// replica that died, or marks it interrupted when it cannot be continued.
    pub async fn sweep_reply(
        self: &Arc<Self>,
        id: &MessageId,
        seen: i64,
    ) -> Result<Swept, StoreError> {
        let Some(shared) = &self.shared_replies else {
            return self.fail_reply(id, seen).await;
        };
        let job = shared.job(id).await;
        let Some((record, user_id, ids)) = job.as_deref().and_then(|j| parse(j, id)) else {
            return self.fail_reply(id, seen).await;
        };
        // A reply of a session running here is this replica's own: a slow database held its
        // saves back.
        let Ok(reservation) = self.generator.streams.reserve(&ids.session_id) else {
            return Ok(Swept::Alive);
        };
        let Some(at) = self.store.claim_interrupted(id, seen).await? else {
            return Ok(Swept::Alive);
        };
        if shared.take(id).await.is_none() {
            return self.fail_reply(id, at).await;
        }
        let Some(published) = shared.published(id).await else {
            tracing::warn!(message_id = %id, "a reply's stream is not whole in Redis; it cannot be continued");
            let why = "its events are no longer all in Redis";
            return self.fail_taken(shared, &user_id, &ids, at, why).await;
        };
        // Finding the model's tokenizer (or loading the model) may take a while: the sweep
        // goes on meanwhile.
        let (me, id) = (self.clone(), id.clone());
        tokio::spawn(async move {
            let job = match me.resumed_job(record, user_id.clone(), &ids).await {
                Ok(job) => job,
                Err(e) => {
                    tracing::warn!(message_id = %id, error = %e, "a reply whose replica died cannot be continued");
                    let why = e.to_string();
                    if let Some(shared) = me.shared_replies.as_ref() {
                        if let Err(e) = me.fail_taken(shared, &user_id, &ids, at, &why).await {
                            tracing::warn!(message_id = %id, error = %e, "could not mark an interrupted reply");
                        }
                    }
                    return;
                }
            };
            tracing::info!(message_id = %id, events = published.events, tokens = published.tokens.len(), "continuing a reply whose replica stopped");
            metrics::counter!(crate::telemetry::REPLICA_TAKEOVERS).increment(1);
            let live = Live::from_event(Some(ids), published.events);
            reservation.fill(&live);
            if let Some(shared) = &me.shared_replies {
                shared.publish(live.clone(), None);
            }
            let g = me.generator.clone();
            g.clone()
                .run_from(job, live.clone(), published.tokens)
                .await;
            g.streams.expire_later(live);
        });
        Ok(Swept::TakenOver)
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
        // Nothing may write to them once the others are told: a late save would fail their
        // claim.
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

    /// Marks a reply this replica claimed, and owns in Redis, interrupted, and ends its stream
    /// with an `error` event (with the text stored), so that a client resuming it anywhere
    /// learns that it ended.
    async fn fail_taken(
        &self,
        shared: &SharedReplies,
        user_id: &UserId,
        ids: &TurnIds,
        at: i64,
        why: &str,
    ) -> Result<Swept, StoreError> {
        let id = &ids.message_id;
        let swept = self.fail_reply(id, at).await?;
        let next = match swept {
            Swept::Failed => shared.next_event(id).await,
            _ => None,
        };
        if let Some(n) = next {
            let stored = self.store.get_message(user_id, &ids.session_id, id).await;
            let live = Live::from_event(Some(ids.clone()), n);
            shared.publish(live.clone(), None);
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
            })));
        }
        Ok(swept)
    }

    async fn fail_reply(&self, id: &MessageId, seen: i64) -> Result<Swept, StoreError> {
        Ok(match self.store.fail_interrupted(id, seen).await? {
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
    ) -> Result<Job, ChatError> {
        let target = self.target(r.model.as_deref()).await?;
        let tokenizer = self.tokenizer(&target);
        let dry_breakers = self.dry_breakers(&r.params, &tokenizer).await?;
        Ok(Job {
            user_id,
            persistence: Persistence::Stored {
                session_id: ids.session_id.clone(),
                message_id: ids.message_id.clone(),
            },
            prompt: r.prompt,
            shared_prefix: r.shared_prefix,
            params: r.params,
            dry_breakers,
            max_new_tokens: r.max_new_tokens,
            logprobs: r.logprobs,
            grammar: r.grammar,
            tools: r.tools.map(Arc::new),
            end_user: r.end_user,
            stop: r.stop,
            ignore_eos: r.ignore_eos,
            arrived: tokio::time::Instant::now(),
            budget: None,
            model: target.key().cloned(),
            tokenizer: tokenizer.tok,
            keep_alive_ms: r.keep_alive_ms,
            lease: None,
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
