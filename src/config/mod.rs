//! What `serve` is configured by: every setting's flag, environment
//! variable and default, and their conversions into the settings structs
//! (`BudgetPolicy`, `ExecSettings`, `ReconcilerSettings`, `NovaConfig`).
//! The command line around it (`Cli`, the other subcommands) lives in
//! `cli/`; nothing here knows it.
//!
//! Every default has one source: a flag that sets a field of a settings
//! struct takes its default from that struct's `DEFAULT` (or `Default`),
//! rendered the way the flag's parser reads it (`domain::parse`); a test
//! checks that the conversions of an empty command line equal the
//! structs' defaults. Durations are written like `500ms`, `30s`, `5m`.
//!
//! - `serve`: `ServeArgs`, every flag of `serve`.
//! - `settings`: the flags converted into each room's settings, and the
//!   checks across flags.
//! - `openstack`: the `OS_*` settings of Keystone mode and their
//!   resolution; the parsers of OpenStack's values.
//! - [`clouds`]: `OS_CLOUD`'s clouds.yaml and secure.yaml, resolved with
//!   the source of each value.

pub mod clouds;
mod openstack;
mod serve;
mod settings;

pub use openstack::{OpenStackArgs, cinder_microversion, http_url, microversion};
pub use serve::{ConfirmArg, ServeArgs};

use std::time::Duration;

/// The gRPC listen address by default; also where the clients look first.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:50051";
/// The admin listener by default; also where `healthcheck` looks.
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9090";
/// The embedded ledger by default (`serve` and `migrate`).
pub const DEFAULT_DATABASE_URL: &str = "sqlite://volume-reconciler.db";

/// What a failure to open the ledger at start is said to be about (`serve`
/// and `migrate`).
pub const LEDGER_CONTEXT: &str =
    "opening the ledger (--database-url; PostgreSQL is waited for up to --db-connect-timeout)";

/// Fetching Nova's version document at start, at most, by default.
pub const NOVA_DISCOVERY_TIMEOUT: Duration = Duration::from_secs(10);
/// Probing Nova's reachability when no request reached it, by default.
pub const NOVA_PROBE_INTERVAL: Duration = Duration::from_secs(15);
/// One probe of Nova's reachability, at most, by default.
pub const NOVA_PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the database may be unreachable before readiness fails, by
/// default: longer than a blip (a failover, a restart), shorter than an
/// outage worth taking the replicas out of the Service for.
pub const READY_DB_GRACE: Duration = Duration::from_secs(30);
