//! `serve`'s flags: every setting with its flag, environment variable,
//! default and help heading, in one declaration (`ServeArgs`), and parsing
//! them alone (`ServeArgs::from_args`). Their conversions into the
//! settings structs are `settings`.
//!
//! Why it is long: every flag of `serve` with its documentation is one
//! field here; split into a struct per help heading, the one place that
//! lists every setting (and every caller's `args.flag`) would be lost.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, Parser, ValueEnum};

use super::openstack::{OpenStackArgs, cinder_microversion, http_url, microversion};
use super::{
    DEFAULT_ADMIN_LISTEN, DEFAULT_DATABASE_URL, DEFAULT_LISTEN, NOVA_DISCOVERY_TIMEOUT,
    NOVA_PROBE_INTERVAL, NOVA_PROBE_TIMEOUT, READY_DB_GRACE,
};
use crate::domain::BudgetPolicy;
use crate::domain::parse::{duration, fraction, rate, render_duration, signed_duration};
use crate::executor::ExecSettings;
use crate::nova::{ConfirmWith, Microversion, NovaConfig};
use crate::reconciler::ReconcilerSettings;
use crate::retention::RetentionSettings;

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
    /// Default and least: 2 × --db-statement-timeout + --heartbeat + 500ms
    /// (11.5s with theirs), so that no round trip the service calls
    /// healthy loses a lease or closes the send gate.
    #[arg(help_heading = "Leases", long, env = "VOLUME_RECONCILER_LEASE", value_parser = duration)]
    pub lease: Option<Duration>,
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
    /// A fair share per caller: rows `NAME key=value...` (one a line, or
    /// `;` between rows; or @FILE of them), `default` for every caller not
    /// named. Keys: rate (attach/detach calls a second), burst, inflight
    /// (operations running), nova-share (weight in Nova's request slots
    /// when contended). Beyond a quota: RESOURCE_EXHAUSTED
    /// CALLER_QUOTA_EXCEEDED with QuotaFailure and RetryInfo.
    #[arg(
        help_heading = "Load shedding",
        long,
        env = "VOLUME_RECONCILER_CALLER_QUOTAS",
        value_name = "ROWS"
    )]
    pub caller_quotas: Option<String>,
    /// Largest request metadata (HTTP/2 header list) accepted.
    #[arg(help_heading = "Shutdown and connections", long, env = "VOLUME_RECONCILER_MAX_METADATA_BYTES", default_value_t = 16 * 1024)]
    pub max_metadata_bytes: u32,

    #[command(flatten, next_help_heading = "OpenStack (Keystone mode)")]
    pub openstack: OpenStackArgs,
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
}
