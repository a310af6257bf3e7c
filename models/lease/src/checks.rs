//! The lease model, checked: the whole protocol holds every property in
//! every interleaving of one operation, and of two to a bounded depth
//! (every interleaving of two: `cargo run --release -p lease-model
//! --example exhaustive`); each guard removed lets the checker find the
//! counterexample it exists for, and each of the two guards that others
//! imply, removed, lets it find none.
//!
//! The guards' checks run on one operation: each guard keeps one
//! operation's requests and decision straight, and one operation's
//! interleavings are few enough to check them all (the two implied guards)
//! or to find the shortest counterexample in well under a second (the
//! others).

use std::collections::BTreeSet;
use std::time::Instant;

use crate::props::{
    DECIDED_STAYS, DECISION_STAYS_TRUE, DECISION_TRUE, ENDED_WINDOW_NOT_WAITED_AGAIN,
    LIVE_HOLDER_KEEPS_LEASE, NO_OVERLAP, UNSENT_WAITS_NO_WINDOW,
};
use crate::{Guards, LeaseModel, PROPERTIES, State};
use stateright::{Checker, HasDiscoveries, Model};

/// The bounded check of two operations: deep enough for a history of both
/// with two faults, shallow enough for the suite (measured:
/// docs/testing.md, "The lease protocol, model-checked").
const DEPTH: usize = 20;
/// The longest counterexample looked for (the longest found is 17 steps).
const MAX_STEPS: usize = 24;
const FAULTS: u8 = 2;

fn one_op(guards: Guards) -> LeaseModel {
    LeaseModel::new(1, FAULTS).with_guards(guards)
}

/// Checks `m` breadth first to `depth` (0: no bound), stopping at the first
/// discovery of one of `wanted` when given.
fn check(
    m: LeaseModel,
    depth: usize,
    threads: usize,
    wanted: &[&'static str],
) -> impl Checker<LeaseModel> {
    let mut builder = m.checker().threads(threads);
    if depth > 0 {
        builder = builder.target_max_depth(depth);
    }
    if !wanted.is_empty() {
        let set: BTreeSet<&'static str> = wanted.iter().copied().collect();
        builder = builder.finish_when(HasDiscoveries::AnyOf(set));
    }
    builder.spawn_bfs().join()
}

/// What a check covered, and in how long.
fn report(checker: &impl Checker<LeaseModel>, started: Instant) {
    println!(
        "{} states ({} unique), depth {}, {:.1} s",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed().as_secs_f64()
    );
}

/// The shortest counterexample of one of `props` with `guards` (one
/// operation), printed. Found by deepening one step at a time: stateright
/// keeps the last path it found for a property, not the first, so a
/// search to a fixed depth may report a longer one.
fn counterexample(guards: Guards, props: &[&'static str]) -> (&'static str, Vec<State>) {
    let started = Instant::now();
    for steps in 1..=MAX_STEPS {
        // A path of `steps` steps ends at depth `steps + 1`; the checker
        // looks at states shallower than its target.
        let checker = check(one_op(guards), steps + 2, 1, props);
        for p in props {
            if let Some(path) = checker.discovery(p) {
                report(&checker, started);
                let actions = path.clone().into_actions();
                println!("{p}: {} steps: {actions:?}", actions.len());
                return (p, path.into_states());
            }
        }
    }
    panic!("no counterexample of {props:?} in {MAX_STEPS} steps with {guards:?}");
}

/// Every interleaving of one operation with `guards`, every property held.
fn holds_for_one_operation(guards: Guards) {
    let started = Instant::now();
    let checker = check(one_op(guards), 0, 2, &[]);
    report(&checker, started);
    checker.assert_properties();
    // Every path ended: nothing was cut short by a bound.
    assert!(checker.unique_state_count() > 100_000);
}

#[test]
fn every_guard_in_place_holds_every_property_in_every_interleaving_of_one_operation() {
    holds_for_one_operation(Guards::ALL);
}

#[test]
fn every_guard_in_place_holds_every_property_for_two_operations_to_a_bounded_depth() {
    let started = Instant::now();
    let checker = check(LeaseModel::new(2, FAULTS), DEPTH, 2, &[]);
    report(&checker, started);
    checker.assert_properties();
    // Not vacuous: histories reach both operations decided.
    assert!(checker.unique_state_count() > 500_000);
}

#[test]
fn without_the_fence_a_replica_that_lost_its_lease_overwrites_a_decision() {
    let guards = Guards {
        fence_epoch: false,
        fence_open: false,
        ..Guards::ALL
    };
    counterexample(guards, &[DECIDED_STAYS]);
}

#[test]
fn without_the_epoch_in_the_fence_a_pass_that_lost_its_lease_decides_over_a_re_send() {
    // The fence's open clause alone lets a stale pass (its lease taken
    // over while its database replies were held; its look needs none)
    // write FAILED while the new holder's re-send is in Nova.
    let guards = Guards {
        fence_epoch: false,
        ..Guards::ALL
    };
    counterexample(guards, &[DECISION_TRUE, DECISION_STAYS_TRUE, NO_OVERLAP]);
}

#[test]
fn the_fences_open_clause_is_implied_by_its_epoch() {
    // A decided row keeps the epoch it was decided under, and that epoch's
    // one holder (each epoch is given out once: the intent's, then one per
    // claim) stops at its decision: no write under it follows. The clause
    // is kept in the SQL for rows decided by an operator (the epoch moves
    // on then too) and as the cheaper test for the planner.
    holds_for_one_operation(Guards {
        fence_open: false,
        ..Guards::ALL
    });
}

#[test]
fn without_the_claims_skip_of_own_runs_a_stalled_run_sends_beside_its_own_replicas_takeover() {
    // The epoch in renewals does not stand in for the skip: a replica's
    // hold is one per operation, under the newest epoch taken there
    // (`Holds`), and the send gate renews that hold. A run stalled past its
    // lease, its own replica's reconciler claims the operation, and the
    // stalled run's gate renews the takeover's lease and lets its request
    // out beside the pass's re-send.
    let guards = Guards {
        claim_skips_own_runs: false,
        ..Guards::ALL
    };
    counterexample(guards, &[NO_OVERLAP]);
}

#[test]
fn the_epoch_in_renewals_is_implied_by_the_claims_skip_of_own_runs() {
    // A row is this replica's under an epoch other than its hold's only if
    // this replica claimed it while holding it, which the claim's skip
    // forbids (a claim whose reply was lost took a row no task here held).
    // The epoch stays in `RENEW_LEASES` for a second process under the same
    // replica name (a paused one replaced), which the model leaves out.
    holds_for_one_operation(Guards {
        renewal_epoch: false,
        ..Guards::ALL
    });
}

#[test]
fn without_the_settle_window_a_re_send_overlaps_a_request_still_in_nova() {
    let guards = Guards {
        settle_window: false,
        ..Guards::ALL
    };
    counterexample(guards, &[NO_OVERLAP]);
}

#[test]
fn without_the_send_gate_a_request_leaves_after_its_operation_was_taken_over() {
    let guards = Guards {
        send_gate: false,
        ..Guards::ALL
    };
    counterexample(guards, &[NO_OVERLAP]);
}

#[test]
fn without_the_takeovers_restamp_a_late_departure_outlives_the_settle_window() {
    // `last_request_at` is stamped when an attempt is recorded, not when
    // its request leaves: a request that waited for a slot past the
    // window's margin, whose holder then died, can still act after its
    // successor re-sent or decided, unless the takeover counts the window
    // from the old lease's end.
    let guards = Guards {
        takeover_restamps: false,
        ..Guards::ALL
    };
    counterexample(guards, &[NO_OVERLAP, DECISION_STAYS_TRUE]);
}

#[test]
fn without_an_attempt_under_the_expiring_lease_a_takeover_restarts_an_ended_window() {
    // A pass that saw the window ended dies before it re-sends; the next
    // claim's restamp (its lease sent nothing) makes the operation wait a
    // whole settle window again.
    let guards = Guards {
        restamp_needs_an_attempt: false,
        ..Guards::ALL
    };
    counterexample(guards, &[ENDED_WINDOW_NOT_WAITED_AGAIN]);
}

#[test]
fn without_the_unsent_mark_an_intent_whose_reply_was_lost_waits_a_settle_window() {
    // The intent's holder hears (by reading it back) that another replica
    // took it over before its request left; silent, it leaves the
    // successor to wait out the window for a request that never left.
    let guards = Guards {
        unsent_mark: false,
        ..Guards::ALL
    };
    counterexample(guards, &[UNSENT_WAITS_NO_WINDOW]);
}

#[test]
fn without_the_deferral_keeping_a_marked_row_due_the_mark_is_overwritten() {
    // The successor's pass read the row before the mark landed, deferred
    // for the window, and its deferral's `next_attempt_at` replaced the
    // mark's `now()`.
    let guards = Guards {
        deferral_keeps_unsent_due: false,
        ..Guards::ALL
    };
    counterexample(guards, &[UNSENT_WAITS_NO_WINDOW]);
}

#[test]
fn without_a_lease_that_outlasts_slow_renewals_a_live_holder_loses_it() {
    let guards = Guards {
        lease_outlasts_slow_renewals: false,
        ..Guards::ALL
    };
    counterexample(guards, &[LIVE_HOLDER_KEEPS_LEASE]);
}

#[test]
fn every_property_is_named_once() {
    let names: BTreeSet<_> = PROPERTIES.iter().collect();
    assert_eq!(names.len(), PROPERTIES.len());
    let m = one_op(Guards::ALL);
    assert_eq!(m.properties().len(), PROPERTIES.len());
}
