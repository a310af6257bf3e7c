//! The tests that need the PostgreSQL cluster alone: one crashes it (and
//! recovers it from its WAL), one measures its WAL, which is the whole
//! cluster's. Every other binary's tests share their cluster; these take
//! it one at a time ([`ALONE`]), in a binary of their own
//! (docs/testing.md, "Where a new test goes").

#[path = "../support/mod.rs"]
mod support;

mod ledger_cost;
mod pg_crash;

/// Held by each test of this binary for its whole run, so that the cluster
/// is its alone: a crash would fail the others' statements, and their
/// writes would be counted in the WAL a test measures.
static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
