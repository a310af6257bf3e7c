//! `volume-reconciler bench`: a load generator to point at any deployment.
//! Reports operations/s, latency percentiles and errors by status code, with
//! a progress line while it runs and a JSON summary (`--output json`). Keys
//! and volumes are unique per run, so runs never collide.
//!
//! `--direct-nova URL` sends the same attach requests straight to Nova (no
//! service): the baseline for the service's added latency.
//! `bench reconcile` measures the reconciler resolving N unknown operations.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::{Args, Subcommand, ValueEnum};
use tokio::time::Instant;
use tonic::transport::Endpoint;
use uuid::Uuid;

use crate::client::Client;

fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| e.to_string())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub command: Option<BenchCommand>,
    #[command(flatten)]
    pub load: LoadArgs,
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
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    #[arg(long, value_enum, default_value = "table")]
    pub output: Output,
}

#[derive(Debug, Clone, Args)]
pub struct LoadArgs {
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    pub server: String,
    /// Send the attach requests straight to this Nova endpoint instead.
    #[arg(long)]
    pub direct_nova: Option<String>,
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// HTTP/2 connections to spread the callers over (default: one per 200 callers).
    #[arg(long)]
    pub connections: Option<usize>,
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
    #[arg(long, value_enum, default_value = "table")]
    pub output: Output,
    /// Print no progress line.
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Debug, Clone, Args)]
pub struct ReconcileBenchArgs {
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// The Nova simulator (its /sim admin API seeds the attachments).
    #[arg(long)]
    pub nova_url: String,
    #[arg(long, default_value_t = 10_000)]
    pub count: usize,
    #[arg(long, default_value_t = 64)]
    pub parallelism: usize,
    #[arg(long, value_enum, default_value = "table")]
    pub output: Output,
}

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

#[derive(Default)]
struct Stats {
    latencies: Mutex<Vec<u32>>, // microseconds
    errors: Mutex<BTreeMap<String, u64>>,
    calls: AtomicU64,
    retries: Mutex<crate::client::RetryStats>,
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    f64::from(sorted[i.min(sorted.len() - 1)]) / 1000.0
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.command {
        Some(BenchCommand::Reconcile(r)) => reconcile_bench(r).await,
        Some(BenchCommand::Adapter(a)) => adapter_bench(a).await,
        Some(BenchCommand::PgbenchScript) => {
            print!("{}", crate::store::pgbench_script());
            Ok(())
        }
        None => load(args.load).await,
    }
}

async fn load(args: LoadArgs) -> anyhow::Result<()> {
    crate::nova::client::install_crypto_provider();
    let attach_share = parse_mix(&args.mix)?;
    let run_id = Uuid::new_v4().simple().to_string()[..8].to_string();
    let conns = args
        .connections
        .unwrap_or(args.concurrency.div_ceil(200))
        .max(1);
    let clients: Vec<Client> = (0..conns)
        .map(|_| -> anyhow::Result<Client> {
            let ep = Endpoint::from_shared(args.server.clone())?
                .tcp_nodelay(true)
                .connect_timeout(Duration::from_secs(3))
                .http2_keep_alive_interval(Duration::from_secs(30));
            Ok(Client::from_channel(ep.connect_lazy()))
        })
        .collect::<anyhow::Result<_>>()?;
    let http = reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(args.concurrency)
        .build()?;
    let stats = Arc::new(Stats::default());
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let end = started + args.duration;
    let mut tasks = Vec::new();
    for w in 0..args.concurrency {
        let client = clients[w % clients.len()].clone();
        let (stats, stop, run_id, http) =
            (stats.clone(), stop.clone(), run_id.clone(), http.clone());
        let per_server = args.volumes_per_server.max(1);
        let (direct, deadline, max_calls) =
            (args.direct_nova.clone(), args.deadline, args.max_calls);
        tasks.push(tokio::spawn(async move {
            let mut attached: Vec<(Uuid, Uuid)> = Vec::new();
            // This worker's current server and how many volumes it was given.
            let (mut server, mut on_server) = (Uuid::new_v4(), 0u32);
            let mut next_target = move || {
                if on_server == per_server {
                    (server, on_server) = (Uuid::new_v4(), 0);
                }
                on_server += 1;
                (server, Uuid::new_v4())
            };
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) && Instant::now() < end {
                if let Some(m) = max_calls
                    && stats.calls.fetch_add(1, Ordering::Relaxed) >= m
                {
                    break;
                }
                i += 1;
                let key = format!("bench-{run_id}-{w}-{i}");
                let detach = !attached.is_empty() && rand::random::<f64>() >= attach_share;
                let t = Instant::now();
                let result: Result<(), String> = if let Some(nova) = &direct {
                    let (s, v) = next_target();
                    let body = serde_json::json!({"volumeAttachment": {"volumeId": v.to_string()}});
                    match http
                        .post(format!("{nova}/servers/{s}/os-volume_attachments"))
                        .header("X-OpenStack-Nova-API-Version", "2.89")
                        .json(&body)
                        .send()
                        .await
                    {
                        Ok(r) if r.status().is_success() => {
                            r.bytes().await.map(drop).map_err(|e| e.to_string())
                        }
                        Ok(r) => Err(format!("HTTP {}", r.status().as_u16())),
                        Err(e) => Err(if e.is_connect() {
                            "CONNECT".into()
                        } else {
                            "TRANSPORT".into()
                        }),
                    }
                } else if detach {
                    let (s, v) = attached.pop().unwrap_or_default();
                    client
                        .detach(&key, &s.to_string(), &v.to_string(), deadline)
                        .await
                        .map(drop)
                        .map_err(|e| format!("{:?}", e.code))
                } else {
                    let (s, v) = next_target();
                    let r = client
                        .attach_counted(
                            &key,
                            &s.to_string(),
                            &v.to_string(),
                            deadline,
                            &stats.retries,
                        )
                        .await
                        .map(drop)
                        .map_err(|e| format!("{:?}", e.code));
                    if r.is_ok() {
                        attached.push((s, v));
                    }
                    r
                };
                let us = t.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
                stats
                    .latencies
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(us);
                if max_calls.is_none() {
                    stats.calls.fetch_add(1, Ordering::Relaxed);
                }
                if let Err(code) = result {
                    *stats
                        .errors
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .entry(code)
                        .or_default() += 1;
                }
            }
        }));
    }
    let progress = {
        let (stats, stop, quiet) = (stats.clone(), stop.clone(), args.quiet);
        tokio::spawn(async move {
            let mut last = 0usize;
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.tick().await;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let n = stats
                    .latencies
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .len();
                let errs: u64 = stats
                    .errors
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .values()
                    .sum();
                if !quiet {
                    eprint!(
                        "\r  {:>6.1}s  {:>9} calls  {:>8} /s now  {:>6} errors   ",
                        started.elapsed().as_secs_f64(),
                        n,
                        n - last,
                        errs
                    );
                    // Progress is cosmetic; a failed flush changes nothing.
                    drop(std::io::stderr().flush());
                }
                last = n;
            }
        })
    };
    for t in tasks {
        t.await?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    progress.await?;
    if !args.quiet {
        eprintln!();
    }
    let mut lat = stats
        .latencies
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    lat.sort_unstable();
    let errors = stats
        .errors
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let retries = stats
        .retries
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let ok = lat.len() as u64 - errors.values().sum::<u64>();
    let summary = serde_json::json!({
        "target": args.direct_nova.clone().map(|n| format!("direct:{n}")).unwrap_or(args.server.clone()),
        "concurrency": args.concurrency,
        "connections": conns,
        "mix": args.mix,
        "seconds": elapsed,
        "calls": lat.len(),
        "ok": ok,
        "ops_per_second": ok as f64 / elapsed,
        "latency_ms": {
            "p50": percentile(&lat, 0.50), "p90": percentile(&lat, 0.90),
            "p99": percentile(&lat, 0.99), "max": percentile(&lat, 1.0),
        },
        "errors": errors,
        "transport_retries": retries.by_code,
    });
    match args.output {
        Output::Json => println!("{summary}"),
        Output::Table => {
            println!("target        {}", summary["target"].as_str().unwrap_or(""));
            println!(
                "concurrency   {} over {} connection(s), mix {}",
                args.concurrency, conns, args.mix
            );
            println!(
                "calls         {} in {:.1} s: {:.0} ok/s",
                lat.len(),
                elapsed,
                ok as f64 / elapsed
            );
            println!(
                "latency       p50 {:.2} ms  p90 {:.2} ms  p99 {:.2} ms  max {:.2} ms",
                percentile(&lat, 0.5),
                percentile(&lat, 0.9),
                percentile(&lat, 0.99),
                percentile(&lat, 1.0)
            );
            println!(
                "errors        {}",
                if errors.is_empty() {
                    "none".to_string()
                } else {
                    format!("{errors:?}")
                }
            );
        }
    }
    Ok(())
}

async fn reconcile_bench(args: ReconcileBenchArgs) -> anyhow::Result<()> {
    use crate::domain::{Action, NewEvent, RequestParams, State, request_fingerprint};
    use crate::store::{CreateOutcome, NewOperation};
    crate::nova::client::install_crypto_provider();
    let store = crate::store::open(&args.database_url, 16).await?;
    let http = reqwest::Client::new();
    let base = args
        .nova_url
        .trim_end_matches('/')
        .trim_end_matches("/v2.1")
        .to_string();
    // Seed: N unknown operations over servers holding ten each (a realistic
    // disk count), half of them attached in Nova.
    let servers: Vec<Uuid> = (0..args.count.div_ceil(10))
        .map(|_| Uuid::new_v4())
        .collect();
    let mut seeded = Vec::new();
    let seed_started = Instant::now();
    for i in 0..args.count {
        let (server, v) = (servers[i / 10], Uuid::new_v4());
        if i % 2 == 0 {
            seeded.push(serde_json::json!({"server_id": server, "volume_id": v}));
        }
        let params = RequestParams::default();
        let new = NewOperation {
            id: Uuid::now_v7(),
            idempotency_key: format!("rb-{}", Uuid::new_v4().simple()),
            fingerprint: request_fingerprint(Action::Attach, server, v, &params),
            action: Action::Attach,
            server_id: server,
            volume_id: v,
            params,
            state: State::Unknown,
            attempts: 1,
            deadline_at: chrono::Utc::now() - chrono::Duration::seconds(1),
            lease_owner: "bench-crashed".into(),
            lease_expires_at: chrono::Utc::now() - chrono::Duration::seconds(1),
            caller: None,
            replica: "bench".into(),
            events: vec![NewEvent::new("recorded", "seeded by bench reconcile")],
        };
        match store
            .operation_create(new, Instant::now() + Duration::from_secs(60))
            .await?
        {
            CreateOutcome::Created(_) => {}
            CreateOutcome::Existing(_) => anyhow::bail!("seed key collided"),
        }
    }
    for chunk in seeded.chunks(1000) {
        let r = http
            .post(format!("{base}/sim/attachments"))
            .json(&chunk)
            .send()
            .await?;
        anyhow::ensure!(
            r.status().is_success(),
            "seeding the simulator: HTTP {}",
            r.status()
        );
    }
    let seed_secs = seed_started.elapsed().as_secs_f64();
    let nova = Arc::new(crate::nova::NovaClient::new(crate::nova::NovaConfig {
        endpoint: crate::nova::NovaEndpoint::Direct(args.nova_url.clone()),
        ..Default::default()
    }));
    let metrics = Arc::new(crate::metrics::Metrics::new());
    let exec = crate::executor::Executor::new(
        store.clone(),
        nova,
        crate::domain::BudgetPolicy::default(),
        "bench-reconciler".into(),
        crate::executor::ExecSettings::default(),
        metrics,
    );
    let rec = crate::reconciler::Reconciler::new(
        exec,
        crate::reconciler::ReconcilerSettings {
            settle_window: Duration::ZERO,
            rate_limit: 1_000_000.0,
            parallelism: args.parallelism,
            batch: 512,
            ..Default::default()
        },
    );
    let started = Instant::now();
    let mut decided = 0;
    loop {
        let c = rec.run_once().await?;
        decided += c.succeeded + c.failed;
        if c.claimed == 0 {
            break;
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let summary = serde_json::json!({
        "operations": args.count, "decided": decided, "seconds": secs,
        "per_second": decided as f64 / secs, "seed_seconds": seed_secs,
    });
    store.close().await;
    match args.output {
        Output::Json => println!("{summary}"),
        Output::Table => println!(
            "reconciled {decided} of {} unknown operations in {secs:.2} s ({:.0}/s)",
            args.count,
            decided as f64 / secs
        ),
    }
    anyhow::ensure!(
        decided == args.count,
        "only {decided} of {} decided",
        args.count
    );
    Ok(())
}

/// Median and p99 of one round, in microseconds.
fn med_p99(mut v: Vec<u32>) -> (f64, f64) {
    v.sort_unstable();
    let at = |p: f64| f64::from(v[((v.len() as f64 - 1.0) * p).round() as usize]);
    (at(0.5), at(0.99))
}

async fn adapter_bench(args: AdapterBenchArgs) -> anyhow::Result<()> {
    crate::nova::client::install_crypto_provider();
    let sim = crate::sim::start("127.0.0.1:0".parse()?, crate::sim::SimConfig::default()).await?;
    let server = Uuid::new_v4();
    for _ in 0..4 {
        sim.sim.seed_attachment(server, Uuid::new_v4());
    }
    let adapter = crate::nova::NovaClient::new(crate::nova::NovaConfig {
        endpoint: crate::nova::NovaEndpoint::Direct(sim.nova_url.clone()),
        ..Default::default()
    });
    // The bare call: the same GET with the same client settings, the body
    // read and parsed into the same types, without the adapter around it.
    let raw = crate::nova::build_http_client(adapter.config(), false);
    let url = format!("{}/servers/{server}/os-volume_attachments", sim.nova_url);
    let mut rounds = Vec::new();
    for round in 0..args.rounds {
        let mut a = Vec::with_capacity(args.calls);
        let mut b = Vec::with_capacity(args.calls);
        for _ in 0..args.calls {
            let t = Instant::now();
            let items = adapter
                .list(server, Instant::now() + Duration::from_secs(10))
                .await?;
            a.push(t.elapsed().as_micros() as u32);
            anyhow::ensure!(items.len() == 4);
            let t = Instant::now();
            let r = raw
                .get(&url)
                .header("X-OpenStack-Nova-API-Version", "2.89")
                .send()
                .await?
                .bytes()
                .await?;
            let parsed: crate::nova::types::AttachmentList = serde_json::from_slice(&r)?;
            b.push(t.elapsed().as_micros() as u32);
            anyhow::ensure!(parsed.volume_attachments.len() == 4);
        }
        let (am, ap) = med_p99(a);
        let (bm, bp) = med_p99(b);
        rounds.push(serde_json::json!({"round": round + 1, "adapter_p50_us": am, "adapter_p99_us": ap,
            "bare_p50_us": bm, "bare_p99_us": bp, "overhead_p50_us": am - bm, "overhead_p99_us": ap - bp}));
    }
    sim.stop().await;
    let field = |k: &str| -> Vec<f64> {
        rounds
            .iter()
            .map(|r| r[k].as_f64().unwrap_or(0.0))
            .collect()
    };
    let median = |mut v: Vec<f64>| -> (f64, f64, f64) {
        v.sort_by(|x, y| x.total_cmp(y));
        (v[v.len() / 2], v[0], v[v.len() - 1])
    };
    let summary = serde_json::json!({
        "calls_per_round": args.calls, "rounds": rounds,
        "overhead_p50_us": median(field("overhead_p50_us")).0,
        "overhead_p99_us": median(field("overhead_p99_us")).0,
    });
    match args.output {
        Output::Json => println!("{summary}"),
        Output::Table => {
            for k in [
                "adapter_p50_us",
                "bare_p50_us",
                "overhead_p50_us",
                "adapter_p99_us",
                "bare_p99_us",
                "overhead_p99_us",
            ] {
                let (m, lo, hi) = median(field(k));
                println!(
                    "{k:<18} median {m:>7.1} µs  (range {lo:.1}–{hi:.1} over {} rounds of {} calls)",
                    args.rounds, args.calls
                );
            }
        }
    }
    Ok(())
}
