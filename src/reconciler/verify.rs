//! Verification of decided operations: twice (`--verify-after` and at the
//! end of `--verify-window`, which follows Nova's bounds on late effects),
//! by a cursor over decision time — one slice per round, one list per
//! server, and a write only when something drifted. Drift means a change
//! no recorded operation explains: a volume whose latest operation began
//! after this one was decided is left to that one.
//!
//! Every look (Nova's list of a server, Cinder's view of a volume) takes a
//! token of the reconciler's bucket (`--reconcile-rate-limit`). A look that
//! failed is tried again later, with backoff, until the verification's
//! window closes; only then is it missed. Looks that fail in a row
//! (`OUTAGE_AFTER`: Nova or Cinder away) hold the verifier back: no new
//! slice is taken, one waiting verification is tried now and then as a
//! probe (`PROBE_PAUSE` doubling to `MAX_PROBE_PAUSE`), and once one
//! answers, every verification held back is made, at the rate limit. An
//! outage shorter than the window thus costs no verification, and never
//! more than a probe's requests.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use tokio::time::Instant;
use uuid::Uuid;

use super::{Observation, Reconciler};
use crate::domain::{NewEvent, Operation, event};
use crate::executor::Seen;
use crate::store::StoreError;

/// Looks failed in a row (none answered between them) past which the
/// target is taken to be away.
const OUTAGE_AFTER: u32 = 3;

/// The first pause between probes of a target taken to be away, doubled
/// after each probe that fails, up to `MAX_PROBE_PAUSE`.
const PROBE_PAUSE: Duration = Duration::from_secs(1);
const MAX_PROBE_PAUSE: Duration = Duration::from_secs(10);

/// A verification to make.
pub(super) struct Pending {
    op: Operation,
    stage: u8,
    /// Looks of it that failed so far.
    tries: u32,
    /// The database's time past which it is missed: its stage's due time
    /// and a whole window.
    give_up_at: DateTime<Utc>,
    /// Not looked at again before this (after a look that failed).
    next_at: Instant,
}

/// The verifications waiting to be made again (their look failed, or the
/// target was away when their turn came), and whether looks fail in a row.
#[derive(Default)]
pub(super) struct Backlog {
    pending: Vec<Pending>,
    failed_in_a_row: u32,
    /// When the next probe may go, while the target is away.
    next_probe: Option<Instant>,
    probe_pause: Duration,
}

impl Backlog {
    fn away(&self) -> bool {
        self.failed_in_a_row >= OUTAGE_AFTER
    }

    fn answered(&mut self) {
        self.failed_in_a_row = 0;
        self.next_probe = None;
        // The next outage's first pause is `PROBE_PAUSE` (see `probe`).
        self.probe_pause = Duration::ZERO;
    }

    fn failed(&mut self) {
        self.failed_in_a_row = self.failed_in_a_row.saturating_add(1);
    }

    /// While the target is away: the one waiting verification to probe it
    /// with, when a probe is due (the pause then doubles); none otherwise.
    fn probe(&mut self, now: Instant) -> Option<Pending> {
        if self.next_probe.is_some_and(|at| at > now) || self.pending.is_empty() {
            return None;
        }
        self.probe_pause = (self.probe_pause * 2).clamp(PROBE_PAUSE, MAX_PROBE_PAUSE);
        self.next_probe = Some(now + self.probe_pause);
        let first = (0..self.pending.len()).min_by_key(|i| self.pending[*i].next_at)?;
        Some(self.pending.swap_remove(first))
    }

    /// The waiting verifications whose pause is over.
    fn due(&mut self, now: Instant) -> Vec<Pending> {
        let (due, wait) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|p| p.next_at <= now);
        self.pending = wait;
        due
    }

    /// The waiting verifications whose window closed by `db_now`.
    fn missed(&mut self, db_now: DateTime<Utc>) -> usize {
        let before = self.pending.len();
        self.pending.retain(|p| p.give_up_at >= db_now);
        before - self.pending.len()
    }
}

/// Whether the volume is on the server, by Nova's list; `None` when the
/// look failed.
fn presence(r: &Reconciler, op: &Operation, listed: &Observation) -> Option<bool> {
    match Seen::by_list(listed, op.volume_id) {
        Ok(seen) => Some(seen.present()),
        Err(e) => {
            // Counted, and summed up in one warn line per interval.
            tracing::debug!(operation_id = %op.id, error = %e, "verification observation failed; trying again later");
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

/// What became of one verification.
enum Verified {
    /// Compared: drifted or not.
    Done { drifted: bool },
    /// To be made again later: its look failed (`looked`), or it was held
    /// back while the target is away.
    Again { looked: bool },
}

impl Reconciler {
    /// The verifications held back or failed before, then (unless Nova or
    /// Cinder is away) one slice of each stage; (operations verified,
    /// drifted).
    pub(super) async fn verify_due(self: &Arc<Self>) -> Result<(usize, usize), StoreError> {
        let db_now = self.store.now().await?;
        let now = Instant::now();
        let (again, away) = {
            let mut backlog = self.lock_backlog();
            let missed = backlog.missed(db_now);
            self.missed("unanswered", missed);
            if backlog.pending.is_empty() {
                // Nothing to probe with: the next slice's looks tell.
                backlog.answered();
            }
            match backlog.away() {
                true => (backlog.probe(now).into_iter().collect(), true),
                false => (backlog.due(now), false),
            }
        };
        let (mut verified, mut drifted) = self.verify_ops(again, away).await;
        if away || self.lock_backlog().away() {
            self.count_waiting();
            return Ok((verified, drifted));
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
        self.count_waiting();
        Ok((verified, drifted))
    }

    /// Sets the gauge of the verifications waiting in the backlog.
    fn count_waiting(&self) {
        let waiting = self.lock_backlog().pending.len();
        self.metrics
            .verification_waiting
            .set(i64::try_from(waiting).unwrap_or(i64::MAX));
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
        let mut late = 0;
        for op in due {
            let explained = latest
                .get(&op.volume_id)
                .zip(op.completed_at)
                .is_some_and(|(l, done)| *l > done);
            if op.drifted || explained {
                continue;
            }
            let Some(give_up_at) = op.completed_at.map(|c| c + late_after) else {
                continue;
            };
            if give_up_at < db_now {
                late += 1;
                continue;
            }
            todo.push(Pending {
                op,
                stage,
                tries: 0,
                give_up_at,
                next_at: Instant::now(),
            });
        }
        // Counted, so an operator sees the verifier falling behind.
        self.missed("late", late);
        Ok(self.verify_ops(todo, false).await)
    }

    /// Counts verifications missed for `reason`, and sums them up in the
    /// interval's warn line.
    fn missed(&self, reason: &'static str, n: usize) {
        if n == 0 {
            return;
        }
        self.metrics.missed(reason, n as u64);
        let why = match reason {
            "late" => {
                "reached a whole --verify-window after they were due (the verifier fell behind)"
            }
            _ => "every look failed until their --verify-window closed (Nova or Cinder away)",
        };
        for _ in 0..n {
            self.failures
                .note("verification", &reason, &format_args!("missed: {why}"));
        }
    }

    /// Verifies `todo`, one look per server (or per volume with Cinder);
    /// a verification whose look failed, or that was held back because
    /// the target is away (unless it is the `probe`), waits in the
    /// backlog. (Verified, drifted.)
    async fn verify_ops(self: &Arc<Self>, todo: Vec<Pending>, probe: bool) -> (usize, usize) {
        if todo.is_empty() {
            return (0, 0);
        }
        let look_at = self.look_at().await;
        let mut by_server: HashMap<Uuid, Vec<Pending>> = HashMap::new();
        for p in todo {
            by_server.entry(p.op.server_id).or_default().push(p);
        }
        let done: Vec<(usize, usize)> = futures_util::stream::iter(by_server)
            .map(|(server, pending)| {
                let this = self.clone();
                async move { this.verify_server(server, pending, look_at, probe).await }
            })
            .buffer_unordered(self.settings.parallelism.max(1))
            .collect()
            .await;
        done.into_iter()
            .fold((0, 0), |(v, d), (v2, d2)| (v + v2, d + d2))
    }

    /// The verifications of one server; (verified, drifted). While the
    /// target is away, only a `probe` looks.
    async fn verify_server(
        self: &Arc<Self>,
        server: Uuid,
        pending: Vec<Pending>,
        look_at: LookAt,
        probe: bool,
    ) -> (usize, usize) {
        let seen = match look_at {
            LookAt::NovaList if self.token_to_look(probe).await => {
                let trace = super::look_trace(pending.iter().map(|p| &p.op));
                let listed = self.observe_server_now(server, trace).await;
                // Nova's word that the server is gone is an answer too.
                self.look_answered(Seen::by_list(&listed, Uuid::nil()).is_ok());
                Some(listed)
            }
            _ => None,
        };
        let (mut verified, mut drifted) = (0, 0);
        for p in pending {
            let present = match (&seen, look_at) {
                (Some(listed), _) => Some(presence(self, &p.op, listed)),
                (None, LookAt::Cinder) if self.token_to_look(probe).await => {
                    Some(self.cinder_presence(&p.op).await)
                }
                (None, _) => None,
            };
            let result = match present {
                None => Verified::Again { looked: false },
                Some(None) => Verified::Again { looked: true },
                Some(Some(present)) => self.verify_with(&p.op, present, look_at, p.stage).await,
            };
            match result {
                Verified::Done { drifted: d } => {
                    verified += 1;
                    drifted += usize::from(d);
                }
                Verified::Again { looked } => self.wait_again(p, looked),
            }
        }
        (verified, drifted)
    }

    /// `p` waits in the backlog: after a pause when its look failed, at
    /// once (for the target's return) when it was held back.
    fn wait_again(&self, mut p: Pending, looked: bool) {
        if looked {
            p.tries += 1;
            p.next_at = Instant::now() + self.backoff_after(p.tries);
        }
        self.lock_backlog().pending.push(p);
    }

    /// Takes a token of the rate limit for a look, and says whether to
    /// make it: always for a `probe`, else only while the target is not
    /// away (it may have been found so while this one waited for its
    /// token).
    async fn token_to_look(&self, probe: bool) -> bool {
        if !probe && self.lock_backlog().away() {
            return false;
        }
        self.limiter.acquire().await;
        probe || !self.lock_backlog().away()
    }

    /// Records whether a look answered (for `Backlog::away`). The first
    /// answer after the target was away makes every verification held
    /// back or failed meanwhile due at once.
    fn look_answered(&self, answered: bool) {
        let mut backlog = self.lock_backlog();
        if !answered {
            backlog.failed();
            return;
        }
        if backlog.away() {
            let now = Instant::now();
            for p in &mut backlog.pending {
                p.next_at = p.next_at.min(now);
            }
        }
        backlog.answered();
    }

    /// The pause before a verification whose look failed `tries` times is
    /// tried again: from 1 s, doubling to `--reconcile-max-backoff`, with
    /// up to as much again of jitter.
    fn backoff_after(&self, tries: u32) -> Duration {
        use backon::BackoffBuilder as _;
        let max = self.settings.max_backoff.max(Duration::from_secs(1));
        backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_secs(1))
            .with_max_delay(max)
            .with_factor(2.0)
            .with_jitter()
            .without_max_times()
            .build()
            .nth(tries.clamp(1, 16) as usize - 1)
            .unwrap_or(max)
    }

    pub(super) fn lock_backlog(&self) -> std::sync::MutexGuard<'_, Backlog> {
        self.verify_backlog
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
            LookAt::Cinder => {
                self.limiter.acquire().await;
                self.cinder_presence(&op).await
            }
        };
        Ok(match present {
            Some(present) => matches!(
                self.verify_with(&op, present, look_at, 0).await,
                Verified::Done { drifted: true }
            ),
            None => false,
        })
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

    /// Whether Cinder shows the volume attached to the operation's server
    /// (its caller took a token of the rate limit); `None` when it could
    /// not be asked (a deleted volume is attached nowhere).
    async fn cinder_presence(&self, op: &Operation) -> Option<bool> {
        let until = tokio::time::Instant::now() + self.settings.observe_timeout;
        let mut ignored = Vec::new();
        let cinder = self.exec.cinder(&mut ignored, until).await?;
        // Under the operation's trace, as the list would be.
        let look = self
            .exec
            .cinder_timed("verify", cinder.volume(op.volume_id, until));
        let answer = crate::telemetry::context::within_opt(super::look_trace([op]), look).await;
        let present = match answer {
            Ok(v) => Some(v.attached_to(op.server_id).is_some()),
            Err(e) if e.kind == crate::nova::CinderErrorKind::VolumeNotFound => Some(false),
            Err(e) => {
                // Counted, and summed up in one warn line per interval.
                tracing::debug!(operation_id = %op.id, error = %e, "verification observation failed; trying again later");
                self.look_failed(op.server_id, &e);
                None
            }
        };
        self.look_answered(present.is_some());
        present
    }

    /// Compares a look with what the decision implies: drifted or not
    /// (recorded, counted, never acted on: that is the orchestrator's
    /// call), or to be made again when the ledger could not be read or
    /// written.
    async fn verify_with(
        &self,
        op: &Operation,
        present: bool,
        look_at: LookAt,
        stage: u8,
    ) -> Verified {
        let Some(expect) = op.verify_expect else {
            return Verified::Done { drifted: false };
        };
        if present == expect {
            return Verified::Done { drifted: false };
        }
        // The round chose this operation a while ago: a later operation of
        // the service's own may have begun since, and explains the change.
        match self.explained_by_later(op).await {
            Ok(true) => return Verified::Done { drifted: false },
            Ok(false) => {}
            Err(e) => {
                // The database's outage is logged by the store.
                tracing::debug!(operation_id = %op.id, error = %e, "could not check for a later operation; trying again later");
                return Verified::Again { looked: false };
            }
        }
        let detail = format!(
            "decided {} but {}, and no later operation explains it; not acting on it: that is the orchestrator's call",
            op.state.as_str(),
            look_at.what(present)
        );
        let ev = NewEvent::new(event::DRIFT_DETECTED, detail.clone())
            .with("decided_state", op.state.as_str())
            .with("present", present)
            .with("verification", if stage == 0 { "first" } else { "last" });
        match self
            .store
            .operation_mark_drift(op.id, &self.replica, vec![ev])
            .await
        {
            Ok(()) => {}
            // Pruned meanwhile: nothing left to mark.
            Err(StoreError::NotFound(_)) => return Verified::Done { drifted: false },
            // Not written: tried again with the verification. (The
            // database's outage is logged by the store.)
            Err(e) if !e.may_have_written() => {
                tracing::debug!(operation_id = %op.id, error = %e, "could not record drift; trying again later");
                return Verified::Again { looked: false };
            }
            // Perhaps written: not made again (a second mark would log the
            // drift twice); counted and summed up as found.
            Err(e) => {
                tracing::debug!(operation_id = %op.id, error = %e, "recording drift: its outcome is not known; not made again");
            }
        }
        self.metrics.drift_detected.inc();
        // Summed up in one warn line per interval (a cloud that lost its
        // attachments would otherwise write one per operation); the
        // detail is in the operation's reconcile log, and here at debug.
        tracing::debug!(operation_id = %op.id, "{detail}");
        self.failures.note(
            crate::telemetry::summary::DRIFT,
            &op.server_id,
            &format_args!("operation {}: {detail}", op.id),
        );
        Verified::Done { drifted: true }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Action, RequestParams, State};

    fn pending(give_up_at: DateTime<Utc>, next_at: Instant) -> Pending {
        let now = Utc::now();
        Pending {
            op: Operation {
                id: Uuid::new_v4(),
                idempotency_key: "k".into(),
                action: Action::Attach,
                state: State::Succeeded,
                resolution: None,
                server_id: Uuid::new_v4(),
                volume_id: Uuid::new_v4(),
                params: RequestParams::default(),
                attachment: None,
                attempts: 1,
                last_error: None,
                deadline_at: now,
                last_request_at: None,
                created_at: now,
                updated_at: now,
                completed_at: Some(now),
                lease_owner: None,
                lease_expires_at: None,
                lease_epoch: 1,
                caller: None,
                ensure: false,
                attempt_unsent: false,
                labels: Default::default(),
                drifted: false,
                passes: 0,
                escalated_at: None,
                escalation: None,
                verify_expect: Some(true),
                trace: None,
            },
            stage: 0,
            tries: 0,
            give_up_at,
            next_at,
        }
    }

    #[test]
    fn looks_failing_in_a_row_hold_the_verifier_back_to_a_probe_now_and_then() {
        let now = Instant::now();
        let later = Utc::now() + chrono::Duration::minutes(30);
        let mut b = Backlog::default();
        for _ in 0..OUTAGE_AFTER - 1 {
            b.failed();
        }
        assert!(!b.away(), "a failure or two is not an outage");
        b.answered();
        for _ in 0..OUTAGE_AFTER {
            b.failed();
        }
        assert!(b.away());
        assert!(b.probe(now).is_none(), "nothing waiting: nothing to probe");
        b.pending = (0..3).map(|_| pending(later, now)).collect();
        // One at a time, 1 s, then doubling to 10 s apart.
        let mut at = now;
        for pause in [1, 2, 4, 8, 10, 10] {
            let p = b.probe(at).expect("a probe is due");
            assert!(b.probe(at).is_none(), "one probe at a time");
            b.pending.push(p);
            at += Duration::from_secs(pause);
            assert!(b.probe(at - Duration::from_millis(1)).is_none());
        }
        b.answered();
        assert!(!b.away());
        assert_eq!(b.due(at).len(), 3, "all made once it answers");
    }

    #[test]
    fn a_waiting_verification_is_missed_only_once_its_window_closed() {
        let now = Instant::now();
        let db_now = Utc::now();
        let mut b = Backlog {
            pending: vec![
                pending(db_now - chrono::Duration::seconds(1), now),
                pending(db_now + chrono::Duration::seconds(1), now),
            ],
            ..Backlog::default()
        };
        assert_eq!(b.missed(db_now), 1);
        assert_eq!(b.pending.len(), 1);
        let not_yet = now + Duration::from_secs(5);
        b.pending[0].next_at = not_yet;
        assert!(b.due(now).is_empty(), "its pause is not over");
        assert_eq!(b.due(not_yet).len(), 1);
    }
}
