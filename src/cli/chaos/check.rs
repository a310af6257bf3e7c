//! The invariants a played history must keep, checked against the
//! simulator's ground truth — every effect with its instant and cause —
//! not against what the service says of itself. Each check names the
//! operation it found wrong and why.
//!
//! Why it is long: one invariant per method over the same timeline types;
//! they are read together when a history fails.

use std::collections::HashMap;
use std::fmt;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::dbfaults::DbOutage;
use super::play::{Answer, Outcome, Played, Recorded};
use super::windows::{Windows, decision_bound, dur, ms, unseen_bound};
use crate::domain::{Action, Operation, Reason, Resolution, State, event};
use crate::sim::{Cause, Change, Effect};

/// The invariants, by name.
pub const INVARIANTS: &[&str] = &[
    "decided-in-time",
    "decision-matches-truth",
    "drift-is-real",
    "drift-is-seen",
    "one-effect-per-key",
    "intent-before-request",
    "answers-agree-with-ledger",
    "keys-are-per-caller",
    "busy-means-busy",
    "story-in-order",
    UNSEEN_NEVER_UNKNOWN,
    ANSWER_FOLLOWS_DECISION,
];

/// An operation none of whose requests reached Nova is never `UNKNOWN`
/// past `windows::unseen_bound`.
pub const UNSEEN_NEVER_UNKNOWN: &str = "unseen-never-unknown";

pub const ANSWER_FOLLOWS_DECISION: &str = "answer-follows-decision";

#[derive(Debug, Clone)]
pub struct Violation {
    pub invariant: &'static str,
    pub operation: Option<Uuid>,
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.operation {
            Some(id) => write!(f, "{} (operation {id}): {}", self.invariant, self.detail),
            None => write!(f, "{}: {}", self.invariant, self.detail),
        }
    }
}

/// A replica killed at an instant (its holders died then).
#[derive(Debug, Clone)]
pub struct Kill {
    pub replica: String,
    pub at: DateTime<Utc>,
}

/// Clock readings of PostgreSQL and of the simulator come from the same
/// machine, but a decision is stamped when its transaction began.
const TOLERANCE_MS: i64 = 100;

/// The attachment history of one (server, volume).
struct Timeline<'a> {
    effects: Vec<&'a Effect>,
}

impl<'a> Timeline<'a> {
    fn of(all: &'a [Effect], server: Uuid, volume: Uuid) -> Self {
        Self {
            effects: all
                .iter()
                .filter(|e| e.server_id == server && e.volume_id == volume)
                .collect(),
        }
    }

    /// Attached at `t` (unattached before the first effect).
    fn at(&self, t: DateTime<Utc>) -> bool {
        self.effects
            .iter()
            .take_while(|e| e.at <= t)
            .last()
            .is_some_and(|e| e.change == Change::Attached)
    }

    /// Whether the pair was `attached` at some instant in `[from, to]`.
    fn ever(&self, attached: bool, from: DateTime<Utc>, to: DateTime<Utc>) -> bool {
        self.at(from) == attached
            || self
                .effects
                .iter()
                .any(|e| e.at > from && e.at <= to && (e.change == Change::Attached) == attached)
    }
}

fn own_request(op: Uuid) -> String {
    crate::nova::RequestId::for_operation(op)
        .as_str()
        .to_string()
}

/// Whether the attach `effects[i]` was the one Nova rolled back next.
fn rolled_back(effects: &[Effect], i: usize) -> bool {
    let e = &effects[i];
    e.change == Change::Attached
        && effects[i + 1..]
            .iter()
            .find(|n| n.server_id == e.server_id && n.volume_id == e.volume_id)
            .is_some_and(|n| n.cause == Cause::RolledBack)
}

/// Whether the attach `effects[i]` was undone next by deleting its server
/// or its volume: what a look could have seen of it is gone with them.
fn deleted_after(effects: &[Effect], i: usize) -> bool {
    let e = &effects[i];
    e.change == Change::Attached
        && effects[i + 1..]
            .iter()
            .find(|n| n.server_id == e.server_id && n.volume_id == e.volume_id)
            .is_some_and(|n| matches!(n.cause, Cause::ServerDeleted | Cause::VolumeDeleted))
}

fn caused_by(e: &Effect, op: Uuid) -> bool {
    matches!(&e.cause, Cause::Request { request_id: Some(id) } if *id == own_request(op))
}

/// A database-fault answer (`DATABASE_UNAVAILABLE`) is honest while a
/// fault hit the answering replica's way to the database, or this soon
/// after it ended: once an outage is known the store refuses at once
/// until its probe connects, and a probe begun just before the end may
/// wait out the connect bound (the round-trip bound) before the next, a
/// probe pause later, connects; 2 s more for a statement sent on a silent
/// connection just before it spoke again, and a loaded machine.
fn db_answer_tail(w: Windows) -> chrono::Duration {
    dur(w.db_round_trip + crate::store::pg::PROBE_PAUSE) + ms(2_000)
}

/// Answers that decide nothing and say so, whenever they come: the
/// outcome is not known yet or nothing was done (a deadline, a busy
/// ledger, no replica, a key used for another request); with no reason, a
/// transport failure or the client's own timer.
const UNDECIDED: &[&str] = &[
    "OPERATION_IN_PROGRESS",
    "DATABASE_DEADLINE",
    "DEADLINE_EXCEEDED",
    "BUDGET_TOO_SMALL",
    "CLIENT_DEADLINE",
    "NO_REPLICA",
    "IDEMPOTENCY_KEY_REUSED",
    "LEDGER_OVERLOADED",
    "OVERLOADED",
    "CALLER_RATE_LIMITED",
];

struct Checker<'a> {
    p: &'a Played,
    windows: Windows,
    kills: &'a [Kill],
    outages: &'a [DbOutage],
    violations: Vec<Violation>,
    by_id: HashMap<Uuid, &'a Recorded>,
}

/// Checks one played history; empty when it kept every invariant.
pub fn check(p: &Played, windows: Windows, kills: &[Kill], outages: &[DbOutage]) -> Vec<Violation> {
    let mut c = Checker {
        p,
        windows,
        kills,
        outages,
        violations: Vec::new(),
        by_id: p.ops.iter().map(|r| (r.op.id, r)).collect(),
    };
    for r in &p.ops {
        c.decided_in_time(r);
        c.unseen_never_unknown(r);
        c.decision_matches_truth(r);
        c.drift(r);
        c.story(r);
    }
    c.effects();
    c.answers();
    c.violations
}

impl Checker<'_> {
    fn fail(&mut self, invariant: &'static str, op: Option<Uuid>, detail: String) {
        self.violations.push(Violation {
            invariant,
            operation: op,
            detail,
        });
    }

    /// The outages that could hold `r` up: the server's, and those of the
    /// replicas that held it (wrote its log, held its lease, or were taken
    /// over from).
    fn outages_of(&self, r: &Recorded) -> Vec<DbOutage> {
        let mut replicas: Vec<&str> = r.events.iter().map(|e| e.replica.as_str()).collect();
        replicas.extend(
            r.events
                .iter()
                .filter_map(|e| e.metadata.get("previous_holder").map(String::as_str)),
        );
        replicas.extend(r.op.lease_owner.as_deref());
        self.outages
            .iter()
            .filter(|o| o.replica.as_deref().is_none_or(|n| replicas.contains(&n)))
            .cloned()
            .collect()
    }

    /// Whether `replica` was cut off from the database (a fault on its way
    /// to it, or the server down) at some instant in `[from, to]`. A slow
    /// database does not cut it off: its statements arrive and act on
    /// time, only the replies are late, so it keeps its leases.
    fn cut_off(&self, replica: &str, from: DateTime<Utc>, to: DateTime<Utc>) -> bool {
        self.outages
            .iter()
            .any(|o| o.cuts_off() && o.hits(replica) && o.overlaps(from, to, ms(TOLERANCE_MS)))
    }

    /// How far back from a takeover its holder's lease may have stopped
    /// being renewed: a lease, and a renewal that waited out the
    /// statement bound, with room for a loaded machine.
    fn lease_lapse(&self) -> chrono::Duration {
        dur(self.windows.lease + self.windows.db_round_trip) + ms(2_000)
    }

    fn decided_in_time(&mut self, r: &Recorded) {
        let op = &r.op;
        let bound = decision_bound(op, self.windows, &self.outages_of(r));
        // Handed to people, with a reason, in time: that is a decision too.
        let settled = op.completed_at.or(op.escalated_at);
        match settled {
            Some(done) if done <= bound => {}
            Some(done) => self.fail(
                "decided-in-time",
                Some(op.id),
                format!(
                    "decided {} ms after its bound (deadline + settle window + lease + slack, + each database outage it met and the recovery from it)",
                    (done - bound).num_milliseconds()
                ),
            ),
            None => self.fail(
                "decided-in-time",
                Some(op.id),
                format!(
                    "still {} {} ms after its deadline (bound: settle window + lease + slack, + database outages and recovery)",
                    op.state.as_str(),
                    (Utc::now() - op.deadline_at).num_milliseconds()
                ),
            ),
        }
    }

    /// An operation Nova never received a request of has nothing working
    /// in Nova to wait for: it is never `UNKNOWN` past
    /// `windows::unseen_bound` (its deadline, a lease, four round-trip
    /// bounds and a few reconciler rounds), however long the settle
    /// window, and however slow the database.
    fn unseen_never_unknown(&mut self, r: &Recorded) {
        let op = &r.op;
        if self.received(op.id) > 0 {
            return;
        }
        let unknown_since = r
            .events
            .iter()
            .find(|e| e.kind == event::UNRESOLVED)
            .map(|e| e.at)
            .or((op.state == State::Unknown).then_some(op.created_at));
        let Some(since) = unknown_since else { return };
        let bound = unseen_bound(op, self.windows, &self.outages_of(r));
        let until = op.completed_at.or(op.escalated_at).unwrap_or_else(Utc::now);
        if until > bound {
            self.fail(
                UNSEEN_NEVER_UNKNOWN,
                Some(op.id),
                format!(
                    "UNKNOWN from {since} until {}, {} ms past its bound (deadline + lease + 4 round-trip bounds + 3 reconciler intervals + a pass's backoff, + outages that cut it off), though Nova never received a request of it",
                    op.completed_at
                        .or(op.escalated_at)
                        .map_or_else(|| "now".to_string(), |t| t.to_string()),
                    (until - bound).num_milliseconds()
                ),
            );
        }
    }

    fn decision_matches_truth(&mut self, r: &Recorded) {
        let op = &r.op;
        let (Some(done), true) = (op.completed_at, op.resolution != Some(Resolution::Operator))
        else {
            return;
        };
        let t = Timeline::of(&self.p.effects, op.server_id, op.volume_id);
        let (from, to) = (op.created_at - ms(TOLERANCE_MS), done + ms(TOLERANCE_MS));
        // A server or volume that no longer exists is an answer: the
        // attach FAILED (NOVA_SERVER_NOT_FOUND / NOVA_VOLUME_NOT_FOUND),
        // whether or not it had taken effect before the deletion undid it.
        let gone = op.last_error.as_ref().is_some_and(|e| {
            matches!(
                e.reason,
                crate::domain::Reason::NovaServerNotFound
                    | crate::domain::Reason::NovaVolumeNotFound
            )
        });
        let own = self.standing_at(op.id, done, gone);
        let wrong = match (op.action, op.state) {
            (Action::Attach, State::Succeeded) if !t.ever(true, from, to) => {
                Some("SUCCEEDED, but the volume was never attached to the server while it ran")
            }
            // Confirmed with Cinder, SUCCEEDED means usable: not an attach
            // Nova was about to roll back.
            (Action::Attach, State::Succeeded) if self.rolled_back_at(op, done) => {
                Some("SUCCEEDED, but the attach it saw was rolled back by Nova: never usable")
            }
            (Action::Detach, State::Succeeded) => (!t.ever(false, from, to))
                .then_some("SUCCEEDED, but the volume stayed attached to the server while it ran"),
            (_, State::Failed) if own > 0 => {
                Some("FAILED, but one of its own requests took effect")
            }
            // A refused attach may find the volume attached by someone
            // else: FAILED says this operation did nothing, and it did not.
            // A detach the deadline stopped before its first request
            // (NOT_SENT, BUDGET_EXHAUSTED with no attempt) says the same:
            // nothing was done, whatever the volume's state.
            (Action::Detach, State::Failed) if self.nothing_sent(op) => None,
            (Action::Detach, State::Failed) => {
                (!t.ever(true, from, to)).then_some("FAILED, but the volume was detached all along")
            }
            _ => None,
        };
        if let Some(why) = wrong {
            let reason = op
                .last_error
                .as_ref()
                .map(|e| e.reason.to_string())
                .unwrap_or_default();
            self.fail(
                "decision-matches-truth",
                Some(op.id),
                format!("{} {why} (reason {reason})", op.action.as_str()),
            );
        }
    }

    /// Whether the last attach of `op`'s volume to its server before
    /// `done` is one Nova rolled back.
    fn rolled_back_at(&self, op: &Operation, done: DateTime<Utc>) -> bool {
        let effects = &self.p.effects;
        (0..effects.len())
            .rev()
            .find(|i| {
                let e = &effects[*i];
                e.change == Change::Attached
                    && e.server_id == op.server_id
                    && e.volume_id == op.volume_id
                    && e.at <= done
            })
            .is_some_and(|i| rolled_back(effects, i))
    }

    /// `op`'s own effects that still stood when it was decided: not rolled
    /// back by Nova, and not undone by anyone before `done`. (An attach
    /// removed by someone else before the service could see it in use is
    /// FAILED rightly: SUCCEEDED promises a usable attachment.) Nor, when
    /// `gone`, undone by a deletion of its server or volume, nor undone
    /// unseen by someone else within a settle window.
    fn standing_at(&self, op: Uuid, done: DateTime<Utc>, gone: bool) -> usize {
        let effects = &self.p.effects;
        (0..effects.len())
            .filter(|i| {
                let e = &effects[*i];
                let undone_before = effects[i + 1..].iter().any(|n| {
                    n.server_id == e.server_id
                        && n.volume_id == e.volume_id
                        && n.at <= done + ms(TOLERANCE_MS)
                });
                let deleted = gone && deleted_after(effects, *i);
                let undone =
                    rolled_back(effects, *i) || deleted || self.undone_unseen(*i) || undone_before;
                caused_by(e, op) && !undone
            })
            .count()
    }

    /// Whether `effects[i]` was undone by someone else's hand less than a
    /// settle window later: a late effect that stood between two looks
    /// (one of which may have failed) is invisible to the attachment list,
    /// so a decision taken after it cannot be held to it.
    ///
    /// Later than that, too, when the operation logged no look between the
    /// effect and its undoing (its replica died before it could) and had
    /// nothing else to tell it by: an attach (no attachment id exists
    /// before it), or a detach whose intent named no attachment to remove
    /// (no Cinder look before sending). A detach that named one is held to
    /// it: its successor must see the attachment on the server is another.
    fn undone_unseen(&self, i: usize) -> bool {
        let effects = &self.p.effects;
        let e = &effects[i];
        let Some(n) = effects[i + 1..]
            .iter()
            .find(|n| n.server_id == e.server_id && n.volume_id == e.volume_id)
        else {
            return false;
        };
        if n.cause != Cause::OutOfBand {
            return false;
        }
        if n.at - e.at < dur(self.windows.settle) {
            return true;
        }
        let Some(r) = self.p.ops.iter().find(|r| caused_by(e, r.op.id)) else {
            return false;
        };
        let named = e.change == Change::Detached
            && r.events
                .iter()
                .any(|ev| ev.metadata.contains_key(crate::executor::DETACH_TARGET));
        let looked = r
            .events
            .iter()
            .any(|ev| ev.kind == event::OBSERVED && ev.at > e.at && ev.at < n.at);
        !named && !looked
    }

    /// How many of `op`'s requests Nova received.
    fn received(&self, op: Uuid) -> usize {
        let own = own_request(op);
        self.p
            .requests
            .iter()
            .filter(|q| q.global_id.as_deref() == Some(own.as_str()))
            .count()
    }

    /// When the verifier recorded `r`'s drift (its look; the end of the
    /// window at the earliest, later by a round or the rate limit).
    fn drift_seen_at(r: &Recorded) -> Option<DateTime<Utc>> {
        r.events
            .iter()
            .filter(|e| e.kind == event::DRIFT_DETECTED)
            .map(|e| e.at)
            .min()
    }

    /// The end of what a drift recorded at `seen` could have seen: `end`,
    /// or the look when it came later, but never past the next operation
    /// on the volume.
    fn looked_until(
        end: DateTime<Utc>,
        seen: Option<DateTime<Utc>>,
        next: Option<DateTime<Utc>>,
    ) -> DateTime<Utc> {
        match seen {
            Some(s) if s > end => next.map_or(s, |n| n.min(s)).max(end),
            _ => end,
        }
    }

    /// The first operation on the same volume created after `r` was
    /// decided: from then on, changes have an explanation.
    fn next_on_volume(&self, r: &Recorded) -> Option<DateTime<Utc>> {
        let done = r.op.completed_at?;
        self.p
            .ops
            .iter()
            .filter(|o| o.op.volume_id == r.op.volume_id && o.op.created_at > done)
            .map(|o| o.op.created_at)
            .min()
    }

    /// The earliest instant the look that decided `r` may have been made:
    /// `done` (the decision's write stamp) less the tolerance; or, when a
    /// database outage hit the replica that wrote the decision while the
    /// operation ran, the start of the first such outage (no sooner than
    /// the operation's creation): the write waited out the outage, the
    /// look came before it (a look at +0.2 s, its write 7.7 s later, the
    /// server deleted in between). An outage that ended
    /// shortly before the operation began counts too, for `db_recovery`
    /// after its end: a database just back (crash recovery, connections
    /// opened again, the writers' backlog) still holds writes up, and an
    /// event is stamped when its write commits, not when it happened (an
    /// operation created 21 ms after PostgreSQL came back from a SIGKILL, its
    /// Cinder look at about +0.1 s written at +1.4 s, the server deleted in
    /// between).
    fn decided_from(&self, r: &Recorded, done: DateTime<Utc>) -> DateTime<Utc> {
        let writer = r
            .events
            .iter()
            .rev()
            .find(|e| e.kind == event::RESOLVED)
            .map(|e| e.replica.as_str());
        let held = writer.and_then(|w| {
            self.outages
                .iter()
                .filter(|o| {
                    o.hits(w)
                        && o.from <= done
                        && o.until(Utc::now()) + super::windows::db_recovery(self.windows)
                            >= r.op.created_at
                })
                .map(|o| o.from)
                .min()
        });
        held.map_or(done, |from| from.max(r.op.created_at).min(done)) - ms(TOLERANCE_MS)
    }

    /// Whether a recorded drift that no unexplained change after the
    /// decision accounts for is backed all the same: by a change the last
    /// look saw late, one made between the deciding look and the
    /// decision's write, or someone else's change the decision left
    /// standing.
    fn drift_backed(
        &self,
        r: &Recorded,
        t: &Timeline<'_>,
        done: DateTime<Utc>,
        end: DateTime<Utc>,
        explained_from: Option<DateTime<Utc>>,
    ) -> bool {
        let op = &r.op;
        let baseline = op.action == Action::Attach;
        // A last look that ran late (a loaded machine) sees changes up to
        // its own instant: real drift too, unless a later operation began
        // before it.
        let seen_late = || {
            let Some(seen) = r.events.iter().find(|e| e.kind == event::DRIFT_DETECTED) else {
                return false;
            };
            let late_end = explained_from.map_or(seen.at, |n| n.min(seen.at));
            late_end > end
                && t.effects.iter().any(|e| {
                    e.at > done && e.at <= late_end + ms(TOLERANCE_MS) && !self.explained(e, done)
                })
                && t.ever(!baseline, done, late_end)
        };
        // A change between the look that decided and the decision's write
        // (stamped at its transaction's start) stands after the decision
        // too (an out-of-band attach 3 ms before the stamp).
        let look = self.decided_from(r, done);
        let changed_at_write = t.effects.iter().any(|e| {
            e.at > look
                && e.at <= end + ms(TOLERANCE_MS)
                && !caused_by(e, op.id)
                && !self.explained(e, done)
        }) && t.ever(!baseline, done, end);
        // A decision that left someone else's change standing (a detach
        // that found the volume attached again by another attachment, seed
        // 1058) leaves drift from its first instant.
        let left_standing = t.at(done) != baseline
            && t.effects
                .iter()
                .rev()
                .find(|e| e.at <= done)
                .is_some_and(|e| e.cause == Cause::OutOfBand)
            && t.ever(!baseline, done, end);
        changed_at_write || left_standing || seen_late()
    }

    /// The drift of a decided operation: a recorded drift is real
    /// (`drift-is-real`), and a change that stood unexplained from the first
    /// verification on was recorded (`drift-is-seen`).
    fn drift(&mut self, r: &Recorded) {
        let op = &r.op;
        let (Some(done), State::Succeeded) = (op.completed_at, op.state) else {
            if op.drifted && op.state == State::Failed {
                self.drift_of_failed(r);
            }
            return;
        };
        if op.resolution == Some(Resolution::Operator) {
            return;
        }
        let baseline = op.action == Action::Attach;
        let t = Timeline::of(&self.p.effects, op.server_id, op.volume_id);
        let window_end = done + dur(self.windows.verify_window);
        let explained_from = self.next_on_volume(r);
        let end = explained_from.map_or(window_end, |n| n.min(window_end));
        let unexplained = |e: &&&Effect| {
            e.at > done && e.at <= end + ms(TOLERANCE_MS) && !self.explained(e, done)
        };
        let changed =
            t.effects.iter().filter(unexplained).count() > 0 && t.ever(!baseline, done, end);
        if op.drifted && !changed && !self.drift_backed(r, &t, done, end, explained_from) {
            self.fail(
                "drift-is-real",
                Some(op.id),
                "marked drifted, but every change after its decision is explained by a later operation (or there was none)".into(),
            );
        }
        // A change the verifier must have seen: one that stood from the
        // first verification on until the window (or the next operation).
        // Never before the verifier's floor, whatever --verify-after says
        // (a change that stood from +0.5 s to +1.7 s, then explained by a
        // later operation before the first look at +2 s).
        let first_look = done
            + dur(self
                .windows
                .verify_after
                .max(crate::reconciler::VERIFY_MIN_LAG));
        let stood = |from: DateTime<Utc>| {
            end - from >= ms(1000)
                && t.at(from) != baseline
                && !t.effects.iter().any(|e| e.at > from && e.at <= end)
        };
        // A replica killed meanwhile takes its round's looks with it; the
        // next one may find a later operation that explains the volume.
        let killed = self
            .kills
            .iter()
            .any(|k| k.at >= first_look - ms(1000) && k.at <= end + ms(TOLERANCE_MS));
        // So does a database outage: the verifiers share one cursor over
        // decisions, and a slice taken by a round whose answer was lost
        // (a silent or reset connection, a crash) is not taken again; a
        // look that comes a whole window late is counted as missed, not
        // made (reconciler::verify). Any replica's outage, since any
        // replica's round may have taken the slice; and a round trip past
        // its end, for the rounds that were waiting on it.
        let db_away = self.outages.iter().any(|o| {
            o.overlaps(
                first_look - ms(1000),
                end + ms(TOLERANCE_MS),
                dur(self.windows.db_round_trip),
            )
        });
        if !op.drifted && changed && !killed && !db_away && stood(first_look - ms(TOLERANCE_MS)) {
            self.fail(
                "drift-is-seen",
                Some(op.id),
                format!(
                    "the volume was {} the server from its first verification on, unexplained, and no drift was recorded",
                    if baseline { "off" } else { "on" }
                ),
            );
        }
    }

    /// Whether a change is explained by an operation that began after
    /// `done` (a late effect of an earlier request, or a change by another
    /// hand, is not).
    fn explained(&self, e: &Effect, done: DateTime<Utc>) -> bool {
        let Cause::Request {
            request_id: Some(id),
        } = &e.cause
        else {
            return false;
        };
        self.p
            .ops
            .iter()
            .find(|r| own_request(r.op.id) == *id)
            .is_some_and(|r| r.op.created_at > done)
    }

    /// A FAILED operation marked drifted: a late effect of its own, or
    /// a change nobody explains, must have happened.
    fn drift_of_failed(&mut self, r: &Recorded) {
        let op = &r.op;
        let Some(done) = op.completed_at else { return };
        let next = self.next_on_volume(r);
        let window_end = done + dur(self.windows.verify_window);
        let end = Self::looked_until(
            next.map_or(window_end, |n| n.min(window_end)),
            Self::drift_seen_at(r),
            next,
        );
        let look = self.decided_from(r, done);
        let any = self.p.effects.iter().any(|e| {
            e.server_id == op.server_id
                && e.volume_id == op.volume_id
                && e.at > look
                && e.at <= end + ms(TOLERANCE_MS)
                && !self.explained(e, done)
        });
        if !any {
            self.fail(
                "drift-is-real",
                Some(op.id),
                "a FAILED operation marked drifted, but nothing changed that it did not explain"
                    .into(),
            );
        }
    }

    fn effects(&mut self) {
        // Effects per request id; an attach Nova itself rolled back (the
        // hypervisor failed it) does not count: a new one is no duplicate.
        // Nor does an effect someone else undid before a look could see it
        // (within a settle window): a replica that died before logging the
        // answer leaves its successor a volume as if nothing happened, and
        // past the settle window it re-sends, rightly.
        let mut per_op: HashMap<String, usize> = HashMap::new();
        for (i, e) in self.p.effects.iter().enumerate() {
            if let Cause::Request {
                request_id: Some(id),
            } = &e.cause
                && !rolled_back(&self.p.effects, i)
                && !self.undone_unseen(i)
            {
                *per_op.entry(id.clone()).or_default() += 1;
            }
        }
        for r in &self.p.ops {
            let n = per_op.remove(&own_request(r.op.id)).unwrap_or(0);
            if n > 1 {
                self.fail(
                    "one-effect-per-key",
                    Some(r.op.id),
                    format!("{n} effects in Nova for one idempotency key"),
                );
            }
        }
        for (id, n) in per_op {
            self.fail(
                "intent-before-request",
                None,
                format!("{n} effect(s) from request {id}, which no operation in the ledger sent"),
            );
        }
        self.one_holder_per_volume();
        self.intent_before_request();
    }

    /// Never two attachments of one (non-multiattach) volume.
    fn one_holder_per_volume(&mut self) {
        let mut holders: HashMap<Uuid, Vec<Uuid>> = HashMap::new();
        for e in &self.p.effects {
            let h = holders.entry(e.volume_id).or_default();
            match e.change {
                Change::Attached => h.push(e.server_id),
                Change::Detached => h.retain(|s| *s != e.server_id),
            }
            if h.len() > 1 {
                self.fail(
                    "one-effect-per-key",
                    None,
                    format!(
                        "volume {} attached to {} servers at once",
                        e.volume_id,
                        h.len()
                    ),
                );
            }
        }
    }

    /// Nova never received a request of an operation before its intent was
    /// recorded.
    fn intent_before_request(&mut self) {
        for r in &self.p.ops {
            let first = self
                .p
                .requests
                .iter()
                .filter(|q| q.global_id.as_deref() == Some(own_request(r.op.id).as_str()))
                .map(|q| q.received_at)
                .min();
            let recorded = r
                .events
                .iter()
                .find(|e| e.kind == event::RECORDED)
                .map(|e| e.at);
            if let (Some(first), Some(rec)) = (first, recorded)
                && first + ms(TOLERANCE_MS) < rec
            {
                self.fail(
                    "intent-before-request",
                    Some(r.op.id),
                    format!(
                        "Nova received its first request {} ms before the intent was recorded",
                        (rec - first).num_milliseconds()
                    ),
                );
            }
        }
    }

    /// Every answer is a decision the ledger holds (the very operation of
    /// the caller's key, in the state it ended in), or one that decides
    /// nothing and says so; `DATABASE_UNAVAILABLE` only while the
    /// database was away from the replica that answered.
    fn answers(&mut self) {
        for a in &self.p.answers {
            match &a.outcome {
                Outcome::Cancelled => {}
                Outcome::Decided { op_id, state } => self.told(a, *op_id, Some(state.as_str())),
                Outcome::Refused { reason, .. } if reason == "VOLUME_BUSY" => self.busy(a),
                // A decision (FAILED) or UNKNOWN: the operation's own.
                Outcome::Refused {
                    op_id: Some(id),
                    state: Some(state),
                    ..
                } => self.told(a, *id, Some(state)),
                Outcome::Refused {
                    code,
                    reason,
                    op_id,
                    message,
                    ..
                } => {
                    if let Some(id) = op_id {
                        self.told(a, *id, None);
                    }
                    self.undecided(a, *code, reason, message);
                }
            }
        }
    }

    /// The ledger operation `a` names: known, the caller's own, of the
    /// call's key; when `told` a state, not the opposite of how it ended.
    fn told(&mut self, a: &Answer, id: Uuid, told: Option<&str>) {
        let Some(r) = self.by_id.get(&id).copied() else {
            self.fail(
                "answers-agree-with-ledger",
                Some(id),
                format!(
                    "call {} (key {:?}) was answered about operation {id}, which the ledger does not hold",
                    a.call, a.key
                ),
            );
            return;
        };
        if r.op.caller.as_deref() != Some(a.caller.as_str()) {
            self.fail(
                "keys-are-per-caller",
                Some(id),
                format!(
                    "caller {} (call {}, key {:?}) was answered about an operation of caller {:?}",
                    a.caller, a.call, a.key, r.op.caller
                ),
            );
            return;
        }
        let reused = matches!(&a.outcome, Outcome::Refused { reason, .. } if reason == "IDEMPOTENCY_KEY_REUSED");
        if r.op.idempotency_key != a.key {
            self.fail(
                "answers-agree-with-ledger",
                Some(id),
                format!(
                    "call {} (key {:?}) was answered about the operation of key {:?}",
                    a.call, a.key, r.op.idempotency_key
                ),
            );
        } else if reused && self.same_request(a, &r.op) {
            self.fail(
                "answers-agree-with-ledger",
                Some(id),
                format!(
                    "call {} was told IDEMPOTENCY_KEY_REUSED, but its key's operation is the very request it made",
                    a.call
                ),
            );
        }
        let final_state = r.op.state.as_str();
        let contradicts = matches!(
            (told, final_state),
            (Some("succeeded"), "failed") | (Some("failed"), "succeeded")
        );
        if contradicts {
            self.fail(
                "answers-agree-with-ledger",
                Some(id),
                format!(
                    "call {} was told {} but the operation ended {final_state}",
                    a.call,
                    told.unwrap_or_default()
                ),
            );
        }
    }

    /// Whether `op` is what call `a` asked for.
    fn same_request(&self, a: &Answer, op: &Operation) -> bool {
        let h = &self.p.history;
        let c = &h.calls[a.call];
        op.action == c.action
            && op.server_id == h.servers[c.server]
            && op.volume_id == h.volumes[c.volume]
    }

    /// An answer without a decision: one of those that say so, and a
    /// database failure only while the database was away.
    fn undecided(&mut self, a: &Answer, code: tonic::Code, reason: &str, message: &str) {
        use tonic::Code;
        let transport = reason.is_empty()
            && matches!(
                code,
                Code::Cancelled | Code::DeadlineExceeded | Code::Unavailable
            );
        if transport || UNDECIDED.contains(&reason) {
            return;
        }
        if reason == "DATABASE_UNAVAILABLE" {
            let away = a.replica.as_deref().is_some_and(|replica| {
                self.outages.iter().any(|o| {
                    o.hits(replica)
                        && o.overlaps(a.sent_at, a.answered_at, db_answer_tail(self.windows))
                })
            });
            if !away {
                self.fail(
                    "answers-agree-with-ledger",
                    None,
                    format!(
                        "call {} (key {:?}) was answered DATABASE_UNAVAILABLE by {} while no database fault hit it: {message}",
                        a.call,
                        a.key,
                        a.replica.as_deref().unwrap_or("?")
                    ),
                );
            }
            return;
        }
        self.fail(
            "answers-agree-with-ledger",
            None,
            format!(
                "call {} (key {:?}) was answered {code:?} {reason:?} ({message}): neither a decision the ledger holds nor an answer that says nothing was decided",
                a.call, a.key
            ),
        );
    }

    /// `VOLUME_BUSY` (whether or not it names the holder): some other
    /// operation on the call's volume was open at that instant; and a
    /// holder it names is that operation, and the caller's own.
    fn busy(&mut self, a: &Answer) {
        let h = &self.p.history;
        let c = &h.calls[a.call];
        let volume = h.volumes[c.volume];
        let (named, meta_volume) = match &a.outcome {
            Outcome::Refused { op_id, meta, .. } => (*op_id, meta.get("volume_id").cloned()),
            _ => (None, None),
        };
        if meta_volume.as_deref() != Some(volume.to_string().as_str()) {
            self.fail(
                "busy-means-busy",
                named,
                format!(
                    "call {} on volume {volume} was told VOLUME_BUSY of volume {meta_volume:?}",
                    a.call
                ),
            );
        }
        let own = self
            .p
            .ops
            .iter()
            .find(|r| {
                r.op.caller.as_deref() == Some(a.caller.as_str()) && r.op.idempotency_key == a.key
            })
            .map(|r| r.op.id);
        let open_then = |r: &Recorded| {
            r.op.volume_id == volume
                && Some(r.op.id) != own
                && r.op.created_at <= a.answered_at + ms(TOLERANCE_MS)
                && r.op
                    .completed_at
                    .is_none_or(|d| d + ms(TOLERANCE_MS) >= a.sent_at)
        };
        let holders: Vec<Uuid> = self
            .p
            .ops
            .iter()
            .filter(|r| open_then(r))
            .map(|r| r.op.id)
            .collect();
        if holders.is_empty() {
            self.fail(
                "busy-means-busy",
                named,
                format!(
                    "call {} was told VOLUME_BUSY, but no other operation on volume {volume} was open then",
                    a.call
                ),
            );
            return;
        }
        if let Some(id) = named {
            if !holders.contains(&id) {
                self.fail(
                    "busy-means-busy",
                    Some(id),
                    format!(
                        "call {} was told VOLUME_BUSY by operation {id}, which was not open on the volume then",
                        a.call
                    ),
                );
            }
            let holder_caller = self.by_id.get(&id).and_then(|r| r.op.caller.clone());
            if holder_caller.as_deref() != Some(a.caller.as_str()) {
                self.fail(
                    "keys-are-per-caller",
                    Some(id),
                    format!(
                        "VOLUME_BUSY to caller {} (call {}) named operation {id} of caller {holder_caller:?}",
                        a.caller, a.call
                    ),
                );
            }
        }
    }

    /// Decided FAILED before its first request reached Nova: it claims
    /// nothing about the volume, only that this operation did nothing.
    fn nothing_sent(&self, op: &Operation) -> bool {
        let own = own_request(op.id);
        op.last_error
            .as_ref()
            .is_some_and(|e| matches!(e.reason, Reason::NotSent | Reason::BudgetExhausted))
            && !self
                .p
                .requests
                .iter()
                .any(|q| q.global_id.as_deref() == Some(own.as_str()))
    }

    fn killed_between(&self, replica: &str, from: DateTime<Utc>, to: DateTime<Utc>) -> bool {
        self.kills.iter().any(|k| {
            k.replica == replica && k.at >= from - ms(TOLERANCE_MS) && k.at <= to + ms(TOLERANCE_MS)
        })
    }

    /// Whether `holder` recorded `op` while its database was slow: the
    /// intent acted at once, but its answer came a latency later, past the
    /// call's deadline, so the run ended not knowing it held the lease,
    /// and nobody renewed it (the first `taken over` of such a row is the
    /// recovery, and the run that gave up decides nothing about it).
    fn recorded_unheard(&self, holder: &str, op: &Operation) -> bool {
        self.outages.iter().any(|o| {
            o.latency.is_some()
                && o.hits(holder)
                && o.overlaps(
                    op.created_at - ms(TOLERANCE_MS),
                    op.created_at + ms(TOLERANCE_MS),
                    chrono::Duration::zero(),
                )
        })
    }

    /// A claim takes an operation over from its holder only when that
    /// holder stopped renewing its lease: in a chaos run, because it was
    /// killed (a decision or a shutdown releases the lease, so takes no
    /// claim). A claim from a holder that was never killed while the
    /// operation was open took over live work (the executor's own replica
    /// or another), whose answer from Nova the fence then drops.
    fn taken_from_the_dead(&mut self, r: &Recorded, e: &crate::domain::OperationEvent) {
        let Some(prev) = e.metadata.get("previous_holder") else {
            return;
        };
        // Or was cut off from the database long enough for its lease to
        // lapse: it stopped renewing as a dead one does.
        if !self.killed_between(prev, r.op.created_at, e.at)
            && !self.cut_off(prev, e.at - self.lease_lapse(), e.at)
            && !self.recorded_unheard(prev, &r.op)
        {
            self.fail(
                "story-in-order",
                Some(r.op.id),
                format!(
                    "{} took it over at {} from {prev}, which was never killed nor cut off from the database while it held the operation",
                    e.replica, e.at
                ),
            );
        }
    }

    /// The reconcile log tells the story in order: a request is followed
    /// by its outcome, or taken over only after its holder died; and it
    /// claims no request Nova never received.
    fn story(&mut self, r: &Recorded) {
        let mut pending: Option<&crate::domain::OperationEvent> = None;
        for e in &r.events {
            match e.kind.as_str() {
                k if k == event::REQUEST_SENT => pending = Some(e),
                k if k == event::RESPONSE || k == event::REQUEST_FAILED => pending = None,
                k if k == event::CLAIMED || k == event::OPERATOR_RESOLVED => {
                    if k == event::CLAIMED {
                        self.taken_from_the_dead(r, e);
                    }
                    if let Some(sent) = pending.take()
                        && !self.killed_between(&sent.replica, sent.at, e.at)
                        && !self.cut_off(&sent.replica, e.at - self.lease_lapse(), e.at)
                    {
                        self.fail(
                            "story-in-order",
                            Some(r.op.id),
                            format!(
                                "{} at {} took over while the request sent by {} at {} was still awaited and its holder was alive and reached the database",
                                e.kind, e.at, sent.replica, sent.at
                            ),
                        );
                    }
                }
                _ => {}
            }
        }
        let logged = r
            .events
            .iter()
            .filter(|e| e.kind == event::REQUEST_SENT)
            .count();
        let never_left = r
            .events
            .iter()
            .filter(|e| {
                e.kind == event::REQUEST_FAILED
                    && e.metadata.get("may_have_reached_nova").map(String::as_str) == Some("false")
            })
            .count();
        let received = self.received(r.op.id);
        if logged > received + never_left {
            self.fail(
                "story-in-order",
                Some(r.op.id),
                format!(
                    "the log says {logged} request(s) were sent, Nova received {received} and {never_left} provably never left"
                ),
            );
        }
    }
}
