//! The operation's task, the executor's second role: spawned by the
//! caller's side (`caller.rs`) before anything is awaited, it writes the
//! intent, drives the run to its decision (`flow.rs`, `confirm.rs`,
//! `ledger.rs`) under the lease `lease.rs` keeps, and announces the
//! decision to whoever waits on it. A reconciler's re-send runs as such a
//! task too (`spawn_run`). The tasks this replica runs (`Tasks`) and the
//! operations they run (`Runs`) are this file's: nothing else reaches
//! into them.
//!
//! Why it is long: the task's life in order (intent, what the write
//! found, the run, the answer) and its cold paths (an intent of unknown
//! outcome read back, a verdict looked at again, a lease lost), with the
//! size probes that keep its future small.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;
use uuid::Uuid;

use super::caller::{Created, Decided, Spawned};
use super::{CallerTime, Executor, OpRequest, ledger, observe, run};
use crate::domain::{
    Budget, Deadline, NewEvent, OpKey, Operation, State, TraceContext, event, request_fingerprint,
};
use crate::store::{CreateOutcome, HeldLease, NewOperation, Renewal};

use super::run::Run;

/// What an operation's task does once its intent is recorded, by what
/// the look before it (`confirm::precheck`) found.
enum AfterIntent {
    /// Send the request the intent counted.
    Send,
    /// Wait for the volume to be ready, then send.
    WaitReady,
    /// The look decided without a request; that look came before the
    /// intent held the volume, so it is made again (with the operation
    /// as it was drawn up) and its verdict stands.
    LookAgain(Box<NewOperation>),
}

/// The operations this replica runs now (their intent written), each with
/// the receiver of its decision: a caller that joins one here waits on it
/// directly.
#[derive(Default)]
pub(super) struct Runs(Mutex<HashMap<Uuid, watch::Receiver<Decided>>>);

impl Runs {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, watch::Receiver<Decided>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn insert(&self, id: Uuid, decided: watch::Receiver<Decided>) {
        self.map().insert(id, decided);
    }

    fn insert_if_absent(&self, id: Uuid, decided: impl FnOnce() -> watch::Receiver<Decided>) {
        self.map().entry(id).or_insert_with(decided);
    }

    fn remove(&self, id: Uuid) {
        self.map().remove(&id);
    }

    /// The receiver of `id`'s decision, if it runs here.
    pub(super) fn get(&self, id: Uuid) -> Option<watch::Receiver<Decided>> {
        self.map().get(&id).cloned()
    }

    /// Whether `id` runs here now.
    pub(super) fn contains(&self, id: Uuid) -> bool {
        self.map().contains_key(&id)
    }
}

/// The operation tasks this replica runs, and what stops them all (the
/// end of a shutdown: what the process's exit would do).
pub(super) struct Tasks {
    tracker: tokio_util::task::TaskTracker,
    stop: tokio_util::sync::CancellationToken,
}

impl Default for Tasks {
    fn default() -> Self {
        Self {
            tracker: tokio_util::task::TaskTracker::new(),
            stop: tokio_util::sync::CancellationToken::new(),
        }
    }
}

impl Tasks {
    /// Runs `task`, ended early (dropped at its current await) by `stop`.
    fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.tracker.spawn(stoppable(self.stop.clone(), task));
    }

    fn len(&self) -> usize {
        self.tracker.len()
    }

    fn stop(&self) {
        self.stop.cancel();
    }

    /// Waits until every task has ended, or `deadline`.
    async fn wait_idle(&self, deadline: Instant) -> bool {
        self.tracker.close();
        let done = tokio::time::timeout_at(deadline, self.tracker.wait())
            .await
            .is_ok();
        self.tracker.reopen();
        done
    }
}

impl Executor {
    /// Operation tasks this replica is running now.
    pub fn running(&self) -> usize {
        self.tasks.len()
    }

    /// Stops the operation tasks still running, as the process's exit
    /// would (the last step of a shutdown, after the leases of finished
    /// ones were handed over): whatever a stopped task did is in the
    /// ledger as an attempt counted, for the next holder to re-observe.
    /// Waits up to a second for them to unwind.
    pub async fn stop_tasks(&self) -> usize {
        let running = self.running();
        self.tasks.stop();
        self.wait_idle(Instant::now() + Duration::from_secs(1))
            .await;
        running
    }

    /// Waits until every operation task has ended, or `deadline`.
    pub async fn wait_idle(&self, deadline: Instant) -> bool {
        self.tasks.wait_idle(deadline).await
    }

    /// Spawns the task that records the intent and drives the operation.
    pub(super) fn spawn_operation(
        self: &Arc<Self>,
        req: &OpRequest,
        deadline: Deadline,
        budget: Budget,
        now: Instant,
        inflight: Option<super::InFlight>,
    ) -> Spawned {
        let new = self.intent(req, deadline, &budget, now);
        let id = new.id;
        let (created_tx, created) = oneshot::channel();
        let (done, result) = watch::channel(None);
        let this = self.clone();
        // Under the operation's trace: its requests and log lines carry it.
        let task = crate::telemetry::context::operation_task(
            new.id,
            req.action.as_str(),
            req.trace.clone(),
            this.own(Box::new(new), budget, created_tx, done, inflight),
        );
        self.tasks.spawn(Box::pin(task));
        Spawned {
            id,
            created,
            result,
            time: CallerTime::of(&budget),
        }
    }

    /// The operation's own task: the intent, then (for a new operation) the
    /// run to its decision, under a lease its heartbeat keeps, and holding
    /// its caller's place under the in-flight cap (`inflight`) until then.
    ///
    /// Why it is long: the task's life in order, and what each step found
    /// is held across the awaits after it (the hold, the `created` sender,
    /// the caller's place); split into awaited parts, each part's future
    /// would sit inside this one, whose size the size probe below bounds
    /// (tens of thousands wait at once). Its cold paths are apart
    /// (`intent_fate`, `decide_after_looking_again`, `drive_when_ready`).
    async fn own(
        self: Arc<Self>,
        mut new: Box<NewOperation>,
        budget: Budget,
        created: oneshot::Sender<Created>,
        done: watch::Sender<Decided>,
        inflight: Option<super::InFlight>,
    ) {
        // A verdict without a request comes from a look made before the
        // intent held the volume: it is not recorded as it stands, but
        // looked at again once the intent holds it.
        let next = match Box::pin(self.precheck(&mut new, &budget)).await {
            observe::Precheck::Send => AfterIntent::Send,
            observe::Precheck::WaitReady => AfterIntent::WaitReady,
            observe::Precheck::Decided(_) => AfterIntent::LookAgain(new.clone()),
        };
        let (id, record_by) = (new.id, new.record_by);
        // Held from before the write: a shutdown that hands leases over
        // meanwhile keeps this one (released, another replica could take
        // the operation over while this task goes on to send), and this
        // replica's reconciler passes over it.
        let hold = self.holds.hold(id, None);
        let write_started = Instant::now();
        // Boxed: the result (520 bytes) is matched across an await
        // below, and its room would stay in this future for the whole
        // run.
        let result = Box::new(self.store.operation_create(*new, budget.answer_by).await);
        self.metrics.ledger(
            "intent",
            if result.is_ok() { "ok" } else { "error" },
            write_started.elapsed().as_secs_f64(),
        );
        let keep_created;
        let op = match *result {
            // Written again after its acknowledgement was lost, and found
            // another's: the write outlived its lease, and another replica
            // took the intent over before anything of it could leave here.
            Ok(CreateOutcome::Created(op))
                if op.lease_epoch != 1 || op.lease_owner.as_deref() != Some(&self.replica) =>
            {
                drop(inflight);
                let answer = Box::pin(self.intent_taken_over(op, &budget)).await;
                // The decision first: the caller wakes on it, not on the
                // end of `created` (dropped with this task).
                drop(done.send(Some(Box::new(answer))));
                return;
            }
            Ok(CreateOutcome::Created(op)) => {
                // The intent's lease was set after its write left.
                hold.known(op.lease_epoch);
                self.holds
                    .confirm(&[id], write_started + self.settings.lease);
                self.runs.insert(id, done.subscribe());
                // Nothing is sent on `created` for a new operation: its
                // caller waits for the decision alone, one wake-up per call
                // (`await_spawned`). The sender is kept until the decision
                // is out, so that its end never wakes the caller first.
                // Unless the write outlasted the caller's answer time: its
                // caller, woken then with nothing running yet, waits for
                // this word to answer that the operation runs.
                keep_created = if Instant::now() >= budget.answer_by {
                    // Nobody waiting is fine: the caller may have gone.
                    drop(created.send(Box::new(Ok(CreateOutcome::Created(op.clone())))));
                    None
                } else {
                    Some(created)
                };
                op
            }
            Err(e) if e.may_have_written() => {
                // The caller is told at once that the write's outcome is
                // unknown (a retry with its key joins the operation if it
                // was recorded); but the intent may have committed, and
                // this task is its only driver: found, it is driven to a
                // decision (nothing is sent once the deadline has passed),
                // so it never waits out a settle window for a request that
                // never left.
                tracing::warn!(operation_id = %id, error = %e,
                    "the intent may have been recorded; reading it before anything is concluded");
                drop(created.send(Box::new(Err(e))));
                keep_created = None;
                match Box::pin(self.intent_fate(id, record_by, Instant::now())).await {
                    Some(op) => {
                        hold.known(op.lease_epoch);
                        op
                    }
                    None => return,
                }
            }
            other => {
                // Nothing to drive: a replay, or no intent. Nobody waiting
                // is fine: the caller may have gone. A replay's place goes
                // back now: the operation it joins has a task of its own.
                drop(inflight);
                drop(created.send(Box::new(other)));
                return;
            }
        };
        self.runs.insert_if_absent(id, || done.subscribe());
        let run = Run::new(op, budget, false);
        let decided = match next {
            AfterIntent::Send => self.drive(run, true).await,
            AfterIntent::LookAgain(again) => {
                Box::pin(self.decide_after_looking_again(run, *again)).await
            }
            AfterIntent::WaitReady => Box::pin(self.drive_when_ready(run)).await,
        };
        drop(done.send(Some(Box::new(decided))));
        drop(keep_created);
        self.runs.remove(id);
        drop(hold);
        drop(inflight);
    }

    /// A pre-check that decided without a request (nothing to detach,
    /// attached already, attached elsewhere, in error) looked before the
    /// intent was recorded, and the volume may have changed since: another
    /// operation on it decided in between (it held the volume then), or
    /// someone else's hand while the write was held up (a slow or silent
    /// database). Its verdict would then be about a volume that is no
    /// longer so (the history checker found a detach decided SUCCEEDED
    /// "nothing to detach" of a volume the service had just attached). So the same pre-check is made again now that the intent
    /// holds the volume, and its verdict stands: a decision, or a request
    /// after all.
    async fn decide_after_looking_again(
        self: &Arc<Self>,
        mut run: Run,
        mut again: NewOperation,
    ) -> Operation {
        again.events.clear();
        let lost = self.holds.lost(run.op.id);
        let Some(pre) = until_lost(lost.as_ref(), self.precheck(&mut again, &run.budget)).await
        else {
            return self.after_loss(&run).await;
        };
        run.events.append(&mut again.events);
        match pre {
            observe::Precheck::Decided(d) => self.record(&mut run, d).await,
            observe::Precheck::Send => self.drive(run, false).await,
            observe::Precheck::WaitReady => self.drive_when_ready(run).await,
        }
    }

    /// After an intent write of unknown outcome: the intent as the ledger
    /// holds it, once the database answers, if it committed and is still
    /// this replica's to drive (open, its lease neither taken over nor
    /// lapsed: renewed now); `None` when it will never be recorded, is
    /// another's now, or the database stayed unreachable for
    /// `DECISION_HORIZON` (then the reconciler decides it). The caller
    /// holds `id` meanwhile, so the heartbeat keeps its lease as soon as
    /// the database answers.
    ///
    /// Absent, it is given up only once no statement of it can still be
    /// recorded (`Store::intent_settled`). A statement can reach the
    /// server any time later (a proxy or a network that held its bytes
    /// hands them over when it speaks again): with `record_by`, one that
    /// arrives after that time of the database's inserts nothing, and the
    /// store tells when every one that arrived before it has ended.
    /// Without it (a store in this process: nothing is held in flight), a
    /// read that began twice the round-trip bound after the failure.
    async fn intent_fate(
        &self,
        id: Uuid,
        record_by: Option<DateTime<Utc>>,
        failed_at: Instant,
    ) -> Option<Operation> {
        use backon::BackoffBuilder as _;
        let settled_at = failed_at + 2 * self.store.round_trip_bound();
        let mut pauses = backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(250))
            .with_max_delay(Duration::from_secs(5))
            .with_jitter()
            .without_max_times()
            .build();
        loop {
            // Asked before the row is read: the read's snapshot is later.
            let settled = match record_by {
                None => Instant::now() >= settled_at,
                Some(by) => match self.store.intent_settled(by).await {
                    Ok(settled) => settled,
                    Err(e) => {
                        tracing::debug!(operation_id = %id, error = %e, "asking whether the intent can still be recorded");
                        false
                    }
                },
            };
            match self.store.operation_get(id).await {
                Ok(Some(op))
                    if op.state.is_terminal()
                        || op.lease_owner.as_deref() != Some(&self.replica)
                        || op.lease_epoch != 1 =>
                {
                    tracing::info!(operation_id = %id, state = op.state.as_str(), "the intent was recorded and is decided or driven elsewhere");
                    // Taken over before anything of it was sent here: its
                    // attempt never left.
                    if !op.state.is_terminal() {
                        self.mark_unsent(id, 1, 1).await;
                    }
                    return None;
                }
                Ok(Some(op)) => {
                    if self.renew_intent(&op).await {
                        return Some(op);
                    }
                }
                Ok(None) if settled => {
                    tracing::info!(operation_id = %id, "the intent was not recorded, and never will be");
                    return None;
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::debug!(operation_id = %id, error = %e, "reading the intent back")
                }
            }
            if failed_at.elapsed() >= ledger::DECISION_HORIZON {
                tracing::error!(operation_id = %id,
                    "the database stayed unreachable; an intent that may have been recorded is left to the reconciler");
                return None;
            }
            tokio::time::sleep(pauses.next().unwrap_or(Duration::from_secs(5))).await;
        }
    }

    /// An intent found taken over once its write was acknowledged: its
    /// attempt never left here (nothing is sent without the lease), so it
    /// is marked unsent for the new holder to decide at once; its caller
    /// is answered from the row, or with the new holder's decision if it
    /// comes in its time.
    async fn intent_taken_over(&self, op: Operation, budget: &Budget) -> Operation {
        tracing::info!(operation_id = %op.id, holder = op.lease_owner.as_deref().unwrap_or("-"),
            lease_epoch = op.lease_epoch,
            "the intent's acknowledgement came after another replica took it over; nothing was sent here");
        if !op.state.is_terminal() {
            self.mark_unsent(op.id, 1, 1).await;
        }
        self.after_fence(op, CallerTime::of(budget)).await
    }

    /// Renews a recorded intent's lease before anything is sent: a lease
    /// that lapsed while the database was away may be taken over by
    /// another replica's reconciler any moment. False when it was not
    /// renewed: taken over or decided, or only held by another statement
    /// at this moment (`Busy`); the next read tells.
    async fn renew_intent(&self, op: &Operation) -> bool {
        let id = op.id;
        let sent = Instant::now();
        let lease = HeldLease {
            id,
            epoch: op.lease_epoch,
        };
        match self
            .store
            .operation_renew_leases(&self.replica, &[lease], self.settings.lease)
            .await
        {
            Ok(found) if found.contains(&(id, Renewal::Renewed)) => {
                self.holds.confirm(&[id], sent + self.settings.lease);
                tracing::info!(operation_id = %id, "the intent was recorded; driving it");
                true
            }
            Ok(_) => false,
            Err(e) => {
                tracing::debug!(operation_id = %id, error = %e, "renewing the intent's lease");
                false
            }
        }
    }

    /// Runs `run` (a reconciler's re-send) as a task of this replica, under
    /// the lease its heartbeat keeps; callers that join the operation here
    /// wait on it directly.
    pub(crate) fn spawn_run(self: &Arc<Self>, run: Run) -> watch::Receiver<Decided> {
        let id = run.op.id;
        let hold = self.holds.hold(id, Some(run.op.lease_epoch));
        let (done, result) = watch::channel(None);
        self.runs.insert(id, result.clone());
        let this = self.clone();
        // The operation's trace, under a span of this pass (a row recorded
        // before traces were kept gets a trace of its own).
        let trace = run
            .op
            .trace
            .as_ref()
            .map_or_else(TraceContext::start, TraceContext::child);
        let action = run.op.action.as_str();
        let task = async move {
            let decided = this.drive(run, false).await;
            drop(done.send(Some(Box::new(decided))));
            this.runs.remove(id);
            drop(hold);
        };
        self.tasks.spawn(crate::telemetry::context::operation_task(
            id, action, trace, task,
        ));
        result
    }

    /// The intent row of a new operation: in progress, its first request
    /// counted (it may leave once this is durable), leased to this replica.
    pub(super) fn intent(
        &self,
        req: &OpRequest,
        deadline: Deadline,
        budget: &Budget,
        now: Instant,
    ) -> NewOperation {
        let recorded = NewEvent::new(event::RECORDED, format!("{} recorded", req.action.as_str()));
        let recorded = match &req.key {
            OpKey::Keyed(k) => recorded.with("idempotency_key", k.key().as_str()),
            OpKey::Ensure(_) => recorded.with("ensure", true),
        };
        // Derived from the row's own column when the log is read (not
        // kept twice).
        let recorded = if req.labels.is_empty() {
            recorded
        } else {
            recorded.with("labels", &req.labels)
        };
        let recorded = recorded
            .with("caller_deadline_ms", deadline.remaining().as_millis())
            .with("deadline_from_caller", deadline.from_caller)
            .with("caller", req.key.caller())
            .with(
                "answer_by_ms",
                budget.answer_by.saturating_duration_since(now).as_millis(),
            )
            .with("trace_id", req.trace.trace_id())
            .with("traceparent", req.trace.traceparent())
            .with(
                "caller_span_id",
                req.trace.parent_span_id().as_deref().unwrap_or("-"),
            );
        NewOperation {
            id: Uuid::now_v7(),
            fingerprint: request_fingerprint(
                req.action,
                req.server_id,
                req.volume_id,
                &req.params,
                &req.labels,
            ),
            key: req.key.clone(),
            action: req.action,
            server_id: req.server_id,
            volume_id: req.volume_id,
            params: req.params.clone(),
            labels: req.labels.clone(),
            state: State::InProgress,
            attempts: 1,
            deadline_in: budget.answer_by.saturating_duration_since(now),
            lease_owner: self.replica.clone(),
            lease_for: self.settings.lease,
            trace: Some(req.trace.clone()),
            replica: self.replica.clone(),
            events: vec![recorded],
            record_by: self.store.intent_record_by(budget.answer_by),
        }
    }

    /// Drives a run to a decision and records it. `first_sent`: the first
    /// request's intent is already recorded (attempt counted).
    ///
    /// A plain function returning its future, not an `async fn`: an
    /// `async fn` moves its argument into a local of its own and keeps
    /// room for both (744 bytes more per operation in flight); the block
    /// below works on what it captured.
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn would keep a second copy of the run"
    )]
    pub(crate) fn drive(
        self: &Arc<Self>,
        mut run: Run,
        first_sent: bool,
    ) -> impl Future<Output = Operation> + Send + '_ {
        async move {
            if first_sent {
                // The intent counted the first request, which has not left yet.
                run.maybe_effect = run.op.attempts > 1;
            }
            // Everything that asks Nova or Cinder runs only while the lease
            // is this run's: found lost (by the heartbeat, the send gate or
            // a fenced write), the run stops where it is, a request in
            // flight abandoned, and its caller is answered from the row.
            let lost = self.holds.lost(run.op.id);
            // Boxed: a task waiting inside the loop holds only the loop's state.
            let sent = until_lost(lost.as_ref(), self.send_loop(&mut run, first_sent));
            let decision = match Box::pin(sent).await {
                Some(Ok(d)) => d,
                // Fenced out: another replica or an operator decided meanwhile.
                Some(Err(run::Fenced(current))) => {
                    return Box::pin(self.after_fence(*current, CallerTime::of(&run.budget))).await;
                }
                None => return Box::pin(self.after_loss(&run)).await,
            };
            let confirmed = until_lost(lost.as_ref(), self.confirm(&mut run, decision));
            let Some(decision) = Box::pin(confirmed).await else {
                return Box::pin(self.after_loss(&run)).await;
            };
            // Not cut short: a fenced write changes nothing, and one that
            // committed is counted and answered.
            Box::pin(self.record(&mut run, decision)).await
        }
    }

    /// After this run's lease was found lost: the row as it stands, or the
    /// new holder's decision if it comes by the caller's answer time (as a
    /// replay of the key would be answered).
    pub(crate) async fn after_loss(&self, run: &Run) -> Operation {
        // Nothing of this run may take effect, and its last attempt never
        // left: say so, so that the operation is decided as one never
        // sent, not after a settle window for a request that never left.
        let never_left = self.holds.departed(run.op.id) < Some(run.op.attempts);
        if run.op.attempts > 0 && !run.maybe_effect && never_left {
            self.mark_unsent(run.op.id, run.op.lease_epoch, run.op.attempts)
                .await;
        }
        let current = self.reread(&run.op).await;
        tracing::info!(operation_id = %run.op.id, lease_epoch = run.op.lease_epoch,
            state = current.state.as_str(), holder = current.lease_owner.as_deref().unwrap_or("-"),
            "lease lost: stopped working on the operation; answering from the ledger");
        self.after_fence(current, CallerTime::of(&run.budget)).await
    }

    /// Marks attempt `attempts` of `id`, recorded under `epoch`, as one
    /// that never left (`Store::operation_mark_unsent`): a statement of
    /// fact whoever holds the operation now, made once it lost its lease
    /// here, within a round trip or two; what it cannot write, the settle
    /// window covers (as it did before the mark existed).
    pub(super) async fn mark_unsent(&self, id: Uuid, epoch: i64, attempts: i32) {
        let by = Instant::now() + 2 * self.store.round_trip_bound();
        let marked = crate::store::within(
            by,
            "marking an attempt that never left",
            self.store
                .operation_mark_unsent(id, epoch, attempts, &self.replica),
        )
        .await;
        match marked {
            Ok(true) => tracing::info!(operation_id = %id, lease_epoch = epoch, attempts,
                "its lease was lost before the attempt's request left: marked unsent, to be decided as never sent"),
            Ok(false) => tracing::debug!(operation_id = %id, lease_epoch = epoch, attempts,
                "an attempt that never left was not marked: a later attempt, or a decision, came first"),
            Err(e) => tracing::warn!(operation_id = %id, error = %e,
                "could not mark an attempt that never left; the reconciler waits for its settle window"),
        }
    }

    /// After this run was fenced (another replica took the operation over):
    /// the operation as the other decides it, if it does by `until`, so the
    /// caller hears the decision rather than the row as it stood.
    pub(crate) async fn after_fence(&self, current: Operation, time: CallerTime) -> Operation {
        if current.state.is_terminal() || Instant::now() >= time.answer_by {
            return current;
        }
        match self.wait_decided_elsewhere(current.id, time).await {
            Ok(op) => op,
            Err(e) => {
                tracing::debug!(operation_id = %current.id, error = %e, "waiting for the new holder's decision");
                current
            }
        }
    }

    /// A new operation whose volume is still being created: waits for it
    /// (nothing sent, nothing counted), then drives it.
    async fn drive_when_ready(self: &Arc<Self>, mut run: Run) -> Operation {
        let lost = self.holds.lost(run.op.id);
        match until_lost(lost.as_ref(), self.wait_ready(&mut run)).await {
            Some(Some(d)) => self.record(&mut run, d).await,
            Some(None) => self.drive(run, false).await,
            None => self.after_loss(&run).await,
        }
    }

    /// The budget a reconciler pass that re-sends works under: what is left
    /// of the operation's own deadline, on the database's clock (`db_now`).
    pub fn budget_from_row(&self, op: &Operation, db_now: DateTime<Utc>) -> Option<Budget> {
        Budget::from_row(&self.policy, op.deadline_at, db_now)
    }
}

/// `fut`, unless `lost` fires first (then `None`, `fut` dropped at its
/// current await). Without a token (not held here), `fut` alone.
async fn until_lost<T>(
    lost: Option<&tokio_util::sync::CancellationToken>,
    fut: impl std::future::Future<Output = T>,
) -> Option<T> {
    match lost {
        None => Some(fut.await),
        Some(lost) => tokio::select! {
            biased;
            () = lost.cancelled() => None,
            v = fut => Some(v),
        },
    }
}

/// `task`, ended early (dropped at its current await) when `stop` fires.
async fn stoppable(
    stop: tokio_util::sync::CancellationToken,
    task: impl std::future::Future<Output = ()>,
) {
    tokio::select! {
        biased;
        () = task => {}
        () = stop.cancelled() => {}
    }
}

#[cfg(test)]
mod size_probe {
    //! Tens of thousands of these futures wait at once (10k attaches in
    //! flight behind the per-host cap): keep them small. Cold paths are
    //! boxed so a waiting future holds only what it is waiting on.
    use super::super::{ExecSettings, test_request};
    use super::*;
    use crate::domain::{BudgetPolicy, RequestParams};
    use crate::executor::metrics::ExecutorMetrics;
    use crate::nova::NovaClient;
    use crate::store::Store;

    fn assert_small<T>(what: &str, f: &T, limit: usize) {
        let size = std::mem::size_of_val(f);
        assert!(size <= limit, "{what}: {size} bytes, more than {limit}");
    }

    async fn executor() -> Arc<Executor> {
        let nova = Arc::new(NovaClient::new(crate::nova::NovaConfig::default()));
        let store: Arc<dyn Store> = Arc::new(
            crate::store::SqliteStore::connect("sqlite::memory:")
                .await
                .unwrap(),
        );
        Executor::new(
            store,
            nova,
            BudgetPolicy::default(),
            "r".into(),
            ExecSettings::default(),
            ExecutorMetrics::unscraped(),
        )
    }

    #[tokio::test]
    async fn nova_calls_that_wait_stay_small() {
        let exec = executor().await;
        let params = RequestParams::default();
        let now = Instant::now();
        assert_small(
            "nova.attach",
            &exec.nova.attach(Uuid::nil(), Uuid::nil(), &params, now),
            1024,
        );
        assert_small("nova.list", &exec.nova.list(Uuid::nil(), now), 1024);
    }

    #[tokio::test]
    async fn submitted_and_driven_operations_stay_small() {
        let exec = executor().await;
        let req = test_request(Uuid::nil(), Uuid::nil());
        // The operation's own task, waiting in its run: the run's future
        // and little else: 1,280 bytes (1,616 while the run's future kept
        // room for a fenced row; 3,568 when it kept the intent, the
        // intent's result and a second run beside it).
        let now = Instant::now();
        let budget = BudgetPolicy::default()
            .plan(now, now + Duration::from_secs(10))
            .unwrap();
        let new = exec.intent(&req, Deadline::none(), &budget, now);
        // The row it is once written, driven below.
        let at = chrono::Utc::now();
        let op = new.recorded_as(at, at, None, None);
        let (created, _c) = oneshot::channel();
        let (done, _d) = watch::channel(None);
        let own = exec.clone().own(Box::new(new), budget, created, done, None);
        assert_small("own", &own, 1344);
        drop(own);
        // The start is boxed: what stays is the wait for the result.
        assert_small("submit", &exec.submit(req, Deadline::none()), 768);
        let budget = BudgetPolicy::default()
            .plan(Instant::now(), Instant::now() + Duration::from_secs(10))
            .unwrap();
        let drive = exec.drive(Run::new(op, budget, false), true);
        // 944 bytes: its run (744) and little else. 1,280 when the send
        // loop's outcome (a fenced row's 512 bytes) was matched across the
        // awaits after it; an `async fn` kept a second copy of its run
        // (2,032).
        assert_small("drive", &drive, 1024);
        // Its task wraps it in the operation's trace and span, adding only
        // their own few bytes, never a second copy of what it wraps (an
        // `async fn` wrapper held both: +32 MiB at 10,000 in flight).
        let inner = std::mem::size_of_val(&drive);
        let task = crate::telemetry::context::operation_task(
            Uuid::nil(),
            "attach",
            TraceContext::start(),
            drive,
        );
        assert_small("operation task", &task, inner + 256);
    }
}
