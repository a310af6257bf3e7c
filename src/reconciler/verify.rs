//! Verification of decided operations: twice (`--verify-after` and at the
//! end of `--verify-window`, which follows Nova's bounds on late effects),
//! by a cursor over decision time — one slice per round, one list per
//! server, and a write only when something drifted. Drift means a change
//! no recorded operation explains: a volume whose latest operation began
//! after this one was decided is left to that one.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use uuid::Uuid;

use super::{Observation, Reconciler};
use crate::domain::{NewEvent, Operation, event};
use crate::executor::Seen;
use crate::store::StoreError;

/// How many times a verification whose look failed is tried (one a round).
const RETRIES: u32 = 5;

/// A verification to make.
pub(super) struct Pending {
    op: Operation,
    stage: u8,
    tries: u32,
}

/// Whether the volume is on the server, by Nova's list; `None` when the
/// look failed.
fn presence(r: &Reconciler, op: &Operation, listed: &Observation) -> Option<bool> {
    match Seen::by_list(listed, op.volume_id) {
        Ok(seen) => Some(seen.present()),
        Err(e) => {
            // Counted, and summed up in one warn line per interval.
            tracing::debug!(operation_id = %op.id, error = %e, "verification observation failed; trying again next round");
            r.look_failed(op.server_id, e);
            None
        }
    }
}

/// Where a verification looks: the executor's confirmation (Cinder's view
/// of each volume when attaches are confirmed with it), else Nova's list
/// of each server (one look per server).
#[derive(Clone, Copy, PartialEq, Eq)]
enum LookAt {
    Cinder,
    NovaList,
}

impl LookAt {
    fn what(self, present: bool) -> &'static str {
        match (self, present) {
            (LookAt::Cinder, true) => "Cinder shows it attached to the server",
            (LookAt::Cinder, false) => "Cinder shows it not attached to the server",
            (LookAt::NovaList, true) => "the volume is in the server's attachment list",
            (LookAt::NovaList, false) => "the volume is not in the server's attachment list",
        }
    }
}

impl Reconciler {
    /// One slice of each stage, and the verifications whose look failed
    /// last round; (operations verified, drifted).
    pub(super) async fn verify_due(self: &Arc<Self>) -> Result<(usize, usize), StoreError> {
        let mut verified = 0;
        let mut drifted = 0;
        let retries = std::mem::take(&mut *self.lock_retries());
        if !retries.is_empty() {
            let (v, d) = self.verify_ops(retries).await;
            verified += v;
            drifted += d;
        }
        for (stage, delay) in self.settings.verification_stages() {
            let due = self
                .store
                .verification_next(stage, delay, self.settings.batch)
                .await?;
            if due.is_empty() {
                continue;
            }
            let (v, d) = self.verify_slice(stage, delay, due).await?;
            verified += v;
            drifted += d;
        }
        Ok((verified, drifted))
    }

    async fn verify_slice(
        self: &Arc<Self>,
        stage: u8,
        delay: Duration,
        due: Vec<Operation>,
    ) -> Result<(usize, usize), StoreError> {
        let store = &self.store;
        let db_now = store.now().await?;
        let volumes: Vec<Uuid> = due.iter().map(|o| o.volume_id).collect();
        let latest: HashMap<Uuid, DateTime<Utc>> = store
            .volumes_latest_operation(&volumes)
            .await?
            .into_iter()
            .collect();
        // A verification that comes a whole window after it was due is
        // late: what it would see says little about the decision.
        let late_after = super::window(delay.saturating_add(self.settings.verify_window));
        let mut todo = Vec::new();
        for op in due {
            let explained = latest
                .get(&op.volume_id)
                .zip(op.completed_at)
                .is_some_and(|(l, done)| *l > done);
            if op.drifted || explained {
                continue;
            }
            if op.completed_at.is_some_and(|c| c + late_after < db_now) {
                // Counted, so an operator sees the verifier falling behind.
                self.metrics.verification_missed.inc();
                continue;
            }
            todo.push(Pending {
                op,
                stage,
                tries: 0,
            });
        }
        Ok(self.verify_ops(todo).await)
    }

    /// Verifies `todo`, one look per server; a verification whose look
    /// failed is tried again next round (a few times, then counted).
    async fn verify_ops(self: &Arc<Self>, todo: Vec<Pending>) -> (usize, usize) {
        let n = todo.len();
        if n == 0 {
            return (0, 0);
        }
        let look_at = self.look_at().await;
        let mut by_server: HashMap<Uuid, Vec<Pending>> = HashMap::new();
        for p in todo {
            by_server.entry(p.op.server_id).or_default().push(p);
        }
        let drifted: usize = futures_util::stream::iter(by_server)
            .map(|(server, pending)| {
                let this = self.clone();
                async move {
                    let seen = match look_at {
                        LookAt::NovaList => {
                            let trace = super::look_trace(pending.iter().map(|p| &p.op));
                            Some(this.observe_server(server, trace).await)
                        }
                        LookAt::Cinder => None,
                    };
                    let mut d = 0;
                    for p in pending {
                        let present = match &seen {
                            Some(listed) => presence(&this, &p.op, listed),
                            None => this.cinder_presence(&p.op).await,
                        };
                        match this.verify_with(&p.op, present, look_at, p.stage).await {
                            Some(true) => d += 1,
                            Some(false) => {}
                            None if p.tries + 1 < RETRIES => {
                                this.lock_retries().push(Pending {
                                    tries: p.tries + 1,
                                    ..p
                                });
                            }
                            None => {
                                this.metrics.verification_missed.inc();
                            }
                        }
                    }
                    d
                }
            })
            .buffer_unordered(self.settings.parallelism.max(1))
            .collect::<Vec<usize>>()
            .await
            .into_iter()
            .sum();
        (n, drifted)
    }

    fn lock_retries(&self) -> std::sync::MutexGuard<'_, Vec<Pending>> {
        self.verify_retries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// `ReconcileOperation` on a decided operation: one look now.
    pub(super) async fn verify_one(self: &Arc<Self>, op: Operation) -> Result<bool, StoreError> {
        if op.verify_expect.is_none() || op.drifted {
            return Ok(false);
        }
        if self.explained_by_later(&op).await? {
            return Ok(false);
        }
        let look_at = self.look_at().await;
        let present = match look_at {
            LookAt::NovaList => {
                let seen = self
                    .observe_server(op.server_id, super::look_trace([&op]))
                    .await;
                presence(self, &op, &seen)
            }
            LookAt::Cinder => self.cinder_presence(&op).await,
        };
        Ok(self
            .verify_with(&op, present, look_at, 0)
            .await
            .unwrap_or(false))
    }

    /// Whether an operation of the same volume began after this one was
    /// decided (its change is then no drift).
    async fn explained_by_later(&self, op: &Operation) -> Result<bool, StoreError> {
        Ok(self
            .store
            .volumes_latest_operation(&[op.volume_id])
            .await?
            .first()
            .zip(op.completed_at)
            .is_some_and(|((_, l), done)| *l > done))
    }

    /// How verifications look this round (the mode is fixed by the
    /// configuration, or by the Keystone catalog).
    async fn look_at(&self) -> LookAt {
        let until = tokio::time::Instant::now() + self.settings.observe_timeout;
        let mut ignored = Vec::new();
        match self.exec.cinder(&mut ignored, until).await {
            Some(_) => LookAt::Cinder,
            None => LookAt::NovaList,
        }
    }

    /// Whether Cinder shows the volume attached to the operation's server;
    /// `None` when it could not be asked (a deleted volume is attached
    /// nowhere).
    async fn cinder_presence(&self, op: &Operation) -> Option<bool> {
        let until = tokio::time::Instant::now() + self.settings.observe_timeout;
        let mut ignored = Vec::new();
        let cinder = self.exec.cinder(&mut ignored, until).await?;
        // Under the operation's trace, as the list would be.
        let look = self
            .exec
            .cinder_timed("verify", cinder.volume(op.volume_id, until));
        match crate::telemetry::context::within_opt(super::look_trace([op]), look).await {
            Ok(v) => Some(v.attached_to(op.server_id).is_some()),
            Err(e) if e.kind == crate::nova::CinderErrorKind::VolumeNotFound => Some(false),
            Err(e) => {
                // Counted, and summed up in one warn line per interval.
                tracing::debug!(operation_id = %op.id, error = %e, "verification observation failed; trying again next round");
                self.look_failed(op.server_id, &e);
                None
            }
        }
    }

    /// Compares a look with what the decision implies; true when it drifted
    /// (recorded, counted, never acted on: that is the orchestrator's
    /// call); `None` when the look failed.
    async fn verify_with(
        &self,
        op: &Operation,
        present: Option<bool>,
        look_at: LookAt,
        stage: u8,
    ) -> Option<bool> {
        let Some(expect) = op.verify_expect else {
            return Some(false);
        };
        let present = present?;
        if present == expect {
            return Some(false);
        }
        // The round chose this operation a while ago: a later operation of
        // the service's own may have begun since, and explains the change.
        match self.explained_by_later(op).await {
            Ok(true) => return Some(false),
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(operation_id = %op.id, error = %e, "could not check for a later operation; trying again next round");
                return None;
            }
        }
        self.metrics.drift_detected.inc();
        let detail = format!(
            "decided {} but {}, and no later operation explains it; not acting on it: that is the orchestrator's call",
            op.state.as_str(),
            look_at.what(present)
        );
        // Summed up in one warn line per interval (a cloud that lost its
        // attachments would otherwise write one per operation); the
        // detail is in the operation's reconcile log, and here at debug.
        tracing::debug!(operation_id = %op.id, "{detail}");
        self.failures.note(
            crate::telemetry::summary::DRIFT,
            &op.server_id,
            &format_args!("operation {}: {detail}", op.id),
        );
        let ev = NewEvent::new(event::DRIFT_DETECTED, detail)
            .with("decided_state", op.state.as_str())
            .with("present", present)
            .with("verification", if stage == 0 { "first" } else { "last" });
        if let Err(e) = self
            .store
            .operation_mark_drift(op.id, &self.replica, vec![ev])
            .await
        {
            tracing::warn!(operation_id = %op.id, error = %e, "could not record drift");
        }
        Some(true)
    }
}
