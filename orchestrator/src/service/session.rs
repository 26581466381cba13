//! A session's fields and a page query as the chat service takes them: checked once, at the
//! API's edge, beside [`super::ValidTurn`]. Each can only be built through its checks.
//!
//! What needs the served model (whether a default `max_tokens` fits its context) is checked by
//! the service when it stores the session: the second half of this file, the service's session
//! operations (create, list, read, update, history, delete).

use super::turn::{check_params, check_text};
use crate::invalid::Invalid;
use std::time::Duration;

use hearth_shared::SamplingParams;

use super::prompt::check_max_tokens;
use super::{ChatError, ChatService, Target};
use crate::ids::{SessionId, UserId};
use crate::storage::NewSession;
use crate::storage::{Message, Session, SessionPatch, SessionQuery, User};

const MAX_TITLE_CHARS: usize = 200;
const MAX_SYSTEM_PROMPT_BYTES: usize = 64 << 10;
const DEFAULT_TITLE: &str = "New chat";
const DEFAULT_PAGE: u32 = 20;
const MAX_PAGE: u32 = 100;
const MAX_QUERY_BYTES: usize = 200;
/// Messages in one page of a session's history, at most and by default.
pub const MAX_MESSAGE_PAGE: u32 = 1000;

/// A page of a session's messages: the newest `limit` before message `before` (by sequence
/// number), oldest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessagePage {
    pub(super) before: Option<i64>,
    pub(super) limit: u32,
}

impl MessagePage {
    /// `limit` 1 to 1000 (default 1000); `before` the previous page's `next_cursor`.
    pub fn new(limit: Option<u32>, before: Option<&str>) -> Result<Self, ChatError> {
        let limit = limit.unwrap_or(MAX_MESSAGE_PAGE);
        if !(1..=MAX_MESSAGE_PAGE).contains(&limit) {
            return Err(ChatError::Invalid(Invalid::field(
                "limit",
                format!("must be between 1 and {MAX_MESSAGE_PAGE}"),
            )));
        }
        let before = before
            .map(|c| {
                c.parse::<i64>().ok().filter(|&seq| seq > 0).ok_or_else(|| {
                    ChatError::Invalid(Invalid::field("before", "not a cursor from this API"))
                })
            })
            .transpose()?;
        Ok(Self { before, limit })
    }
}

/// A new session, checked; `max_tokens` is checked against the model when it is stored.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidSession {
    pub(super) new: NewSession,
    pub(super) max_tokens: Option<u32>,
}

impl ValidSession {
    /// A title of up to 200 characters, trimmed ("New chat" when empty), a system prompt of up
    /// to 64 KiB, sampling parameters in range.
    pub fn new(
        title: Option<&str>,
        system_prompt: Option<String>,
        params: Option<Fields>,
        max_tokens: Option<u32>,
    ) -> Result<Self, ChatError> {
        let title = check_title(title.unwrap_or(""))?;
        if let Some(sys) = &system_prompt {
            check_system(sys)?;
        }
        Ok(Self {
            new: NewSession {
                title: if title.is_empty() {
                    DEFAULT_TITLE.to_string()
                } else {
                    title
                },
                system_prompt,
                params: params.map(stored_params).transpose()?,
                max_tokens: None,
                model: None,
            },
            max_tokens,
        })
    }

    /// The model the session's turns need (checked against the served one when stored).
    pub fn with_model(mut self, model: Option<String>) -> Result<Self, ChatError> {
        self.new.model = model.map(check_model_name).transpose()?;
        Ok(self)
    }
}

/// Longest model name a session may name.
const MAX_MODEL_CHARS: usize = 256;

fn check_model_name(m: String) -> Result<String, ChatError> {
    if m.is_empty() || m.chars().count() > MAX_MODEL_CHARS {
        return Err(ChatError::Invalid(Invalid::field(
            "model",
            format!("must be 1 to {MAX_MODEL_CHARS} characters"),
        )));
    }
    check_text("model", &m)?;
    Ok(m)
}

/// Changes to a session, checked: `None` leaves a field as it is, `Some(None)` clears it.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidPatch {
    pub(super) patch: SessionPatch,
    pub(super) max_tokens: Option<Option<u32>>,
}

impl ValidPatch {
    pub fn new(
        title: Option<&str>,
        system_prompt: Option<Option<String>>,
        params: Option<Option<Fields>>,
        max_tokens: Option<Option<u32>>,
    ) -> Result<Self, ChatError> {
        if let Some(Some(sys)) = &system_prompt {
            check_system(sys)?;
        }
        Ok(Self {
            patch: SessionPatch {
                title: title.map(check_title).transpose()?,
                system_prompt,
                params: params
                    .map(|p| p.map(stored_params).transpose())
                    .transpose()?,
                max_tokens: None,
                model: None,
            },
            max_tokens,
        })
    }

    /// Changes the model the session's turns need (`Some(None)`: whichever is served).
    pub fn with_model(mut self, model: Option<Option<String>>) -> Result<Self, ChatError> {
        self.patch.model = model
            .map(|m| m.map(check_model_name).transpose())
            .transpose()?;
        Ok(self)
    }
}

/// A page of the caller's sessions: `limit` 1 to 100 (default 20), a title filter of up to
/// 200 bytes, and the previous page's cursor (see [`next_cursor`]).
pub fn session_query(
    limit: Option<u32>,
    q: Option<String>,
    before: Option<&str>,
) -> Result<SessionQuery, ChatError> {
    let limit = limit.unwrap_or(DEFAULT_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ChatError::Invalid(Invalid::field(
            "limit",
            format!("must be between 1 and {MAX_PAGE}"),
        )));
    }
    let before = before
        .map(|c| {
            c.split_once('_')
                .and_then(|(at, id)| Some((at.parse::<i64>().ok()?, SessionId::parse(id)?)))
                .ok_or_else(|| {
                    ChatError::Invalid(Invalid::field("before", "not a cursor from this API"))
                })
        })
        .transpose()?;
    if let Some(q) = &q {
        check_text("q", q)?;
        if q.len() > MAX_QUERY_BYTES {
            return Err(ChatError::Invalid(Invalid::field(
                "q",
                format!("longer than {MAX_QUERY_BYTES} bytes"),
            )));
        }
    }
    Ok(SessionQuery { q, limit, before })
}

/// The cursor of the page after one that ended with the session last updated at `updated_at`.
pub fn next_cursor(updated_at: i64, id: &SessionId) -> String {
    format!("{updated_at}_{id}")
}

fn check_title(t: &str) -> Result<String, ChatError> {
    check_text("title", t)?;
    let t = t.trim();
    if t.chars().count() > MAX_TITLE_CHARS {
        return Err(ChatError::Invalid(Invalid::field(
            "title",
            format!("longer than {MAX_TITLE_CHARS} characters"),
        )));
    }
    Ok(t.to_string())
}

fn check_system(s: &str) -> Result<(), ChatError> {
    check_text("system_prompt", s)?;
    if s.len() > MAX_SYSTEM_PROMPT_BYTES {
        return Err(ChatError::Invalid(Invalid::field(
            "system_prompt",
            format!("longer than {MAX_SYSTEM_PROMPT_BYTES} bytes"),
        )));
    }
    Ok(())
}

/// A session's default sampling parameters, in range, as stored.
/// Sampling fields as a client gave them (a JSON object).
pub type Fields = serde_json::Map<String, serde_json::Value>;

/// The fields, checked as [`SamplingParams`] (names, types, ranges), stored as given: the
/// fields left out take the served model's defaults at each turn.
fn stored_params(p: Fields) -> Result<serde_json::Value, ChatError> {
    let parsed: SamplingParams = serde_json::from_value(serde_json::Value::Object(p.clone()))
        .map_err(|e| ChatError::Invalid(Invalid::field("params", format!("{e}"))))?;
    check_params(parsed, "params.")?;
    Ok(serde_json::Value::Object(p))
}

impl ChatService {
    // --- Sessions ---

    /// Creates a session, unless the user already keeps the most sessions allowed. Its model
    /// must be served or loadable; it is not loaded here (its first turn loads it), so its
    /// `max_tokens` is checked against the model's context only when a worker holds it.
    pub async fn create_session(
        &self,
        user: &User,
        session: ValidSession,
    ) -> Result<Session, ChatError> {
        self.room_for_session(&user.id).await?;
        let mut new = session.new;
        let target = self.loaded_target(new.model.as_deref()).await?;
        new.max_tokens = session
            .max_tokens
            .map(|n| session_max_tokens(n, target.as_ref()))
            .transpose()?;
        Ok(self.store.create_session(&user.id, new).await?)
    }

    /// Refuses a new session to a user who holds as many as one may.
    pub(super) async fn room_for_session(&self, user_id: &UserId) -> Result<(), ChatError> {
        let cap = self.limits.max_sessions_per_user;
        if self.store.count_sessions(user_id).await? >= cap {
            return Err(ChatError::TooManySessions { max: cap });
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn message(r: Result<impl std::fmt::Debug, ChatError>) -> String {
        r.expect_err("refused").to_string()
    }

    #[test]
    fn a_new_session_is_trimmed_named_and_checked_once() {
        let s = ValidSession::new(Some("  hi  "), None, None, Some(5)).expect("valid");
        assert_eq!(s.new.title, "hi");
        assert_eq!(s.max_tokens, Some(5));
        let untitled = ValidSession::new(Some("   "), None, None, None).expect("valid");
        assert_eq!(untitled.new.title, "New chat");
        assert_eq!(
            message(ValidSession::new(Some("a\0b"), None, None, None)),
            "title: must not contain NUL characters"
        );
        let long = "é".repeat(MAX_TITLE_CHARS + 1);
        assert!(message(ValidSession::new(Some(&long), None, None, None)).starts_with("title:"));
        let big = "a".repeat(MAX_SYSTEM_PROMPT_BYTES + 1);
        assert!(
            message(ValidSession::new(None, Some(big), None, None)).starts_with("system_prompt:")
        );
        let fields = |v: serde_json::Value| v.as_object().cloned().expect("object");
        let hot = fields(serde_json::json!({"temperature": -1.0}));
        assert!(message(ValidSession::new(
            None,
            None,
            Some(fields(serde_json::json!({"temprature": 1}))),
            None
        ))
        .starts_with("params: unknown field `temprature`"));
        let given = fields(serde_json::json!({"top_k": 5}));
        let kept = ValidSession::new(None, None, Some(given.clone()), None).expect("valid");
        assert_eq!(kept.new.params, Some(serde_json::Value::Object(given)));
        assert!(
            message(ValidSession::new(None, None, Some(hot.clone()), None))
                .starts_with("params.temperature:")
        );
        assert!(message(ValidPatch::new(None, None, Some(Some(hot)), None))
            .starts_with("params.temperature:"));
    }

    #[test]
    fn a_patch_keeps_absent_fields_and_clears_null_ones() {
        let p = ValidPatch::new(None, Some(None), None, Some(None)).expect("valid");
        assert_eq!(p.patch.title, None);
        assert_eq!(p.patch.system_prompt, Some(None));
        assert_eq!(p.patch.params, None);
        assert_eq!(p.max_tokens, Some(None));
        assert_eq!(
            message(ValidPatch::new(None, Some(Some("\0".into())), None, None)),
            "system_prompt: must not contain NUL characters"
        );
    }

    #[test]
    fn only_a_cursor_this_api_made_pages_on() {
        let id = SessionId::random();
        let q = session_query(None, None, Some(&next_cursor(-5, &id))).expect("cursor");
        assert_eq!(q.before, Some((-5, id)));
        assert_eq!(q.limit, DEFAULT_PAGE);
        for bad in ["", "12", "x_0123456789abcdef0123456789abcdef", "12_NOTANID"] {
            assert_eq!(
                message(session_query(None, None, Some(bad))),
                "before: not a cursor from this API",
                "{bad:?}"
            );
        }
        assert!(message(session_query(Some(0), None, None)).starts_with("limit:"));
        assert!(message(session_query(Some(101), None, None)).starts_with("limit:"));
        assert!(message(session_query(None, Some("q".repeat(201)), None)).starts_with("q:"));
    }
}
