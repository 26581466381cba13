//! Kept responses of OpenAI's Responses API, on sessions: a response's request becomes a native
//! turn of a session of its user (a new one, or the one that holds the response it continues,
//! so the worker that holds that session's KV cache reuses it), and its reply is the message
//! that answers it.

use std::sync::Arc;

use super::{Caller, ChatError, ChatService, NativeTurn, StopOutcome, ValidTurn};
use crate::generate::Live;
use crate::ids::{MessageId, SessionId};
use crate::storage::{Message, MessageStatus, NewSession, StoreError, StoredResponse};

/// Longest title a response's new session takes from its first words, in characters.
const TITLE_CHARS: usize = 60;

impl ChatService {
    /// Starts a kept response: `turn` (a [`NativeTurn::Response`]) in the session of
    /// `previous` when its reply is still that session's last message, else in a copy of that
    /// session up to its reply, else (no `previous`) in a new session titled `title`.
    pub async fn start_response(
        &self,
        caller: &Caller,
        previous: Option<&StoredResponse>,
        turn: ValidTurn<NativeTurn>,
        title: &str,
    ) -> Result<Arc<Live>, ChatError> {
        let user_id = &caller.user.id;
        let Some(previous) = previous else {
            self.room_for_session(user_id).await?;
            let new = NewSession {
                title: title.chars().take(TITLE_CHARS).collect(),
                ..NewSession::default()
            };
            let session = self.store.create_session(user_id, new).await?;
            let started = self.start_turn(caller, &session.id, turn).await;
            if started.is_err() {
                // Nothing of a refused request is kept.
                let _ = self.store.delete_session(user_id, &session.id).await;
            }
            return started;
        };
        if previous.reply.status == MessageStatus::Streaming {
            return Err(ChatError::Store(StoreError::ReplyRunning));
        }
        let last = self
            .store
            .last_message(user_id, &previous.session_id)
            .await?;
        if last.as_ref().map(|m| &m.id) == Some(&previous.reply.id) {
            match self
                .start_turn(caller, &previous.session_id, turn.clone())
                .await
            {
                // Continued by another request since: this one branches off.
                Err(ChatError::Store(StoreError::Conflict(_))) => {}
                started => return started,
            }
        }
        self.room_for_session(user_id).await?;
        let fork = self
            .store
            .fork_session(user_id, &previous.session_id, previous.reply.seq)
            .await?;
        let started = self
            .start_turn(caller, &fork.id, turn.without_previous())
            .await;
        if started.is_err() {
            let _ = self.store.delete_session(user_id, &fork.id).await;
        }
        started
    }

    /// The caller's kept response whose reply is `reply`.
    pub async fn response(
        &self,
        caller: &Caller,
        reply: &MessageId,
    ) -> Result<StoredResponse, ChatError> {
        Ok(self.store.get_response(&caller.user.id, reply).await?)
    }

    /// The messages `response`'s request added to its session, in order.
    pub async fn response_input(
        &self,
        caller: &Caller,
        response: &StoredResponse,
    ) -> Result<Vec<Message>, ChatError> {
        let history = self
            .store
            .list_messages(&caller.user.id, &response.session_id)
            .await?;
        let added = response.first_seq..response.reply.seq;
        Ok(history
            .into_iter()
            .filter(|m| added.contains(&m.seq))
            .collect())
    }

    /// Stops the response's reply if it is still running, and answers it as it then stands.
    pub async fn cancel_response(
        &self,
        caller: &Caller,
        reply: &MessageId,
    ) -> Result<StoredResponse, ChatError> {
        let kept = self.response(caller, reply).await?;
        if kept.reply.status != MessageStatus::Streaming {
            return Ok(kept);
        }
        // A streaming reply is its session's only running one.
        if let StopOutcome::Ended(_) = self.stop(caller, &kept.session_id).await? {
            return self.response(caller, reply).await;
        }
        Ok(kept)
    }

    /// Forgets the response, stopping its reply first if it runs. When its session holds no
    /// other response, the session is deleted as `DELETE /v1/sessions/{id}` deletes one.
    pub async fn delete_response(
        &self,
        caller: &Caller,
        reply: &MessageId,
    ) -> Result<(), ChatError> {
        self.cancel_response(caller, reply).await?;
        if let Some(session) = self.store.delete_response(&caller.user.id, reply).await? {
            self.forget_session(&session);
        }
        Ok(())
    }

    /// Drops a deleted session's cache on the workers.
    fn forget_session(&self, id: &SessionId) {
        let pool = self.generator.pool.clone();
        let id = id.clone();
        tokio::spawn(async move { pool.drop_session(&id).await });
    }
}
