//! Runs one operation: records the intent, calls Nova in a task the service
//! owns (the RPC future can be dropped), classifies the answer, re-observes
//! when the answer was lost or ambiguous, and records the true outcome.
//!
//! Rules (see README "Budgets"): a timeout means "unknown", not "failed";
//! only an observation of Nova's state finalizes an operation whose request
//! may have arrived; every wait is bounded by the operation's deadline.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use rand::Rng;
use tokio::sync::watch;
use tokio::time::Instant;
use uuid::Uuid;

use crate::domain::deadline::BudgetTooSmall;
use crate::domain::{
    Action, AttachmentInfo, Budget, BudgetPolicy, Deadline, NewEvent, Operation, OperationError,
    RequestParams, Resolution, State, event, request_fingerprint,
};
use crate::metrics::Metrics;
use crate::nova::{AttachAnswer, NovaClient, NovaError, NovaErrorKind, Rejection};
use crate::store::{CreateOutcome, NewOperation, Store, StoreError, Transition};

/// A validated request.
#[derive(Debug, Clone)]
pub struct OpRequest {
    pub action: Action,
    pub idempotency_key: String,
    pub server_id: Uuid,
    pub volume_id: Uuid,
    pub params: RequestParams,
    pub caller: Option<String>,
}

#[derive(Debug, Clone)]
pub struct ExecSettings {
    /// How long past its deadline an operation's lease outlives a crash
    /// before another replica's reconciler may take it over.
    pub lease_grace: Duration,
    /// Extra time the task may use to write an outcome that arrived at the
    /// last moment (the write is bounded, never open-ended).
    pub record_grace: Duration,
    /// First and largest pause between observations while waiting for an
    /// accepted (202) request to show.
    pub observe_interval: Duration,
    pub observe_interval_max: Duration,
    /// When a decided operation is observed once more for late effects.
    pub verify_after: Duration,
}

impl ExecSettings {
    /// The built-in defaults: the one source of the flags' defaults too
    /// (`config.rs` refers to these; a test checks they agree).
    pub const DEFAULT: Self = Self {
        lease_grace: Duration::from_secs(30),
        record_grace: Duration::from_secs(10),
        observe_interval: Duration::from_millis(50),
        observe_interval_max: Duration::from_secs(1),
        verify_after: Duration::from_secs(60),
    };
}

impl Default for ExecSettings {
    fn default() -> Self {
        Self::DEFAULT
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("the caller's deadline leaves {} ms for Nova; at least {} ms are needed", .0.available.as_millis(), .0.minimum.as_millis())]
    BudgetTooSmall(BudgetTooSmall),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The deadline came while the operation still runs (joined replay or
    /// a slow database); it goes on and is recorded.
    #[error("operation {0} is still in progress at the caller's deadline")]
    StillRunning(Uuid),
}

/// The decision of one pass.
#[derive(Debug, Clone)]
pub(crate) struct Decision {
    state: State,
    resolution: Option<Resolution>,
    attachment: Option<AttachmentInfo>,
    error: Option<OperationError>,
    detail: String,
}

impl Decision {
    pub(crate) fn succeeded_with(
        resolution: Resolution,
        attachment: Option<AttachmentInfo>,
        detail: &str,
    ) -> Self {
        Self::succeeded(resolution, attachment, detail.to_string())
    }
    pub(crate) fn failed_with(resolution: Resolution, error: OperationError) -> Self {
        Self::failed(resolution, error)
    }
    fn succeeded(
        resolution: Resolution,
        attachment: Option<AttachmentInfo>,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            state: State::Succeeded,
            resolution: Some(resolution),
            attachment,
            error: None,
            detail: detail.into(),
        }
    }
    fn failed(resolution: Resolution, error: OperationError) -> Self {
        Self {
            state: State::Failed,
            resolution: Some(resolution),
            attachment: None,
            detail: error.message.clone(),
            error: Some(error),
        }
    }
    fn unknown(error: OperationError) -> Self {
        Self {
            state: State::Unknown,
            resolution: None,
            attachment: None,
            detail: error.message.clone(),
            error: Some(error),
        }
    }
}

/// What an observation of the server's attachments found.
#[derive(Debug)]
pub(crate) enum Seen {
    Attached(AttachmentInfo),
    Absent,
}

/// Per-run context: the operation as last written, the plan, the events
/// not yet written (flushed with the next state write).
pub(crate) struct Run {
    pub op: Operation,
    pub budget: Budget,
    pub events: Vec<NewEvent>,
    /// Whether any request so far may have reached Nova.
    pub maybe_sent: bool,
    /// Decisions of a reconciler pass are attributed to the reconciler.
    pub by_reconciler: bool,
    backoff_step: u32,
}

impl Run {
    /// Observations stop a slice before `answer_by`, so the decision can be
    /// written and answered in time.
    pub(crate) fn observe_by(&self) -> Instant {
        let slice = (self.budget.reserve / 10).min(Duration::from_millis(250));
        self.budget
            .answer_by
            .checked_sub(slice)
            .unwrap_or(self.budget.answer_by)
    }

    pub(crate) fn new(op: Operation, budget: Budget, by_reconciler: bool) -> Self {
        Self {
            maybe_sent: op.attempts > 0,
            op,
            budget,
            events: Vec::new(),
            by_reconciler,
            backoff_step: 0,
        }
    }
}

/// How a submitted operation started.
enum Started {
    /// New, running in its own task; its result arrives on `rx`.
    Running {
        id: Uuid,
        rx: watch::Receiver<Option<Operation>>,
        until: Instant,
    },
    /// A replayed key whose operation is already decided.
    Settled(Box<Operation>),
    /// A replayed key whose operation is still running (here or elsewhere).
    Joined { id: Uuid, until: Instant },
}

pub struct Executor {
    pub store: Arc<dyn Store>,
    pub nova: Arc<NovaClient>,
    pub policy: BudgetPolicy,
    pub replica: String,
    pub settings: ExecSettings,
    pub metrics: Arc<Metrics>,
    inflight: Mutex<HashMap<Uuid, watch::Receiver<Option<Operation>>>>,
    tasks: tokio_util::task::TaskTracker,
}

fn wall_clock(at: Instant) -> chrono::DateTime<Utc> {
    let now = Instant::now();
    let d = at.saturating_duration_since(now);
    Utc::now() + chrono::Duration::from_std(d).unwrap_or(chrono::Duration::days(3650))
}

fn monotonic(at: chrono::DateTime<Utc>) -> Instant {
    let d = (at - Utc::now()).to_std().unwrap_or(Duration::ZERO);
    Instant::now() + d
}

impl Executor {
    pub fn new(
        store: Arc<dyn Store>,
        nova: Arc<NovaClient>,
        policy: BudgetPolicy,
        replica: String,
        settings: ExecSettings,
        metrics: Arc<Metrics>,
    ) -> Arc<Self> {
        Arc::new(Self {
            store,
            nova,
            policy,
            replica,
            settings,
            metrics,
            inflight: Mutex::new(HashMap::new()),
            tasks: tokio_util::task::TaskTracker::new(),
        })
    }

    /// Operation tasks this replica is running now.
    pub fn running(&self) -> usize {
        self.tasks.len()
    }

    /// Waits until every operation task has ended, or `deadline`.
    pub async fn wait_idle(&self, deadline: Instant) -> bool {
        self.tasks.close();
        let done = tokio::time::timeout_at(deadline, self.tasks.wait())
            .await
            .is_ok();
        self.tasks.reopen();
        done
    }

    /// Runs (or joins) an operation and answers by the caller's deadline
    /// minus the safety margin.
    ///
    /// Not an `async fn`: the start (intent write, spawning the work) is
    /// boxed here and freed once done, and the request moves into it, so
    /// the returned future (thousands of them can wait at once) holds only
    /// what it waits on.
    pub fn submit(
        self: &Arc<Self>,
        req: OpRequest,
        deadline: Deadline,
    ) -> impl std::future::Future<Output = Result<Operation, ExecError>> + Send + '_ {
        use tracing::Instrument as _;
        let span = tracing::info_span!("submit operation",
            action = req.action.as_str(), server_id = %req.server_id, volume_id = %req.volume_id,
            operation_id = tracing::field::Empty);
        let start = Box::pin(self.start(req, deadline));
        async move {
            match start.await? {
                Started::Running { id, rx, until } => self.await_result(id, rx, until).await,
                Started::Settled(op) => Ok(*op),
                Started::Joined { id, until } => Box::pin(self.wait_settled(id, until)).await,
            }
        }
        .instrument(span)
    }

    async fn start(
        self: &Arc<Self>,
        req: OpRequest,
        deadline: Deadline,
    ) -> Result<Started, ExecError> {
        let now = Instant::now();
        let budget = self
            .policy
            .plan(now, deadline.at)
            .map_err(ExecError::BudgetTooSmall)?;
        let outbound = self.policy.outbound(&budget, now);
        let deadline_at = wall_clock(budget.answer_by);
        let id = Uuid::now_v7();
        let new = NewOperation {
            id,
            fingerprint: request_fingerprint(req.action, req.server_id, req.volume_id, &req.params),
            idempotency_key: req.idempotency_key.clone(),
            action: req.action,
            server_id: req.server_id,
            volume_id: req.volume_id,
            params: req.params.clone(),
            state: State::InProgress,
            attempts: 1,
            deadline_at,
            lease_owner: self.replica.clone(),
            lease_expires_at: deadline_at
                + chrono::Duration::from_std(self.settings.lease_grace).unwrap_or_default(),
            caller: req.caller.clone(),
            replica: self.replica.clone(),
            events: vec![
                NewEvent::new(event::RECORDED, format!("{} recorded", req.action.as_str()))
                    .with("idempotency_key", &req.idempotency_key)
                    .with("caller_deadline_ms", deadline.remaining().as_millis())
                    .with("deadline_from_caller", deadline.from_caller)
                    .with("caller", req.caller.as_deref().unwrap_or("-"))
                    .with(
                        "answer_by_ms",
                        budget.answer_by.saturating_duration_since(now).as_millis(),
                    ),
                request_sent_event(req.action, 1, outbound, now),
            ],
        };
        let write_started = Instant::now();
        let created = self.store.operation_create(new, budget.answer_by).await;
        self.metrics.ledger(
            "intent",
            if created.is_ok() { "ok" } else { "error" },
            write_started.elapsed().as_secs_f64(),
        );
        match created? {
            CreateOutcome::Created(op) => {
                tracing::Span::current().record("operation_id", tracing::field::display(op.id));
                let (tx, rx) = watch::channel(None);
                self.inflight
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(op.id, rx.clone());
                let this = self.clone();
                let op_id = op.id;
                self.tasks.spawn(async move {
                    let run = Run::new(op, budget, false);
                    let done = this.drive(run, true).await;
                    // Nobody waiting is fine: the caller may have gone.
                    drop(tx.send(Some(done)));
                    this.inflight
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&op_id);
                });
                Ok(Started::Running {
                    id: op_id,
                    rx,
                    until: budget.answer_by,
                })
            }
            CreateOutcome::Existing(op) => {
                tracing::Span::current().record("operation_id", tracing::field::display(op.id));
                tracing::info!(operation_id = %op.id, state = op.state.as_str(), "idempotency key replayed; joining the operation");
                if op.state.is_terminal() || op.state == State::Unknown {
                    return Ok(Started::Settled(Box::new(op)));
                }
                Ok(Started::Joined {
                    id: op.id,
                    until: budget.answer_by,
                })
            }
        }
    }

    async fn await_result(
        &self,
        id: Uuid,
        mut rx: watch::Receiver<Option<Operation>>,
        until: Instant,
    ) -> Result<Operation, ExecError> {
        let wait = async {
            loop {
                if let Some(op) = rx.borrow_and_update().clone() {
                    return Some(op);
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

    /// Waits for an operation (run by this or another replica) to reach a
    /// terminal or unknown state, on change notifications.
    pub async fn wait_settled(&self, id: Uuid, until: Instant) -> Result<Operation, ExecError> {
        let local = self
            .inflight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned();
        if let Some(rx) = local {
            return self.await_result(id, rx, until).await;
        }
        let mut changes = self.store.subscribe();
        loop {
            let op = self
                .store
                .operation_get(id)
                .await?
                .ok_or(StoreError::NotFound(id))?;
            if op.state.is_terminal() || op.state == State::Unknown {
                return Ok(op);
            }
            // The notification is a hint; re-reading at least every second
            // covers one that was missed.
            let wake = Instant::now() + Duration::from_secs(1);
            let stop = wake.min(until);
            loop {
                match tokio::time::timeout_at(stop, changes.recv()).await {
                    Ok(Ok(changed)) if changed != id && !changed.is_nil() => continue,
                    _ => break,
                }
            }
            if Instant::now() >= until {
                return Err(ExecError::StillRunning(id));
            }
        }
    }

    /// Drives a run to a decision and records it. `first_sent`: the first
    /// request's intent is already recorded (attempt counted).
    pub(crate) async fn drive(self: &Arc<Self>, mut run: Run, first_sent: bool) -> Operation {
        // Boxed: a task waiting inside one flow holds only that flow's state.
        let decision = match run.op.action {
            Action::Attach => Box::pin(self.attach_flow(&mut run, first_sent)).await,
            Action::Detach => Box::pin(self.detach_flow(&mut run, first_sent)).await,
        };
        let decision = match decision {
            Ok(d) => d,
            // Fenced out: another replica or an operator decided meanwhile.
            Err(Fenced(current)) => return current,
        };
        Box::pin(self.record(&mut run, decision)).await
    }

    /// Writes a decision (terminal or unknown) with the pending events.
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
        if d.state.is_terminal() {
            t.verify_at = Some(
                Utc::now()
                    + chrono::Duration::from_std(self.settings.verify_after).unwrap_or_default(),
            );
        }
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
            ev = ev.with("reason", &e.reason);
        }
        run.events.push(ev);
        t.events = std::mem::take(&mut run.events);
        let write_by = run
            .budget
            .answer_by
            .max(Instant::now() + self.settings.record_grace);
        let write_started = Instant::now();
        let written = self.store.operation_transition(t, write_by).await;
        self.metrics.ledger(
            "decision",
            if written.is_ok() { "ok" } else { "error" },
            write_started.elapsed().as_secs_f64(),
        );
        match written {
            Ok(Some(op)) => {
                tracing::info!(operation_id = %op.id, state = op.state.as_str(),
                    resolution = op.resolution.map(|r| r.as_str()).unwrap_or(""), "operation decided");
                op
            }
            Ok(None) => self.reread(&run.op).await,
            Err(e) => {
                // The row stays in_progress with an expiring lease: another
                // pass (this replica's reconciler or another's) finishes it.
                tracing::error!(operation_id = %run.op.id, error = %e,
                    "could not record the decision; the reconciler will re-observe");
                let mut op = run.op.clone();
                op.state = d.state;
                op.resolution = resolution;
                op.last_error = d.error;
                op.attachment = d.attachment;
                op
            }
        }
    }

    async fn reread(&self, op: &Operation) -> Operation {
        match self.store.operation_get(op.id).await {
            Ok(Some(cur)) => cur,
            Ok(None) | Err(_) => op.clone(),
        }
    }

    /// Records the intent of another attempt (attempts + 1, request_sent),
    /// flushing pending events with it.
    async fn record_attempt(&self, run: &mut Run, outbound: Instant) -> Result<(), Fenced> {
        let mut t = Transition::new(&run.op, State::InProgress, &self.replica);
        t.add_attempt = true;
        t.request_sent = true;
        run.events.push(request_sent_event(
            run.op.action,
            run.op.attempts + 1,
            outbound,
            Instant::now(),
        ));
        t.events = std::mem::take(&mut run.events);
        match self
            .store
            .operation_transition(t, run.budget.answer_by)
            .await
        {
            Ok(Some(op)) => {
                run.op = op;
                Ok(())
            }
            Ok(None) => Err(Fenced(self.reread(&run.op).await)),
            Err(e) => {
                // Without a durable intent no request may leave.
                tracing::warn!(operation_id = %run.op.id, error = %e, "could not record a retry; not sending it");
                Err(Fenced(self.reread(&run.op).await))
            }
        }
    }

    fn note_failure(&self, run: &mut Run, op_name: &str, e: &NovaError) {
        self.metrics
            .nova(op_name, e.kind.as_str(), e.elapsed.as_secs_f64());
        if e.outcome_unknown() {
            self.metrics.responses_lost.inc();
        }
        tracing::warn!(operation_id = %run.op.id, error = %e, "Nova request failed");
        run.events.push(
            NewEvent::new(event::REQUEST_FAILED, e.clock())
                .with("reason", e.reason())
                .with("outcome_unknown", e.outcome_unknown())
                .with_all(&e.metadata()),
        );
    }

    /// Sleeps a jittered, growing pause if it still leaves time for another
    /// request before `send_by`; false when no retry fits.
    async fn backoff(&self, run: &mut Run, why: &str) -> bool {
        let base = Duration::from_millis(50) * 2u32.saturating_pow(run.backoff_step.min(6));
        let base = base.min(Duration::from_secs(2));
        let jitter = rand::rng().random_range(0.5..1.5);
        let pause = base.mul_f64(jitter);
        run.backoff_step += 1;
        let resume = Instant::now() + pause;
        if !self.policy.can_send_again(&run.budget, resume) {
            return false;
        }
        run.events.push(
            NewEvent::new(
                event::RETRY_SCHEDULED,
                format!("retrying after {} ms: {why}", pause.as_millis()),
            )
            .with("pause_ms", pause.as_millis()),
        );
        tokio::time::sleep_until(resume).await;
        true
    }

    /// Lists the server's attachments (bounded by `until`) and reports
    /// whether the volume is there.
    async fn observe(&self, run: &mut Run, until: Instant) -> Result<Seen, NovaError> {
        let started = Instant::now();
        let result = self.nova.list(run.op.server_id, until).await;
        match result {
            Ok(items) => {
                self.metrics
                    .nova("list", "ok", started.elapsed().as_secs_f64());
                let vol = run.op.volume_id.to_string();
                let found = items.iter().find(|a| a.volume_id == vol);
                let seen = match found {
                    Some(a) => Seen::Attached(a.to_info()),
                    None => Seen::Absent,
                };
                run.events.push(
                    NewEvent::new(
                        event::OBSERVED,
                        match &seen {
                            Seen::Attached(_) => "the volume is in the server's attachment list",
                            Seen::Absent => "the volume is not in the server's attachment list",
                        },
                    )
                    .with("attachments_listed", items.len())
                    .with("present", matches!(seen, Seen::Attached(_))),
                );
                Ok(seen)
            }
            Err(e) => {
                self.metrics
                    .nova("list", e.kind.as_str(), e.elapsed.as_secs_f64());
                run.events.push(
                    NewEvent::new(
                        event::OBSERVED,
                        format!("observation failed: {}", e.clock()),
                    )
                    .with("reason", e.reason())
                    .with_all(&e.metadata()),
                );
                Err(e)
            }
        }
    }

    /// Observes until the volume is (or is no longer) attached, or `until`.
    async fn observe_until(
        &self,
        run: &mut Run,
        want_attached: bool,
        until: Instant,
    ) -> Option<Seen> {
        let mut pause = self.settings.observe_interval;
        loop {
            match self.observe(run, until).await {
                Ok(Seen::Attached(a)) if want_attached => return Some(Seen::Attached(a)),
                Ok(Seen::Absent) if !want_attached => return Some(Seen::Absent),
                Ok(_) | Err(_) => {}
            }
            let next = Instant::now() + pause;
            if next >= until {
                return None;
            }
            tokio::time::sleep_until(next).await;
            pause = (pause * 2).min(self.settings.observe_interval_max);
        }
    }

    fn unknown_error(&self, run: &Run, e: Option<&NovaError>, message: &str) -> OperationError {
        let mut err = OperationError::new("OUTCOME_UNKNOWN", message)
            .with("operation_id", run.op.id)
            .with("attempts", run.op.attempts);
        if let Some(e) = e {
            err.metadata.extend(e.metadata());
            err = err.with("last_failure", e.reason());
        }
        err
    }

    async fn attach_flow(
        self: &Arc<Self>,
        run: &mut Run,
        first_sent: bool,
    ) -> Result<Decision, Fenced> {
        let mut need_record = !first_sent;
        loop {
            let now = Instant::now();
            if !self.policy.can_send_again(&run.budget, now) {
                return Ok(Box::pin(self.out_of_budget(run, None)).await);
            }
            let outbound = self.policy.outbound(&run.budget, now);
            if need_record {
                Box::pin(self.record_attempt(run, outbound)).await?;
            }
            need_record = true;
            self.metrics
                .nova_outbound_deadline
                .observe(outbound.saturating_duration_since(now).as_secs_f64());
            let started = Instant::now();
            let result = self
                .nova
                .attach(run.op.server_id, run.op.volume_id, &run.op.params, outbound)
                .await;
            match result {
                Ok(AttachAnswer::Attached(a)) => {
                    self.metrics
                        .nova("attach", "ok", started.elapsed().as_secs_f64());
                    run.events.push(
                        NewEvent::new(event::RESPONSE, "Nova answered 200: attachment created")
                            .with("http_status", 200)
                            .with("elapsed_ms", started.elapsed().as_millis()),
                    );
                    return Ok(Decision::succeeded(
                        Resolution::Response,
                        Some(a.to_info()),
                        "attached (Nova's response)",
                    ));
                }
                Ok(AttachAnswer::Accepted) => {
                    self.metrics
                        .nova("attach", "accepted", started.elapsed().as_secs_f64());
                    run.maybe_sent = true;
                    run.events.push(
                        NewEvent::new(
                            event::RESPONSE,
                            "Nova answered 202: accepted; watching the attachment list",
                        )
                        .with("http_status", 202),
                    );
                    return Ok(match Box::pin(self.observe_until(run, true, run.observe_by())).await {
                        Some(Seen::Attached(a)) => {
                            Decision::succeeded(Resolution::Reobserved, Some(a), "attached (observed after 202)")
                        }
                        _ => Decision::unknown(self.unknown_error(
                            run,
                            None,
                            "Nova accepted the attach (202) but it did not appear before the deadline",
                        )),
                    });
                }
                Err(e) => {
                    self.note_failure(run, "attach", &e);
                    if e.may_have_reached_nova {
                        run.maybe_sent = true;
                    }
                    match e.kind.clone() {
                        NovaErrorKind::Rejected(Rejection::AlreadyAttached { servers }) => {
                            // Maybe ours (a retry of an attach that took effect).
                            match Box::pin(self.observe(run, run.observe_by())).await {
                                Ok(Seen::Attached(a)) => {
                                    self.metrics.responses_recovered.inc();
                                    return Ok(Decision::succeeded(
                                        Resolution::Reobserved,
                                        Some(a),
                                        "already attached to this server (observed)",
                                    ));
                                }
                                Ok(Seen::Absent) => {
                                    let ours = run.op.server_id.to_string();
                                    let elsewhere: Vec<_> =
                                        servers.into_iter().filter(|s| *s != ours).collect();
                                    if !elsewhere.is_empty() {
                                        let mut err = OperationError::new(
                                            "ALREADY_ATTACHED_ELSEWHERE",
                                            format!(
                                                "volume {} is attached to another server: {}",
                                                run.op.volume_id,
                                                elsewhere.join(" ")
                                            ),
                                        )
                                        .with("attached_to", elsewhere.join(" "))
                                        .with("operation_id", run.op.id);
                                        err.metadata.extend(e.metadata());
                                        return Ok(Decision::failed(Resolution::Response, err));
                                    }
                                    // Not listed anywhere we can see: a rollback
                                    // raced us; try again if time allows.
                                    if Box::pin(
                                        self.backoff(run, "already-attached but not listed"),
                                    )
                                    .await
                                    {
                                        continue;
                                    }
                                    return Ok(Box::pin(self.out_of_budget(run, Some(&e))).await);
                                }
                                Err(_) => {
                                    return Ok(Decision::unknown(self.unknown_error(
                                        run,
                                        Some(&e),
                                        "volume reported attached, observation failed",
                                    )));
                                }
                            }
                        }
                        NovaErrorKind::Rejected(Rejection::Conflict | Rejection::Throttled) => {
                            if self
                                .backoff(run, "Nova reported a transient conflict")
                                .await
                            {
                                continue;
                            }
                            return Ok(
                                Box::pin(self.definitive_failure(run, &e, "NOVA_CONFLICT")).await
                            );
                        }
                        NovaErrorKind::ConnectFailed | NovaErrorKind::AuthFailed => {
                            if Box::pin(self.backoff(run, "the request was never sent")).await {
                                continue;
                            }
                            return Ok(Box::pin(self.definitive_failure(run, &e, e.reason())).await);
                        }
                        NovaErrorKind::DeadlineExceeded if !e.may_have_reached_nova => {
                            return Ok(Box::pin(self.definitive_failure(run, &e, e.reason())).await);
                        }
                        NovaErrorKind::Rejected(_) if !e.outcome_unknown() => {
                            return Ok(Box::pin(self.definitive_failure(run, &e, e.reason())).await);
                        }
                        _ => {
                            // Outcome unknown: look before deciding anything.
                            match Box::pin(self.observe(run, run.observe_by())).await {
                                Ok(Seen::Attached(a)) => {
                                    self.metrics.responses_recovered.inc();
                                    return Ok(Decision::succeeded(
                                        Resolution::Reobserved,
                                        Some(a),
                                        "response lost; the attachment was observed",
                                    ));
                                }
                                Ok(Seen::Absent) => {
                                    // It may still be in flight inside Nova: a
                                    // retry's duplicate is caught as "already
                                    // attached" and re-observed.
                                    if Box::pin(
                                        self.backoff(run, "outcome unknown and not observed"),
                                    )
                                    .await
                                    {
                                        continue;
                                    }
                                    return Ok(Decision::unknown(self.unknown_error(
                                        run,
                                        Some(&e),
                                        "the response was lost and the attachment was not observed in time",
                                    )));
                                }
                                Err(_) => {
                                    return Ok(Decision::unknown(self.unknown_error(
                                        run,
                                        Some(&e),
                                        "the response was lost and the observation failed",
                                    )));
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    async fn detach_flow(
        self: &Arc<Self>,
        run: &mut Run,
        first_sent: bool,
    ) -> Result<Decision, Fenced> {
        let mut need_record = !first_sent;
        loop {
            let now = Instant::now();
            if !self.policy.can_send_again(&run.budget, now) {
                return Ok(Box::pin(self.out_of_budget(run, None)).await);
            }
            let outbound = self.policy.outbound(&run.budget, now);
            if need_record {
                Box::pin(self.record_attempt(run, outbound)).await?;
            }
            need_record = true;
            self.metrics
                .nova_outbound_deadline
                .observe(outbound.saturating_duration_since(now).as_secs_f64());
            let started = Instant::now();
            let result = self
                .nova
                .detach(run.op.server_id, run.op.volume_id, outbound)
                .await;
            let watch_gone = match result {
                Ok(()) => {
                    self.metrics
                        .nova("detach", "accepted", started.elapsed().as_secs_f64());
                    run.maybe_sent = true;
                    run.events.push(
                        NewEvent::new(
                            event::RESPONSE,
                            "Nova answered 202: detach accepted; watching the attachment list",
                        )
                        .with("http_status", 202),
                    );
                    true
                }
                Err(e) => {
                    self.note_failure(run, "detach", &e);
                    if e.may_have_reached_nova {
                        run.maybe_sent = true;
                    }
                    match e.kind.clone() {
                        NovaErrorKind::Rejected(Rejection::NotAttached) => {
                            return Ok(Decision::succeeded(
                                Resolution::Reobserved,
                                None,
                                "Nova reports the volume is not attached",
                            ));
                        }
                        NovaErrorKind::Rejected(Rejection::Detaching) => true,
                        NovaErrorKind::Rejected(Rejection::Conflict | Rejection::Throttled) => {
                            if self
                                .backoff(run, "Nova reported a transient conflict")
                                .await
                            {
                                continue;
                            }
                            return Ok(
                                Box::pin(self.definitive_failure(run, &e, "NOVA_CONFLICT")).await
                            );
                        }
                        NovaErrorKind::ConnectFailed | NovaErrorKind::AuthFailed => {
                            if Box::pin(self.backoff(run, "the request was never sent")).await {
                                continue;
                            }
                            return Ok(Box::pin(self.definitive_failure(run, &e, e.reason())).await);
                        }
                        NovaErrorKind::DeadlineExceeded if !e.may_have_reached_nova => {
                            return Ok(Box::pin(self.definitive_failure(run, &e, e.reason())).await);
                        }
                        NovaErrorKind::Rejected(_) if !e.outcome_unknown() => {
                            return Ok(Box::pin(self.definitive_failure(run, &e, e.reason())).await);
                        }
                        _ => match Box::pin(self.observe(run, run.observe_by())).await {
                            Ok(Seen::Absent) => {
                                self.metrics.responses_recovered.inc();
                                return Ok(Decision::succeeded(
                                    Resolution::Reobserved,
                                    None,
                                    "response lost; the volume was observed detached",
                                ));
                            }
                            Ok(Seen::Attached(_)) => {
                                // Nova may be detaching it right now: watch a while before
                                // sending again (a duplicate is harmless, 400 "detaching",
                                // but needless).
                                let watch_until = run
                                    .budget
                                    .send_by
                                    .min(Instant::now() + Duration::from_secs(2));
                                if Box::pin(self.observe_until(run, false, watch_until))
                                    .await
                                    .is_some()
                                {
                                    self.metrics.responses_recovered.inc();
                                    return Ok(Decision::succeeded(
                                        Resolution::Reobserved,
                                        None,
                                        "response lost; the volume was observed detached",
                                    ));
                                }
                                if self
                                    .backoff(run, "outcome unknown and still attached")
                                    .await
                                {
                                    continue;
                                }
                                return Ok(Decision::unknown(self.unknown_error(
                                    run,
                                    Some(&e),
                                    "the response was lost and the volume is still listed",
                                )));
                            }
                            Err(_) => {
                                return Ok(Decision::unknown(self.unknown_error(
                                    run,
                                    Some(&e),
                                    "the response was lost and the observation failed",
                                )));
                            }
                        },
                    }
                }
            };
            if watch_gone {
                return Ok(match Box::pin(self.observe_until(run, false, run.observe_by())).await {
                    Some(_) => Decision::succeeded(Resolution::Reobserved, None, "detached (observed gone)"),
                    None => Decision::unknown(self.unknown_error(
                        run,
                        None,
                        "the detach was accepted but the volume was still listed at the deadline",
                    )),
                });
            }
        }
    }

    /// A refusal that means the request did not take effect. If an earlier
    /// attempt may have reached Nova, look first: that one may have worked.
    async fn definitive_failure(&self, run: &mut Run, e: &NovaError, reason: &str) -> Decision {
        if run.maybe_sent && run.op.attempts > 1 {
            match self
                .observe(
                    run,
                    run.budget
                        .answer_by
                        .max(Instant::now() + Duration::from_secs(1)),
                )
                .await
            {
                Ok(Seen::Attached(a)) if run.op.action == Action::Attach => {
                    self.metrics.responses_recovered.inc();
                    return Decision::succeeded(
                        Resolution::Reobserved,
                        Some(a),
                        "an earlier attempt took effect (observed)",
                    );
                }
                Ok(Seen::Absent) if run.op.action == Action::Detach => {
                    self.metrics.responses_recovered.inc();
                    return Decision::succeeded(
                        Resolution::Reobserved,
                        None,
                        "an earlier attempt took effect (observed)",
                    );
                }
                Ok(_) => {}
                Err(_) => {
                    return Decision::unknown(self.unknown_error(run, Some(e), "refused now, but an earlier attempt may have worked and the observation failed"));
                }
            }
        }
        let mut err = OperationError::new(
            reason,
            format!(
                "{}: {}",
                e.clock(),
                e.nova_message.clone().unwrap_or_else(|| e.cause.clone())
            ),
        )
        .with("operation_id", run.op.id);
        err.metadata.extend(e.metadata());
        Decision::failed(Resolution::Response, err)
    }

    /// No time left for another request: decide from one last look.
    async fn out_of_budget(&self, run: &mut Run, e: Option<&NovaError>) -> Decision {
        if !run.maybe_sent {
            let err = OperationError::new(
                "BUDGET_EXHAUSTED",
                "the deadline came before any request could be sent",
            )
            .with("operation_id", run.op.id);
            return Decision::failed(Resolution::Response, err);
        }
        let want_attached = run.op.action == Action::Attach;
        match self.observe(run, run.observe_by()).await {
            Ok(Seen::Attached(a)) if want_attached => {
                Decision::succeeded(Resolution::Reobserved, Some(a), "attached (observed)")
            }
            Ok(Seen::Absent) if !want_attached => {
                Decision::succeeded(Resolution::Reobserved, None, "detached (observed)")
            }
            _ => Decision::unknown(self.unknown_error(
                run,
                e,
                "no time left to send again and the effect was not observed",
            )),
        }
    }

    /// The deadline an operation's own work runs under (for reconciler
    /// passes that re-send).
    pub fn budget_from_row(&self, op: &Operation) -> Option<Budget> {
        let deadline = monotonic(op.deadline_at);
        let now = Instant::now();
        if deadline <= now {
            return None;
        }
        // The row's deadline is already the answer-by instant: no margin.
        let reserve = self.policy.reserve_for(deadline - now);
        let send_by = deadline.checked_sub(reserve).unwrap_or(now);
        if send_by.saturating_duration_since(now) < self.policy.min_budget {
            return None;
        }
        Some(Budget {
            answer_by: deadline,
            send_by,
            margin: Duration::ZERO,
            reserve,
        })
    }
}

/// Another writer decided first (lease epoch moved on): here is the row.
pub(crate) struct Fenced(pub Operation);

fn request_sent_event(action: Action, attempt: i32, outbound: Instant, now: Instant) -> NewEvent {
    NewEvent::new(
        event::REQUEST_SENT,
        format!(
            "{} request #{attempt} with an outbound deadline of {} ms",
            match action {
                Action::Attach => "POST attach",
                Action::Detach => "DELETE detach",
            },
            outbound.saturating_duration_since(now).as_millis()
        ),
    )
    .with("attempt", attempt)
    .with(
        "outbound_deadline_ms",
        outbound.saturating_duration_since(now).as_millis(),
    )
}

#[cfg(test)]
mod size_probe {
    //! Tens of thousands of these futures wait at once (10k attaches in
    //! flight behind the per-host cap): keep them small. Cold paths are
    //! boxed so a waiting future holds only what it is waiting on.
    #[tokio::test]
    async fn futures_that_wait_in_large_numbers_stay_small() {
        use super::*;
        let nova = Arc::new(crate::nova::NovaClient::new(
            crate::nova::NovaConfig::default(),
        ));
        let params = RequestParams::default();
        let f = nova.attach(Uuid::nil(), Uuid::nil(), &params, Instant::now());
        assert!(
            std::mem::size_of_val(&f) <= 1024,
            "nova.attach: {}",
            std::mem::size_of_val(&f)
        );
        drop(f);
        let f = nova.list(Uuid::nil(), Instant::now());
        assert!(
            std::mem::size_of_val(&f) <= 1024,
            "nova.list: {}",
            std::mem::size_of_val(&f)
        );
        drop(f);
        let store: Arc<dyn Store> = Arc::new(
            crate::store::SqliteStore::connect("sqlite::memory:")
                .await
                .unwrap(),
        );
        let exec = Executor::new(
            store,
            nova,
            BudgetPolicy::default(),
            "r".into(),
            ExecSettings::default(),
            Arc::new(Metrics::new()),
        );
        let req = OpRequest {
            action: Action::Attach,
            idempotency_key: "k".into(),
            server_id: Uuid::nil(),
            volume_id: Uuid::nil(),
            params,
            caller: None,
        };
        let f = exec.submit(req.clone(), Deadline::none());
        // The start is boxed: what stays is the wait for the result.
        assert!(
            std::mem::size_of_val(&f) <= 768,
            "submit: {}",
            std::mem::size_of_val(&f)
        );
        drop(f);
        let op = Operation {
            id: Uuid::nil(),
            idempotency_key: "k".into(),
            action: Action::Attach,
            state: State::InProgress,
            resolution: None,
            server_id: Uuid::nil(),
            volume_id: Uuid::nil(),
            params: RequestParams::default(),
            attachment: None,
            attempts: 1,
            last_error: None,
            deadline_at: Utc::now(),
            last_request_at: None,
            created_at: Utc::now(),
            updated_at: Utc::now(),
            completed_at: None,
            lease_owner: None,
            lease_expires_at: None,
            lease_epoch: 1,
            caller: None,
            drifted: false,
            passes: 0,
        };
        let budget = BudgetPolicy::default()
            .plan(Instant::now(), Instant::now() + Duration::from_secs(10))
            .unwrap();
        let f = exec.drive(Run::new(op, budget, false), true);
        assert!(
            std::mem::size_of_val(&f) <= 2048,
            "drive: {}",
            std::mem::size_of_val(&f)
        );
        drop(f);
        let api = crate::grpc::Api {
            exec: exec.clone(),
            reconciler: crate::reconciler::Reconciler::new(exec.clone(), Default::default()),
            metrics: Arc::new(Metrics::new()),
            watch_idle: Duration::from_secs(1),
        };
        use crate::grpc::pb::volume_reconciler_server::VolumeReconciler;
        let f = api.attach_volume(tonic::Request::new(crate::grpc::pb::AttachVolumeRequest {
            idempotency_key: "k".into(),
            server_id: Uuid::from_u128(1).to_string(),
            volume_id: Uuid::from_u128(2).to_string(),
            ..Default::default()
        }));
        // The handler parses the request before making its future.
        assert!(
            std::mem::size_of_val(&*f) <= 1280,
            "attach_volume handler: {}",
            std::mem::size_of_val(&*f)
        );
        drop(f);
    }
}
