//! `volume-reconciler chaos`: a history checker in the spirit of Jepsen and
//! FoundationDB's simulation tests. It plays many random histories — a
//! small world of servers and volumes, orchestrators attaching and
//! detaching with fresh and replayed keys under random deadlines, every
//! fault the simulator knows, servers and volumes deleted, someone else's
//! hand, an operator, callers who give up at any instant, replicas killed
//! and restarted, a replica whose clock is off, and on PostgreSQL the
//! database's faults (silent, reset and refused connections of one replica
//! or all, the server crashed and restarted, its replies slow) — against real replicas and
//! the simulator, then checks each against the simulator's ground truth. A violation prints the seed, the smallest history that still
//! shows it, and the ledger rows involved; the exit code is then 1.
//!
//! - `history.rs`: histories drawn from a seed.
//! - `cluster.rs`: the replicas, each killable like a process.
//! - `postgres.rs`: a throwaway PostgreSQL of chaos's own (to crash).
//! - `dbfaults.rs`: each replica's fault proxy to it, and the faults.
//! - `play.rs`: playing one history and gathering what happened.
//! - `windows.rs`: the service's windows, and the bounds on a decision
//!   derived from them (read by `play` and `check`).
//! - `check.rs`: the invariants.
//! - `shrink.rs`: the smallest history that still fails.
//! - `report.rs`: what a run played, and each failure, as printed.

pub mod check;
pub mod cluster;
pub mod dbfaults;
pub mod history;
pub mod play;
pub mod postgres;
pub mod report;
pub mod shrink;
pub mod waits;
pub mod windows;

pub use report::{Failure, Summary};

use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Args;
use futures_util::StreamExt;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tokio::time::Instant;

use crate::domain::parse::{duration, signed_duration};
use crate::sim::{self, SimConfig};
use check::{Kill, Violation};
use cluster::{Cluster, ClusterConfig};
use history::{History, Shape};
use play::{Context, Played};
use report::record;
use windows::Windows;

#[derive(Debug, Clone, Args)]
pub struct ChaosArgs {
    /// How many histories to play.
    #[arg(long, default_value_t = 200)]
    pub histories: u64,
    /// The first history's seed (history i plays seed + i).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// A PostgreSQL database to use (it must be empty or this run's): its
    /// connections are faulted, the server is not crashed. Without it (and
    /// without --embedded) chaos starts a throwaway PostgreSQL of its own,
    /// which database faults may crash.
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        conflicts_with = "embedded"
    )]
    pub database_url: Option<String>,
    /// The embedded store in a temporary file instead (one replica, no
    /// database faults).
    #[arg(long)]
    pub embedded: bool,
    /// Where PostgreSQL's server binaries (initdb, postgres) are, for the
    /// throwaway cluster (default: PG_BIN, pg_config --bindir,
    /// /usr/lib/postgresql/*/bin, PATH).
    #[arg(long, value_name = "DIR")]
    pub postgres_bin: Option<std::path::PathBuf>,
    /// Replicas sharing the database (PostgreSQL only).
    #[arg(long, default_value_t = 2)]
    pub replicas: usize,
    /// The share of histories that meet database faults (PostgreSQL only;
    /// 0 turns them off): silent connections of one replica (open ones, or
    /// open and new), resets mid-batch, refused connections, and (on the
    /// throwaway cluster) PostgreSQL crashed and restarted.
    #[arg(long, default_value_t = 0.25, value_parser = share)]
    pub db_faults: f64,
    /// The share of histories that meet a replica frozen past its lease
    /// (its runtime stopped, then resumed, as SIGSTOP and SIGCONT) or its
    /// database replies held, then delivered (PostgreSQL, 2 replicas or
    /// more; 0 turns them off). A third of their calls get a 20 s deadline.
    #[arg(long, default_value_t = 0.25, value_parser = share)]
    pub pauses: f64,
    /// The share of histories that meet a slow database (PostgreSQL only;
    /// 0 turns it off): for 4 to 12 s, every reply of the database to one
    /// replica, or to every replica, comes 2 to 5 s after it was sent.
    /// Held to `unseen-never-unknown` as to every other invariant.
    #[arg(long, default_value_t = 0.0, value_parser = share)]
    pub db_slow: f64,
    /// How long a caller may still wait once its operation was decided
    /// (the invariant answer-follows-decision).
    #[arg(long, value_parser = duration, default_value = "6s")]
    pub answer_within: Duration,
    /// Histories played at once.
    #[arg(long, default_value_t = 24)]
    pub concurrency: usize,
    /// Kill a replica (kill -9) and restart it about this often (0: never).
    #[arg(long, value_parser = duration, default_value = "20s")]
    pub kill_every: Duration,
    /// The last replica's clock is off by this much (e.g. `-2m`).
    #[arg(long, value_parser = signed_duration, default_value = "-2m")]
    pub skew: chrono::Duration,
    /// The Nova microversion the replicas speak (2.101+: asynchronous attach).
    #[arg(long, default_value = "2.89")]
    pub nova_microversion: String,
    /// How long shrinking a failing history may take.
    #[arg(long, value_parser = duration, default_value = "5m")]
    pub shrink_for: Duration,
    /// Where the replicas' logs go (unless --verbose).
    #[arg(long, default_value = "volume-reconciler-chaos.log")]
    pub log_file: std::path::PathBuf,
    /// The replicas' logs on stderr instead of the log file.
    #[arg(long)]
    pub verbose: bool,
}

fn share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!(
            "{s:?}: a share from 0 to 1 (0.25: a quarter of the histories)"
        )),
    }
}

impl ChaosArgs {
    /// Where logs go instead of stderr (unless `--verbose`).
    pub fn log_file(&self) -> Option<std::path::PathBuf> {
        (!self.verbose).then(|| self.log_file.clone())
    }
}

/// Which ledger the replicas share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ledger {
    /// The embedded store in a temporary file (one replica).
    Embedded,
    /// A PostgreSQL database somebody else runs (its connections are
    /// faulted; the server is not crashed).
    Postgres(String),
    /// A throwaway PostgreSQL cluster of chaos's own (crashed too), from
    /// the binaries in the folder given or found.
    OwnPostgres(Option<std::path::PathBuf>),
}

impl Ledger {
    fn is_postgres(&self) -> bool {
        !matches!(self, Ledger::Embedded)
    }
}

/// A chaos run, as the command and the tests configure it.
#[derive(Debug, Clone)]
pub struct ChaosConfig {
    pub histories: u64,
    pub seed: u64,
    pub ledger: Ledger,
    pub replicas: usize,
    pub concurrency: usize,
    pub kill_every: Option<Duration>,
    pub skew: chrono::Duration,
    pub nova_microversion: String,
    pub shape: Shape,
    pub windows: Windows,
    /// Time for shrinking each failing history (zero: no shrinking).
    pub shrink_for: Duration,
    /// Draw progress (off in tests).
    pub progress: bool,
}

impl ChaosConfig {
    pub fn from_args(a: &ChaosArgs) -> Self {
        let ledger = match (&a.database_url, a.embedded) {
            (Some(url), _) => Ledger::Postgres(url.clone()),
            (None, true) => Ledger::Embedded,
            (None, false) => Ledger::OwnPostgres(a.postgres_bin.clone()),
        };
        Self {
            histories: a.histories,
            seed: a.seed,
            ledger,
            replicas: a.replicas,
            concurrency: a.concurrency,
            kill_every: (!a.kill_every.is_zero()).then_some(a.kill_every),
            skew: a.skew,
            nova_microversion: a.nova_microversion.clone(),
            shrink_for: a.shrink_for,
            progress: true,
            shape: Shape {
                db_faults: a.db_faults,
                pauses: a.pauses,
                db_slow: a.db_slow,
                ..Shape::default()
            },
            windows: Windows {
                answer_within: a.answer_within,
                ..Self::default().windows
            },
        }
    }

    /// The `serve` flags that compress the service's windows to the
    /// simulator's (late effects within `max_late_effect_ms`).
    fn serve_args(&self) -> Vec<String> {
        let w = &self.windows;
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        vec![
            "--settle-window".into(),
            ms(w.settle),
            "--verify-after".into(),
            ms(w.verify_after),
            "--verify-window".into(),
            ms(w.verify_window),
            "--reconcile-interval".into(),
            ms(w.reconcile_interval),
            "--reconcile-rate-limit".into(),
            "2000".into(),
            "--reconcile-max-backoff".into(),
            ms(w.reconcile_max_backoff),
            "--nova-microversion".into(),
            self.nova_microversion.clone(),
            "--lease".into(),
            ms(w.lease),
            "--db-statement-timeout".into(),
            ms(w.db_round_trip),
        ]
    }
}

impl Default for ChaosConfig {
    fn default() -> Self {
        Self {
            histories: 20,
            seed: 1,
            ledger: Ledger::Embedded,
            replicas: 1,
            concurrency: 10,
            kill_every: None,
            skew: chrono::Duration::zero(),
            nova_microversion: "2.89".into(),
            shape: Shape::default(),
            windows: Windows {
                settle: Duration::from_secs(2),
                verify_after: Duration::from_millis(500),
                verify_window: Duration::from_secs(3),
                slack: Duration::from_secs(5),
                lease: crate::executor::ExecSettings::DEFAULT.lease,
                db_round_trip: crate::store::DbBounds::DEFAULT.round_trip,
                answer_within: DEFAULT_ANSWER_WITHIN,
                reconcile_interval: Duration::from_millis(100),
                reconcile_max_backoff: Duration::from_secs(1),
            },
            shrink_for: Duration::ZERO,
            progress: false,
        }
    }
}

/// How long a caller may wait once its operation is decided: a few
/// seconds, and one heartbeat (the replica that lost the operation hears
/// so at its next renewal).
pub const DEFAULT_ANSWER_WITHIN: Duration = Duration::from_secs(6);

/// The running parts of a chaos run.
struct Rig {
    ctx: Arc<Context>,
    kills: Arc<Mutex<Vec<Kill>>>,
    sim: sim::SimHandle,
    /// The shape histories are drawn with here (database faults only
    /// where there is a database to fault, crashes only of our own).
    shape: Shape,
    /// Where the ledger is, for the report.
    ledger: String,
    _dir: Option<TempDir>,
    /// Held to the end (dropped last): the server stops once nothing uses
    /// it.
    _pg: Option<Arc<postgres::OwnPostgres>>,
}

/// A temporary folder removed on drop (the embedded ledger's).
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        // Best effort: a leftover folder in the temp dir harms nothing.
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            tracing::debug!(error = %e, path = %self.0.display(), "could not remove the chaos folder");
        }
    }
}

/// The ledger a chaos run writes to: its URL, how many replicas share it,
/// the folder of an embedded one (removed on drop), what the report calls
/// it, and the throwaway PostgreSQL the run started, if it did.
struct LedgerRig {
    url: String,
    replicas: usize,
    dir: Option<TempDir>,
    name: String,
    pg: Option<Arc<postgres::OwnPostgres>>,
}

async fn ledger_rig(cfg: &ChaosConfig) -> anyhow::Result<LedgerRig> {
    let mut pg = None;
    let (url, replicas, dir, name) = match &cfg.ledger {
        Ledger::Postgres(url) => (
            url.clone(),
            cfg.replicas.max(1),
            None,
            format!("PostgreSQL at {}", crate::store::mask_url(url)),
        ),
        Ledger::OwnPostgres(bin) => {
            let bin = bin.clone();
            let own =
                tokio::task::spawn_blocking(move || postgres::OwnPostgres::start(bin.as_deref()))
                    .await??;
            own.up(Duration::from_secs(60)).await?;
            let url = own.url().to_string();
            let ledger = format!("a throwaway PostgreSQL in {}", own.dir().display());
            pg = Some(Arc::new(own));
            (url, cfg.replicas.max(1), None, ledger)
        }
        Ledger::Embedded => {
            let dir =
                std::env::temp_dir().join(format!("vr-chaos-{}", uuid::Uuid::new_v4().simple()));
            std::fs::create_dir_all(&dir)?;
            let url = format!("sqlite://{}", dir.join("ledger.db").display());
            (url, 1, Some(TempDir(dir)), "the embedded store".to_string())
        }
    };
    Ok(LedgerRig {
        url,
        replicas,
        dir,
        name,
        pg,
    })
}

async fn rig(cfg: &ChaosConfig) -> anyhow::Result<Rig> {
    let sim = sim::start(
        "127.0.0.1:0".parse()?,
        SimConfig {
            record_history: true,
            detach_delay_ms: 150,
            attach_complete_ms: 80,
            rollback_share: 0.03,
            rollback_delay_ms: 300,
            ..SimConfig::default()
        },
    )
    .await?;
    let LedgerRig {
        url: database_url,
        replicas,
        dir,
        name: ledger,
        pg,
    } = ledger_rig(cfg).await?;
    let mut skews = vec![chrono::Duration::zero(); replicas];
    if replicas > 1
        && let Some(last) = skews.last_mut()
    {
        *last = cfg.skew;
    }
    // On PostgreSQL each replica goes through a fault proxy of its own.
    let (db, urls) = if cfg.ledger.is_postgres() {
        let names: Vec<String> = (0..replicas).map(cluster::replica_name).collect();
        let (db, urls) =
            dbfaults::DbFaults::start(&database_url, &names, pg.clone(), cfg.shape.db_slow_quiet)
                .await?;
        (Some(Arc::new(db)), urls)
    } else {
        (None, Vec::new())
    };
    let shape = Shape {
        db_faults: if db.is_some() {
            cfg.shape.db_faults
        } else {
            0.0
        },
        db_slow: if db.is_some() { cfg.shape.db_slow } else { 0.0 },
        db_crash: db.as_ref().is_some_and(|d| d.can_crash()),
        replicas,
        ..cfg.shape.clone()
    };
    let cluster = Arc::new(
        Cluster::start_each(
            ClusterConfig {
                database_url: database_url.clone(),
                nova_url: sim.nova_url.clone(),
                cinder_url: sim.cinder_url.clone(),
                replicas,
                clients: cfg.shape.clients,
                skews,
                extra_args: cfg.serve_args(),
            },
            urls,
        )
        .await?,
    );
    // The checker reads the ledger directly, past the proxies.
    let store = match cluster.store(0) {
        Some(s) if dir.is_some() => s,
        _ => crate::store::open(&database_url, 4).await?,
    };
    Ok(Rig {
        ctx: Arc::new(Context {
            cluster,
            sim: sim.sim.clone(),
            store,
            windows: cfg.windows,
            db,
        }),
        kills: Arc::new(Mutex::new(Vec::new())),
        sim,
        shape,
        ledger,
        _dir: dir,
        _pg: pg,
    })
}

/// Kills a random live replica every `every` (keeping one up) and restarts
/// it shortly after, until `stop`.
async fn killer(
    rig_ctx: Arc<Context>,
    kills: Arc<Mutex<Vec<Kill>>>,
    every: Duration,
    seed: u64,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6b69_6c6c);
    let cluster = &rig_ctx.cluster;
    loop {
        let pause = every.mul_f64(rng.random_range(0.5..1.5));
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        // A replica whose restart failed (it did not start in time) is
        // started again first.
        for down in (0..cluster.len()).filter(|i| !cluster.is_up(*i)) {
            if let Err(e) = cluster.restart(down).await {
                tracing::warn!(error = %e, "chaos: a replica that was down did not come back");
            }
        }
        let up: Vec<usize> = (0..cluster.len()).filter(|i| cluster.is_up(*i)).collect();
        if up.len() < 2 {
            continue;
        }
        let victim = up[rng.random_range(0..up.len())];
        cluster.kill(victim);
        kills.lock().unwrap_or_else(|p| p.into_inner()).push(Kill {
            replica: cluster.name(victim),
            at: chrono::Utc::now(),
        });
        tokio::time::sleep(Duration::from_millis(rng.random_range(300..2000))).await;
        if let Err(e) = cluster.restart(victim).await {
            tracing::warn!(error = %e, "chaos: a killed replica did not come back");
        }
    }
}

/// Plays and checks one history.
async fn trial(
    ctx: &Context,
    kills: &Mutex<Vec<Kill>>,
    h: History,
) -> anyhow::Result<(Played, Vec<Violation>)> {
    let played = ctx.play(h).await?;
    let kills = kills.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut violations = check::check(&played, ctx.windows, &kills, &played.outages);
    violations.extend(waits::check(
        &played,
        ctx.windows.answer_within,
        &played.outages,
        chrono::Utc::now(),
    ));
    Ok((played, violations))
}

/// Runs the configured histories; every failure is in the summary.
pub async fn run_chaos(cfg: &ChaosConfig) -> anyhow::Result<Summary> {
    let started = Instant::now();
    let rig = rig(cfg).await?;
    let stop = tokio_util::sync::CancellationToken::new();
    let killer_task = cfg
        .kill_every
        .filter(|_| rig.ctx.cluster.len() > 1)
        .map(|every| {
            tokio::spawn(killer(
                rig.ctx.clone(),
                rig.kills.clone(),
                every,
                cfg.seed,
                stop.clone(),
            ))
        });
    let mut progress = cfg
        .progress
        .then(|| crate::cli::output::Progress::new(cfg.histories, "histories"));
    let mut summary = Summary::default();
    let mut results = futures_util::stream::iter(0..cfg.histories)
        .map(|i| {
            let h = History::generate(cfg.seed + i, &rig.shape);
            let (ctx, kills) = (rig.ctx.clone(), rig.kills.clone());
            async move { trial(&ctx, &kills, h).await }
        })
        .buffer_unordered(cfg.concurrency.max(1));
    while let Some(result) = results.next().await {
        let (played, violations) = result?;
        record(&mut summary, progress.as_ref(), played, violations);
        if let Some(p) = &mut progress {
            p.set(summary.histories);
        }
    }
    drop(results);
    if let Some(p) = &progress {
        p.finish();
    }
    stop.cancel();
    if let Some(t) = killer_task
        && let Err(e) = t.await
    {
        tracing::warn!(error = %e, "chaos: the killer task failed");
    }
    shrink_failures(cfg, &rig, &mut summary.failures).await;
    summary.kills = rig.kills.lock().unwrap_or_else(|p| p.into_inner()).len() as u64;
    if let Some(db) = &rig.ctx.db {
        summary.db_faults = db.counts();
    }
    summary.ledger = rig.ledger.clone();
    rig.ctx.cluster.stop().await;
    rig.ctx.store.close().await;
    rig.sim.stop().await;
    summary.elapsed = started.elapsed();
    Ok(summary)
}

/// Shrinks each failing history (for at most `--shrink-for` each) to fewer
/// events that still break one of the same invariants.
async fn shrink_failures(cfg: &ChaosConfig, rig: &Rig, failures: &mut [Failure]) {
    if cfg.shrink_for.is_zero() {
        return;
    }
    for f in failures {
        let invariants: Vec<&'static str> = f.violations.iter().map(|v| v.invariant).collect();
        let (ctx, kills) = (rig.ctx.clone(), rig.kills.clone());
        let until = Instant::now() + cfg.shrink_for;
        f.history = shrink::shrink(f.history.clone(), until, |h| {
            let (ctx, kills, invariants) = (ctx.clone(), kills.clone(), invariants.clone());
            async move {
                match trial(&ctx, &kills, h).await {
                    Ok((_, v)) => v.iter().any(|v| invariants.contains(&v.invariant)),
                    // A candidate that could not be played does not show the
                    // failure: the shrinker keeps the larger history.
                    Err(e) => {
                        tracing::debug!(error = %e, "chaos: a shrink candidate could not be played");
                        false
                    }
                }
            }
        })
        .await;
    }
}

fn db_faults_line(share: f64, crashes: bool, slow: f64) -> String {
    let slow = match slow {
        s if s > 0.0 => format!(", a slow database in {:.0} %", s * 100.0),
        _ => String::new(),
    };
    if share <= 0.0 {
        return format!("database faults off{slow}");
    }
    format!(
        "database faults in {:.0} % of histories ({}){slow}",
        share * 100.0,
        if crashes {
            "connections and crashes"
        } else {
            "connections only: the server is not ours to crash"
        }
    )
}

/// `volume-reconciler chaos`.
pub async fn run(args: ChaosArgs) -> anyhow::Result<()> {
    let cfg = ChaosConfig::from_args(&args);
    let (replicas, on, faults) = match &cfg.ledger {
        Ledger::Embedded => (1, "the embedded store", "no database faults".to_string()),
        Ledger::Postgres(_) => (
            cfg.replicas,
            "PostgreSQL (--database-url)",
            db_faults_line(cfg.shape.db_faults, false, cfg.shape.db_slow),
        ),
        Ledger::OwnPostgres(_) => (
            cfg.replicas,
            "a throwaway PostgreSQL",
            db_faults_line(cfg.shape.db_faults, true, cfg.shape.db_slow),
        ),
    };
    crate::say!(
        "chaos: {} histories from seed {}, {replicas} replica(s) on {on}, {faults}, {} at once",
        cfg.histories,
        cfg.seed,
        cfg.concurrency
    );
    let summary = run_chaos(&cfg).await?;
    crate::say!("{}", summary.report().trim_end_matches('\n'));
    if let Some(log) = args.log_file() {
        crate::say!("  the replicas' logs: {}", log.display());
    }
    if summary.failures.is_empty() {
        Ok(())
    } else {
        anyhow::bail!(
            "{} of {} histories broke an invariant (seeds: {})",
            summary.failures.len(),
            summary.histories,
            summary
                .failures
                .iter()
                .map(|f| f.seed.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    }
}
