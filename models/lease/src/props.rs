//! What the checker holds every reachable state to.

use stateright::Property;

use crate::{Answer, Caller, LeaseModel, RowState, State};

/// The properties' names, as the checker reports them.
pub const PROPERTIES: [&str; 8] = [
    ONE_EFFECT,
    NO_OVERLAP,
    DECISION_TRUE,
    DECISION_STAYS_TRUE,
    DECIDED_STAYS,
    ANSWER_AGREES,
    QUIET_IS_DONE,
    EVENTUALLY_DONE,
];

pub const ONE_EFFECT: &str = "at most one effect per key";
pub const NO_OVERLAP: &str = "no request sent while an earlier one may still take effect";
pub const DECISION_TRUE: &str = "a decision agrees with Nova when it is made";
pub const DECISION_STAYS_TRUE: &str = "no effect of a key after its decision";
pub const DECIDED_STAYS: &str = "a decided row never changes";
pub const ANSWER_AGREES: &str = "a caller's answer never contradicts the row";
pub const QUIET_IS_DONE: &str =
    "where only faults could move, every operation is decided and every caller answered";
pub const EVENTUALLY_DONE: &str = "every operation is decided and every caller answered";

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
        // The liveness property as a safety one over quiet states: a state
        // where no step but a fault is enabled is where a history ends once
        // its faults stop, whatever budget is left.
        Property::always(QUIET_IS_DONE, |m, s: &State| m.busy(s) || done(m, s)),
        // stateright's own liveness check: on every path that ends (the
        // budget spent, nothing enabled), it must have held somewhere.
        Property::eventually(EVENTUALLY_DONE, done),
    ]
}
