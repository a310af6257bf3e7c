//! The only place with SQL. `Store` is the ledger's interface; the
//! PostgreSQL implementation (`pg`) is the production one, the embedded
//! SQLite one (`sqlite`) serves a single process. No driver type crosses
//! this trait or `StoreError`; what both stores read is read in one place
//! (`rows`).
//!
//! Names are entity first (`operation_create`, `operation_transition`,
//! `operation_claim`). Every write of a decision is fenced by the lease
//! epoch it was taken under: a zero-row update is a lost race, handled on
//! purpose by the caller.
//!
//! - [`pg`]: the PostgreSQL store.
//! - [`sqlite`]: the embedded store.
//! - `open`: opening the store a URL names; the URL without its password.
//! - `rows`: what both stores read, read once.
//! - [`query`]: the list query, its SQL and arguments built together for
//!   both stores.
//! - `error`: `StoreError` and the driver failures under it.
//! - `migrations`: both stores' migrations, embedded at build time.
//! - [`metrics`]: the store's metric families (round trips, pool, queue,
//!   open operations).
//!
//! Why it is one file: it is the ledger's interface, the `Store` trait and
//! every value that crosses it, which both stores implement and every
//! caller reads together.

mod error;
pub mod metrics;
mod migrations;
mod open;
pub mod pg;
pub mod query;
mod rows;
pub mod sqlite;

pub use error::{DbFailure, StoreError};
pub use migrations::{MigrationStatus, migration_status};
pub use open::{mask_url, open, open_with, open_within};
pub use pg::{PgSettings, PgStore};
pub use sqlite::SqliteStore;

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use tokio::sync::broadcast;
use tokio::time::Instant;
use uuid::Uuid;

use crate::domain::{
    Action, AttachmentInfo, Caller, CallerKey, KeyHash, Labels, NewEvent, OpKey, Operation,
    OperationError, OperationEvent, RequestParams, Resolution, State, TraceContext,
};

/// How long opening the store waits, by default, for a database that does
/// not accept connections yet (`--db-connect-timeout`).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(60);

/// PostgreSQL ledger writes waiting for a writer, at most per kind, by
/// default (`--max-queued-writes`): larger than the cap on mutations in
/// flight, so a full queue means the database has fallen far behind.
pub const DEFAULT_WRITE_QUEUE: u32 = 32_768;

pub use pg::Bounds as DbBounds;

/// The kinds of round trip to the database, as the metrics label them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoundTrip {
    /// A batch of intents (the writers').
    Intent,
    /// A batch of decisions and appends (the writers').
    Decision,
    /// Reads of operations, their pages and logs.
    Read,
    /// The reconciler's claims, verifications and drift marks.
    Reconcile,
    /// Lease renewals (the heartbeat's) and releases.
    Lease,
    /// Waits registered for a decision.
    Watch,
    /// Readiness and liveness checks of a connection.
    Ping,
    /// Metrics read at scrape.
    Scrape,
    /// Operators' decisions.
    Resolve,
    /// Retention rounds.
    Retention,
    /// The change listener's connection.
    Listen,
    /// Opening a connection.
    Connect,
}

impl RoundTrip {
    pub const ALL: [RoundTrip; 12] = [
        RoundTrip::Intent,
        RoundTrip::Decision,
        RoundTrip::Read,
        RoundTrip::Reconcile,
        RoundTrip::Lease,
        RoundTrip::Watch,
        RoundTrip::Ping,
        RoundTrip::Scrape,
        RoundTrip::Resolve,
        RoundTrip::Retention,
        RoundTrip::Listen,
        RoundTrip::Connect,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RoundTrip::Intent => "intent",
            RoundTrip::Decision => "decision",
            RoundTrip::Read => "read",
            RoundTrip::Reconcile => "reconcile",
            RoundTrip::Lease => "lease",
            RoundTrip::Watch => "watch",
            RoundTrip::Ping => "ping",
            RoundTrip::Scrape => "scrape",
            RoundTrip::Resolve => "resolve",
            RoundTrip::Retention => "retention",
            RoundTrip::Listen => "listen",
            RoundTrip::Connect => "connect",
        }
    }
}

/// Told of every round trip to the database: its kind, how long it took,
/// and how it ended (`ok`, `error`, `timeout`).
pub trait DbObserver: Send + Sync {
    fn round_trip(&self, kind: &'static str, seconds: f64, outcome: &'static str);
}

/// How full the store's own queues and pools are now (saturation gauges).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Saturation {
    /// Connections of the read pool lent out, and its size.
    pub pool_in_use: usize,
    pub pool_size: usize,
    /// Writes waiting for (or being written by) the ledger writers.
    pub writes_pending: usize,
}

/// A new operation: its intent, written before any request leaves.
#[derive(Debug, Clone)]
pub struct NewOperation {
    /// Chosen by the caller. The same intent recorded twice (a re-run, a
    /// repeat) is one row: the repeat finds its own id and is `Created`.
    pub id: Uuid,
    /// Who asked, and what it is known by: a caller's key, or (an Ensure
    /// call) its identity alone.
    pub key: OpKey,
    pub fingerprint: String,
    pub action: Action,
    pub server_id: Uuid,
    pub volume_id: Uuid,
    pub params: RequestParams,
    /// Its caller's labels (part of the fingerprint), kept in a column of
    /// their own.
    pub labels: Labels,
    /// `InProgress` with `attempts = 1` when the first request may be sent
    /// once this is durable (the intent and the attempt in one write).
    pub state: State,
    pub attempts: i32,
    /// The operation's own deadline, from now on the database's clock (no
    /// replica's clock enters any deadline, lease or backoff).
    pub deadline_in: Duration,
    pub lease_owner: String,
    /// The lease, from now on the database's clock; the holder's heartbeat
    /// renews it (`operation_renew_leases`).
    pub lease_for: Duration,
    /// The trace it belongs to, with this service's span (kept with the
    /// row: the reconciler's later requests carry it too).
    pub trace: Option<TraceContext>,
    pub replica: String,
    pub events: Vec<NewEvent>,
    /// The database's time past which the intent may no longer be
    /// recorded (`Store::intent_record_by`; `None`: whenever it arrives).
    /// A statement of it that reaches the server later, its bytes held by
    /// a proxy or a network while its task read it back, found it absent
    /// and gave up, inserts nothing: no intent is ever recorded that
    /// nobody drives.
    pub record_by: Option<DateTime<Utc>>,
}

/// What `operation_create` found.
impl NewOperation {
    /// What the ledger knows its key by (the one computation of it:
    /// `OpKey::hash`).
    pub fn key_hash(&self) -> KeyHash {
        self.key.hash(self.id)
    }

    /// The ledger's `idempotency_key` (see `OpKey::stored_key`).
    pub fn stored_key(&self) -> String {
        self.key.stored_key(self.id)
    }

    /// The ledger's `caller` (`None`: anonymous).
    pub fn caller_name(&self) -> Option<String> {
        self.key.caller().name().map(str::to_string)
    }

    /// Whether an Ensure call asked for it.
    pub fn ensure(&self) -> bool {
        self.key.is_ensure()
    }

    /// The row this intent is once written, given what the database set
    /// (`INTENDED_COLUMNS`): an intent returns only that.
    pub(crate) fn recorded_as(
        &self,
        created_at: DateTime<Utc>,
        deadline_at: DateTime<Utc>,
        last_request_at: Option<DateTime<Utc>>,
        lease_expires_at: Option<DateTime<Utc>>,
    ) -> Operation {
        Operation {
            id: self.id,
            // As a row reads back: an Ensure operation has no caller's key.
            idempotency_key: self
                .key
                .keyed()
                .map(|k| k.key().as_str().to_string())
                .unwrap_or_default(),
            action: self.action,
            state: self.state,
            resolution: None,
            server_id: self.server_id,
            volume_id: self.volume_id,
            params: self.params.clone(),
            attachment: None,
            attempts: self.attempts,
            last_error: None,
            deadline_at,
            last_request_at,
            created_at,
            updated_at: created_at,
            completed_at: None,
            lease_owner: Some(self.lease_owner.clone()),
            lease_expires_at,
            lease_epoch: 1,
            caller: self.caller_name(),
            ensure: self.ensure(),
            labels: self.labels.clone(),
            attempt_unsent: false,
            drifted: false,
            passes: 0,
            escalated_at: None,
            escalation: None,
            verify_expect: None,
            trace: self.trace.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub enum CreateOutcome {
    /// A new row: this caller owns the work.
    Created(Operation),
    /// The key was seen before with the same parameters: join that operation.
    Existing(Operation),
}

/// A fenced state change plus the events that explain it, in one write.
///
/// Made twice (the group commit re-runs a batch whose acknowledgement was
/// lost; a caller repeats it), the same `Transition` applies once: the
/// repeat changes nothing, logs nothing, and answers with the row as the
/// first left it — unless the lease epoch moved on meanwhile (then `None`,
/// as for any fenced write).
#[derive(Debug, Clone)]
pub struct Transition {
    pub id: Uuid,
    pub lease_epoch: i64,
    /// Names this write (set by `new`): how a repeat recognises its own
    /// earlier effect.
    pub write_id: Uuid,
    pub state: State,
    pub resolution: Option<Resolution>,
    pub attachment: Option<AttachmentInfo>,
    pub add_attempt: bool,
    /// `Some(x)` replaces `last_error` with `x`.
    pub last_error: Option<Option<OperationError>>,
    pub request_sent: bool,
    pub release_lease: bool,
    /// The reconciler's next pass, from now on the database's clock.
    pub next_attempt_in: Option<Duration>,
    /// With a decision: what a later look should find (see
    /// `Operation::verify_expect`).
    pub verify_expect: Option<bool>,
    /// Hands the (still open) operation to people, with the reason.
    pub escalation: Option<String>,
    /// Marks its last attempt as one of which nothing may take effect (a
    /// run that pauses after a refusal proving nothing took effect, with
    /// nothing earlier that may): until its next attempt is recorded, it
    /// may be cancelled, and a pass decides it as one never sent.
    pub mark_unsent: bool,
    pub replica: String,
    pub events: Vec<NewEvent>,
    /// The row as its writer last read or wrote it: the decided row is
    /// this with the transition applied and what the database set (a
    /// decision returns only that).
    pub base: Box<Operation>,
}

impl Transition {
    /// The row after this transition, given what the database set
    /// (`DECIDED_COLUMNS`); `base` for the rest.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn applied(
        &self,
        attempts: i32,
        last_request_at: Option<DateTime<Utc>>,
        updated_at: DateTime<Utc>,
        completed_at: Option<DateTime<Utc>>,
        lease_owner: Option<String>,
        lease_expires_at: Option<DateTime<Utc>>,
        escalated_at: Option<DateTime<Utc>>,
    ) -> Operation {
        let mut op = (*self.base).clone();
        op.state = self.state;
        op.resolution = self.resolution;
        if self.attachment.is_some() {
            op.attachment = self.attachment.clone();
        }
        if attempts > op.attempts {
            // An attempt recorded since: the one known unsent is no longer
            // the last.
            op.attempt_unsent = false;
        } else if self.mark_unsent {
            op.attempt_unsent = true;
        }
        op.attempts = attempts;
        if let Some(e) = &self.last_error {
            op.last_error = e.clone();
        }
        op.last_request_at = last_request_at;
        op.updated_at = updated_at;
        op.completed_at = completed_at;
        op.lease_owner = lease_owner;
        op.lease_expires_at = lease_expires_at;
        op.verify_expect = self.verify_expect;
        op.escalated_at = escalated_at;
        if self.escalation.is_some() {
            op.escalation = self.escalation.clone();
        }
        op
    }
    pub fn new(op: &Operation, state: State, replica: &str) -> Self {
        Self {
            id: op.id,
            lease_epoch: op.lease_epoch,
            write_id: Uuid::now_v7(),
            state,
            resolution: None,
            attachment: None,
            add_attempt: false,
            last_error: None,
            request_sent: false,
            release_lease: false,
            next_attempt_in: None,
            verify_expect: None,
            escalation: None,
            mark_unsent: false,
            replica: replica.to_string(),
            events: Vec::new(),
            base: Box::new(op.clone()),
        }
    }
}

/// A cancel: one compare-and-set that decides the operation FAILED
/// (resolution `cancelled`) and moves its lease epoch on, if nothing that
/// may take effect was sent for it (`Operation::nothing_sent`): no further
/// attempt can then be recorded, and none may leave unrecorded.
#[derive(Debug, Clone)]
pub struct Cancel {
    pub id: Uuid,
    pub replica: String,
    /// Its `last_error` (reason CANCELLED) and the event logging it
    /// (`domain::cancelled`).
    pub error: OperationError,
    pub event: NewEvent,
    /// Only if it is an attach of this server by this caller (a detach of
    /// the same volume superseding it).
    pub only_attach_of: Option<(Uuid, Caller)>,
}

impl Cancel {
    /// The cancel of `old`, an open attach of which nothing may take
    /// effect, by `new`, a detach of the same server and volume by the
    /// same caller: only if it is still such an attach.
    pub fn superseded_by(old: &Operation, new: &NewOperation) -> Self {
        let who = new.key.caller().clone();
        let (error, event) = crate::domain::cancelled(
            old.id,
            &who,
            &format!(
                "superseded by detach {} of the same volume from the same server",
                new.id
            ),
        );
        Self {
            id: old.id,
            replica: new.replica.clone(),
            error: error.with("superseded_by", new.id),
            event: event.with("superseded_by", new.id),
            only_attach_of: Some((new.server_id, who)),
        }
    }
}

/// What a cancel found.
#[derive(Debug, Clone)]
pub enum Cancelled {
    /// Cancelled: the row as it is now.
    Done(Operation),
    /// Not cancelled: decided already, or something that may take effect
    /// may have been sent (or it is not the attach `only_attach_of`
    /// names); the row as it stands.
    Not(Operation),
    NotFound,
}

/// An operator's decision (`ResolveOperation`, and each of a bulk
/// resolve's), audited.
#[derive(Debug, Clone)]
pub struct OperatorDecision {
    pub id: Uuid,
    pub state: State,
    pub reason: String,
    pub replica: String,
    /// Who decided (`None`: the anonymous caller).
    pub caller: Option<String>,
    /// Only if the operation is in this state (a bulk resolve's filter
    /// named one, and it must still hold).
    pub expect: Option<State>,
    /// More for its event's metadata (a bulk call's id and filter).
    pub audit: Vec<(String, String)>,
}

impl OperatorDecision {
    /// `caller`'s decision of `id` (`None`: the anonymous caller), made on
    /// `replica`: in any open state, with no audit beyond its own.
    pub fn new(id: Uuid, state: State, reason: &str, replica: &str, caller: Option<&str>) -> Self {
        Self {
            id,
            state,
            reason: reason.to_string(),
            replica: replica.to_string(),
            caller: caller.map(str::to_string),
            expect: None,
            audit: Vec::new(),
        }
    }
}

/// One lease a replica holds: the operation and the epoch it was taken
/// (or written) under. Renewals and fenced writes name both: a lease whose
/// epoch moved on is another holder's, even when the owner's name is the
/// same (a takeover by this replica's own reconciler).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HeldLease {
    pub id: Uuid,
    pub epoch: i64,
}

/// What a renewal found of one lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Renewal {
    /// Renewed for another lease from when the row was renewed.
    Renewed,
    /// Not renewed now because another statement holds the row (a decision
    /// being written, the heartbeat's own renewal): still this holder's as
    /// far as anyone can tell. Never read as lost: the next renewal tells.
    Busy,
    /// The lease is no longer this holder's: another owner or a newer
    /// epoch (taken over, or resolved by an operator), released, or no
    /// such row.
    Lost,
    /// The operation is decided.
    Decided,
}

/// Which operations a list (or a bulk call) is about: every filter set
/// applies. Its query is built in one place for both stores (`query`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OperationFilter {
    pub state: Option<State>,
    pub server_id: Option<Uuid>,
    pub volume_id: Option<Uuid>,
    pub drifted_only: bool,
    pub escalated_only: bool,
    /// Only this caller's ([`Caller::ANONYMOUS`]: the callers without a
    /// name).
    pub caller: Option<Caller>,
    /// Only operations carrying every one of these labels.
    pub labels: Labels,
    /// Created within this range.
    pub created: TimeRange,
    /// Last changed within this range.
    pub updated: TimeRange,
    /// Only open operations (a bulk resolve pins no decided one).
    pub open_only: bool,
    /// Only this operation (a bulk call asks whether it still matches).
    pub id: Option<Uuid>,
}

/// `from` (inclusive) to `before` (exclusive); either end open.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TimeRange {
    pub from: Option<DateTime<Utc>>,
    pub before: Option<DateTime<Utc>>,
}

/// Where a list's page ended: the last row's `seq`, which never changes
/// (a row that changes while a list is paged keeps its place).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListCursor {
    pub seq: i64,
}

/// One page of operations, newest first.
#[derive(Debug, Clone)]
pub struct OperationPage {
    pub operations: Vec<Operation>,
    /// The position after the last row, when more may follow.
    pub next_cursor: Option<ListCursor>,
}

/// Counts of operations by (state, resolution), for metrics and the demo.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StateCount {
    pub state: String,
    pub resolution: Option<String>,
    pub count: i64,
}

/// What a retention round deletes (see `crate::retention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PruneParams {
    /// Decided operations decided longer ago than this go, with their
    /// events; each leaves a tombstone of its (caller, key).
    pub keep: Duration,
    /// Tombstones of keys decided longer ago than this go; `None`: never.
    pub keep_keys: Option<Duration>,
    /// Operations (or tombstones) per statement.
    pub limit: u32,
    /// As if the database's clock read this much later (tests); zero in
    /// production.
    pub ahead: Duration,
    /// PostgreSQL: how long a batch waits for transactions that may not
    /// see its tombstones yet (a concurrent replay of a key being pruned)
    /// before deleting the operations; past it, the round ends and the
    /// batch is taken again next round.
    pub horizon_wait: Duration,
}

/// What a retention batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PruneCounts {
    pub operations: u64,
    pub events: u64,
    pub tombstones_written: u64,
    pub tombstones_expired: u64,
    /// Operations marked (tombstones written) but left for the next round:
    /// older transactions were still running (PostgreSQL).
    pub deferred: u64,
}

impl PruneCounts {
    pub fn add(&mut self, o: PruneCounts) {
        self.operations += o.operations;
        self.events += o.events;
        self.tombstones_written += o.tombstones_written;
        self.tombstones_expired += o.tombstones_expired;
        self.deferred += o.deferred;
    }
}

/// A retention round: while it lives, no other replica's round runs
/// (PostgreSQL: an advisory lock on a connection of its own; the embedded
/// store: a lock in the process). Dropped without `end`, the lock goes
/// with its connection.
#[async_trait]
pub trait PruneRound: Send {
    /// Deletes up to `limit` decided operations older than `keep` and
    /// their events, leaving a tombstone per key.
    async fn prune_batch(&mut self, p: &PruneParams) -> Result<PruneCounts, StoreError>;

    /// Deletes up to `limit` tombstones older than `keep_keys`.
    async fn expire_batch(&mut self, p: &PruneParams) -> Result<u64, StoreError>;

    /// Ends the round (releases the lock).
    async fn end(self: Box<Self>);
}

/// Registers a wait for `id`'s decision (`Store::watch`) for `wait`,
/// giving it at most `bound` (the waiter's re-read interval: a
/// registration is a hint, never worth more of the waiter's time). A
/// registration that fails or takes longer is logged and otherwise left:
/// the waiter re-reads the operation every `bound` regardless.
pub async fn watch_within(store: &dyn Store, id: Uuid, wait: Duration, bound: Duration) {
    match tokio::time::timeout(bound.min(wait), store.watch(id, wait)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(
            operation_id = %id,
            error = %e,
            "could not register a wait for the decision; re-reading it every {bound:?} instead"
        ),
        Err(_) => tracing::warn!(
            operation_id = %id,
            "registering a wait for the decision took longer than {bound:?}; re-reading it every {bound:?} instead"
        ),
    }
}

/// Runs a store future under a deadline: every wait in the store is bounded
/// by the deadline of the work it serves, never by a pool constant.
pub async fn within<T>(
    deadline: Instant,
    what: &'static str,
    fut: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout_at(deadline, fut).await {
        Ok(r) => r,
        Err(_) => Err(StoreError::DeadlineExceeded { what }),
    }
}

#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Records a new operation, or finds the one its key already names.
    /// `deadline` bounds when the intent may still be written: a write not
    /// started by then is not made. One that started is awaited to its
    /// end, even past it: given up on, it could commit unseen (an intent
    /// nothing drives); the caller drives what it gets, or decides it at
    /// once when no time is left.
    ///
    /// Not an `async fn`: the implementation takes what it needs from `new`
    /// before it makes its future, so each of the thousands of intents that
    /// can wait for the group commit at once holds no copy of the intent
    /// beside the one being written.
    fn operation_create(
        &self,
        new: NewOperation,
        deadline: Instant,
    ) -> futures_util::future::BoxFuture<'_, Result<CreateOutcome, StoreError>>;

    async fn operation_get(&self, id: Uuid) -> Result<Option<Operation>, StoreError>;

    /// The operation a caller's key names now (keys are per caller; a key
    /// retired by a replay names the operation that replay started).
    async fn operation_get_by_key(&self, key: &CallerKey) -> Result<Option<Operation>, StoreError>;

    async fn operation_list(
        &self,
        filter: &OperationFilter,
        after: Option<ListCursor>,
        limit: u32,
    ) -> Result<OperationPage, StoreError>;

    async fn operation_events(&self, id: Uuid) -> Result<Vec<OperationEvent>, StoreError>;

    /// A fenced state change. `Ok(None)`: the lease epoch moved on or the row
    /// is already terminal — somebody else decided; re-read it.
    async fn operation_transition(
        &self,
        t: Transition,
        deadline: Instant,
    ) -> Result<Option<Operation>, StoreError>;

    /// Appends events to an operation without changing its state.
    async fn operation_append_events(
        &self,
        id: Uuid,
        replica: &str,
        events: Vec<NewEvent>,
    ) -> Result<(), StoreError>;

    /// Leases up to `limit` open operations that nobody holds (expired lease,
    /// or released to the reconciler), whose backoff has passed and that are
    /// not escalated, except those of `held` (operations a task of this
    /// replica works on now: a lease of theirs that lapsed in a stall is
    /// theirs to renew, not this replica's to take over a second time).
    /// Each gets a new epoch. Safe to call from several replicas at once.
    async fn operation_claim(
        &self,
        replica: &str,
        lease: Duration,
        limit: u32,
        held: &[Uuid],
    ) -> Result<Vec<Operation>, StoreError>;

    /// Leases one operation now (for `ReconcileOperation`), whatever its
    /// backoff or escalation, unless anyone — this replica's own executor
    /// included — holds a live lease on it.
    async fn operation_claim_one(
        &self,
        id: Uuid,
        replica: &str,
        lease: Duration,
    ) -> Result<Option<Operation>, StoreError>;

    /// Renews the leases `replica` holds (each under its epoch) for
    /// `lease`: the heartbeat's, and the send gate's for one. Each comes
    /// back with what was found (`Renewal`), in no particular order. A row
    /// another statement holds at that moment is `Busy`, never `Lost`: the
    /// statement does not wait for locks (waiting made it deadlock with
    /// decisions written in another order).
    async fn operation_renew_leases(
        &self,
        replica: &str,
        held: &[HeldLease],
        lease: Duration,
    ) -> Result<Vec<(Uuid, Renewal)>, StoreError>;

    /// When the oldest decision due for verification `stage` (decided at
    /// least `delay` ago) that no replica has taken yet was decided; `None`
    /// when the stage is up to date. How far the verifier is behind, for
    /// /metrics (reads the cursor and one index entry; takes nothing).
    async fn verification_backlog(
        &self,
        stage: u8,
        delay: Duration,
    ) -> Result<Option<DateTime<Utc>>, StoreError>;

    /// Takes the next (at most `limit`) decided operations that verification
    /// `stage` has not seen, decided at least `delay` ago, in decision
    /// order, and moves the stage's cursor past them: each is handed out
    /// once, to one replica.
    async fn verification_next(
        &self,
        stage: u8,
        delay: Duration,
        limit: u32,
    ) -> Result<Vec<Operation>, StoreError>;

    /// Records the result of a late-effect verification.
    async fn operation_mark_drift(
        &self,
        id: Uuid,
        replica: &str,
        events: Vec<NewEvent>,
    ) -> Result<(), StoreError>;

    /// An operator's decision: ends the operation whatever lease it had
    /// (the epoch moves on, fencing out any worker).
    async fn operation_resolve_by_operator(
        &self,
        d: &OperatorDecision,
    ) -> Result<Operation, StoreError>;

    /// Cancels an operation of which nothing that may take effect was
    /// sent, in one compare-and-set (see [`Cancel`]), with its event,
    /// notified.
    async fn operation_cancel(&self, c: &Cancel) -> Result<Cancelled, StoreError>;

    /// Lets go of this replica's leases on open operations (drain): they
    /// become claimable by any reconciler at once.
    /// Releases the leases `replica` holds on open operations, except those
    /// of `keep` (operations whose task still runs here: released, they
    /// could be taken over while that task may still send a request).
    async fn operation_release_leases(
        &self,
        replica: &str,
        keep: &[Uuid],
    ) -> Result<u64, StoreError>;

    /// Every operation of the ledger by state and resolution: one pass over
    /// the whole table, on demand (`ops stats`), never at scrape.
    async fn operation_count_by_state(&self) -> Result<Vec<StateCount>, StoreError>;

    /// The open operations by state (the gauge read at scrape): through
    /// the open operations' index, its cost grows with open work only.
    async fn operation_open_by_state(&self) -> Result<Vec<StateCount>, StoreError>;

    /// When Nova was last asked about the oldest UNKNOWN operation (when it
    /// was recorded, if it never was); `None` when none is UNKNOWN. Reads
    /// the open operations only, through their index.
    async fn oldest_unknown_since(&self) -> Result<Option<DateTime<Utc>>, StoreError>;

    /// For each of `volumes`, when its latest operation was created (the
    /// verifier: a change after a later operation began is explained).
    async fn volumes_latest_operation(
        &self,
        volumes: &[Uuid],
    ) -> Result<Vec<(Uuid, DateTime<Utc>)>, StoreError>;

    /// The database's clock: what every lease, deadline and backoff is
    /// measured against.
    async fn now(&self) -> Result<DateTime<Utc>, StoreError>;

    /// Wake-ups when operations change (the id; `Uuid::nil()` means "re-read
    /// everything", e.g. after the listener reconnected).
    fn subscribe(&self) -> broadcast::Receiver<Uuid>;

    /// Asks for wake-ups (through `subscribe`) about `id`'s decision when
    /// another replica makes it, for the next `wait`: PostgreSQL notifies
    /// only the decisions somebody watches. Call it after `subscribe` and
    /// before reading the operation. A decision whose statement began
    /// before the registration committed may still go unnotified, so a
    /// wake-up is a hint: a waiter re-reads now and then whatever this
    /// returned, and bounds this call by that interval. An id that names
    /// no operation registers nothing.
    async fn watch(&self, id: Uuid, wait: Duration) -> Result<(), StoreError>;

    /// Whether the database answers (readiness).
    async fn ping(&self) -> Result<(), StoreError>;

    /// Begins a retention round; `None` while another one (another
    /// replica's) runs.
    async fn retention_begin(&self) -> Result<Option<Box<dyn PruneRound>>, StoreError>;

    /// When the oldest decided operation the ledger still holds was
    /// decided (the retention metrics).
    async fn retention_oldest_decided(&self) -> Result<Option<DateTime<Utc>>, StoreError>;

    /// When a caller's key was pruned, if its tombstone still stands.
    async fn operation_key_expired(
        &self,
        key: &CallerKey,
    ) -> Result<Option<DateTime<Utc>>, StoreError>;

    /// Marks the operation's attempt `attempts` (recorded under `epoch`,
    /// for the log) as one that never left (its holder lost the lease
    /// before its send gate let it out, and no earlier request of the
    /// operation may still take effect), and due for a pass now. A fact
    /// about that attempt, so not fenced by the current lease: attempt
    /// counts are given out once each (every attempt is recorded under the
    /// lease's epoch), so it changes the row only while that attempt is
    /// still its last and it is open. True when it did.
    async fn operation_mark_unsent(
        &self,
        id: Uuid,
        epoch: i64,
        attempts: i32,
        replica: &str,
    ) -> Result<bool, StoreError>;

    /// Closes the pool (last step of a drain).
    async fn close(&self);

    /// Reports each round trip to `observer` (set once, at start).
    fn observe(&self, observer: std::sync::Arc<dyn DbObserver>) {
        drop(observer);
    }

    /// The longest one round trip to the database may take (and the
    /// server's own bound of a statement's execution, PostgreSQL's
    /// `statement_timeout`).
    fn round_trip_bound(&self) -> Duration {
        DbBounds::DEFAULT.round_trip
    }

    /// For an intent to be written by `deadline`: the database's time past
    /// which it may no longer be recorded (`NewOperation::record_by`):
    /// the latest the database's clock can read at `deadline`, and a
    /// second more. `None` when the store cannot bound its clock (the
    /// embedded store, in this process: nothing holds its statements in
    /// flight).
    fn intent_record_by(&self, _deadline: Instant) -> Option<DateTime<Utc>> {
        None
    }

    /// Whether an intent bound by `record_by` that a read begun after this
    /// answer does not find will never be recorded: no statement of it can
    /// insert it any more, and none that could is still under way.
    async fn intent_settled(&self, record_by: DateTime<Utc>) -> Result<bool, StoreError> {
        let bound = chrono::Duration::from_std(2 * self.round_trip_bound())
            .unwrap_or(chrono::Duration::MAX);
        Ok(self.now().await? >= record_by + bound)
    }

    /// How full the store's pools and queues are now.
    fn saturation(&self) -> Saturation {
        Saturation::default()
    }
}
