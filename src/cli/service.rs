//! `serve`, `migrate` and `healthcheck`: the service and its two helpers
//! for deployments.

use std::time::Duration;

use clap::Args;

use crate::config::{
    DEFAULT_ADMIN_LISTEN, DEFAULT_DATABASE_URL, LEDGER_CONTEXT, ServeArgs, duration,
    render_duration,
};
use crate::{nova, startup, store};

#[derive(Debug, Clone, Args)]
pub struct MigrateArgs {
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = DEFAULT_DATABASE_URL
    )]
    pub database_url: String,
    /// How long to wait for PostgreSQL to accept connections (each try is
    /// logged); then exit with the last error.
    #[arg(long, env = "VOLUME_RECONCILER_DB_CONNECT_TIMEOUT", value_parser = duration, default_value = render_duration(store::DEFAULT_CONNECT_TIMEOUT))]
    pub db_connect_timeout: Duration,
}

#[derive(Debug, Clone, Args)]
pub struct HealthcheckArgs {
    #[arg(long, default_value = format!("http://{DEFAULT_ADMIN_LISTEN}/readyz"))]
    pub url: String,
}

/// Bound of the health check's one request (a container probe's own
/// timeout is usually a few seconds more).
const HEALTHCHECK_TIMEOUT: Duration = Duration::from_secs(3);

/// Runs the service until SIGTERM/SIGINT, then drains in stages.
pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    nova::client::install_crypto_provider();
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

/// Applies pending migrations (opening the store does) and exits.
pub async fn migrate(args: MigrateArgs) -> anyhow::Result<()> {
    let store = store::open_within(&args.database_url, 1, args.db_connect_timeout)
        .await
        .map_err(|e| e.context(LEDGER_CONTEXT))?;
    store.close().await;
    tracing::info!("migrations applied");
    Ok(())
}

/// Succeeds when the admin endpoint answers 2xx.
pub async fn healthcheck(args: HealthcheckArgs) -> anyhow::Result<()> {
    nova::client::install_crypto_provider();
    let resp = reqwest::Client::new()
        .get(&args.url)
        .timeout(HEALTHCHECK_TIMEOUT)
        .send()
        .await
        .map_err(|e| anyhow::anyhow!("GET {}: {e}", args.url))?;
    anyhow::ensure!(
        resp.status().is_success(),
        "GET {}: HTTP {}",
        args.url,
        resp.status()
    );
    Ok(())
}
