//! The database's clock as this replica can bound it: the latest time
//! PostgreSQL's `now()` can read at a given instant of this process, from
//! round trips whose answers carry the server's time.
//!
//! An intent carries such a bound (`NewOperation::record_by`): a statement
//! of it that reaches the server after it (a proxy or a network that held
//! its bytes while the service gave up on it) inserts nothing, so that an
//! intent its task read back and gave up on can never be recorded behind
//! its back (tests/faults/db_faults.rs).
//!
//! A round trip sent at `sent` whose answer carries the server's `now()`
//! `db` bounds the server's clock from above at any later instant `t`:
//! `db + (t − sent)`, the server having read `db` no earlier than `sent`.
//! The tightest such bound is kept; it is widened by a drift allowance as
//! it ages (two clocks drift apart by parts per million), and a sample
//! that contradicts it (the server's clock stepped forward) replaces it.

use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::time::Instant;

/// How fast the two clocks may drift apart, at most: 1,000 parts per
/// million (an NTP-disciplined clock stays well within it; the bound is
/// refreshed every second or so, by the reconciler's rounds and by the
/// intents' own round trips).
const DRIFT_PPM: u32 = 1000;

/// The tightest upper bound of the server's clock the round trips gave.
#[derive(Debug, Default)]
pub(super) struct DbClock {
    best: Mutex<Option<Sample>>,
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    /// The server's `now()` as the answer carried it.
    db: DateTime<Utc>,
    /// When the round trip was sent.
    sent: Instant,
}

impl Sample {
    /// The latest the server's clock can read at `t` (not before `sent`).
    fn upper(&self, t: Instant) -> DateTime<Utc> {
        let since = t.saturating_duration_since(self.sent);
        self.db + chrono_of(since + since / 1_000_000 * DRIFT_PPM)
    }
}

fn chrono_of(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
}

impl DbClock {
    /// A round trip sent at `sent` and answered at `answered` whose answer
    /// carried the server's `now()`, `db`.
    pub(super) fn observe(&self, sent: Instant, answered: Instant, db: DateTime<Utc>) {
        let new = Sample { db, sent };
        let mut best = self.best.lock().unwrap_or_else(|p| p.into_inner());
        let keep = best.is_some_and(|b| {
            let bound = b.upper(answered);
            // Tighter than the new one, and not contradicted by it (the
            // server read `db` at `answered` at the latest).
            bound <= new.upper(answered) && db <= bound
        });
        if !keep {
            *best = Some(new);
        }
    }

    /// The latest the server's clock can read at `t`; `None` before any
    /// round trip told it.
    pub(super) fn latest_at(&self, t: Instant) -> Option<DateTime<Utc>> {
        let best = *self.best.lock().unwrap_or_else(|p| p.into_inner());
        best.map(|b| b.upper(t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + s, 0).expect("a time")
    }

    #[test]
    fn the_tightest_round_trip_bounds_the_server_clock_from_above() {
        let clock = DbClock::default();
        let t0 = Instant::now();
        assert_eq!(clock.latest_at(t0), None);
        // Sent at t0, the server read 100 s: at t0 + 5 s it reads at most
        // 105 s (and the drift allowance, 5 ms).
        clock.observe(t0, t0 + Duration::from_millis(40), at(100));
        let b = clock.latest_at(t0 + Duration::from_secs(5)).unwrap();
        assert!(
            b >= at(105) && b <= at(105) + chrono::Duration::milliseconds(6),
            "{b}"
        );
        // A round trip that bounds it less tightly (the server read 101.5 s
        // at t0 + 1 s or later: at most 105.5 s at t0 + 5 s) keeps it.
        clock.observe(
            t0 + Duration::from_secs(1),
            t0 + Duration::from_secs(2),
            at(101) + chrono::Duration::milliseconds(500),
        );
        let b = clock.latest_at(t0 + Duration::from_secs(5)).unwrap();
        assert!(b <= at(105) + chrono::Duration::milliseconds(6), "{b}");
        // A tighter one replaces it.
        clock.observe(
            t0 + Duration::from_secs(2),
            t0 + Duration::from_secs(2),
            at(101),
        );
        let b = clock.latest_at(t0 + Duration::from_secs(5)).unwrap();
        assert!(
            b >= at(104) && b <= at(104) + chrono::Duration::milliseconds(4),
            "{b}"
        );
    }

    #[test]
    fn a_server_clock_stepped_forward_replaces_the_bound() {
        let clock = DbClock::default();
        let t0 = Instant::now();
        clock.observe(t0, t0, at(100));
        // 10 s later the server reads 130 s: its clock jumped 20 s.
        let t1 = t0 + Duration::from_secs(10);
        clock.observe(t1, t1 + Duration::from_millis(1), at(130));
        let b = clock.latest_at(t1 + Duration::from_secs(1)).unwrap();
        assert!(b >= at(131), "{b}");
    }

    #[test]
    fn an_old_bound_widens_with_the_drift_allowance() {
        let clock = DbClock::default();
        let t0 = Instant::now();
        clock.observe(t0, t0, at(0));
        let hour = Duration::from_secs(3600);
        let b = clock.latest_at(t0 + hour).unwrap();
        assert_eq!(b, at(3600) + chrono::Duration::milliseconds(3600));
    }
}
