//! The caller's side, the executor's first role: `submit` plans the
//! caller's budget, spawns the operation's task (`task.rs`) and waits for
//! its word; a replayed key joins the operation it names; `wait_decided`
//! waits for an operation this or another replica runs (a joined replay, a
//! reconciler's `ReconcileOperation`).
//!
//! Every wait here ends by the caller's time ([`CallerTime`](super::CallerTime)), and so does
//! every ledger read made while a caller waits: a database that stops
//! answering never holds a caller past it. A read cut short answers as the
//! deadline does: the operation as last seen if it is unknown (the caller
//! hears OUTCOME_UNKNOWN), else `StillRunning` (OPERATION_IN_PROGRESS).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tokio::time::Instant;
use uuid::Uuid;

use super::{CallerTime, ExecError, Executor, OpRequest};
use crate::domain::deadline::BudgetTooSmall;
use crate::domain::{Deadline, OpKey, Operation, State, request_fingerprint};
use crate::store::{CreateOutcome, StoreError};

/// An operation's decision as its task announces it (boxed: tens of
/// thousands of these slots wait at once, empty).
pub(super) type Decided = Option<Box<Operation>>;

/// What an operation's intent write found, as its task tells the caller
/// (boxed, for the same reason).
pub(super) type Created = Box<Result<CreateOutcome, StoreError>>;

/// A submitted operation: its task runs already; these wait for it.
pub(super) struct Spawned {
    /// The new operation's id.
    pub(super) id: Uuid,
    /// What the intent write found, when there is no run to wait for: an
    /// error, or the key's existing operation (never sent for a new one).
    pub(super) created: oneshot::Receiver<Created>,
    /// The decision of a new operation.
    pub(super) result: watch::Receiver<Decided>,
    pub(super) time: CallerTime,
}

/// Why a request could not start: its caller's time is too short (unless
/// its key names an operation already: then it is answered with it).
struct TooShort {
    key: OpKey,
    fingerprint: String,
    small: BudgetTooSmall,
    /// The caller's deadline: the replay's read ends by it.
    until: Instant,
}

/// What the operation's task said on `created`, for its waiting caller.
enum Word {
    /// The caller's answer (boxed: the other words are small).
    Answer(Box<Result<Operation, ExecError>>),
    /// The intent is recorded and runs here: the decision is waited for.
    Recorded,
    /// A replayed key's open operation, joined.
    Join(Uuid),
}

/// The answer at the caller's time, from what was last seen of the
/// operation: an unknown (or decided) one as it stood, else `StillRunning`.
fn at_deadline(id: Uuid, last: Option<Operation>) -> Result<Operation, ExecError> {
    match last {
        Some(op) if matches!(op.state, State::Unknown) || op.state.is_terminal() => Ok(op),
        _ => Err(ExecError::StillRunning(id)),
    }
}

impl Executor {
    /// Runs (or joins) an operation and answers by the caller's deadline
    /// minus the safety margin.
    ///
    /// The task that drives the operation is spawned here, before anything
    /// is awaited, and it writes the intent itself: whatever instant the
    /// caller leaves at (even before this future is polled), an intent that
    /// commits has its driver. The returned future holds only what it waits
    /// on (thousands of them can wait at once).
    pub fn submit(
        self: &Arc<Self>,
        mut req: OpRequest,
        deadline: Deadline,
    ) -> impl std::future::Future<Output = Result<Operation, ExecError>> + Send + '_ {
        use tracing::Instrument as _;
        let now = Instant::now();
        let inflight = req.inflight.take();
        let started = match self.policy.plan(now, deadline.at) {
            Ok(budget) => Ok(self.spawn_operation(&req, deadline, budget, now, inflight)),
            Err(small) => Err(Box::new(TooShort {
                fingerprint: request_fingerprint(
                    req.action,
                    req.server_id,
                    req.volume_id,
                    &req.params,
                    &req.labels,
                ),
                key: req.key,
                small,
                until: deadline.at,
            })),
        };
        // The span is made once the operation's id is known: recording a
        // field into a span re-renders all its fields (a fifth of the
        // span's cost with JSON logs), so only a replayed key's join
        // records one later.
        let span = tracing::info_span!("submit operation",
            action = req.action.as_str(), server_id = %req.server_id, volume_id = %req.volume_id,
            operation_id = started.as_ref().ok().map(|s| tracing::field::display(s.id)),
            trace_id = %req.trace.trace_id());
        async move {
            match started {
                Ok(spawned) => self.await_spawned(spawned).await,
                Err(short) => Box::pin(self.replay_or_too_short(*short)).await,
            }
        }
        .instrument(span)
    }

    async fn await_spawned(&self, s: Spawned) -> Result<Operation, ExecError> {
        let Spawned {
            mut created,
            mut result,
            time,
            id,
        } = s;
        let until = time.answer_by;
        let peek = result.clone();
        // One wake-up for a new operation: its task answers `created` only
        // when there is no run of its own to wait for (the intent failed, or
        // the key was replayed); otherwise the decision is the one message.
        let decided = async {
            loop {
                if let Some(op) = result.borrow_and_update().clone() {
                    return Some(*op);
                }
                if result.changed().await.is_err() {
                    return None;
                }
            }
        };
        tokio::pin!(decided);
        let sleep = tokio::time::sleep_until(until);
        tokio::pin!(sleep);
        let mut recorded = false;
        // Leaves only to join a replayed key's open operation, after every
        // value of the wake-up is dropped: the wait holds nothing of them.
        let open = loop {
            tokio::select! {
                biased;
                c = &mut created, if !recorded => match self.heard(c, id, until, &peek) {
                    Word::Answer(answer) => return *answer,
                    Word::Recorded => recorded = true,
                    Word::Join(open) => {
                        tracing::Span::current()
                            .record("operation_id", tracing::field::display(open));
                        break open;
                    }
                },
                op = &mut decided => {
                    return match op {
                        Some(op) => Ok(op),
                        // The task stopped (a shutdown) after its intent.
                        None => Err(ExecError::StillRunning(id)),
                    };
                }
                () = &mut sleep => {
                    // The caller's time is up. A run of its own goes on
                    // without it. An intent still being written has its
                    // outcome waited for, on `created`: PostgreSQL's write
                    // is cut at `until` (an outcome of unknown effect is
                    // sent at once), the embedded store's commit is
                    // awaited to its end, and its task sends a new
                    // operation too when it comes this late.
                    if recorded || self.runs.contains(id) {
                        return Err(ExecError::StillRunning(id));
                    }
                    sleep.as_mut().reset(Instant::now() + Duration::from_secs(3600));
                }
            }
        };
        // Cold (a replay of an open operation): boxed.
        Box::pin(self.wait_decided(open, time)).await
    }

    /// What the task's word on `created` means for its caller: `peek`
    /// holds the decision if one came first.
    fn heard(
        &self,
        word: Result<Created, oneshot::error::RecvError>,
        id: Uuid,
        until: Instant,
        peek: &watch::Receiver<Decided>,
    ) -> Word {
        match word.map(|c| *c) {
            Ok(Ok(CreateOutcome::Existing(op))) => {
                tracing::debug!(operation_id = %op.id, state = op.state.as_str(), "idempotency key replayed; joining the operation");
                if op.state.is_terminal() {
                    return Word::Answer(Box::new(Ok(op)));
                }
                Word::Join(op.id)
            }
            // Sent only when the intent's write outlasted the
            // caller's answer time (else the task keeps the sender
            // of a new one): the operation runs on without it.
            Ok(Ok(CreateOutcome::Created(_))) => {
                if Instant::now() >= until {
                    return Word::Answer(Box::new(Err(ExecError::StillRunning(id))));
                }
                Word::Recorded
            }
            Ok(Err(e)) => Word::Answer(Box::new(Err(e.into()))),
            // The task let go of `created` without a word: after
            // its decision (read here, whichever wake-up came
            // first), stopped while its run goes on here (a
            // shutdown: the decision is still waited for), or
            // stopped before its intent's outcome (nothing runs).
            Err(_) => {
                if let Some(op) = peek.borrow().clone() {
                    return Word::Answer(Box::new(Ok(*op)));
                }
                if self.runs.contains(id) {
                    Word::Recorded
                } else {
                    Word::Answer(Box::new(Err(ExecError::TaskLost)))
                }
            }
        }
    }

    /// The caller's time is too short to start a request; but a replay of
    /// a key names its operation, and is answered with it whatever the
    /// time: decided, its decision; still open, the operation as it
    /// stands (OUTCOME_UNKNOWN or OPERATION_IN_PROGRESS, with its id), so
    /// that a caller retrying in the last moments of its deadline never
    /// loses the operation id to "too small". A key that saved no result
    /// (`Operation::frees_key`) would start a new operation: too short.
    /// An Ensure call has no key to look up: too short. The read ends by
    /// the caller's deadline; past it, the time is too short.
    async fn replay_or_too_short(&self, short: TooShort) -> Result<Operation, ExecError> {
        let OpKey::Keyed(key) = &short.key else {
            return Err(ExecError::BudgetTooSmall(short.small));
        };
        let read = crate::store::within(
            short.until,
            "read the operation of a replayed key",
            self.store.operation_get_by_key(key),
        )
        .await;
        let found = match read {
            Err(StoreError::DeadlineExceeded { .. }) => None,
            read => read?,
        };
        let Some(op) = found.filter(|op| {
            request_fingerprint(
                op.action,
                op.server_id,
                op.volume_id,
                &op.params,
                &op.labels,
            ) == short.fingerprint
        }) else {
            return Err(ExecError::BudgetTooSmall(short.small));
        };
        match op.state {
            State::Succeeded | State::Failed if op.frees_key() => {
                Err(ExecError::BudgetTooSmall(short.small))
            }
            State::Succeeded | State::Failed | State::Unknown => Ok(op),
            State::Pending | State::InProgress => Err(ExecError::StillRunning(op.id)),
        }
    }

    async fn await_result(
        &self,
        id: Uuid,
        mut rx: watch::Receiver<Decided>,
        until: Instant,
    ) -> Result<Operation, ExecError> {
        let wait = async {
            loop {
                if let Some(op) = rx.borrow_and_update().clone() {
                    return Some(*op);
                }
                if rx.changed().await.is_err() {
                    return None;
                }
            }
        };
        match tokio::time::timeout_at(until, wait).await {
            Ok(Some(op)) => Ok(op),
            Ok(None) | Err(_) => Err(ExecError::StillRunning(id)),
        }
    }

    /// Waits (on change notifications) for an operation run by this or
    /// another replica to be decided, until `time.answer_by`; then answers
    /// with the operation as it stands if it is unknown (the caller is
    /// told so), or `StillRunning`. Its ledger reads end by `time.read_by`.
    pub async fn wait_decided(&self, id: Uuid, time: CallerTime) -> Result<Operation, ExecError> {
        if let Some(rx) = self.runs.get(id) {
            match self.await_result(id, rx, time.answer_by).await {
                Ok(op) if op.state.is_terminal() => return Ok(op),
                seen @ (Ok(_) | Err(_)) if Instant::now() >= time.answer_by => {
                    return self.settled_or_running(id, seen.ok(), time).await;
                }
                // Unknown when the run ended: the reconciler goes on.
                _ => {}
            }
        }
        self.wait_decided_elsewhere(id, time).await
    }

    /// Waits (on change notifications, re-reading every second) for an
    /// operation another replica or pass drives; as `wait_decided` after
    /// its look at this replica's own runs.
    pub(super) async fn wait_decided_elsewhere(
        &self,
        id: Uuid,
        time: CallerTime,
    ) -> Result<Operation, ExecError> {
        let until = time.answer_by;
        let mut changes = self.store.subscribe();
        // Another replica may decide it: asked to notify (the loop below
        // re-reads every second regardless).
        crate::store::watch_within(
            self.store.as_ref(),
            id,
            until.saturating_duration_since(Instant::now()),
            Duration::from_secs(1),
        )
        .await;
        let mut last = None;
        loop {
            let Some(op) = self.read_for_caller(id, time).await? else {
                return at_deadline(id, last);
            };
            if op.state.is_terminal() {
                return Ok(op);
            }
            if Instant::now() >= until {
                return match op.state {
                    State::Unknown => Ok(op),
                    _ => Err(ExecError::StillRunning(id)),
                };
            }
            last = Some(op);
            // The notification is a hint; re-reading at least every second
            // covers one that was missed.
            let stop = (Instant::now() + Duration::from_secs(1)).min(until);
            loop {
                match tokio::time::timeout_at(stop, changes.recv()).await {
                    Ok(Ok(changed)) if changed != id && !changed.is_nil() => continue,
                    _ => break,
                }
            }
        }
    }

    /// At the caller's answer time: the operation as the ledger has it if
    /// it is settled (unknown or decided), else `StillRunning`; `last`, as
    /// the run here ended, when the ledger does not answer by `read_by`.
    async fn settled_or_running(
        &self,
        id: Uuid,
        last: Option<Operation>,
        time: CallerTime,
    ) -> Result<Operation, ExecError> {
        let Some(op) = self.read_for_caller(id, time).await? else {
            return at_deadline(id, last);
        };
        match op.state {
            State::Unknown | State::Succeeded | State::Failed => Ok(op),
            _ => Err(ExecError::StillRunning(id)),
        }
    }

    /// Reads operation `id` for a waiting caller, by its `read_by`
    /// (`None`: the ledger did not answer in the caller's time).
    async fn read_for_caller(
        &self,
        id: Uuid,
        time: CallerTime,
    ) -> Result<Option<Operation>, ExecError> {
        let read = crate::store::within(
            time.read_by,
            "read the operation a caller waits for",
            self.store.operation_get(id),
        )
        .await;
        match read {
            Ok(found) => Ok(Some(found.ok_or(StoreError::NotFound(id))?)),
            Err(StoreError::DeadlineExceeded { what }) => {
                tracing::debug!(operation_id = %id, stage = what,
                    "the ledger did not answer in the caller's time; answering as at its deadline");
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }
}
