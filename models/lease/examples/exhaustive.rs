//! Every interleaving of the lease model, 2 replicas × 2 operations with
//! two faults, checked against every property, with the figures of
//! docs/testing.md ("The lease protocol, model-checked"). Many minutes in a
//! release build and gigabytes of memory, so it is a command rather than a
//! test of the suite (which checks every interleaving of one operation, and
//! of two to a bounded depth):
//!
//! ```sh
//! cargo run --release -p lease-model --example exhaustive
//! ```
//!
//! Progress (states so far) is printed every minute on stderr.

use std::time::{Duration, Instant};

use lease_model::{Guards, LeaseModel};
use stateright::{Checker, Model};

fn main() {
    let started = Instant::now();
    let checker = LeaseModel::new(2, 2)
        .with_guards(Guards::ALL)
        .checker()
        .threads(2)
        .spawn_bfs();
    let mut next_report = Duration::from_secs(60);
    while !checker.is_done() {
        std::thread::sleep(Duration::from_millis(200));
        if started.elapsed() >= next_report {
            eprintln!(
                "{} s: {} states ({} unique), depth {}",
                next_report.as_secs(),
                checker.state_count(),
                checker.unique_state_count(),
                checker.max_depth()
            );
            next_report += Duration::from_secs(60);
        }
    }
    let checker = checker.join();
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
