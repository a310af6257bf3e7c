//! An operator's first attach: `dev` started as the README says, then the
//! `ops attach` it prints, copied as it is; and `ops attach`'s answers
//! when the attach fails or cannot be known, with their exit statuses.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command};
use std::time::Duration;

use super::{BIN, always, free_port, host_port, run};
use crate::support::{AppOptions, Ledger, spawn_app};
use volume_reconciler::sim::{Fault, FaultOp};

/// `dev` as a process: `stop` is Ctrl-C (SIGINT); a test that fails
/// before kills it when `Dev` is dropped.
struct Dev {
    child: Child,
    /// Everything printed up to the banner's last line.
    banner: Vec<String>,
    rest: std::sync::mpsc::Receiver<String>,
}

impl Dev {
    /// Starts `dev` on free ports, as a person would (no log settings in
    /// its environment), and reads what it prints up to the banner's
    /// "Ctrl-C": its stdout and stderr in one pipe, in the order written,
    /// as a terminal shows them.
    fn start(extra: &[&str]) -> Self {
        let port = || format!("127.0.0.1:{}", free_port());
        let (reader, writer) = std::io::pipe().unwrap();
        let child = Command::new(BIN)
            .args(["dev", "--listen", &port(), "--admin-listen", &port()])
            .args(["--sim-listen", &port()])
            .args(extra)
            .env_remove("VOLUME_RECONCILER_LOG")
            .env_remove("VOLUME_RECONCILER_LOG_FORMAT")
            .stdout(writer.try_clone().unwrap())
            .stderr(writer)
            .spawn()
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        // Read until dev ends (the pipe is dev's alone: no writer is left
        // here once the command above is dropped), so that it never waits
        // on a full pipe.
        std::thread::spawn(move || {
            for line in BufReader::new(reader).lines() {
                let Ok(line) = line else { return };
                // The test stopped listening (it has the banner, or
                // failed): the rest is read and dropped.
                drop(tx.send(line));
            }
        });
        let mut banner = Vec::new();
        loop {
            // Wide: the machine is loaded and the service migrates a ledger.
            match rx.recv_timeout(Duration::from_secs(60)) {
                Ok(line) => {
                    let end = line.starts_with("Ctrl-C");
                    banner.push(line);
                    if end {
                        break;
                    }
                }
                Err(e) => panic!("dev's banner did not end ({e}): {banner:#?}"),
            }
        }
        Self {
            child,
            banner,
            rest: rx,
        }
    }

    /// Nothing but the banner came up to its end: its first line first,
    /// and no log line (JSON or human) before or among its lines.
    fn assert_banner_first(&self) {
        let b = &self.banner;
        assert!(
            b[0].starts_with("volume-reconciler dev:"),
            "the banner is the first thing printed: {b:#?}"
        );
        let banner_line = |l: &str| {
            l.is_empty()
                || l.starts_with("  ")
                || l.starts_with("volume-reconciler dev:")
                || l == "in another terminal:"
                || l.starts_with("Ctrl-C")
        };
        assert!(
            b.iter().all(|l| banner_line(l)),
            "no log line before or among the banner's: {b:#?}"
        );
    }

    /// The first line printed after the banner that holds `what` (within
    /// 30 s), with the lines before it.
    fn after_banner(&self, what: &str) -> (String, Vec<String>) {
        let mut before = Vec::new();
        loop {
            match self.rest.recv_timeout(Duration::from_secs(30)) {
                Ok(line) if line.contains(what) => return (line, before),
                Ok(line) => before.push(line),
                Err(e) => panic!("no {what:?} after the banner ({e}): {before:#?}"),
            }
        }
    }

    /// The banner's line holding `what`, as printed.
    fn line(&self, what: &str) -> String {
        self.banner
            .iter()
            .find(|l| l.contains(what))
            .unwrap_or_else(|| panic!("no {what:?} in {:#?}", self.banner))
            .trim()
            .to_string()
    }

    fn stop(&mut self) -> std::process::ExitStatus {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        self.child.wait().unwrap()
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        // After `stop` the child is gone and kill fails: nothing to do;
        // after a failed assertion this ends it, and its error is moot.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs a printed command line as the user would paste it.
async fn paste(line: &str) -> std::process::Output {
    let line = line.to_string();
    tokio::task::spawn_blocking(move || Command::new("sh").args(["-c", &line]).output().unwrap())
        .await
        .unwrap()
}

#[tokio::test]
async fn the_attach_that_dev_prints_succeeds_when_pasted_and_prints_the_operation_and_its_log() {
    volume_reconciler::tls::install_crypto_provider();
    let mut dev = Dev::start(&[]);
    dev.assert_banner_first();
    // The startup's warning comes after it, as a line for a person.
    let (warning, _) = dev.after_banner("no caller authentication");
    assert!(
        !warning.starts_with('{') && warning.contains("WARN"),
        "{warning}"
    );
    // The metrics address it prints answers with the service's metrics.
    let metrics = dev.line("metrics");
    let url = metrics.split_whitespace().nth(1).unwrap();
    let body = reqwest::get(url).await.unwrap().text().await.unwrap();
    assert!(body.contains("volume_reconciler_"), "{url}: {body}");
    let attach = dev.line("ops attach");
    let out = paste(&attach).await;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{attach}: {stderr}\n{stdout}");
    assert!(
        stdout.contains("state       succeeded") && stdout.contains("reconcile log:"),
        "{stdout}"
    );
    assert!(
        stdout.contains("recorded") && stdout.contains("request_sent"),
        "the reconcile log: {stdout}"
    );
    // The key was made and said, so the same operation can be asked again.
    let key = stderr
        .split_whitespace()
        .skip_while(|w| *w != "key")
        .nth(1)
        .unwrap_or_else(|| panic!("no key said: {stderr}"))
        .to_string();
    let again = paste(&format!("{attach} --idempotency-key {key} -o json")).await;
    assert!(again.status.success());
    let shown: serde_json::Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(shown["operation"]["state"], "succeeded");
    assert_eq!(shown["operation"]["idempotency_key"], key.as_str());
    let list = paste(&dev.line("ops list")).await;
    let list = String::from_utf8_lossy(&list.stdout);
    assert_eq!(list.lines().count(), 2, "one operation: {list}");
    assert!(list.contains(shown["operation"]["id"].as_str().unwrap()));
    assert!(dev.stop().success());
}

/// `--log-format json` (or its variable) still gives JSON, and `--log`
/// its level; the banner still comes first, the lines held until then
/// follow it.
#[test]
fn dev_logs_json_at_the_level_asked_for_after_its_banner() {
    let mut dev = Dev::start(&["--log-format", "json", "--log", "info"]);
    dev.assert_banner_first();
    let (serving, before) = dev.after_banner("\"serving\"");
    for line in before.iter().chain([&serving]) {
        let json: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(json["level"].is_string(), "{line}");
    }
    assert!(dev.stop().success());
}

#[tokio::test]
async fn ops_attach_says_what_to_do_next_and_exits_by_it() {
    let app = spawn_app(AppOptions::default().on(Ledger::Embedded)).await;
    let grpc = host_port(&app.grpc_url);
    let (server, volume) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    let (s, v) = (server.to_string(), volume.to_string());
    let attach = |key: &'static str, timeout: &'static str| {
        let (s, v, grpc) = (s.clone(), v.clone(), grpc.clone());
        async move {
            run(
                &[
                    "ops",
                    "attach",
                    "--server-id",
                    &s,
                    "--volume-id",
                    &v,
                    "--idempotency-key",
                    key,
                    "--timeout",
                    timeout,
                    "--server",
                    &grpc,
                ],
                &[],
            )
            .await
        }
    };
    // The response is lost and Nova cannot be asked: not known by the
    // deadline, worth asking again (75) with the same key.
    app.sim
        .add_fault(always(FaultOp::Attach, Fault::CloseAfterEffect));
    for op in [FaultOp::List, FaultOp::Show, FaultOp::Cinder] {
        app.sim.add_fault(always(
            op,
            Fault::Status {
                code: 500,
                effect: false,
            },
        ));
    }
    let r = attach("exit-1", "3s").await;
    assert_eq!(r.code, Some(75), "{}\n{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("OUTCOME_UNKNOWN")
            && r.stderr.contains("ask again with --idempotency-key exit-1")
            && r.stderr.contains("operation_id="),
        "{}",
        r.stderr
    );
    assert!(r.stdout.contains("state       unknown"), "{}", r.stdout);
    app.sim.clear_faults();
    // A server that is gone: a final answer (1), every ErrorInfo key said.
    app.sim.remove_server(server);
    // (Another volume: the first is still busy with the unknown attach,
    // which no reconciler of this app decides.)
    let v2 = uuid::Uuid::new_v4().to_string();
    let r = run(
        &[
            "ops",
            "attach",
            "--server-id",
            &s,
            "--volume-id",
            &v2,
            "--server",
            &grpc,
            "-o",
            "json",
        ],
        &[],
    )
    .await;
    assert_eq!(r.code, Some(1), "{}\n{}", r.stdout, r.stderr);
    let error: serde_json::Value = serde_json::from_str(r.stderr.lines().last().unwrap()).unwrap();
    assert_eq!(error["error"]["reason"], "NOVA_SERVER_NOT_FOUND", "{error}");
    for key in [
        "operation_id",
        "state",
        "server_id",
        "volume_id",
        "attempts",
    ] {
        assert!(
            error["error"]["metadata"][key].is_string(),
            "{key}: {error}"
        );
    }
    let shown: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(shown["operation"]["state"], "failed");
    // Nothing listens: unavailable, worth retrying (75).
    let refused = format!("127.0.0.1:{}", free_port());
    let r = run(&["ops", "list", "--server", &refused], &[]).await;
    assert_eq!(r.code, Some(75), "{}", r.stderr);
    // No such operation: final (1).
    let r = run(
        &[
            "ops",
            "show",
            &uuid::Uuid::new_v4().to_string(),
            "--server",
            &grpc,
        ],
        &[],
    )
    .await;
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    app.stop().await;
}
