//! Runs one operation: records the intent, calls Nova in a task the service
//! owns (the RPC future can be dropped), classifies the answer, re-observes
//! when the answer was lost or ambiguous, and records the true outcome.
//!
//! Rules (see README "Budgets"): a timeout means "unknown", not "failed";
//! only an observation of Nova's state finalizes an operation whose request
//! may have arrived; every wait is bounded by the operation's deadline.
//!
//! - `mod.rs`: the owned tasks: submit, start, await, join, drive.
//! - `run.rs`: a run's state and the decision it ends with.
//! - `classify.rs`: what each of Nova's answers means (pure; README's table).
//! - `flow.rs`: the one send loop for attach and detach.
//! - `observe.rs`: looking at the server's attachments.
//! - `ledger.rs`: the executor's writes to the ledger.

mod classify;
mod flow;
mod ledger;
mod observe;
mod run;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use uuid::Uuid;

use crate::domain::deadline::BudgetTooSmall;
use crate::domain::{
    Action, Budget, BudgetPolicy, Clock, Deadline, IdempotencyKey, NewEvent, Operation,
    RequestParams, State, event, request_fingerprint,
};
use crate::metrics::Metrics;
use crate::nova::NovaClient;
use crate::store::{CreateOutcome, NewOperation, Store, StoreError};

pub(crate) use run::{Decision, Run};

/// A validated request.
#[derive(Debug, Clone)]
pub struct OpRequest {
    pub action: Action,
    pub idempotency_key: IdempotencyKey,
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
    /// This replica's wall clock (the timestamps it writes).
    pub clock: Clock,
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
        clock: Clock::SYSTEM,
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
    /// This replica's wall clock (ledger timestamps it writes).
    pub clock: Clock,
    inflight: Mutex<HashMap<Uuid, watch::Receiver<Option<Operation>>>>,
    tasks: tokio_util::task::TaskTracker,
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
            clock: settings.clock,
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
        let new = self.intent(&req, deadline, &budget, now);
        let write_started = Instant::now();
        let created = self.store.operation_create(new, budget.answer_by).await;
        self.metrics.ledger(
            "intent",
            if created.is_ok() { "ok" } else { "error" },
            write_started.elapsed().as_secs_f64(),
        );
        let op = match created? {
            CreateOutcome::Created(op) => op,
            CreateOutcome::Existing(op) => {
                tracing::Span::current().record("operation_id", tracing::field::display(op.id));
                tracing::info!(operation_id = %op.id, state = op.state.as_str(), "idempotency key replayed; joining the operation");
                if op.state.is_terminal() || op.state == State::Unknown {
                    return Ok(Started::Settled(Box::new(op)));
                }
                return Ok(Started::Joined {
                    id: op.id,
                    until: budget.answer_by,
                });
            }
        };
        tracing::Span::current().record("operation_id", tracing::field::display(op.id));
        let (tx, rx) = watch::channel(None);
        let op_id = op.id;
        self.inflight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(op_id, rx.clone());
        let this = self.clone();
        self.tasks.spawn(async move {
            let done = this.drive(Run::new(op, budget, false), true).await;
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

    /// The intent row of a new operation: in progress, its first request
    /// counted, leased to this replica.
    fn intent(
        &self,
        req: &OpRequest,
        deadline: Deadline,
        budget: &Budget,
        now: Instant,
    ) -> NewOperation {
        let outbound = self.policy.outbound(budget, now);
        let deadline_at = self.clock.wall_of(budget.answer_by);
        let recorded = NewEvent::new(event::RECORDED, format!("{} recorded", req.action.as_str()))
            .with("idempotency_key", req.idempotency_key.as_str())
            .with("caller_deadline_ms", deadline.remaining().as_millis())
            .with("deadline_from_caller", deadline.from_caller)
            .with("caller", req.caller.as_deref().unwrap_or("-"))
            .with(
                "answer_by_ms",
                budget.answer_by.saturating_duration_since(now).as_millis(),
            );
        let id = Uuid::now_v7();
        NewOperation {
            id,
            fingerprint: request_fingerprint(req.action, req.server_id, req.volume_id, &req.params),
            idempotency_key: req.idempotency_key.as_str().to_string(),
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
                recorded,
                ledger::request_sent_event(id, req.action, 1, outbound, now),
            ],
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
        if first_sent {
            // The intent counted the first request, which has not left yet.
            run.maybe_sent = run.op.attempts > 1;
        }
        // Boxed: a task waiting inside the loop holds only the loop's state.
        let decision = match Box::pin(self.send_loop(&mut run, first_sent)).await {
            Ok(d) => d,
            // Fenced out: another replica or an operator decided meanwhile.
            Err(run::Fenced(current)) => return current,
        };
        Box::pin(self.record(&mut run, decision)).await
    }

    /// The budget a reconciler pass that re-sends works under: what is left
    /// of the operation's own deadline.
    pub fn budget_from_row(&self, op: &Operation) -> Option<Budget> {
        Budget::from_row(&self.policy, &self.clock, op.deadline_at)
    }
}

#[cfg(test)]
mod size_probe {
    //! Tens of thousands of these futures wait at once (10k attaches in
    //! flight behind the per-host cap): keep them small. Cold paths are
    //! boxed so a waiting future holds only what it is waiting on.
    use super::*;

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
            Arc::new(Metrics::new()),
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
        let req = OpRequest {
            action: Action::Attach,
            idempotency_key: IdempotencyKey::parse("k").unwrap(),
            server_id: Uuid::nil(),
            volume_id: Uuid::nil(),
            params: RequestParams::default(),
            caller: None,
        };
        // The start is boxed: what stays is the wait for the result.
        assert_small("submit", &exec.submit(req, Deadline::none()), 768);
        let now = chrono::Utc::now();
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
            deadline_at: now,
            last_request_at: None,
            created_at: now,
            updated_at: now,
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
        assert_small(
            "drive",
            &exec.drive(Run::new(op, budget, false), true),
            2048,
        );
    }
}
