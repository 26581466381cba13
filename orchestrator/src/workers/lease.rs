//! A worker's place held by one request.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use hearth_shared::proto;
use tokio::sync::Notify;

use super::connection::{Generation, WorkerConnection, WorkerError};
use super::health::WorkerSlot;
use super::pool::WorkerPool;
use super::Tenant;

/// A worker chosen for one request; it counts as in flight there until dropped.
#[derive(Debug)]
pub struct Lease {
    pub(super) slot: Arc<WorkerSlot>,
    pub(super) conn: Arc<WorkerConnection>,
    pub(super) pool: Arc<WorkerPool>,
    pub(super) tenant: Tenant,
    pub(super) id: u64,
    pub(super) yield_signal: Arc<Notify>,
}

impl Lease {
    pub fn addr(&self) -> &str {
        &self.slot.addr
    }

    /// This worker on this connection, for a reply that failed here to skip.
    pub fn excluded(&self) -> super::Excluded {
        super::Excluded {
            addr: self.slot.addr.clone(),
            serial: self.conn.serial(),
        }
    }

    /// The worker's public name (see [`WorkerSlot::name`]).
    pub fn name(&self) -> &str {
        &self.slot.name
    }

    pub fn generate(&self, req: proto::GenerateRequest) -> Result<Generation, WorkerError> {
        self.conn.generate(req)
    }

    /// Resolves once the place is asked for by a user who holds none: the generation should
    /// stop on this worker, drop the lease, and continue through [`WorkerPool::readmit`].
    pub async fn yielded(&self) {
        self.yield_signal.notified().await;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.slot.in_flight.fetch_sub(1, Ordering::SeqCst);
        {
            let mut fair = self.pool.fair();
            fair.release(&self.tenant);
            if let Some(i) = fair.leases.iter().position(|l| l.id == self.id) {
                fair.leases.remove(i);
            }
        }
        self.pool.room.notify_waiters();
    }
}
