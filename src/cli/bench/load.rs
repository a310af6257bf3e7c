//! The load generator: `--concurrency` workers calling attach (and detach,
//! per `--mix`) for `--duration`, over `--connections` HTTP/2 connections,
//! or the same attach straight to Nova (`--direct-nova`) as a baseline.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::time::Instant;
use uuid::Uuid;

use super::{LoadArgs, Output, parse_mix};
use crate::cli::output::{bare_table, quantile};
use crate::client::{Client, RetryStats, code_name};

/// What all workers record.
#[derive(Default)]
struct Stats {
    /// Per call, in microseconds.
    latencies: Mutex<Vec<u32>>,
    errors: Mutex<BTreeMap<String, u64>>,
    /// Calls started (for `--max-calls`).
    started: AtomicU64,
    /// Calls still in flight when `--duration` ended (not measured).
    cut_off: AtomicU64,
    retries: Mutex<RetryStats>,
    /// Why the run stopped early: the server refused the credentials.
    refused: Mutex<Option<crate::client::CallError>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A worker that panicked mid-update leaves numbers still worth reporting.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How one call failed.
enum Failure {
    /// The canonical code name (`UNAVAILABLE`), or the HTTP outcome of a
    /// direct Nova call.
    Code(String),
    /// UNAUTHENTICATED or PERMISSION_DENIED: no call of this run can pass.
    Refused(Box<crate::client::CallError>),
}

/// One worker's fixed part.
#[derive(Clone)]
struct Worker {
    client: Client,
    http: reqwest::Client,
    stats: Arc<Stats>,
    stop: Arc<AtomicBool>,
    run_id: String,
    direct_nova: Option<String>,
    deadline: Duration,
    max_calls: Option<u64>,
    attach_share: f64,
    volumes_per_server: u32,
    end: Instant,
}

impl Worker {
    async fn run(self, w: usize) {
        let mut attached: Vec<(Uuid, Uuid)> = Vec::new();
        // This worker's current server and how many volumes it was given.
        let (mut server, mut on_server) = (Uuid::new_v4(), 0u32);
        let mut i = 0u64;
        while !self.stop.load(Ordering::Relaxed) && Instant::now() < self.end {
            if self
                .max_calls
                .is_some_and(|m| self.stats.started.fetch_add(1, Ordering::Relaxed) >= m)
            {
                break;
            }
            i += 1;
            let detach = !attached.is_empty() && rand::random::<f64>() >= self.attach_share;
            let target = if detach {
                attached.pop().unwrap_or_default()
            } else {
                if on_server == self.volumes_per_server {
                    (server, on_server) = (Uuid::new_v4(), 0);
                }
                on_server += 1;
                (server, Uuid::new_v4())
            };
            let key = format!("bench-{}-{w}-{i}", self.run_id);
            let t = Instant::now();
            // The run ends at --duration, whatever the calls' deadlines:
            // one still in flight then is cut off, not waited for.
            let Ok(result) =
                tokio::time::timeout_at(self.end, self.call(&key, target, detach)).await
            else {
                self.stats.cut_off.fetch_add(1, Ordering::Relaxed);
                break;
            };
            let us = u32::try_from(t.elapsed().as_micros()).unwrap_or(u32::MAX);
            lock(&self.stats.latencies).push(us);
            match result {
                Ok(()) if !detach && self.direct_nova.is_none() => attached.push(target),
                Ok(()) => {}
                Err(Failure::Refused(e)) => {
                    // Every call would be refused alike: stop them all.
                    *lock(&self.stats.errors)
                        .entry(code_name(e.code).to_string())
                        .or_default() += 1;
                    lock(&self.stats.refused).get_or_insert(*e);
                    self.stop.store(true, Ordering::Relaxed);
                }
                Err(Failure::Code(code)) => *lock(&self.stats.errors).entry(code).or_default() += 1,
            }
        }
    }

    /// One call; the error is a status code name, or the refusal that
    /// stops the run.
    async fn call(&self, key: &str, (s, v): (Uuid, Uuid), detach: bool) -> Result<(), Failure> {
        if let Some(nova) = &self.direct_nova {
            return self.direct_attach(nova, s, v).await.map_err(Failure::Code);
        }
        let (s, v) = (s.to_string(), v.to_string());
        let r = if detach {
            self.client.detach(key, &s, &v, self.deadline).await
        } else {
            let retries = &self.stats.retries;
            let client = &self.client;
            client
                .attach_counted(key, &s, &v, self.deadline, retries)
                .await
        };
        r.map(drop).map_err(|e| match e.code {
            tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => {
                Failure::Refused(Box::new(e))
            }
            code => Failure::Code(code_name(code).to_string()),
        })
    }

    async fn direct_attach(&self, nova: &str, s: Uuid, v: Uuid) -> Result<(), String> {
        let body = serde_json::json!({"volumeAttachment": {"volumeId": v.to_string()}});
        match self
            .http
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
            Err(e) if e.is_connect() => Err("CONNECT".into()),
            Err(_) => Err("TRANSPORT".into()),
        }
    }
}

/// Runs the load and prints its summary.
pub async fn run(args: LoadArgs) -> anyhow::Result<()> {
    crate::tls::install_crypto_provider();
    let conns = args
        .connections
        .unwrap_or(args.concurrency.div_ceil(200))
        .max(1);
    // One lazy channel, so one HTTP/2 connection, per client.
    let opts = args.client.connect_options()?;
    let clients: Vec<Client> = (0..conns)
        .map(|_| Client::connect(&opts))
        .collect::<anyhow::Result<_>>()?;
    if args.direct_nova.is_none() {
        check_health(&opts, &args.client.server).await?;
    }
    let started = Instant::now();
    let worker = Worker {
        client: clients[0].clone(),
        http: reqwest::Client::builder()
            .tcp_nodelay(true)
            .pool_max_idle_per_host(args.concurrency)
            .build()?,
        stats: Arc::new(Stats::default()),
        stop: Arc::new(AtomicBool::new(false)),
        run_id: Uuid::new_v4().simple().to_string()[..8].to_string(),
        direct_nova: args.direct_nova.clone(),
        deadline: args.deadline,
        max_calls: args.max_calls,
        attach_share: parse_mix(&args.mix)?,
        volumes_per_server: args.volumes_per_server.max(1),
        end: started + args.duration,
    };
    let tasks: Vec<_> = (0..args.concurrency)
        .map(|w| {
            let mut worker = worker.clone();
            worker.client = clients[w % clients.len()].clone();
            tokio::spawn(worker.run(w))
        })
        .collect();
    let progress = tokio::spawn(progress(worker.clone(), args.duration, args.quiet));
    for t in tasks {
        t.await?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    worker.stop.store(true, Ordering::Relaxed);
    progress.await?;
    report(&args, conns, elapsed, &worker.stats)?;
    verdict(&args, elapsed, &worker.stats)
}

/// How long the health check before the load may take.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(5);

/// The server answers `grpc.health.v1` SERVING before any load is sent:
/// an unreachable server, a TLS mismatch or a wrong port is one clear
/// error, not thousands of failed calls. The failed call stays in the
/// error's chain: its code is the exit status (a server out of reach is
/// worth a retry, 75).
async fn check_health(opts: &crate::client::ConnectOptions, server: &str) -> anyhow::Result<()> {
    crate::client::health(opts, HEALTH_TIMEOUT)
        .await
        .map_err(|e| {
            e.context("bench: the server's health check failed, no load sent")
                .context(format!("--server {server}"))
        })
}

/// The exit status: 1 when the server refused the credentials, when no
/// call succeeded in the `elapsed` seconds the run took, or when errors
/// passed `--max-error-rate`.
fn verdict(args: &LoadArgs, elapsed: f64, stats: &Stats) -> anyhow::Result<()> {
    if let Some(e) = lock(&stats.refused).take() {
        anyhow::bail!(
            "bench stopped at the first refusal, every call would get it: {}",
            crate::client::explain_refusal(e)
        );
    }
    let calls = lock(&stats.latencies).len() as u64;
    let errors: u64 = lock(&stats.errors).values().sum();
    if calls == errors {
        anyhow::bail!(
            "bench: no call succeeded in {elapsed:.1} s ({}; {calls} answered, all errors; {} still in flight at the end)",
            what_ended(args, stats),
            stats.cut_off.load(Ordering::Relaxed)
        );
    }
    if let Some(max) = args.max_error_rate {
        let rate = errors as f64 / calls as f64;
        anyhow::ensure!(
            rate <= max,
            "bench: {:.2} % of the calls failed, more than --max-error-rate {max} ({:.2} %)",
            rate * 100.0,
            max * 100.0
        );
    }
    Ok(())
}

/// What ended the run: `--max-calls` when it was reached, else
/// `--duration`.
fn what_ended(args: &LoadArgs, stats: &Stats) -> String {
    let duration = crate::domain::parse::render_duration(args.duration);
    match args.max_calls {
        Some(max) if stats.started.load(Ordering::Relaxed) >= max => {
            format!("it stopped at --max-calls {max}, before --duration {duration}")
        }
        _ => format!("--duration {duration}"),
    }
}

/// A bar over `--duration` on stderr, with calls, rate and errors (hidden
/// off a terminal and with `--quiet`), until the workers stop.
async fn progress(w: Worker, duration: Duration, quiet: bool) {
    let bar = ProgressBar::with_draw_target(
        Some(duration.as_secs().max(1)),
        if quiet {
            ProgressDrawTarget::hidden()
        } else {
            ProgressDrawTarget::stderr()
        },
    );
    bar.set_style(
        ProgressStyle::with_template("  [{bar:30}] {elapsed:>4}/{duration}  {msg}")
            .expect("the template is valid")
            .progress_chars("#>."),
    );
    let mut last = 0usize;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.tick().await;
    while !w.stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let n = lock(&w.stats.latencies).len();
        let errors: u64 = lock(&w.stats.errors).values().sum();
        bar.inc(1);
        bar.set_message(format!("{n} calls  {}/s now  {errors} errors", n - last));
        last = n;
    }
    bar.finish_and_clear();
}

fn report(args: &LoadArgs, conns: usize, elapsed: f64, stats: &Stats) -> anyhow::Result<()> {
    let mut lat = lock(&stats.latencies).clone();
    lat.sort_unstable();
    let errors = lock(&stats.errors).clone();
    let retries = lock(&stats.retries).clone();
    let ok = lat.len() as u64 - errors.values().sum::<u64>();
    let ms = |p: f64| quantile(&lat, p).map_or(0.0, |us| f64::from(us) / 1000.0);
    let target = match &args.direct_nova {
        Some(n) => format!("direct:{n}"),
        None => args.client.server.clone(),
    };
    if args.output != Output::Table {
        let summary = serde_json::json!({
            "target": target,
            "concurrency": args.concurrency,
            "connections": conns,
            "mix": args.mix,
            "seconds": elapsed,
            "calls": lat.len(),
            "ok": ok,
            "ops_per_second": ok as f64 / elapsed,
            "latency_ms": {"p50": ms(0.5), "p90": ms(0.9), "p99": ms(0.99), "max": ms(1.0)},
            "errors": errors,
            "cut_off": stats.cut_off.load(Ordering::Relaxed),
            "transport_retries": retries.by_code,
        });
        match args.output {
            Output::Yaml => crate::say!("{}", crate::cli::format::yaml(&summary).trim_end()),
            _ => crate::say!("{summary}"),
        }
        return Ok(());
    }
    let mut t = bare_table();
    t.add_row(["target".to_string(), target]);
    t.add_row([
        "concurrency".to_string(),
        format!(
            "{} over {conns} connection(s), mix {}",
            args.concurrency, args.mix
        ),
    ]);
    t.add_row([
        "calls".to_string(),
        format!(
            "{} in {elapsed:.1} s: {:.0} ok/s",
            lat.len(),
            ok as f64 / elapsed
        ),
    ]);
    t.add_row([
        "latency".to_string(),
        format!(
            "p50 {:.2} ms  p90 {:.2} ms  p99 {:.2} ms  max {:.2} ms",
            ms(0.5),
            ms(0.9),
            ms(0.99),
            ms(1.0)
        ),
    ]);
    let errors = if errors.is_empty() {
        "none".to_string()
    } else {
        errors
            .iter()
            .map(|(code, n)| format!("{code} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    t.add_row(["errors".to_string(), errors]);
    let cut = stats.cut_off.load(Ordering::Relaxed);
    if cut > 0 {
        t.add_row([
            "cut off".to_string(),
            format!("{cut} call(s) still in flight at the end of --duration (not counted)"),
        ]);
    }
    crate::say!("{}", t.trim_fmt());
    Ok(())
}
