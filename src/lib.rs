//! volume-reconciler: runs non-idempotent OpenStack Nova volume attach and
//! detach calls exactly once per idempotency key, and records their true
//! outcome in a ledger, re-observing Nova whenever a response was lost.
//!
//! Module map (each boundary knows one foreign thing):
//! - [`config`]: what `serve` is configured by: each setting's flag,
//!   environment variable and default (one source: the settings structs).
//! - [`telemetry`]: logs (human or JSON), an operation's trace context,
//!   OTLP export (feature `otlp`).
//! - [`startup`]: `Application::build` → `run_until`, used by main and tests;
//!   the staged shutdown, the admin endpoints, Nova's start-up checks.
//! - [`domain`]: operations, states, deadlines and budgets, validated newtypes,
//!   and how durations and rates are written (`domain::parse`).
//! - [`grpc`]: the only place that sees protobuf: the service, the layers of
//!   the server chain (metrics, deadline, auth, load shedding, message
//!   size), conversions, the one mapping to `Status`.
//! - [`executor`]: runs one operation, split by role: the caller's side
//!   and its waits (`caller.rs`), the operation's task (`task.rs`), lease
//!   keeping (`lease.rs`, `holds.rs`, `gate.rs`), deciding and recording
//!   (`ledger.rs`); classify, re-observe, confirm beside them.
//! - [`reconciler`]: resolves what could not be known in time; verifies
//!   decisions for late effects.
//! - [`retention`]: prunes decided operations past `--retain`, leaving a
//!   tombstone per key.
//! - [`store`]: the ledger (all SQL): PostgreSQL, or SQLite for one process.
//! - [`nova`]: the Nova/Keystone HTTP adapter (all HTTP to OpenStack).
//! - [`sim`]: the Nova/Keystone simulator used by tests and the demo.
//! - [`client`]: the Rust client with keyed, safe retries.
//! - [`cli`]: the command line (`Cli`, every subcommand), operator
//!   commands, the demo, the load generator and the history checker.
//! - [`metrics`]: the Prometheus registry each room registers its own
//!   families into, the process metrics and the `/metrics` rendering.
//! - [`tls`]: TLS on the gRPC port with reload, the process's crypto
//!   provider, and what is read of a certificate.

pub mod cli;
pub mod client;
pub mod config;
pub mod domain;
pub mod executor;
pub mod grpc;
pub mod metrics;
pub mod nova;
pub mod reconciler;
pub mod retention;
pub mod sim;
pub mod startup;
pub mod store;
pub mod telemetry;
pub mod tls;
