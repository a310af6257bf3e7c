//! The service's windows as the checker knows them (settle, verification,
//! lease, the database's round-trip bound, the reconciler's pace), and the
//! bounds derived from them: how long after a database outage the service
//! may still be catching up, the latest instant an operation may be
//! decided, and the latest an operation Nova never saw may be UNKNOWN. Both
//! the waits of `play` and the invariants of `check` read them.

use chrono::{DateTime, Utc};
use std::time::Duration;

use super::dbfaults::DbOutage;
use crate::domain::Operation;

/// The service's windows, for the waits and the checks.
#[derive(Debug, Clone, Copy)]
pub struct Windows {
    pub settle: Duration,
    pub verify_after: Duration,
    pub verify_window: Duration,
    /// Extra time an operation may take past its deadline, its settle
    /// window and a lease (a takeover: its holder killed) before it counts
    /// as stuck (backoff, passes).
    pub slack: Duration,
    /// The replicas' lease (`--lease`): a holder cut off from the database
    /// loses its operations this long after its last renewal.
    pub lease: Duration,
    /// The replicas' bound of one database round trip
    /// (`--db-statement-timeout`).
    pub db_round_trip: Duration,
    /// How long a caller may still wait once its operation is decided
    /// (`answer-follows-decision`).
    pub answer_within: Duration,
    /// The replicas' pause between reconciler rounds when idle
    /// (`--reconcile-interval`), and their longest backoff of a pass
    /// (`--reconcile-max-backoff`).
    pub reconcile_interval: Duration,
    pub reconcile_max_backoff: Duration,
}

pub(super) fn ms(n: i64) -> chrono::Duration {
    chrono::Duration::milliseconds(n)
}

pub(super) fn dur(d: std::time::Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or_default()
}

/// How long after a database outage the service may still need to catch
/// up on what it held back: a round trip that went silent is given up at
/// the statement bound, a decision's next try comes at most 5 s after the
/// last (`executor::ledger`), a lease that lapsed meanwhile is taken over
/// one lease later, and a reconciler pass or two.
pub fn db_recovery(w: Windows) -> chrono::Duration {
    dur(w.db_round_trip + w.lease) + ms(5_000 + 2_000)
}

/// However many database outages an operation meets, it is decided (or
/// escalated) at most this long past its deadline, settle window and
/// slack.
pub const DB_BOUND_CAP: std::time::Duration = std::time::Duration::from_secs(120);

/// The latest instant an operation may be decided (or escalated): its
/// deadline, the settle window and the slack; or, when `outages` it met
/// (one that lasted into its life and began before that bound) ended
/// later, `db_recovery` after the last of them ended — an operation of a
/// database that is away is decided once the database is back, no sooner,
/// but not any time after either; and never past `DB_BOUND_CAP` beyond
/// the first bound.
pub fn decision_bound(op: &Operation, w: Windows, outages: &[DbOutage]) -> DateTime<Utc> {
    let now = Utc::now();
    let base = op.deadline_at + dur(w.settle + w.lease + w.slack);
    let mut bound = base;
    loop {
        let back = outages
            .iter()
            .filter(|o| o.until(now) >= op.created_at && o.from <= bound)
            .map(|o| o.until(now))
            .max();
        match back {
            Some(back) if back + db_recovery(w) > bound => bound = back + db_recovery(w),
            _ => break,
        }
    }
    bound.min(base + dur(DB_BOUND_CAP))
}

/// How long past its deadline an operation none of whose requests reached
/// Nova may stay `UNKNOWN` (`unseen-never-unknown`), whatever the settle
/// window: nothing of it can be working in Nova, so there is nothing to
/// wait for. Its run's last write (the UNKNOWN, which lets its lease go)
/// is made by the deadline, within a round trip of it; if that write did
/// not land, the lease lapses at most a lease after its last renewal; a
/// reconciler round then takes it within a few intervals (and a pass's
/// backoff), and a round costs three round trips (the claim, the
/// database's clock, the decision). Each round trip may take the whole
/// statement bound: a slow database stretches the bound that far, no
/// further.
pub fn unseen_slack(w: Windows) -> chrono::Duration {
    dur(w.lease + 4 * w.db_round_trip + 3 * w.reconcile_interval + w.reconcile_max_backoff)
}

/// The latest instant an operation Nova never saw may still be `UNKNOWN`:
/// its deadline and `unseen_slack`; or, when an outage that cut its
/// replicas off (`outages`: a slow database does not) lasted into that
/// bound, `db_recovery` after the last of them ended; never past
/// `DB_BOUND_CAP` beyond the first bound.
pub fn unseen_bound(op: &Operation, w: Windows, outages: &[DbOutage]) -> DateTime<Utc> {
    let now = Utc::now();
    let base = op.deadline_at + unseen_slack(w);
    let mut bound = base;
    loop {
        let back = outages
            .iter()
            .filter(|o| o.cuts_off() && o.until(now) >= op.created_at && o.from <= bound)
            .map(|o| o.until(now))
            .max();
        match back {
            Some(back) if back + db_recovery(w) > bound => bound = back + db_recovery(w),
            _ => break,
        }
    }
    bound.min(base + dur(DB_BOUND_CAP))
}
