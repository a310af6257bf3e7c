//! The background reconciler, in every `serve` replica. It leases open
//! operations nobody holds (`FOR UPDATE SKIP LOCKED`, a lease naming the
//! replica, a new epoch per lease), re-observes Nova and decides; every
//! decision is written under the epoch it was taken with, so a late writer
//! can never overwrite a newer decision. It also re-observes decided
//! operations once within a verification window to catch late effects.
//!
//! `run_once()` does one round and returns counts; `run()` is a thin loop
//! around it on a shutdown token (rule 9).

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use backon::BackoffBuilder as _;

use crate::domain::{
    Action, Budget, NewEvent, Operation, OperationError, Reason, Resolution, State, event,
};
use crate::executor::{Decision, Executor, Run};
use crate::store::{StoreError, Transition};

#[derive(Debug, Clone)]
pub struct ReconcilerSettings {
    /// Pause between rounds when there was nothing to do.
    pub interval: Duration,
    /// Operations leased per round.
    pub batch: u32,
    /// How long a lease lasts: a pass must finish within it.
    pub lease: Duration,
    /// Nova may still be processing a request this long after it was sent:
    /// "not found" means nothing before then.
    pub settle_window: Duration,
    /// Global cap on the reconciler's Nova requests per second, so an
    /// outage does not turn into a hammering.
    pub rate_limit: f64,
    /// Passes run concurrently.
    pub parallelism: usize,
    /// Decided operations are re-observed once within this window.
    pub verify_window: Duration,
    /// Bound of one observation.
    pub observe_timeout: Duration,
    /// Longest per-operation backoff.
    pub max_backoff: Duration,
}

impl ReconcilerSettings {
    /// The built-in defaults: the one source of the flags' defaults too
    /// (`config.rs` refers to these; a test checks they agree).
    pub const DEFAULT: Self = Self {
        interval: Duration::from_secs(1),
        batch: 256,
        lease: Duration::from_secs(60),
        settle_window: Duration::from_secs(120),
        rate_limit: 200.0,
        parallelism: 32,
        verify_window: Duration::from_secs(600),
        observe_timeout: Duration::from_secs(10),
        max_backoff: Duration::from_secs(60),
    };
}

impl Default for ReconcilerSettings {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// What one round did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoundCounts {
    pub claimed: usize,
    pub succeeded: usize,
    pub failed: usize,
    pub deferred: usize,
    pub verified: usize,
    pub drifted: usize,
}

/// The rate limit shared by every pass of this replica: `rate` Nova
/// requests per second, in bursts of up to `rate` (at most 10 at start).
pub struct RateLimiter {
    inner: governor::DefaultDirectRateLimiter,
}

impl RateLimiter {
    pub fn new(rate: f64) -> Self {
        let rate = rate.max(0.1);
        // GCRA: one request per `1 / rate` seconds, bursts of `burst`.
        let period = Duration::from_secs_f64(1.0 / rate);
        let burst = std::num::NonZeroU32::new(rate.clamp(1.0, 10.0) as u32)
            .unwrap_or(std::num::NonZeroU32::MIN);
        let quota = governor::Quota::with_period(period)
            .unwrap_or_else(|| governor::Quota::per_second(std::num::NonZeroU32::MIN))
            .allow_burst(burst);
        Self {
            inner: governor::RateLimiter::direct(quota),
        }
    }

    /// Waits for a token.
    pub async fn acquire(&self) {
        self.inner.until_ready().await;
    }
}

/// What listing a server's attachments gave.
type Observation = Result<Vec<crate::nova::NovaAttachment>, crate::nova::NovaError>;

fn group_by_server(ops: Vec<Operation>) -> Vec<(Uuid, Vec<Operation>)> {
    let mut groups: std::collections::HashMap<Uuid, Vec<Operation>> =
        std::collections::HashMap::new();
    for op in ops {
        groups.entry(op.server_id).or_default().push(op);
    }
    groups.into_iter().collect()
}

/// The outcome class of one pass, for counts and metrics.
enum PassResult {
    Decided(State),
    Deferred,
}

pub struct Reconciler {
    exec: Arc<Executor>,
    pub settings: ReconcilerSettings,
    limiter: RateLimiter,
}

impl Reconciler {
    pub fn new(exec: Arc<Executor>, settings: ReconcilerSettings) -> Arc<Self> {
        Arc::new(Self {
            limiter: RateLimiter::new(settings.rate_limit),
            exec,
            settings,
        })
    }

    /// Rounds until `shutdown`.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            let counts = match self.run_once().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "reconciler round failed");
                    RoundCounts::default()
                }
            };
            let busy = counts.claimed > 0 || counts.verified > 0;
            if counts.claimed > 0 {
                tracing::info!(
                    claimed = counts.claimed,
                    succeeded = counts.succeeded,
                    failed = counts.failed,
                    deferred = counts.deferred,
                    "reconciler round"
                );
            }
            let pause = if busy {
                Duration::ZERO
            } else {
                self.settings.interval
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// One round: lease a batch, pass over each, then verify decided ones.
    pub async fn run_once(self: &Arc<Self>) -> Result<RoundCounts, StoreError> {
        let store = &self.exec.store;
        let claimed = store
            .operation_claim(&self.exec.replica, self.settings.lease, self.settings.batch)
            .await?;
        let mut counts = RoundCounts {
            claimed: claimed.len(),
            ..Default::default()
        };
        // One observation per server per round, shared by its operations.
        let results: Vec<PassResult> = futures_util::stream::iter(group_by_server(claimed))
            .map(|(server, ops)| {
                let this = self.clone();
                async move {
                    let seen = this.observe_server(server).await;
                    futures_util::future::join_all(
                        ops.into_iter().map(|op| this.pass_with(op, &seen)),
                    )
                    .await
                }
            })
            .buffer_unordered(self.settings.parallelism.max(1))
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .flatten()
            .collect();
        for r in results {
            match r {
                PassResult::Decided(State::Succeeded) => counts.succeeded += 1,
                PassResult::Decided(State::Failed) => counts.failed += 1,
                PassResult::Decided(_) | PassResult::Deferred => counts.deferred += 1,
            }
        }
        let due = store
            .operation_claim_verification(self.settings.batch)
            .await?;
        let verified: Vec<bool> = futures_util::stream::iter(group_by_server(due))
            .map(|(server, ops)| {
                let this = self.clone();
                async move {
                    let seen = this.observe_server(server).await;
                    futures_util::future::join_all(
                        ops.into_iter().map(|op| this.verify_with(op, &seen)),
                    )
                    .await
                }
            })
            .buffer_unordered(self.settings.parallelism.max(1))
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .flatten()
            .collect();
        counts.verified = verified.len();
        counts.drifted = verified.iter().filter(|d| **d).count();
        Ok(counts)
    }

    /// `ReconcileOperation`: one pass now over one operation.
    pub async fn reconcile_now(self: &Arc<Self>, id: Uuid) -> Result<Operation, StoreError> {
        let store = &self.exec.store;
        match store
            .operation_claim_one(id, &self.exec.replica, self.settings.lease)
            .await?
        {
            Some(op) => {
                self.pass(op).await;
                store
                    .operation_get(id)
                    .await?
                    .ok_or(StoreError::NotFound(id))
            }
            None => {
                let op = store
                    .operation_get(id)
                    .await?
                    .ok_or(StoreError::NotFound(id))?;
                if op.state.is_terminal() {
                    // Decided already: observe once more and report drift.
                    self.verify(op).await;
                }
                store
                    .operation_get(id)
                    .await?
                    .ok_or(StoreError::NotFound(id))
            }
        }
    }

    /// The pause before an operation's next pass: exponential in its
    /// passes so far, from 250 ms to half of `max_backoff`, each with up to
    /// as much again of jitter.
    fn backoff(&self, op: &Operation) -> Duration {
        let step = op.passes.clamp(1, 16) as usize - 1;
        backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(250))
            .with_max_delay(self.settings.max_backoff / 2)
            .with_factor(2.0)
            .with_jitter()
            .without_max_times()
            .build()
            .nth(step)
            .unwrap_or(self.settings.max_backoff)
    }

    /// Leaves the operation for a later pass (lease released, backoff set).
    async fn defer(
        &self,
        op: &Operation,
        state: State,
        until: chrono::DateTime<chrono::Utc>,
        events: Vec<NewEvent>,
    ) -> PassResult {
        let mut t = Transition::new(op, state, &self.exec.replica);
        t.release_lease = true;
        t.next_attempt_at = Some(until);
        t.events = events;
        self.exec.metrics.decision("deferred");
        if let Err(e) = self
            .exec
            .store
            .operation_transition(t, Instant::now() + self.settings.observe_timeout)
            .await
        {
            // The lease expires by itself; the next round takes it again.
            tracing::warn!(operation_id = %op.id, error = %e, "could not record a deferral");
        }
        PassResult::Deferred
    }

    /// Lists a server's attachments under the global rate limit.
    async fn observe_server(&self, server: Uuid) -> Observation {
        self.limiter.acquire().await;
        let started = Instant::now();
        let until = started + self.settings.observe_timeout;
        let listed = self.exec.nova.list(server, until).await;
        match &listed {
            Ok(_) => self
                .exec
                .metrics
                .nova("list", "ok", started.elapsed().as_secs_f64()),
            Err(e) => self
                .exec
                .metrics
                .nova("list", e.kind.as_str(), e.elapsed.as_secs_f64()),
        }
        listed
    }

    async fn pass(self: &Arc<Self>, op: Operation) -> PassResult {
        let seen = self.observe_server(op.server_id).await;
        self.pass_with(op, &seen).await
    }

    #[tracing::instrument(name = "reconcile operation", skip_all, fields(operation_id = %op.id, action = op.action.as_str()))]
    async fn pass_with(self: &Arc<Self>, op: Operation, listed: &Observation) -> PassResult {
        self.exec.metrics.reconciler_passes.inc();
        let until = Instant::now() + self.settings.observe_timeout;
        let present = match listed {
            Ok(items) => {
                let v = op.volume_id.to_string();
                items
                    .iter()
                    .find(|a| a.volume_id == v)
                    .map(|a| a.to_info())
                    .ok_or(())
            }
            Err(e) => {
                let next = self.exec.clock.now()
                    + chrono::Duration::from_std(self.backoff(&op)).unwrap_or_default();
                let state = if op.state == State::Pending {
                    State::Pending
                } else {
                    State::Unknown
                };
                let ev = NewEvent::new(
                    event::OBSERVED,
                    format!("observation failed: {}; backing off", e.clock()),
                )
                .with("reason", e.reason())
                .with("next_attempt_at", next.to_rfc3339())
                .with_all(&e.metadata());
                return self.defer(&op, state, next, vec![ev]).await;
            }
        };
        let observed = NewEvent::new(
            event::OBSERVED,
            if present.is_ok() {
                "reconciler: the volume is in the server's attachment list"
            } else {
                "reconciler: the volume is not in the server's attachment list"
            },
        )
        .with("present", present.is_ok());
        let mut run = Run::new(op.clone(), Budget::observe_only(until), true);
        run.events.push(observed);
        match (op.action, present) {
            (Action::Attach, Ok(att)) => {
                self.exec.metrics.decision("succeeded");
                let d = Decision::succeeded(
                    Resolution::Reconciler,
                    Some(att),
                    "attachment observed by the reconciler",
                );
                return PassResult::Decided(self.exec.record(&mut run, d).await.state);
            }
            (Action::Detach, Err(())) if op.state != State::Pending => {
                self.exec.metrics.decision("succeeded");
                let d = Decision::succeeded(
                    Resolution::Reconciler,
                    None,
                    "volume observed detached by the reconciler",
                );
                return PassResult::Decided(self.exec.record(&mut run, d).await.state);
            }
            _ => {}
        }
        // Not observed. A request sent recently may still be in Nova.
        if op.state != State::Pending
            && let Some(sent) = op.last_request_at
        {
            let settle =
                sent + chrono::Duration::from_std(self.settings.settle_window).unwrap_or_default();
            if settle > self.exec.clock.now() {
                let ev = NewEvent::new(
                    event::RETRY_SCHEDULED,
                    "not observed yet; waiting for the settle window",
                )
                .with("settle_until", settle.to_rfc3339());
                let mut events = std::mem::take(&mut run.events);
                events.push(ev);
                return self.defer(&op, State::Unknown, settle, events).await;
            }
        }
        // Settled (or never sent): re-send within the operation's own
        // deadline, else it did not happen.
        match self.exec.budget_from_row(&op) {
            Some(budget) => {
                self.exec.metrics.decision("resent");
                let mut run2 = Run::new(op, budget, true);
                run2.events = std::mem::take(&mut run.events);
                run2.events.push(NewEvent::new(
                    event::RETRY_SCHEDULED,
                    "reconciler re-sends the request within the operation's deadline",
                ));
                let done = self.exec.drive(run2, false).await;
                if done.state.is_terminal() {
                    PassResult::Decided(done.state)
                } else {
                    PassResult::Deferred
                }
            }
            None => {
                self.exec.metrics.decision("failed");
                let reason = if op.state == State::Pending {
                    Reason::NotSent
                } else {
                    Reason::NotObserved
                };
                let err = OperationError::new(
                    reason,
                    match op.action {
                        Action::Attach => {
                            "the attachment never appeared and the operation's deadline has passed"
                        }
                        Action::Detach => {
                            "the volume is still attached and the operation's deadline has passed"
                        }
                    },
                )
                .with("operation_id", op.id)
                .with("attempts", op.attempts);
                let d = Decision::failed(Resolution::Reconciler, err);
                PassResult::Decided(self.exec.record(&mut run, d).await.state)
            }
        }
    }

    /// Re-observes a decided operation; true when it drifted.
    async fn verify(&self, op: Operation) -> bool {
        let seen = self.observe_server(op.server_id).await;
        self.verify_with(op, &seen).await
    }

    async fn verify_with(&self, op: Operation, listed: &Observation) -> bool {
        let window = chrono::Duration::from_std(self.settings.verify_window).unwrap_or_default();
        if op
            .completed_at
            .is_some_and(|c| c + window < self.exec.clock.now())
        {
            // Counted, so an operator sees the verifier falling behind.
            self.exec.metrics.verification_missed.inc();
            return false;
        }
        let present = match listed {
            Ok(items) => items
                .iter()
                .any(|a| a.volume_id == op.volume_id.to_string()),
            Err(e) => {
                tracing::warn!(operation_id = %op.id, error = %e, "verification observation failed");
                return false;
            }
        };
        let expected_present = match (op.action, op.state) {
            (Action::Attach, State::Succeeded) => true,
            (Action::Attach, _) => false,
            (Action::Detach, State::Succeeded) => false,
            (Action::Detach, _) => true,
        };
        let store = &self.exec.store;
        if present == expected_present {
            let ev = NewEvent::new(
                event::VERIFIED,
                "a later observation agrees with the decision",
            )
            .with("present", present);
            if let Err(e) = store
                .operation_append_events(op.id, &self.exec.replica, vec![ev])
                .await
            {
                tracing::warn!(operation_id = %op.id, error = %e, "could not record a verification");
            }
            return false;
        }
        self.exec.metrics.drift_detected.inc();
        let detail = format!(
            "decided {} but the volume is {} the server's attachment list (late effect); not acting on it: that is the orchestrator's call",
            op.state.as_str(),
            if present { "in" } else { "not in" }
        );
        tracing::warn!(operation_id = %op.id, "{detail}");
        let ev = NewEvent::new(event::DRIFT_DETECTED, detail)
            .with("decided_state", op.state.as_str())
            .with("present", present);
        if let Err(e) = store
            .operation_mark_drift(op.id, &self.exec.replica, vec![ev])
            .await
        {
            tracing::warn!(operation_id = %op.id, error = %e, "could not record drift");
        }
        true
    }
}
