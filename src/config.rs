//! What `serve` is configured by: every setting's flag, environment
//! variable and default, and their conversions into the settings structs
//! (`BudgetPolicy`, `ExecSettings`, `ReconcilerSettings`, `NovaConfig`).
//! The command line around it (`Cli`, the other subcommands) lives in
//! `cli/`; nothing here knows it.
//!
//! Every default has one source: a flag that sets a field of a settings
//! struct takes its default from that struct's `DEFAULT` (or `Default`),
//! rendered the way the flag's parser reads it; a test checks that the
//! conversions of an empty command line equal the structs' defaults.
//! Durations are written like `500ms`, `30s`, `5m`.
//!
//! Why it is long: every flag of `serve` with its documentation is one
//! declaration here, and a third of the file is the tests of precedence and
//! of defaults; split by topic, the one place that lists every setting would
//! be lost.
//!
//! - [`clouds`]: `OS_CLOUD`'s clouds.yaml and secure.yaml, resolved with
//!   the source of each value.

pub mod clouds;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, ValueEnum};

use crate::domain::BudgetPolicy;
use crate::executor::ExecSettings;
use crate::nova::{
    CaBundle, ConfirmWith, Credential, KeystoneConfig, Microversion, NovaConfig, NovaEndpoint,
    Secret, TlsTrust,
};
use crate::reconciler::{MAX_WINDOW, ReconcilerSettings};
use crate::retention::RetentionSettings;

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

/// A duration as `duration` reads it back (`humantime`: `2m`, `50ms`): how
/// a settings struct's default becomes a flag's default.
pub fn render_duration(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// Parses a duration flag (`500ms`, `30s`, `5m`).
pub fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (write durations like 500ms, 30s, 5m)"))
}

/// Parses a duration that may be negative (`-2m`, `90s`).
pub fn signed_duration(s: &str) -> Result<chrono::Duration, String> {
    let (sign, magnitude) = match s.strip_prefix('-') {
        Some(rest) => (-1, rest),
        None => (1, s.strip_prefix('+').unwrap_or(s)),
    };
    let d = duration(magnitude)?;
    chrono::Duration::from_std(d)
        .map(|d| d * sign)
        .map_err(|e| format!("{e}: too long"))
}

/// Parses a rate per second: a finite number, at least 0.
pub fn rate(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err("must be a finite number of at least 0".into())
    }
}

/// Parses a share: at least 0 and below 1.
pub fn fraction(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if (0.0..1.0).contains(&v) {
        Ok(v)
    } else {
        Err("must be at least 0 and below 1".into())
    }
}

/// Parses an http:// or https:// URL with a host (Nova's and Keystone's
/// endpoints); anything else is refused at start, not discovered later as
/// lost responses.
pub fn http_url(s: &str) -> Result<String, String> {
    let url = reqwest::Url::parse(s).map_err(|e| format!("{s:?} is not a URL: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!(
            "{s:?} has the scheme {:?}; use http:// or https://",
            url.scheme()
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(format!("{s:?} has no host"));
    }
    Ok(s.to_string())
}

/// Parses a Nova microversion: `2.N` or `latest`.
pub fn microversion(s: &str) -> Result<Microversion, String> {
    s.parse()
}

/// Parses a Cinder microversion: `3.N` (never `latest`, whose answers may
/// change shape under a cloud upgrade).
pub fn cinder_microversion(s: &str) -> Result<String, String> {
    match s.split_once('.') {
        Some(("3", minor)) if !minor.is_empty() && minor.bytes().all(|b| b.is_ascii_digit()) => {
            Ok(s.to_string())
        }
        _ => Err("must be 3.N, e.g. 3.27 (the block-storage v3 API)".into()),
    }
}

/// `--confirm-with`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ConfirmArg {
    Cinder,
    NovaList,
}

impl From<ConfirmArg> for ConfirmWith {
    fn from(a: ConfirmArg) -> Self {
        match a {
            ConfirmArg::Cinder => ConfirmWith::Cinder,
            ConfirmArg::NovaList => ConfirmWith::NovaList,
        }
    }
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// gRPC listen address.
    #[arg(
        help_heading = "Listeners",
        long,
        env = "VOLUME_RECONCILER_LISTEN",
        default_value = DEFAULT_LISTEN
    )]
    pub listen: SocketAddr,
    /// Admin listener: /healthz, /readyz, /metrics (plain HTTP; keep it on loopback unless needed).
    #[arg(
        help_heading = "Listeners",
        long,
        env = "VOLUME_RECONCILER_ADMIN_LISTEN",
        default_value = DEFAULT_ADMIN_LISTEN
    )]
    pub admin_listen: SocketAddr,
    /// postgres://user@host/db (production, several replicas) or
    /// sqlite://FILE (embedded, one process; created on first start).
    #[arg(
        help_heading = "Ledger (database)",
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = DEFAULT_DATABASE_URL
    )]
    pub database_url: String,
    /// PostgreSQL connections of this replica, at most (6 at least): the
    /// ledger writers' own (two for intents and two for decisions from 16,
    /// one each below, plus one for a lone write) and a pool for the rest
    /// (reads, the reconciler, the listener).
    #[arg(
        help_heading = "Ledger (database)",
        long,
        env = "VOLUME_RECONCILER_DB_MAX_CONNECTIONS",
        default_value_t = 16
    )]
    pub db_max_connections: u32,
    /// At start, how long to wait for PostgreSQL to accept connections
    /// (each try is logged); then exit with the last error.
    #[arg(help_heading = "Ledger (database)", long, env = "VOLUME_RECONCILER_DB_CONNECT_TIMEOUT", value_parser = duration, default_value = render_duration(crate::store::DEFAULT_CONNECT_TIMEOUT))]
    pub db_connect_timeout: Duration,
    /// The longest one round trip to PostgreSQL may take (a statement, a
    /// short transaction, a ping), on both ends: PostgreSQL's
    /// statement_timeout for this service's sessions, and the service's own
    /// bound, past which the connection is dropped (it may have gone
    /// silent) and a write is made again on a new one, within the caller's
    /// deadline. Opening a connection has the same bound.
    #[arg(help_heading = "Ledger (database)", long, env = "VOLUME_RECONCILER_DB_STATEMENT_TIMEOUT", value_parser = duration, default_value = render_duration(crate::store::DbBounds::DEFAULT.round_trip))]
    pub db_statement_timeout: Duration,
    /// How long the database may stay unreachable before /readyz answers
    /// 503: within it, a replica stays in the Service and callers get
    /// DATABASE_UNAVAILABLE with a retry hint, so a blip does not take
    /// every replica out at once (0s: not ready at the first failed check).
    #[arg(help_heading = "Ledger (database)", long, env = "VOLUME_RECONCILER_READY_DB_GRACE", value_parser = duration, default_value = render_duration(READY_DB_GRACE))]
    pub ready_db_grace: Duration,
    /// Nova's compute endpoint (direct mode, no Keystone), e.g. http://127.0.0.1:8774/v2.1.
    /// Without it, the endpoint comes from Keystone (OS_* variables).
    #[arg(help_heading = "Nova and Cinder", long, env = "VOLUME_RECONCILER_NOVA_URL", value_parser = http_url)]
    pub nova_url: Option<String>,
    /// This instance's name in leases and the reconcile log (default: host-pid).
    #[arg(help_heading = "Listeners", long, env = "VOLUME_RECONCILER_REPLICA_ID")]
    pub replica_id: Option<String>,
    /// The compute API microversion: 2.N, or latest (the cloud's maximum,
    /// read from Nova's version document at start). Checked at start
    /// against the range Nova's version document gives.
    #[arg(
        help_heading = "Nova and Cinder",
        long,
        env = "VOLUME_RECONCILER_NOVA_MICROVERSION",
        value_parser = microversion,
        default_value_t = NovaConfig::default().microversion
    )]
    pub nova_microversion: Microversion,
    /// At start, the bound of fetching Nova's version document (a token
    /// from Keystone first, in Keystone mode). Nova unreachable then is a
    /// warning (and the `nova_reachable` metric), not a failure.
    #[arg(help_heading = "Nova and Cinder", long, env = "VOLUME_RECONCILER_NOVA_DISCOVERY_TIMEOUT", value_parser = duration, default_value = render_duration(NOVA_DISCOVERY_TIMEOUT))]
    pub nova_discovery_timeout: Duration,
    /// How often Nova's reachability is probed (a GET of its version
    /// document) when no request reached Nova in the last interval: the
    /// `nova_reachable` gauge follows Nova within about two intervals even
    /// with no traffic.
    #[arg(help_heading = "Nova and Cinder", long, env = "VOLUME_RECONCILER_NOVA_PROBE_INTERVAL", value_parser = duration, default_value = render_duration(NOVA_PROBE_INTERVAL))]
    pub nova_probe_interval: Duration,
    /// The bound of one probe of Nova's reachability (below
    /// --nova-probe-interval); no answer within it counts as unreachable.
    #[arg(help_heading = "Nova and Cinder", long, env = "VOLUME_RECONCILER_NOVA_PROBE_TIMEOUT", value_parser = duration, default_value = render_duration(NOVA_PROBE_TIMEOUT))]
    pub nova_probe_timeout: Duration,
    /// Concurrent Nova requests per host; waiting for a slot counts against the deadline.
    #[arg(
        help_heading = "Nova and Cinder",
        long,
        env = "VOLUME_RECONCILER_NOVA_MAX_CONCURRENCY",
        default_value_t = NovaConfig::default().max_concurrent_per_host
    )]
    pub nova_max_concurrency: usize,
    /// Bound of a TCP connect to Nova/Keystone (connection setup only).
    #[arg(help_heading = "Nova and Cinder", long, env = "VOLUME_RECONCILER_NOVA_CONNECT_TIMEOUT", value_parser = duration, default_value = render_duration(NovaConfig::default().connect_timeout))]
    pub nova_connect_timeout: Duration,
    /// Bound of a TLS handshake with Nova/Keystone (connection setup only).
    #[arg(help_heading = "Nova and Cinder", long, env = "VOLUME_RECONCILER_NOVA_TLS_HANDSHAKE_TIMEOUT", value_parser = duration, default_value = render_duration(NovaConfig::default().tls_handshake_timeout))]
    pub nova_tls_handshake_timeout: Duration,
    /// Cinder's v3 endpoint with the project id (direct mode, like --nova-url),
    /// e.g. http://127.0.0.1:8776/v3/PROJECT_ID. Without it, the catalog's
    /// block-storage (or volumev3) endpoint in Keystone mode, none in direct mode.
    #[arg(help_heading = "Nova and Cinder", long, env = "VOLUME_RECONCILER_CINDER_URL", value_parser = http_url)]
    pub cinder_url: Option<String>,
    /// How attaches and detaches are confirmed: by Cinder's view of the volume
    /// (attached to the server, as cinder-csi waits for) or by Nova's attachment
    /// list (a reservation shows there before the attach is usable). Default:
    /// cinder when --cinder-url is given or the catalog has block-storage, else
    /// nova-list (with a warning at startup).
    #[arg(
        help_heading = "Nova and Cinder",
        long,
        env = "VOLUME_RECONCILER_CONFIRM_WITH",
        value_enum
    )]
    pub confirm_with: Option<ConfirmArg>,
    /// `OpenStack-API-Version: volume X` on Cinder requests (3.27: the attachments
    /// API, whose reserved/attaching/in-use flow Nova uses).
    #[arg(
        help_heading = "Nova and Cinder",
        long,
        env = "VOLUME_RECONCILER_CINDER_MICROVERSION",
        value_parser = cinder_microversion,
        default_value = NovaConfig::DEFAULT_CINDER_MICROVERSION
    )]
    pub cinder_microversion: String,

    /// Deadline applied only when a caller sends none.
    #[arg(help_heading = "Deadlines and budgets", long, env = "VOLUME_RECONCILER_DEFAULT_DEADLINE", value_parser = duration, default_value = "5m")]
    pub default_deadline: Duration,
    /// Share of the remaining time kept to answer before the caller gives up.
    #[arg(help_heading = "Deadlines and budgets", long, env = "VOLUME_RECONCILER_SAFETY_MARGIN_FRACTION", value_parser = fraction, default_value_t = BudgetPolicy::DEFAULT.margin_fraction)]
    pub safety_margin_fraction: f64,
    /// The least time kept to answer before the caller gives up (the fraction's floor).
    #[arg(help_heading = "Deadlines and budgets", long, env = "VOLUME_RECONCILER_SAFETY_MARGIN_MIN", value_parser = duration, default_value = render_duration(BudgetPolicy::DEFAULT.margin_min))]
    pub safety_margin_min: Duration,
    /// The most time kept to answer before the caller gives up (the fraction's ceiling).
    #[arg(help_heading = "Deadlines and budgets", long, env = "VOLUME_RECONCILER_SAFETY_MARGIN_MAX", value_parser = duration, default_value = render_duration(BudgetPolicy::DEFAULT.margin_max))]
    pub safety_margin_max: Duration,
    /// Share of the remaining time kept back to re-observe after a lost response.
    #[arg(help_heading = "Deadlines and budgets", long, env = "VOLUME_RECONCILER_REOBSERVE_RESERVE_FRACTION", value_parser = fraction, default_value_t = BudgetPolicy::DEFAULT.reserve_fraction)]
    pub reobserve_reserve_fraction: f64,
    /// The most time kept back to re-observe after a lost response (the fraction's ceiling).
    #[arg(help_heading = "Deadlines and budgets", long, env = "VOLUME_RECONCILER_REOBSERVE_RESERVE_MAX", value_parser = duration, default_value = render_duration(BudgetPolicy::DEFAULT.reserve_max))]
    pub reobserve_reserve_max: Duration,
    /// The longest one Nova request may take (policy, visible and configurable).
    #[arg(help_heading = "Deadlines and budgets", long, env = "VOLUME_RECONCILER_PER_CALL_CAP", value_parser = duration, default_value = render_duration(BudgetPolicy::DEFAULT.per_call_cap))]
    pub per_call_cap: Duration,
    /// Below this much time for the Nova request, Nova is not called (BUDGET_TOO_SMALL).
    #[arg(help_heading = "Deadlines and budgets", long, env = "VOLUME_RECONCILER_MIN_BUDGET", value_parser = duration, default_value = render_duration(BudgetPolicy::DEFAULT.min_budget))]
    pub min_budget: Duration,
    /// How long an operation's lease lasts unrenewed: a replica that dies
    /// is taken over this long after its last heartbeat (database time).
    #[arg(help_heading = "Leases", long, env = "VOLUME_RECONCILER_LEASE", value_parser = duration, default_value = render_duration(ExecSettings::DEFAULT.lease))]
    pub lease: Duration,
    /// How often a replica renews the leases it holds (a third of --lease at most).
    #[arg(help_heading = "Leases", long, env = "VOLUME_RECONCILER_HEARTBEAT", value_parser = duration, default_value = render_duration(ExecSettings::DEFAULT.heartbeat))]
    pub heartbeat: Duration,

    /// Nova may still attach this long after the last request (Nova's
    /// long_rpc_timeout, 30 min by default, plus a margin).
    #[arg(help_heading = "Reconciler and verification", long, env = "VOLUME_RECONCILER_SETTLE_WINDOW_ATTACH", value_parser = duration, default_value = render_duration(ReconcilerSettings::DEFAULT.settle_attach))]
    pub settle_window_attach: Duration,
    /// Nova may still detach this long after the last request (libvirt's
    /// device_detach_attempts × device_detach_timeout, 8 × 20 s, plus a margin).
    #[arg(help_heading = "Reconciler and verification", long, env = "VOLUME_RECONCILER_SETTLE_WINDOW_DETACH", value_parser = duration, default_value = render_duration(ReconcilerSettings::DEFAULT.settle_detach))]
    pub settle_window_detach: Duration,
    /// Sets both settle windows at once (overrides the two above).
    #[arg(help_heading = "Reconciler and verification", long, env = "VOLUME_RECONCILER_SETTLE_WINDOW", value_parser = duration)]
    pub settle_window: Option<Duration>,
    /// The reconciler's pause between rounds when there was nothing to do.
    #[arg(help_heading = "Reconciler and verification", long, env = "VOLUME_RECONCILER_RECONCILE_INTERVAL", value_parser = duration, default_value = render_duration(ReconcilerSettings::DEFAULT.interval))]
    pub reconcile_interval: Duration,
    /// Operations the reconciler leases per round, at most.
    #[arg(help_heading = "Reconciler and verification", long, env = "VOLUME_RECONCILER_RECONCILE_BATCH", default_value_t = ReconcilerSettings::DEFAULT.batch)]
    pub reconcile_batch: u32,
    /// The reconciler's Nova requests per second, at most (all passes of this replica).
    #[arg(
        help_heading = "Reconciler and verification",
        long,
        env = "VOLUME_RECONCILER_RECONCILE_RATE_LIMIT",
        default_value_t = ReconcilerSettings::DEFAULT.rate_limit
    )]
    pub reconcile_rate_limit: f64,
    /// Reconciler passes run at once.
    #[arg(
        help_heading = "Reconciler and verification",
        long,
        env = "VOLUME_RECONCILER_RECONCILE_PARALLELISM",
        default_value_t = ReconcilerSettings::DEFAULT.parallelism
    )]
    pub reconcile_parallelism: usize,
    /// Decided operations are re-observed this long after the decision
    /// (never sooner than 2s)...
    #[arg(help_heading = "Reconciler and verification", long, env = "VOLUME_RECONCILER_VERIFY_AFTER", value_parser = duration, default_value = render_duration(ReconcilerSettings::DEFAULT.verify_after))]
    pub verify_after: Duration,
    /// ...and again at the end of this window (it should cover the attach
    /// settle window: Nova's late effects come within it).
    #[arg(help_heading = "Reconciler and verification", long, env = "VOLUME_RECONCILER_VERIFY_WINDOW", value_parser = duration, default_value = render_duration(ReconcilerSettings::DEFAULT.verify_window))]
    pub verify_window: Duration,
    /// Run no background reconciler in this process.
    #[arg(
        help_heading = "Reconciler and verification",
        long,
        env = "VOLUME_RECONCILER_NO_RECONCILER"
    )]
    pub no_reconciler: bool,
    /// The longest pause between two reconciler passes over one operation.
    #[arg(help_heading = "Reconciler and verification", long, env = "VOLUME_RECONCILER_RECONCILE_MAX_BACKOFF", value_parser = duration, default_value = render_duration(ReconcilerSettings::DEFAULT.max_backoff))]
    pub reconcile_max_backoff: Duration,
    /// Decided operations and their events are deleted this long after
    /// their decision (at least twice --verify-window); 0 keeps everything.
    #[arg(help_heading = "Retention", long, env = "VOLUME_RECONCILER_RETAIN", value_parser = duration, default_value = "90days")]
    pub retain: Duration,
    /// A pruned operation's key is refused (IDEMPOTENCY_KEY_EXPIRED) until
    /// this long after its decision, then forgotten; 0: for ever.
    #[arg(help_heading = "Retention", long, env = "VOLUME_RECONCILER_RETAIN_KEYS", value_parser = duration, default_value = "365days")]
    pub retain_keys: Duration,
    /// How often a replica tries a retention round (one replica at a time).
    #[arg(help_heading = "Retention", long, env = "VOLUME_RECONCILER_RETAIN_INTERVAL", value_parser = duration, default_value = render_duration(RetentionSettings::DEFAULT.interval))]
    pub retain_interval: Duration,
    /// Rows deleted per statement.
    #[arg(help_heading = "Retention", long, env = "VOLUME_RECONCILER_RETAIN_BATCH", default_value_t = RetentionSettings::DEFAULT.batch)]
    pub retain_batch: u32,
    /// Pause between two statements of a round.
    #[arg(help_heading = "Retention", long, env = "VOLUME_RECONCILER_RETAIN_PAUSE", value_parser = duration, default_value = render_duration(RetentionSettings::DEFAULT.pause))]
    pub retain_pause: Duration,
    /// How long a retention batch waits for transactions older than its
    /// tombstones before deleting (PostgreSQL); past it, next round.
    #[arg(help_heading = "Retention", long, env = "VOLUME_RECONCILER_RETAIN_HORIZON_WAIT", value_parser = duration, default_value = render_duration(RetentionSettings::DEFAULT.horizon_wait), hide = true)]
    pub retain_horizon_wait: Duration,
    /// Moves this replica's wall clock (e.g. `-2m`): for testing that
    /// nothing depends on replicas' clocks agreeing. Never in production.
    #[arg(help_heading = "Leases", long, env = "VOLUME_RECONCILER_CLOCK_SKEW", value_parser = signed_duration, default_value = "0s", hide = true)]
    pub clock_skew: chrono::Duration,

    /// After SIGTERM: keep serving (not ready) this long so load balancers notice.
    #[arg(help_heading = "Shutdown and connections", long, env = "VOLUME_RECONCILER_SHUTDOWN_DELAY", value_parser = duration, default_value = "5s")]
    pub shutdown_delay: Duration,
    /// Then wait at most this long for in-flight RPCs.
    #[arg(help_heading = "Shutdown and connections", long, env = "VOLUME_RECONCILER_DRAIN_TIMEOUT", value_parser = duration, default_value = "30s")]
    pub drain_timeout: Duration,
    /// Rotate client connections after this age (GOAWAY, graceful).
    #[arg(help_heading = "Shutdown and connections", long, env = "VOLUME_RECONCILER_MAX_CONNECTION_AGE", value_parser = duration)]
    pub max_connection_age: Option<Duration>,
    /// HTTP/2 keepalive pings to idle clients this often (finds dead connections).
    #[arg(help_heading = "Shutdown and connections", long, env = "VOLUME_RECONCILER_HTTP2_KEEPALIVE_INTERVAL", value_parser = duration, default_value = "30s")]
    pub http2_keepalive_interval: Duration,
    /// A client that does not answer a keepalive ping within this is dropped.
    #[arg(help_heading = "Shutdown and connections", long, env = "VOLUME_RECONCILER_HTTP2_KEEPALIVE_TIMEOUT", value_parser = duration, default_value = "20s")]
    pub http2_keepalive_timeout: Duration,
    /// Concurrent gRPC calls (HTTP/2 streams) per client connection, at most.
    #[arg(
        help_heading = "Shutdown and connections",
        long,
        env = "VOLUME_RECONCILER_MAX_CONCURRENT_STREAMS",
        default_value_t = 1024
    )]
    pub max_concurrent_streams: u32,
    /// The longest a WatchOperation stream waits for its next message.
    #[arg(help_heading = "Shutdown and connections", long, env = "VOLUME_RECONCILER_WATCH_IDLE_TIMEOUT", value_parser = duration, default_value = "10m")]
    pub watch_idle_timeout: Duration,
    /// Largest gRPC request message accepted.
    #[arg(help_heading = "Shutdown and connections", long, env = "VOLUME_RECONCILER_MAX_MESSAGE_BYTES", default_value_t = 64 * 1024)]
    pub max_message_bytes: usize,

    /// TLS certificate (PEM) of the gRPC port; with --tls-key, TLS is on.
    #[arg(
        help_heading = "TLS and authentication",
        long,
        env = "VOLUME_RECONCILER_TLS_CERT",
        requires = "tls_key"
    )]
    pub tls_cert: Option<std::path::PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(
        help_heading = "TLS and authentication",
        long,
        env = "VOLUME_RECONCILER_TLS_KEY",
        requires = "tls_cert"
    )]
    pub tls_key: Option<std::path::PathBuf>,
    /// CA (PEM) that client certificates must be signed by (mutual TLS).
    #[arg(
        help_heading = "TLS and authentication",
        long,
        env = "VOLUME_RECONCILER_TLS_CLIENT_CA",
        requires = "tls_cert"
    )]
    pub tls_client_ca: Option<std::path::PathBuf>,
    /// Roles of callers named by their client certificate (mutual TLS
    /// without --auth-tokens): CN=NAME=ROLE and OU=UNIT=ROLE entries,
    /// comma separated, `OU` for "the OU names the role", or @FILE of
    /// them. The CN's entry wins, then the OUs'; else orchestrator.
    #[arg(
        help_heading = "TLS and authentication",
        long,
        env = "VOLUME_RECONCILER_TLS_CLIENT_ROLES"
    )]
    pub tls_client_roles: Option<String>,
    /// Bound of a TLS handshake with a client (connection setup only).
    #[arg(help_heading = "TLS and authentication", long, env = "VOLUME_RECONCILER_TLS_HANDSHAKE_TIMEOUT", value_parser = duration, default_value = "5s")]
    pub tls_handshake_timeout: Duration,
    /// Callers allowed in, as NAME:ROLE:SHA256HEX entries (comma separated;
    /// ROLE is orchestrator or operator; the hash is `sha256sum` of the
    /// token). When set, every RPC but health needs `authorization: Bearer`.
    #[arg(
        help_heading = "TLS and authentication",
        long,
        env = "VOLUME_RECONCILER_AUTH_TOKENS",
        hide_env_values = true
    )]
    pub auth_tokens: Option<String>,
    /// Attach/detach operations running at most (each counted until its
    /// task ends, whether or not its caller still waits); beyond,
    /// RESOURCE_EXHAUSTED OVERLOADED at once.
    #[arg(
        help_heading = "Load shedding",
        long,
        env = "VOLUME_RECONCILER_MAX_INFLIGHT_MUTATIONS",
        default_value_t = 16384,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub max_inflight_mutations: u32,
    /// Unary reads (GetOperation, ListOperations, ListOperationEvents) in
    /// flight at most, each until its answer is sent; beyond,
    /// RESOURCE_EXHAUSTED READS_OVERLOADED at once.
    #[arg(
        help_heading = "Load shedding",
        long,
        env = "VOLUME_RECONCILER_MAX_INFLIGHT_READS",
        default_value_t = 1024,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub max_inflight_reads: u32,
    /// WatchOperation streams open at most; beyond, RESOURCE_EXHAUSTED
    /// WATCHES_OVERLOADED at once.
    #[arg(
        help_heading = "Load shedding",
        long,
        env = "VOLUME_RECONCILER_MAX_WATCH_STREAMS",
        default_value_t = 4096,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub max_watch_streams: u32,
    /// PostgreSQL ledger writes waiting for a writer at most, per kind
    /// (intents; decisions and appends); beyond, RESOURCE_EXHAUSTED
    /// LEDGER_OVERLOADED at once (the database has fallen far behind).
    /// The embedded ledger has no queue.
    #[arg(
        help_heading = "Load shedding",
        long,
        env = "VOLUME_RECONCILER_MAX_QUEUED_WRITES",
        default_value_t = crate::store::DEFAULT_WRITE_QUEUE,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub max_queued_writes: u32,
    /// Attach/detach calls per second per caller (token bucket; 0: off).
    #[arg(
        help_heading = "Load shedding",
        long,
        env = "VOLUME_RECONCILER_CALLER_RATE_LIMIT",
        default_value_t = 0.0,
        value_parser = rate
    )]
    pub caller_rate_limit: f64,
    /// Burst of the per-caller token bucket (calls, at least 1).
    #[arg(help_heading = "Load shedding", long, env = "VOLUME_RECONCILER_CALLER_BURST", default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
    pub caller_burst: u32,
    /// Largest request metadata (HTTP/2 header list) accepted.
    #[arg(help_heading = "Shutdown and connections", long, env = "VOLUME_RECONCILER_MAX_METADATA_BYTES", default_value_t = 16 * 1024)]
    pub max_metadata_bytes: u32,

    #[command(flatten, next_help_heading = "OpenStack (Keystone mode)")]
    pub openstack: OpenStackArgs,
}

/// Bound of one Keystone token renewal by default.
const KEYSTONE_RENEWAL_TIMEOUT: Duration = Duration::from_secs(30);
/// Renew a token this long before it expires (keystoneauth uses 120 s).
const KEYSTONE_RENEW_BEFORE: Duration = Duration::from_secs(120);
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

/// The standard OpenStack settings, for Keystone mode. Each has its `OS_*`
/// variable; with `OS_CLOUD`, clouds.yaml (and secure.yaml) fill what these
/// leave unset. Defaults apply last, so an explicit setting always wins
/// over the file, even when it equals the default.
#[derive(Debug, Clone, Args)]
pub struct OpenStackArgs {
    /// A cloud of clouds.yaml (OS_CLIENT_CONFIG_FILE, ./clouds.yaml,
    /// ~/.config/openstack/clouds.yaml, /etc/openstack/clouds.yaml), with
    /// secure.yaml from the same places (OS_CLIENT_SECURE_FILE) over it;
    /// the OS_* settings below override both.
    #[arg(long, env = "OS_CLOUD")]
    pub os_cloud: Option<String>,
    /// password (the default) or v3applicationcredential.
    #[arg(long, env = "OS_AUTH_TYPE")]
    pub os_auth_type: Option<String>,
    /// Keystone's endpoint (v3), e.g. https://keystone.example:5000/v3.
    #[arg(long, env = "OS_AUTH_URL")]
    pub os_auth_url: Option<String>,
    /// The user to authenticate as (password auth; or an application credential's owner).
    #[arg(long, env = "OS_USERNAME")]
    pub os_username: Option<String>,
    /// The user's password (password auth).
    #[arg(long, env = "OS_PASSWORD", hide_env_values = true)]
    pub os_password: Option<String>,
    /// The project to scope the token to (password auth).
    #[arg(long, env = "OS_PROJECT_NAME")]
    pub os_project_name: Option<String>,
    /// The user's domain (default: Default).
    #[arg(long, env = "OS_USER_DOMAIN_NAME")]
    pub os_user_domain_name: Option<String>,
    /// The project's domain (default: Default).
    #[arg(long, env = "OS_PROJECT_DOMAIN_NAME")]
    pub os_project_domain_name: Option<String>,
    /// An application credential's id (v3applicationcredential).
    #[arg(long, env = "OS_APPLICATION_CREDENTIAL_ID")]
    pub os_application_credential_id: Option<String>,
    /// An application credential's name; with it, OS_USERNAME (and
    /// OS_USER_DOMAIN_NAME) name its owner.
    #[arg(long, env = "OS_APPLICATION_CREDENTIAL_NAME")]
    pub os_application_credential_name: Option<String>,
    /// The application credential's secret (v3applicationcredential).
    #[arg(long, env = "OS_APPLICATION_CREDENTIAL_SECRET", hide_env_values = true)]
    pub os_application_credential_secret: Option<String>,
    /// The region whose Nova and Cinder endpoints to take from the catalog.
    #[arg(long, env = "OS_REGION_NAME")]
    pub os_region_name: Option<String>,
    /// The catalog interface: public (the default), internal or admin.
    #[arg(long, env = "OS_INTERFACE")]
    pub os_interface: Option<String>,
    /// The CA bundle (PEM) that Keystone's and Nova's certificates must
    /// chain to, instead of the system's roots.
    #[arg(long, env = "OS_CACERT")]
    pub os_cacert: Option<PathBuf>,
    /// Accept any TLS certificate from Keystone and Nova (clouds.yaml
    /// `verify: false`). Anyone on the path can then read the tokens.
    #[arg(long, env = "OS_INSECURE", num_args = 0..=1, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub os_insecure: Option<bool>,
    /// Bound of one Keystone token renewal (its own clock, shared by all callers).
    #[arg(long, env = "VOLUME_RECONCILER_KEYSTONE_TIMEOUT", value_parser = duration, default_value = render_duration(KEYSTONE_RENEWAL_TIMEOUT))]
    pub keystone_timeout: Duration,
}

impl ServeArgs {
    /// Parses `serve` flags with the very definitions `main` uses (the
    /// global flags of the command line aside).
    pub fn from_args<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        /// `serve`'s flags alone, as a command of their own.
        #[derive(Parser)]
        #[command(name = "serve")]
        struct Serve {
            #[command(flatten)]
            args: ServeArgs,
        }
        let argv = std::iter::once(std::ffi::OsString::from("serve"))
            .chain(args.into_iter().map(Into::into));
        Ok(Serve::try_parse_from(argv)?.args)
    }

    pub fn replica(&self) -> String {
        self.replica_id.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/etc/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_else(|_| "replica".into());
            format!("{host}-{}", std::process::id())
        })
    }

    pub fn budget_policy(&self) -> BudgetPolicy {
        BudgetPolicy {
            margin_fraction: self.safety_margin_fraction,
            margin_min: self.safety_margin_min,
            margin_max: self.safety_margin_max,
            reserve_fraction: self.reobserve_reserve_fraction,
            reserve_max: self.reobserve_reserve_max,
            per_call_cap: self.per_call_cap,
            min_budget: self.min_budget,
        }
    }

    /// Checks settings that must agree with each other; every problem at
    /// once, each naming its flags.
    pub fn validate(&self) -> anyhow::Result<()> {
        let mut problems = Vec::new();
        if self.heartbeat.is_zero() || self.heartbeat * 3 > self.lease {
            problems.push(format!(
                "--heartbeat ({}) must be more than zero and at most a third of --lease ({}): one late heartbeat must not lose a lease",
                render_duration(self.heartbeat),
                render_duration(self.lease)
            ));
        }
        let settle_attach = self.settle_window.unwrap_or(self.settle_window_attach);
        if self.verify_window < self.verify_after {
            problems.push(format!(
                "--verify-window ({}) must not be shorter than --verify-after ({})",
                render_duration(self.verify_window),
                render_duration(self.verify_after)
            ));
        }
        problems.extend(self.window_problems());
        problems.extend(self.retention_settings().problems());
        if self.nova_probe_interval.is_zero() || self.nova_probe_timeout >= self.nova_probe_interval
        {
            problems.push(format!(
                "--nova-probe-timeout ({}) must be shorter than --nova-probe-interval ({}), which must be more than zero: one probe ends before the next begins",
                render_duration(self.nova_probe_timeout),
                render_duration(self.nova_probe_interval)
            ));
        }
        if self.db_statement_timeout < Duration::from_millis(100)
            || self.db_statement_timeout > Duration::from_secs(600)
        {
            problems.push(format!(
                "--db-statement-timeout ({}) must be between 100ms and 10m: it bounds each round trip to PostgreSQL",
                render_duration(self.db_statement_timeout)
            ));
        }
        if self.verify_window < settle_attach {
            tracing::warn!(
                verify_window = %render_duration(self.verify_window),
                settle_window_attach = %render_duration(settle_attach),
                "--verify-window is shorter than the attach settle window: a late attach after the last verification goes unnoticed"
            );
        }
        if problems.is_empty() {
            Ok(())
        } else {
            anyhow::bail!("invalid settings:\n  {}", problems.join("\n  "))
        }
    }

    /// Settle and verification windows past [`MAX_WINDOW`]: refused, each
    /// naming its flag, rather than read as something else (they were
    /// once read as 0 past chrono's range: "decide at once").
    fn window_problems(&self) -> Vec<String> {
        [
            ("--settle-window-attach", Some(self.settle_window_attach)),
            ("--settle-window-detach", Some(self.settle_window_detach)),
            ("--settle-window", self.settle_window),
            ("--verify-after", Some(self.verify_after)),
            ("--verify-window", Some(self.verify_window)),
        ]
        .into_iter()
        .filter_map(|(flag, d)| Some((flag, d?)))
        .filter(|(_, d)| *d > MAX_WINDOW)
        .map(|(flag, d)| {
            format!(
                "{flag} ({}) must be at most {}: a window is how long Nova may still act on a request whose answer was lost (Nova's own timeouts are minutes)",
                render_duration(d),
                render_duration(MAX_WINDOW)
            )
        })
        .collect()
    }

    /// The bounds of each round trip to PostgreSQL.
    pub fn db_bounds(&self) -> crate::store::DbBounds {
        crate::store::DbBounds {
            round_trip: self.db_statement_timeout,
            connect: self.db_statement_timeout,
        }
    }

    pub fn exec_settings(&self) -> ExecSettings {
        ExecSettings {
            lease: self.lease,
            heartbeat: self.heartbeat,
            clock: crate::domain::Clock::skewed(self.clock_skew),
            ..ExecSettings::default()
        }
    }

    pub fn retention_settings(&self) -> RetentionSettings {
        RetentionSettings {
            retain: self.retain,
            retain_keys: self.retain_keys,
            interval: self.retain_interval,
            batch: self.retain_batch,
            pause: self.retain_pause,
            horizon_wait: self.retain_horizon_wait,
            verify_window: self.verify_window,
        }
    }

    pub fn reconciler_settings(&self) -> ReconcilerSettings {
        ReconcilerSettings {
            interval: self.reconcile_interval,
            batch: self.reconcile_batch,
            settle_attach: self.settle_window.unwrap_or(self.settle_window_attach),
            settle_detach: self.settle_window.unwrap_or(self.settle_window_detach),
            rate_limit: self.reconcile_rate_limit,
            parallelism: self.reconcile_parallelism,
            verify_after: self.verify_after,
            verify_window: self.verify_window,
            max_backoff: self.reconcile_max_backoff,
            ..ReconcilerSettings::default()
        }
    }

    /// The Nova endpoint: `--nova-url`, else Keystone from the OS_*
    /// settings (with clouds.yaml under `OS_CLOUD`); Cinder's: `--cinder-url`,
    /// else the catalog's (Keystone mode only).
    pub fn nova_config(&self) -> anyhow::Result<NovaConfig> {
        if self.confirm_with == Some(ConfirmArg::Cinder)
            && self.nova_url.is_some()
            && self.cinder_url.is_none()
        {
            anyhow::bail!(
                "--confirm-with cinder in direct mode (--nova-url) needs --cinder-url: there is no catalog to find Cinder in"
            );
        }
        let (endpoint, tls) = match &self.nova_url {
            // Direct mode reads no clouds.yaml: only the explicit TLS settings.
            Some(url) => (
                NovaEndpoint::Direct(url.clone()),
                self.openstack.tls(
                    &self
                        .openstack
                        .resolve_in(None, &clouds::Search::standard())?,
                )?,
            ),
            None => {
                let r = self.openstack.resolve()?;
                (
                    NovaEndpoint::Keystone(self.openstack.keystone(&r)?),
                    self.openstack.tls(&r)?,
                )
            }
        };
        Ok(NovaConfig {
            endpoint,
            microversion: self.nova_microversion,
            tls,
            max_concurrent_per_host: self.nova_max_concurrency,
            connect_timeout: self.nova_connect_timeout,
            tls_handshake_timeout: self.nova_tls_handshake_timeout,
            cinder_url: self.cinder_url.clone(),
            cinder_microversion: self.cinder_microversion.clone(),
            confirm_with: self.confirm_with.map(ConfirmWith::from),
        })
    }
}

/// How Keystone is asked for a token (`OS_AUTH_TYPE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AuthType {
    Password,
    ApplicationCredential,
}

impl OpenStackArgs {
    /// The explicit settings, by openstacksdk key.
    fn given(&self) -> BTreeMap<&'static str, String> {
        let mut m = BTreeMap::new();
        let mut put = |k: &'static str, v: &Option<String>| {
            if let Some(v) = v {
                m.insert(k, v.clone());
            }
        };
        put("auth_type", &self.os_auth_type);
        put("auth_url", &self.os_auth_url);
        put("username", &self.os_username);
        put("password", &self.os_password);
        put("project_name", &self.os_project_name);
        put("user_domain_name", &self.os_user_domain_name);
        put("project_domain_name", &self.os_project_domain_name);
        put(
            "application_credential_id",
            &self.os_application_credential_id,
        );
        put(
            "application_credential_name",
            &self.os_application_credential_name,
        );
        put(
            "application_credential_secret",
            &self.os_application_credential_secret,
        );
        put("region_name", &self.os_region_name);
        put("interface", &self.os_interface);
        put(
            "cacert",
            &self.os_cacert.as_ref().map(|p| p.display().to_string()),
        );
        put(
            "verify",
            &self.os_insecure.map(|insecure| (!insecure).to_string()),
        );
        m
    }

    /// The settings resolved: explicit ones over `OS_CLOUD`'s entry of
    /// clouds.yaml and secure.yaml (openstacksdk's search path) over the
    /// defaults.
    pub fn resolve(&self) -> anyhow::Result<clouds::Resolved> {
        self.resolve_in(self.os_cloud.as_deref(), &clouds::Search::standard())
    }

    /// As `resolve`, for `cloud`, looking for the files in `search`.
    pub fn resolve_in(
        &self,
        cloud: Option<&str>,
        search: &clouds::Search,
    ) -> anyhow::Result<clouds::Resolved> {
        clouds::resolve(cloud, &self.given(), search)
    }

    fn auth_type(r: &clouds::Resolved) -> anyhow::Result<AuthType> {
        match r.get("auth_type") {
            Some("password" | "v3password") => Ok(AuthType::Password),
            Some(
                "v3applicationcredential" | "applicationcredential" | "application_credential",
            ) => Ok(AuthType::ApplicationCredential),
            Some(other) => anyhow::bail!(
                "{} is {other:?}; this service speaks password and v3applicationcredential",
                r.describe("auth_type")
            ),
            // Unsaid: an application credential when one is all there is.
            None if r.get("application_credential_secret").is_some()
                && r.get("password").is_none() =>
            {
                Ok(AuthType::ApplicationCredential)
            }
            None => Ok(AuthType::Password),
        }
    }

    /// The Keystone settings from resolved values; every error names the
    /// setting (and the file a value came from).
    pub fn keystone(&self, r: &clouds::Resolved) -> anyhow::Result<KeystoneConfig> {
        let auth_type = Self::auth_type(r)?;
        let need: &[&str] = match auth_type {
            AuthType::Password => &["auth_url", "username", "password", "project_name"],
            AuthType::ApplicationCredential => &["auth_url", "application_credential_secret"],
        };
        let mut missing: Vec<String> = need
            .iter()
            .filter(|k| r.get(k).is_none())
            .map(|k| r.describe(k))
            .collect();
        if auth_type == AuthType::ApplicationCredential
            && r.get("application_credential_id").is_none()
        {
            if r.get("application_credential_name").is_none() {
                missing.push("OS_APPLICATION_CREDENTIAL_ID (or OS_APPLICATION_CREDENTIAL_NAME with OS_USERNAME)".into());
            } else if r.get("username").is_none() {
                missing.push("OS_USERNAME (the owner of the application credential OS_APPLICATION_CREDENTIAL_NAME names)".into());
            }
        }
        if !missing.is_empty() {
            anyhow::bail!(
                "no Nova endpoint: give --nova-url (direct mode) or the Keystone settings; for {} authentication, missing: {}",
                match auth_type {
                    AuthType::Password => "password",
                    AuthType::ApplicationCredential => "application credential",
                },
                missing.join(", ")
            );
        }
        // Every key read below was checked present above (or has a default).
        let text = |k: &str| r.get(k).unwrap_or_default().to_string();
        let auth_url = http_url(&text("auth_url"))
            .map_err(|e| anyhow::anyhow!("{}: {e}", r.describe("auth_url")))?;
        let credential = match auth_type {
            AuthType::Password => Credential::Password {
                username: text("username"),
                user_domain_name: text("user_domain_name"),
                password: Secret::new(text("password")),
                project_name: text("project_name"),
                project_domain_name: text("project_domain_name"),
            },
            AuthType::ApplicationCredential => match r.get("application_credential_id") {
                Some(id) => Credential::ApplicationCredentialId {
                    id: id.to_string(),
                    secret: Secret::new(text("application_credential_secret")),
                },
                None => Credential::ApplicationCredentialName {
                    name: text("application_credential_name"),
                    username: text("username"),
                    user_domain_name: text("user_domain_name"),
                    secret: Secret::new(text("application_credential_secret")),
                },
            },
        };
        let interface = match text("interface").trim_end_matches("URL") {
            i @ ("public" | "internal" | "admin") => i.to_string(),
            other => anyhow::bail!(
                "{} is {other:?}; use public, internal or admin",
                r.describe("interface")
            ),
        };
        Ok(KeystoneConfig {
            auth_url,
            credential,
            region: r.get("region_name").map(str::to_string),
            interface,
            renewal_timeout: self.keystone_timeout,
            renew_before: KEYSTONE_RENEW_BEFORE,
        })
    }

    /// How TLS servers are trusted: `cacert` and `verify` as resolved.
    pub fn tls(&self, r: &clouds::Resolved) -> anyhow::Result<TlsTrust> {
        let ca = match r.get("cacert") {
            Some(path) => Some(
                CaBundle::from_file(std::path::Path::new(path))
                    .map_err(|e| anyhow::anyhow!("{}: {e}", r.describe("cacert")))?,
            ),
            None => None,
        };
        let insecure = match r.get("verify") {
            Some("false" | "False") => true,
            Some("true" | "True") | None => false,
            Some(other) => anyhow::bail!(
                "{}: verify is {other:?}; write true or false (a CA bundle goes in cacert)",
                r.describe("verify")
            ),
        };
        Ok(TlsTrust { ca, insecure })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flags' defaults and the settings structs' defaults are one:
    /// what an empty command line converts into equals each struct's
    /// `Default`, compared whole (Debug, so the structs need no PartialEq;
    /// fields without a flag come from the same `DEFAULT`).
    #[test]
    fn an_empty_command_line_converts_into_every_settings_default() {
        let url = "http://127.0.0.1:8774/v2.1";
        let args = ServeArgs::from_args(["--nova-url", url]).unwrap();
        let same = |what: &str, from_flags: String, default: String| {
            assert_eq!(
                from_flags, default,
                "{what}: the flags' defaults differ from the struct's"
            )
        };
        same(
            "BudgetPolicy",
            format!("{:?}", args.budget_policy()),
            format!("{:?}", BudgetPolicy::default()),
        );
        same(
            "ExecSettings",
            format!("{:?}", args.exec_settings()),
            format!("{:?}", ExecSettings::default()),
        );
        same(
            "ReconcilerSettings",
            format!("{:?}", args.reconciler_settings()),
            format!("{:?}", ReconcilerSettings::default()),
        );
        same(
            "RetentionSettings",
            format!("{:?}", args.retention_settings()),
            format!("{:?}", RetentionSettings::default()),
        );
        same(
            "DbBounds",
            format!("{:?}", args.db_bounds()),
            format!("{:?}", crate::store::DbBounds::DEFAULT),
        );
        same(
            "NovaConfig",
            format!("{:?}", args.nova_config().unwrap()),
            format!(
                "{:?}",
                NovaConfig {
                    endpoint: NovaEndpoint::Direct(url.into()),
                    ..NovaConfig::default()
                }
            ),
        );
    }

    #[test]
    fn cinder_settings_reach_the_nova_config_and_contradictions_are_refused() {
        let args = ServeArgs::from_args([
            "--nova-url",
            "http://n:8774/v2.1",
            "--cinder-url",
            "http://c:8776/v3/p",
            "--confirm-with",
            "cinder",
            "--cinder-microversion",
            "3.60",
        ])
        .unwrap();
        let cfg = args.nova_config().unwrap();
        assert_eq!(cfg.cinder_url.as_deref(), Some("http://c:8776/v3/p"));
        assert_eq!(cfg.confirm_with, Some(ConfirmWith::Cinder));
        assert_eq!(cfg.cinder_microversion, "3.60");
        let args = ServeArgs::from_args(["--nova-url", "http://n", "--confirm-with", "nova-list"])
            .unwrap();
        assert_eq!(
            args.nova_config().unwrap().confirm_with,
            Some(ConfirmWith::NovaList)
        );
        // Direct mode has no catalog to find Cinder in.
        let err = ServeArgs::from_args(["--nova-url", "http://n", "--confirm-with", "cinder"])
            .unwrap()
            .nova_config()
            .unwrap_err()
            .to_string();
        assert!(err.contains("--cinder-url"), "{err}");
        for bad in ["latest", "2.89", "3", "3.", "3.x", "volume 3.27"] {
            assert!(
                ServeArgs::from_args(["--nova-url", "http://n", "--cinder-microversion", bad])
                    .is_err(),
                "{bad} was accepted"
            );
        }
    }

    #[test]
    fn a_window_past_a_year_is_refused_naming_its_flag() {
        let check = |flags: &[&str]| {
            let mut argv = vec!["--nova-url", "http://n"];
            argv.extend(flags);
            ServeArgs::from_args(argv).unwrap().validate()
        };
        // 600 million years is past chrono's range (it was read as 0,
        // "decide at once"); 1,000 years is within it, and still a typo.
        for flag in [
            "--settle-window-attach",
            "--settle-window-detach",
            "--settle-window",
            "--verify-window",
        ] {
            for value in ["600000000years", "1000years"] {
                let err = check(&[flag, value]).unwrap_err().to_string();
                assert!(err.contains(&format!("{flag} (")), "{flag} {value}: {err}");
            }
        }
        let err = check(&["--verify-after", "2years", "--verify-window", "3years"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--verify-after (") && err.contains("--verify-window ("),
            "{err}"
        );
        check(&["--settle-window", "366days", "--verify-window", "366days"]).unwrap();
    }

    #[test]
    fn retention_settings_are_checked_naming_their_flags() {
        let check = |flags: &[&str]| {
            let mut argv = vec!["--nova-url", "http://n"];
            argv.extend(flags);
            ServeArgs::from_args(argv).unwrap().validate()
        };
        for (flags, needle) in [
            (vec!["--retain", "30s"], "--retain (30s)"),
            (
                vec!["--retain", "90days", "--retain-keys", "30days"],
                "--retain-keys",
            ),
            (vec!["--retain-batch", "0"], "--retain-batch"),
        ] {
            let err = check(&flags).unwrap_err().to_string();
            assert!(err.contains(needle), "{flags:?}: {err}");
        }
        for ok in [
            vec!["--retain", "0"],
            vec!["--retain", "0", "--retain-keys", "1m"],
            vec!["--retain", "5m", "--retain-keys", "0"],
            vec!["--retain", "1m", "--retain-keys", "1m"],
        ] {
            check(&ok).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
        }
        assert!(ServeArgs::from_args(["--retain", "ninety"]).is_err());
        let args = ServeArgs::from_args(["--retain", "0"]).unwrap();
        assert_eq!(args.retention_settings().keep(), None, "0 keeps everything");
        let args = ServeArgs::from_args(["--retain", "1m", "--verify-window", "10m"]).unwrap();
        assert_eq!(
            args.retention_settings().keep(),
            Some(Duration::from_secs(1200)),
            "a decision the verifier may still look at is kept"
        );
    }

    #[test]
    fn durations_render_the_way_the_flags_read_them() {
        for d in [
            Duration::ZERO,
            Duration::from_millis(50),
            Duration::from_millis(1500),
            Duration::from_secs(120),
            Duration::from_secs(3600),
        ] {
            assert_eq!(duration(&render_duration(d)), Ok(d));
        }
    }

    /// A directory of its own, removed when the test is done with it.
    struct Scratch(std::path::PathBuf);

    impl std::ops::Deref for Scratch {
        type Target = std::path::Path;
        fn deref(&self) -> &std::path::Path {
            &self.0
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            // Best effort: a directory left behind only costs disk space.
            drop(std::fs::remove_dir_all(&self.0));
        }
    }

    /// A directory of its own with these files in it.
    fn files(files: &[(&str, &str)]) -> Scratch {
        let dir = std::env::temp_dir().join(format!("vr-clouds-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, text) in files {
            std::fs::write(dir.join(name), text).unwrap();
        }
        Scratch(dir)
    }

    fn search(dir: &std::path::Path) -> clouds::Search {
        clouds::Search {
            clouds: vec![dir.join("clouds.yaml")],
            secure: vec![dir.join("secure.yaml")],
        }
    }

    fn keystone_of(flags: &[&str], dir: &std::path::Path) -> anyhow::Result<KeystoneConfig> {
        let args = ServeArgs::from_args(flags.iter().copied()).unwrap();
        let r = args
            .openstack
            .resolve_in(args.openstack.os_cloud.as_deref(), &search(dir))?;
        args.openstack.keystone(&r)
    }

    const PROD: &str = "clouds:\n  prod:\n    auth:\n      auth_url: https://keystone.example/v3\n      username: svc\n      password: from-file\n      project_name: storage\n      user_domain_name: Corp\n      project_domain_name: Corp\n    region_name: RegionTwo\n    interface: internal\n    identity_api_version: 3\n";

    #[test]
    fn os_cloud_fills_what_the_os_variables_leave_open() {
        let dir = files(&[("clouds.yaml", PROD)]);
        let k = keystone_of(&["--os-cloud", "prod", "--os-password", "from-flag"], &dir).unwrap();
        assert_eq!(k.auth_url, "https://keystone.example/v3");
        let Credential::Password {
            username,
            password,
            user_domain_name,
            project_name,
            project_domain_name,
        } = &k.credential
        else {
            panic!("{k:?}")
        };
        assert_eq!(username, "svc");
        assert_eq!(
            password.expose(),
            "from-flag",
            "an explicit setting wins over the file"
        );
        assert_eq!(
            (
                user_domain_name.as_str(),
                project_name.as_str(),
                project_domain_name.as_str()
            ),
            ("Corp", "storage", "Corp")
        );
        assert_eq!(
            (k.region.as_deref(), k.interface.as_str()),
            (Some("RegionTwo"), "internal")
        );
        let err = keystone_of(&["--os-cloud", "staging"], &dir)
            .unwrap_err()
            .to_string();
        assert!(err.contains("staging") && err.contains("prod"), "{err}");
    }

    #[test]
    fn an_explicit_setting_wins_over_the_file_even_when_it_equals_the_default() {
        let dir = files(&[("clouds.yaml", PROD)]);
        let k = keystone_of(
            &[
                "--os-cloud",
                "prod",
                "--os-interface",
                "public",
                "--os-user-domain-name",
                "Default",
            ],
            &dir,
        )
        .unwrap();
        assert_eq!(k.interface, "public");
        let Credential::Password {
            user_domain_name,
            project_domain_name,
            ..
        } = &k.credential
        else {
            panic!("{k:?}")
        };
        assert_eq!(user_domain_name, "Default");
        assert_eq!(project_domain_name, "Corp", "unset: the file's");
        // With nothing said anywhere, the defaults.
        let k = keystone_of(
            &[
                "--os-auth-url",
                "http://k/v3",
                "--os-username",
                "u",
                "--os-password",
                "p",
                "--os-project-name",
                "x",
            ],
            &dir,
        )
        .unwrap();
        assert_eq!(k.interface, "public");
    }

    #[test]
    fn secure_yaml_overrides_clouds_yaml_key_by_key_for_the_same_cloud() {
        let dir = files(&[
            ("clouds.yaml", PROD),
            (
                "secure.yaml",
                "clouds:\n  prod:\n    auth:\n      password: from-secure\n  other:\n    auth:\n      username: nobody\n",
            ),
        ]);
        let args = ServeArgs::from_args(["--os-cloud", "prod"]).unwrap();
        let r = args
            .openstack
            .resolve_in(Some("prod"), &search(&dir))
            .unwrap();
        assert_eq!(r.get("password"), Some("from-secure"));
        assert_eq!(
            r.source("password"),
            Some(&clouds::Source::Secure(dir.join("secure.yaml")))
        );
        assert_eq!(
            r.get("username"),
            Some("svc"),
            "the rest stays clouds.yaml's"
        );
        assert_eq!(
            r.source("username"),
            Some(&clouds::Source::Clouds(dir.join("clouds.yaml")))
        );
        assert_eq!(r.files, [dir.join("clouds.yaml"), dir.join("secure.yaml")]);
        let shown = format!("{:?}", r.rows());
        assert!(!shown.contains("from-secure"), "masked: {shown}");
        // A secure.yaml without this cloud changes nothing.
        let dir = files(&[
            ("clouds.yaml", PROD),
            (
                "secure.yaml",
                "clouds:\n  other:\n    auth:\n      password: x\n",
            ),
        ]);
        let r = args
            .openstack
            .resolve_in(Some("prod"), &search(&dir))
            .unwrap();
        assert_eq!(r.get("password"), Some("from-file"));
        assert_eq!(r.files, [dir.join("clouds.yaml")]);
    }

    #[test]
    fn application_credentials_by_id_or_by_name_and_user() {
        let dir = files(&[(
            "clouds.yaml",
            "clouds:\n  svc:\n    auth_type: v3applicationcredential\n    auth:\n      auth_url: http://k/v3\n      application_credential_id: 423f19a4\n      application_credential_secret: s3cr3t\n",
        )]);
        let k = keystone_of(&["--os-cloud", "svc"], &dir).unwrap();
        assert!(
            matches!(&k.credential, Credential::ApplicationCredentialId { id, secret } if id == "423f19a4" && secret.expose() == "s3cr3t"),
            "{k:?}"
        );
        let by_name = [
            "--os-auth-url",
            "http://k/v3",
            "--os-auth-type",
            "v3applicationcredential",
            "--os-application-credential-name",
            "monitoring",
            "--os-application-credential-secret",
            "s",
        ];
        let err = keystone_of(&by_name, &dir).unwrap_err().to_string();
        assert!(err.contains("OS_USERNAME"), "the owner is needed: {err}");
        let mut with_user = by_name.to_vec();
        with_user.extend(["--os-username", "svc"]);
        let k = keystone_of(&with_user, &dir).unwrap();
        assert!(
            matches!(&k.credential, Credential::ApplicationCredentialName { name, username, user_domain_name, .. }
                if name == "monitoring" && username == "svc" && user_domain_name == "Default"),
            "{k:?}"
        );
        // Unsaid, an application credential is inferred when it is all there is.
        let k = keystone_of(
            &[
                "--os-auth-url",
                "http://k/v3",
                "--os-application-credential-id",
                "abc",
                "--os-application-credential-secret",
                "s",
            ],
            &dir,
        )
        .unwrap();
        assert!(matches!(
            k.credential,
            Credential::ApplicationCredentialId { .. }
        ));
        let err = keystone_of(
            &["--os-auth-type", "token", "--os-auth-url", "http://k/v3"],
            &dir,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("OS_AUTH_TYPE") && err.contains("v3applicationcredential"),
            "{err}"
        );
    }

    #[test]
    fn bad_settings_are_named_with_the_file_they_came_from() {
        let dir = files(&[(
            "clouds.yaml",
            "clouds:\n  bad:\n    auth:\n      auth_url: ftp://keystone/v3\n      username: u\n      password: p\n      project_name: x\n    cacert: /nonexistent/ca.pem\n",
        )]);
        let err = keystone_of(&["--os-cloud", "bad"], &dir)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("OS_AUTH_URL") && err.contains("clouds.yaml") && err.contains("ftp"),
            "{err}"
        );
        let args = ServeArgs::from_args(["--os-cloud", "bad"]).unwrap();
        let r = args
            .openstack
            .resolve_in(Some("bad"), &search(&dir))
            .unwrap();
        let err = args.openstack.tls(&r).unwrap_err().to_string();
        assert!(
            err.contains("OS_CACERT") && err.contains("/nonexistent/ca.pem"),
            "{err}"
        );
        let err = keystone_of(
            &[
                "--os-cloud",
                "bad",
                "--os-auth-url",
                "http://k/v3",
                "--os-interface",
                "private",
            ],
            &dir,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("OS_INTERFACE"), "{err}");
    }

    #[test]
    fn verify_false_and_insecure_turn_certificate_checks_off() {
        let dir = files(&[(
            "clouds.yaml",
            "clouds:\n  a:\n    verify: false\n  b:\n    insecure: true\n  c: {}\n",
        )]);
        for (cloud, flags, insecure) in [
            ("a", vec![], true),
            ("b", vec![], true),
            ("c", vec![], false),
            ("c", vec!["--os-insecure"], true),
            ("a", vec!["--os-insecure", "false"], false),
        ] {
            let mut argv = vec!["--os-cloud", cloud];
            argv.extend(flags.iter().copied());
            let args = ServeArgs::from_args(argv.clone()).unwrap();
            let r = args
                .openstack
                .resolve_in(Some(cloud), &search(&dir))
                .unwrap();
            assert_eq!(
                args.openstack.tls(&r).unwrap().insecure,
                insecure,
                "{argv:?}"
            );
        }
    }

    #[test]
    fn nova_urls_and_microversions_are_checked_naming_the_flag() {
        for (flags, needle) in [
            (vec!["--nova-url", "ftp://x"], "--nova-url"),
            (vec!["--nova-url", "not a url"], "--nova-url"),
            (
                vec![
                    "--nova-url",
                    "http://127.0.0.1:8774/v2.1",
                    "--nova-microversion",
                    "banana",
                ],
                "--nova-microversion",
            ),
            (
                vec![
                    "--nova-url",
                    "http://127.0.0.1:8774/v2.1",
                    "--nova-microversion",
                    "2.0",
                ],
                "--nova-microversion",
            ),
        ] {
            let err = ServeArgs::from_args(flags.clone()).unwrap_err().to_string();
            assert!(err.contains(needle), "{flags:?}: {err}");
        }
        let ok = ServeArgs::from_args([
            "--nova-url",
            "https://nova.example/compute/v2.1",
            "--nova-microversion",
            "latest",
        ])
        .unwrap();
        assert_eq!(ok.nova_microversion, Microversion::Latest);
    }
}
