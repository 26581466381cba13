//! Native turns: a user message (or tool results) in a stored session, its prompt built from
//! the history, stored with an empty reply in one transaction, and the reply run to its end.

use crate::invalid::Invalid;
use std::sync::Arc;

use tracing::Instrument;

use hearth_shared::chat::{Message as ChatMessage, Role as ChatRole};

use super::prompt::{check_max_tokens, compile_grammars, owner};
use super::{Caller, ChatError, ChatService, JobRecord, NativeTurn, ToolResult, ValidTurn};
use crate::generate::{Before, Generator, Job, Live, Persistence, Reservation, TurnIds};
use crate::ids::{MessageId, SessionId, UserId};
use crate::storage::{
    Message, NewItem, NewResponse, NewToolResult, ReplyLease, Role, Session, ToolCall,
};
use crate::tools::{result_text, Tools};
use crate::workers::Tenant;

impl ChatService {
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
        let session = settled(self.store.get_session(user_id, session_id).await?, &input);
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
        let plan = self.plan(convo, max_tokens, &target).await?;
        let params = match opts.params() {
            Some(p) => p.clone(),
            None => target.defaults().with_session(session.params.as_ref()),
        };
        let request = self.gen_request(&plan, &opts, params).await?;
        let tenant = Tenant::user(user_id);
        let place = self
            .generator
            .pool
            .admit(&tenant, plan.model.as_ref(), Some(session_id), &[])
            .await?;
        let (user_message_id, message_id) = self.store_turn(user_id, session_id, store).await?;
        let ids = TurnIds {
            session_id: session_id.clone(),
            user_message_id,
            message_id: message_id.clone(),
        };
        let job = Job {
            request,
            owner: owner(caller, &opts, arrived, budget),
            placement: self.placement(caller, &plan, &opts, Some(place)),
            persistence: Persistence::Stored {
                session_id: session_id.clone(),
                lease: ReplyLease::first(message_id),
                record: None,
            },
        };
        Ok(self.launch(ids, job, reservation))
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
        let span = Generator::chat_span(&job);
        let run = async move {
            g.clone().run(job, running.clone()).await;
            g.streams.expire_later(running);
        };
        tokio::spawn(run.instrument(span));
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
            StoreTurn::Response(new) => {
                let reply = self.store.begin_response(user_id, session_id, &new).await?;
                (None, reply.id)
            }
        })
    }
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
    Response(Box<NewResponse>),
}

/// The session as the turn sees it: a kept response sets its system prompt and model.
fn settled(mut session: Session, input: &NativeTurn) -> Session {
    if let NativeTurn::Response(r) = input {
        session.system_prompt.clone_from(&r.system_prompt);
        session.model.clone_from(&r.model);
    }
    session
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
            let mut convo = conversation(session, said(&history), tools);
            convo.push(ChatMessage::new(ChatRole::User, content.as_str()));
            Ok((convo, StoreTurn::Post(content.as_str().to_string())))
        }
        NativeTurn::ToolResults(results) => prepare_results(session, &history, results, tools),
        NativeTurn::Response(r) => {
            let added = r.items.iter().map(Said::from);
            let convo = conversation(session, history.iter().map(Said::from).chain(added), tools);
            Ok((convo, StoreTurn::Response(r.clone())))
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
                conversation(session, said(&earlier), tools),
                StoreTurn::Regenerate { from, asked },
            ))
        }
        NativeTurn::Edit {
            message_id,
            content,
        } => {
            let from = edited(session, &history, message_id)?.seq;
            let earlier: Vec<Message> = history.into_iter().filter(|m| m.seq < from).collect();
            let mut convo = conversation(session, said(&earlier), tools);
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

/// A turn of tool results: the conversation with each result as a user message, and the
/// results to store. Refused unless they answer the last reply's calls.
fn prepare_results(
    session: &Session,
    history: &[Message],
    results: &[ToolResult],
    tools: Option<&Tools>,
) -> Result<(Vec<ChatMessage>, StoreTurn), ChatError> {
    let names = answered_calls(history.last(), results)?;
    let mut convo = conversation(session, said(history), tools);
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

/// The message an edit replaces: one of the session's user messages (404 when missing, 422
/// when not a user's).
fn edited<'a>(
    session: &Session,
    history: &'a [Message],
    message_id: &MessageId,
) -> Result<&'a Message, ChatError> {
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
    Ok(target)
}

/// The names of the functions whose results `results` are, in order: each must answer a call
/// of `last` (the session's last message, a reply that made calls), and every call once.
fn answered_calls(
    last: Option<&Message>,
    results: &[ToolResult],
) -> Result<Vec<String>, ChatError> {
    let invalid = |field: &str, why: String| Err(ChatError::Invalid(Invalid::field(field, why)));
    let calls = match last {
        Some(m) if m.role == Role::Assistant => m.tool_calls.as_deref().unwrap_or_default(),
        _ => &[],
    };
    if calls.is_empty() {
        return invalid(
            "tool_results",
            "the session's last reply made no tool calls".into(),
        );
    }
    let mut names: Vec<String> = Vec::with_capacity(results.len());
    for (i, r) in results.iter().enumerate() {
        let field = format!("tool_results[{i}].tool_call_id");
        let Some(call) = calls.iter().find(|c| c.id == r.call_id) else {
            return invalid(
                &field,
                format!("`{}` names no call of the last reply", r.call_id),
            );
        };
        if results[..i].iter().any(|e| e.call_id == r.call_id) {
            return invalid(&field, format!("`{}` is answered twice", r.call_id));
        }
        names.push(call.function.name.clone());
    }
    if let Some(c) = calls
        .iter()
        .find(|c| !results.iter().any(|r| r.call_id == c.id))
    {
        return invalid(
            "tool_results",
            format!(
                "no result for call `{}` (`{}`); answer every call of the last reply",
                c.id, c.function.name
            ),
        );
    }
    Ok(names)
}

/// A message of the conversation, stored or about to be.
struct Said<'a> {
    role: Role,
    content: &'a str,
    calls: &'a [ToolCall],
    call_id: Option<&'a str>,
}

impl<'a> Said<'a> {
    fn new(
        role: Role,
        content: &'a str,
        calls: Option<&'a [ToolCall]>,
        call_id: Option<&'a str>,
    ) -> Self {
        let calls = calls.unwrap_or_default();
        Self {
            role,
            content,
            calls,
            call_id,
        }
    }
}

impl<'a> From<&'a Message> for Said<'a> {
    fn from(m: &'a Message) -> Self {
        let (calls, id) = (m.tool_calls.as_deref(), m.tool_call_id.as_deref());
        Self::new(m.role, &m.content, calls, id)
    }
}

impl<'a> From<&'a NewItem> for Said<'a> {
    fn from(m: &'a NewItem) -> Self {
        let (calls, id) = (m.tool_calls.as_deref(), m.tool_call_id.as_deref());
        Self::new(m.role, &m.content, calls, id)
    }
}

fn said(history: &[Message]) -> impl Iterator<Item = Said<'_>> {
    history.iter().map(Said::from)
}

/// The stored conversation as the template sees it: the tools' description and the system
/// prompt, then every message with text (a reply that was cut off counts with what it said; a
/// reply that made calls, with the text that made them). A tool's result is a user turn that
/// names its function.
fn conversation<'a>(
    session: &Session,
    history: impl Iterator<Item = Said<'a>>,
    tools: Option<&Tools>,
) -> Vec<ChatMessage> {
    let mut out = Vec::new();
    if let Some(sys) = session.system_prompt.as_deref().filter(|s| !s.is_empty()) {
        out.push(ChatMessage::new(ChatRole::System, sys));
    }
    if let Some(t) = tools.and_then(Tools::system_text) {
        super::turn::prefix_system(&mut out, t);
    }
    let mut calls: Vec<(&str, &str)> = Vec::new();
    for m in history {
        let (role, text) = match m.role {
            Role::User => (ChatRole::User, m.content.to_string()),
            Role::Assistant => {
                calls.extend(
                    m.calls
                        .iter()
                        .map(|c| (c.id.as_str(), c.function.name.as_str())),
                );
                (ChatRole::Assistant, m.content.to_string())
            }
            Role::Tool => {
                let id = m.call_id.unwrap_or_default();
                let name = calls.iter().find(|(c, _)| *c == id).map_or(id, |(_, n)| n);
                (ChatRole::User, result_text(name, m.content))
            }
        };
        if !text.is_empty() {
            out.push(ChatMessage::new(role, text));
        }
    }
    out
}
