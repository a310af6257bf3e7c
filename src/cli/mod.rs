//! The command line: `Cli`, its subcommands' arguments and their
//! implementations. `main` parses (`parse`), sets up logging and hands the
//! result to `run`. `serve`'s own settings live in `config/`, which knows
//! nothing of this module; everything else about the command line is here.
//!
//! - [`settings`]: `--config FILE` layered under flags and environment, and
//!   `config show`.
//! - [`service`]: `serve`, `migrate`, `healthcheck`.
//! - [`nova_sim`]: the Nova/Keystone simulator as a process.
//! - [`ops`]: operator commands against a running server.
//! - [`dev`]: the simulator and the service on fixed ports, to try things.
//! - [`demo`], [`bench`]: a guided run, and the load generator.
//! - [`chaos`]: the history checker (random histories against the
//!   simulator's ground truth).
//! - [`client_args`]: the client options of the commands that call the
//!   service.
//! - [`output`]: tables and progress shared by the commands.
//! - [`format`]: `-o FORMAT`, YAML, and the exit statuses.
//! - [`docs`]: completion scripts and man pages.

pub mod bench;
pub mod chaos;
pub mod client_args;
pub mod demo;
pub mod dev;
pub mod docs;
pub mod format;
pub mod nova_sim;
pub mod ops;
pub mod output;
pub mod service;
pub mod settings;

use clap::{Parser, Subcommand};

use crate::config::ServeArgs;
use crate::telemetry::LogFormat;

/// `--version`: the crate's version and the commit it was built from
/// (`unknown` from a source tree without git, e.g. a tarball; see build.rs).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("VOLUME_RECONCILER_GIT_SHA"),
    ")"
);

#[derive(Debug, Parser)]
#[command(
    name = "volume-reconciler",
    version = VERSION,
    after_help = format::EXIT_HELP,
    about = "Attach and detach OpenStack volumes exactly once per idempotency key, and record the true outcome"
)]
pub struct Cli {
    /// How log lines are written on stderr: human (coloured only on a
    /// terminal), json (one object a line), or auto (human on a terminal,
    /// json otherwise).
    #[arg(
        long,
        global = true,
        env = "VOLUME_RECONCILER_LOG_FORMAT",
        value_enum,
        default_value = "auto",
        help_heading = "Logging"
    )]
    pub log_format: LogFormat,
    /// A tracing filter, e.g. `info` or `volume_reconciler=debug`.
    #[arg(
        long,
        global = true,
        env = "VOLUME_RECONCILER_LOG",
        default_value = "info",
        help_heading = "Logging"
    )]
    pub log: String,
    /// A TOML file of `serve` settings (keys are flag names), for `serve`
    /// and `config show` (which take it too); flags and environment
    /// variables override it.
    #[arg(long, env = settings::CONFIG_ENV, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

/// `--config FILE`, on the commands that read it (`serve`, `config show`).
#[derive(Debug, Clone, clap::Args)]
pub struct ConfigFileArg {
    /// A TOML file of `serve` settings (keys are flag names); flags and
    /// environment variables override it.
    #[arg(long, env = settings::CONFIG_ENV, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
}

/// `serve`: the settings, and the file they may come from.
#[derive(Debug, clap::Args)]
pub struct ServeCommand {
    #[command(flatten, next_help_heading = "Settings file")]
    pub file: ConfigFileArg,
    #[command(flatten)]
    pub args: ServeArgs,
}

/// `config show`: `serve`'s settings, the file, and the output format.
#[derive(Debug, clap::Args)]
pub struct ShowCommand {
    #[command(flatten)]
    pub file: ConfigFileArg,
    /// table (aligned columns), wide (the same), json, yaml or name (the
    /// settings' names).
    #[arg(
        short = 'o',
        long,
        value_enum,
        default_value = "table",
        help_heading = "Output"
    )]
    pub output: ops::Output,
    #[command(flatten)]
    pub args: ServeArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the gRPC service (applies pending migrations first).
    Serve(Box<ServeCommand>),
    /// Apply pending database migrations and exit.
    Migrate(service::MigrateArgs),
    /// Run the Nova and Keystone simulator.
    NovaSim(nova_sim::SimArgs),
    /// Operator commands against a running server: attach, detach, list,
    /// show, watch, reconcile, resolve, stats.
    Ops(ops::OpsArgs),
    /// The simulator and the service on an embedded ledger, on fixed
    /// printed ports, with a server and volumes to attach: to try it out
    /// and to develop clients against (until Ctrl-C).
    Dev(dev::DevArgs),
    /// Simulator + service + a faulty workload; ends with a truth table.
    Demo(demo::DemoArgs),
    /// Load generator (point it at any deployment) and reconciler benchmark.
    Bench(bench::BenchArgs),
    /// Random volume lifecycles against the simulator's ground truth: a
    /// history checker (exit 1 on any violation).
    Chaos(chaos::ChaosArgs),
    /// The effective configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Exit 0 when the admin endpoint answers ready (container health checks).
    Healthcheck(service::HealthcheckArgs),
    /// Print the shell completion script (e.g. `volume-reconciler
    /// completions bash > /etc/bash_completion.d/volume-reconciler`).
    Completions {
        /// The shell the script is for.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the top man page (roff), or, with `--dir DIR`, write one page
    /// per command there (`volume-reconciler-ops-list.1`, ...):
    /// `volume-reconciler man --dir /usr/local/share/man/man1`.
    Man {
        /// Write every page into this directory (created if missing).
        #[arg(long, value_name = "DIR", value_hint = clap::ValueHint::DirPath)]
        dir: Option<std::path::PathBuf>,
    },
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Print every `serve` setting with the value in force and where it
    /// came from (flag, env, file, default, or the setting it is derived
    /// from), secrets masked. Takes the same flags as `serve`.
    Show(Box<ShowCommand>),
}

/// A parsed command line: what to run, and where each setting came from
/// (for `config show`).
pub struct Invocation {
    pub cli: Cli,
    pub sources: settings::Sources,
}

/// How a failed command reports its error: once, on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorStyle {
    /// A service (`serve`, `nova-sim`, `migrate`): its stderr is its log,
    /// so the error is a log line (JSON or human, like the others).
    Log,
    /// `error: ...`, readable on a terminal.
    Text,
    /// `{"error": {...}}`, when the command was asked for `--output json`.
    Json,
}

impl ErrorStyle {
    pub fn of(command: &Command) -> Self {
        match command {
            Command::Serve(_) | Command::NovaSim(_) | Command::Migrate(_) => Self::Log,
            Command::Ops(a) if a.output == ops::Output::Json => Self::Json,
            Command::Dev(_) => Self::Log,
            Command::Bench(a) if a.output() == bench::Output::Json => Self::Json,
            Command::Config(ConfigCommand::Show(a)) if a.output == ops::Output::Json => Self::Json,
            _ => Self::Text,
        }
    }

    /// Reports `e`: the code, reason and metadata of a failed call are
    /// kept as fields in JSON.
    pub fn report(self, e: &anyhow::Error) {
        match self {
            Self::Log => tracing::error!(error = format!("{e:#}"), "exiting"),
            Self::Text => eprintln!("error: {e:#}"),
            Self::Json => {
                let body = match e.downcast_ref::<crate::client::CallError>() {
                    Some(call) => call.to_json(),
                    None => serde_json::json!({ "message": format!("{e:#}") }),
                };
                eprintln!("{}", serde_json::json!({ "error": body }));
            }
        }
    }
}

/// Parses the process's command line with the config file layered in.
/// Exits (like clap does) on `--help`, `--version` and usage errors.
pub fn parse() -> Invocation {
    let mut invocation = settings::parse(std::env::args_os().collect());
    if let Command::Demo(args) = &mut invocation.cli.command {
        args.prepare();
    }
    invocation
}

/// `dev`'s log filter unless `--log` (or its variable) says otherwise: its
/// console is a person's, and the service's startup lines would bury the
/// banner.
pub const DEV_LOG: &str = "warn";

impl Invocation {
    /// The log format and filter in force: as given (a flag or its
    /// variable), else the command's own defaults: `dev` writes human
    /// lines, warnings and errors only (its banner says the rest); every
    /// other command `--log-format auto --log info`.
    pub fn logging(&self) -> (LogFormat, String) {
        let dev = matches!(self.cli.command, Command::Dev(_));
        let format = if self.sources.given("log_format") || !dev {
            self.cli.log_format
        } else {
            LogFormat::Human
        };
        let filter = if self.sources.given("log") || !dev {
            self.cli.log.clone()
        } else {
            DEV_LOG.to_string()
        };
        (format, filter)
    }

    /// Whether log lines wait for `telemetry::release_held`: `dev`'s
    /// banner comes first.
    pub fn holds_logs(&self) -> bool {
        matches!(self.cli.command, Command::Dev(_))
    }

    /// Where logs go instead of stderr: the quiet demo's log file.
    pub fn log_file(&self) -> Option<std::path::PathBuf> {
        match &self.cli.command {
            Command::Demo(args) => args.log_file(),
            Command::Chaos(args) => args.log_file(),
            _ => None,
        }
    }
}

/// Runs one command to its end.
pub async fn run(invocation: Invocation) -> anyhow::Result<()> {
    let Invocation { cli, sources } = invocation;
    match cli.command {
        Command::Serve(cmd) => service::serve(cmd.args).await,
        Command::Migrate(args) => service::migrate(args).await,
        Command::Healthcheck(args) => service::healthcheck(args).await,
        Command::NovaSim(args) => nova_sim::run(args).await,
        Command::Ops(args) => ops::run(args).await,
        Command::Dev(args) => dev::run(args).await,
        Command::Demo(args) => demo::run(args).await,
        Command::Bench(args) => bench::run(args).await,
        Command::Chaos(args) => chaos::run(args).await,
        Command::Completions { shell } => docs::completions(shell),
        Command::Man { dir } => docs::man(dir.as_deref()),
        Command::Config(ConfigCommand::Show(cmd)) => {
            let report = settings::Report::of(&sources, &cmd.args);
            let text = match cmd.output.document(&report.json()) {
                Some(doc) => doc,
                None if cmd.output == ops::Output::Name => report.names(),
                None => report.text(),
            };
            Ok(output::emit(&text)?)
        }
    }
}
