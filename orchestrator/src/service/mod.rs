//! The chat service: the one thing the HTTP handlers call. It owns the store, the worker pool,
//! the limiter, the running replies and the stop bus, all private, so every rule about them
//! (who may see a session, what is charged and when, one running reply per session, what a
//! stop or a delete does on other replicas) lives here and nowhere else.
//!
//! Requests reach it validated ([`ValidTurn`]); it answers with stored records or a running
//! reply's [`Live`] log, which the API turns into JSON or Server-Sent Events.

mod breakers;
mod error;
mod models;
mod session;
mod shared_prompt;
mod takeover;
mod tokenizers;
mod turn;

pub use error::{ChatError, LoadRefusal};
pub use models::{ModelDefaults, Target};
pub use session::{next_cursor, session_query, MessagePage, ValidPatch, ValidSession};
pub use shared_prompt::{SharedPromptText, SharedPrompts};
pub use takeover::{JobRecord, Swept};
pub use tokenizers::{ModelTokenizer, Tokenizers};

pub use turn::{
    check_params, Conversation, GenOptions, NativeTurn, RawPrompt, ToolResult, UserText, ValidTurn,
    MAX_CONTENT_BYTES, MAX_TOOL_RESULTS,
};

use std::sync::Arc;
use std::time::Duration;

use hearth_shared::chat::{
    render, ChatError as TemplateError, Message as ChatMessage, Role as ChatRole,
};
use hearth_shared::SamplingParams;
use tokio_stream::{Stream, StreamExt};

use crate::auth::{AuthError, KeyChecks};
use crate::bus::StopBus;
use crate::generate::wire::NativeEvent;
use crate::generate::{
    Before, Generator, Job, KeepAlive, Leases, Live, Persistence, Reservation, SharedReplies,
    SharedReply, Streams, TurnIds,
};
use crate::ids::{MessageId, SessionId, UserId};
use crate::limits::{Budget, Limiter, Quota};
use crate::storage::{
    Message, MessageStatus, NewToolResult, ReplyLease, Role, Session, SessionPatch, SessionQuery,
    Store, User,
};
use crate::tools::{result_text, Tools};
use crate::workers::{Tenant, WorkerPool};

/// Server-wide limits and defaults of the chat service.
#[derive(Debug, Clone)]
pub struct ChatLimits {
    /// Reply length when a request (and its session) names none.
    pub default_max_tokens: u32,
    /// Limits for keys that have none of their own (and for the local user without auth).
    pub requests_per_minute: Option<i64>,
    pub tokens_per_day: Option<i64>,
    /// Sessions one user may keep (deleted ones do not count).
    pub max_sessions_per_user: u64,
    /// Messages one session may hold; a longer conversation continues in a new session.
    pub max_messages_per_session: usize,
    /// Bytes of text one session may hold (its messages together), checked when a turn starts.
    pub max_session_bytes: usize,
    /// Longest stay an ordinary key's `keep_alive` may give a model, in milliseconds.
    pub max_keep_alive_ms: i64,
    /// Loads on demand one ordinary key may start in an hour (admin keys: any).
    pub max_loads_per_hour: i64,
}

impl Default for ChatLimits {
    fn default() -> Self {
        Self {
            default_max_tokens: 1024,
            requests_per_minute: None,
            tokens_per_day: None,
            max_sessions_per_user: 10_000,
            max_messages_per_session: 10_000,
            max_session_bytes: 16 << 20,
            max_keep_alive_ms: 3_600_000,
            max_loads_per_hour: 20,
        }
    }
}

/// What the service is made of; [`ChatService::new`] takes them all.
#[derive(Debug)]
pub struct ServiceParts {
    pub store: Arc<dyn Store>,
    pub pool: Arc<WorkerPool>,
    /// The default tokenizer (`--tokenizer`) and the models' own ones.
    pub tokenizers: Tokenizers,
    pub limiter: Limiter,
    /// Shared with the stop bus's listener and with shutdown, which stops what still runs.
    pub streams: Arc<Streams>,
    /// Relays stops to the replica running a reply (with Redis).
    pub stop_bus: Option<StopBus>,
    pub limits: ChatLimits,
    /// Operators' system prompts whose prefix cache every user shares.
    pub shared_prompts: SharedPrompts,
    /// Native replies' events in Redis, so any replica can serve a resume (with Redis).
    pub shared_replies: Option<SharedReplies>,
}

#[derive(Debug)]
pub struct ChatService {
    store: Arc<dyn Store>,
    generator: Arc<Generator>,
    limiter: Arc<Limiter>,
    stop_bus: Option<StopBus>,
    limits: ChatLimits,
    shared_prompts: SharedPrompts,
    breakers: Arc<breakers::Breakers>,
    tokenizers: Tokenizers,
    shared_replies: Option<SharedReplies>,
    /// Replies this replica handed over as it shut down: it never claims them back.
    handed: std::sync::Mutex<std::collections::HashSet<MessageId>>,
    key_checks: KeyChecks,
    /// One gate per model being loaded on demand, so that one load serves every request
    /// waiting for it.
    loads: std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// Most choices (`n`) one request may ask for.
pub const MAX_CHOICES: u32 = 16;

/// The authenticated user of a request and the limits that apply to it.
#[derive(Debug, Clone)]
pub struct Caller {
    pub user: User,
    pub quota: Quota,
    /// May use the admin API: an admin key's owner, or the local user of a server without
    /// keys (which listens on loopback only).
    pub admin: bool,
}

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

/// A model a request names: one a worker serves (or none yet: no worker has reported its
/// model), or one some worker's repository holds, which must be loaded first.
enum Resolved {
    Served(Target),
    Loadable { spec: String, asked: String },
}

/// How long a request waits for its model's load on demand before it is answered 503.
const ON_DEMAND_LOAD_TIMEOUT: Duration = Duration::from_secs(300);

/// How long a stop waits for the reply to end and be stored.
const STOP_WAIT: Duration = Duration::from_secs(10);

/// Largest default reply length a session may store when no worker has reported its context yet.
const MAX_SESSION_MAX_TOKENS: u32 = 1 << 20;

impl ChatService {
    pub fn new(p: ServiceParts) -> Self {
        Self {
            generator: Arc::new(Generator {
                pool: p.pool,
                store: p.store.clone(),
                streams: p.streams,
                savers: tokio::sync::watch::Sender::new(0),
                leases: Arc::default(),
            }),
            store: p.store,
            limiter: Arc::new(p.limiter),
            stop_bus: p.stop_bus,
            limits: p.limits,
            shared_prompts: p.shared_prompts,
            breakers: Arc::default(),
            tokenizers: p.tokenizers,
            shared_replies: p.shared_replies,
            handed: std::sync::Mutex::default(),
            key_checks: KeyChecks::default(),
            loads: std::sync::Mutex::default(),
        }
    }

    /// The leases of the replies running here, for the server's heartbeat to renew.
    pub(crate) fn leases(&self) -> Arc<Leases> {
        self.generator.leases.clone()
    }

    // --- Who is asking ---

    /// The local user of a server without keys, with the server's limits.
    pub fn local_caller(&self, user: &User) -> Caller {
        Caller {
            admin: true,
            user: user.clone(),
            quota: Quota {
                bucket: user.id.to_string(),
                requests_per_minute: self.limits.requests_per_minute,
                tokens_per_day: self.limits.tokens_per_day,
            },
        }
    }

    /// The owner of an API key, with the key's limits (the server's where it has none).
    pub async fn key_caller(&self, token: &str) -> Result<Caller, ChatError> {
        match self
            .key_checks
            .authenticate(self.store.as_ref(), token)
            .await
        {
            Ok(c) => Ok(Caller {
                admin: c.key.admin,
                quota: Quota {
                    bucket: c.key.id.to_string(),
                    requests_per_minute: c
                        .key
                        .requests_per_minute
                        .or(self.limits.requests_per_minute),
                    tokens_per_day: c.key.tokens_per_day.or(self.limits.tokens_per_day),
                },
                user: c.user,
            }),
            Err(AuthError::InvalidKey) => Err(ChatError::InvalidKey),
            Err(AuthError::Store(e)) => Err(e.into()),
        }
    }

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

    /// The model `asked` names (`name`: its newest version; `name@version`), else the default
    /// model, for `caller`'s request; 404 `model_not_found` for one no worker serves. Until a
    /// worker has reported its model, nothing is refused here: the request waits for a worker
    /// as any other. A model no worker has ready yet, only loading, is a 503 with
    /// `Retry-After`. A model no worker holds but some worker's repository has is loaded
    /// first, on demand, and charged to the caller (see [`Self::load_on_demand`]): call this
    /// only once the request has passed every other check, and been charged.
    pub async fn target(&self, caller: &Caller, asked: Option<&str>) -> Result<Target, ChatError> {
        self.target_for(Some(caller), asked).await
    }

    /// [`Self::target`] for `caller`, or (None) for this replica itself: a reply it takes over,
    /// charged when it started.
    async fn target_for(
        &self,
        caller: Option<&Caller>,
        asked: Option<&str>,
    ) -> Result<Target, ChatError> {
        let target = match self.resolve(asked)? {
            Resolved::Served(t) => t,
            Resolved::Loadable { spec, asked } => {
                self.load_on_demand(caller, &spec, &asked).await?
            }
        };
        self.with_tokenizer(target).await
    }

    /// [`Self::target`] without a load: None for a model that must be loaded first (the
    /// request that needs it loads it). So naming a model, as a session does, costs no load.
    pub async fn loaded_target(&self, asked: Option<&str>) -> Result<Option<Target>, ChatError> {
        match self.resolve(asked)? {
            Resolved::Served(t) => Ok(Some(self.with_tokenizer(t).await?)),
            Resolved::Loadable { .. } => Ok(None),
        }
    }

    /// The model `asked` names, served or to be loaded on demand.
    fn resolve(&self, asked: Option<&str>) -> Result<Resolved, ChatError> {
        let model = match self.generator.pool.resolve(asked) {
            Ok(model) => model,
            Err(u) => {
                return match (u.loadable.clone(), asked) {
                    (Some(spec), Some(asked)) => Ok(Resolved::Loadable {
                        spec,
                        asked: asked.to_string(),
                    }),
                    _ => Err(u.into()),
                }
            }
        };
        if let Some(m) = &model {
            if m.ready_workers == 0 && m.loading_workers > 0 {
                return Err(ChatError::ModelLoading(m.key.to_string()));
            }
        }
        Ok(Resolved::Served(Target {
            model,
            tokenizer: None,
        }))
    }

    /// `target` with its model's tokenizer.
    async fn with_tokenizer(&self, mut target: Target) -> Result<Target, ChatError> {
        if let Some(m) = &target.model {
            let pool = &self.generator.pool;
            target.tokenizer = Some(self.tokenizers.for_model(pool, m).await?);
        }
        Ok(target)
    }

    /// Loads the repository version `spec` (which `asked` names) on the worker with the most
    /// room, which first unloads its least recently used idle models if it must (never a
    /// pinned one, nor one used within its `--min-resident-secs`), and waits for it. Requests
    /// for a model being loaded here wait for that one load; the one that starts it is charged
    /// for it first ([`Self::charge_load`]). A refusal says the same to every caller, and
    /// more to an admin key.
    async fn load_on_demand(
        &self,
        caller: Option<&Caller>,
        spec: &str,
        asked: &str,
    ) -> Result<Target, ChatError> {
        let gate = {
            let mut loads = self.loads.lock().unwrap_or_else(|p| p.into_inner());
            loads.entry(spec.to_string()).or_default().clone()
        };
        let _one_load = gate.lock().await;
        let pool = &self.generator.pool;
        // Another request may have loaded it while this one waited.
        if let Ok(Some(model)) = pool.resolve(Some(asked)) {
            if model.ready_workers > 0 {
                return Ok(Target {
                    model: Some(model),
                    tokenizer: None,
                });
            }
        }
        if let Some(c) = caller {
            self.charge_load(c).await?;
        }
        let user = caller.map(|c| c.user.id.to_string());
        tracing::info!(
            model = spec,
            user = user.as_deref(),
            "loading a model on demand"
        );
        metrics::counter!(crate::telemetry::MODEL_LOADS).increment(1);
        let loaded =
            tokio::time::timeout(ON_DEMAND_LOAD_TIMEOUT, pool.load_model(spec, None, true));
        let refused = |why, retry_after_secs, detail: String| {
            tracing::warn!(model = spec, %detail, "a load on demand did not happen");
            ChatError::LoadRefused {
                model: spec.to_string(),
                why,
                retry_after_secs,
                detail: caller.is_some_and(|c| c.admin).then_some(detail),
            }
        };
        match loaded.await {
            Ok(Ok(_)) => {}
            Ok(Err(crate::workers::AdminError::NotFound(_))) => {
                return Err(pool.resolve(Some(asked)).err().map_or_else(
                    || ChatError::Unavailable(format!("the model {spec} could not be loaded")),
                    ChatError::from,
                ))
            }
            Ok(Err(crate::workers::AdminError::NoRoom {
                detail,
                retry_after_secs,
            })) => return Err(refused(LoadRefusal::NoRoom, retry_after_secs, detail)),
            Ok(Err(e)) => return Err(refused(LoadRefusal::Failed, None, e.to_string())),
            Err(_) => return Err(ChatError::ModelLoading(spec.to_string())),
        }
        Ok(Target {
            model: pool.resolve(Some(asked))?,
            tokenizer: None,
        })
    }

    /// The repository version (`name@version`) that [`Self::target`] would load on demand
    /// for `asked` before a request could start; none when a worker holds it already (or
    /// nothing can load it, which `target` refuses).
    pub fn needs_load(&self, asked: Option<&str>) -> Option<String> {
        asked?;
        self.generator.pool.resolve(asked).err()?.loadable
    }

    /// [`Self::needs_load`] for a turn in the caller's session `id` (none when the session
    /// cannot be read: the turn itself says why).
    pub async fn session_needs_load(&self, caller: &Caller, id: &SessionId) -> Option<String> {
        // Without a repository nothing loads on demand: no read of the session for it.
        if self.generator.pool.available().is_empty() {
            return None;
        }
        let session = self.store.get_session(&caller.user.id, id).await.ok()?;
        self.needs_load(session.model.as_deref())
    }

    /// The model `asked` names, as [`Self::target`] finds it, in any state.
    pub fn lookup(&self, asked: Option<&str>) -> Result<Target, ChatError> {
        Ok(Target {
            model: self.generator.pool.resolve(asked)?,
            tokenizer: None,
        })
    }

    /// Every model some worker serves, as `/v1/models` lists them.
    pub fn models(&self) -> Vec<crate::workers::ServedModel> {
        self.generator.pool.models()
    }

    /// Every `name@version` the workers' repositories hold, loaded or not.
    pub fn available(&self) -> Vec<String> {
        self.generator.pool.available()
    }

    // --- Administration (admin callers only; the API checks) ---

    /// Every worker and the models it holds.
    pub fn worker_models(&self) -> Vec<crate::workers::WorkerModels> {
        self.generator.pool.worker_models()
    }

    /// Loads `model` on `worker`, else where it fits (see [`crate::workers::WorkerPool::load_model`]).
    pub async fn load_model(
        &self,
        model: &str,
        worker: Option<&str>,
    ) -> Result<(String, crate::workers::WorkerModel), crate::workers::AdminError> {
        self.generator.pool.load_model(model, worker, false).await
    }

    /// Unloads `model` from the workers that hold it (or from `worker`).
    pub async fn unload_model(
        &self,
        model: &str,
        worker: Option<&str>,
        deadline: Option<Duration>,
    ) -> Result<Vec<(String, u32)>, crate::workers::AdminError> {
        self.generator
            .pool
            .unload_model(model, worker, deadline)
            .await
    }

    /// The text of token ids for `target`'s model (a legacy completion's echoed prompt);
    /// nothing for ids its tokenizer cannot read.
    pub fn decode(&self, target: &Target, ids: &[u32]) -> String {
        self.tokenizer(target).tok.decode(ids).unwrap_or_default()
    }

    /// `target`'s tokenizer: its model's own, else the default one.
    fn tokenizer(&self, target: &Target) -> ModelTokenizer {
        target
            .tokenizer
            .clone()
            .unwrap_or_else(|| self.tokenizers.default_tokenizer().clone())
    }

    // --- Sessions ---

    /// Creates a session, unless the user already keeps the most sessions allowed. Its model
    /// must be served or loadable; it is not loaded here (its first turn loads it), so its
    /// `max_tokens` is checked against the model's context only when a worker holds it.
    pub async fn create_session(
        &self,
        user: &User,
        session: ValidSession,
    ) -> Result<Session, ChatError> {
        let cap = self.limits.max_sessions_per_user;
        if self.store.count_sessions(&user.id).await? >= cap {
            return Err(ChatError::TooManySessions { max: cap });
        }
        let mut new = session.new;
        let target = self.loaded_target(new.model.as_deref()).await?;
        new.max_tokens = session
            .max_tokens
            .map(|n| session_max_tokens(n, target.as_ref()))
            .transpose()?;
        Ok(self.store.create_session(&user.id, new).await?)
    }

    pub async fn sessions(&self, user: &User, q: &SessionQuery) -> Result<Vec<Session>, ChatError> {
        Ok(self.store.list_sessions(&user.id, q).await?)
    }

    pub async fn session(&self, user: &User, id: &SessionId) -> Result<Session, ChatError> {
        Ok(self.store.get_session(&user.id, id).await?)
    }

    pub async fn update_session(
        &self,
        user: &User,
        id: &SessionId,
        patch: ValidPatch,
    ) -> Result<Session, ChatError> {
        // The caller's session first: another's (or none) costs nothing. The session's model
        // after the patch bounds its reply length, when a worker holds it (nothing is loaded).
        let session = self.store.get_session(&user.id, id).await?;
        let model = match &patch.patch.model {
            Some(m) => m.as_deref(),
            None => session.model.as_deref(),
        };
        let target = self.loaded_target(model).await?;
        let max_tokens = match patch.max_tokens {
            Some(Some(n)) => Some(Some(session_max_tokens(n, target.as_ref())?)),
            Some(None) => Some(None),
            None => None,
        };
        let patch = SessionPatch {
            max_tokens,
            ..patch.patch
        };
        Ok(self.store.update_session(&user.id, id, patch).await?)
    }

    /// One page of a session's messages, oldest first (a reply still streaming included), and
    /// the cursor of the page before it when there is one.
    pub async fn messages(
        &self,
        user: &User,
        id: &SessionId,
        page: MessagePage,
    ) -> Result<(Vec<Message>, Option<String>), ChatError> {
        let data = self
            .store
            .list_messages_page(&user.id, id, page.before, page.limit)
            .await?;
        let full = data.len() == page.limit as usize;
        let earlier = data
            .first()
            .filter(|m| full && m.seq > 1)
            .map(|m| m.seq.to_string());
        Ok((data, earlier))
    }

    /// Deletes a session: stops its running reply first (here, or on another replica through
    /// the stop bus) so it is not left generating for nobody, then frees its KV cache on the
    /// workers.
    pub async fn delete_session(&self, user: &User, id: &SessionId) -> Result<(), ChatError> {
        self.store.get_session(&user.id, id).await?;
        if let Some(live) = self.running(id) {
            live.stop();
            let _ = tokio::time::timeout(Duration::from_secs(5), live.outcome()).await;
        } else if let Some(bus) = &self.stop_bus {
            bus.publish(id).await;
        }
        self.store.delete_session(&user.id, id).await?;
        // Now and once more a little later, in case a reply stopped on another replica hands
        // its cache back after the first call.
        let pool = self.generator.pool.clone();
        let id = id.clone();
        tokio::spawn(async move {
            pool.drop_session(&id).await;
            tokio::time::sleep(Duration::from_secs(2)).await;
            pool.drop_session(&id).await;
        });
        Ok(())
    }

    // --- Generation ---

    /// Starts a native turn in one of the caller's sessions and returns its running reply.
    ///
    /// In order, so that a refused request costs nothing and changes nothing: the session
    /// (404), its model (404 when no worker serves it or can load it), the options against the
    /// served context (422), the session's place (409: one reply at a time), the history and
    /// its cap (422) and what the turn needs from it (409, 404, 422); then the caller's rate
    /// limit and token budget are charged, the model is loaded if it must be (charged to the
    /// caller too; its context checked then), the prompt is fitted, a worker is taken (503) and
    /// only then the turn is stored and generation starts.
    pub async fn start_turn(
        &self,
        caller: &Caller,
        session_id: &SessionId,
        turn: ValidTurn<NativeTurn>,
    ) -> Result<Arc<Live>, ChatError> {
        let user_id = &caller.user.id;
        let (input, opts, arrived) = turn.into_parts();
        let session = self.store.get_session(user_id, session_id).await?;
        let loaded = self.loaded_target(session.model.as_deref()).await?;
        // The turn's own value, else the session's default (else the server's).
        let max_tokens = opts
            .max_tokens()
            .or_else(|| session.max_tokens.and_then(|n| u32::try_from(n).ok()));
        if let (Some(n), Some(t)) = (max_tokens, &loaded) {
            check_max_tokens(n, t)?;
        }
        let reservation = self.generator.streams.reserve(session_id)?;
        let history = self.store.list_messages(user_id, session_id).await?;
        self.check_room(&history, &input)?;
        let (convo, store) = prepare(&session, history, &input, opts.tools().map(|t| &**t))?;
        let budget = self.charge(caller, max_tokens).await?;
        compile_grammars(&opts).await?;
        let target = match loaded {
            Some(t) => t,
            None => {
                self.load_for(caller, session.model.as_deref(), max_tokens)
                    .await?
            }
        };
        let (prompt, max_new_tokens, shared_prefix) = self.plan(convo, max_tokens, &target).await?;
        let params = match opts.params() {
            Some(p) => p.clone(),
            None => target.defaults().with_session(session.params.as_ref()),
        };
        let tokenizer = self.tokenizer(&target);
        let dry_breakers = self.dry_breakers(&params, &tokenizer).await?;
        let (tenant, model) = (Tenant::user(user_id), target.key().cloned());
        let place = self
            .generator
            .pool
            .admit(&tenant, model.as_ref(), Some(session_id), &[])
            .await?;
        let (user_message_id, message_id) = self.store_turn(user_id, session_id, store).await?;
        let ids = TurnIds {
            session_id: session_id.clone(),
            user_message_id,
            message_id: message_id.clone(),
        };
        let job = Job {
            user_id: user_id.clone(),
            persistence: Persistence::Stored {
                session_id: session_id.clone(),
                lease: ReplyLease::first(message_id),
                record: None,
            },
            prompt,
            shared_prefix,
            params,
            dry_breakers,
            max_new_tokens,
            logprobs: opts.logprobs(),
            grammar: opts.grammar().cloned(),
            tools: opts.tools().cloned(),
            end_user: opts.end_user().map(str::to_string),
            stop: opts.stop().to_vec(),
            ignore_eos: opts.ignore_eos(),
            arrived,
            budget,
            model,
            tokenizer: tokenizer.tok,
            keep_alive: self.keep_alive(caller, opts.keep_alive_ms()),
            lease: Some(place),
        };
        Ok(self.launch(ids, job, reservation))
    }

    /// The model `asked` names, loaded on demand for `caller` (see [`Self::target`]), and a
    /// reply length checked against its context now that it is known.
    async fn load_for(
        &self,
        caller: &Caller,
        asked: Option<&str>,
        max_tokens: Option<u32>,
    ) -> Result<Target, ChatError> {
        let target = self.target(caller, asked).await?;
        if let Some(n) = max_tokens {
            check_max_tokens(n, &target)?;
        }
        Ok(target)
    }

    /// Starts a stored turn's generation: its log in the session's place, its job saved with
    /// it (and with its shared stream, with Redis), for another replica to take it over.
    fn launch(&self, ids: TurnIds, mut job: Job, reservation: Reservation) -> Arc<Live> {
        let record = JobRecord::of(&job, &ids);
        let live = match &self.shared_replies {
            Some(_) => Live::shared(ids, 0),
            None => Live::new(Some(ids)),
        };
        reservation.fill(&live);
        if let Persistence::Stored {
            record: r, lease, ..
        } = &mut job.persistence
        {
            r.clone_from(&record);
            if let Some(shared) = &self.shared_replies {
                shared.publish(live.clone(), lease, record, Before::Nothing);
            }
        }
        let g = self.generator.clone();
        let running = live.clone();
        tokio::spawn(async move {
            g.clone().run(job, running.clone()).await;
            g.streams.expire_later(running);
        });
        live
    }

    /// Whether the session holds room for the turn: its new messages, and its new text.
    fn check_room(&self, history: &[Message], input: &NativeTurn) -> Result<(), ChatError> {
        let cap = self.limits.max_messages_per_session;
        if history.len() + input.new_messages() > cap {
            return Err(ChatError::SessionFull {
                held: history.len(),
                max: cap,
            });
        }
        let held: usize = history.iter().map(|m| m.content.len()).sum();
        let max = self.limits.max_session_bytes;
        if held + input.text_len() > max {
            return Err(ChatError::SessionTooLarge { held, max });
        }
        Ok(())
    }

    /// Stores a turn the way its kind asks: the user's message and an empty reply, or a new
    /// reply only. Returns the ids of the user's message (if the turn has one) and of the reply.
    async fn store_turn(
        &self,
        user_id: &UserId,
        session_id: &SessionId,
        turn: StoreTurn,
    ) -> Result<(Option<MessageId>, MessageId), ChatError> {
        Ok(match turn {
            StoreTurn::Post(content) => {
                let t = self.store.begin_turn(user_id, session_id, &content).await?;
                (Some(t.user.id), t.assistant.id)
            }
            StoreTurn::ToolResults(results) => {
                let (tool, reply) = self
                    .store
                    .begin_tool_results(user_id, session_id, &results)
                    .await?;
                (tool.last().map(|m| m.id.clone()), reply.id)
            }
            StoreTurn::Regenerate { from, asked } => {
                let reply = self
                    .store
                    .begin_regenerate(user_id, session_id, from)
                    .await?;
                (asked, reply.id)
            }
            StoreTurn::Edit {
                message_id,
                content,
            } => {
                let t = self
                    .store
                    .begin_edit(user_id, session_id, &message_id, &content)
                    .await?;
                (Some(t.user.id), t.assistant.id)
            }
        })
    }

    /// Starts a stateless completion of a whole conversation (OpenAI's API), `n` choices of
    /// it (see [`Self::start_choices`]).
    pub async fn complete(
        &self,
        caller: &Caller,
        turn: ValidTurn<Conversation>,
        target: &Target,
        n: u32,
    ) -> Result<Vec<Arc<Live>>, ChatError> {
        let (convo, opts, arrived) = turn.into_parts();
        let max_tokens = opts.max_tokens();
        if let Some(n) = max_tokens {
            check_max_tokens(n, target)?;
        }
        let budget = self.charge_choices(caller, max_tokens, n).await?;
        compile_grammars(&opts).await?;
        let (prompt, max_new_tokens, shared_prefix) =
            self.plan(convo.into_messages(), max_tokens, target).await?;
        let plan = Planned {
            prompt,
            max_new_tokens,
            shared_prefix,
            model: target.key().cloned(),
            tokenizer: self.tokenizer(target),
        };
        self.start_choices(caller, plan, opts, arrived, budget, n)
            .await
    }

    /// Starts a stateless completion of a prompt sent as it is (OpenAI's legacy completions),
    /// `n` choices of it.
    pub async fn complete_raw(
        &self,
        caller: &Caller,
        turn: ValidTurn<RawPrompt>,
        target: &Target,
        n: u32,
    ) -> Result<Vec<Arc<Live>>, ChatError> {
        let (raw, opts, arrived) = turn.into_parts();
        let ctx = target
            .context_length()
            .ok_or_else(|| ChatError::Unavailable("no worker is ready".into()))?;
        let max_tokens = opts.max_tokens();
        if let Some(n) = max_tokens {
            check_max_tokens(n, target)?;
        }
        let tokenizer = self.tokenizer(target);
        let tok = &tokenizer.tok;
        let prompt = match raw {
            RawPrompt::Text(text) => {
                let mut ids = vec![tok.bos_id];
                ids.extend(
                    tok.encode(&text)
                        .map_err(|e| ChatError::Internal(e.to_string()))?,
                );
                ids
            }
            RawPrompt::Tokens(ids) => {
                let vocab = tok.vocab_size();
                if let Some((i, id)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
                    return Err(ChatError::Invalid(format!(
                        "prompt[{i}]: token id {id} is outside the vocabulary of {vocab}"
                    )));
                }
                ids
            }
        };
        if prompt.len() >= ctx {
            return Err(ChatError::Invalid(format!(
                "prompt: {} tokens do not fit the model's context of {ctx} (one position is \
                 needed to generate)",
                prompt.len()
            )));
        }
        let want = max_tokens.unwrap_or(LEGACY_DEFAULT_MAX_TOKENS);
        let budget = self.charge_choices(caller, Some(want), n).await?;
        compile_grammars(&opts).await?;
        let plan = Planned {
            max_new_tokens: want.min((ctx - prompt.len()) as u32),
            shared_prefix: 0,
            prompt,
            model: target.key().cloned(),
            tokenizer,
        };
        self.start_choices(caller, plan, opts, arrived, budget, n)
            .await
    }

    /// Charges one request of `n` choices, each of up to `max_tokens` (else the server's
    /// default).
    async fn charge_choices(
        &self,
        caller: &Caller,
        max_tokens: Option<u32>,
        n: u32,
    ) -> Result<Option<Budget>, ChatError> {
        let n = n.clamp(1, MAX_CHOICES);
        let reserve = max_tokens.unwrap_or(self.limits.default_max_tokens);
        self.charge(caller, Some(reserve.saturating_mul(n))).await
    }

    /// Starts `n` choices of a planned prompt: nothing is stored, and the worker that likely
    /// holds the prompt's beginning is preferred. The first choice starts at once; the others
    /// once it has its first token, on the worker that holds its prompt's K/V by then (prefix
    /// affinity), so the prompt is prefilled once. A seed gives choice `i` the seed `seed + i`.
    async fn start_choices(
        &self,
        caller: &Caller,
        plan: Planned,
        opts: GenOptions,
        arrived: tokio::time::Instant,
        budget: Option<Budget>,
        n: u32,
    ) -> Result<Vec<Arc<Live>>, ChatError> {
        let n = n.clamp(1, MAX_CHOICES);
        let Planned {
            prompt,
            max_new_tokens,
            shared_prefix,
            model,
            tokenizer,
        } = plan;
        let keys = crate::workers::prefix_keys(&caller.user.id, &prompt, shared_prefix as usize);
        let tenant = Tenant::within(&caller.user.id, opts.end_user());
        let pool = &self.generator.pool;
        let lease = pool.admit_prefix(&tenant, model.as_ref(), &keys).await?;
        let params = opts.params().cloned().unwrap_or_default();
        let dry_breakers = self.dry_breakers(&params, &tokenizer).await?;
        let mut budgets: Vec<Option<Budget>> = match budget {
            Some(b) => b.split(n as usize).into_iter().map(Some).collect(),
            None => (0..n).map(|_| None).collect(),
        };
        let job = |i: u32, budget: Option<Budget>| Job {
            user_id: caller.user.id.clone(),
            persistence: Persistence::Stateless,
            prompt: prompt.clone(),
            shared_prefix,
            params: SamplingParams {
                seed: params.seed.map(|s| s.wrapping_add(u64::from(i))),
                ..params.clone()
            },
            dry_breakers: dry_breakers.clone(),
            max_new_tokens,
            logprobs: opts.logprobs(),
            grammar: opts.grammar().cloned(),
            tools: opts.tools().cloned(),
            end_user: opts.end_user().map(str::to_string),
            stop: opts.stop().to_vec(),
            ignore_eos: opts.ignore_eos(),
            arrived,
            budget,
            model: model.clone(),
            tokenizer: tokenizer.tok.clone(),
            keep_alive: self.keep_alive(caller, opts.keep_alive_ms()),
            lease: None,
        };
        let first = Live::new(None);
        let mut lives = vec![first.clone()];
        let mut lead = job(0, budgets.remove(0));
        lead.lease = Some(lease);
        tokio::spawn(self.generator.clone().run(lead, first.clone()));
        for (i, budget) in (1..n).zip(budgets) {
            let live = Live::new(None);
            lives.push(live.clone());
            let (g, mut follower, user) = (self.generator.clone(), job(i, budget), tenant.clone());
            let (keys, first) = (keys.clone(), first.clone());
            tokio::spawn(async move {
                first.first_progress().await;
                // Failing here, the generation waits in the queue like a failover.
                let model = follower.model.clone();
                follower.lease = g.pool.admit_prefix(&user, model.as_ref(), &keys).await.ok();
                g.run(follower, live).await;
            });
        }
        Ok(lives)
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

    fn running(&self, session_id: &SessionId) -> Option<Arc<Live>> {
        self.generator
            .streams
            .get(session_id)
            .filter(|l| !l.is_finished())
    }

    /// The `keep_alive` (ms; negative: for good) a request asked for, as the caller may have
    /// it. The model is every tenant's: an admin key's request may set any stay (0 unloads the
    /// model once idle), any other may only lengthen it, up to `--max-keep-alive-secs` (for
    /// good means that long).
    fn keep_alive(&self, caller: &Caller, asked: Option<i64>) -> Option<KeepAlive> {
        let ms = asked?;
        if caller.admin {
            return Some(KeepAlive {
                ms,
                may_shorten: true,
            });
        }
        let cap = self.limits.max_keep_alive_ms;
        Some(KeepAlive {
            ms: if ms < 0 { cap } else { ms.min(cap) },
            may_shorten: false,
        })
    }

    /// Charges a load on demand to the caller: one request of its rate limit, and one of its
    /// key's loads per hour (`--max-loads-per-hour`). A load takes a worker's memory and
    /// time from every tenant: an admin key's is not counted.
    async fn charge_load(&self, caller: &Caller) -> Result<(), ChatError> {
        if caller.admin {
            return Ok(());
        }
        let per_hour = self.limits.max_loads_per_hour;
        Ok(self.limiter.admit_load(&caller.quota, per_hour).await?)
    }

    /// Charges the request to the caller's rate limit and sets its reply's tokens aside from
    /// the caller's daily budget.
    async fn charge(
        &self,
        caller: &Caller,
        max_tokens: Option<u32>,
    ) -> Result<Option<Budget>, ChatError> {
        let reserve = max_tokens.unwrap_or(self.limits.default_max_tokens);
        Ok(self
            .limiter
            .admit(&caller.quota, u64::from(reserve))
            .await?)
    }

    /// The tokens that end a DRY run for `params` (none when DRY is off).
    async fn dry_breakers(
        &self,
        params: &SamplingParams,
        tokenizer: &ModelTokenizer,
    ) -> Result<Arc<[u32]>, ChatError> {
        if !params.dry_enabled() || params.dry_sequence_breakers.is_empty() {
            return Ok(Arc::from([]));
        }
        let (tok, wanted) = (tokenizer.clone(), params.dry_sequence_breakers.clone());
        let cache = self.breakers.clone();
        tokio::task::spawn_blocking(move || cache.ids(&tok, &wanted))
            .await
            .map_err(|e| ChatError::Internal(format!("resolving DRY breakers failed: {e}")))
    }

    /// Prompt tokens for `convo`, the number of tokens to generate, and how many leading tokens
    /// are an operator's shared prompt (see [`SharedPrompts`]): the oldest whole turns are
    /// dropped until the prompt leaves room for the reply. Tokenizing runs on the blocking
    /// pool, so a long history never holds up the runtime's other requests (or its health
    /// checks).
    async fn plan(
        &self,
        convo: Vec<ChatMessage>,
        max_tokens: Option<u32>,
        target: &Target,
    ) -> Result<(Vec<u32>, u32, u32), ChatError> {
        let ctx = target
            .context_length()
            .ok_or_else(|| ChatError::Unavailable("no worker is ready".into()))?;
        // The server's default shrinks to fit a small model; an explicit value must fit as asked.
        let want = max_tokens.unwrap_or_else(|| self.limits.default_max_tokens.min(ctx as u32 / 2));
        check_max_tokens(want, target)?;
        let reserve = (want as usize).min(ctx / 2);
        let tokenizer = self.tokenizer(target);
        let default = self.tokenizers.is_default(&tokenizer);
        let tok = tokenizer.tok;
        let rendered = tokio::task::spawn_blocking(move || render(&tok, &convo, ctx - reserve))
            .await
            .map_err(|e| ChatError::Internal(format!("prompt rendering failed: {e}")))?;
        let prompt = rendered.map_err(|e| match e {
            TemplateError::Tokenizer(e) => ChatError::Internal(e.to_string()),
            other => ChatError::Invalid(other.to_string()),
        })?;
        let room = (ctx - prompt.tokens.len()) as u32;
        // Shared prompts are rendered with the default tokenizer: a model with its own shares
        // none.
        let leading = default.then(|| self.shared_prompts.leading(&prompt.tokens));
        let shared = match leading.flatten() {
            Some((name, n)) => {
                tracing::debug!(
                    shared_prompt = name,
                    tokens = n,
                    "prompt begins with a shared prompt"
                );
                n as u32
            }
            None => 0,
        };
        Ok((prompt.tokens, want.min(room), shared))
    }
}

/// Refuses a reply length (a turn's, or a session's default) of zero or more than the
/// target model's context can hold, before anything is charged or stored. Until a worker has
/// reported its context, the bound is [`MAX_SESSION_MAX_TOKENS`].
/// Waits, at most [`STOP_WAIT`], until the reply is no longer `streaming` in the database.
async fn wait_stored(store: &dyn Store, user: &UserId, session: &SessionId, id: &MessageId) {
    let deadline = tokio::time::Instant::now() + STOP_WAIT;
    while tokio::time::Instant::now() < deadline {
        match store.get_message(user, session, id).await {
            Ok(m) if m.status == MessageStatus::Streaming => {}
            _ => return,
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn check_max_tokens(n: u32, target: &Target) -> Result<u32, ChatError> {
    let ctx = target.context_length();
    let limit = ctx.map_or(MAX_SESSION_MAX_TOKENS, |ctx| {
        u32::try_from(ctx).unwrap_or(u32::MAX).saturating_sub(1)
    });
    if n == 0 || n > limit {
        let why = ctx.map_or_else(String::new, |ctx| {
            format!(" (the model's context is {ctx} tokens)")
        });
        return Err(ChatError::Invalid(format!(
            "max_tokens: must be between 1 and {limit}{why}"
        )));
    }
    Ok(n)
}

/// Longest the grammars of one request may take to compile.
const GRAMMAR_COMPILE_BUDGET: Duration = Duration::from_secs(10);

/// Compiles every grammar `opts` brings (see [`GenOptions::to_compile`]) on the blocking pool,
/// a few requests at a time (half the cores), within [`GRAMMAR_COMPILE_BUDGET`]: a tenant's
/// huge grammars cost its own requests' time, not the async threads every request shares nor
/// all the cores. A compile past its budget keeps its place until it really ends. Called once
/// the request is charged.
async fn compile_grammars(opts: &GenOptions) -> Result<(), ChatError> {
    static COMPILING: std::sync::OnceLock<Arc<tokio::sync::Semaphore>> = std::sync::OnceLock::new();
    let pending = opts.to_compile();
    if pending.is_empty() {
        return Ok(());
    }
    let slots = COMPILING.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(2, usize::from);
        Arc::new(tokio::sync::Semaphore::new((cores / 2).max(1)))
    });
    let slot = slots
        .clone()
        .acquire_owned()
        .await
        .map_err(|e| ChatError::Internal(format!("the grammar compiler: {e}")))?;
    let work = tokio::task::spawn_blocking(move || {
        let _slot = slot;
        pending
            .iter()
            .try_for_each(|(field, g)| g.check().map_err(|e| format!("{field}: {e}")))
    });
    match tokio::time::timeout(GRAMMAR_COMPILE_BUDGET, work).await {
        Ok(Ok(Ok(()))) => Ok(()),
        Ok(Ok(Err(why))) => Err(ChatError::InvalidGrammar(why)),
        Ok(Err(e)) => Err(ChatError::Internal(format!(
            "a grammar's compile failed: {e}"
        ))),
        Err(_) => Err(ChatError::InvalidGrammar(format!(
            "the request's grammars take longer than {} s to compile; send simpler ones",
            GRAMMAR_COMPILE_BUDGET.as_secs()
        ))),
    }
}

/// A session's `max_tokens`: [`check_max_tokens`] against its model's context when a worker
/// holds it (`target`), else only against [`MAX_SESSION_MAX_TOKENS`] (its turns check the rest).
fn session_max_tokens(n: u32, target: Option<&Target>) -> Result<i64, ChatError> {
    let unloaded = Target {
        model: None,
        tokenizer: None,
    };
    check_max_tokens(n, target.unwrap_or(&unloaded)).map(i64::from)
}

/// OpenAI's default reply length on the legacy completions API.
const LEGACY_DEFAULT_MAX_TOKENS: u32 = 16;

/// A prompt ready for a worker.
struct Planned {
    prompt: Vec<u32>,
    max_new_tokens: u32,
    /// Leading tokens that are an operator's shared prompt (see [`SharedPrompts`]).
    shared_prefix: u32,
    /// The exact version every worker of it must serve.
    model: Option<crate::workers::ModelKey>,
    /// That model's tokenizer.
    tokenizer: ModelTokenizer,
}

/// How a prepared native turn is stored once a worker has taken it.
enum StoreTurn {
    Post(String),
    ToolResults(Vec<NewToolResult>),
    Regenerate {
        /// The sequence number of the reply being replaced.
        from: i64,
        /// The user message it answers.
        asked: Option<MessageId>,
    },
    Edit {
        message_id: MessageId,
        content: String,
    },
}

/// The conversation a native turn answers, and how to store the turn. Refuses a regenerate
/// without a reply (409), an edit of a missing (404) or non-user (422) message, and tool results
/// that do not answer the last reply's calls (422). `tools`' description heads the system prompt.
fn prepare(
    session: &Session,
    history: Vec<Message>,
    input: &NativeTurn,
    tools: Option<&Tools>,
) -> Result<(Vec<ChatMessage>, StoreTurn), ChatError> {
    match input {
        NativeTurn::Post(content) => {
            let mut convo = conversation(session, &history, tools);
            convo.push(ChatMessage::new(ChatRole::User, content.as_str()));
            Ok((convo, StoreTurn::Post(content.as_str().to_string())))
        }
        NativeTurn::ToolResults(results) => {
            let names = answered_calls(history.last(), results)?;
            let mut convo = conversation(session, &history, tools);
            for (r, name) in results.iter().zip(&names) {
                convo.push(ChatMessage::new(
                    ChatRole::User,
                    result_text(name, &r.content),
                ));
            }
            let store = results
                .iter()
                .map(|r| NewToolResult {
                    tool_call_id: r.call_id.clone(),
                    content: r.content.clone(),
                })
                .collect();
            Ok((convo, StoreTurn::ToolResults(store)))
        }
        NativeTurn::Regenerate => {
            // The reply to replace is the last message; what came before must end with a user
            // message.
            let from = match history.last() {
                Some(m) if m.role == Role::Assistant => m.seq,
                _ => return Err(ChatError::NothingToRegenerate),
            };
            let earlier: Vec<Message> = history.into_iter().filter(|m| m.seq < from).collect();
            let asked = earlier.last().map(|m| m.id.clone());
            Ok((
                conversation(session, &earlier, tools),
                StoreTurn::Regenerate { from, asked },
            ))
        }
        NativeTurn::Edit {
            message_id,
            content,
        } => {
            let target = history
                .iter()
                .find(|m| m.id == *message_id)
                .ok_or(ChatError::NotFound("message"))?;
            if target.role != Role::User {
                return Err(ChatError::NotAUserMessage(format!(
                    "message {message_id} is an {} message; only user messages can be edited \
                     (POST /v1/sessions/{}/regenerate answers the last one again)",
                    target.role.as_str(),
                    session.id
                )));
            }
            let from = target.seq;
            let earlier: Vec<Message> = history.into_iter().filter(|m| m.seq < from).collect();
            let mut convo = conversation(session, &earlier, tools);
            convo.push(ChatMessage::new(ChatRole::User, content.as_str()));
            Ok((
                convo,
                StoreTurn::Edit {
                    message_id: message_id.clone(),
                    content: content.as_str().to_string(),
                },
            ))
        }
    }
}

/// The names of the functions whose results `results` are, in order: each must answer a call
/// of `last` (the session's last message, a reply that made calls), and every call once.
fn answered_calls(
    last: Option<&Message>,
    results: &[ToolResult],
) -> Result<Vec<String>, ChatError> {
    let invalid = |m: String| Err(ChatError::Invalid(m));
    let calls = match last {
        Some(m) if m.role == Role::Assistant => m.tool_calls.as_deref().unwrap_or_default(),
        _ => &[],
    };
    if calls.is_empty() {
        return invalid("tool_results: the session's last reply made no tool calls".into());
    }
    let mut names: Vec<String> = Vec::with_capacity(results.len());
    for (i, r) in results.iter().enumerate() {
        let field = format!("tool_results[{i}].tool_call_id");
        let Some(call) = calls.iter().find(|c| c.id == r.call_id) else {
            return invalid(format!(
                "{field}: `{}` names no call of the last reply",
                r.call_id
            ));
        };
        if results[..i].iter().any(|e| e.call_id == r.call_id) {
            return invalid(format!("{field}: `{}` is answered twice", r.call_id));
        }
        names.push(call.function.name.clone());
    }
    if let Some(c) = calls
        .iter()
        .find(|c| !results.iter().any(|r| r.call_id == c.id))
    {
        return invalid(format!(
            "tool_results: no result for call `{}` (`{}`); answer every call of the last reply",
            c.id, c.function.name
        ));
    }
    Ok(names)
}

/// The stored conversation as the template sees it: the tools' description and the system
/// prompt, then every message with text (a reply that was cut off counts with what it said; a
/// reply that made calls, with the text that made them). A tool's result is a user turn that
/// names its function.
fn conversation(session: &Session, history: &[Message], tools: Option<&Tools>) -> Vec<ChatMessage> {
    let mut out = Vec::with_capacity(history.len() + 2);
    if let Some(sys) = session.system_prompt.as_deref().filter(|s| !s.is_empty()) {
        out.push(ChatMessage::new(ChatRole::System, sys));
    }
    if let Some(t) = tools.and_then(Tools::system_text) {
        turn::prefix_system(&mut out, t);
    }
    let mut calls: Vec<(&str, &str)> = Vec::new();
    for m in history {
        let (role, text) = match m.role {
            Role::User => (ChatRole::User, m.content.clone()),
            Role::Assistant => {
                let made = m.tool_calls.iter().flatten();
                calls.extend(made.map(|c| (c.id.as_str(), c.function.name.as_str())));
                (ChatRole::Assistant, m.content.clone())
            }
            Role::Tool => {
                let id = m.tool_call_id.as_deref().unwrap_or_default();
                let name = calls.iter().find(|(c, _)| *c == id).map_or(id, |(_, n)| n);
                (ChatRole::User, result_text(name, &m.content))
            }
        };
        if !text.is_empty() {
            out.push(ChatMessage::new(role, text));
        }
    }
    out
}
