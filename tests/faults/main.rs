//! Faults in what the service stands on and in its own processes:
//! PostgreSQL behind a fault proxy (silent, reset, refused connections),
//! the real binary as separate processes (SIGKILL, rolling restarts,
//! database blips and outages), and the verifier through an outage of
//! Cinder. One test binary, one PostgreSQL cluster, a
//! database of its own for each test (docs/testing.md, "Where a new test
//! goes"); the cluster's own crash is in `whole_cluster`.

#[path = "../support/mod.rs"]
mod support;

mod db_faults;
mod db_outage;
mod process;
mod slow_database;
mod verifier_outage;
