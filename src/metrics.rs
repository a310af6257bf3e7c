//! Prometheus metrics (served on the admin listener at `/metrics`): the
//! registry, the process metrics and the rendering. No globals, so each
//! test's server has its own.
//!
//! Each room owns its families, in a file beside its code, and registers
//! them here at start-up (`startup`): `grpc::metrics` (go-grpc-prometheus'
//! server families, deadlines, load shedding), `nova::metrics` (requests to
//! Nova and Cinder, Nova's reachability, the Keystone token),
//! `store::metrics` (the database's round trips and pools, the open
//! operations), `executor::metrics` (decisions, lost responses, ledger
//! writes, leases), `reconciler::metrics` (passes, verification),
//! `retention` (pruning) and `tls::metrics` (the served certificate). This
//! module imports none of them: it stands below what it observes.
//!
//! Conventions (docs/operating.md, "Observability"):
//! - the service's own metrics are prefixed `volume_reconciler_`
//!   ([`Metrics::register`]); go-grpc-prometheus' families keep their
//!   unprefixed `grpc_server_` names ([`Metrics::register_unprefixed`]), and
//!   the process metrics ([`process`]) the standard unprefixed `process_`
//!   names, so stock dashboards and alerts work on them;
//! - gRPC status codes are labelled in their canonical form (`OK`,
//!   `DEADLINE_EXCEEDED`, ...), as every other gRPC implementation writes
//!   them;
//! - durations are in seconds;
//! - label values come from bounded sets: method names are the ones the
//!   server registers (anything else is `unknown`), never ids.
//!
//! Saturation (docs/operating.md, "Observability"): what is full or about
//! to be is read at each scrape from what holds it, by a collector its room
//! registers (the load-shedding caps, the Keystone token, the served
//! certificate); the store's pool and write queue and the leases held are
//! set by the scrape (`startup`).
//!
//! - `process`: the standard `process_` metrics of this process.

pub mod process;

use std::sync::Mutex;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The crate version, from Cargo.toml.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The commit the binary was built from: `VOLUME_RECONCILER_GIT_SHA` at
/// build time (the image build passes it), else `git rev-parse HEAD` of the
/// source tree, else `unknown` (see build.rs).
pub const GIT_SHA: &str = env!("VOLUME_RECONCILER_GIT_SHA");

/// The registry every room registers its families into, and what this
/// process is (its build, its `process_` metrics).
pub struct Metrics {
    registry: Mutex<Registry>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: String,
    pub git_sha: String,
}

/// Latency buckets in seconds, from a millisecond to an hour.
pub fn seconds_buckets() -> impl Iterator<Item = f64> {
    [
        0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
    ]
    .into_iter()
}

/// Finer at the low end than [`seconds_buckets`]: most calls answer within
/// milliseconds, a few wait for Nova up to their deadline.
pub fn rpc_buckets() -> impl Iterator<Item = f64> {
    [
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        60.0, 300.0, 3600.0,
    ]
    .into_iter()
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry holding the process metrics and `build_info`; each room
    /// adds its families with [`Metrics::register`].
    pub fn new() -> Self {
        let m = Self {
            registry: Mutex::new(Registry::default()),
        };
        m.registry()
            .register_collector(Box::new(process::ProcessCollector::new()));
        let build_info = Family::<BuildLabels, Gauge>::default();
        build_info
            .get_or_create(&BuildLabels {
                version: VERSION.to_string(),
                git_sha: GIT_SHA.to_string(),
            })
            .set(1);
        m.register(|r| {
            r.register(
                "build_info",
                "Always 1; the labels say which build this replica runs",
                build_info,
            )
        });
        m
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        // A poisoned lock only means a panic elsewhere; the registry is intact.
        self.registry.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a room's families under the service's prefix
    /// (`volume_reconciler_`).
    pub fn register(&self, families: impl FnOnce(&mut Registry)) {
        families(
            self.registry()
                .sub_registry_with_prefix("volume_reconciler"),
        );
    }

    /// Registers families under their own names, unprefixed (the standard
    /// ones other tools read, such as go-grpc-prometheus' `grpc_server_`).
    pub fn register_unprefixed(&self, families: impl FnOnce(&mut Registry)) {
        families(&mut self.registry());
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let r = self.registry();
        // Writing into a String cannot fail.
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &r) {
            out.push_str(&format!("# encoding failed: {e}\n"));
        }
        out
    }
}
