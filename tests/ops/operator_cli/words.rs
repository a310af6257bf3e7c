//! What the binary says is what is true: a server that requires a client
//! certificate is named as such; a TLS mismatch is the retry status (75)
//! whichever side speaks TLS; `serve`'s first line names its version and
//! commit; human logs in a file carry no colour codes; `bench` says how
//! long it really ran; `-o name` prints nothing when the call is refused.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{BIN, QUICK, always, free_port, host_port, run};
use crate::support::{self, AppOptions, Ledger, spawn_app};
use volume_reconciler::sim::{Fault, FaultOp};

/// `https://localhost:PORT` of an app's gRPC port (its certificate names
/// localhost).
fn https_localhost(grpc_url: &str) -> String {
    let port = grpc_url.rsplit(':').next().unwrap();
    format!("https://localhost:{port}")
}

#[tokio::test]
async fn a_server_that_requires_a_client_certificate_says_so_not_give_ca() {
    let pki = support::pki::Pki::new();
    let app = spawn_app(pki.server_flags(AppOptions::default().on(Ledger::Embedded))).await;
    let server = https_localhost(&app.grpc_url);
    let ca = ["--server", server.as_str(), "--ca", pki.server_ca.as_str()];
    // Without a certificate: the server's refusal reaches the client as an
    // alert or as a closed connection, depending on timing; a few runs see
    // either.
    for attempt in 0..3 {
        for command in [
            vec!["ops", "list"],
            vec!["bench", "--duration", "3s", "--quiet"],
        ] {
            let mut args = command.clone();
            args.extend(ca);
            let r = run(&args, &[]).await;
            let what = format!("{command:?} without a client certificate (run {attempt})");
            assert!(
                r.stderr
                    .contains("asks for a client certificate: give --client-cert and --client-key"),
                "{what}: {}",
                r.stderr
            );
            assert!(!r.stderr.contains("give --ca"), "{what}: {}", r.stderr);
            assert_eq!(r.code, Some(75), "{what}: {}", r.stderr);
            assert!(r.took < QUICK, "{what}: took {:?}", r.took);
        }
    }
    // A certificate of a CA the server does not trust: refused, said so.
    let foreign = support::pki::Ca::new("a CA the server does not trust");
    let (cert, key) = foreign.client("intruder");
    let (cert_file, key_file) = (pki.dir.join("foreign.pem"), pki.dir.join("foreign.key"));
    std::fs::write(&cert_file, cert).unwrap();
    std::fs::write(&key_file, key).unwrap();
    let mut args = vec!["ops", "list"];
    args.extend(ca);
    let (cert_file, key_file) = (cert_file.to_str().unwrap(), key_file.to_str().unwrap());
    args.extend(["--client-cert", cert_file, "--client-key", key_file]);
    let r = run(&args, &[]).await;
    assert!(
        r.stderr.contains("refused the client certificate"),
        "{}",
        r.stderr
    );
    assert_eq!(r.code, Some(75), "{}", r.stderr);
    // The client CA's certificate is served.
    let mut args = vec!["ops", "list"];
    args.extend(ca);
    args.extend(["--cert", &pki.client_cert, "--key", &pki.client_key]);
    let r = run(&args, &[]).await;
    assert!(r.ok, "{}", r.stderr);
    app.stop().await;
}

#[tokio::test]
async fn tls_mismatches_exit_75_whichever_side_speaks_tls() {
    let plain = spawn_app(AppOptions::default().on(Ledger::Embedded)).await;
    let pki = support::pki::Pki::new();
    let tls = spawn_app(
        AppOptions::default()
            .on(Ledger::Embedded)
            .arg("--tls-cert", &pki.server_cert)
            .arg("--tls-key", &pki.server_key),
    )
    .await;
    let tls_in_plaintext = host_port(&tls.grpc_url);
    let plaintext_in_tls = format!("https://{}", host_port(&plain.grpc_url));
    let cases = [
        ("plaintext to a TLS server", &tls_in_plaintext, "speaks TLS"),
        (
            "TLS to a plaintext server",
            &plaintext_in_tls,
            "does not speak TLS",
        ),
    ];
    for (what, server, says) in cases {
        for command in [
            vec!["ops", "list"],
            vec!["bench", "--duration", "3s", "--quiet"],
        ] {
            let mut args = command.clone();
            args.extend(["--server", server.as_str()]);
            let r = run(&args, &[]).await;
            assert!(r.stderr.contains(says), "{command:?}, {what}: {}", r.stderr);
            assert_eq!(
                r.code,
                Some(75),
                "{command:?}, {what}: the retry status, as docs/operating.md says: {}",
                r.stderr
            );
        }
    }
    plain.stop().await;
    tls.stop().await;
}

/// `serve` as a process on free ports, its stderr in `log`; killed when
/// dropped.
struct Serve {
    child: Child,
    log: std::path::PathBuf,
}

impl Serve {
    fn start(nova_url: &str, env: &[(&str, &str)]) -> Self {
        let dir = support::pki::temp_dir();
        let log = dir.join("serve.log");
        let port = || format!("127.0.0.1:{}", free_port());
        let mut cmd = Command::new(BIN);
        cmd.args(["serve", "--listen", &port(), "--admin-listen", &port()])
            .args(["--nova-url", nova_url])
            .args([
                "--database-url",
                &format!("sqlite://{}", dir.join("ledger.db").display()),
            ]);
        for (k, _) in std::env::vars() {
            if k.starts_with("VOLUME_RECONCILER_") || k == "DATABASE_URL" || k == "NO_COLOR" {
                cmd.env_remove(k);
            }
        }
        let child = cmd
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("serve starts");
        Self { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The log once the service listens.
    async fn log_when_listening(&self) -> String {
        support::eventually(Duration::from_secs(60), "serve listens", || async {
            self.log().contains("listening")
        })
        .await;
        self.log()
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        // The test is over (or failed): the server goes with it.
        if let Err(e) = self.child.kill() {
            eprintln!("could not stop serve: {e}");
        }
        drop(self.child.wait());
    }
}

#[tokio::test]
async fn serve_names_its_version_and_commit_in_its_first_line() {
    let sim = volume_reconciler::sim::start(
        "127.0.0.1:0".parse().unwrap(),
        volume_reconciler::sim::SimConfig::default(),
    )
    .await
    .unwrap();
    let serve = Serve::start(&sim.nova_url, &[("VOLUME_RECONCILER_LOG_FORMAT", "json")]);
    let log = serve.log_when_listening().await;
    let first: serde_json::Value =
        serde_json::from_str(log.lines().next().unwrap()).expect("a JSON line");
    let (version, commit) = (
        volume_reconciler::metrics::VERSION,
        volume_reconciler::metrics::GIT_SHA,
    );
    assert!(!commit.is_empty());
    assert_eq!(first["version"], version, "{first}");
    assert_eq!(first["commit"], commit, "{first}");
    assert_eq!(
        first["message"],
        format!("starting volume-reconciler {version} (commit {commit})"),
        "{first}"
    );
    drop(serve);
    sim.stop().await;
}

#[tokio::test]
async fn human_logs_written_to_a_file_carry_no_colour_codes() {
    let sim = volume_reconciler::sim::start(
        "127.0.0.1:0".parse().unwrap(),
        volume_reconciler::sim::SimConfig::default(),
    )
    .await
    .unwrap();
    // No NO_COLOR in its environment: a file is reason enough.
    let serve = Serve::start(&sim.nova_url, &[("VOLUME_RECONCILER_LOG_FORMAT", "human")]);
    let log = serve.log_when_listening().await;
    assert!(!log.contains('\u{1b}'), "escape codes in a file:\n{log:?}");
    assert!(log.contains(" INFO "), "human lines: {log}");
    drop(serve);
    sim.stop().await;
}

/// The seconds `no call succeeded in N s` states.
fn stated_seconds(stderr: &str) -> f64 {
    let (_, rest) = stderr
        .split_once("no call succeeded in ")
        .unwrap_or_else(|| panic!("no 'no call succeeded in': {stderr}"));
    let (seconds, _) = rest.split_once(" s ").expect("N s");
    seconds.parse().expect("a number of seconds")
}

#[tokio::test]
async fn bench_states_how_long_it_ran_when_no_call_succeeded() {
    let app = spawn_app(AppOptions::default().on(Ledger::Embedded)).await;
    app.sim
        .add_fault(always(FaultOp::Attach, Fault::DeviceInUse));
    let grpc = host_port(&app.grpc_url);
    let r = run(
        &[
            "bench",
            "--server",
            &grpc,
            "--max-calls",
            "3",
            "--concurrency",
            "1",
            "--duration",
            "10m",
            "--quiet",
        ],
        &[],
    )
    .await;
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(r.took < QUICK, "three calls took {:?}", r.took);
    let said = stated_seconds(&r.stderr);
    assert!(
        said <= r.took.as_secs_f64(),
        "it says {said} s, the process ran {:?}: {}",
        r.took,
        r.stderr
    );
    assert!(
        r.stderr
            .contains("it stopped at --max-calls 3, before --duration 10m; 3 answered"),
        "{}",
        r.stderr
    );
    app.stop().await;
}

#[tokio::test]
async fn name_output_is_empty_when_the_call_is_refused_or_fails() {
    let app = spawn_app(AppOptions::default().on(Ledger::Embedded)).await;
    let grpc = host_port(&app.grpc_url);
    let (server, volume, other) = (support::uuid(), support::uuid(), support::uuid());
    let attach = |volume: &str, key: &str| {
        let args = [
            "ops",
            "attach",
            "--server",
            &grpc,
            "--server-id",
            &server,
            "--volume-id",
            volume,
            "--idempotency-key",
            key,
            "-o",
            "name",
        ]
        .map(String::from);
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            run(&args, &[]).await
        }
    };
    // Succeeded: the id, alone.
    let first = attach(&volume, "name-1").await;
    assert!(first.ok, "{}", first.stderr);
    let id = first.stdout.trim().to_string();
    assert_eq!(first.stdout, format!("{id}\n"));
    // The same key for another volume: refused, and nothing on stdout,
    // although the refusal names the key's first operation.
    let replay = attach(&other, "name-1").await;
    assert_eq!(replay.code, Some(1), "{}", replay.stderr);
    assert_eq!(replay.stdout, "", "stdout of a refused replay");
    assert!(replay.stderr.contains(&id), "{}", replay.stderr);
    // An attach that Nova refuses: failed, and nothing on stdout.
    app.sim
        .add_fault(always(FaultOp::Attach, Fault::DeviceInUse));
    let failed = attach(&other, "name-2").await;
    assert_eq!(failed.code, Some(1), "{}", failed.stderr);
    assert_eq!(failed.stdout, "", "stdout of a failed attach");
    // The ledger: the first key's operation is the first volume's; the
    // second key's failed.
    let by_key = |key: &str| {
        let mut raw = app.raw();
        let key = key.to_string();
        async move {
            raw.get_operation(volume_reconciler::grpc::pb::GetOperationRequest {
                idempotency_key: key,
                ..Default::default()
            })
            .await
            .expect("the operation of the key")
            .into_inner()
        }
    };
    let row = by_key("name-1").await;
    assert_eq!(
        (row.id.as_str(), row.volume_id.as_str()),
        (id.as_str(), volume.as_str())
    );
    let row = by_key("name-2").await;
    assert_eq!(row.state, volume_reconciler::grpc::pb::State::Failed as i32);
    // What Nova saw: the first volume attached once, the other never.
    assert_eq!(app.sim.attach_effects(volume.parse().unwrap()), 1);
    assert_eq!(app.sim.attach_effects(other.parse().unwrap()), 0);
    app.stop().await;
}
