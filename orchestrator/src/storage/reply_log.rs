//! A streaming reply's record while it runs: the job that makes it, its checkpoints, the
//! lease that says which replica owns it, and its end. Takeover reads it back.

use async_trait::async_trait;

use super::types::{Checkpoint, Completion, MessageId, ReplyLease, SavedReply, StreamingReply};
use super::StoreResult;

#[async_trait]
pub trait ReplyLog: Send + Sync + std::fmt::Debug {
    /// The job that makes a streaming reply, for a replica that takes it over (see the
    /// service's takeover). False when `lease` no longer holds the reply (another replica
    /// claimed it, or it ended).
    async fn save_job(&self, lease: &ReplyLease, job: &str) -> StoreResult<bool>;

    /// The reply so far, while it streams, with how far it got (its checkpoint). False when
    /// `lease` no longer holds it: nothing is written.
    async fn save_progress(&self, lease: &ReplyLease, checkpoint: &Checkpoint)
        -> StoreResult<bool>;

    /// The owner's heartbeat: a new `updated_at` for each reply it still holds, whatever the
    /// reply is doing. Returns the ids of the replies `leases` no longer hold.
    async fn renew_leases(&self, leases: &[ReplyLease]) -> StoreResult<Vec<MessageId>>;

    /// The reply's final state; its checkpoint is cleared. False when `lease` no longer holds
    /// the reply: nothing is written.
    async fn finish_message(&self, lease: &ReplyLease, done: &Completion) -> StoreResult<bool>;

    /// Every reply in `streaming` state, with its last write's time and its lease's epoch.
    async fn streaming_replies(&self) -> StoreResult<Vec<StreamingReply>>;

    /// Claims a streaming reply for this replica: its epoch grows by one, and the previous
    /// owner can write it no more. Only while the reply is as `seen` (its epoch; and, when
    /// `silent`, its `updated_at`: no write landed since, so its owner is gone), so of replicas
    /// racing for it one wins. The new lease, or None.
    async fn claim_reply(
        &self,
        seen: &StreamingReply,
        silent: bool,
    ) -> StoreResult<Option<ReplyLease>>;

    /// A reply that cannot be continued becomes `error` / `interrupted`, keeping its text: only
    /// while `lease` holds it. Returns whether it changed.
    async fn fail_interrupted(&self, lease: &ReplyLease) -> StoreResult<bool>;

    /// A streaming reply's checkpoint and job; None once it ended (or if there is no such
    /// reply).
    async fn saved_reply(&self, message_id: &MessageId) -> StoreResult<Option<SavedReply>>;
}
