//! Lease keeping, the executor's third role beside the caller's side
//! (`caller.rs`) and the operation's task (`task.rs`): the leases this
//! replica holds (`holds.rs`) are renewed by its heartbeat, found lost by a
//! renewal or a fenced write, and handed to a reconciler pass while it
//! works on an operation. The send gate (`gate.rs`) asks the same holds
//! before each request leaves.

use std::sync::Arc;

use tokio::time::Instant;
use uuid::Uuid;

use super::{Executor, holds};
use crate::store::{HeldLease, Renewal};

impl Executor {
    /// The operations whose lease this replica holds for a task running
    /// here now.
    pub fn held(&self) -> Vec<Uuid> {
        self.holds.ids()
    }

    /// Holds `lease` (renewed by the heartbeat) until the guard drops.
    pub(crate) fn hold(&self, lease: HeldLease) -> holds::Hold {
        self.holds.hold(lease.id, Some(lease.epoch))
    }

    /// Fires when `id`'s lease is found lost (`None`: not held here).
    pub(crate) fn lease_lost(&self, id: Uuid) -> Option<tokio_util::sync::CancellationToken> {
        self.holds.lost(id)
    }

    /// `lease` was found lost (a fenced write): whoever works on it here
    /// stops.
    pub(crate) fn lose(&self, lease: HeldLease) {
        if self.holds.lose(lease) {
            tracing::info!(operation_id = %lease.id, lease_epoch = lease.epoch,
                "the operation's lease is another's now; this replica stops working on it");
        }
    }

    /// Renews the leases this replica holds, every `heartbeat`, until
    /// `stop`. A holder whose heartbeat stops (a crash) loses them within
    /// one lease; a lease found lost (another holder's epoch, or decided)
    /// stops the run working on it here at once.
    pub async fn heartbeat(self: Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(self.settings.heartbeat) => {}
            }
            // A renewal slower than its bound ends there: the next beat
            // renews again (the lease outlasts two bounds and a beat).
            let bound = self.store.round_trip_bound();
            if tokio::time::timeout(bound, self.renew_held())
                .await
                .is_err()
            {
                tracing::debug!(
                    bound_ms = bound.as_millis() as u64,
                    "renewing leases took longer than the database's round-trip bound; renewing again"
                );
            }
        }
    }

    /// One beat: renews every lease held under a known epoch, and trips
    /// those found lost.
    pub(crate) async fn renew_held(&self) {
        let leases = self.holds.leases();
        if leases.is_empty() {
            return;
        }
        let sent = Instant::now();
        let found = match self
            .store
            .operation_renew_leases(&self.replica, &leases, self.settings.lease)
            .await
        {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(error = %e, held = leases.len(), "could not renew leases");
                return;
            }
        };
        let mut renewed = Vec::with_capacity(found.len());
        for (id, renewal) in found {
            let Some(lease) = leases.iter().find(|l| l.id == id) else {
                continue;
            };
            match renewal {
                // Held at least a lease from when the renewal left.
                Renewal::Renewed => renewed.push(id),
                // Held by another statement right now: the next beat tells.
                Renewal::Busy => {}
                Renewal::Lost => self.lose(*lease),
                // Decided (by this replica's run, whose hold ends with its
                // answer, or by another): nothing more to do for it here.
                Renewal::Decided => {
                    if self.holds.lose(*lease) {
                        tracing::debug!(operation_id = %id, "a held operation is decided");
                    }
                }
            }
        }
        self.holds.confirm(&renewed, sent + self.settings.lease);
    }
}
