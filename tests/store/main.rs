//! The ledger: the `Store` conformance suite on both stores, leases
//! between replicas, the reconciler, retention, the reconcile log as
//! callers and operators read it, and the rolling upgrade across the
//! ledger's expand steps. One test binary, one PostgreSQL cluster, a
//! database of its own for each test (docs/testing.md, "Where a new test
//! goes").

#[path = "../support/mod.rs"]
mod support;

mod fleet;
mod leases;
mod reconcile_log;
mod reconciler;
mod retention;
mod store_conformance;
mod upgrade;
