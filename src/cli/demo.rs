//! `volume-reconciler demo`: the simulator, the service on the embedded
//! store, and a faulty workload through the real gRPC client — lost
//! responses, slow answers, conflicts, 5xx, and one restart of the service
//! in the middle. It ends with a table a person can read at a glance and
//! exits non-zero if any ledger row disagrees with what Nova really did.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Args;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::output::{Progress, align_right, bare_table, plain_table, quantile};
use crate::client::Client;
use crate::config::{ServeArgs, duration};
use crate::domain::{Action, Resolution, State};
use crate::metrics::Metrics;
use crate::sim::{self, Fault, FaultOp, FaultRule, SimConfig};
use crate::startup::Application;
use crate::store::Store;

/// How long the reconciler may take to decide what the calls left open.
const SETTLE_LIMIT: Duration = Duration::from_secs(120);
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
    /// The embedded ledger file (default: a new temporary file).
    #[arg(long)]
    pub database: Option<std::path::PathBuf>,
    /// Seed of the fault mix (the same seed, the same faults).
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Keep the service running afterwards, to look closer with `ops`.
    #[arg(long)]
    pub keep_running: bool,
}

struct Running {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
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
        "--replica-id",
        replica,
        "--settle-window",
        "1s",
        "--lease-grace",
        "1s",
        "--reconcile-interval",
        "200ms",
        "--verify-after",
        "2s",
        "--shutdown-delay",
        "0s",
        "--drain-timeout",
        "10s",
    ])
    .map_err(|e| anyhow::anyhow!("demo flags: {e}"))?;
    let app = Application::build(args).await?;
    let (store, metrics) = (app.store.clone(), app.metrics.clone());
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
    codes: Mutex<BTreeMap<String, usize>>,
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

/// The volumes to attach and detach, and the faults injected for them.
struct Plan {
    volumes: Vec<(Uuid, Uuid)>,
    injected: BTreeMap<&'static str, usize>,
}

/// Seeds the simulator's faults: the same seed, the same faults.
fn plan_faults(sim: &sim::Sim, args: &DemoArgs) -> Plan {
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let servers: Vec<Uuid> = (0..SERVERS).map(|_| Uuid::new_v4()).collect();
    let mut plan = Plan {
        volumes: Vec::new(),
        injected: BTreeMap::new(),
    };
    let late = u64::try_from(args.deadline.as_millis()).unwrap_or(u64::MAX) + 2000;
    for i in 0..args.volumes {
        let (s, v) = (servers[i % servers.len()], Uuid::new_v4());
        if let Some((name, f)) = attach_fault(rng.random(), late) {
            sim.add_fault(FaultRule::new(FaultOp::Attach, f).volume(v));
            *plan.injected.entry(name).or_default() += 1;
        }
        let roll: f64 = rng.random();
        let detach_fault = if roll < 0.08 {
            Some(("lost detach response", Fault::CloseAfterEffect))
        } else if roll < 0.12 {
            Some(("409 on detach", Fault::Conflict))
        } else {
            None
        };
        if let Some((name, f)) = detach_fault {
            sim.add_fault(FaultRule::new(FaultOp::Detach, f).volume(v));
            *plan.injected.entry(name).or_default() += 1;
        }
        plan.volumes.push((s, v));
    }
    plan
}

/// The attach fault for a roll in 0..1 (about half the attaches get one).
fn attach_fault(roll: f64, late_ms: u64) -> Option<(&'static str, Fault)> {
    Some(match roll {
        r if r < 0.12 => (
            "lost response (answer too late)",
            Fault::DelayAfterEffect { ms: late_ms },
        ),
        r if r < 0.20 => ("lost response (connection closed)", Fault::CloseAfterEffect),
        r if r < 0.30 => ("slow answer (1 s)", Fault::DelayAfterEffect { ms: 1000 }),
        r if r < 0.36 => ("409 conflict, then clears", Fault::Conflict),
        r if r < 0.42 => (
            "503 without effect",
            Fault::Status {
                code: 503,
                effect: false,
            },
        ),
        r if r < 0.46 => (
            "500 after taking effect",
            Fault::Status {
                code: 500,
                effect: true,
            },
        ),
        r if r < 0.49 => (
            "502 proxy page",
            Fault::ProxyError {
                code: 502,
                effect: false,
            },
        ),
        _ => return None,
    })
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
    let db_path = match &args.database {
        Some(p) => p.clone(),
        None => std::env::temp_dir().join(format!(
            "volume-reconciler-demo-{}.db",
            Uuid::new_v4().simple()
        )),
    };
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
    println!("volume-reconciler demo");
    println!(
        "  {} volumes × (attach, then detach) = {} operations, {} concurrent callers, {} deadlines",
        args.volumes,
        args.volumes * 2,
        args.concurrency,
        ms(args.deadline)
    );
    println!("  Nova simulator  {}", setup.sim.nova_url);
    println!(
        "  service         {}  (embedded ledger {})",
        setup.url,
        setup.db_path.display()
    );
    println!("  injected faults:");
    for (name, n) in &plan.injected {
        println!("    {n:>4}  {name}");
    }
    println!("  the service is restarted once, halfway through");
    println!();
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
        Ok(_) => "OK".to_string(),
        Err(e) => format!("{:?}", e.code),
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
) -> anyhow::Result<(Running, Vec<Arc<Metrics>>)> {
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
            progress
                .println("  restarting the service (graceful drain, same port, same ledger)...");
            current.stop().await?;
            current = start_service(setup, "demo-2").await?;
            metrics.push(current.metrics.clone());
            progress.println("  ...back");
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
            println!("  waiting for the reconciler: {open} operations not yet decided");
        }
    }
    println!(
        "  all {total} operations decided in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The ledger against what Nova really did.
#[derive(Default)]
struct Verdict {
    by_outcome: BTreeMap<(String, String), usize>,
    disagreements: Vec<String>,
    twice: usize,
    /// An attach whose response was lost and whose outcome an observation decided.
    story: Option<Uuid>,
}

async fn compare(store: &dyn Store, sim: &sim::Sim, plan: &Plan) -> anyhow::Result<Verdict> {
    let mut verdict = Verdict::default();
    for (s, v) in &plan.volumes {
        let att = store
            .operation_get_by_key(&format!("demo-attach-{v}"))
            .await?;
        let det = store
            .operation_get_by_key(&format!("demo-detach-{v}"))
            .await?;
        let effects = sim.attach_effects(*v);
        if effects > 1 {
            verdict.twice += 1;
        }
        let attached_now = sim.is_attached(*s, *v);
        let attach_ok = att.as_ref().is_some_and(|o| o.state == State::Succeeded);
        let detach_ok = det.as_ref().is_some_and(|o| o.state == State::Succeeded);
        if attach_ok != (effects >= 1) {
            verdict.disagreements.push(format!(
                "attach of {v}: ledger says {}, Nova attached it {effects} times",
                if attach_ok { "succeeded" } else { "failed" }
            ));
        }
        if attached_now != (attach_ok && !detach_ok) {
            verdict.disagreements.push(format!(
                "detach of {v}: ledger says {}, Nova still lists it: {attached_now}",
                if detach_ok { "succeeded" } else { "failed" }
            ));
        }
        for op in att.iter().chain(det.iter()) {
            let res = op.resolution.map(Resolution::as_str).unwrap_or("-");
            *verdict
                .by_outcome
                .entry((op.state.as_str().to_string(), res.to_string()))
                .or_default() += 1;
            if verdict.story.is_none()
                && op.action == Action::Attach
                && op.resolution == Some(Resolution::Reobserved)
                && op.attempts == 1
            {
                verdict.story = Some(op.id);
            }
        }
    }
    Ok(verdict)
}

fn print_report(verdict: &Verdict, metrics: &[Arc<Metrics>], tally: &Tally) {
    let lost: u64 = metrics.iter().map(|m| m.responses_lost.get()).sum();
    let recovered: u64 = metrics.iter().map(|m| m.responses_recovered.get()).sum();
    let mut lat = lock(&tally.latencies).clone();
    lat.sort();
    let pct = |p: f64| ms(quantile(&lat, p).unwrap_or_default());
    let codes = lock(&tally.codes).clone();
    let mut table = plain_table(["OUTCOME", "DECIDED BY", "OPERATIONS"]);
    for ((state, res), n) in &verdict.by_outcome {
        table.add_row([state.clone(), res.clone(), n.to_string()]);
    }
    align_right(&mut table, &[2]);
    println!();
    println!("{}", table.trim_fmt());
    println!();
    let mut facts = bare_table();
    facts.add_row([
        "responses lost (timeouts, resets, 5xx)".to_string(),
        lost.to_string(),
        String::new(),
    ]);
    facts.add_row([
        "...outcome then established by observation".to_string(),
        recovered.to_string(),
        "(the rest went to retries or the reconciler)".to_string(),
    ]);
    facts.add_row([
        "attaches that took effect twice".to_string(),
        verdict.twice.to_string(),
        "(must be 0)".to_string(),
    ]);
    facts.add_row([
        "ledger rows that disagree with Nova's truth".to_string(),
        verdict.disagreements.len().to_string(),
        "(must be 0)".to_string(),
    ]);
    align_right(&mut facts, &[1]);
    println!("{}", facts.trim_fmt());
    println!(
        "  caller latency   p50 {}   p90 {}   p99 {}   max {}",
        pct(0.5),
        pct(0.9),
        pct(0.99),
        pct(1.0)
    );
    let answered: Vec<String> = codes.iter().map(|(c, n)| format!("{c} {n}")).collect();
    println!("  calls answered   {}", answered.join(", "));
    for d in verdict.disagreements.iter().take(10) {
        println!("  DISAGREES: {d}");
    }
}

async fn print_story(store: &dyn Store, id: Uuid) -> anyhow::Result<()> {
    println!();
    println!("  the story of one lost response ({id}):");
    let mut table = plain_table(["AT", "EVENT", "DETAIL"]);
    for e in store.operation_events(id).await? {
        table.add_row([
            e.at.format("%H:%M:%S%.3f").to_string(),
            e.kind.clone(),
            e.detail.clone(),
        ]);
    }
    for line in table.lines() {
        println!("  {}", line.trim_end());
    }
    Ok(())
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    crate::nova::client::install_crypto_provider();
    let total = args.volumes * 2;
    let setup = setup(&args).await?;
    let plan = plan_faults(&setup.sim.sim, &args);
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
    let verdict = compare(store.as_ref(), &setup.sim.sim, &plan).await?;
    print_report(&verdict, &metrics, &tally);
    if let Some(id) = verdict.story {
        print_story(store.as_ref(), id).await?;
    }
    println!();
    epilogue(&args, &setup, verdict.story).await;
    running.stop().await?;
    setup.sim.stop().await;
    if verdict.twice > 0 || !verdict.disagreements.is_empty() {
        anyhow::bail!(
            "{} ledger rows disagree with the truth, {} volumes attached twice",
            verdict.disagreements.len(),
            verdict.twice
        );
    }
    Ok(())
}

/// How to look closer; with `--keep-running`, serves until Ctrl-C.
async fn epilogue(args: &DemoArgs, setup: &Setup, story: Option<Uuid>) {
    let url = &setup.url;
    if args.keep_running {
        println!("  the service keeps running at {url}; in another terminal:");
        println!("    volume-reconciler ops list --server {url}");
        println!("    volume-reconciler ops list --state failed --server {url}");
        if let Some(id) = story {
            println!("    volume-reconciler ops show {id} --server {url}");
        }
        println!("  Ctrl-C to stop.");
        crate::startup::shutdown_signal().await;
    } else {
        println!("  to look closer, run the demo with --keep-running and, in another terminal:");
        println!("    volume-reconciler ops list --server {url}");
        println!("    volume-reconciler ops show <operation id> --server {url}");
        println!("  the ledger stays in {}", setup.db_path.display());
    }
}
