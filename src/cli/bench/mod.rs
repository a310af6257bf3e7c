//! `volume-reconciler bench`: a load generator to point at any deployment.
//! Reports operations/s, latency percentiles and errors by status code, with
//! a progress line while it runs and a JSON summary (`--output json`). Keys
//! and volumes are unique per run, so runs never collide.
//!
//! `--direct-nova URL` sends the same attach requests straight to Nova (no
//! service): the baseline for the service's added latency.
//! `bench reconcile` measures the reconciler resolving N unknown operations;
//! `bench adapter` the Nova adapter's own cost per call.
//!
//! - [`load`]: the load generator;
//! - [`reconcile`]: the reconciler benchmark;
//! - [`adapter`]: the adapter benchmark.

mod adapter;
mod load;
mod reconcile;

use std::time::Duration;

use clap::{Args, Subcommand, ValueEnum};

use crate::domain::parse::duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Aligned lines, for people.
    Table,
    /// One JSON document, for scripts.
    Json,
    /// The JSON document as YAML.
    Yaml,
}

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub command: Option<BenchCommand>,
    #[command(flatten)]
    pub load: LoadArgs,
}

impl BenchArgs {
    /// The output format the run was asked for.
    pub fn output(&self) -> Output {
        match &self.command {
            Some(BenchCommand::Reconcile(r)) => r.output,
            Some(BenchCommand::Adapter(a)) => a.output,
            Some(BenchCommand::PgbenchScript) | None => self.load.output,
        }
    }
}

#[derive(Debug, Clone, Subcommand)]
pub enum BenchCommand {
    /// Time the reconciler resolving N unknown operations (half attached in Nova).
    Reconcile(ReconcileBenchArgs),
    /// The Nova adapter's own cost per call: adapter vs a bare HTTP call to
    /// the same simulator, alternating rounds.
    Adapter(AdapterBenchArgs),
    /// Print the service's per-operation ledger writes (its very statements)
    /// as a pgbench script: the database's ceiling for this write pattern.
    PgbenchScript,
}

#[derive(Debug, Clone, Args)]
pub struct AdapterBenchArgs {
    /// Calls per round and side.
    #[arg(long, default_value_t = 5000)]
    pub calls: usize,
    /// Rounds, alternating the adapter and the bare HTTP call.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// How to print the result: table, json or yaml.
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    pub output: Output,
}

#[derive(Debug, Clone, Args)]
pub struct LoadArgs {
    #[command(flatten)]
    pub client: crate::cli::client_args::ClientArgs,
    /// Send the attach requests straight to this Nova endpoint instead.
    #[arg(long)]
    pub direct_nova: Option<String>,
    /// Callers calling at once, each one call after the other (at least 1).
    #[arg(long, default_value_t = 16, value_parser = concurrency)]
    pub concurrency: usize,
    /// HTTP/2 connections to spread the callers over (default: one per 200 callers).
    #[arg(long)]
    pub connections: Option<usize>,
    /// How long the load runs; calls still in flight then are cut off
    /// (counted apart, not as errors).
    #[arg(long, value_parser = duration, default_value = "30s")]
    pub duration: Duration,
    /// Share of attaches and detaches, e.g. attach=3,detach=1.
    #[arg(long, default_value = "attach=1,detach=0")]
    pub mix: String,
    /// Each call's deadline.
    #[arg(long, value_parser = duration, default_value = "30s")]
    pub deadline: Duration,
    /// Volumes attached to each server before the next server is used (a
    /// Nova server holds a handful of volumes, not thousands: this keeps
    /// each server's attachment list, which re-observations read, realistic).
    #[arg(long, default_value_t = 8)]
    pub volumes_per_server: u32,
    /// Stop after this many calls (in addition to --duration).
    #[arg(long)]
    pub max_calls: Option<u64>,
    /// How to print the summary: table, json or yaml (errors too: with
    /// json, one JSON error object on stderr).
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    pub output: Output,
    /// Print no progress line.
    #[arg(long)]
    pub quiet: bool,
    /// Exit 1 when more than this share of the calls failed (0 to 1;
    /// default: only when none succeeded).
    #[arg(long, value_parser = share)]
    pub max_error_rate: Option<f64>,
}

/// Callers of `--concurrency`: at least one.
fn concurrency(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("at least 1 caller".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{s:?}: {e}")),
    }
}

/// A share between 0 and 1 (`--max-error-rate`).
fn share(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|e| format!("{s:?} is not a number: {e}"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is not between 0 and 1 (0.01 is 1 %)"))
    }
}

#[derive(Debug, Clone, Args)]
pub struct ReconcileBenchArgs {
    /// The ledger to fill with unknown operations: postgres://... or
    /// sqlite://FILE (a scratch one: the benchmark writes to it).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// The Nova simulator (its /sim admin API seeds the attachments).
    #[arg(long)]
    pub nova_url: String,
    /// Unknown operations to resolve.
    #[arg(long, default_value_t = 10_000)]
    pub count: usize,
    /// Operations the reconciler resolves at once.
    #[arg(long, default_value_t = 64)]
    pub parallelism: usize,
    /// How to print the result: table, json or yaml.
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    pub output: Output,
}

/// The share of attaches in a `--mix` like `attach=3,detach=1`.
fn parse_mix(mix: &str) -> anyhow::Result<f64> {
    let mut attach = 0.0;
    let mut detach = 0.0;
    for part in mix.split(',') {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("--mix: {part:?} is not name=weight"))?;
        let w: f64 = v
            .trim()
            .parse()
            .map_err(|e| anyhow::anyhow!("--mix: weight {v:?}: {e}"))?;
        match k.trim() {
            "attach" => attach = w,
            "detach" => detach = w,
            other => anyhow::bail!("--mix: unknown operation {other:?} (attach, detach)"),
        }
    }
    if attach + detach <= 0.0 {
        anyhow::bail!("--mix: the weights must add up to more than 0");
    }
    Ok(attach / (attach + detach))
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.command {
        Some(BenchCommand::Reconcile(r)) => reconcile::run(r).await,
        Some(BenchCommand::Adapter(a)) => adapter::run(a).await,
        Some(BenchCommand::PgbenchScript) => Ok(crate::cli::output::emit(
            &crate::store::pg::tooling::pgbench_script(),
        )?),
        None => load::run(args.load).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mix_is_the_share_of_attaches() {
        assert_eq!(parse_mix("attach=3,detach=1").unwrap(), 0.75);
        assert_eq!(parse_mix("attach=1").unwrap(), 1.0);
        for bad in ["attach", "swap=1", "attach=0,detach=0", "attach=x"] {
            assert!(parse_mix(bad).is_err(), "{bad}");
        }
    }
}
