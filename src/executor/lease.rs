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
    ///
    /// Beats that fail in a row (the database away) are logged at their
    /// edges: the first at warn, those after it at debug, the first that
    /// renews again at info (the store logs the outage itself).
    pub async fn heartbeat(self: Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        let mut failing: Option<(Instant, u64)> = None;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(self.settings.heartbeat) => {}
            }
            // A renewal slower than its bound ends there, as a failed one:
            // the next beat renews again (the lease outlasts two bounds
            // and a beat: `min_lease`).
            let bound = self.store.round_trip_bound();
            let renewed = match tokio::time::timeout(bound, self.renew_held()).await {
                Ok(r) => r,
                Err(_) => Err((
                    crate::store::StoreError::DeadlineExceeded {
                        what: "renewing leases within the round-trip bound",
                    },
                    self.holds.leases().len(),
                )),
            };
            match (renewed, &mut failing) {
                (Ok(()), None) => {}
                (Ok(()), Some((since, failed))) => {
                    tracing::info!(
                        failed = *failed,
                        "leases renewed again after {} s, {failed} renewal(s) failed",
                        since.elapsed().as_secs()
                    );
                    failing = None;
                }
                (Err((e, held)), None) => {
                    tracing::warn!(error = %e, held, "could not renew leases; trying every beat, logged again when a renewal succeeds");
                    failing = Some((Instant::now(), 1));
                }
                (Err((e, held)), Some((_, failed))) => {
                    *failed += 1;
                    tracing::debug!(error = %e, held, "could not renew leases");
                }
            }
        }
    }

    /// One beat: renews every lease held under a known epoch, and trips
    /// those found lost; the failure, with how many leases it held.
    pub(crate) async fn renew_held(&self) -> Result<(), (crate::store::StoreError, usize)> {
        let leases = self.holds.leases();
        if leases.is_empty() {
            return Ok(());
        }
        let sent = Instant::now();
        let found = self
            .store
            .operation_renew_leases(&self.replica, &leases, self.settings.lease)
            .await
            .map_err(|e| (e, leases.len()))?;
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
        Ok(())
    }
}
