//! The background reconciler, in every `serve` replica. It leases open
//! operations nobody holds (`FOR UPDATE SKIP LOCKED`, a lease naming the
//! replica, a new epoch per lease, renewed by the replica's heartbeat while
//! a pass runs), re-observes Nova and decides (`pass.rs`); every decision
//! is written under the epoch it was taken with, so a late writer can never
//! overwrite a newer decision. It also verifies decided operations for
//! changes nothing recorded explains (`verify.rs`).
//!
//! Every comparison of time (leases, backoff, settle windows, deadlines)
//! is made on the database's clock, read once per round: replicas whose
//! clocks disagree still agree on who holds what.
//!
//! `run_once()` does one round and returns counts; `run()` is a thin loop
//! around it on a shutdown token (rule 9).
//!
//! - `pass.rs`: one pass over one claimed operation, and what it decides.
//! - `verify.rs`: verification of decided operations for late effects.
//! - `bulk.rs`: bulk calls by filter (`ReconcileOperations`,
//!   `ResolveOperations`).
//! - `metrics.rs`: the reconciler's metric families.

pub mod bulk;
pub mod metrics;
mod pass;
mod verify;

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::domain::{Action, Deadline, Operation, TraceContext};
use crate::executor::Executor;
use crate::nova::{NovaAttachment, NovaError, RequestId};
use crate::store::StoreError;
use metrics::ReconcilerMetrics;

/// A verification never looks at a decision younger than this, whatever
/// `--verify-after` says: a decision stamped with its transaction's start
/// commits a little later, and the cursor must not pass it unseen. The
/// first look of a decision is at `max(--verify-after, this)`.
pub const VERIFY_MIN_LAG: Duration = Duration::from_secs(2);

/// The longest settle or verification window `serve` accepts (366 days).
/// A window is how long Nova may still act on a request whose answer was
/// lost (half an hour by default); a year is far past any of Nova's
/// timeouts, so a longer setting is a mistake, refused at the start naming
/// its flag (`config`). Within it a window is exact on the database's
/// clock ([`window`]).
pub const MAX_WINDOW: Duration = Duration::from_secs(366 * 24 * 3600);

/// `d` as a span of the database's clock: exact up to [`MAX_WINDOW`],
/// saturated there beyond it (settings built in code skip the start's
/// check). Never 0 for a long window, which would read "decide at once",
/// and never past what a timestamp plus it can hold.
pub(crate) fn window(d: Duration) -> chrono::Duration {
    let capped = chrono::Duration::from_std(d.min(MAX_WINDOW));
    capped.unwrap_or(chrono::Duration::days(366))
}

#[derive(Debug, Clone)]
pub struct ReconcilerSettings {
    /// Pause between rounds when there was nothing to do.
    pub interval: Duration,
    /// Operations leased per round.
    pub batch: u32,
    /// How long after its last request Nova may still be processing an
    /// attach: "not found" means nothing before then. Below microversion
    /// 2.101 the attach POST is a synchronous RPC that may wait up to
    /// Nova's `long_rpc_timeout` (1800 s by default) after a load balancer
    /// answered 504; hence 30 min plus a margin.
    pub settle_attach: Duration,
    /// The same for a detach: libvirt retries a detach up to
    /// `device_detach_attempts` × `device_detach_timeout` (8 × 20 s).
    pub settle_detach: Duration,
    /// Global cap on the reconciler's Nova requests per second, so an
    /// outage does not turn into a hammering.
    pub rate_limit: f64,
    /// Passes run concurrently.
    pub parallelism: usize,
    /// Decided operations are verified this long after the decision...
    pub verify_after: Duration,
    /// ...and again at the end of this window (Nova's late effects).
    pub verify_window: Duration,
    /// Bound of one observation.
    pub observe_timeout: Duration,
    /// Longest per-operation backoff.
    pub max_backoff: Duration,
}

impl ReconcilerSettings {
    /// The verification stages, each with how long after a decision it
    /// looks: the first at `--verify-after` (never before
    /// [`VERIFY_MIN_LAG`]), the last at the end of `--verify-window`.
    pub fn verification_stages(&self) -> [(u8, Duration); 2] {
        [
            (0, self.verify_after.max(VERIFY_MIN_LAG)),
            (1, self.verify_window.max(VERIFY_MIN_LAG)),
        ]
    }

    /// The built-in defaults: the one source of the flags' defaults too
    /// (`config/serve.rs` refers to these; a test checks they agree).
    pub const DEFAULT: Self = Self {
        interval: Duration::from_secs(1),
        batch: 256,
        settle_attach: Duration::from_secs(31 * 60),
        settle_detach: Duration::from_secs(4 * 60),
        rate_limit: 200.0,
        parallelism: 32,
        verify_after: Duration::from_secs(60),
        verify_window: Duration::from_secs(35 * 60),
        observe_timeout: Duration::from_secs(10),
        max_backoff: Duration::from_secs(60),
    };

    /// How long after its last request an operation's effect may still
    /// come.
    pub fn settle(&self, action: Action) -> Duration {
        match action {
            Action::Attach => self.settle_attach,
            Action::Detach => self.settle_detach,
        }
    }
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
    pub escalated: usize,
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

/// Rounds that fail in a row (the database away), logged at their edges:
/// the first at warn, those after it at debug, and the first that
/// succeeds again at info with how many failed.
#[derive(Default)]
struct FailingRounds(Option<(Instant, u64)>);

impl FailingRounds {
    fn failed(&mut self, e: &StoreError) {
        match &mut self.0 {
            None => {
                tracing::warn!(error = %e, "reconciler round failed; trying every round, logged again when one succeeds");
                self.0 = Some((Instant::now(), 1));
            }
            Some((_, failed)) => {
                *failed += 1;
                tracing::debug!(error = %e, "reconciler round failed");
            }
        }
    }

    fn ended(&mut self) {
        if let Some((since, failed)) = self.0.take() {
            tracing::info!(
                failed,
                "reconciler rounds succeed again after {} s, {failed} failed",
                since.elapsed().as_secs()
            );
        }
    }
}

/// What listing a server's attachments gave.
type Observation = Result<Vec<NovaAttachment>, NovaError>;

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
    Succeeded,
    Failed,
    Deferred,
    Escalated,
}

/// What a reconciler works with, its own (not reached through the
/// executor's): the ledger, Nova, the budget policy, this replica's name
/// and lease, the metrics and the failure summaries.
pub struct Deps {
    pub store: Arc<dyn crate::store::Store>,
    pub nova: Arc<crate::nova::NovaClient>,
    pub policy: crate::domain::BudgetPolicy,
    pub replica: String,
    /// How long a claimed lease lasts (the executor's `--lease`).
    pub lease: Duration,
    pub metrics: Arc<ReconcilerMetrics>,
    /// Failed looks, summed up in the executor's warn line of the interval.
    pub failures: Arc<crate::telemetry::summary::Summaries>,
}

pub struct Reconciler {
    /// Runs re-sends and holds the leases of passes (its methods only).
    exec: Arc<Executor>,
    store: Arc<dyn crate::store::Store>,
    nova: Arc<crate::nova::NovaClient>,
    policy: crate::domain::BudgetPolicy,
    replica: String,
    lease: Duration,
    pub metrics: Arc<ReconcilerMetrics>,
    failures: Arc<crate::telemetry::summary::Summaries>,
    pub settings: ReconcilerSettings,
    limiter: RateLimiter,
    /// Verifications whose look failed or that were held back while Nova
    /// or Cinder was away, made again later (`verify`).
    verify_backlog: std::sync::Mutex<verify::Backlog>,
}

impl Reconciler {
    pub fn new(exec: Arc<Executor>, deps: Deps, settings: ReconcilerSettings) -> Arc<Self> {
        let Deps {
            store,
            nova,
            policy,
            replica,
            lease,
            metrics,
            failures,
        } = deps;
        Arc::new(Self {
            limiter: RateLimiter::new(settings.rate_limit),
            exec,
            store,
            nova,
            policy,
            replica,
            lease,
            metrics,
            failures,
            settings,
            verify_backlog: std::sync::Mutex::new(verify::Backlog::default()),
        })
    }

    /// Rounds until `shutdown`.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        let mut failing = FailingRounds::default();
        loop {
            let counts = match self.run_once().await {
                Ok(c) => {
                    failing.ended();
                    c
                }
                Err(e) => {
                    failing.failed(&e);
                    RoundCounts::default()
                }
            };
            if counts.claimed > 0 {
                tracing::info!(
                    claimed = counts.claimed,
                    succeeded = counts.succeeded,
                    failed = counts.failed,
                    deferred = counts.deferred,
                    escalated = counts.escalated,
                    "reconciler round"
                );
            }
            let busy = counts.claimed > 0 || counts.verified > 0;
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
        let store = &self.store;
        // Never this replica's own live work: a lease of a run here that
        // lapsed in a stall is the run's to renew (or to lose to another
        // replica), not a second run's to take here.
        let held = self.exec.held();
        let claimed = store
            .operation_claim(&self.replica, self.lease, self.settings.batch, &held)
            .await?;
        let mut counts = RoundCounts {
            claimed: claimed.len(),
            ..Default::default()
        };
        if !claimed.is_empty() {
            // Held (the heartbeat renews the leases) from the claim on.
            let holds: Vec<_> = claimed
                .iter()
                .map(|op| self.exec.hold(lease_of(op)))
                .collect();
            // The database's time at the claim (its statement stamps the
            // rows it took): no read after it that could fail and leave
            // the batch claimed with nobody working on it for a lease.
            let db_now = claimed
                .iter()
                .map(|op| op.updated_at)
                .max()
                .unwrap_or_default();
            // One observation per server per round, shared by its operations.
            let results: Vec<PassResult> = futures_util::stream::iter(group_by_server(claimed))
                .map(|(server, ops)| {
                    let this = self.clone();
                    async move {
                        let seen = this.observe_server(server, look_trace(&ops)).await;
                        futures_util::future::join_all(
                            ops.into_iter()
                                .map(|op| this.pass_traced(op, &seen, db_now)),
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
            drop(holds);
            for r in results {
                match r {
                    PassResult::Succeeded => counts.succeeded += 1,
                    PassResult::Failed => counts.failed += 1,
                    PassResult::Deferred => counts.deferred += 1,
                    PassResult::Escalated => counts.escalated += 1,
                }
            }
        }
        let (verified, drifted) = self.verify_due().await?;
        counts.verified = verified;
        counts.drifted = drifted;
        Ok(counts)
    }

    /// Counts a failed look at `server`: summed up in the executor's
    /// warn line of the interval, not one line per operation per round (a
    /// Nova outage would otherwise write hundreds).
    pub(super) fn look_failed(&self, server: uuid::Uuid, error: &dyn std::fmt::Display) {
        self.failures.note("verification look", &server, error);
    }

    /// `ReconcileOperation`: one pass now over one operation. An operation
    /// a live holder works on (this replica's executor included) is never
    /// taken over: its decision is awaited until `deadline`, and the
    /// operation is reported as it stands then. Every ledger read made
    /// while its caller waits ends by the caller's time (`read_by`).
    pub async fn reconcile_now(
        self: &Arc<Self>,
        id: Uuid,
        deadline: Deadline,
    ) -> Result<Operation, StoreError> {
        let now = Instant::now();
        let until = deadline.at.min(now + Duration::from_secs(3600));
        // The deadline layer answers DEADLINE_EXCEEDED half the policy's
        // margin before the deadline: the reads end a margin before it,
        // the wait a margin before them, to read the row and answer with
        // it (the current state) first.
        let margin = self.policy.margin_for(until.saturating_duration_since(now));
        let read_by = until.checked_sub(margin).unwrap_or(now).max(now);
        let stop = until.checked_sub(margin * 2).unwrap_or(now).max(now);
        let store = &self.store;
        // A run of this replica's own holds it (its lease may have lapsed
        // in a stall): waited for, like another holder's.
        let claimed = if self.exec.held().contains(&id) {
            None
        } else {
            crate::store::within(
                read_by,
                "claim the operation to reconcile",
                store.operation_claim_one(id, &self.replica, self.lease),
            )
            .await?
        };
        match claimed {
            Some(op) => {
                let hold = self.exec.hold(lease_of(&op));
                let db_now = store.now().await?;
                let seen = self.observe_server(op.server_id, look_trace([&op])).await;
                self.pass_traced(op, &seen, db_now).await;
                drop(hold);
            }
            None => {
                let op = crate::store::within(
                    read_by,
                    "read the operation to reconcile",
                    store.operation_get(id),
                )
                .await?
                .ok_or(StoreError::NotFound(id))?;
                if op.state.is_terminal() {
                    // Decided already: look once more for drift.
                    self.verify_one(op).await?;
                } else {
                    let time = crate::executor::CallerTime {
                        answer_by: stop,
                        read_by,
                    };
                    match self.exec.wait_decided(id, time).await {
                        // The row as it was just read: no second read
                        // eating into the caller's margin.
                        Ok(op) => return Ok(op),
                        Err(crate::executor::ExecError::StillRunning(_)) => {}
                        Err(crate::executor::ExecError::Store(e)) => return Err(e),
                        Err(e) => {
                            tracing::warn!(operation_id = %id, error = %e, "waiting for a live operation failed")
                        }
                    }
                }
            }
        }
        crate::store::within(
            read_by,
            "read the reconciled operation",
            store.operation_get(id),
        )
        .await?
        .ok_or(StoreError::NotFound(id))
    }

    /// A pass over `op` under its trace: the requests it sends (Cinder's
    /// confirmation, a re-send's own task aside) carry the operation's trace
    /// id, as the list did.
    async fn pass_traced(
        self: &Arc<Self>,
        op: Operation,
        seen: &Observation,
        db_now: DateTime<Utc>,
    ) -> PassResult {
        let trace = look_trace([&op]);
        // A pass whose lease is found lost (another replica's now, or
        // decided) stops: it would only be fenced.
        let lost = self.exec.lease_lost(op.id);
        let pass = crate::telemetry::context::within_opt(trace, self.pass_with(op, seen, db_now));
        match lost {
            None => pass.await,
            Some(lost) => tokio::select! {
                biased;
                () = lost.cancelled() => PassResult::Deferred,
                r = pass => r,
            },
        }
    }

    /// Lists a server's attachments under the global rate limit, under
    /// `trace` (see [`look_trace`]).
    async fn observe_server(&self, server: Uuid, trace: Option<TraceContext>) -> Observation {
        self.limiter.acquire().await;
        self.observe_server_now(server, trace).await
    }

    /// `observe_server` for a caller that took its token already.
    async fn observe_server_now(&self, server: Uuid, trace: Option<TraceContext>) -> Observation {
        let started = Instant::now();
        let until = started + self.settings.observe_timeout;
        let rid = RequestId::fresh();
        let list = self.nova.list_as(&rid, server, until);
        let listed = crate::telemetry::context::within_opt(trace, list)
            .await
            .map(|a| a.value);
        let nova = &self.metrics.nova;
        match &listed {
            Ok(_) => nova.request("list", "ok", started.elapsed().as_secs_f64()),
            Err(e) => nova.request("list", e.kind.as_str(), e.elapsed.as_secs_f64()),
        }
        listed
    }

    /// The pause before an operation's next pass: exponential in its
    /// passes so far, from 250 ms to half of `max_backoff`, each with up to
    /// as much again of jitter.
    fn backoff(&self, op: &Operation) -> Duration {
        use backon::BackoffBuilder as _;
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
}

/// The trace a look on behalf of `ops` (one server's) is sent under: the
/// first one's that has a trace, under a new span of this pass. One list
/// serves every operation of the server, and a request carries one trace.
fn look_trace<'a>(ops: impl IntoIterator<Item = &'a Operation>) -> Option<TraceContext> {
    ops.into_iter()
        .find_map(|op| op.trace.as_ref())
        .map(TraceContext::child)
}

/// The lease a claim took `op` under.
fn lease_of(op: &Operation) -> crate::store::HeldLease {
    crate::store::HeldLease {
        id: op.id,
        epoch: op.lease_epoch,
    }
}

/// Milliseconds between two instants of the database's clock, for events.
fn ms_between(from: DateTime<Utc>, to: DateTime<Utc>) -> i64 {
    (to - from).num_milliseconds()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_is_exact_within_a_year_and_never_zero_past_it() {
        for d in [
            Duration::ZERO,
            Duration::from_millis(1500),
            Duration::from_secs(31 * 60),
            MAX_WINDOW,
        ] {
            assert_eq!(window(d).to_std().unwrap(), d);
        }
        // Past chrono's range (more than i64::MAX milliseconds) and past
        // what a timestamp plus it can hold: the year, not 0.
        for d in [Duration::from_secs(u64::MAX / 2), Duration::MAX] {
            assert_eq!(window(d).to_std().unwrap(), MAX_WINDOW);
            let now = chrono::Utc::now();
            assert!(now + window(d) > now);
        }
    }
}
