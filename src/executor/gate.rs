//! The send gate of one run (see `nova::SendGate`): a request leaves only
//! while the run's lease is known to hold — by the heartbeat's last
//! renewal, else by a renewal made now — and the instant it left is
//! noted. It is asked when the request's slot and token are had, and again
//! once a connection made for it is ready (connect and TLS can take
//! seconds), just before the request is written. Without it, a request
//! that waited long for a slot, a token or a connection while the database
//! was away could leave after another replica took the operation over: two
//! requests for one key.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use uuid::Uuid;

use super::Executor;
use crate::store::{HeldLease, Renewal};

use super::SEND_MARGIN;

#[derive(Clone)]
pub(crate) struct LeaseGate {
    exec: Arc<Executor>,
    id: Uuid,
    /// The request's own deadline: a renewal made here waits no longer.
    deadline: Instant,
    /// The attempt (the operation's count) whose request this gate lets
    /// out: its holds learn it left.
    attempt: i32,
    left_at: Arc<Mutex<Option<Instant>>>,
    /// The caller row whose share of Nova's slots the request counts
    /// against.
    share: Option<usize>,
}

impl LeaseGate {
    pub(crate) fn new(
        exec: &Arc<Executor>,
        id: Uuid,
        deadline: Instant,
        attempt: i32,
        caller: Option<&str>,
    ) -> Self {
        Self {
            exec: exec.clone(),
            id,
            deadline,
            attempt,
            left_at: Arc::new(Mutex::new(None)),
            share: exec.row_of(caller),
        }
    }

    /// When the request left (its gate was last let through), if it did.
    pub(crate) fn left_at(&self) -> Option<Instant> {
        *self.left_at.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn confirm_lease(&self) -> Result<(), String> {
        let now = Instant::now();
        let holds = &self.exec.holds;
        if holds
            .confirmed_until(self.id)
            .is_some_and(|until| until > now + SEND_MARGIN)
        {
            return Ok(());
        }
        let Some(lease) = holds.lease(self.id) else {
            return Err("the operation's lease is not held here".into());
        };
        // A renewal the store calls healthy may take its whole round-trip
        // bound; the lease is sized so that one that long still leaves the
        // gate its margin (`min_lease`).
        let by = self.deadline.min(now + self.exec.store.round_trip_bound());
        match tokio::time::timeout_at(by, self.renew(lease)).await {
            Ok(r) => r,
            Err(_) => Err(format!(
                "its lease could not be renewed within {} ms",
                by.saturating_duration_since(now).as_millis()
            )),
        }
    }

    /// Renews this one lease now (under its epoch); a row another statement
    /// holds at this moment (the heartbeat's renewal, a write) is asked
    /// again after a short pause, never read as lost.
    async fn renew(&self, lease: HeldLease) -> Result<(), String> {
        let exec = &self.exec;
        let mut pause = Duration::from_millis(5);
        loop {
            let sent = Instant::now();
            let found = exec
                .store
                .operation_renew_leases(&exec.replica, &[lease], exec.settings.lease)
                .await
                .map_err(|e| format!("its lease could not be renewed: {e}"))?;
            match found.iter().find(|(id, _)| *id == lease.id).map(|f| f.1) {
                Some(Renewal::Renewed) => {
                    exec.holds.confirm(&[lease.id], sent + exec.settings.lease);
                    return Ok(());
                }
                Some(Renewal::Busy) => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(100));
                }
                Some(Renewal::Decided) => {
                    exec.lose(lease);
                    return Err("the operation was decided meanwhile".into());
                }
                Some(Renewal::Lost) | None => {
                    exec.lose(lease);
                    return Err("the operation's lease is no longer this replica's".into());
                }
            }
        }
    }
}

impl crate::nova::SendGate for LeaseGate {
    fn may_send(&self) -> futures_util::future::BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            self.confirm_lease().await?;
            // Noted before the request may leave: a run stopped from here on
            // counts it as sent.
            self.exec.holds.depart(self.id, self.attempt);
            *self.left_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
            Ok(())
        })
    }

    fn owned(&self) -> Option<Arc<dyn crate::nova::SendGate>> {
        Some(Arc::new(self.clone()))
    }

    fn share(&self) -> Option<usize> {
        self.share
    }
}
