//! The real binary as separate processes: SIGKILL in the middle of work,
//! rolling restarts under load with zero client-visible errors, and the
//! operator CLI telling an operation's story.

use crate::support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::{AppOptions, spawn_app, with_timeout};
use tonic::transport::{Channel, Endpoint};
use uuid::Uuid;
use volume_reconciler::client::{Client, RetryStats};
use volume_reconciler::domain::State;
use volume_reconciler::grpc::pb;
use volume_reconciler::sim::{self, Fault, FaultOp, FaultRule, SimConfig, SimHandle};
use volume_reconciler::store::{PgSettings, PgStore, Store};

const BIN: &str = env!("CARGO_BIN_EXE_volume-reconciler");

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

struct Replica {
    name: String,
    grpc: SocketAddr,
    admin: SocketAddr,
    args: Vec<String>,
    child: Option<Child>,
}

impl Replica {
    fn new(name: &str, db: &str, nova: &str, extra: &[&str]) -> Self {
        let (grpc, admin) = (free_addr(), free_addr());
        let mut args: Vec<String> = vec![
            "serve".into(),
            "--listen".into(),
            grpc.to_string(),
            "--admin-listen".into(),
            admin.to_string(),
            "--database-url".into(),
            db.into(),
            "--nova-url".into(),
            nova.into(),
            "--replica-id".into(),
            name.into(),
            "--db-max-connections".into(),
            "8".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        Self {
            name: name.into(),
            grpc,
            admin,
            args,
            child: None,
        }
    }

    /// Where the process's log goes (appended, one file per name and test run).
    fn log_path(&self) -> std::path::PathBuf {
        std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "vr-{}-{}.log",
            self.name,
            std::process::id()
        ))
    }

    async fn start(&mut self) {
        let log = self.log_path();
        let child = Command::new(BIN)
            .args(&self.args)
            .env(
                "VOLUME_RECONCILER_LOG",
                std::env::var("TEST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .env("VOLUME_RECONCILER_LOG_FORMAT", "human")
            .stdout(Stdio::null())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(log)
                    .unwrap(),
            )
            .spawn()
            .expect("the binary starts");
        self.child = Some(child);
        let url = format!("http://{}/readyz", self.admin);
        support::eventually(
            Duration::from_secs(30),
            &format!("{} is ready", self.name),
            || {
                let url = url.clone();
                async move { matches!(reqwest::get(&url).await, Ok(r) if r.status() == 200) }
            },
        )
        .await;
    }

    fn signal(&mut self, sig: i32) {
        let pid = self.child.as_ref().expect("running").id() as i32;
        // SAFETY: sending a signal to our own child process.
        let rc = unsafe { libc::kill(pid, sig) };
        assert_eq!(rc, 0, "kill({pid}, {sig})");
    }

    /// Waits for the process to exit; returns its exit status.
    async fn wait(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        tokio::task::spawn_blocking(move || child.wait().expect("wait"))
            .await
            .unwrap()
    }

    fn url(&self) -> String {
        format!("http://{}", self.grpc)
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // Test cleanup: the process may already be gone.
            drop(c.kill());
            drop(c.wait());
        }
    }
}

async fn ledger(db: &str) -> Arc<dyn Store> {
    Arc::new(
        PgStore::connect(&PgSettings {
            url: db.into(),
            max_connections: 4,
            bounds: volume_reconciler::store::DbBounds::DEFAULT,
            write_queue: volume_reconciler::store::DEFAULT_WRITE_QUEUE,
        })
        .await
        .unwrap(),
    )
}

async fn start_sim(cfg: SimConfig) -> SimHandle {
    support::init_logs();
    sim::start("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap()
}

/// Every recorded key's final row agrees with Nova; nothing attached twice;
/// no effect without a row.
async fn assert_truth(
    store: &dyn Store,
    sim: &SimHandle,
    server: Uuid,
    keys: &[(String, Uuid)],
) -> usize {
    let mut disagreements = Vec::new();
    let mut recorded = 0;
    for (key, v) in keys {
        let attached = sim.sim.is_attached(server, *v);
        assert!(sim.sim.attach_effects(*v) <= 1, "{v} attached twice");
        match store
            .operation_get_by_key(&crate::support::ck(None, key))
            .await
            .unwrap()
        {
            Some(op) => {
                recorded += 1;
                assert!(op.state.is_terminal(), "{key} still {:?}", op.state);
                if (op.state == State::Succeeded) != attached {
                    disagreements.push(format!(
                        "{key}: {:?}/{:?} but attached={attached}",
                        op.state, op.resolution
                    ));
                }
            }
            None => assert!(
                !attached,
                "{key}: Nova attached {v} but the ledger has no intent row"
            ),
        }
    }
    assert!(disagreements.is_empty(), "{disagreements:#?}");
    recorded
}

#[tokio::test]
async fn a_killed_service_resolves_everything_after_restart_and_attaches_nothing_twice() {
    let sim = start_sim(SimConfig::default()).await;
    let db = support::pg::fresh_database().await;
    let mut r = Replica::new(
        "kill-a",
        &db,
        &sim.nova_url,
        &[
            "--settle-window",
            "500ms",
            // The least lease a 1s round-trip bound allows (2.75s), for
            // a quick takeover.
            "--db-statement-timeout",
            "1s",
            "--lease",
            "3s",
            "--heartbeat",
            "250ms",
            "--reconcile-interval",
            "100ms",
            "--shutdown-delay",
            "0s",
        ],
    );
    r.start().await;
    let server = Uuid::new_v4();
    let mut keys = Vec::new();
    let client = Client::connect_lazy(&r.url()).unwrap();
    let mut calls = Vec::new();
    for i in 0..30 {
        let v = Uuid::new_v4();
        // A third answer late (lost when the process dies), a third take
        // effect late, a third are plain.
        match i % 3 {
            0 => sim.sim.add_fault(
                FaultRule::new(FaultOp::Attach, Fault::DelayAfterEffect { ms: 3000 }).volume(v),
            ),
            1 => sim.sim.add_fault(
                FaultRule::new(FaultOp::Attach, Fault::DelayBeforeEffect { ms: 1500 }).volume(v),
            ),
            _ => {}
        }
        let key = format!("kill-{i}");
        keys.push((key.clone(), v));
        let c = client.clone();
        calls.push(tokio::spawn(async move {
            c.attach(
                &key,
                &server.to_string(),
                &v.to_string(),
                Default::default(),
                Duration::from_secs(4),
            )
            .await
        }));
    }
    let store = ledger(&db).await;
    let s2 = store.clone();
    support::eventually(
        Duration::from_secs(10),
        "the attaches are in flight",
        || {
            let s2 = s2.clone();
            async move {
                let page = s2
                    .operation_list(&Default::default(), None, 100)
                    .await
                    .unwrap();
                // Recorded, and the late ones still open (the 1.5 s ones
                // may be done already when the intents were spread out by
                // a loaded machine).
                page.operations.len() >= 15
                    && page
                        .operations
                        .iter()
                        .filter(|o| o.state == State::InProgress)
                        .count()
                        >= 10
            }
        },
    )
    .await;
    r.signal(libc::SIGKILL);
    let status = r.wait().await;
    assert!(!status.success());
    for c in calls {
        // Callers see errors (the process died); the truth is in the ledger.
        drop(c.await.unwrap());
    }
    r.start().await;
    support::eventually(
        Duration::from_secs(60),
        "every operation is decided after the restart",
        || {
            let store = store.clone();
            async move {
                let page = store
                    .operation_list(&Default::default(), None, 100)
                    .await
                    .unwrap();
                page.operations.iter().all(|o| o.state.is_terminal())
            }
        },
    )
    .await;
    let recorded = assert_truth(store.as_ref(), &sim, server, &keys).await;
    assert!(recorded >= 15, "{recorded} recorded");
    r.signal(libc::SIGTERM);
    assert!(r.wait().await.success(), "a clean SIGTERM shutdown exits 0");
}

fn balanced(replicas: &[&Replica]) -> Client {
    let endpoints: Vec<Endpoint> = replicas
        .iter()
        .map(|r| {
            Endpoint::from_shared(r.url())
                .unwrap()
                .connect_timeout(Duration::from_secs(1))
                .tcp_nodelay(true)
        })
        .collect();
    Client::from_channel(Channel::balance_list(endpoints.into_iter()))
}

struct Load {
    stop: Arc<std::sync::atomic::AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    errors: Arc<Mutex<BTreeMap<String, u64>>>,
    ok: Arc<std::sync::atomic::AtomicU64>,
    keys: Arc<Mutex<Vec<(String, Uuid)>>>,
    stats: Arc<Mutex<RetryStats>>,
}

fn steady_load(client: Client, server: Uuid, workers: usize, prefix: &str) -> Load {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let errors = Arc::new(Mutex::new(BTreeMap::new()));
    let ok = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let keys = Arc::new(Mutex::new(Vec::new()));
    let stats = Arc::new(Mutex::new(RetryStats::default()));
    let mut tasks = Vec::new();
    for w in 0..workers {
        let (client, stop, errors, ok, keys, stats, prefix) = (
            client.clone(),
            stop.clone(),
            errors.clone(),
            ok.clone(),
            keys.clone(),
            stats.clone(),
            prefix.to_string(),
        );
        tasks.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) && i < 100_000 {
                let v = Uuid::new_v4();
                let key = format!("{prefix}-{w}-{i}");
                keys.lock().unwrap().push((key.clone(), v));
                match client
                    .attach_counted(
                        &key,
                        &server.to_string(),
                        &v.to_string(),
                        Duration::from_secs(10),
                        &stats,
                    )
                    .await
                {
                    Ok(_) => {
                        ok.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                    Err(e) => {
                        *errors
                            .lock()
                            .unwrap()
                            .entry(format!("{:?}", e.code))
                            .or_default() += 1
                    }
                }
                i += 1;
            }
        }));
    }
    Load {
        stop,
        tasks,
        errors,
        ok,
        keys,
        stats,
    }
}

impl Load {
    async fn finish(self) -> (u64, BTreeMap<String, u64>, Vec<(String, Uuid)>, RetryStats) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        for t in self.tasks {
            t.await.unwrap();
        }
        let errors = self.errors.lock().unwrap().clone();
        let keys = self.keys.lock().unwrap().clone();
        let stats = self.stats.lock().unwrap().clone();
        (
            self.ok.load(std::sync::atomic::Ordering::SeqCst),
            errors,
            keys,
            stats,
        )
    }
}

#[tokio::test]
async fn rolling_restarts_under_load_show_callers_no_errors() {
    let sim = start_sim(SimConfig::default()).await;
    let db = support::pg::fresh_database().await;
    let flags = [
        "--shutdown-delay",
        "500ms",
        "--drain-timeout",
        "10s",
        "--settle-window",
        "1s",
        // Not short: the test is about the staged shutdown, and a stall of
        // a loaded machine must not let the other replica take over live
        // work.
        "--db-statement-timeout",
        "1s",
        "--lease",
        "3s",
        "--heartbeat",
        "250ms",
    ];
    let mut a = Replica::new("roll-a", &db, &sim.nova_url, &flags);
    let mut b = Replica::new("roll-b", &db, &sim.nova_url, &flags);
    a.start().await;
    b.start().await;
    let client = balanced(&[&a, &b]);
    let server = Uuid::new_v4();
    let load = steady_load(client, server, 8, "roll");
    let ok = load.ok.clone();
    let mut restarts = 0;
    for _round in 0..3 {
        for r in [&mut a, &mut b] {
            let before = ok.load(std::sync::atomic::Ordering::SeqCst);
            let target = before + 50;
            support::eventually(Duration::from_secs(30), "load flows", || {
                let ok = ok.clone();
                async move { ok.load(std::sync::atomic::Ordering::SeqCst) >= target }
            })
            .await;
            r.signal(libc::SIGTERM);
            assert!(
                r.wait().await.success(),
                "{} drained and exited cleanly",
                r.name
            );
            r.start().await;
            restarts += 1;
        }
    }
    let after = ok.load(std::sync::atomic::Ordering::SeqCst) + 50;
    support::eventually(
        Duration::from_secs(30),
        "load flows after the last restart",
        || {
            let ok = ok.clone();
            async move { ok.load(std::sync::atomic::Ordering::SeqCst) >= after }
        },
    )
    .await;
    let (ok, errors, keys, stats) = load.finish().await;
    eprintln!(
        "rolling restart: {restarts} restarts, {ok} calls ok, caller-visible errors {errors:?}, transport failures absorbed by keyed retries {:?}",
        stats.by_code
    );
    assert!(restarts >= 5);
    assert!(errors.is_empty(), "callers saw errors: {errors:?}");
    let store = ledger(&db).await;
    support::eventually(
        Duration::from_secs(60),
        "every operation is decided",
        || {
            let store = store.clone();
            async move {
                let mut after = None;
                loop {
                    let page = store
                        .operation_list(&Default::default(), after, 500)
                        .await
                        .unwrap();
                    if page.operations.iter().any(|o| !o.state.is_terminal()) {
                        return false;
                    }
                    match page.next_cursor {
                        Some(c) => after = Some(c),
                        None => return true,
                    }
                }
            }
        },
    )
    .await;
    let recorded = assert_truth(store.as_ref(), &sim, server, &keys).await;
    assert_eq!(recorded as u64, ok, "every successful call has its row");
}

#[tokio::test]
async fn killing_one_of_two_replicas_under_load_loses_nothing() {
    let sim = start_sim(SimConfig::default()).await;
    let db = support::pg::fresh_database().await;
    let flags = [
        "--shutdown-delay",
        "0s",
        "--settle-window",
        "500ms",
        // The least lease a 1s round-trip bound allows (2.75s), for a
        // quick takeover.
        "--db-statement-timeout",
        "1s",
        "--lease",
        "3s",
        "--heartbeat",
        "250ms",
        "--reconcile-interval",
        "100ms",
    ];
    let mut a = Replica::new("kill2-a", &db, &sim.nova_url, &flags);
    let mut b = Replica::new("kill2-b", &db, &sim.nova_url, &flags);
    a.start().await;
    b.start().await;
    let server = Uuid::new_v4();
    // Slow answers so work is in flight on both when one dies.
    sim.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::DelayAfterEffect { ms: 300 }).always());
    let load = steady_load(balanced(&[&a, &b]), server, 8, "k2");
    let ok = load.ok.clone();
    support::eventually(Duration::from_secs(30), "load flows", || {
        let ok = ok.clone();
        async move { ok.load(std::sync::atomic::Ordering::SeqCst) >= 40 }
    })
    .await;
    a.signal(libc::SIGKILL);
    a.wait().await;
    let target = ok.load(std::sync::atomic::Ordering::SeqCst) + 40;
    support::eventually(
        Duration::from_secs(30),
        "the survivor carries the load",
        || {
            let ok = ok.clone();
            async move { ok.load(std::sync::atomic::Ordering::SeqCst) >= target }
        },
    )
    .await;
    let (_ok, _errors, keys, _stats) = load.finish().await;
    sim.sim.clear_faults();
    let store = ledger(&db).await;
    support::eventually(
        Duration::from_secs(60),
        "the survivor's reconciler finishes the dead replica's work",
        || {
            let store = store.clone();
            async move {
                let page = store
                    .operation_list(&Default::default(), None, 500)
                    .await
                    .unwrap();
                page.operations.iter().all(|o| o.state.is_terminal())
            }
        },
    )
    .await;
    assert_truth(store.as_ref(), &sim, server, &keys).await;
}

#[tokio::test]
async fn ops_show_tells_the_story_of_a_lost_response() {
    let app = spawn_app(AppOptions::default()).await;
    let (s, v) = (Uuid::new_v4(), Uuid::new_v4());
    app.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::DelayAfterEffect { ms: 10_000 }).volume(v),
    );
    let op = app
        .raw()
        .attach_volume(with_timeout(
            pb::AttachVolumeRequest {
                idempotency_key: "story-1".into(),
                server_id: s.to_string(),
                volume_id: v.to_string(),
                ..Default::default()
            },
            // 5 s: the look, Cinder's confirmation and the durable
            // decision fit in the reserve (1 s) on a loaded CI machine.
            Duration::from_secs(5),
        ))
        .await
        .unwrap()
        .into_inner();
    let out = tokio::task::spawn_blocking({
        let (url, id) = (app.grpc_url.clone(), op.id.clone());
        move || {
            Command::new(BIN)
                .args(["ops", "show", &id, "--server", &url])
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "succeeded (reobserved)",
        "request_sent",
        "outbound_deadline_ms=",
        "request_failed",
        "the caller's deadline expired waiting for the response headers",
        "observed",
        "the volume is in the server's attachment list",
        "resolved",
    ] {
        assert!(
            text.contains(needle),
            "`ops show` lacks {needle:?}:\n{text}"
        );
    }
    // Cinder's pre-check before the request, the request before the loss,
    // the loss before the look, the look before Cinder's confirmation, and
    // that before the decision.
    let pos = |n: &str| text.find(n).unwrap();
    assert!(
        pos("Cinder before sending") < pos(" request_sent ")
            && pos(" request_sent ") < pos(" request_failed ")
            && pos(" request_failed ") < pos("the volume is in the server's attachment list")
            && pos("the volume is in the server's attachment list") < pos("Cinder confirming")
            && pos("Cinder confirming") < pos(" resolved "),
        "{text}"
    );

    let out = tokio::task::spawn_blocking({
        let url = app.grpc_url.clone();
        move || {
            Command::new(BIN)
                .args([
                    "ops",
                    "list",
                    "--state",
                    "succeeded",
                    "--output",
                    "json",
                    "--server",
                    &url,
                ])
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    assert_eq!(v["operations"][0]["id"], op.id);
    assert_eq!(v["operations"][0]["resolution"], "reobserved");

    let out = tokio::task::spawn_blocking({
        let url = app.grpc_url.clone();
        move || {
            Command::new(BIN)
                .args(["ops", "show", "not-a-uuid", "--server", &url])
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("operation_id"),
        "names the field"
    );
    app.stop().await;
}

/// Runs the demo binary off a terminal (stdout and stderr are pipes), with
/// the test's own log settings removed: the demo's defaults.
async fn run_demo(volumes: usize, extra: &[&str]) -> (std::process::Output, String) {
    let volumes = volumes.to_string();
    let mut args: Vec<String> = [
        "demo",
        "--volumes",
        &volumes,
        "--concurrency",
        "8",
        "--deadline",
        "4s",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    let out = tokio::task::spawn_blocking(move || {
        let mut cmd = Command::new(BIN);
        cmd.args(&args).stdin(Stdio::null());
        for (k, _) in std::env::vars() {
            if k.starts_with("VOLUME_RECONCILER_") || k == "RUST_LOG" {
                cmd.env_remove(k);
            }
        }
        cmd.output().unwrap()
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    (out, text)
}

/// The files of a demo run: the ledger it printed, its lock, WAL and log.
fn demo_files(text: &str) -> Vec<std::path::PathBuf> {
    let ledger = text
        .split("embedded ledger ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .unwrap_or_else(|| panic!("no ledger path in:\n{text}"));
    let log = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("service log"))
        .map(|l| l.trim().to_string())
        .unwrap_or_else(|| panic!("no log path in:\n{text}"));
    assert_eq!(
        std::path::Path::new(&log).parent(),
        std::path::Path::new(ledger).parent(),
        "the log sits beside the ledger"
    );
    ["", ".lock", "-wal", "-shm"]
        .iter()
        .map(|s| std::path::PathBuf::from(format!("{ledger}{s}")))
        .chain(std::iter::once(std::path::PathBuf::from(log)))
        .collect()
}

#[tokio::test]
async fn the_demo_completes_with_no_disagreement_and_no_double_attach() {
    let (out, text) = run_demo(30, &[]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{text}\n{stderr}");
    let line = |needle: &str| {
        text.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no {needle:?} in:\n{text}"))
            .to_string()
    };
    let count = |l: String| -> u64 { l.split_whitespace().find_map(|w| w.parse().ok()).unwrap() };
    assert_eq!(count(line("attaches that took effect twice")), 0);
    assert_eq!(count(line("disagree with Nova's truth")), 0);
    assert!(
        count(line("responses lost")) > 0,
        "the workload did lose responses:\n{text}"
    );
    assert!(line("restarting the service").contains("waits up to 10s"));
    assert!(line("...back after").contains(" s") || line("...back after").contains(" ms"));
    assert!(text.contains("OUTCOME") && text.contains("p99"));

    // Quiet: the service's logs went to the file, none to the terminal.
    assert!(stderr.is_empty(), "nothing on stderr:\n{stderr}");
    for l in text.lines() {
        assert!(
            !(l.contains(" INFO ") || l.contains(" WARN ") || l.contains("\"level\"")),
            "a log line on stdout: {l}"
        );
    }
    // Off a terminal, a line per 10 %, in order, and no carriage returns.
    let tenths: Vec<u64> = text
        .lines()
        .filter_map(|l| {
            l.trim()
                .split_once(" %  ")
                .and_then(|(p, _)| p.parse().ok())
        })
        .collect();
    assert_eq!(
        tenths,
        (1..=10).map(|t| t * 10).collect::<Vec<_>>(),
        "{text}"
    );
    assert!(!text.contains('\r'));
    // Its files are gone.
    for f in demo_files(&text) {
        assert!(!f.exists(), "{} was left behind", f.display());
    }
}

#[tokio::test]
async fn the_demo_keeps_its_ledger_and_log_when_asked() {
    let (out, text) = run_demo(8, &["--keep"]).await;
    assert!(
        out.status.success(),
        "demo failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let files = demo_files(&text);
    let (ledger, log) = (&files[0], files.last().unwrap());
    assert!(ledger.exists(), "{text}");
    let logged = std::fs::read_to_string(log).expect("the log is kept");
    assert!(
        // The service's own lines (a decision per operation is debug).
        logged.contains("serving"),
        "the service logged to the file:\n{logged}"
    );
    assert!(text.contains("kept: the ledger"), "{text}");
    for f in files {
        if f.exists() {
            std::fs::remove_file(&f).unwrap();
        }
    }
}

/// `GET /readyz` of `admin`: status and body (`None`: no answer in 5 s).
async fn readyz(admin: SocketAddr) -> Option<(u16, String)> {
    let got = tokio::time::timeout(Duration::from_secs(5), async move {
        let r = reqwest::get(format!("http://{admin}/readyz")).await.ok()?;
        let status = r.status().as_u16();
        Some((status, r.text().await.ok()?))
    });
    got.await.ok().flatten()
}

#[tokio::test]
async fn a_database_blip_keeps_the_replica_ready_and_an_outage_past_the_grace_does_not() {
    use volume_reconciler::sim::netfault::{FaultProxy, NewConns};
    let sim = start_sim(SimConfig::default()).await;
    let direct = support::pg::fresh_database().await;
    let (proxy, db) = FaultProxy::for_url(&direct)
        .await
        .expect("the proxy starts");
    let mut r = Replica::new(
        &format!("ready-grace-{}", Uuid::new_v4().simple()),
        &db,
        &sim.nova_url,
        &[
            "--ready-db-grace",
            "20s",
            "--no-reconciler",
            "--log",
            "info",
        ],
    );
    r.start().await;
    let (admin, log) = (r.admin, r.log_path());
    let cut = || {
        // Refused, as a restarting PostgreSQL refuses; the open ones reset.
        proxy.set_new(NewConns::Refuse);
        proxy.reset_open();
    };

    // A blip: noticed, and still ready (callers get DATABASE_UNAVAILABLE).
    cut();
    eventually_ready(
        admin,
        "the blip is noticed, the replica still ready",
        |s, body| s == 200 && body.contains("database unreachable for"),
    )
    .await;
    proxy.resume();
    eventually_ready(admin, "the database is back", |s, body| {
        s == 200 && body == "ready\n"
    })
    .await;

    // An outage past the grace: not ready, but not before the grace.
    cut();
    let cut_at = tokio::time::Instant::now();
    eventually_ready(admin, "not ready past the grace", |s, body| {
        s == 503 && body.contains("longer than --ready-db-grace 20s")
    })
    .await;
    assert!(
        cut_at.elapsed() >= Duration::from_secs(15),
        "not ready after {:?}, within the 20 s grace",
        cut_at.elapsed()
    );
    proxy.resume();
    eventually_ready(admin, "ready again", |s, _| s == 200).await;
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        text.matches("database unreachable since").count(),
        2,
        "{text}"
    );
    assert_eq!(
        text.matches("database reachable again after").count(),
        2,
        "{text}"
    );
}

/// Waits (60 s at most) until `/readyz` answers as `holds` wants.
async fn eventually_ready(admin: SocketAddr, what: &str, holds: impl Fn(u16, &str) -> bool) {
    let holds = &holds;
    support::eventually_explained(Duration::from_secs(60), what, || async move {
        match readyz(admin).await {
            Some((s, body)) if holds(s, &body) => Ok(()),
            other => Err(format!("/readyz: {other:?}")),
        }
    })
    .await
}

/// The requests of operation `op` (its executor's, which carry its id)
/// that looked at `server`: its attachment list or the server itself.
fn looks_at(sim: &SimHandle, server: Uuid, op: &str) -> usize {
    let (list, show) = (
        format!("/v2.1/servers/{server}/os-volume_attachments"),
        format!("/v2.1/servers/{server}"),
    );
    let rid = format!("req-{op}");
    sim.sim
        .truth()
        .http
        .iter()
        .filter(|r| r.method == "GET" && (r.path == list || r.path == show))
        .filter(|r| r.request_id.as_deref() == Some(rid.as_str()))
        .count()
}

/// A replica paused past its lease (SIGSTOP right after it sent an attach
/// that Nova committed but answers only a minute later, with a 500) loses
/// the operation to the other replica's reconciler, which decides it
/// SUCCEEDED; the volume is then detached through the other replica.
/// Resumed, the paused replica hears the loss within a heartbeat or so: it
/// looks at Nova no more for that operation (it would watch for an attach
/// that is gone until its caller's deadline) and its caller is answered
/// the other's SUCCEEDED within seconds, far inside its 150 s deadline.
#[tokio::test]
async fn a_replica_paused_past_its_lease_stops_at_once_and_answers_the_decision_taken_over() {
    let sim = start_sim(SimConfig {
        record_history: true,
        ..Default::default()
    })
    .await;
    let db = support::pg::fresh_database().await;
    let flags = [
        "--reconcile-interval",
        "200ms",
        "--shutdown-delay",
        "0s",
        "--confirm-with",
        "nova-list",
    ];
    let mut r1 = Replica::new("paused-1", &db, &sim.nova_url, &flags);
    let mut r2 = Replica::new("paused-2", &db, &sim.nova_url, &flags);
    r1.start().await;
    r2.start().await;
    let (server, volume) = (Uuid::new_v4(), Uuid::new_v4());
    sim.sim.add_fault(
        FaultRule::new(
            FaultOp::Attach,
            Fault::LateStatus {
                ms: 60_000,
                code: 500,
            },
        )
        .volume(volume),
    );
    let caller = Client::connect_lazy(&r1.url()).unwrap();
    let call = tokio::spawn(async move {
        caller
            .attach(
                "paused-attach",
                &server.to_string(),
                &volume.to_string(),
                Default::default(),
                Duration::from_secs(150),
            )
            .await
    });
    support::eventually(Duration::from_secs(20), "replica 1 sent the attach", || {
        let sim = sim.sim.clone();
        async move { sim.attach_requests(volume) == 1 }
    })
    .await;
    r1.signal(libc::SIGSTOP);

    // Replica 2 takes the lapsed lease over and decides from Nova's list.
    let store = ledger(&db).await;
    support::eventually(
        Duration::from_secs(30),
        "replica 2 decided the attach",
        || {
            let store = store.clone();
            async move {
                store
                    .operation_get_by_key(&crate::support::ck(None, "paused-attach"))
                    .await
                    .unwrap()
                    .is_some_and(|op| op.state.is_terminal())
            }
        },
    )
    .await;
    let op = store
        .operation_get_by_key(&crate::support::ck(None, "paused-attach"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(op.state, State::Succeeded, "{op:?}");
    assert_eq!(op.lease_owner, None);
    let detached = Client::connect_lazy(&r2.url())
        .unwrap()
        .detach(
            "paused-detach",
            &server.to_string(),
            &volume.to_string(),
            Duration::from_secs(30),
        )
        .await
        .expect("the detach through replica 2");
    assert_eq!(detached.state, pb::State::Succeeded as i32);
    assert!(!sim.sim.is_attached(server, volume));

    let before = looks_at(&sim, server, &op.id.to_string());
    let resumed = tokio::time::Instant::now();
    r1.signal(libc::SIGCONT);
    let answer = tokio::time::timeout(Duration::from_secs(20), call)
        .await
        .expect("replica 1's caller was answered within 20 s of the resume")
        .unwrap()
        .expect("replica 1's caller is answered the decision");
    let waited = resumed.elapsed();
    assert_eq!(answer.state, pb::State::Succeeded as i32, "{answer:?}");
    assert_eq!(answer.id, op.id.to_string());
    // Its run ended with the answer: nothing of it looks at Nova any more,
    // and nothing did since the resume (Nova's answer was still a minute
    // away: without it, the run had no reason to look).
    assert_eq!(
        looks_at(&sim, server, &op.id.to_string()),
        before,
        "replica 1 looked at the server for the operation it lost (answered after {waited:?})"
    );
    // The ledger and Nova agree: one attach request, one effect, undone by
    // the detach; both decided.
    assert_eq!(sim.sim.attach_requests(volume), 1);
    assert_eq!(sim.sim.attach_effects(volume), 1);
    assert!(!sim.sim.is_attached(server, volume));
    let row = store.operation_get(op.id).await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.lease_epoch),
        (State::Succeeded, op.lease_epoch),
        "the decision of replica 2 stands"
    );
    r1.signal(libc::SIGTERM);
    r2.signal(libc::SIGTERM);
    assert!(r1.wait().await.success());
    assert!(r2.wait().await.success());
}

/// Two replicas on one ledger. A detach through replica 1 is answered 500
/// with nothing done; the server's attachment list then answers Nova's 404
/// naming another instance, while `GET /servers/{id}` shows this one. That
/// 404 says nothing about this server: replica 1 answers OUTCOME_UNKNOWN
/// at the caller's deadline, and replica 2's reconciler (replica 1's never
/// runs in this test), reading the same list, looks again and again
/// without deciding; Nova still holds the attachment, and the ledger says
/// UNKNOWN. Once the list answers again, replica 2 decides from it, as Nova
/// has it.
#[tokio::test]
async fn a_404_naming_another_instance_decides_nothing_on_either_replica() {
    let sim = start_sim(SimConfig {
        record_history: true,
        ..Default::default()
    })
    .await;
    let db = support::pg::fresh_database().await;
    let common = [
        "--shutdown-delay",
        "0s",
        "--confirm-with",
        "nova-list",
        "--settle-window",
        "3s",
    ];
    let mut r1 = Replica::new(
        "other404-1",
        &db,
        &sim.nova_url,
        &[&common[..], &["--reconcile-interval", "1h"]].concat(),
    );
    let mut r2 = Replica::new(
        "other404-2",
        &db,
        &sim.nova_url,
        &[&common[..], &["--reconcile-interval", "200ms"]].concat(),
    );
    r1.start().await;
    r2.start().await;
    let (server, volume, other) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    sim.sim.seed_attachment(server, volume);
    sim.sim.add_fault(
        FaultRule::new(
            FaultOp::Detach,
            Fault::Status {
                code: 500,
                effect: false,
            },
        )
        .volume(volume),
    );
    sim.sim.add_fault(
        FaultRule::new(
            FaultOp::List,
            Fault::Page {
                code: 404,
                content_type: "application/json; charset=UTF-8".into(),
                body: format!(
                    r#"{{"itemNotFound": {{"code": 404, "message": "Instance {other} could not be found."}}}}"#
                ),
                effect: false,
            },
        )
        .server(server)
        .always(),
    );
    let err = Client::connect_lazy(&r1.url())
        .unwrap()
        .raw()
        .detach_volume(with_timeout(
            pb::DetachVolumeRequest {
                labels: Default::default(),
                idempotency_key: "other-404".into(),
                server_id: server.to_string(),
                volume_id: volume.to_string(),
            },
            Duration::from_secs(4),
        ))
        .await
        .expect_err("nothing about this server was said");
    let (reason, meta) = support::error_info(&err);
    assert_eq!(
        (err.code(), reason.as_str()),
        (tonic::Code::DeadlineExceeded, "OUTCOME_UNKNOWN"),
        "{meta:?}"
    );
    let id: Uuid = meta["operation_id"].parse().unwrap();
    let store = ledger(&db).await;
    // Replica 2's reconciler looks (three passes, each a failed look at
    // the other instance's 404: the log keeps the first, a repeat adds
    // nothing) and leaves it open.
    support::eventually_explained(
        Duration::from_secs(60),
        "replica 2's reconciler made three passes",
        || {
            let store = store.clone();
            async move {
                let op = store.operation_get(id).await.unwrap().unwrap();
                let events = store.operation_events(id).await.unwrap();
                let looked = events.iter().any(|e| {
                    e.replica == "other404-2"
                        && e.kind == "observed"
                        && e.detail.starts_with("observation failed")
                });
                if looked && op.passes >= 3 {
                    Ok(())
                } else {
                    Err(format!("{} pass(es): {events:#?}", op.passes))
                }
            }
        },
    )
    .await;
    let op = store.operation_get(id).await.unwrap().unwrap();
    assert_eq!(op.state, State::Unknown, "{op:?}");
    assert!(
        sim.sim.is_attached(server, volume),
        "Nova still holds the attachment"
    );
    assert_eq!(sim.sim.detach_requests(volume), 1, "never sent again");
    // Once the list answers, replica 2 decides from what Nova says (asked
    // to: past the deadline and settle window, its passes may have handed
    // the operation to people, still open).
    sim.sim.clear_faults();
    let r2_client = Client::connect_lazy(&r2.url()).unwrap();
    support::eventually(
        Duration::from_secs(60),
        "replica 2 decides the detach",
        || {
            let mut raw = r2_client.raw();
            async move {
                let op = raw
                    .reconcile_operation(with_timeout(
                        pb::ReconcileOperationRequest {
                            operation_id: id.to_string(),
                        },
                        Duration::from_secs(10),
                    ))
                    .await;
                matches!(op, Ok(op) if op.get_ref().state != pb::State::Unknown as i32)
            }
        },
    )
    .await;
    let op = store.operation_get(id).await.unwrap().unwrap();
    let truth = sim.sim.is_attached(server, volume);
    assert!(
        (op.state == State::Succeeded && !truth) || (op.state == State::Failed && truth),
        "the ledger says {:?}, Nova {}",
        op.state,
        if truth { "attached" } else { "detached" }
    );
    r1.signal(libc::SIGTERM);
    r2.signal(libc::SIGTERM);
    assert!(r1.wait().await.success());
    assert!(r2.wait().await.success());
}
