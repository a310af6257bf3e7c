//! What an operator meets first: the binary's `ops`, `bench`,
//! `healthcheck` and `config show` against real servers (spawn_app, real
//! sockets), misconfigured ones included. Every session ends in seconds,
//! with a message that names the fix.
//!
//! - `first_attach`: `dev` and the `ops attach` it prints; exit statuses.
//! - `pipes`: every printing command into a closed pipe.
//! - `formats`: `-o table|wide|json|yaml|name`.
//! - `completion`: bash completion past the first word, the man pages.
//! - `words`: what the binary says is true (TLS diagnoses and their exit
//!   status, serve's first line, logs in a file, bench's time, `-o name`
//!   on a refusal).

use crate::support;

mod completion;
mod first_attach;
mod fleet;
mod formats;
mod pipes;
mod words;

use std::process::Command;
use std::time::{Duration, Instant};

use support::{AppOptions, Ledger, eventually, spawn_app};
use volume_reconciler::sim::{Fault, FaultOp, FaultRule};

const BIN: &str = env!("CARGO_BIN_EXE_volume-reconciler");

/// The bound every misconfigured session must end within (the brief's
/// 10 s, with the room a loaded machine needs).
const QUICK: Duration = Duration::from_secs(10);

pub(crate) struct Run {
    ok: bool,
    code: Option<i32>,
    stdout: String,
    stderr: String,
    took: Duration,
}

/// Runs the binary with nothing inherited that it would read.
async fn run(args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("VOLUME_RECONCILER_") || k == "DATABASE_URL" || k.starts_with("OS_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().copied());
    let started = Instant::now();
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    Run {
        ok: out.status.success(),
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into(),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
        took: started.elapsed(),
    }
}

/// A fault on every matching request (not just the first).
fn always(op: FaultOp, fault: Fault) -> FaultRule {
    let mut rule = FaultRule::new(op, fault);
    rule.count = None;
    rule
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn host_port(url: &str) -> String {
    url.trim_start_matches("http://").to_string()
}

/// The exit status a help text states: the number after its first "exit ".
fn stated_exit(help: &str) -> Option<i32> {
    let (_, rest) = help.split_once("exit ")?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Fails unless the session failed quickly, saying `fix`.
fn assert_fails_saying(r: &Run, what: &str, fix: &str) {
    assert!(!r.ok, "{what}: succeeded:\n{}", r.stdout);
    assert!(r.took < QUICK, "{what}: took {:?}", r.took);
    assert!(
        r.stderr.contains(fix),
        "{what}: the message does not say {fix:?}:\n{}",
        r.stderr
    );
}

#[tokio::test]
async fn misconfigured_targets_end_in_seconds_with_a_message_that_names_the_fix() {
    let token_hash = volume_reconciler::grpc::auth::sha256_hex("good-token");
    let plain = spawn_app(
        AppOptions::default()
            .on(Ledger::Embedded)
            .arg("--auth-tokens", &format!("ops:operator:{token_hash}")),
    )
    .await;
    let pki = support::pki::Pki::new();
    let tls = spawn_app(
        AppOptions::default()
            .on(Ledger::Embedded)
            .arg("--tls-cert", &pki.server_cert)
            .arg("--tls-key", &pki.server_key),
    )
    .await;
    let grpc = host_port(&plain.grpc_url);
    let tls_grpc = host_port(&tls.grpc_url);
    let admin = host_port(&plain.admin_url);
    let refused = format!("127.0.0.1:{}", free_port());
    // A port that accepts connections and never answers.
    let hung = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hung_addr = hung.local_addr().unwrap().to_string();
    let https_plain = format!("https://{grpc}");

    let cases: Vec<(&str, Vec<&str>, &str)> = vec![
        ("refused", vec!["--server", &refused], "connection refused"),
        (
            "plaintext to TLS",
            vec!["--server", &tls_grpc],
            "speaks TLS: use https://",
        ),
        (
            "TLS to plaintext",
            vec!["--server", &https_plain],
            "does not speak TLS: use http://",
        ),
        (
            "the admin port",
            vec!["--server", &admin],
            "HTTP/1 server, not gRPC",
        ),
        (
            "accepts, never answers",
            vec!["--server", &hung_addr],
            "does not answer as a gRPC server in time",
        ),
        (
            "a bad token",
            vec!["--server", &grpc, "--token", "bad"],
            "a bearer token it knows",
        ),
        (
            "no token",
            vec!["--server", &grpc],
            "a bearer token it knows",
        ),
    ];
    for (what, args, fix) in &cases {
        let mut ops = vec!["ops", "list"];
        ops.extend(args.iter().copied());
        let r = run(&ops, &[]).await;
        assert_fails_saying(&r, &format!("ops list, {what}"), fix);
        // A port that never answers is unavailable, worth a retry (75),
        // as a refused connection is; a token is not (1).
        if *what == "accepts, never answers" || *what == "refused" {
            assert_eq!(r.code, Some(75), "{what}: {}", r.stderr);
        }
        if what.contains("token") {
            assert_eq!(r.code, Some(1), "{what}: {}", r.stderr);
        }
        let mut bench = vec!["bench", "--duration", "3s", "--quiet"];
        bench.extend(args.iter().copied());
        let r = run(&bench, &[]).await;
        assert_fails_saying(&r, &format!("bench, {what}"), fix);
    }
    // The right settings work, TLS with the CA.
    let ok = run(
        &["ops", "list", "--server", &grpc, "--token", "good-token"],
        &[],
    )
    .await;
    assert!(ok.ok, "{}", ok.stderr);
    let ok = run(
        &[
            "ops",
            "list",
            "--server",
            &format!("https://localhost:{}", tls_grpc.rsplit(':').next().unwrap()),
            "--ca",
            &pki.server_ca,
        ],
        &[],
    )
    .await;
    assert!(ok.ok, "{}", ok.stderr);

    // healthcheck follows serve's variables, takes HOST:PORT, and asks
    // gRPC health with --grpc; a wrong port says what to check.
    let r = run(
        &["healthcheck"],
        &[("VOLUME_RECONCILER_ADMIN_LISTEN", &admin)],
    )
    .await;
    assert!(
        r.ok,
        "healthcheck at VOLUME_RECONCILER_ADMIN_LISTEN: {}",
        r.stderr
    );
    let r = run(&["healthcheck", "--url", &admin], &[]).await;
    assert!(r.ok, "healthcheck --url HOST:PORT: {}", r.stderr);
    let r = run(
        &["healthcheck", "--grpc"],
        &[("VOLUME_RECONCILER_LISTEN", &grpc)],
    )
    .await;
    assert!(r.ok, "healthcheck --grpc: {}", r.stderr);
    let r = run(&["healthcheck", "--url", &refused], &[]).await;
    assert_fails_saying(&r, "healthcheck, refused", "connection refused");
    let r = run(&["healthcheck", "--url", &grpc], &[]).await;
    assert_fails_saying(&r, "healthcheck, the gRPC port", "ask it with --grpc");
    let r = run(&["healthcheck", "--grpc", "--listen", &tls_grpc], &[]).await;
    assert_fails_saying(&r, "healthcheck --grpc, plaintext to TLS", "speaks TLS");
    drop(hung);
    plain.stop().await;
    tls.stop().await;
}

#[tokio::test]
async fn bench_stops_at_a_refusal_keeps_to_its_duration_and_fails_when_nothing_succeeds() {
    let token_hash = volume_reconciler::grpc::auth::sha256_hex("orch");
    let app = spawn_app(
        AppOptions::default()
            .on(Ledger::Embedded)
            .arg("--auth-tokens", &format!("orch:orchestrator:{token_hash}")),
    )
    .await;
    let grpc = host_port(&app.grpc_url);

    // A bad token: the first refusal stops the run (not 77,640 of them).
    let r = run(
        &[
            "bench",
            "--server",
            &grpc,
            "--token",
            "bad",
            "--duration",
            "20s",
            "--quiet",
        ],
        &[],
    )
    .await;
    assert_fails_saying(&r, "bench with a bad token", "UNAUTHENTICATED");
    assert!(
        r.took < Duration::from_secs(8),
        "stopped at once: {:?}",
        r.took
    );

    // Attaches that take 20 s: the run still ends at --duration, and as
    // nothing succeeded, it fails.
    app.sim.add_fault(always(
        FaultOp::Attach,
        Fault::DelayBeforeEffect { ms: 20_000 },
    ));
    let r = run(
        &[
            "bench",
            "--server",
            &grpc,
            "--token",
            "orch",
            "--duration",
            "2s",
            "--deadline",
            "60s",
            "--quiet",
            "--output",
            "json",
        ],
        &[],
    )
    .await;
    assert!(r.took < QUICK, "--duration 2s took {:?}", r.took);
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(r.stderr.contains("no call succeeded"), "{}", r.stderr);
    app.sim.clear_faults();

    // Errors by their canonical names; past --max-error-rate, exit 1.
    app.sim
        .add_fault(always(FaultOp::Attach, Fault::DeviceInUse));
    let r = run(
        &[
            "bench",
            "--server",
            &grpc,
            "--token",
            "orch",
            "--duration",
            "2s",
            "--quiet",
            "--output",
            "json",
        ],
        &[],
    )
    .await;
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    let summary: serde_json::Value = serde_json::from_str(r.stdout.trim()).unwrap();
    let codes: Vec<&String> = summary["errors"].as_object().unwrap().keys().collect();
    assert!(
        !codes.is_empty()
            && codes
                .iter()
                .all(|c| c.chars().all(|c| c.is_ascii_uppercase() || c == '_')),
        "canonical code names: {codes:?}"
    );
    app.sim.clear_faults();
    // The last run's cut-off calls still run in the service: they would
    // take the five faults meant for the next run.
    let exec = app.exec.clone();
    eventually(
        Duration::from_secs(60),
        "the last runs' operations to end",
        || {
            let exec = exec.clone();
            async move { exec.running() == 0 }
        },
    )
    .await;
    let mut five = FaultRule::new(FaultOp::Attach, Fault::DeviceInUse);
    five.count = Some(5);
    app.sim.add_fault(five);
    let args = [
        "bench",
        "--server",
        &grpc,
        "--token",
        "orch",
        "--duration",
        "2s",
        "--concurrency",
        "1",
        "--quiet",
    ];
    let mut strict = args.to_vec();
    strict.extend(["--max-error-rate", "0"]);
    let r = run(&strict, &[]).await;
    assert_eq!(
        r.code,
        Some(1),
        "5 errors pass --max-error-rate 0: {}",
        r.stderr
    );
    assert!(r.stderr.contains("--max-error-rate"), "{}", r.stderr);
    let r = run(&args, &[]).await;
    assert!(
        r.ok,
        "without --max-error-rate, some errors are a report, not a failure: {}",
        r.stderr
    );
    app.stop().await;
}

#[tokio::test]
async fn ops_watch_honours_its_timeout_and_prints_only_changes() {
    let app = spawn_app(AppOptions::default().on(Ledger::Embedded)).await;
    // The response is lost and Nova's list fails: the attach stays
    // UNKNOWN (no reconciler runs in this app).
    let (server, volume) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    app.sim
        .add_fault(always(FaultOp::Attach, Fault::CloseAfterEffect));
    app.sim.add_fault(always(
        FaultOp::List,
        Fault::Status {
            code: 500,
            effect: false,
        },
    ));
    app.sim.add_fault(always(
        FaultOp::Show,
        Fault::Status {
            code: 500,
            effect: false,
        },
    ));
    app.sim.add_fault(always(
        FaultOp::Cinder,
        Fault::Status {
            code: 500,
            effect: false,
        },
    ));
    let e = app
        .client
        .attach(
            "watch-1",
            &server.to_string(),
            &volume.to_string(),
            Default::default(),
            Duration::from_secs(5),
        )
        .await
        .expect_err("the outcome cannot be known");
    let id = e.operation_id().expect("the operation's id").to_string();
    let grpc = host_port(&app.grpc_url);
    let r = run(
        &["ops", "watch", &id, "--server", &grpc, "--timeout", "3s"],
        &[],
    )
    .await;
    // Not decided yet: worth watching again (the retry status), as
    // `ops watch --help` says.
    assert_eq!(r.code, Some(75), "{}\n{}", r.stdout, r.stderr);
    let help = run(&["ops", "watch", "--help"], &[]).await;
    assert_eq!(
        stated_exit(&help.stdout),
        r.code,
        "the status `ops watch --help` states:\n{}",
        help.stdout
    );
    assert!(r.took < QUICK, "watch --timeout 3s took {:?}", r.took);
    assert!(
        r.stderr.contains("not decided within --timeout 3s") && r.stderr.contains("still unknown"),
        "{}",
        r.stderr
    );
    assert_eq!(
        r.stdout.lines().count(),
        1,
        "one line: the state did not change:\n{}",
        r.stdout
    );
    app.stop().await;
}

#[tokio::test]
async fn config_show_prints_the_values_in_force_and_where_they_came_from() {
    let args = [
        "config",
        "show",
        "--settle-window-attach",
        "10m",
        "--settle-window",
        "2m",
    ];
    let r = run(&args, &[]).await;
    assert!(r.ok, "{}", r.stderr);
    let line = r
        .stdout
        .lines()
        .find(|l| l.split_whitespace().next() == Some("settle-window-attach"))
        .unwrap();
    assert!(
        line.contains(" 2m ") && line.contains("via settle-window"),
        "{line}"
    );
    assert!(
        r.stdout
            .contains("note: settle-window-attach 10m (flag) does not apply"),
        "{}",
        r.stdout
    );
    let mut json = args.to_vec();
    json.extend(["-o", "json"]);
    let r = run(&json, &[]).await;
    let shown: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    let row = shown["settings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["setting"] == "settle-window-attach")
        .unwrap();
    assert_eq!(row["value"], "2m");
    assert_eq!(row["source"], "via settle-window");
    assert_eq!(row["overridden"]["value"], "10m");
    assert_eq!(row["overridden"]["source"], "flag");
    let detach = shown["settings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["setting"] == "settle-window-detach")
        .unwrap();
    assert_eq!(detach["value"], "2m");
    assert!(detach["overridden"].is_null(), "its default was not given");
}

#[tokio::test]
async fn the_command_line_checks_ranges_and_offers_completions_a_man_page_and_its_commit() {
    for limit in ["9999", "0"] {
        let r = run(
            &["ops", "list", "--limit", limit, "--server", "127.0.0.1:1"],
            &[],
        )
        .await;
        assert_eq!(r.code, Some(2), "--limit {limit}: a usage error");
        assert!(
            r.stderr.contains("--limit") && r.stderr.contains("1..=500"),
            "{}",
            r.stderr
        );
    }
    let r = run(&["ops", "--help"], &[]).await;
    assert!(
        !r.stdout.contains("--config"),
        "ops does not read --config:\n{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("Connection:") && r.stdout.contains("--client-key"),
        "{}",
        r.stdout
    );
    let r = run(&["--version"], &[]).await;
    assert!(r.stdout.contains("(commit "), "{}", r.stdout);
    let r = run(&["completions", "bash"], &[]).await;
    assert!(
        r.ok && r.stdout.contains("volume-reconciler"),
        "{}",
        r.stderr
    );
    let r = run(&["man"], &[]).await;
    assert!(
        r.ok && r.stdout.contains(".TH volume-reconciler 1"),
        "{}",
        r.stderr
    );
}
