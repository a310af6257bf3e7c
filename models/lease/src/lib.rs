//! The lease protocol of volume-reconciler as a model, checked by
//! `stateright` over every interleaving.
//!
//! Three kinds of actor share one state:
//!
//! - **two replicas**, each with its tasks: an executor task (the caller's
//!   run: write the intent, send, await the answer, watch, decide), a
//!   reconciler pass (claim, look, decide, defer, or become a re-send run)
//!   and the heartbeat that renews every lease the replica holds (one hold
//!   per operation, as `executor/holds.rs` keys them);
//! - **the ledger**: one row per operation with its state, lease owner,
//!   epoch, whether the lease is past its expiry, the attempts, the epoch
//!   the last one was recorded under and whether it is known never to have
//!   left, and whether the settle window after the last stamped request has
//!   passed; every write goes through the fence as the real statements
//!   check it;
//! - **Nova**: whether the volume is attached, the requests in flight (each
//!   may take effect with or without an answer, or be lost before taking
//!   effect), and the answers not yet read.
//!
//! Time is abstracted: a lease is live or expired, a settle window open or
//! passed, a deadline ahead or past, each by a step of the model
//! (`Expire`, `Settle`, `Deadline`) that may happen only when the real
//! clocks would allow it. A lease expires only when its holder cannot renew
//! it within the store's round-trip bound: crashed, paused, its database
//! replies held or lost, or no task holding it (the lease is sized so that
//! a live holder whose renewals are slow but within the bound keeps it).
//!
//! Faults, drawn from a budget so that they stop: a replica crashes
//! (restarts with nothing running), pauses past its lease, its database
//! replies are held past the round-trip bound, its database is slow (within
//! the bound), the reply to an intent or to a claim is lost (it committed;
//! its writer does not know), a request waits for a connection slot longer
//! than the settle window's margin, a request is lost before or after
//! taking effect, an answer comes after its request's deadline.
//!
//! The guards each stand for a clause of the real code (`Guards`, and
//! docs/testing.md, "The lease protocol, model-checked", which maps each to
//! its file and SQL); each can be removed to show that the checker then
//! finds the counterexample, or, for the two that others imply, that it
//! finds none (`checks.rs` says why).

#[cfg(test)]
mod checks;
pub mod props;
mod step;

pub use props::{PROPERTIES, done};

use stateright::{Model, Property};

/// How many replicas share the ledger.
pub const REPLICAS: usize = 2;
/// How many operations run on the one volume (an attach, then a detach).
pub const MAX_OPS: usize = 2;
/// Requests one operation may record (the caller's and one re-send).
pub const MAX_ATTEMPTS: u8 = 2;

/// The protocol's guards; each one off stands for the real code without it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Guards {
    /// A run's writes (a further attempt's record, a decision, a deferral)
    /// are fenced by its epoch: `transition_sql`'s `o.lease_epoch =
    /// u.epoch` (`store/pg/sql/write.rs`). Off: whatever the epoch.
    pub fence_epoch: bool,
    /// ... and only while the row is open: `o.completed_at IS NULL` (the
    /// same statement; the unsent mark has its own). Off: decided rows too.
    pub fence_open: bool,
    /// Renewals (the heartbeat's and the send gate's) name the epoch the
    /// replica holds the operation under: `RENEW_LEASES`'s `o.lease_epoch
    /// = req.epoch` beside `o.lease_owner = $3` (`store/pg/sql/mod.rs`).
    /// Off: the owner alone.
    pub renewal_epoch: bool,
    /// No re-send and no FAILED before the settle window after the last
    /// stamped request: `reconciler/pass.rs` `not_yet`. Off: the
    /// reconciler acts on its first look.
    pub settle_window: bool,
    /// A request leaves only while its lease is known to hold (by the last
    /// renewal, else by one made now): `executor/gate.rs`. Off: it leaves
    /// whatever the lease.
    pub send_gate: bool,
    /// The reconciler never claims an operation this replica holds:
    /// `claim_many_sql`'s `NOT (id = ANY($4))` with `Executor::held`.
    /// Off: it claims any expired lease.
    pub claim_skips_own_runs: bool,
    /// A takeover counts the settle window from the old lease's end:
    /// `TAKEOVER_RESTAMP` moves `last_request_at` up to the expired
    /// `lease_expires_at`, the latest its holder's request may have left
    /// (the gate lets none leave after). Off: from the attempt's record
    /// alone (a request that waited for a slot leaves later than that).
    pub takeover_restamps: bool,
    /// ... only when an attempt was recorded under the expiring lease's
    /// epoch and it is not marked unsent: `TAKEOVER_RESTAMP`'s
    /// `o.attempts > o.claim_attempts AND o.unsent_attempt IS DISTINCT FROM
    /// o.attempts` (`claim_attempts`: the attempts when the epoch began,
    /// stamped by each claim; the model's `attempt_epoch = epoch`). Off:
    /// every takeover of an expired lease restamps (a pass that only
    /// looked, a claim whose reply was lost, start the window again).
    pub restamp_needs_an_attempt: bool,
    /// A holder that hears its lease lost before its run's last recorded
    /// attempt passed the send gate marks that attempt unsent
    /// (`MARK_UNSENT`: `unsent_attempt = $n, next_attempt_at = now()
    /// WHERE attempts = $n AND completed_at IS NULL`: attempt counts are
    /// given out once each, so "still its last" is "recorded under its
    /// epoch and no later one", the model's `attempt_epoch` and
    /// `attempts`), and a pass decides a marked operation as one never sent, no
    /// settle window (`not_yet`). Off: it stops without a word.
    pub unsent_mark: bool,
    /// A write of a pass that did not see the mark (it claimed the row
    /// before the mark landed) leaves a marked row due now:
    /// `transition_sql`'s `next_attempt_at = CASE WHEN o.unsent_attempt =
    /// o.attempts AND NOT u.unsent_seen THEN now() ...`. Off: its deferral moves
    /// `next_attempt_at` to the end of the settle window, over the mark's.
    pub deferral_keeps_unsent_due: bool,
    /// The lease outlasts two round trips, a heartbeat and the gate's
    /// margin (`--lease` ≥ 2R + `--heartbeat` + the send margin, checked at
    /// start), so a holder whose renewals are slow but within the store's
    /// round-trip bound R keeps it. Off: a slow renewal may let it lapse.
    pub lease_outlasts_slow_renewals: bool,
}

impl Guards {
    /// The protocol as the real code makes it: every guard in place.
    pub const ALL: Guards = Guards {
        fence_epoch: true,
        fence_open: true,
        renewal_epoch: true,
        settle_window: true,
        send_gate: true,
        claim_skips_own_runs: true,
        takeover_restamps: true,
        restamp_needs_an_attempt: true,
        unsent_mark: true,
        deferral_keeps_unsent_due: true,
        lease_outlasts_slow_renewals: true,
    };
}

/// The model: which guards hold, how many operations, how many faults.
#[derive(Clone, Debug)]
pub struct LeaseModel {
    pub guards: Guards,
    /// 1 or 2: an attach, then (once it is decided) a detach.
    pub ops: usize,
    /// How many faults a history may play; after them, none.
    pub faults: u8,
}

/// A row's state (an absent row: the operation not submitted yet).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum RowState {
    Absent,
    InProgress,
    Unknown,
    Succeeded,
    Failed,
}

impl RowState {
    pub fn decided(self) -> bool {
        matches!(self, RowState::Succeeded | RowState::Failed)
    }
}

/// One operation's row in the ledger.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Row {
    pub state: RowState,
    pub owner: Option<u8>,
    pub epoch: u8,
    /// Past `lease_expires_at` on the database's clock (only with an owner).
    pub expired: bool,
    pub attempts: u8,
    /// The lease epoch the last attempt was recorded under (the intent's is
    /// 1): in the ledger, `attempts > claim_attempts` says it is the
    /// current epoch's.
    pub attempt_epoch: u8,
    /// The last attempt is known never to have left (the ledger's
    /// `unsent_attempt = attempts`).
    pub unsent: bool,
    /// The settle window after `last_request_at` has passed.
    pub settled: bool,
    /// `next_attempt_at` set to the end of the settle window (a deferral).
    pub wait_settle: bool,
    /// The operation's deadline has passed.
    pub deadline: bool,
}

/// What a task is about to do.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    /// A re-send: record the attempt (stamps `last_request_at`).
    RecordAttempt,
    /// The attempt is recorded; waiting for a connection slot or a token,
    /// then the gate and the request's first byte.
    PreSend,
    /// The intent's reply was lost: reading the row back, and renewing its
    /// lease if it is still this replica's under the intent's epoch
    /// (`intent_fate`). Its epoch is not known meanwhile, so the heartbeat
    /// does not renew it.
    ReadBack,
    /// The request left; its answer is awaited.
    AwaitNova,
    /// The answer was lost or came late: looking until the wanted state
    /// shows, or the deadline.
    Watch,
    /// A reconciler pass that claimed the row: its look is next.
    Look,
    /// A decision to write (fenced).
    Write(Decision),
    /// The lease was heard lost before the run's recorded attempt left:
    /// marking it unsent, then stopping.
    MarkUnsent,
    /// A database reply held by the network: what it said, read once it
    /// arrives.
    Reply(Reply),
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Decision {
    Succeeded,
    Failed,
    /// The executor's UNKNOWN at its deadline (stamps the request).
    Unknown,
    /// The reconciler's deferral until the settle window has passed.
    Defer,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reply {
    /// The attempt was recorded: on to the send.
    Recorded,
    /// The write landed; the caller (if any) hears this.
    Written(Option<Answer>),
    /// The write was fenced: the lease is lost.
    Fenced,
}

/// What a caller was told.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Answer {
    Succeeded,
    Failed,
    /// OUTCOME_UNKNOWN, DEADLINE_EXCEEDED or UNAVAILABLE: never a decision.
    Unknown,
}

/// A caller of one operation.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Caller {
    None,
    /// Waiting on its task, on this replica.
    Waiting(u8),
    /// Its task heard the lease lost: waiting, on this replica, for the
    /// row's decision (as a replay joins).
    Joined(u8),
    Answered(Answer),
}

/// A task of a replica on one operation.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct Task {
    pub op: u8,
    pub epoch: u8,
    pub phase: Phase,
    /// The lease is known to hold (the last renewal of the replica's hold
    /// on the operation is recent enough; shared by its tasks there).
    pub known_live: bool,
    /// A database reply to this task is held.
    pub held: bool,
    /// The caller waits on this task.
    pub caller: bool,
    /// The attempt whose request this task sent or will send.
    pub attempt: u8,
    /// Will leave, or left, within the margin of the last stamp.
    pub prompt: bool,
    /// A pass: its claim read the row marked unsent (`unsent_seen`).
    pub saw_unsent: bool,
}

#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct Replica {
    pub paused: bool,
    /// Its database replies are held past the round-trip bound (or lost).
    pub db_held: bool,
    /// Its database is slow, its replies within the round-trip bound.
    pub slow: bool,
    /// Sorted, so that equal states hash alike.
    pub tasks: Vec<Task>,
}

/// A request in Nova, not yet acted on.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct Request {
    pub op: u8,
    pub from: u8,
    pub attempt: u8,
    /// Left within the margin of its stamp: the settle window covers it.
    pub prompt: bool,
}

/// What the properties look at beyond the current rows (history).
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct Ghost {
    /// Each row's first decision.
    pub decided: [Option<RowState>; MAX_OPS],
    /// A request left while another of its operation could still act.
    pub overlap: bool,
    /// A decision was written that Nova's state did not bear out then.
    pub wrong_decision: bool,
    /// A request took effect after its operation was decided.
    pub late_effect: bool,
    /// Per operation: the holder of its last recorded attempt heard its
    /// lease lost before that attempt left, and stopped (alive: a crash
    /// tells nobody); no attempt was recorded since.
    pub unsent_known: [bool; MAX_OPS],
    /// Per operation: a pass saw its settle window ended; no request was
    /// stamped since.
    pub window_ended: [bool; MAX_OPS],
    /// An operation of `unsent_known` waited for a settle window: a pass
    /// deferred it, or a claim waited for the window's end.
    pub unsent_waited: bool,
    /// An operation of `window_ended` waited for a settle window again.
    pub window_waited_again: bool,
    /// A lease lapsed while its holder renewed it within the bound.
    pub live_lease_lapsed: bool,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct State {
    pub rows: [Row; MAX_OPS],
    pub attached: bool,
    pub effects: [u8; MAX_OPS],
    /// Sorted.
    pub nova: Vec<Request>,
    /// Answers of Nova not read yet: (replica, op, attempt), sorted.
    pub answers: Vec<(u8, u8, u8)>,
    pub replicas: [Replica; REPLICAS],
    pub callers: [Caller; MAX_OPS],
    pub faults_left: u8,
    pub ghost: Ghost,
}

/// One step of one actor.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Action {
    /// A caller submits operation `op` to replica `r`: the intent (its
    /// first attempt recorded, leased to `r`) and the executor task. With
    /// `r`'s database replies held, the intent commits and its holder
    /// hears so late (its lease may lapse meanwhile).
    Submit {
        op: u8,
        r: u8,
    },
    /// The reconciler of `r` claims `op`.
    Claim {
        op: u8,
        r: u8,
    },
    /// A step of task `t` of replica `r` (what it is depends on its phase).
    Task {
        r: u8,
        t: u8,
    },
    /// The gate and the request's first byte (task in `PreSend`).
    Send {
        r: u8,
        t: u8,
    },
    /// Task `t` reads its request's answer.
    ReadAnswer {
        r: u8,
        t: u8,
    },
    /// Task `t` stops awaiting its answer (lost; or, as a fault, late).
    Timeout {
        r: u8,
        t: u8,
    },
    /// The heartbeat of `r` renews the lease of task `t`'s operation.
    Renew {
        r: u8,
        t: u8,
    },
    /// A joined caller of `op` hears the row's decision.
    Notify {
        op: u8,
    },
    /// Nova acts on request `i` and answers.
    NovaAct {
        i: u8,
    },
    Expire {
        op: u8,
    },
    Settle {
        op: u8,
    },
    Deadline {
        op: u8,
    },
    Resume {
        r: u8,
    },
    ReleaseDb {
        r: u8,
    },
    /// `r`'s database answers within the bound again.
    Fast {
        r: u8,
    },
    // Faults.
    Crash {
        r: u8,
    },
    Pause {
        r: u8,
    },
    HoldDb {
        r: u8,
    },
    /// `r`'s database is slow: every round trip takes up to the bound.
    Slow {
        r: u8,
    },
    /// As `Submit`, and the intent's reply is lost: its caller hears
    /// UNAVAILABLE (outcome unknown) at once, its task reads the row back.
    SubmitReplyLost {
        op: u8,
        r: u8,
    },
    /// As `Claim`, and the claim's reply is lost: the row is `r`'s under a
    /// new epoch, and no task of `r` works on it (it lapses).
    ClaimReplyLost {
        op: u8,
        r: u8,
    },
    /// Task `t` waits for a slot longer than the settle window's margin.
    SlotWait {
        r: u8,
        t: u8,
    },
    /// Nova acts on request `i`, and its answer is lost.
    NovaActUnanswered {
        i: u8,
    },
    /// Request `i` is lost before Nova sees it.
    NovaLose {
        i: u8,
    },
}

impl Action {
    /// Drawn from the fault budget.
    pub fn is_fault(&self, s: &State) -> bool {
        match *self {
            Action::Crash { .. }
            | Action::Pause { .. }
            | Action::HoldDb { .. }
            | Action::Slow { .. }
            | Action::SubmitReplyLost { .. }
            | Action::ClaimReplyLost { .. }
            | Action::SlotWait { .. }
            | Action::NovaActUnanswered { .. }
            | Action::NovaLose { .. } => true,
            Action::Timeout { r, t } => step::timeout_is_late(s, r, t),
            _ => false,
        }
    }
}

impl LeaseModel {
    /// Whether a step other than a fault is enabled in `s`: where none is,
    /// a history ends once its faults stop.
    pub fn busy(&self, s: &State) -> bool {
        let mut actions = Vec::new();
        step::candidates(self, s, &mut actions);
        actions
            .into_iter()
            .any(|a| !a.is_fault(s) && step::apply(self, s, a).is_some())
    }

    /// The whole protocol: `ops` operations, `faults` faults.
    pub fn new(ops: usize, faults: u8) -> Self {
        assert!((1..=MAX_OPS).contains(&ops), "1 or 2 operations");
        LeaseModel {
            guards: Guards::ALL,
            ops,
            faults,
        }
    }

    pub fn with_guards(mut self, guards: Guards) -> Self {
        self.guards = guards;
        self
    }
}

impl Model for LeaseModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let row = Row {
            state: RowState::Absent,
            owner: None,
            epoch: 0,
            expired: false,
            attempts: 0,
            attempt_epoch: 0,
            unsent: false,
            settled: false,
            wait_settle: false,
            deadline: false,
        };
        vec![State {
            rows: [row.clone(), row],
            attached: false,
            effects: [0; MAX_OPS],
            nova: Vec::new(),
            answers: Vec::new(),
            replicas: Default::default(),
            callers: [Caller::None; MAX_OPS],
            faults_left: self.faults,
            ghost: Ghost::default(),
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        // Every candidate: `next_state` is `None` for those not enabled
        // (or that would change nothing, which would make a quiet state
        // look busy: it would never be terminal).
        step::candidates(self, s, actions);
    }

    fn next_state(&self, s: &State, a: Action) -> Option<State> {
        let fault = a.is_fault(s);
        if fault && s.faults_left == 0 {
            return None;
        }
        let mut next = step::apply(self, s, a)?;
        if fault {
            next.faults_left -= 1;
        }
        Some(next)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        props::properties()
    }
}
