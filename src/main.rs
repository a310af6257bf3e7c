//! Thin: parse the command line, set up logging, run one command.

use volume_reconciler::config::Command;

fn main() -> std::process::ExitCode {
    let (cli, from_file, matches) = volume_reconciler::cli::settings::parse();
    if let Command::Config(_) = &cli.command {
        print!(
            "{}",
            volume_reconciler::cli::settings::show(&matches, &from_file)
        );
        return std::process::ExitCode::SUCCESS;
    }
    volume_reconciler::telemetry::init(cli.log_format, &cli.log);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli.command)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "exiting");
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(command: Command) -> anyhow::Result<()> {
    use volume_reconciler::{nova, sim, startup, store};
    match command {
        Command::Serve(args) => {
            nova::client::install_crypto_provider();
            let app = startup::Application::build(*args).await?;
            tracing::info!(grpc = %app.grpc_addr(), admin = %app.admin_addr(), "listening");
            app.run_until(startup::shutdown_signal()).await
        }
        Command::Migrate(args) => {
            let store = store::open(&args.database_url, 1).await?;
            store.close().await;
            tracing::info!("migrations applied");
            Ok(())
        }
        Command::NovaSim(args) => {
            let cfg = sim::SimConfig {
                require_auth: args.require_auth,
                detach_delay_ms: args.detach_delay.as_millis() as u64,
                rollback_share: args.rollback_share,
                username: args.username,
                password: args.password,
                ..sim::SimConfig::default()
            };
            let handle = sim::start(args.listen, cfg).await?;
            tracing::info!(nova_url = %handle.nova_url, auth_url = %handle.auth_url, "nova-sim listening");
            println!(
                "nova-sim: Nova at {}  Keystone at {}  admin at {}/sim",
                handle.nova_url, handle.auth_url, handle.base_url
            );
            startup::shutdown_signal().await;
            handle.stop().await;
            Ok(())
        }
        Command::Ops(args) => volume_reconciler::cli::ops::run(args).await,
        Command::Demo(args) => volume_reconciler::cli::demo::run(args).await,
        Command::Bench(args) => volume_reconciler::cli::bench::run(args).await,
        Command::Config(_) => Ok(()),
        Command::Healthcheck(args) => {
            nova::client::install_crypto_provider();
            let resp = reqwest::Client::new()
                .get(&args.url)
                .timeout(std::time::Duration::from_secs(3))
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
    }
}
