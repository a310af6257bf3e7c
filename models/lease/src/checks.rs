//! The lease model, checked: the whole protocol holds every property to a
//! bounded depth (every interleaving: `cargo run --release -p lease-model
//! --example exhaustive`), and each guard removed
//! lets the checker find the counterexample it exists for.

use std::collections::BTreeSet;
use std::time::Instant;

use crate::{Guards, LeaseModel, PROPERTIES, State};
use stateright::{Checker, HasDiscoveries, Model};

/// Deep enough for every counterexample below and for a history of two
/// operations with two faults; shallow enough for the suite (measured:
/// docs/testing.md, "The lease protocol, model-checked").
const DEPTH: usize = 22;
const FAULTS: u8 = 2;

fn model(guards: Guards) -> LeaseModel {
    LeaseModel::new(2, FAULTS).with_guards(guards)
}

/// Checks `m` breadth first to `depth` (0: no bound), stopping at the first
/// discovery of one of `wanted` when given, and prints what it covered.
fn check(m: LeaseModel, depth: usize, wanted: &[&'static str]) -> impl Checker<LeaseModel> {
    let started = Instant::now();
    let mut builder = m.checker().threads(2);
    if depth > 0 {
        builder = builder.target_max_depth(depth);
    }
    if !wanted.is_empty() {
        let set: BTreeSet<&'static str> = wanted.iter().copied().collect();
        builder = builder.finish_when(HasDiscoveries::AnyOf(set));
    }
    let checker = builder.spawn_bfs().join();
    println!(
        "{} states ({} unique), depth {}, {:.1} s",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed().as_secs_f64()
    );
    checker
}

/// The counterexample of one of `props` found with `guards`, printed.
fn counterexample(guards: Guards, props: &[&'static str]) -> (&'static str, Vec<State>) {
    let checker = check(model(guards), DEPTH, props);
    for p in props {
        if let Some(path) = checker.discovery(p) {
            let actions = path.clone().into_actions();
            println!("{p}: {} steps: {actions:?}", actions.len());
            return (p, path.into_states());
        }
    }
    panic!(
        "no counterexample of {props:?} with {guards:?}; found: {:?}",
        checker.discoveries().keys().collect::<Vec<_>>()
    );
}

#[test]
fn every_guard_in_place_holds_every_property_to_a_bounded_depth() {
    let checker = check(model(Guards::ALL), DEPTH, &[]);
    checker.assert_properties();
    // Not vacuous: histories reach both operations decided.
    assert!(checker.unique_state_count() > 10_000);
}

#[test]
fn without_the_fence_a_replica_that_lost_its_lease_overwrites_a_decision() {
    let guards = Guards {
        fence: false,
        ..Guards::ALL
    };
    counterexample(guards, &[crate::props::DECIDED_STAYS]);
}

#[test]
fn without_the_epoch_in_renewals_a_replicas_stale_run_sends_beside_its_own_takeover() {
    // Issue 47's review: the claim took this replica's own live runs, and
    // renewals and the gate checked the owner alone.
    let guards = Guards {
        epoch: false,
        claim_skips_own_runs: false,
        ..Guards::ALL
    };
    counterexample(guards, &[crate::props::NO_OVERLAP]);
}

#[test]
fn without_the_settle_window_a_re_send_overlaps_a_request_still_in_nova() {
    let guards = Guards {
        settle_window: false,
        ..Guards::ALL
    };
    counterexample(guards, &[crate::props::NO_OVERLAP]);
}

#[test]
fn without_the_send_gate_a_request_leaves_after_its_operation_was_taken_over() {
    let guards = Guards {
        send_gate: false,
        ..Guards::ALL
    };
    counterexample(guards, &[crate::props::NO_OVERLAP]);
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
    counterexample(
        guards,
        &[crate::props::NO_OVERLAP, crate::props::DECISION_STAYS_TRUE],
    );
}

#[test]
fn every_property_is_named_once() {
    let names: BTreeSet<_> = PROPERTIES.iter().collect();
    assert_eq!(names.len(), PROPERTIES.len());
    let m = model(Guards::ALL);
    assert_eq!(m.properties().len(), PROPERTIES.len());
}
