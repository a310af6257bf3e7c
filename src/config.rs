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

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, Parser, ValueEnum};

use crate::domain::BudgetPolicy;
use crate::executor::ExecSettings;
use crate::nova::{ConfirmWith, KeystoneConfig, NovaConfig, NovaEndpoint, Secret};
use crate::reconciler::ReconcilerSettings;

/// The gRPC listen address by default; also where the clients look first.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:50051";
/// The admin listener by default; also where `healthcheck` looks.
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9090";
/// The embedded ledger by default (`serve` and `migrate`).
pub const DEFAULT_DATABASE_URL: &str = "sqlite://volume-reconciler.db";

/// A duration as `duration` reads it back (`humantime`: `2m`, `50ms`): how
/// a settings struct's default becomes a flag's default.
pub fn render_duration(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// Parses a duration flag (`500ms`, `30s`, `5m`).
pub fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (write durations like 500ms, 30s, 5m)"))
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable on a terminal, JSON otherwise.
    Auto,
    Human,
    Json,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// gRPC listen address.
    #[arg(
        long,
        env = "VOLUME_RECONCILER_LISTEN",
        default_value = DEFAULT_LISTEN
    )]
    pub listen: SocketAddr,
    /// Admin listener: /healthz, /readyz, /metrics (plain HTTP; keep it on loopback unless needed).
    #[arg(
        long,
        env = "VOLUME_RECONCILER_ADMIN_LISTEN",
        default_value = DEFAULT_ADMIN_LISTEN
    )]
    pub admin_listen: SocketAddr,
    /// postgres://user@host/db (production, several replicas) or
    /// sqlite://FILE (embedded, one process; created on first start).
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = DEFAULT_DATABASE_URL
    )]
    pub database_url: String,
    /// PostgreSQL connections of this replica, at most (5 at least): the
    /// ledger writers' own (a quarter of them, 1 to 4, plus one for a lone
    /// write) and a pool for the rest (reads, the reconciler, the listener).
    #[arg(
        long,
        env = "VOLUME_RECONCILER_DB_MAX_CONNECTIONS",
        default_value_t = 16
    )]
    pub db_max_connections: u32,
    /// Nova's compute endpoint (direct mode, no Keystone), e.g. http://127.0.0.1:8774/v2.1.
    /// Without it, the endpoint comes from Keystone (OS_* variables).
    #[arg(long, env = "VOLUME_RECONCILER_NOVA_URL")]
    pub nova_url: Option<String>,
    /// This instance's name in leases and the reconcile log (default: host-pid).
    #[arg(long, env = "VOLUME_RECONCILER_REPLICA_ID")]
    pub replica_id: Option<String>,
    #[arg(
        long,
        env = "VOLUME_RECONCILER_NOVA_MICROVERSION",
        default_value_t = NovaConfig::default().microversion
    )]
    pub nova_microversion: String,
    /// Concurrent Nova requests per host; waiting for a slot counts against the deadline.
    #[arg(
        long,
        env = "VOLUME_RECONCILER_NOVA_MAX_CONCURRENCY",
        default_value_t = NovaConfig::default().max_concurrent_per_host
    )]
    pub nova_max_concurrency: usize,
    /// Bound of a TCP connect to Nova/Keystone (connection setup only).
    #[arg(long, env = "VOLUME_RECONCILER_NOVA_CONNECT_TIMEOUT", value_parser = duration, default_value = render_duration(NovaConfig::default().connect_timeout))]
    pub nova_connect_timeout: Duration,
    /// Bound of a TLS handshake with Nova/Keystone (connection setup only).
    #[arg(long, env = "VOLUME_RECONCILER_NOVA_TLS_HANDSHAKE_TIMEOUT", value_parser = duration, default_value = render_duration(NovaConfig::default().tls_handshake_timeout))]
    pub nova_tls_handshake_timeout: Duration,
    /// Cinder's v3 endpoint with the project id (direct mode, like --nova-url),
    /// e.g. http://127.0.0.1:8776/v3/PROJECT_ID. Without it, the catalog's
    /// block-storage (or volumev3) endpoint in Keystone mode, none in direct mode.
    #[arg(long, env = "VOLUME_RECONCILER_CINDER_URL")]
    pub cinder_url: Option<String>,
    /// How attaches and detaches are confirmed: by Cinder's view of the volume
    /// (attached to the server, as cinder-csi waits for) or by Nova's attachment
    /// list (a reservation shows there before the attach is usable). Default:
    /// cinder when --cinder-url is given or the catalog has block-storage, else
    /// nova-list (with a warning at startup).
    #[arg(long, env = "VOLUME_RECONCILER_CONFIRM_WITH", value_enum)]
    pub confirm_with: Option<ConfirmArg>,
    /// `OpenStack-API-Version: volume X` on Cinder requests (3.27: the attachments
    /// API, whose reserved/attaching/in-use flow Nova uses).
    #[arg(
        long,
        env = "VOLUME_RECONCILER_CINDER_MICROVERSION",
        value_parser = cinder_microversion,
        default_value = NovaConfig::DEFAULT_CINDER_MICROVERSION
    )]
    pub cinder_microversion: String,

    /// Deadline applied only when a caller sends none.
    #[arg(long, env = "VOLUME_RECONCILER_DEFAULT_DEADLINE", value_parser = duration, default_value = "5m")]
    pub default_deadline: Duration,
    /// Share of the remaining time kept to answer before the caller gives up.
    #[arg(long, env = "VOLUME_RECONCILER_SAFETY_MARGIN_FRACTION", value_parser = fraction, default_value_t = BudgetPolicy::DEFAULT.margin_fraction)]
    pub safety_margin_fraction: f64,
    #[arg(long, env = "VOLUME_RECONCILER_SAFETY_MARGIN_MIN", value_parser = duration, default_value = render_duration(BudgetPolicy::DEFAULT.margin_min))]
    pub safety_margin_min: Duration,
    #[arg(long, env = "VOLUME_RECONCILER_SAFETY_MARGIN_MAX", value_parser = duration, default_value = render_duration(BudgetPolicy::DEFAULT.margin_max))]
    pub safety_margin_max: Duration,
    /// Share of the remaining time kept back to re-observe after a lost response.
    #[arg(long, env = "VOLUME_RECONCILER_REOBSERVE_RESERVE_FRACTION", value_parser = fraction, default_value_t = BudgetPolicy::DEFAULT.reserve_fraction)]
    pub reobserve_reserve_fraction: f64,
    #[arg(long, env = "VOLUME_RECONCILER_REOBSERVE_RESERVE_MAX", value_parser = duration, default_value = render_duration(BudgetPolicy::DEFAULT.reserve_max))]
    pub reobserve_reserve_max: Duration,
    /// The longest one Nova request may take (policy, visible and configurable).
    #[arg(long, env = "VOLUME_RECONCILER_PER_CALL_CAP", value_parser = duration, default_value = render_duration(BudgetPolicy::DEFAULT.per_call_cap))]
    pub per_call_cap: Duration,
    /// Below this much time for the Nova request, Nova is not called (BUDGET_TOO_SMALL).
    #[arg(long, env = "VOLUME_RECONCILER_MIN_BUDGET", value_parser = duration, default_value = render_duration(BudgetPolicy::DEFAULT.min_budget))]
    pub min_budget: Duration,
    /// How long past its deadline an operation's lease outlives a crash.
    #[arg(long, env = "VOLUME_RECONCILER_LEASE_GRACE", value_parser = duration, default_value = render_duration(ExecSettings::DEFAULT.lease_grace))]
    pub lease_grace: Duration,

    /// Nova may still process a request this long after it was sent.
    #[arg(long, env = "VOLUME_RECONCILER_SETTLE_WINDOW", value_parser = duration, default_value = render_duration(ReconcilerSettings::DEFAULT.settle_window))]
    pub settle_window: Duration,
    #[arg(long, env = "VOLUME_RECONCILER_RECONCILE_INTERVAL", value_parser = duration, default_value = render_duration(ReconcilerSettings::DEFAULT.interval))]
    pub reconcile_interval: Duration,
    #[arg(long, env = "VOLUME_RECONCILER_RECONCILE_BATCH", default_value_t = ReconcilerSettings::DEFAULT.batch)]
    pub reconcile_batch: u32,
    #[arg(long, env = "VOLUME_RECONCILER_RECONCILE_LEASE", value_parser = duration, default_value = render_duration(ReconcilerSettings::DEFAULT.lease))]
    pub reconcile_lease: Duration,
    /// The reconciler's Nova requests per second, at most (all passes of this replica).
    #[arg(
        long,
        env = "VOLUME_RECONCILER_RECONCILE_RATE_LIMIT",
        default_value_t = ReconcilerSettings::DEFAULT.rate_limit
    )]
    pub reconcile_rate_limit: f64,
    #[arg(
        long,
        env = "VOLUME_RECONCILER_RECONCILE_PARALLELISM",
        default_value_t = ReconcilerSettings::DEFAULT.parallelism
    )]
    pub reconcile_parallelism: usize,
    /// Decided operations are re-observed once this long after the decision...
    #[arg(long, env = "VOLUME_RECONCILER_VERIFY_AFTER", value_parser = duration, default_value = render_duration(ExecSettings::DEFAULT.verify_after))]
    pub verify_after: Duration,
    /// ...and only within this window.
    #[arg(long, env = "VOLUME_RECONCILER_VERIFY_WINDOW", value_parser = duration, default_value = render_duration(ReconcilerSettings::DEFAULT.verify_window))]
    pub verify_window: Duration,
    /// Run no background reconciler in this process.
    #[arg(long, env = "VOLUME_RECONCILER_NO_RECONCILER")]
    pub no_reconciler: bool,

    /// After SIGTERM: keep serving (not ready) this long so load balancers notice.
    #[arg(long, env = "VOLUME_RECONCILER_SHUTDOWN_DELAY", value_parser = duration, default_value = "5s")]
    pub shutdown_delay: Duration,
    /// Then wait at most this long for in-flight RPCs.
    #[arg(long, env = "VOLUME_RECONCILER_DRAIN_TIMEOUT", value_parser = duration, default_value = "30s")]
    pub drain_timeout: Duration,
    /// Rotate client connections after this age (GOAWAY, graceful).
    #[arg(long, env = "VOLUME_RECONCILER_MAX_CONNECTION_AGE", value_parser = duration)]
    pub max_connection_age: Option<Duration>,
    #[arg(long, env = "VOLUME_RECONCILER_HTTP2_KEEPALIVE_INTERVAL", value_parser = duration, default_value = "30s")]
    pub http2_keepalive_interval: Duration,
    #[arg(long, env = "VOLUME_RECONCILER_HTTP2_KEEPALIVE_TIMEOUT", value_parser = duration, default_value = "20s")]
    pub http2_keepalive_timeout: Duration,
    #[arg(
        long,
        env = "VOLUME_RECONCILER_MAX_CONCURRENT_STREAMS",
        default_value_t = 1024
    )]
    pub max_concurrent_streams: u32,
    /// The longest a WatchOperation stream waits for its next message.
    #[arg(long, env = "VOLUME_RECONCILER_WATCH_IDLE_TIMEOUT", value_parser = duration, default_value = "10m")]
    pub watch_idle_timeout: Duration,
    /// Largest gRPC request message accepted.
    #[arg(long, env = "VOLUME_RECONCILER_MAX_MESSAGE_BYTES", default_value_t = 64 * 1024)]
    pub max_message_bytes: usize,

    /// TLS certificate (PEM) of the gRPC port; with --tls-key, TLS is on.
    #[arg(long, env = "VOLUME_RECONCILER_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,
    #[arg(long, env = "VOLUME_RECONCILER_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,
    /// CA (PEM) that client certificates must be signed by (mutual TLS).
    #[arg(long, env = "VOLUME_RECONCILER_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<std::path::PathBuf>,
    /// Bound of a TLS handshake with a client (connection setup only).
    #[arg(long, env = "VOLUME_RECONCILER_TLS_HANDSHAKE_TIMEOUT", value_parser = duration, default_value = "5s")]
    pub tls_handshake_timeout: Duration,
    /// Callers allowed in, as NAME:ROLE:SHA256HEX entries (comma separated;
    /// ROLE is orchestrator or operator; the hash is `sha256sum` of the
    /// token). When set, every RPC but health needs `authorization: Bearer`.
    #[arg(long, env = "VOLUME_RECONCILER_AUTH_TOKENS", hide_env_values = true)]
    pub auth_tokens: Option<String>,
    /// Attach/detach calls in flight at most; beyond, RESOURCE_EXHAUSTED at once.
    #[arg(
        long,
        env = "VOLUME_RECONCILER_MAX_INFLIGHT_MUTATIONS",
        default_value_t = 16384
    )]
    pub max_inflight_mutations: usize,
    /// Attach/detach calls per second per caller (token bucket; 0: off).
    #[arg(
        long,
        env = "VOLUME_RECONCILER_CALLER_RATE_LIMIT",
        default_value_t = 0.0,
        value_parser = rate
    )]
    pub caller_rate_limit: f64,
    /// Burst of the per-caller token bucket (calls, at least 1).
    #[arg(long, env = "VOLUME_RECONCILER_CALLER_BURST", default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
    pub caller_burst: u32,
    /// Largest request metadata (HTTP/2 header list) accepted.
    #[arg(long, env = "VOLUME_RECONCILER_MAX_METADATA_BYTES", default_value_t = 16 * 1024)]
    pub max_metadata_bytes: u32,

    #[command(flatten)]
    pub openstack: OpenStackArgs,
}

/// Bound of one Keystone token renewal by default.
const KEYSTONE_RENEWAL_TIMEOUT: Duration = Duration::from_secs(30);
/// Renew a token this long before it expires (keystoneauth uses 120 s).
const KEYSTONE_RENEW_BEFORE: Duration = Duration::from_secs(120);
/// Keystone's default domain name (OS_USER_DOMAIN_NAME, OS_PROJECT_DOMAIN_NAME).
const DEFAULT_DOMAIN: &str = "Default";
/// The catalog interface by default (OS_INTERFACE).
const DEFAULT_INTERFACE: &str = "public";

/// The standard OpenStack variables, for Keystone mode.
#[derive(Debug, Clone, Args)]
pub struct OpenStackArgs {
    /// A cloud of clouds.yaml (OS_CLIENT_CONFIG_FILE, ./clouds.yaml,
    /// ~/.config/openstack/clouds.yaml, /etc/openstack/clouds.yaml); the
    /// OS_* settings below override its values.
    #[arg(long, env = "OS_CLOUD")]
    pub os_cloud: Option<String>,
    #[arg(long, env = "OS_AUTH_URL")]
    pub os_auth_url: Option<String>,
    #[arg(long, env = "OS_USERNAME")]
    pub os_username: Option<String>,
    #[arg(long, env = "OS_PASSWORD", hide_env_values = true)]
    pub os_password: Option<String>,
    #[arg(long, env = "OS_PROJECT_NAME")]
    pub os_project_name: Option<String>,
    #[arg(long, env = "OS_USER_DOMAIN_NAME", default_value = DEFAULT_DOMAIN)]
    pub os_user_domain_name: String,
    #[arg(long, env = "OS_PROJECT_DOMAIN_NAME", default_value = DEFAULT_DOMAIN)]
    pub os_project_domain_name: String,
    #[arg(long, env = "OS_REGION_NAME")]
    pub os_region_name: Option<String>,
    #[arg(long, env = "OS_INTERFACE", default_value = DEFAULT_INTERFACE)]
    pub os_interface: String,
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

    pub fn exec_settings(&self) -> ExecSettings {
        ExecSettings {
            lease_grace: self.lease_grace,
            verify_after: self.verify_after,
            ..ExecSettings::default()
        }
    }

    pub fn reconciler_settings(&self) -> ReconcilerSettings {
        ReconcilerSettings {
            interval: self.reconcile_interval,
            batch: self.reconcile_batch,
            lease: self.reconcile_lease,
            settle_window: self.settle_window,
            rate_limit: self.reconcile_rate_limit,
            parallelism: self.reconcile_parallelism,
            verify_window: self.verify_window,
            ..ReconcilerSettings::default()
        }
    }

    /// The Nova endpoint: `--nova-url`, else Keystone from the OS_* settings;
    /// Cinder's: `--cinder-url`, else the catalog's (Keystone mode only).
    pub fn nova_config(&self) -> anyhow::Result<NovaConfig> {
        if self.confirm_with == Some(ConfirmArg::Cinder)
            && self.nova_url.is_some()
            && self.cinder_url.is_none()
        {
            anyhow::bail!(
                "--confirm-with cinder in direct mode (--nova-url) needs --cinder-url: there is no catalog to find Cinder in"
            );
        }
        let endpoint = match &self.nova_url {
            Some(url) => NovaEndpoint::Direct(url.clone()),
            None => {
                let o = &self.openstack.resolved()?;
                let missing: Vec<&str> = [
                    ("OS_AUTH_URL", o.os_auth_url.is_none()),
                    ("OS_USERNAME", o.os_username.is_none()),
                    ("OS_PASSWORD", o.os_password.is_none()),
                    ("OS_PROJECT_NAME", o.os_project_name.is_none()),
                ]
                .into_iter()
                .filter(|(_, m)| *m)
                .map(|(n, _)| n)
                .collect();
                if !missing.is_empty() {
                    anyhow::bail!(
                        "no Nova endpoint: give --nova-url (direct mode) or the Keystone settings; missing: {}",
                        missing.join(", ")
                    );
                }
                NovaEndpoint::Keystone(KeystoneConfig {
                    auth_url: o.os_auth_url.clone().unwrap_or_default(),
                    username: o.os_username.clone().unwrap_or_default(),
                    password: Secret::new(o.os_password.clone().unwrap_or_default()),
                    project_name: o.os_project_name.clone().unwrap_or_default(),
                    user_domain_name: o.os_user_domain_name.clone(),
                    project_domain_name: o.os_project_domain_name.clone(),
                    region: o.os_region_name.clone(),
                    interface: o.os_interface.clone(),
                    renewal_timeout: o.keystone_timeout,
                    renew_before: KEYSTONE_RENEW_BEFORE,
                })
            }
        };
        Ok(NovaConfig {
            endpoint,
            microversion: self.nova_microversion.clone(),
            max_concurrent_per_host: self.nova_max_concurrency,
            connect_timeout: self.nova_connect_timeout,
            tls_handshake_timeout: self.nova_tls_handshake_timeout,
            cinder_url: self.cinder_url.clone(),
            cinder_microversion: self.cinder_microversion.clone(),
            confirm_with: self.confirm_with.map(ConfirmWith::from),
        })
    }
}

#[derive(Debug, Default, serde::Deserialize)]
struct CloudsFile {
    #[serde(default)]
    clouds: std::collections::BTreeMap<String, CloudEntry>,
}

#[derive(Debug, Default, serde::Deserialize)]
struct CloudEntry {
    #[serde(default)]
    auth: CloudAuth,
    region_name: Option<String>,
    interface: Option<String>,
}

#[derive(Debug, Default, serde::Deserialize)]
struct CloudAuth {
    auth_url: Option<String>,
    username: Option<String>,
    password: Option<String>,
    project_name: Option<String>,
    user_domain_name: Option<String>,
    project_domain_name: Option<String>,
}

/// Where openstacksdk looks for clouds.yaml, in order.
fn clouds_yaml_paths() -> Vec<std::path::PathBuf> {
    let mut v = Vec::new();
    if let Some(p) = std::env::var_os("OS_CLIENT_CONFIG_FILE") {
        v.push(std::path::PathBuf::from(p));
    }
    v.push("clouds.yaml".into());
    if let Some(home) = std::env::var_os("HOME") {
        v.push(std::path::PathBuf::from(home).join(".config/openstack/clouds.yaml"));
    }
    v.push("/etc/openstack/clouds.yaml".into());
    v
}

impl OpenStackArgs {
    /// Fills what the OS_* settings leave open from `OS_CLOUD`'s entry.
    pub fn resolved(&self) -> anyhow::Result<OpenStackArgs> {
        self.resolved_from(&clouds_yaml_paths())
    }

    /// As `resolved`, looking for clouds.yaml in `paths` (in order).
    pub fn resolved_from(&self, paths: &[std::path::PathBuf]) -> anyhow::Result<OpenStackArgs> {
        let mut o = self.clone();
        let Some(cloud) = &self.os_cloud else {
            return Ok(o);
        };
        let path = paths.iter().find(|p| p.exists()).ok_or_else(|| {
            anyhow::anyhow!("OS_CLOUD={cloud}, but no clouds.yaml was found (looked in {paths:?})")
        })?;
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
        let file: CloudsFile =
            serde_yaml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let entry = file.clouds.get(cloud).ok_or_else(|| {
            anyhow::anyhow!(
                "cloud {cloud:?} is not in {} (it has: {:?})",
                path.display(),
                file.clouds.keys().collect::<Vec<_>>()
            )
        })?;
        let a = &entry.auth;
        o.os_auth_url = o.os_auth_url.or_else(|| a.auth_url.clone());
        o.os_username = o.os_username.or_else(|| a.username.clone());
        o.os_password = o.os_password.or_else(|| a.password.clone());
        o.os_project_name = o.os_project_name.or_else(|| a.project_name.clone());
        o.os_region_name = o.os_region_name.or_else(|| entry.region_name.clone());
        // The two domains and the interface have defaults; the file only
        // replaces a default, never an explicit setting.
        if o.os_user_domain_name == DEFAULT_DOMAIN
            && let Some(d) = &a.user_domain_name
        {
            o.os_user_domain_name = d.clone();
        }
        if o.os_project_domain_name == DEFAULT_DOMAIN
            && let Some(d) = &a.project_domain_name
        {
            o.os_project_domain_name = d.clone();
        }
        if o.os_interface == DEFAULT_INTERFACE
            && let Some(i) = &entry.interface
        {
            o.os_interface = i.clone();
        }
        Ok(o)
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

    #[test]
    fn os_cloud_fills_what_the_os_variables_leave_open() {
        let dir = std::env::temp_dir().join(format!("vr-clouds-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("clouds.yaml");
        std::fs::write(
            &file,
            "clouds:\n  prod:\n    auth:\n      auth_url: https://keystone.example/v3\n      username: svc\n      password: from-file\n      project_name: storage\n      user_domain_name: Corp\n      project_domain_name: Corp\n    region_name: RegionTwo\n    interface: internal\n",
        )
        .unwrap();
        let args =
            ServeArgs::from_args(["--os-cloud", "prod", "--os-password", "from-flag"]).unwrap();
        let o = args
            .openstack
            .resolved_from(std::slice::from_ref(&file))
            .unwrap();
        assert_eq!(
            o.os_auth_url.as_deref(),
            Some("https://keystone.example/v3")
        );
        assert_eq!(o.os_username.as_deref(), Some("svc"));
        assert_eq!(
            o.os_password.as_deref(),
            Some("from-flag"),
            "an explicit setting wins over the file"
        );
        assert_eq!(
            (o.os_user_domain_name.as_str(), o.os_interface.as_str()),
            ("Corp", "internal")
        );
        assert_eq!(o.os_region_name.as_deref(), Some("RegionTwo"));
        let missing = ServeArgs::from_args(["--os-cloud", "staging"]).unwrap();
        let err = missing
            .openstack
            .resolved_from(std::slice::from_ref(&file))
            .unwrap_err()
            .to_string();
        assert!(err.contains("staging") && err.contains("prod"), "{err}");
    }
}
