//! The native replies this replica owns, and the heartbeat that keeps them its own.
//!
//! A stored reply is written only under its lease (see [`crate::storage::ReplyLease`]): the
//! replica that began it holds epoch 0, and a replica that takes it over claims the next one,
//! after which every write of the old owner is refused. Another replica claims a reply only
//! when its `updated_at` has stood still for `--orphan-after-secs`, so the owner renews every
//! reply it holds on a heartbeat, whatever the reply is doing: waiting for a worker's place,
//! preempted, or failing over, it saves nothing, yet it is alive. A renewal that finds the
//! lease gone (the reply was claimed while this replica could not reach the database, or was
//! stopped for a while) disowns the reply here: it stops, and its listeners resume elsewhere.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::Live;
use crate::ids::MessageId;
use crate::storage::{ReplyLease, ReplyLog};

/// The leases this replica holds, each with its reply's log.
#[derive(Debug, Default)]
pub struct Leases {
    held: Mutex<HashMap<MessageId, Held>>,
}

#[derive(Debug)]
struct Held {
    epoch: i64,
    live: Weak<Live>,
    /// Its end is being stored: that write decides whether the reply is still this
    /// replica's, not a renewal that may find it ended.
    finishing: bool,
}

impl Leases {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<MessageId, Held>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `lease` renewed while `live` runs.
    pub(crate) fn hold(&self, lease: &ReplyLease, live: &Arc<Live>) {
        self.map().insert(
            lease.message_id.clone(),
            Held {
                epoch: lease.epoch,
                live: Arc::downgrade(live),
                finishing: false,
            },
        );
    }

    /// The reply's end is being stored (see [`Held::finishing`]).
    pub(crate) fn finishing(&self, id: &MessageId) {
        if let Some(h) = self.map().get_mut(id) {
            h.finishing = true;
        }
    }

    pub(crate) fn release(&self, id: &MessageId) {
        self.map().remove(id);
    }

    /// Every lease held now.
    fn snapshot(&self) -> Vec<ReplyLease> {
        self.map()
            .iter()
            .map(|(id, h)| ReplyLease {
                message_id: id.clone(),
                epoch: h.epoch,
            })
            .collect()
    }

    /// The leases of `lost` are gone: their replies stop here (unless one is being stored,
    /// or was released meanwhile).
    pub(crate) fn lost(&self, lost: &[MessageId]) {
        let mut held = self.map();
        for id in lost {
            let Some(h) = held.get(id).filter(|h| !h.finishing) else {
                continue;
            };
            tracing::warn!(message_id = %id, epoch = h.epoch, "another replica claimed this reply; stopping it here");
            if let Some(live) = h.live.upgrade() {
                live.disown();
            }
            held.remove(id);
        }
    }

    /// Renews every lease held once; a database error is left to the next beat.
    pub(crate) async fn renew(
        &self,
        store: &dyn ReplyLog,
    ) -> Result<(), crate::storage::StoreError> {
        let leases = self.snapshot();
        if leases.is_empty() {
            return Ok(());
        }
        let lost = store.renew_leases(&leases).await?;
        self.lost(&lost);
        Ok(())
    }
}

/// How often the heartbeat renews: a third of the silence after which another replica claims
/// a reply, so that two beats may fail before it does (at least every 250 ms).
pub(crate) fn heartbeat_every(orphan_after: Duration) -> Duration {
    (orphan_after / 3).max(Duration::from_millis(250))
}

/// Renews this replica's leases every `every` for as long as it runs.
pub(crate) fn heartbeat_task(
    store: Arc<dyn ReplyLog>,
    leases: Arc<Leases>,
    every: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            tick.tick().await;
            match leases.renew(store.as_ref()).await {
                Ok(()) => failing = false,
                Err(e) if !failing => {
                    tracing::warn!(error = %e, "cannot renew the leases of running replies");
                    failing = true;
                }
                Err(_) => {}
            }
        }
    })
}
