//! One pass over one claimed operation: what the server's attachment list
//! (or its absence) says, and what the pass decides.
//!
//! | what the look found | attach | detach |
//! |---|---|---|
//! | the volume on the server | SUCCEEDED | another attachment than the one it was to remove: SUCCEEDED; else wait for the settle window, then re-send or FAILED |
//! | the volume not on it | wait for the settle window, then re-send or FAILED | SUCCEEDED |
//! | the server does not exist (the list's 404 naming it, and GET /servers/{id} agrees) | FAILED `NOVA_SERVER_NOT_FOUND` | SUCCEEDED |
//! | the look failed | back off; past deadline + settle window: escalate | same |
//!
//! A SUCCEEDED found this way is confirmed with Cinder first, as the
//! executor confirms (`executor/confirm.rs`): not confirmed yet, the pass
//! waits for a later one (never a re-send); past the operation's deadline
//! and settle window it is escalated.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::time::Instant;

use super::{Observation, PassResult, Reconciler, ms_between};
use crate::domain::{
    Action, Budget, NewEvent, Operation, OperationError, Reason, Resolution, State, event,
};
use crate::executor::{CinderSays, Decision, Run, Seen};
use crate::store::Transition;

impl Reconciler {
    /// One pass over a claimed operation, from what the server's list
    /// (`listed`) shows. Why it is long: it is the table of what a look
    /// means for each action (the server gone, the volume there or not),
    /// with the events each row writes; every step it leads to (confirm,
    /// decide, defer, re-send) is a call of its own.
    #[tracing::instrument(name = "reconcile operation", skip_all, fields(operation_id = %op.id, action = op.action.as_str(), trace_id = op.trace.as_ref().map(|t| t.trace_id())))]
    pub(super) async fn pass_with(
        self: &Arc<Self>,
        op: Operation,
        listed: &Observation,
        db_now: DateTime<Utc>,
    ) -> PassResult {
        self.metrics.passes.inc();
        let until = Instant::now() + self.settings.observe_timeout;
        let mut run = Run::new(op.clone(), Budget::observe_only(until), true);
        let present = match Seen::by_list(listed, op.volume_id) {
            Err(e) => return self.unobservable(&op, e, db_now).await,
            Ok(Seen::ServerGone) => {
                run.events.push(
                    NewEvent::new(
                        event::OBSERVED,
                        "reconciler: the server no longer exists (Nova's 404 naming it, for the list and for GET /servers/{id})",
                    )
                    .with("present", false),
                );
                run.last_seen = Some(false);
                return self.server_gone(&mut run).await;
            }
            Ok(Seen::Attached(att)) => Some(att),
            Ok(Seen::Absent) => None,
        };
        run.last_seen = Some(present.is_some());
        run.events.push(
            NewEvent::new(
                event::OBSERVED,
                if present.is_some() {
                    "reconciler: the volume is in the server's attachment list"
                } else {
                    "reconciler: the volume is not in the server's attachment list"
                },
            )
            .with("present", present.is_some()),
        );
        match (op.action, present) {
            (Action::Attach, Some(att)) => {
                let d = Decision::succeeded(
                    Resolution::Reconciler,
                    Some(att),
                    "attachment observed by the reconciler",
                );
                self.confirm_then_decide(run, d, db_now).await
            }
            (Action::Detach, Some(att)) if !op.nothing_sent() => {
                match self.replaced(&mut run, &att).await {
                    Ok(Some(d)) => self.decide(&mut run, d, "succeeded").await,
                    Ok(None) => self.not_yet(run, db_now).await,
                    // Within the deadline a re-send could remove someone
                    // else's attachment: wait until it can be told.
                    Err(why) if self.exec.budget_from_row(&op, db_now).is_some() => {
                        let wait = self.backoff(&op);
                        self.defer(run, State::Unknown, wait, why, 0).await
                    }
                    Err(_) => self.not_yet(run, db_now).await,
                }
            }
            // Never sent too (PENDING: its replica recorded the intent and
            // went silent before the request): the volume is not on the
            // server, which is what the detach was asked for, as the
            // executor's pre-check decides "nothing to detach". Cinder
            // confirms it as for a sent one (an attachment on its way
            // waits for a later pass). A re-send instead found no time
            // left near the deadline and failed a detach of a volume
            // detached all along (chaos seeds 1577 and 1585).
            (Action::Detach, None) => {
                let d = Decision::succeeded(
                    Resolution::Reconciler,
                    None,
                    if op.nothing_sent() {
                        "the volume is not on the server: nothing to detach; nothing sent"
                    } else {
                        "volume observed detached by the reconciler"
                    },
                );
                self.confirm_then_decide(run, d, db_now).await
            }
            _ => self.not_yet(run, db_now).await,
        }
    }

    /// What Nova's list shows, confirmed with Cinder as the executor does
    /// (`executor/confirm.rs`): one look; still under way, the operation
    /// waits for a later pass (past its deadline and settle window it is
    /// handed to people).
    async fn confirm_then_decide(
        &self,
        mut run: Run,
        d: Decision,
        db_now: DateTime<Utc>,
    ) -> PassResult {
        let until = run.budget.answer_by;
        let last = match self.exec.cinder_says(&mut run, until).await {
            CinderSays::NotAsked => return self.decide(&mut run, d, "succeeded").await,
            CinderSays::Confirmed(att) => {
                let mut d = d;
                d.detail = format!("{}; confirmed by Cinder", d.detail);
                if d.attachment.is_none() {
                    d.attachment = att;
                }
                return self.decide(&mut run, d, "succeeded").await;
            }
            CinderSays::VolumeGone if run.op.action == Action::Detach => {
                return self.decide(&mut run, d, "succeeded").await;
            }
            CinderSays::VolumeGone => {
                let err = OperationError::new(
                    Reason::NovaVolumeNotFound,
                    "the volume was deleted before Cinder showed it attached",
                )
                .with("operation_id", run.op.id);
                let d = Decision::failed(Resolution::Reconciler, err);
                return self.decide(&mut run, d, "failed").await;
            }
            CinderSays::NotAttached(status) if status.is_error() => {
                let err = OperationError::new(
                    Reason::AttachRolledBack,
                    format!("Nova rolled the attach back: Cinder shows the volume {status}"),
                )
                .with("operation_id", run.op.id)
                .with("volume_status", status.as_str());
                let d = Decision::failed(Resolution::Reconciler, err);
                return self.decide(&mut run, d, "failed").await;
            }
            CinderSays::NotAttached(status) | CinderSays::Pending(status) => status.to_string(),
            CinderSays::Failed(e) => format!("unknown ({})", e.clock()),
        };
        let why = format!(
            "Nova's list shows the {} done, but Cinder does not confirm it yet (volume {last})",
            run.op.action.as_str()
        );
        let settle = super::window(self.settings.settle(run.op.action));
        if db_now > run.op.deadline_at + settle {
            let op = run.op.clone();
            let why = format!("{why}, past its deadline and settle window");
            return self.escalate(&op, why, &Default::default()).await;
        }
        let wait = self.backoff(&run.op);
        self.defer(run, State::Unknown, wait, why, 0).await
    }

    /// A detach whose request may have left finds the volume on the server:
    /// is it still the attachment the detach was asked to remove (Cinder's
    /// id, logged before the first request)? Another one means that one is
    /// gone (removed by this operation's unlogged request, or by someone
    /// else) and the volume was attached again since: SUCCEEDED, and the
    /// new attachment is not this key's to remove (a re-send would be a
    /// second effect; the verifier reports it as drift). `Ok(None)`: the
    /// same one, or nothing named before sending (no Cinder then).
    async fn replaced(
        &self,
        run: &mut Run,
        now: &crate::domain::AttachmentInfo,
    ) -> Result<Option<Decision>, String> {
        let events = self
            .store
            .operation_events(run.op.id)
            .await
            .map_err(|e| format!("could not read the operation's log: {e}"))?;
        let Some(asked) = events
            .iter()
            .find_map(|e| e.metadata.get(crate::executor::DETACH_TARGET))
        else {
            return Ok(None);
        };
        // From microversion 2.89 Nova's list names Cinder's attachment;
        // before it, only the volume: ask Cinder.
        let current = if now.id != run.op.volume_id.to_string() {
            Some(now.id.clone())
        } else {
            let until = run.budget.answer_by;
            self.exec.cinder_attachment_here(run, until).await?
        };
        let Some(current) = current else {
            // Nova lists it, Cinder no longer: on its way out; a later
            // pass tells.
            return Err("Nova lists the volume, Cinder names no attachment yet".into());
        };
        if *asked == current {
            return Ok(None);
        }
        run.events.push(
            NewEvent::new(
                event::OBSERVED,
                "reconciler: the attachment this detach was asked to remove is gone; \
                 the volume is attached again by another",
            )
            .with("asked_to_remove", asked)
            .with("attached_now", &current),
        );
        Ok(Some(Decision::succeeded(
            Resolution::Reconciler,
            None,
            format!(
                "the attachment it was asked to remove ({asked}) is gone; the volume was \
                 attached again since ({current}), which is not this operation's to remove"
            ),
        )))
    }

    async fn decide(&self, run: &mut Run, d: Decision, what: &str) -> PassResult {
        self.metrics.decision(what);
        match self.exec.record(run, d).await.state {
            State::Succeeded => PassResult::Succeeded,
            State::Failed => PassResult::Failed,
            _ => PassResult::Deferred,
        }
    }

    /// The server is gone: nothing is attached to it, and nothing can be.
    async fn server_gone(&self, run: &mut Run) -> PassResult {
        match run.op.action {
            Action::Detach => {
                let d = Decision::succeeded(
                    Resolution::Reconciler,
                    None,
                    "the server no longer exists: the volume is not attached to it",
                );
                self.decide(run, d, "succeeded").await
            }
            Action::Attach => {
                let err = OperationError::new(
                    Reason::NovaServerNotFound,
                    "the server no longer exists: the volume cannot be attached to it",
                )
                .with("operation_id", run.op.id)
                .with("attempts", run.op.attempts);
                let d = Decision::failed(Resolution::Reconciler, err);
                self.decide(run, d, "failed").await
            }
        }
    }

    /// Not (yet) in the wanted state: a request sent recently may still be
    /// in Nova (the settle window); after it, re-send within the
    /// operation's own deadline, else it did not happen.
    async fn not_yet(self: &Arc<Self>, mut run: Run, db_now: DateTime<Utc>) -> PassResult {
        let op = run.op.clone();
        let settle = self.settings.settle(op.action);
        // Nothing of it may take effect (never sent, or its last attempt
        // known never to have left): no settle window to wait out.
        let never_sent = op.nothing_sent();
        if !never_sent && let Some(sent) = op.last_request_at {
            let settled_at = sent + super::window(settle);
            if settled_at > db_now {
                let why = format!(
                    "not observed yet; waiting for the settle window ({} s after the last request)",
                    settle.as_secs()
                );
                let wait = (settled_at - db_now).to_std().unwrap_or_default();
                return self
                    .defer(
                        run,
                        State::Unknown,
                        wait,
                        why,
                        ms_between(db_now, settled_at),
                    )
                    .await;
            }
        }
        match self.exec.budget_from_row(&op, db_now) {
            Some(budget) => {
                self.metrics.decision("resent");
                let mut resend = Run::new(op, budget, true);
                // Nothing earlier may take effect: its answers decide as a
                // first request's would.
                if never_sent {
                    resend.maybe_effect = false;
                }
                resend.events = std::mem::take(&mut run.events);
                resend.events.push(NewEvent::new(
                    event::RETRY_SCHEDULED,
                    "reconciler re-sends the request within the operation's deadline",
                ));
                // A task of its own, under the heartbeat: the round goes on.
                drop(self.exec.spawn_run(resend));
                PassResult::Deferred
            }
            None => {
                let reason = if never_sent {
                    Reason::NotSent
                } else {
                    Reason::NotObserved
                };
                let err = OperationError::new(
                    reason,
                    match (never_sent, op.action) {
                        (true, _) => {
                            "no request of it ever left, and the operation's deadline has passed"
                        }
                        (false, Action::Attach) => {
                            "the attachment never appeared and the operation's deadline has passed"
                        }
                        (false, Action::Detach) => {
                            "the volume is still attached and the operation's deadline has passed"
                        }
                    },
                )
                .with("operation_id", op.id)
                .with("attempts", op.attempts)
                .with("settle_window_s", settle.as_secs());
                let d = Decision::failed(Resolution::Reconciler, err);
                self.decide(&mut run, d, "failed").await
            }
        }
    }

    /// The server's attachments could not be listed: back off; past the
    /// operation's deadline and settle window, hand it to people. An
    /// observation failing as the last one did adds nothing to the log.
    async fn unobservable(
        &self,
        op: &Operation,
        e: &crate::nova::NovaError,
        db_now: DateTime<Utc>,
    ) -> PassResult {
        let settle = super::window(self.settings.settle(op.action));
        let message = format!("observation failed: {}", e.clock());
        let repeated = op
            .last_error
            .as_ref()
            .is_some_and(|last| last.message == message && last.reason == e.reason());
        let mut t = Transition::new(op, self.open_state(op), &self.replica);
        t.release_lease = true;
        let mut error =
            OperationError::new(e.reason(), message.clone()).with("operation_id", op.id);
        error.metadata.extend(e.metadata());
        if db_now > op.deadline_at + settle {
            let why = format!(
                "its server's attachments could not be listed past its deadline and settle window: {message}"
            );
            return self.escalate(op, why, &e.metadata()).await;
        }
        let wait = self.backoff(op);
        t.next_attempt_in = Some(wait);
        t.last_error = Some(Some(error));
        if !repeated {
            t.events = vec![
                NewEvent::new(event::OBSERVED, format!("{message}; backing off"))
                    .with("reason", e.reason())
                    .with("next_attempt_in_ms", wait.as_millis())
                    .with_all(&e.metadata()),
            ];
        }
        self.metrics.decision("deferred");
        self.write(t).await;
        PassResult::Deferred
    }

    /// Hands the (still open) operation to people: counted, visible in
    /// `ops list --escalated`, and not passed over again.
    async fn escalate(
        &self,
        op: &Operation,
        why: String,
        context: &std::collections::BTreeMap<String, String>,
    ) -> PassResult {
        self.metrics.decision("escalated");
        tracing::warn!(operation_id = %op.id, "operation escalated to operators: {why}");
        let mut t = Transition::new(op, self.open_state(op), &self.replica);
        t.release_lease = true;
        t.escalation = Some(why.clone());
        t.last_error = Some(Some(OperationError::new(
            Reason::NotObservable,
            why.clone(),
        )));
        t.events = vec![
            NewEvent::new(event::ESCALATED, why)
                .with("reason", Reason::NotObservable)
                .with_all(context),
        ];
        self.write(t).await;
        PassResult::Escalated
    }

    /// The state an undecided operation keeps: never sent stays pending.
    fn open_state(&self, op: &Operation) -> State {
        if op.state == State::Pending {
            State::Pending
        } else {
            State::Unknown
        }
    }

    /// Leaves the operation for a later pass (lease released, backoff set);
    /// a wait that says what the last one said adds nothing to the log.
    async fn defer(
        &self,
        mut run: Run,
        state: State,
        wait: Duration,
        why: String,
        settle_in_ms: i64,
    ) -> PassResult {
        let op = &run.op;
        let repeated = op
            .last_error
            .as_ref()
            .is_some_and(|last| last.message == why);
        let mut t = Transition::new(op, state, &self.replica);
        t.release_lease = true;
        t.next_attempt_in = Some(wait.min(self.settings.max_backoff.max(Duration::from_secs(1))));
        t.last_error = Some(Some(
            OperationError::new(Reason::OutcomeUnknown, why.clone())
                .with("operation_id", op.id)
                .with("attempts", op.attempts),
        ));
        let mut events = std::mem::take(&mut run.events);
        if repeated {
            events.clear();
        } else {
            events.push(
                NewEvent::new(event::RETRY_SCHEDULED, why).with("settle_in_ms", settle_in_ms),
            );
        }
        t.events = events;
        self.metrics.decision("deferred");
        self.write(t).await;
        PassResult::Deferred
    }

    async fn write(&self, t: Transition) {
        let id = t.id;
        if let Err(e) = self
            .store
            .operation_transition(t, Instant::now() + self.settings.observe_timeout)
            .await
        {
            // The lease expires by itself; the next round takes it again.
            tracing::warn!(operation_id = %id, error = %e, "could not record a reconciler pass");
        }
    }
}
