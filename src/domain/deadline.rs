//! Deadlines and budgets: the caller's deadline is the only upper bound of a
//! request. This module turns it into the instants each stage works under.
//!
//! | stage                         | bounded by                                   |
//! |-------------------------------|----------------------------------------------|
//! | whole RPC (server answers by) | caller deadline − safety margin (`answer_by`) |
//! | each Nova request             | min(`answer_by` − reserve, now + cap)        |
//! | re-observation after a loss   | `answer_by`                                  |
//! | database waits                | `answer_by` (statement timeout, acquire)     |
//! | connection setup (TCP, TLS)   | short constants (3 s, 5 s): not server work   |

use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::time::Instant;

/// The instant by which a request must be finished, as the deadline layer
/// derived it from `grpc-timeout` (or from the server default when the
/// caller sent none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline {
    pub at: Instant,
    /// False when the server default applied because the caller sent none.
    pub from_caller: bool,
}

impl Deadline {
    /// A deadline so far away it never fires: used for work that has no
    /// caller (streams without a deadline).
    pub fn none() -> Self {
        Self {
            at: far_future(),
            from_caller: false,
        }
    }

    pub fn remaining(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }
}

/// Ten years from now: "no deadline" without overflow arithmetic.
pub fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(10 * 365 * 24 * 3600)
}

/// The rules that split a caller's remaining time into stages. Every number
/// is a flag (see `config/serve.rs`).
#[derive(Debug, Clone, Copy)]
pub struct BudgetPolicy {
    /// Share of the remaining time kept to answer before the caller gives up.
    pub margin_fraction: f64,
    pub margin_min: Duration,
    pub margin_max: Duration,
    /// Share of the remaining time kept back to re-observe after a loss.
    pub reserve_fraction: f64,
    pub reserve_max: Duration,
    /// The longest a single Nova request may take (policy, not transport).
    pub per_call_cap: Duration,
    /// Below this much time for the Nova request, Nova is not called at all.
    pub min_budget: Duration,
}

impl BudgetPolicy {
    /// The built-in defaults: the one source of the flags' defaults too
    /// (`config/serve.rs` refers to these; a test checks they agree).
    pub const DEFAULT: Self = Self {
        margin_fraction: 0.05,
        margin_min: Duration::from_millis(50),
        margin_max: Duration::from_secs(2),
        reserve_fraction: 0.20,
        reserve_max: Duration::from_secs(5),
        per_call_cap: Duration::from_secs(3600),
        min_budget: Duration::from_millis(100),
    };
}

impl Default for BudgetPolicy {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// The plan for one operation, fixed when the RPC arrives.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    /// The RPC answers by then; the operation's own deadline.
    pub answer_by: Instant,
    /// No Nova request runs past this instant: time after it is the reserve
    /// for re-observation.
    pub send_by: Instant,
    pub margin: Duration,
    pub reserve: Duration,
}

impl Budget {
    /// A budget for work that only looks (a reconciler pass): nothing is
    /// sent, the look ends by `until`.
    pub fn observe_only(until: Instant) -> Self {
        Self {
            answer_by: until,
            send_by: until,
            margin: Duration::ZERO,
            reserve: Duration::ZERO,
        }
    }

    /// Observations stop a slice before `answer_by` (a quarter of the
    /// reserve, at most 250 ms), so the decision can be written and
    /// answered in time: a durable write on a loaded machine takes tens of
    /// milliseconds, so a short reserve's tenth (28 ms of a 1.5 s call's)
    /// was too little, and the caller heard "in progress" where "unknown"
    /// was already known.
    pub fn observe_by(&self) -> Instant {
        let slice = (self.reserve / 4).min(Duration::from_millis(250));
        self.answer_by.checked_sub(slice).unwrap_or(self.answer_by)
    }

    /// The budget of work resumed from a ledger row whose own deadline is
    /// `deadline_at` (the answer-by instant, so no margin), read when the
    /// database's clock said `db_now` (no replica's clock enters it): the
    /// reserve comes off the end. `None` when too little is left to send
    /// again.
    pub fn from_row(
        policy: &BudgetPolicy,
        deadline_at: DateTime<Utc>,
        db_now: DateTime<Utc>,
    ) -> Option<Budget> {
        let now = Instant::now();
        let left = (deadline_at - db_now).to_std().ok()?;
        if left.is_zero() {
            return None;
        }
        let answer_by = now + left;
        let reserve = policy.reserve_for(answer_by - now);
        let send_by = answer_by.checked_sub(reserve).unwrap_or(now);
        if send_by.saturating_duration_since(now) < policy.min_budget {
            return None;
        }
        Some(Budget {
            answer_by,
            send_by,
            margin: Duration::ZERO,
            reserve,
        })
    }
}

/// This replica's wall clock: `Utc::now()` plus a configured offset (zero
/// in production; tests move one replica's clock to check that nothing
/// depends on replicas agreeing), and the conversions between wall-clock
/// timestamps (the ledger's) and monotonic instants (the process's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Clock {
    offset_ms: i64,
}

impl Clock {
    /// The real clock.
    pub const SYSTEM: Clock = Clock { offset_ms: 0 };

    /// A clock `offset` ahead of the system's (behind when negative).
    pub fn skewed(offset: chrono::Duration) -> Self {
        Self {
            offset_ms: offset.num_milliseconds(),
        }
    }

    pub fn offset(&self) -> chrono::Duration {
        chrono::Duration::milliseconds(self.offset_ms)
    }

    pub fn now(&self) -> DateTime<Utc> {
        Utc::now() + self.offset()
    }

    /// The wall-clock time of a monotonic instant (in the future or now).
    pub fn wall_of(&self, at: Instant) -> DateTime<Utc> {
        let d = at.saturating_duration_since(Instant::now());
        self.now() + chrono::Duration::from_std(d).unwrap_or(chrono::Duration::days(3650))
    }

    /// The monotonic instant of a wall-clock time (now, if it is past).
    pub fn instant_of(&self, at: DateTime<Utc>) -> Instant {
        let d = (at - self.now()).to_std().unwrap_or(Duration::ZERO);
        Instant::now() + d
    }
}

/// The caller's time is too short to call Nova at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetTooSmall {
    pub available: Duration,
    pub minimum: Duration,
}

impl BudgetPolicy {
    pub fn margin_for(&self, remaining: Duration) -> Duration {
        remaining
            .mul_f64(self.margin_fraction)
            .clamp(self.margin_min, self.margin_max)
    }

    pub fn reserve_for(&self, remaining: Duration) -> Duration {
        remaining
            .mul_f64(self.reserve_fraction)
            .min(self.reserve_max)
    }

    /// Splits the time until `deadline` into the answer, send and reserve
    /// instants. Example: 8 s remaining → margin 0.4 s, reserve 1.6 s: the
    /// request gets 6 s, the look 1.6 s, the answer leaves by 7.6 s.
    pub fn plan(&self, now: Instant, deadline: Instant) -> Result<Budget, BudgetTooSmall> {
        let remaining = deadline.saturating_duration_since(now);
        let margin = self.margin_for(remaining);
        let reserve = self.reserve_for(remaining);
        let answer_by = deadline.checked_sub(margin).unwrap_or(now).max(now);
        let send_by = answer_by.checked_sub(reserve).unwrap_or(now).max(now);
        let available = send_by.saturating_duration_since(now);
        if available < self.min_budget {
            return Err(BudgetTooSmall {
                available,
                minimum: self.min_budget,
            });
        }
        Ok(Budget {
            answer_by,
            send_by,
            margin,
            reserve,
        })
    }

    /// The deadline of the next Nova request: min(send_by, now + cap).
    pub fn outbound(&self, budget: &Budget, now: Instant) -> Instant {
        budget.send_by.min(now + self.per_call_cap)
    }

    /// Whether another request still fits before `send_by`.
    pub fn can_send_again(&self, budget: &Budget, now: Instant) -> bool {
        budget.send_by.saturating_duration_since(now) >= self.min_budget
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn eight_seconds_split_as_documented() {
        let p = BudgetPolicy::default();
        let now = Instant::now();
        let b = p.plan(now, now + Duration::from_secs(8)).unwrap();
        assert_eq!(b.margin, ms(400));
        assert_eq!(b.reserve, ms(1600));
        assert_eq!(b.answer_by - now, ms(7600));
        assert_eq!(p.outbound(&b, now) - now, ms(6000));
    }

    #[test]
    fn observation_leaves_a_quarter_of_the_reserve_for_the_decision() {
        let p = BudgetPolicy::default();
        let now = Instant::now();
        // 1.5 s: reserve 300 ms, the last 75 ms kept to write the decision.
        let b = p.plan(now, now + ms(1500)).unwrap();
        assert_eq!(b.answer_by - b.observe_by(), ms(75));
        // Long calls: at most 250 ms.
        let b = p.plan(now, now + Duration::from_secs(60)).unwrap();
        assert_eq!(b.answer_by - b.observe_by(), ms(250));
    }

    #[test]
    fn margin_and_reserve_are_clamped() {
        let p = BudgetPolicy::default();
        assert_eq!(p.margin_for(ms(100)), ms(50));
        assert_eq!(
            p.margin_for(Duration::from_secs(3600)),
            Duration::from_secs(2)
        );
        assert_eq!(
            p.reserve_for(Duration::from_secs(3600)),
            Duration::from_secs(5)
        );
    }

    #[test]
    fn an_hour_long_deadline_is_never_shortened_below_the_cap() {
        let p = BudgetPolicy::default();
        let now = Instant::now();
        let b = p.plan(now, now + Duration::from_secs(3600)).unwrap();
        // 1 h − 2 s margin − 5 s reserve, then capped at the 1 h per-call cap.
        assert_eq!(p.outbound(&b, now) - now, Duration::from_secs(3593));
    }

    #[test]
    fn a_row_budget_keeps_the_reserve_and_refuses_what_is_too_short() {
        let p = BudgetPolicy::default();
        // The database's clock, not this process's, decides what is left.
        let db_now = Utc::now() - chrono::Duration::hours(5);
        let b = Budget::from_row(&p, db_now + chrono::Duration::seconds(10), db_now).unwrap();
        let left = b.answer_by - Instant::now();
        assert!(left <= Duration::from_secs(10) && left > Duration::from_secs(9));
        assert_eq!(b.answer_by - b.send_by, b.reserve);
        assert!(Budget::from_row(&p, db_now, db_now).is_none());
        assert!(
            Budget::from_row(&p, db_now + chrono::Duration::milliseconds(50), db_now).is_none()
        );
    }

    #[test]
    fn a_skewed_clock_converts_both_ways_consistently() {
        let clock = Clock::skewed(chrono::Duration::minutes(5));
        let real = Utc::now();
        assert!(
            (clock.now() - real - chrono::Duration::minutes(5))
                .num_milliseconds()
                .abs()
                < 1000
        );
        let at = Instant::now() + Duration::from_secs(30);
        let back = clock.instant_of(clock.wall_of(at));
        let diff = if back > at { back - at } else { at - back };
        assert!(diff < Duration::from_millis(50), "{diff:?}");
    }

    #[test]
    fn tiny_budgets_are_refused() {
        let p = BudgetPolicy::default();
        let now = Instant::now();
        let err = p.plan(now, now + ms(150)).unwrap_err();
        assert_eq!(err.minimum, ms(100));
        assert!(err.available < ms(100));
        assert!(p.plan(now, now).is_err());
    }
}
