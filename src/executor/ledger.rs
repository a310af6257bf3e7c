//! The executor's writes to the ledger: the intent of each further
//! attempt, the decision with the events that explain it, and the event
//! vocabulary of requests and failures.

use tokio::time::Instant;

use crate::domain::{Action, NewEvent, Operation, Resolution, event};

/// How long a decision that cannot be written (the database unreachable)
/// is tried again before the reconciler is left to re-observe it.
pub(crate) const DECISION_HORIZON: std::time::Duration = std::time::Duration::from_secs(600);
use crate::nova::NovaError;
use crate::store::Transition;

use super::Executor;
use super::run::{Decision, Fenced, Run};

impl Executor {
    /// Writes a decision (terminal or unknown) with the pending events.
    ///
    /// Why it is long: one write and everything its outcome means (the
    /// events that explain it, the count once it commits, a fenced write's
    /// new holder, a database that stays away), in the order they happen.
    pub(crate) async fn record(&self, run: &mut Run, d: Decision) -> Operation {
        let resolution = if run.by_reconciler && d.resolution.is_some() {
            Some(Resolution::Reconciler)
        } else {
            d.resolution
        };
        let mut t = Transition::new(&run.op, d.state, &self.replica);
        t.resolution = resolution;
        t.attachment = d.attachment.clone();
        t.last_error = Some(d.error.clone());
        t.release_lease = true;
        // An outcome left open after a request left counts that request
        // from now: its settle window (`last_request_at`) must not start
        // at the intent when the request waited for a slot or a token
        // first (the reconciler would otherwise conclude "not attached"
        // of an attach still running in Nova for as long as it waited).
        // Now is after the request left, so the window is never short.
        t.request_sent = !d.state.is_terminal() && run.last_left_at.is_some();
        t.verify_expect = verify_expect(run, &d, resolution);
        let kind = if d.state.is_terminal() {
            event::RESOLVED
        } else {
            event::UNRESOLVED
        };
        let mut ev = NewEvent::new(kind, d.detail.clone()).with("state", d.state.as_str());
        if let Some(r) = resolution {
            ev = ev.with("resolution", r.as_str());
        }
        if let Some(e) = &d.error {
            ev = ev.with("reason", e.reason);
        }
        run.events.push(ev);
        t.events = written_now(&mut run.events);
        // Durable before anyone is told: a write that fails for now is
        // made again (the same write: its id makes a second run a no-op)
        // until it lands, is fenced, or `DECISION_HORIZON` passes. The
        // caller meanwhile hears OPERATION_IN_PROGRESS at its deadline,
        // never a decision the ledger does not hold.
        let first_try = Instant::now();
        const FIRST_PAUSE: std::time::Duration = std::time::Duration::from_millis(250);
        let mut pause = FIRST_PAUSE;
        loop {
            let write_by = run
                .budget
                .answer_by
                .max(Instant::now() + self.settings.record_grace);
            let write_started = Instant::now();
            let written = self.store.operation_transition(t.clone(), write_by).await;
            self.metrics.ledger(
                "decision",
                if written.is_ok() { "ok" } else { "error" },
                write_started.elapsed().as_secs_f64(),
            );
            match written {
                Ok(Some(op)) => {
                    self.counted(&op);
                    // One per operation: debug (the metrics count them).
                    tracing::debug!(operation_id = %op.id, state = op.state.as_str(),
                        resolution = op.resolution.map(|r| r.as_str()).unwrap_or(""), "operation decided");
                    return op;
                }
                Ok(None) => {
                    // Fenced: another writer decided, or holds it now.
                    self.lose(held(&run.op));
                    let current = self.reread(&run.op).await;
                    return self
                        .after_fence(current, super::CallerTime::of(&run.budget))
                        .await;
                }
                Err(e) if first_try.elapsed() < DECISION_HORIZON => {
                    // Once per operation at warn (an outage fails them all).
                    if pause == FIRST_PAUSE {
                        tracing::warn!(operation_id = %run.op.id, error = %e, state = d.state.as_str(),
                            "could not record the decision yet; trying again until it is");
                    } else {
                        tracing::debug!(operation_id = %run.op.id, error = %e, pause_ms = pause.as_millis() as u64,
                            "could not record the decision yet; trying again");
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(std::time::Duration::from_secs(5));
                }
                Err(e) => {
                    // The row stays open with an expiring lease: another
                    // pass (this replica's reconciler or another's)
                    // re-observes and decides it. Its caller is told what
                    // the ledger holds.
                    tracing::error!(operation_id = %run.op.id, error = %e,
                        "could not record the decision; the reconciler will re-observe");
                    return self.reread(&run.op).await;
                }
            }
        }
    }

    /// Counts a decision this replica committed (`decisions_total`): the
    /// one place it is counted, for every path that decides (an executor
    /// run, a reconciler pass, an operator through `resolve_by_operator`).
    pub(crate) fn counted(&self, op: &Operation) {
        if op.state.is_terminal() {
            self.metrics.decided(op);
        }
    }

    /// An operator's decision, recorded and counted.
    pub async fn resolve_by_operator(
        &self,
        id: uuid::Uuid,
        state: crate::domain::State,
        reason: &str,
        caller: Option<&str>,
    ) -> Result<Operation, crate::store::StoreError> {
        self.resolve_audited(self.operator_decision(id, state, reason, caller))
            .await
    }

    /// An operator's decision of `id` made here, to audit further
    /// (`resolve_audited`).
    pub fn operator_decision(
        &self,
        id: uuid::Uuid,
        state: crate::domain::State,
        reason: &str,
        caller: Option<&str>,
    ) -> crate::store::OperatorDecision {
        crate::store::OperatorDecision::new(id, state, reason, &self.replica, caller)
    }

    /// An operator's decision as `d` says it (a bulk resolve's, with its
    /// audit and the state it must still be in), recorded and counted.
    pub async fn resolve_audited(
        &self,
        d: crate::store::OperatorDecision,
    ) -> Result<Operation, crate::store::StoreError> {
        let op = self.store.operation_resolve_by_operator(&d).await?;
        self.counted(&op);
        Ok(op)
    }

    /// Cancels `id` for `who` if nothing that may take effect was sent for
    /// it (one compare-and-set: `Store::operation_cancel`), counted.
    pub async fn cancel(
        &self,
        id: uuid::Uuid,
        who: &crate::domain::Caller,
        why: &str,
    ) -> Result<crate::store::Cancelled, crate::store::StoreError> {
        let (error, event) = crate::domain::cancelled(id, who, why);
        let done = self
            .store
            .operation_cancel(&crate::store::Cancel {
                id,
                replica: self.replica.clone(),
                error,
                event,
                only_attach_of: None,
            })
            .await?;
        if let crate::store::Cancelled::Done(op) = &done {
            self.counted(op);
        }
        Ok(done)
    }

    /// The row as it stands; `op` itself when it cannot be read (the
    /// caller then answers with what it knew last).
    pub(crate) async fn reread(&self, op: &Operation) -> Operation {
        match self.store.operation_get(op.id).await {
            Ok(Some(cur)) => cur,
            Ok(None) => op.clone(),
            Err(e) => {
                tracing::warn!(operation_id = %op.id, error = %e, "could not re-read the operation");
                op.clone()
            }
        }
    }

    /// Records the intent of another attempt (attempts + 1, request_sent),
    /// flushing pending events with it. Without it no request may leave:
    /// `Ok(false)` when it could not be recorded by the deadline (the
    /// attempt is not sent); `Err` when another writer decided meanwhile.
    pub(crate) async fn record_attempt(&self, run: &mut Run) -> Result<bool, Fenced> {
        let mut t = Transition::new(&run.op, crate::domain::State::InProgress, &self.replica);
        t.add_attempt = true;
        t.request_sent = true;
        // The attempt's own `request_sent` is made once its request is over
        // (stamped with when it started) and logged with the next write: an
        // intent is not a request sent.
        t.events = written_now(&mut run.events);
        match self
            .store
            .operation_transition(t, run.budget.answer_by)
            .await
        {
            Ok(Some(op)) => {
                run.op = op;
                Ok(true)
            }
            Ok(None) => {
                self.lose(held(&run.op));
                Err(Fenced(Box::new(self.reread(&run.op).await)))
            }
            Err(e) => {
                tracing::warn!(operation_id = %run.op.id, error = %e, "could not record a retry by the deadline; not sending it");
                Ok(false)
            }
        }
    }

    /// A run pausing before it sends again, after a refusal that proves
    /// nothing took effect and with nothing earlier that may: its last
    /// attempt is marked as one of which nothing may take effect
    /// (`unsent_attempt`, through its fenced transition, with the run's
    /// events so far). While it pauses, the operation may be cancelled
    /// (its next attempt must be recorded under its epoch, which a cancel
    /// moves on), and should its holder die, a pass decides it as one
    /// never sent. The next attempt's record leaves the mark behind (of
    /// an attempt no longer the last). A refusal's
    /// path only: one write more per pause. A write that fails or is
    /// fenced is left as it is: the next attempt's record is fenced too,
    /// and without the mark only a cancel is refused (too late).
    pub(crate) async fn mark_paused(&self, run: &mut Run) {
        let mut t = Transition::new(&run.op, crate::domain::State::InProgress, &self.replica);
        t.mark_unsent = true;
        let events = written_now(&mut run.events);
        t.events = events.clone();
        match self
            .store
            .operation_transition(t, run.budget.answer_by)
            .await
        {
            Ok(Some(op)) => run.op = op,
            Ok(None) => {
                tracing::debug!(operation_id = %run.op.id,
                    "pausing: decided or taken over meanwhile; the next attempt's record finds it");
                run.events = events;
            }
            Err(e) => {
                tracing::debug!(operation_id = %run.op.id, error = %e,
                    "pausing: could not mark the attempt unsent; it is not cancellable meanwhile");
                run.events = events;
            }
        }
    }

    /// Counts a failed request and logs it in the run's events.
    pub(crate) fn note_failure(&self, run: &mut Run, e: &NovaError) {
        self.metrics.nova.request(
            run.op.action.as_str(),
            e.kind.as_str(),
            e.elapsed.as_secs_f64(),
        );
        if e.outcome_unknown() {
            self.metrics.responses_lost.inc();
        }
        // Each attempt at debug (its event below is in the reconcile log);
        // the warn line is the interval's summary.
        tracing::debug!(operation_id = %run.op.id, error = %e, "Nova request failed");
        self.failures.note("Nova request", &run.op.server_id, e);
        run.events.push(
            NewEvent::new(event::REQUEST_FAILED, e.clock())
                .with("reason", e.reason())
                .with("outcome_unknown", e.outcome_unknown())
                .with_all(&e.metadata()),
        );
    }
}

/// The lease a run writes under.
fn held(op: &Operation) -> crate::store::HeldLease {
    crate::store::HeldLease {
        id: op.id,
        epoch: op.lease_epoch,
    }
}

/// The pending events, each with how long ago it happened, for a write now.
pub(crate) fn written_now(events: &mut Vec<NewEvent>) -> Vec<NewEvent> {
    std::mem::take(events)
        .into_iter()
        .map(NewEvent::written_now)
        .collect()
}

/// What a later look should find after decision `d`: the decided state of
/// a success; for a failure, the state last seen (nothing, when it was not
/// looked at: a refusal has no late effect to catch); nothing for an
/// operator's word.
fn verify_expect(run: &Run, d: &Decision, resolution: Option<Resolution>) -> Option<bool> {
    match (d.state, resolution, run.op.action) {
        (_, Some(Resolution::Operator), _) => None,
        (crate::domain::State::Succeeded, _, Action::Attach) => Some(true),
        (crate::domain::State::Succeeded, _, Action::Detach) => Some(false),
        (crate::domain::State::Failed, _, _) => run.last_seen,
        _ => None,
    }
}

/// The line of a request that started at `started` (made once it is over).
pub(crate) fn request_sent_event(
    op_id: uuid::Uuid,
    action: Action,
    attempt: i32,
    outbound: Instant,
    started: Instant,
) -> NewEvent {
    let budget_ms = outbound.saturating_duration_since(started).as_millis();
    NewEvent::new_at(
        event::REQUEST_SENT,
        format!(
            "{} request #{attempt} with an outbound deadline of {budget_ms} ms",
            match action {
                Action::Attach => "POST attach",
                Action::Detach => "DELETE detach",
            },
        ),
        started,
    )
    .with("attempt", attempt)
    .with("outbound_deadline_ms", budget_ms)
    .with(
        "request_id",
        crate::nova::RequestId::for_operation(op_id).as_str(),
    )
}
