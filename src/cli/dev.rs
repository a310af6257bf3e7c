//! `volume-reconciler dev`: the Nova simulator and the service on an
//! embedded ledger, on fixed ports it prints, with a server and two
//! volumes ready, until Ctrl-C: a first attach in one command, and a
//! server for client developers to call (like `temporal server start-dev`).
//!
//! The gRPC port is the one `ops` and the clients call by default
//! (127.0.0.1:50051), so the printed commands need no `--server`. The admin
//! port is not `serve`'s 9090, which is also Prometheus's own: a developer
//! scraping `dev` from a local Prometheus would find it taken. The simulator
//! listens where `nova-sim` does (8774, Nova's port).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Args;
use uuid::Uuid;

use super::demo::files;
use crate::config::{DEFAULT_LISTEN, ServeArgs};
use crate::say;
use crate::sim::{self, SimConfig};
use crate::startup::Application;

/// dev's admin listener (`/metrics`, `/healthz`, `/readyz`).
pub const DEV_ADMIN_LISTEN: &str = "127.0.0.1:9091";
/// dev's simulator, where `nova-sim` listens by default.
pub const DEV_SIM_LISTEN: &str = "127.0.0.1:8774";

/// The server the simulator lists from the start.
pub const DEV_SERVER: Uuid = Uuid::from_u128(0xa000_0000_0000_4000_8000_0000_0000_0001);
/// Two volumes to attach to it.
pub const DEV_VOLUMES: [Uuid; 2] = [
    Uuid::from_u128(0xb000_0000_0000_4000_8000_0000_0000_0001),
    Uuid::from_u128(0xb000_0000_0000_4000_8000_0000_0000_0002),
];

#[derive(Debug, Clone, Args)]
pub struct DevArgs {
    /// The service's gRPC listener (the address `ops` calls by default).
    #[arg(long, default_value = DEFAULT_LISTEN, value_name = "HOST:PORT")]
    pub listen: SocketAddr,
    /// The admin listener: /metrics, /healthz, /readyz.
    #[arg(long, default_value = DEV_ADMIN_LISTEN, value_name = "HOST:PORT")]
    pub admin_listen: SocketAddr,
    /// The Nova, Cinder and Keystone simulator (its faults and ground
    /// truth under /sim).
    #[arg(long, default_value = DEV_SIM_LISTEN, value_name = "HOST:PORT")]
    pub sim_listen: SocketAddr,
    /// The embedded ledger file, kept at exit (default: a new temporary
    /// file, removed at exit).
    #[arg(long, value_name = "FILE")]
    pub database: Option<PathBuf>,
}

/// Lets the held log lines out when dropped: after the banner, or when
/// `dev` ends before it (the error that ends it is a log line).
struct ReleaseLogs;

impl Drop for ReleaseLogs {
    fn drop(&mut self) {
        crate::telemetry::release_held();
    }
}

/// Serves until SIGTERM/SIGINT. Its log lines (held by `main`) follow the
/// banner.
pub async fn run(args: DevArgs) -> anyhow::Result<()> {
    let logs = ReleaseLogs;
    crate::tls::install_crypto_provider();
    let sim = sim::start(args.sim_listen, SimConfig::default())
        .await
        .map_err(|e| e.context("--sim-listen: another nova-sim or dev running?"))?;
    sim.sim.add_server(DEV_SERVER, "dev-server-1");
    let (ledger, own) = match &args.database {
        Some(path) => (path.clone(), false),
        None => (fresh_ledger(), true),
    };
    let serve = ServeArgs::from_args([
        "--listen",
        &args.listen.to_string(),
        "--admin-listen",
        &args.admin_listen.to_string(),
        "--database-url",
        &format!("sqlite://{}", ledger.display()),
        "--nova-url",
        &sim.nova_url,
        "--cinder-url",
        &sim.cinder_url,
        "--replica-id",
        "dev",
        "--shutdown-delay",
        "0s",
    ])
    .map_err(|e| anyhow::anyhow!("dev's serve flags: {e}"))?;
    let served = match Application::build(serve).await {
        Ok(app) => {
            // Listening before the banner says "Ctrl-C to stop".
            let stop = crate::startup::shutdown_signal();
            print_banner(&args, &sim, &ledger, own);
            drop(logs);
            app.run_until(stop).await
        }
        Err(e) => Err(e.context(
            "--listen or --admin-listen: another serve or dev running? (both take flags)",
        )),
    };
    sim.stop().await;
    if own {
        for failure in files::remove(&ledger) {
            say!("could not remove {failure}");
        }
    }
    served
}

/// A ledger of its own in the temp directory.
fn fresh_ledger() -> PathBuf {
    std::env::temp_dir().join(format!(
        "volume-reconciler-dev-{}.db",
        Uuid::new_v4().simple()
    ))
}

/// How to call this program again: its path when it was started by one
/// (`cargo run` starts target/release/volume-reconciler), else its name.
fn program() -> String {
    let invoked = std::env::args().next().unwrap_or_default();
    if invoked.contains('/')
        && let Ok(exe) = std::env::current_exe()
    {
        return exe.display().to_string();
    }
    "volume-reconciler".into()
}

fn print_banner(args: &DevArgs, sim: &sim::SimHandle, ledger: &std::path::Path, own: bool) {
    let grpc = args.listen.to_string();
    let server = if grpc == DEFAULT_LISTEN {
        String::new()
    } else {
        format!(" --server {grpc}")
    };
    let me = program();
    let (s, v) = (DEV_SERVER, DEV_VOLUMES);
    say!("volume-reconciler dev: the service on an embedded ledger, against the Nova simulator");
    say!("  gRPC     {grpc}  (ops and the clients' default)");
    say!(
        "  metrics  http://{}/metrics  (and /healthz, /readyz)",
        args.admin_listen
    );
    say!(
        "  Nova     {}  (simulator; faults and ground truth under {}/sim)",
        sim.nova_url,
        sim.base_url
    );
    say!(
        "  ledger   {}{}",
        ledger.display(),
        if own {
            "  (removed at exit; --database FILE keeps one)"
        } else {
            ""
        }
    );
    say!("  server   {s}  (dev-server-1)");
    say!("  volumes  {}  {}", v[0], v[1]);
    say!();
    say!("in another terminal:");
    say!(
        "  {me} ops attach --server-id {s} --volume-id {}{server}",
        v[0]
    );
    say!("  {me} ops list{server}");
    say!("  {me} ops show --idempotency-key KEY{server}  (the key ops attach printed)");
    say!(
        "  {me} ops detach --server-id {s} --volume-id {}{server}",
        v[0]
    );
    say!("Ctrl-C to stop.");
}
