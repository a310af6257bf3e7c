//! The service's log stays in proportion to what happens, not to how many
//! operations there are: the real binary serves 1,000 attaches with its log
//! captured (JSON on stderr, at `info`, as in production), then their
//! verifications fall due while Nova's list fails (a few looks, summed up,
//! and every verification made once Nova answers again); a 30 s outage of Nova under load is a
//! handful of warn lines, its edges one line each; thirty decisions found
//! drifted at once (the cloud lost its attachments) are one warn line, not
//! thirty; and with no traffic at all, the `nova_reachable` gauge follows
//! Nova stopped and started again.

use crate::support;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use support::eventually;
use volume_reconciler::client::Client;
use volume_reconciler::sim::{self, Fault, FaultOp, FaultRule, SimConfig};

const BIN: &str = env!("CARGO_BIN_EXE_volume-reconciler");

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The log's lines, parsed (every line must be JSON).
fn lines(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

fn level<'a>(lines: &'a [serde_json::Value], level: &str) -> Vec<&'a serde_json::Value> {
    lines.iter().filter(|l| l["level"] == level).collect()
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        // The test is over (or failed): the server goes with it.
        if let Err(e) = self.0.kill() {
            eprintln!("could not stop the server: {e}");
        }
        drop(self.0.wait());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_operations_and_a_nova_outage_log_a_handful_of_lines() {
    support::init_logs();
    let nova = sim::start("127.0.0.1:0".parse().unwrap(), SimConfig::default())
        .await
        .unwrap();
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("vr-logs-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("serve.log");
    let (grpc, admin) = (free_port(), free_port());
    let child = Command::new(BIN)
        .args(["serve", "--log-format", "json", "--log", "info"])
        .args(["--listen", &format!("127.0.0.1:{grpc}")])
        .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
        .args(["--nova-url", &nova.nova_url])
        .args(["--confirm-with", "nova-list"])
        .args([
            "--database-url",
            &format!("sqlite://{}", dir.join("ledger.db").display()),
        ])
        .args(["--verify-after", "2s", "--reconcile-interval", "200ms"])
        .env_remove("VOLUME_RECONCILER_CONFIG")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let _server = Killed(child);
    let client = Client::connect_lazy(&format!("http://127.0.0.1:{grpc}")).unwrap();
    eventually(Duration::from_secs(30), "the server serves", || async {
        lines(&log).iter().any(|l| l["message"] == "serving")
    })
    .await;
    let before = lines(&log).len();

    // 1,000 attaches, 8 volumes a server, 20 at a time.
    let mut tasks = Vec::new();
    for w in 0..20 {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..50 {
                let server = uuid::Uuid::from_u128((w * 7 + i / 8) as u128 + 1).to_string();
                let volume = uuid::Uuid::new_v4().to_string();
                client
                    .attach(
                        &format!("logs-{w}-{i}"),
                        &server,
                        &volume,
                        Default::default(),
                        Duration::from_secs(30),
                    )
                    .await
                    .unwrap_or_else(|e| panic!("attach {w}-{i}: {e}"));
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let after_calls = lines(&log);
    let new = &after_calls[before..];
    assert!(
        new.len() <= 20,
        "1,000 attaches wrote {} log lines (a line per operation is debug):\n{:#?}",
        new.len(),
        &new[..new.len().min(10)]
    );

    // Nova's list fails from now on; the decisions fall due for
    // verification (2 s after each) while it does. The verifier finds its
    // looks failing and holds back, probing now and then: the failed looks
    // are summed up in a line an interval, and the verifications wait.
    nova.sim.add_fault(FaultRule {
        op: FaultOp::List,
        server_id: None,
        volume_id: None,
        count: None,
        fault: Fault::Status {
            code: 500,
            effect: false,
        },
    });
    let outage = lines(&log).len();
    let failed_in = |l: &serde_json::Value| l["count"].as_u64().unwrap_or(0);
    eventually(
        Duration::from_secs(60),
        "the failed verification looks are summed up",
        || async {
            lines(&log)[outage..]
                .iter()
                .any(|l| l["level"] == "WARN" && failed_in(l) > 0)
        },
    )
    .await;
    const WAITING: &str = "volume_reconciler_verification_waiting";
    eventually(
        Duration::from_secs(30),
        "verifications wait for Nova",
        || async { gauge(admin, WAITING).await.is_some_and(|n| n > 0.0) },
    )
    .await;
    let all = lines(&log);
    let warns = level(&all[outage..], "WARN");
    let round = warns.iter().find(|l| failed_in(l) > 0).unwrap();
    assert!(
        round["first_error"].as_str().is_some_and(|e| !e.is_empty()),
        "the summary says its first error: {round}"
    );
    assert_eq!(round["kind"], "verification look", "{round}");
    // Nova answers again: every verification due meanwhile is made, none
    // missed, in a line or two more.
    nova.sim.clear_faults();
    eventually(
        Duration::from_secs(90),
        "every verification held back is made",
        || async {
            gauge(admin, WAITING).await == Some(0.0)
                && gauge(
                    admin,
                    r#"volume_reconciler_verification_backlog_seconds{stage="first"}"#,
                )
                .await
                    == Some(0.0)
        },
    )
    .await;
    let text = reqwest::get(format!("http://127.0.0.1:{admin}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let missed: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("volume_reconciler_verification_missed_total"))
        .collect();
    assert!(
        !missed.is_empty() && missed.iter().all(|l| l.ends_with(" 0")),
        "{missed:?}"
    );
    let all = lines(&log);
    let warns = level(&all[outage..], "WARN");
    let looks: u64 = warns.iter().map(|l| failed_in(l)).sum();
    eprintln!(
        "a thousand verifications through a Nova outage: {} WARN line(s), {looks} failed look(s)",
        warns.len()
    );
    // A handful of lines and of looks: a probe now and then, not a look per
    // verification per round.
    assert!(
        warns.len() <= 5 && looks < 100,
        "{} WARN lines for {looks} failed looks:\n{:#?}",
        warns.len(),
        &warns[..warns.len().min(5)]
    );
    drop(std::fs::remove_dir_all(&dir));
}

/// `serve` against `nova_url` on a fresh embedded ledger, its JSON log at
/// `info` in a file: the process, its log, its gRPC and admin ports.
async fn serve(nova_url: &str, extra: &[&str]) -> (Killed, std::path::PathBuf, u16, u16) {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("vr-logs-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("serve.log");
    let (grpc, admin) = (free_port(), free_port());
    let child = Command::new(BIN)
        .args(["serve", "--log-format", "json", "--log", "info"])
        .args(["--listen", &format!("127.0.0.1:{grpc}")])
        .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
        .args(["--nova-url", nova_url, "--confirm-with", "nova-list"])
        .args([
            "--database-url",
            &format!("sqlite://{}", dir.join("ledger.db").display()),
        ])
        .args(extra)
        .env_remove("VOLUME_RECONCILER_CONFIG")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let server = Killed(child);
    eventually(Duration::from_secs(30), "the server serves", || async {
        lines(&log).iter().any(|l| l["message"] == "serving")
    })
    .await;
    (server, log, grpc, admin)
}

/// A gauge of the service's `/metrics` (`None`: not there, or no answer).
async fn gauge(admin: u16, name: &str) -> Option<f64> {
    let text = reqwest::get(format!("http://127.0.0.1:{admin}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .filter_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .find_map(|v| v.trim().parse().ok())
}

/// The log lines whose message begins with `prefix`.
fn said(log: &std::path::Path, prefix: &str) -> Vec<serde_json::Value> {
    lines(log)
        .into_iter()
        .filter(|l| l["message"].as_str().is_some_and(|m| m.starts_with(prefix)))
        .collect()
}

#[tokio::test]
async fn with_no_traffic_the_nova_gauge_follows_nova_stopped_and_started_again_within_a_minute() {
    support::init_logs();
    let nova = sim::start("127.0.0.1:0".parse().unwrap(), SimConfig::default())
        .await
        .unwrap();
    let addr = nova.addr;
    // No reconciler, no caller: nothing but the probe asks Nova.
    let (_server, log, _, admin) = serve(
        &nova.nova_url,
        &[
            "--no-reconciler",
            "--nova-probe-interval",
            "5s",
            "--nova-probe-timeout",
            "2s",
        ],
    )
    .await;
    const REACHABLE: &str = "volume_reconciler_nova_reachable";
    const CONTACT: &str = "volume_reconciler_nova_last_contact_timestamp_seconds";
    assert_eq!(
        gauge(admin, REACHABLE).await,
        Some(1.0),
        "the version document came at start"
    );
    let first_contact = gauge(admin, CONTACT).await.expect("the contact gauge");
    assert!(first_contact > 1.0e9, "a Unix time: {first_contact}");

    nova.stop().await;
    eventually(
        Duration::from_secs(60),
        "the gauge says Nova is gone",
        || async { gauge(admin, REACHABLE).await == Some(0.0) },
    )
    .await;
    let gone = said(&log, "Nova unreachable since");
    assert_eq!(gone.len(), 1, "one line when it goes: {gone:#?}");

    let nova = sim::start(addr, SimConfig::default()).await.unwrap();
    eventually(
        Duration::from_secs(60),
        "the gauge says Nova is back",
        || async { gauge(admin, REACHABLE).await == Some(1.0) },
    )
    .await;
    let last_contact = gauge(admin, CONTACT).await.expect("the contact gauge");
    assert!(
        last_contact > first_contact,
        "{last_contact} after {first_contact}"
    );
    let back = said(&log, "Nova reachable again after");
    assert_eq!(back.len(), 1, "one line when it comes back: {back:#?}");
    assert_eq!(said(&log, "Nova unreachable since").len(), 1);
    nova.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_30s_nova_outage_under_load_writes_fewer_than_20_warn_lines() {
    support::init_logs();
    let nova = sim::start("127.0.0.1:0".parse().unwrap(), SimConfig::default())
        .await
        .unwrap();
    let addr = nova.addr;
    let (_server, log, grpc, _) = serve(
        &nova.nova_url,
        &["--verify-after", "2s", "--reconcile-interval", "200ms"],
    )
    .await;
    let client = Client::connect_lazy(&format!("http://127.0.0.1:{grpc}")).unwrap();
    // A small steady load: 8 callers attaching, each with a 5 s deadline.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for w in 0..8 {
        let (client, stop, calls) = (client.clone(), stop.clone(), calls.clone());
        tasks.push(tokio::spawn(async move {
            let server = uuid::Uuid::from_u128(w + 1).to_string();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let volume = uuid::Uuid::new_v4().to_string();
                // Failures are the point of the outage; the log is judged.
                drop(
                    client
                        .attach(
                            &format!("outage-{w}-{i}"),
                            &server,
                            &volume,
                            Default::default(),
                            Duration::from_secs(5),
                        )
                        .await,
                );
                calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                i += 1;
            }
        }));
    }
    eventually(Duration::from_secs(30), "the load runs", || async {
        calls.load(std::sync::atomic::Ordering::SeqCst) >= 40
    })
    .await;
    let before = lines(&log).len();
    nova.stop().await;
    let outage = tokio::time::Instant::now();
    eventually(Duration::from_secs(30), "the outage is noticed", || async {
        !said(&log, "Nova unreachable since").is_empty()
    })
    .await;
    // The outage's length is what is measured against, not a wait for
    // something to happen.
    tokio::time::sleep_until(outage + Duration::from_secs(30)).await;
    let nova = sim::start(addr, SimConfig::default()).await.unwrap();
    eventually(Duration::from_secs(60), "the return is logged", || async {
        !said(&log, "Nova reachable again after").is_empty()
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for t in tasks {
        t.await.unwrap();
    }
    let all = lines(&log);
    let warns = level(&all[before..], "WARN");
    eprintln!("a 30 s Nova outage under load: {} WARN lines", warns.len());
    assert!(
        warns.len() < 20,
        "{} WARN lines during a 30 s outage:\n{warns:#?}",
        warns.len()
    );
    let summaries: Vec<_> = warns
        .iter()
        .filter(|l| l["kind"] == "Nova request")
        .collect();
    assert!(
        !summaries.is_empty(),
        "the failed requests are summed up: {warns:#?}"
    );
    assert!(
        summaries
            .iter()
            .all(|l| l["count"].as_u64() > Some(0) && l["first_error"].is_string())
    );
    assert_eq!(said(&log, "Nova unreachable since").len(), 1);
    let back = said(&log, "Nova reachable again after");
    assert_eq!(back.len(), 1, "{back:#?}");
    assert!(back[0]["failed"].as_u64() > Some(0), "{}", back[0]);
    nova.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drift_found_on_many_operations_in_an_interval_is_one_warn_line() {
    support::init_logs();
    let nova = sim::start("127.0.0.1:0".parse().unwrap(), SimConfig::default())
        .await
        .unwrap();
    let (_server, log, grpc, admin) = serve(
        &nova.nova_url,
        &["--verify-after", "2s", "--reconcile-interval", "200ms"],
    )
    .await;
    let client = Client::connect_lazy(&format!("http://127.0.0.1:{grpc}")).unwrap();
    // 30 attaches on 3 servers, decided at once.
    const N: u64 = 30;
    for i in 0..N {
        let server = uuid::Uuid::from_u128(u128::from(i % 3) + 1).to_string();
        client
            .attach(
                &format!("drift-{i}"),
                &server,
                &uuid::Uuid::new_v4().to_string(),
                Default::default(),
                Duration::from_secs(30),
            )
            .await
            .unwrap_or_else(|e| panic!("attach {i}: {e}"));
    }
    let before = lines(&log).len();
    // The cloud loses every attachment before the first verification:
    // each decision has drifted, and the verifier finds it so.
    nova.sim.reset();
    const DRIFT: &str = "volume_reconciler_drift_detected_total";
    eventually(
        Duration::from_secs(60),
        "every operation is found drifted",
        || async { gauge(admin, DRIFT).await == Some(N as f64) },
    )
    .await;
    let warns = |all: &[serde_json::Value]| -> Vec<serde_json::Value> {
        level(&all[before..], "WARN").into_iter().cloned().collect()
    };
    // At most two intervals' lines (the finds may straddle an edge), never
    // one per operation.
    let at_most = |w: &[serde_json::Value]| {
        assert!(
            w.len() <= 2,
            "{} WARN lines for {N} drifted operations:\n{:#?}",
            w.len(),
            &w[..w.len().min(5)]
        )
    };
    at_most(&warns(&lines(&log)));
    let counted = |w: &[serde_json::Value]| -> u64 {
        w.iter()
            .filter(|l| l["kind"] == "drift")
            .map(|l| l["count"].as_u64().unwrap_or(0))
            .sum()
    };
    eventually(
        Duration::from_secs(30),
        "the interval's summary counts every drifted operation",
        || async { counted(&warns(&lines(&log))) == N },
    )
    .await;
    let w = warns(&lines(&log));
    eprintln!("{N} drifted operations: {} WARN line(s)", w.len());
    at_most(&w);
    let summary = w.iter().find(|l| l["kind"] == "drift").unwrap();
    assert!(
        summary["first"]
            .as_str()
            .is_some_and(|f| f.contains("decided succeeded")),
        "the summary says its first drift: {summary}"
    );
    let servers: u64 = w
        .iter()
        .filter(|l| l["kind"] == "drift")
        .map(|l| l["targets"].as_u64().unwrap_or(0))
        .max()
        .unwrap_or(0);
    assert!((1..=3).contains(&servers), "distinct servers: {summary}");
    nova.stop().await;
}
