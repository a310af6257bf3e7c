//! The invariant `answer-follows-decision`: no caller waits longer than
//! `Windows::answer_within` after its operation was decided. A replica
//! that lost its operation (paused past its lease, or its database away)
//! while another decided it must hear so and answer from the row, not
//! hold its caller to the deadline.
//!
//! The wait counts from the latest of the call, the decision, and the end
//! of every outage that hit the answering replica meanwhile (a frozen
//! replica answers nobody while it is frozen; one cut off from the
//! database cannot read the decision until it is back).

use chrono::{DateTime, Utc};

use super::check::{ANSWER_FOLLOWS_DECISION, Violation};
use super::dbfaults::DbOutage;
use super::play::{Outcome, Played};
use super::windows::dur;

/// The violations of `answer-follows-decision` in `p`.
pub fn check(
    p: &Played,
    within: std::time::Duration,
    outages: &[DbOutage],
    now: DateTime<Utc>,
) -> Vec<Violation> {
    let mut found = Vec::new();
    for a in &p.answers {
        if matches!(a.outcome, Outcome::Cancelled) {
            continue;
        }
        let Some(r) = p
            .ops
            .iter()
            .find(|r| r.op.idempotency_key == a.key && r.op.caller.as_deref() == Some(&a.caller))
        else {
            continue;
        };
        let Some(decided) = r.op.completed_at else {
            continue;
        };
        let theirs: Vec<&DbOutage> = match &a.replica {
            Some(replica) => outages.iter().filter(|o| o.hits(replica)).collect(),
            None => Vec::new(),
        };
        let waited = waited_after_decision(a.sent_at, a.answered_at, decided, &theirs, now);
        if waited > dur(within) {
            found.push(Violation {
                invariant: ANSWER_FOLLOWS_DECISION,
                operation: Some(r.op.id),
                detail: format!(
                    "call {} (key {:?}) was answered by {} {} ms after its operation was decided {} \
                     (allowed: {} ms)",
                    a.call,
                    a.key,
                    a.replica.as_deref().unwrap_or("no replica"),
                    waited.num_milliseconds(),
                    r.op.state.as_str(),
                    within.as_millis()
                ),
            });
        }
    }
    found
}

/// How long a call sent at `sent_at` and answered at `answered_at` waited
/// once its operation was `decided`: from the latest of the two, moved to
/// the end of each of `outages` (of the replica that answered) that lasted
/// into the wait.
pub fn waited_after_decision(
    sent_at: DateTime<Utc>,
    answered_at: DateTime<Utc>,
    decided: DateTime<Utc>,
    outages: &[&DbOutage],
    now: DateTime<Utc>,
) -> chrono::Duration {
    let mut from = decided.max(sent_at);
    // In the order they ended: one that ends later can cover the next.
    let mut ends: Vec<(DateTime<Utc>, DateTime<Utc>)> =
        outages.iter().map(|o| (o.from, o.until(now))).collect();
    ends.sort_by_key(|e| e.1);
    for (start, end) in ends {
        if start <= answered_at && end >= from {
            from = from.max(end);
        }
    }
    (answered_at - from).max(chrono::Duration::zero())
}
