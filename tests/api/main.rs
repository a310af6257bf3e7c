//! The gRPC API through the real server (spawn_app, real sockets, a real
//! PostgreSQL and the simulator): the ledger's calls and their keys, a
//! volume's whole life, the Rust client, security and overload,
//! saturation, trace context and the decisions counted. One test binary,
//! one PostgreSQL cluster, a database of its own for each test
//! (docs/testing.md, "Where a new test goes").

#[path = "../support/mod.rs"]
mod support;

mod callers_loop;
mod client;
mod decision_counts;
mod fleet_cancel;
mod fleet_lists;
mod fleet_share;
mod ledger_api;
mod lifecycle;
mod lifecycle_calls;
mod saturation;
mod security;
mod tracing;
