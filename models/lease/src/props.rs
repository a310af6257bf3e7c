//! What the checker holds every reachable state to.

use stateright::Property;

use crate::{Answer, Caller, LeaseModel, RowState, State};

/// The properties' names, as the checker reports them.
pub const PROPERTIES: [&str; 12] = [
    ONE_EFFECT,
    NO_OVERLAP,
    DECISION_TRUE,
    DECISION_STAYS_TRUE,
    DECIDED_STAYS,
    ANSWER_AGREES,
    LIVE_HOLDER_KEEPS_LEASE,
    UNSENT_WAITS_NO_WINDOW,
    ENDED_WINDOW_NOT_WAITED_AGAIN,
    QUIET_IS_DONE,
    EVENTUALLY_DONE,
    UNSENT_DECIDED,
];

pub const ONE_EFFECT: &str = "at most one effect per key";
pub const NO_OVERLAP: &str = "no request sent while an earlier one may still take effect";
pub const DECISION_TRUE: &str = "a decision agrees with Nova when it is made";
pub const DECISION_STAYS_TRUE: &str = "no effect of a key after its decision";
pub const DECIDED_STAYS: &str = "a decided row never changes";
pub const ANSWER_AGREES: &str = "a caller's answer never contradicts the row";
pub const LIVE_HOLDER_KEEPS_LEASE: &str =
    "a holder that renews within the round-trip bound keeps its lease";
pub const UNSENT_WAITS_NO_WINDOW: &str = "an operation whose holder stopped knowing its last attempt never left waits for no settle window";
pub const ENDED_WINDOW_NOT_WAITED_AGAIN: &str =
    "a settle window a pass saw ended is not waited for again before another request";
pub const QUIET_IS_DONE: &str =
    "where only faults could move, every operation is decided and every caller answered";
pub const EVENTUALLY_DONE: &str = "every operation is decided and every caller answered";
pub const UNSENT_DECIDED: &str =
    "sometimes an operation marked unsent is decided without another request";

/// Every operation decided, and no caller left waiting.
pub fn done(m: &LeaseModel, s: &State) -> bool {
    (0..m.ops).all(|op| s.rows[op].state.decided())
        && !s
            .callers
            .iter()
            .any(|c| matches!(c, Caller::Waiting(_) | Caller::Joined(_)))
}

pub(crate) fn properties() -> Vec<Property<LeaseModel>> {
    vec![
        Property::always(ONE_EFFECT, |_, s: &State| s.effects.iter().all(|e| *e <= 1)),
        Property::always(NO_OVERLAP, |_, s: &State| !s.ghost.overlap),
        Property::always(DECISION_TRUE, |_, s: &State| !s.ghost.wrong_decision),
        Property::always(DECISION_STAYS_TRUE, |_, s: &State| !s.ghost.late_effect),
        Property::always(DECIDED_STAYS, |_, s: &State| {
            s.ghost
                .decided
                .iter()
                .zip(&s.rows)
                .all(|(first, row)| first.is_none_or(|d| d == row.state))
        }),
        Property::always(ANSWER_AGREES, |_, s: &State| {
            s.callers.iter().zip(&s.rows).all(|(c, row)| match c {
                Caller::Answered(Answer::Succeeded) => row.state == RowState::Succeeded,
                Caller::Answered(Answer::Failed) => row.state == RowState::Failed,
                _ => true,
            })
        }),
        // Liveness with a bound, as safety over what happened: a holder
        // renewing in time is never taken over; a run that heard its lease
        // lost before its attempt left leaves the operation to be decided
        // at the next pass (re-sent, or FAILED NOT_SENT), not after a
        // settle window; a window once seen ended (a pass then decides or
        // re-sends, unless it is cut short) is not started again by a
        // takeover of a lease that sent nothing.
        Property::always(LIVE_HOLDER_KEEPS_LEASE, |_, s: &State| {
            !s.ghost.live_lease_lapsed
        }),
        Property::always(UNSENT_WAITS_NO_WINDOW, |_, s: &State| {
            !s.ghost.unsent_waited
        }),
        Property::always(ENDED_WINDOW_NOT_WAITED_AGAIN, |_, s: &State| {
            !s.ghost.window_waited_again
        }),
        // The liveness property as a safety one over quiet states: a state
        // where no step but a fault is enabled is where a history ends once
        // its faults stop, whatever budget is left.
        Property::always(QUIET_IS_DONE, |m, s: &State| m.busy(s) || done(m, s)),
        // stateright's own liveness check: on every path that ends (the
        // budget spent, nothing enabled), it must have held somewhere.
        Property::eventually(EVENTUALLY_DONE, done),
        // Not vacuous: the mark is written, read by a pass, and decides
        // (FAILED NOT_SENT past the deadline; a re-send clears the mark).
        Property::sometimes(UNSENT_DECIDED, |_, s: &State| {
            s.rows.iter().any(|row| row.unsent && row.state.decided())
        }),
    ]
}
