//! Runs one operation: records the intent, calls Nova in a task the service
//! owns (the RPC future can be dropped), classifies the answer, re-observes
//! when the answer was lost or ambiguous, and records the true outcome.
//!
//! Rules (see docs/design.md, "Budgets"): a timeout means "unknown", not "failed";
//! only an observation of Nova's state finalizes an operation whose request
//! may have arrived; every wait is bounded by the operation's deadline, and
//! every ledger read a waiting caller makes by the caller's time.
//!
//! This file is the executor's public face: its request, settings and
//! errors, and the `Executor` whose fields no other room reaches (the
//! reconciler is given its own store, Nova client and settings). Its work
//! is split by role, each in its own file:
//!
//! - `caller.rs`: the caller's side: submit, replay, join, and its waits,
//!   every one (ledger reads included) bounded by the caller's time.
//! - `task.rs`: the operation's task: the intent, the run to a decision,
//!   the answer; the tasks and runs of this replica.
//! - `lease.rs`: lease keeping: the heartbeat, holds handed to reconciler
//!   passes, leases found lost.
//!   - `holds.rs`: the leases this replica holds.
//!   - `gate.rs`: the send gate: a request leaves only while its lease holds.
//! - `ledger.rs`: deciding and recording: the executor's writes to the
//!   ledger.
//! - `run.rs`: a run's state and the decision it ends with.
//! - `flow.rs`: the one send loop for attach and detach.
//! - `classify.rs`: what each of Nova's answers means (pure; docs/design.md's table).
//! - `observe.rs`: looking at the server's attachments.
//! - `confirm.rs`: Cinder's word before the first request and after a
//!   success (cinder-csi's checks).
//! - `metrics.rs`: the executor's metric families.

mod caller;
mod classify;
mod confirm;
mod flow;
mod gate;
pub mod holds;
mod lease;
mod ledger;
pub mod metrics;
mod observe;
mod run;
mod task;

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use uuid::Uuid;

use crate::domain::deadline::BudgetTooSmall;
use crate::domain::{Action, Budget, BudgetPolicy, Clock, OpKey, RequestParams, TraceContext};
use crate::nova::NovaClient;
use crate::store::{Store, StoreError};
use metrics::ExecutorMetrics;

pub(crate) use confirm::{CinderSays, DETACH_TARGET};
pub(crate) use run::{Decision, Run, Seen};

/// A validated request.
#[derive(Debug)]
pub struct OpRequest {
    pub action: Action,
    /// Who asks, and what the operation is known by: a caller's key, or
    /// (an Ensure call) the identity alone.
    pub key: OpKey,
    pub server_id: Uuid,
    pub volume_id: Uuid,
    pub params: RequestParams,
    /// Its caller's labels, checked (part of the request).
    pub labels: crate::domain::Labels,
    /// The caller's trace (or one begun for the request), with this
    /// service's span: the operation's requests and log lines carry it.
    pub trace: TraceContext,
    /// The request's place under the in-flight cap (the gRPC layer's,
    /// `--max-inflight-mutations`): the operation's task holds it until it
    /// ends, however early its caller leaves; a replay that joins an
    /// operation already running gives it back at once.
    pub inflight: Option<InFlight>,
}

/// An operation's places while its task runs: under the in-flight cap
/// (`--max-inflight-mutations`), and under its caller's row of the caller
/// table when that row caps its operations in flight. Held, then dropped
/// with the task.
///
/// Boxed: every operation task holds one while it runs (tens of
/// thousands at once), a pointer's room.
#[derive(Debug)]
pub struct InFlight(
    #[allow(dead_code, reason = "held for its drop")]
    Box<(
        tokio::sync::OwnedSemaphorePermit,
        Option<tokio::sync::OwnedSemaphorePermit>,
    )>,
);

impl InFlight {
    pub fn new(
        all: tokio::sync::OwnedSemaphorePermit,
        caller: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Self {
        Self(Box::new((all, caller)))
    }
}

/// A request leaves only this long before its lease is known to end, at
/// the latest: room for the request's way out between the send gate and
/// the wire (the gate is asked again once a connection made for it is
/// ready).
pub const SEND_MARGIN: Duration = Duration::from_millis(500);

/// The shortest lease a holder keeps through every round trip the store
/// calls healthy (each up to `round_trip`, the store's bound), renewing
/// every `heartbeat`: `2 × round_trip + heartbeat + SEND_MARGIN`.
///
/// A renewal sent at *t* holds the lease until *t* + lease (the database
/// sets the expiry after the statement left). The heartbeat sends the
/// next renewal `heartbeat` after the last one ended, so one answered at
/// the latest (`round_trip` after it left) is followed by another sent
/// `heartbeat` later and answered up to `round_trip` after that: the
/// lease must last that long and still leave the send gate its margin.
/// The intent's own lease, set as its write runs, is confirmed from when
/// the write left: a write answered `round_trip` later leaves the first
/// request a whole `round_trip + heartbeat` to go. Shorter, a latency the
/// store calls healthy would close the send gate on every new operation
/// (`FAILED NOT_SENT`, its key spent, Nova untouched), or let another
/// replica take over an intent whose acknowledgement was merely slow.
pub const fn min_lease(round_trip: Duration, heartbeat: Duration) -> Duration {
    round_trip
        .saturating_mul(2)
        .saturating_add(heartbeat)
        .saturating_add(SEND_MARGIN)
}

#[derive(Debug, Clone)]
pub struct ExecSettings {
    /// How long an operation's lease lasts without renewal: a holder that
    /// dies (kill -9, a lost network) is taken over this long after its
    /// last heartbeat. Measured on the database's clock. At least
    /// [`min_lease`] of the store's round-trip bound and the heartbeat.
    pub lease: Duration,
    /// How often a live holder renews its leases (at most a third of the
    /// lease, so one late heartbeat never loses one).
    pub heartbeat: Duration,
    /// Extra time the task may use to write an outcome that arrived at the
    /// last moment (the write is bounded, never open-ended).
    pub record_grace: Duration,
    /// First and largest pause between observations while waiting for an
    /// accepted (202) request to show.
    pub observe_interval: Duration,
    pub observe_interval_max: Duration,
    /// When a decided operation is observed once more for late effects.
    pub verify_after: Duration,
    /// This replica's wall clock (nothing that decides anything reads it:
    /// leases, deadlines and backoffs are the database's).
    pub clock: Clock,
}

impl ExecSettings {
    /// The built-in defaults: the one source of the flags' defaults too
    /// (`config/serve.rs` refers to these; a test checks they agree).
    pub const DEFAULT: Self = Self {
        // 11.5 s: the default round-trip bound (5 s) twice, a heartbeat
        // and the send margin.
        lease: min_lease(
            crate::store::pg::Bounds::DEFAULT.round_trip,
            Duration::from_secs(1),
        ),
        heartbeat: Duration::from_secs(1),
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
    /// The operation's task ended without an answer (it panicked).
    #[error("the task running the operation ended without an answer")]
    TaskLost,
}

/// A waiting caller's time. It is answered by `answer_by`; every ledger
/// read made for it ends by `read_by`, which leaves the one read made at
/// `answer_by` (the operation as it stands then) a slice of the margin:
/// a quarter of it, before the deadline layer answers for the handler
/// (half the margin before the caller's deadline).
#[derive(Debug, Clone, Copy)]
pub struct CallerTime {
    pub answer_by: Instant,
    pub read_by: Instant,
}

impl CallerTime {
    /// The time of a caller whose work runs under `budget`.
    pub fn of(budget: &Budget) -> Self {
        Self {
            answer_by: budget.answer_by,
            read_by: budget.answer_by + budget.margin / 4,
        }
    }
}

/// The executor of one replica. Its fields are its own: the files of
/// this module share them (each role keeps its state in a type of its
/// own: `task::Tasks`, `task::Runs`, `holds::Holds`); other rooms use its
/// methods.
pub struct Executor {
    store: Arc<dyn Store>,
    nova: Arc<NovaClient>,
    policy: BudgetPolicy,
    replica: String,
    settings: ExecSettings,
    metrics: Arc<ExecutorMetrics>,
    /// The operations running here, with their decisions' receivers.
    runs: task::Runs,
    holds: holds::Holds,
    /// The operation tasks, and what stops those still running at the end
    /// of a shutdown.
    tasks: task::Tasks,
    /// Failed Nova requests and looks, summed up in one warn line per kind
    /// per interval (written by the task `startup` runs).
    failures: Arc<crate::telemetry::summary::Summaries>,
    /// The caller table (`--caller-quotas`): whose share of Nova's slots
    /// an operation's requests count against (set once, at start).
    quotas: std::sync::OnceLock<Arc<crate::domain::quota::CallerQuotas>>,
}

impl Executor {
    pub fn new(
        store: Arc<dyn Store>,
        nova: Arc<NovaClient>,
        policy: BudgetPolicy,
        replica: String,
        settings: ExecSettings,
        metrics: Arc<ExecutorMetrics>,
    ) -> Arc<Self> {
        Arc::new(Self {
            store,
            nova,
            policy,
            replica,
            settings,
            metrics,
            runs: task::Runs::default(),
            holds: holds::Holds::default(),
            tasks: task::Tasks::default(),
            failures: Arc::default(),
            quotas: std::sync::OnceLock::new(),
        })
    }

    /// The caller table, and each row's weight in Nova's request slots
    /// (set once, at start, before anything is sent).
    pub fn set_quotas(&self, quotas: Arc<crate::domain::quota::CallerQuotas>) {
        self.nova.set_shares(quotas.nova_shares());
        if self.quotas.set(quotas).is_err() {
            tracing::debug!("the caller table was set already; kept the first");
        }
    }

    /// The caller table (empty until set).
    pub fn quotas(&self) -> Arc<crate::domain::quota::CallerQuotas> {
        self.quotas.get().cloned().unwrap_or_default()
    }

    /// The caller row an operation of `caller` counts against.
    pub(crate) fn row_of(&self, caller: Option<&str>) -> Option<usize> {
        self.quotas.get().map(|q| q.row_of(caller.unwrap_or("")))
    }

    /// This replica's name (the lease owner it writes).
    pub fn replica(&self) -> &str {
        &self.replica
    }

    /// The executor's metric families (the admin endpoint sets the leases
    /// held before a scrape; the demo reads the decisions it counted).
    pub fn metrics(&self) -> &Arc<ExecutorMetrics> {
        &self.metrics
    }

    /// The failure summaries this executor notes into (its reconciler's
    /// too); `startup` runs their warn lines.
    pub fn failures(&self) -> &Arc<crate::telemetry::summary::Summaries> {
        &self.failures
    }

    /// The Nova microversion this executor's requests carry.
    pub fn nova_microversion(&self) -> String {
        self.nova.microversion()
    }
}

/// A caller's attach of `volume` to `server` with key "k", for tests that
/// need an operation as `submit` would make it (`intent`, then
/// `recorded_as`): no hand-written row to keep in step with the domain.
#[cfg(test)]
pub(crate) fn test_request(server_id: Uuid, volume_id: Uuid) -> OpRequest {
    OpRequest {
        action: Action::Attach,
        key: crate::domain::CallerKey::parse(None, "k").unwrap().into(),
        server_id,
        volume_id,
        params: RequestParams::default(),
        labels: crate::domain::Labels::none(),
        trace: TraceContext::start(),
        inflight: None,
    }
}
