//! `volume-reconciler demo`: the simulator, the service on the embedded
//! store, and a faulty workload through the real gRPC client — lost
//! responses, slow answers, conflicts, 5xx, and one restart of the service
//! in the middle. It ends with a table a person can read at a glance and
//! exits non-zero if any ledger row disagrees with what Nova really did.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Args;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::client::Client;
use crate::config::ServeArgs;
use crate::domain::{Action, Resolution, State};
use crate::metrics::Metrics;
use crate::sim::{self, Fault, FaultOp, FaultRule, SimConfig};
use crate::startup::Application;
use crate::store::Store;

#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Volumes to attach and then detach (two operations each).
    #[arg(long, default_value_t = 100)]
    pub volumes: usize,
    /// Concurrent callers.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Each call's deadline.
    #[arg(long, value_parser = |s: &str| humantime::parse_duration(s).map_err(|e| e.to_string()), default_value = "8s")]
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

async fn start_service(
    grpc: SocketAddr,
    admin: SocketAddr,
    db: &str,
    nova: &str,
    replica: &str,
) -> anyhow::Result<Running> {
    let args = ServeArgs::from_args([
        "--listen",
        &grpc.to_string(),
        "--admin-listen",
        &admin.to_string(),
        "--database-url",
        db,
        "--nova-url",
        nova,
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

#[derive(Default)]
struct Tally {
    done: AtomicUsize,
    latencies: Mutex<Vec<Duration>>,
    codes: Mutex<BTreeMap<String, usize>>,
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    if d >= Duration::from_secs(1) {
        format!("{:.2} s", d.as_secs_f64())
    } else {
        format!("{} ms", d.as_millis())
    }
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    crate::nova::client::install_crypto_provider();
    let total = args.volumes * 2;
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
    let db = format!("sqlite://{}", db_path.display());
    let (grpc, admin) = (free_addr()?, free_addr()?);
    let url = format!("http://{grpc}");

    // The fault mix, seeded.
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let servers: Vec<Uuid> = (0..10).map(|_| Uuid::new_v4()).collect();
    let mut plan = Vec::new();
    let mut injected: BTreeMap<&str, usize> = BTreeMap::new();
    let late = args.deadline.as_millis() as u64 + 2000;
    for i in 0..args.volumes {
        let (s, v) = (servers[i % servers.len()], Uuid::new_v4());
        let roll: f64 = rng.random();
        let attach_fault = match roll {
            r if r < 0.12 => Some((
                "lost response (answer too late)",
                Fault::DelayAfterEffect { ms: late },
            )),
            r if r < 0.20 => Some(("lost response (connection closed)", Fault::CloseAfterEffect)),
            r if r < 0.30 => Some(("slow answer (1 s)", Fault::DelayAfterEffect { ms: 1000 })),
            r if r < 0.36 => Some(("409 conflict, then clears", Fault::Conflict)),
            r if r < 0.42 => Some((
                "503 without effect",
                Fault::Status {
                    code: 503,
                    effect: false,
                },
            )),
            r if r < 0.46 => Some((
                "500 after taking effect",
                Fault::Status {
                    code: 500,
                    effect: true,
                },
            )),
            r if r < 0.49 => Some((
                "502 proxy page",
                Fault::ProxyError {
                    code: 502,
                    effect: false,
                },
            )),
            _ => None,
        };
        if let Some((name, f)) = attach_fault {
            sim.sim
                .add_fault(FaultRule::new(FaultOp::Attach, f).volume(v));
            *injected.entry(name).or_default() += 1;
        }
        let roll: f64 = rng.random();
        if roll < 0.08 {
            sim.sim
                .add_fault(FaultRule::new(FaultOp::Detach, Fault::CloseAfterEffect).volume(v));
            *injected.entry("lost detach response").or_default() += 1;
        } else if roll < 0.12 {
            sim.sim
                .add_fault(FaultRule::new(FaultOp::Detach, Fault::Conflict).volume(v));
            *injected.entry("409 on detach").or_default() += 1;
        }
        plan.push((s, v));
    }

    println!("volume-reconciler demo");
    println!(
        "  {} volumes × (attach, then detach) = {total} operations, {} concurrent callers, {} deadlines",
        args.volumes,
        args.concurrency,
        ms(args.deadline)
    );
    println!("  Nova simulator  {}", sim.nova_url);
    println!(
        "  service         {url}  (embedded ledger {})",
        db_path.display()
    );
    println!("  injected faults:");
    for (name, n) in &injected {
        println!("    {n:>4}  {name}");
    }
    println!("  the service is restarted once, halfway through");
    println!();

    let mut metrics = Vec::new();
    let first = start_service(grpc, admin, &db, &sim.nova_url, "demo-1").await?;
    metrics.push(first.metrics.clone());
    let client = Client::connect_lazy(&url)?;
    let tally = Arc::new(Tally::default());
    let queue = Arc::new(Mutex::new(plan.clone()));
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..args.concurrency.max(1) {
        let (client, tally, queue, deadline) =
            (client.clone(), tally.clone(), queue.clone(), args.deadline);
        workers.push(tokio::spawn(async move {
            loop {
                let next = queue.lock().unwrap_or_else(|p| p.into_inner()).pop();
                let Some((s, v)) = next else { return };
                for action in [Action::Attach, Action::Detach] {
                    let key = format!("demo-{}-{v}", action.as_str());
                    let t = Instant::now();
                    let r = match action {
                        Action::Attach => {
                            client
                                .attach(
                                    &key,
                                    &s.to_string(),
                                    &v.to_string(),
                                    Default::default(),
                                    deadline,
                                )
                                .await
                        }
                        Action::Detach => {
                            client
                                .detach(&key, &s.to_string(), &v.to_string(), deadline)
                                .await
                        }
                    };
                    let code = match r {
                        Ok(_) => "OK".to_string(),
                        Err(e) => format!("{:?}", e.code),
                    };
                    tally
                        .latencies
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(t.elapsed());
                    *tally
                        .codes
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .entry(code)
                        .or_default() += 1;
                    tally.done.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }

    // Progress, and the restart halfway.
    let mut current = Some(first);
    let mut restarted = false;
    loop {
        let done = tally.done.load(Ordering::SeqCst);
        let bar = (done * 30) / total.max(1);
        print!(
            "\r  [{}{}] {done:>4}/{total} calls answered  {:>5.1} s{}",
            "#".repeat(bar),
            ".".repeat(30 - bar),
            started.elapsed().as_secs_f64(),
            if restarted { "  (restarted)" } else { "" }
        );
        // A progress line that cannot be flushed is only cosmetic.
        drop(std::io::stdout().flush());
        if done >= total {
            break;
        }
        if !restarted && done >= total / 2 {
            restarted = true;
            print!("\n  restarting the service (graceful drain, same port, same ledger)...");
            drop(std::io::stdout().flush());
            if let Some(r) = current.take() {
                r.stop().await?;
            }
            let next = start_service(grpc, admin, &db, &sim.nova_url, "demo-2").await?;
            metrics.push(next.metrics.clone());
            current = Some(next);
            println!(" back");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!();
    for w in workers {
        w.await.map_err(|e| anyhow::anyhow!("worker: {e}"))?;
    }
    let running = current
        .take()
        .ok_or_else(|| anyhow::anyhow!("no service running"))?;
    let store = running.store.clone();

    // Whatever could not be known in time, the reconciler resolves.
    let settle_by = Instant::now() + Duration::from_secs(120);
    loop {
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
            anyhow::bail!("{open} operations still open after 120 s");
        }
        print!("\r  waiting for the reconciler: {open} operations not yet decided   ");
        drop(std::io::stdout().flush());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    println!(
        "\r  all {total} operations decided in {:.1} s                              ",
        started.elapsed().as_secs_f64()
    );

    // Compare the ledger with what Nova really did.
    let mut by_outcome: BTreeMap<(String, String), usize> = BTreeMap::new();
    let mut disagreements = Vec::new();
    let mut twice = 0;
    let mut story = None;
    for (s, v) in &plan {
        let att = store
            .operation_get_by_key(&format!("demo-attach-{v}"))
            .await?;
        let det = store
            .operation_get_by_key(&format!("demo-detach-{v}"))
            .await?;
        let effects = sim.sim.attach_effects(*v);
        if effects > 1 {
            twice += 1;
        }
        let attached_now = sim.sim.is_attached(*s, *v);
        let attach_ok = att.as_ref().is_some_and(|o| o.state == State::Succeeded);
        let detach_ok = det.as_ref().is_some_and(|o| o.state == State::Succeeded);
        if attach_ok != (effects >= 1) {
            disagreements.push(format!(
                "attach of {v}: ledger says {}, Nova attached it {effects} times",
                if attach_ok { "succeeded" } else { "failed" }
            ));
        }
        if attached_now != (attach_ok && !detach_ok) {
            disagreements.push(format!(
                "detach of {v}: ledger says {}, Nova still lists it: {attached_now}",
                if detach_ok { "succeeded" } else { "failed" }
            ));
        }
        for op in att.iter().chain(det.iter()) {
            let res = op
                .resolution
                .map(Resolution::as_str)
                .unwrap_or("-")
                .to_string();
            *by_outcome
                .entry((op.state.as_str().to_string(), res))
                .or_default() += 1;
            if story.is_none()
                && op.action == Action::Attach
                && op.resolution == Some(Resolution::Reobserved)
                && op.attempts == 1
            {
                story = Some(op.id);
            }
        }
    }
    let lost: u64 = metrics.iter().map(|m| m.responses_lost.get()).sum();
    let recovered: u64 = metrics.iter().map(|m| m.responses_recovered.get()).sum();
    let mut lat = tally
        .latencies
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    lat.sort();
    let codes = tally
        .codes
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();

    println!();
    println!(
        "  {:<11} {:<11} {:>10}",
        "OUTCOME", "DECIDED BY", "OPERATIONS"
    );
    for ((state, res), n) in &by_outcome {
        println!("  {state:<11} {res:<11} {n:>10}");
    }
    println!();
    println!("  responses lost (timeouts, resets, 5xx)       {lost:>5}");
    println!(
        "  ...outcome then established by observation    {recovered:>5}   (the rest went to retries or the reconciler)"
    );
    println!("  attaches that took effect twice               {twice:>5}   (must be 0)");
    println!(
        "  ledger rows that disagree with Nova's truth   {:>5}   (must be 0)",
        disagreements.len()
    );
    println!(
        "  caller latency   p50 {}   p90 {}   p99 {}   max {}",
        ms(pct(&lat, 0.5)),
        ms(pct(&lat, 0.9)),
        ms(pct(&lat, 0.99)),
        ms(pct(&lat, 1.0))
    );
    println!(
        "  calls answered   {}",
        codes
            .iter()
            .map(|(c, n)| format!("{c} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for d in disagreements.iter().take(10) {
        println!("  DISAGREES: {d}");
    }

    if let Some(id) = story {
        println!();
        println!("  the story of one lost response ({id}):");
        for e in store.operation_events(id).await? {
            println!(
                "    {}  {:<15} {}",
                e.at.format("%H:%M:%S%.3f"),
                e.kind,
                e.detail
            );
        }
    }
    println!();
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
        println!("  the ledger stays in {}", db_path.display());
    }
    running.stop().await?;
    sim.stop().await;
    if twice > 0 || !disagreements.is_empty() {
        anyhow::bail!(
            "{} ledger rows disagree with the truth, {twice} volumes attached twice",
            disagreements.len()
        );
    }
    Ok(())
}
