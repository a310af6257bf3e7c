//! `serve`, `migrate` and `healthcheck`: the service and its two helpers
//! for deployments.

use std::time::Duration;

use clap::Args;

use crate::config::{
    DEFAULT_ADMIN_LISTEN, DEFAULT_DATABASE_URL, DEFAULT_LISTEN, LEDGER_CONTEXT, ServeArgs,
};
use crate::domain::parse::{duration, render_duration};
use crate::{startup, store, tls};

/// `migrate`: applies the pending migrations and says which (or that the
/// ledger is up to date); `migrate status`: what is applied, pending, and
/// unknown to this build, changing nothing.
#[derive(Debug, Clone, Args)]
pub struct MigrateArgs {
    /// The ledger: postgres://... or sqlite://FILE.
    #[arg(
        long,
        global = true,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = DEFAULT_DATABASE_URL
    )]
    pub database_url: String,
    /// How long to wait for PostgreSQL to accept connections (each try is
    /// logged); then exit with the last error.
    #[arg(long, global = true, env = "VOLUME_RECONCILER_DB_CONNECT_TIMEOUT", value_parser = duration, default_value = render_duration(store::DEFAULT_CONNECT_TIMEOUT))]
    pub db_connect_timeout: Duration,
    #[command(subcommand)]
    pub action: Option<MigrateAction>,
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum MigrateAction {
    /// Lists the ledger's migrations: applied, pending (this build would
    /// apply them), unknown (applied by a later release); changes nothing.
    Status,
}

/// Where `healthcheck` asks: by default the admin listener's `/readyz`, at
/// the address `serve` listens on in the same environment (so it works in
/// the image, where `VOLUME_RECONCILER_ADMIN_LISTEN=0.0.0.0:9090`); with
/// `--grpc`, `grpc.health.v1` on the gRPC listener.
#[derive(Debug, Clone, Args)]
pub struct HealthcheckArgs {
    /// The admin listener, as `serve --admin-listen` (an unspecified
    /// address such as 0.0.0.0 is asked on loopback).
    #[arg(long, env = "VOLUME_RECONCILER_ADMIN_LISTEN", default_value = DEFAULT_ADMIN_LISTEN, value_name = "HOST:PORT")]
    pub admin_listen: String,
    /// Ask this instead: http(s)://HOST:PORT/PATH, or HOST:PORT (its /readyz).
    #[arg(long, conflicts_with = "grpc")]
    pub url: Option<String>,
    /// Ask `grpc.health.v1.Health/Check` on the gRPC listener instead of
    /// the admin listener's /readyz.
    #[arg(long)]
    pub grpc: bool,
    /// The gRPC listener for --grpc, as `serve --listen` (HOST:PORT, or
    /// https://HOST:PORT when serve has TLS on).
    #[arg(long, env = "VOLUME_RECONCILER_LISTEN", default_value = DEFAULT_LISTEN, value_name = "HOST:PORT")]
    pub listen: String,
    /// How long the check may take.
    #[arg(long, value_parser = duration, default_value = "3s")]
    pub timeout: Duration,
}

/// A listen address as a place to connect to: 0.0.0.0 and [::] are this
/// host, asked on loopback.
fn connectable(listen: &str) -> String {
    let (scheme, rest) = match listen.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None => (String::new(), listen),
    };
    let rest = match rest.parse::<std::net::SocketAddr>() {
        Ok(a) if a.ip().is_unspecified() && a.is_ipv4() => format!("127.0.0.1:{}", a.port()),
        Ok(a) if a.ip().is_unspecified() => format!("[::1]:{}", a.port()),
        _ => rest.to_string(),
    };
    format!("{scheme}{rest}")
}

impl HealthcheckArgs {
    /// The URL of the HTTP check.
    fn http_url(&self) -> anyhow::Result<String> {
        let given = self.url.as_deref().map(str::trim);
        let target = given.unwrap_or(&self.admin_listen);
        let target = connectable(target);
        let url = if target.contains("://") {
            target
        } else {
            format!("http://{target}/readyz")
        };
        let parsed = reqwest::Url::parse(&url).map_err(|e| {
            anyhow::anyhow!(
                "{} {url:?} is not a URL ({e}): write http://HOST:PORT/PATH or HOST:PORT",
                if given.is_some() {
                    "--url"
                } else {
                    "--admin-listen"
                }
            )
        })?;
        anyhow::ensure!(
            matches!(parsed.scheme(), "http" | "https"),
            "--url {url:?}: http:// or https:// (or HOST:PORT)"
        );
        Ok(url)
    }
}

/// Runs the service until SIGTERM/SIGINT, then drains in stages.
pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    // The first line: which build this is, before anything can fail.
    tracing::info!(
        version = crate::metrics::VERSION,
        commit = crate::metrics::GIT_SHA,
        "starting volume-reconciler {}",
        crate::cli::VERSION
    );
    tls::install_crypto_provider();
    #[cfg(feature = "otlp")]
    if crate::telemetry::otlp::init()? {
        tracing::info!("exporting operation spans over OTLP (OTEL_EXPORTER_OTLP_ENDPOINT)");
    }
    let app = startup::Application::build(args).await?;
    tracing::info!(grpc = %app.grpc_addr(), admin = %app.admin_addr(), "listening");
    let served = app.run_until(startup::shutdown_signal()).await;
    #[cfg(feature = "otlp")]
    crate::telemetry::otlp::shutdown();
    served
}

/// Applies pending migrations (opening the store does), prints those it
/// applied or that the ledger is up to date, and warns of migrations the
/// ledger holds that this build does not know; `status` only reports
/// (the unknown ones among the rest, no warning).
pub async fn migrate(args: MigrateArgs) -> anyhow::Result<()> {
    let url = &args.database_url;
    let status = || async {
        store::migration_status(url, args.db_connect_timeout)
            .await
            .map_err(|e| e.context(LEDGER_CONTEXT))
    };
    let before = status().await?;
    if matches!(args.action, Some(MigrateAction::Status)) {
        // The report names the unknown ones itself: no warning beside it.
        print!("{}", render_status(&before));
        return Ok(());
    }
    warn_unknown(&before);
    let store = store::open_within(url, 1, args.db_connect_timeout)
        .await
        .map_err(|e| e.context(LEDGER_CONTEXT))?;
    store.close().await;
    let after = status().await?;
    let now: Vec<&(i64, String)> = after
        .applied
        .iter()
        .filter(|m| !before.applied.contains(m))
        .collect();
    for (version, description) in &now {
        println!("applied {version} {description}");
    }
    match (now.len(), after.applied.last()) {
        (0, Some((version, description))) => println!(
            "the ledger is up to date: nothing to apply ({} migrations applied, the last {version} {description})",
            after.applied.len()
        ),
        (0, None) => println!("the ledger is up to date: nothing to apply"),
        (n, _) => println!("{n} migration(s) applied; the ledger is up to date"),
    }
    Ok(())
}

/// Migrations the ledger holds that this build does not know: a later
/// release migrated it. This build runs against its expanded schema (each
/// migration is an expand step), but should not be the one left running.
/// One line, naming them once (in its `unknown` field).
fn warn_unknown(status: &store::MigrationStatus) {
    if status.unknown.is_empty() {
        return;
    }
    let names: Vec<String> = status
        .unknown
        .iter()
        .map(|(v, d)| format!("{v} {d}"))
        .collect();
    tracing::warn!(
        unknown = %names.join(", "),
        "the ledger holds {} migration(s) this build does not know (a later release applied them); this build runs against the expanded schema, but roll forward rather than back",
        names.len(),
    );
}

/// `migrate status`: one line per migration, then the counts.
fn render_status(status: &store::MigrationStatus) -> String {
    let mut out = String::new();
    for (what, list) in [
        ("applied", &status.applied),
        ("pending", &status.pending),
        ("unknown", &status.unknown),
    ] {
        for (version, description) in list {
            out.push_str(&format!("{what:<8} {version}  {description}\n"));
        }
    }
    out.push_str(&format!(
        "{} applied, {} pending, {} unknown to this build\n",
        status.applied.len(),
        status.pending.len(),
        status.unknown.len()
    ));
    out
}

/// Succeeds when the admin endpoint answers 2xx (or, `--grpc`, the gRPC
/// health service SERVING).
pub async fn healthcheck(args: HealthcheckArgs) -> anyhow::Result<()> {
    tls::install_crypto_provider();
    if args.grpc {
        let opts = crate::client::ConnectOptions::new(connectable(&args.listen));
        return crate::client::health(&opts, args.timeout).await;
    }
    let url = args.http_url()?;
    let resp = reqwest::Client::new()
        .get(&url)
        .timeout(args.timeout)
        .send()
        .await
        .map_err(|e| anyhow::anyhow!("GET {url}: {}", http_hint(&e)))?;
    anyhow::ensure!(
        resp.status().is_success(),
        "GET {url}: HTTP {}{}",
        resp.status(),
        if resp.status() == reqwest::StatusCode::SERVICE_UNAVAILABLE {
            " (not ready: the database is unreachable, or the replica is draining)"
        } else {
            ""
        }
    );
    Ok(())
}

/// A failed GET with its cause chain and, when it is recognisable, the fix.
fn http_hint(e: &reqwest::Error) -> String {
    let mut chain = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        chain.push_str(": ");
        chain.push_str(&s.to_string());
        source = s.source();
    }
    let lower = chain.to_ascii_lowercase();
    let hint = if lower.contains("connection refused") {
        "connection refused: nothing listens there; is serve running, and is this its --admin-listen (VOLUME_RECONCILER_ADMIN_LISTEN)?"
    } else if e.is_timeout() {
        "no answer in time: a wrong address, or a firewall"
    } else if lower.contains("dns error") || lower.contains("failed to lookup") {
        "cannot resolve the host name"
    } else if lower.contains("invalidcontenttype") || lower.contains("corrupt message") {
        "the admin listener does not speak TLS: use http://"
    } else if lower.contains("http2")
        || lower.contains("invalid http version")
        || lower.contains("frame")
        || lower.contains("unexpected message")
    {
        "this is not the admin listener but an HTTP/2 port (serve's gRPC port? ask it with --grpc --listen HOST:PORT)"
    } else {
        return chain;
    };
    format!("{hint} [{chain}]")
}
