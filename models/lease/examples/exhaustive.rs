//! Every interleaving of the lease model, 2 replicas × 2 operations with
//! two faults, checked against every property, with the figures of
//! docs/testing.md ("The lease protocol, model-checked"). Minutes in a
//! release build, so it is a command rather than a test of the suite
//! (which checks the same model to a bounded depth):
//!
//! ```sh
//! cargo run --release -p lease-model --example exhaustive
//! ```

use std::time::Instant;

use lease_model::{Guards, LeaseModel};
use stateright::{Checker, Model};

fn main() {
    let started = Instant::now();
    let checker = LeaseModel::new(2, 2)
        .with_guards(Guards::ALL)
        .checker()
        .threads(2)
        .spawn_bfs()
        .join();
    println!(
        "{} states ({} unique), depth {}, {:.1} s",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed().as_secs_f64()
    );
    // Panics naming the property and its counterexample's path when one
    // fails: the command then exits non-zero.
    checker.assert_properties();
    println!("every property holds in every interleaving");
}
