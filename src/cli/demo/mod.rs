//! `volume-reconciler demo`: the simulator, the service on the embedded
//! store, and a faulty workload through the real gRPC client — lost
//! responses, slow answers, conflicts, 5xx, and one restart of the service
//! in the middle. It ends with a table a person can read at a glance and
//! exits non-zero if any ledger row disagrees with what Nova really did.
//!
//! Quiet by default: the embedded service logs to a file beside the ledger
//! (`--verbose`: to stderr); progress is a bar on a terminal and a line per
//! 10 % elsewhere; the ledger and the log are removed at the end unless
//! `--keep` (or `--database` named the ledger).
//!
//! - [`faults`]: the workload and its injected faults;
//! - [`report`]: the verdict against Nova's truth;
//! - [`files`]: the ledger and log files.

mod faults;
pub(crate) mod files;
mod report;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Args;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::output::Progress;
use crate::client::Client;
use crate::config::ServeArgs;
use crate::domain::Action;
use crate::domain::parse::{duration, render_duration};
use crate::executor::metrics::ExecutorMetrics;
use crate::sim::{self, SimConfig};
use crate::startup::Application;
use crate::store::Store;
use faults::Plan;

/// How long the mid-run restart waits at most for calls in flight (the
/// embedded service's `--drain-timeout`; its `--shutdown-delay` is 0).
const RESTART_DRAIN: Duration = Duration::from_secs(10);

/// How long the reconciler may take to decide what the calls left open.
const SETTLE_LIMIT: Duration = Duration::from_secs(120);
/// How long the demo gives its verifier (`--verify-after 2s`) to report an
/// attachment removed behind the service's back.
const DRIFT_WITHIN: Duration = Duration::from_secs(30);
/// Nova servers the volumes are spread over.
const SERVERS: usize = 10;

#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Volumes to attach and then detach (two operations each).
    #[arg(long, default_value_t = 100)]
    pub volumes: usize,
    /// Concurrent callers.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Each call's deadline.
    #[arg(long, value_parser = duration, default_value = "8s")]
    pub deadline: Duration,
    /// The embedded ledger file (default: a new temporary file, removed at
    /// the end unless --keep).
    #[arg(long)]
    pub database: Option<std::path::PathBuf>,
    /// Seed of the fault mix (the same seed, the same faults).
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Keep the service running afterwards, to look closer with `ops`.
    #[arg(long)]
    pub keep_running: bool,
    /// Keep the ledger and the log at the end.
    #[arg(long)]
    pub keep: bool,
    /// The service's log on stderr instead of a file beside the ledger.
    #[arg(long)]
    pub verbose: bool,
    /// Whether the demo named the ledger itself (its files are its own).
    #[arg(skip)]
    pub own_ledger: bool,
}

impl DemoArgs {
    /// Names the ledger when --database did not, so that the log file is
    /// known before logging starts.
    pub fn prepare(&mut self) {
        if self.database.is_none() {
            self.database = Some(files::fresh_ledger());
            self.own_ledger = true;
        }
    }

    /// The log file, unless --verbose (logs then go to stderr).
    pub fn log_file(&self) -> Option<std::path::PathBuf> {
        let ledger = self.database.as_ref()?;
        (!self.verbose).then(|| files::log_beside(ledger))
    }
}

struct Running {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
    store: Arc<dyn Store>,
    metrics: Arc<ExecutorMetrics>,
}

fn free_addr() -> anyhow::Result<SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

/// The service on the demo's ledger, tuned to settle fast (short settle
/// window and lease grace, frequent reconciler rounds, no shutdown delay).
async fn start_service(setup: &Setup, replica: &str) -> anyhow::Result<Running> {
    let args = ServeArgs::from_args([
        "--listen",
        &setup.grpc.to_string(),
        "--admin-listen",
        &setup.admin.to_string(),
        "--database-url",
        &setup.db,
        "--nova-url",
        &setup.sim.nova_url,
        "--cinder-url",
        &setup.sim.cinder_url,
        "--replica-id",
        replica,
        "--settle-window",
        "1s",
        "--db-statement-timeout",
        "1s",
        "--lease",
        "3s",
        "--heartbeat",
        "250ms",
        "--reconcile-interval",
        "200ms",
        "--verify-after",
        "2s",
        "--shutdown-delay",
        "0s",
        "--drain-timeout",
        &render_duration(RESTART_DRAIN),
    ])
    .map_err(|e| anyhow::anyhow!("demo flags: {e}"))?;
    let app = Application::build(args).await?;
    let (store, metrics) = (app.store.clone(), app.exec.metrics().clone());
    let stop = CancellationToken::new();
    let s = stop.clone();
    let task = tokio::spawn(app.run_until(async move { s.cancelled().await }));
    Ok(Running {
        stop,
        task,
        store,
        metrics,
    })
}

impl Running {
    async fn stop(self) -> anyhow::Result<()> {
        self.stop.cancel();
        self.task
            .await
            .map_err(|e| anyhow::anyhow!("service task: {e}"))?
    }
}

/// What the callers saw.
#[derive(Default)]
struct Tally {
    done: AtomicUsize,
    latencies: Mutex<Vec<Duration>>,
    codes: Mutex<BTreeMap<&'static str, usize>>,
}

fn ms(d: Duration) -> String {
    if d >= Duration::from_secs(1) {
        format!("{:.2} s", d.as_secs_f64())
    } else {
        format!("{} ms", d.as_millis())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A worker that panicked mid-update leaves numbers still worth showing.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where the demo runs.
struct Setup {
    sim: sim::SimHandle,
    db_path: std::path::PathBuf,
    db: String,
    grpc: SocketAddr,
    admin: SocketAddr,
    url: String,
}

async fn setup(args: &DemoArgs) -> anyhow::Result<Setup> {
    let sim = sim::start(
        "127.0.0.1:0".parse()?,
        SimConfig {
            detach_delay_ms: 100,
            ..SimConfig::default()
        },
    )
    .await?;
    let db_path = args.database.clone().unwrap_or_else(files::fresh_ledger);
    let (grpc, admin) = (free_addr()?, free_addr()?);
    Ok(Setup {
        db: format!("sqlite://{}", db_path.display()),
        db_path,
        sim,
        grpc,
        admin,
        url: format!("http://{grpc}"),
    })
}

fn print_intro(args: &DemoArgs, setup: &Setup, plan: &Plan) {
    crate::say!("volume-reconciler demo");
    crate::say!(
        "  {} volumes × (attach, then detach) = {} operations, {} concurrent callers, {} deadlines",
        args.volumes,
        args.volumes * 2,
        args.concurrency,
        ms(args.deadline)
    );
    crate::say!("  Nova simulator  {}", setup.sim.nova_url);
    crate::say!(
        "  service         {}  (embedded ledger {})",
        setup.url,
        setup.db_path.display()
    );
    crate::say!("  injected faults:");
    for (name, n) in &plan.injected {
        crate::say!("    {n:>4}  {name}");
    }
    match args.log_file() {
        Some(log) => crate::say!("  service log     {}", log.display()),
        None => crate::say!("  service log     stderr (--verbose)"),
    }
    crate::say!(
        "  the service is restarted once, halfway through (a graceful drain of up to {})",
        render_duration(RESTART_DRAIN)
    );
    crate::say!();
}

/// The callers: each takes the next volume, attaches, then detaches it.
fn spawn_workers(
    args: &DemoArgs,
    client: &Client,
    plan: &Plan,
    tally: &Arc<Tally>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let queue = Arc::new(Mutex::new(plan.volumes.clone()));
    (0..args.concurrency.max(1))
        .map(|_| {
            let (client, tally, queue, deadline) =
                (client.clone(), tally.clone(), queue.clone(), args.deadline);
            tokio::spawn(async move {
                loop {
                    let next = lock(&queue).pop();
                    let Some((s, v)) = next else { return };
                    for action in [Action::Attach, Action::Detach] {
                        call(&client, action, s, v, deadline, &tally).await;
                    }
                }
            })
        })
        .collect()
}

async fn call(
    client: &Client,
    action: Action,
    s: Uuid,
    v: Uuid,
    deadline: Duration,
    tally: &Tally,
) {
    let key = format!("demo-{}-{v}", action.as_str());
    let (s, v) = (s.to_string(), v.to_string());
    let t = Instant::now();
    let r = match action {
        Action::Attach => {
            client
                .attach(&key, &s, &v, Default::default(), deadline)
                .await
        }
        Action::Detach => client.detach(&key, &s, &v, deadline).await,
    };
    let code = match r {
        Ok(_) => crate::client::code_name(tonic::Code::Ok),
        Err(e) => crate::client::code_name(e.code),
    };
    lock(&tally.latencies).push(t.elapsed());
    *lock(&tally.codes).entry(code).or_default() += 1;
    tally.done.fetch_add(1, Ordering::SeqCst);
}

/// Follows the calls to their end, restarting the service halfway; returns
/// the running service and every instance's metrics.
async fn drive(
    first: Running,
    setup: &Setup,
    tally: &Tally,
    total: usize,
) -> anyhow::Result<(Running, Vec<Arc<ExecutorMetrics>>)> {
    let mut metrics = vec![first.metrics.clone()];
    let mut current = first;
    let mut progress = Progress::new(total as u64, "calls answered");
    let mut restarted = false;
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tick.tick().await;
        let done = tally.done.load(Ordering::SeqCst);
        progress.set(done as u64);
        if done >= total {
            break;
        }
        if !restarted && done >= total / 2 {
            restarted = true;
            progress.println(format!(
                "  restarting the service: it waits up to {} for the calls in flight (graceful drain), then starts again on the same port and ledger...",
                render_duration(RESTART_DRAIN)
            ));
            let t = Instant::now();
            current.stop().await?;
            current = start_service(setup, "demo-2").await?;
            metrics.push(current.metrics.clone());
            progress.println(format!(
                "  ...back after {} (callers retried with the same keys meanwhile)",
                ms(t.elapsed())
            ));
        }
    }
    progress.finish();
    Ok((current, metrics))
}

/// Waits until the reconciler has decided every operation.
async fn settle(store: &dyn Store, started: Instant, total: usize) -> anyhow::Result<()> {
    let settle_by = Instant::now() + SETTLE_LIMIT;
    let mut said = false;
    let mut tick = tokio::time::interval(Duration::from_millis(300));
    loop {
        tick.tick().await;
        let counts = store.operation_count_by_state().await?;
        let open: i64 = counts
            .iter()
            .filter(|c| !matches!(c.state.as_str(), "succeeded" | "failed"))
            .map(|c| c.count)
            .sum();
        if open == 0 {
            break;
        }
        if Instant::now() > settle_by {
            anyhow::bail!("{open} operations still open after {}", ms(SETTLE_LIMIT));
        }
        if !said {
            said = true;
            crate::say!("  waiting for the reconciler: {open} operations not yet decided");
        }
    }
    crate::say!(
        "  all {total} operations decided in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

pub async fn run(mut args: DemoArgs) -> anyhow::Result<()> {
    crate::tls::install_crypto_provider();
    args.prepare();
    let total = args.volumes * 2;
    let setup = setup(&args).await?;
    let plan = faults::plan_faults(&setup.sim.sim, &args);
    print_intro(&args, &setup, &plan);
    let first = start_service(&setup, "demo-1").await?;
    let client = Client::connect_lazy(&setup.url)?;
    let tally = Arc::new(Tally::default());
    let started = Instant::now();
    let workers = spawn_workers(&args, &client, &plan, &tally);
    let (running, metrics) = drive(first, &setup, &tally, total).await?;
    for w in workers {
        w.await.map_err(|e| anyhow::anyhow!("worker: {e}"))?;
    }
    let store = running.store.clone();
    // Whatever could not be known in time, the reconciler resolves.
    settle(store.as_ref(), started, total).await?;
    let verdict = report::compare(store.as_ref(), &setup.sim.sim, &plan).await?;
    report::print_report(&verdict, &metrics, &tally);
    let server = plan
        .volumes
        .first()
        .map(|(s, _)| *s)
        .unwrap_or_else(Uuid::new_v4);
    report::real_drift(
        &client,
        store.as_ref(),
        &setup.sim.sim,
        server,
        DRIFT_WITHIN,
    )
    .await?;
    if let Some(id) = verdict.story {
        report::print_story(store.as_ref(), id).await?;
    }
    crate::say!();
    let passed = verdict.twice == 0
        && verdict.disagreements.is_empty()
        && verdict.drifted == 0
        && verdict.rolled_back_decided == verdict.rolled_back;
    look_closer(&args, &setup, verdict.story).await;
    running.stop().await?;
    setup.sim.stop().await;
    clean_up(&args, &setup.db_path, passed);
    anyhow::ensure!(
        passed,
        "{} ledger rows disagree with the truth, {} volumes attached twice, {} drift reports, {} of {} rollbacks decided at the call",
        verdict.disagreements.len(),
        verdict.twice,
        verdict.drifted,
        verdict.rolled_back_decided,
        verdict.rolled_back
    );
    Ok(())
}

/// How to look closer; with --keep-running, serves until Ctrl-C.
async fn look_closer(args: &DemoArgs, setup: &Setup, story: Option<Uuid>) {
    let url = &setup.url;
    if args.keep_running {
        // Listening before "Ctrl-C to stop." is said.
        let stop = crate::startup::shutdown_signal();
        crate::say!("  the service keeps running at {url}; in another terminal:");
        crate::say!("    (its metrics: http://{}/metrics)", setup.admin);
        crate::say!("    volume-reconciler ops list --server {url}");
        crate::say!("    volume-reconciler ops list --state failed --server {url}");
        if let Some(id) = story {
            crate::say!("    volume-reconciler ops show {id} --server {url}");
        }
        crate::say!("  Ctrl-C to stop.");
        stop.await;
    } else {
        crate::say!("  to look closer, run the demo with --keep-running and, in another terminal:");
        crate::say!("    volume-reconciler ops list --server {url}");
        crate::say!("    volume-reconciler ops show <operation id> --server {url}");
    }
}

/// Removes the demo's own files once the service is stopped, unless
/// --keep or the run failed (they are then kept to look into).
fn clean_up(args: &DemoArgs, ledger_path: &std::path::Path, passed: bool) {
    let ledger = ledger_path.display();
    let log = args
        .log_file()
        .map(|l| format!(" and the service log {}", l.display()))
        .unwrap_or_default();
    if args.own_ledger && !args.keep && passed {
        crate::say!("  removing the ledger {ledger}{log} (--keep keeps them)");
        for failure in files::remove(ledger_path) {
            crate::say!("  could not remove {failure}");
        }
    } else {
        crate::say!("  kept: the ledger {ledger}{log}");
    }
}
