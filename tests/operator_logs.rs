//! The service's log stays in proportion to what happens, not to how many
//! operations there are: the real binary serves 1,000 attaches with its log
//! captured (JSON on stderr, at `info`, as in production), then verifies
//! them while Nova's list fails.

mod support;

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
    // verification (2 s after each) and every round's looks fail.
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
    let failed_in = |l: &serde_json::Value| l["failed"].as_u64().unwrap_or(0);
    eventually(
        Duration::from_secs(60),
        "three rounds of failed verifications are logged",
        || async {
            let all = lines(&log);
            let rounds: Vec<_> = all[outage..]
                .iter()
                .filter(|l| l["level"] == "WARN" && failed_in(l) > 0)
                .collect();
            rounds.len() >= 3 && rounds.iter().map(|l| failed_in(l)).sum::<u64>() >= 1000
        },
    )
    .await;
    let all = lines(&log);
    let warns = level(&all[outage..], "WARN");
    let looks: u64 = warns.iter().map(|l| failed_in(l)).sum();
    // One line a round, with the count and the first error; at a line per
    // operation per round this would be one per failed look.
    assert!(
        (warns.len() as u64) * 10 < looks,
        "{} WARN lines for {looks} failed looks:\n{:#?}",
        warns.len(),
        &warns[..warns.len().min(5)]
    );
    let round = warns.iter().find(|l| failed_in(l) > 0).unwrap();
    assert!(
        round["first_error"].as_str().is_some_and(|e| !e.is_empty()),
        "the round's line says its first error: {round}"
    );
    drop(std::fs::remove_dir_all(&dir));
}
