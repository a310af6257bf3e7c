//! The command line in pipes: every command that prints ends quietly when
//! its reader is gone (`ops list | head -1`), with exit 0 and nothing on
//! stderr, instead of panicking with "failed printing to stdout".

use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Command, Stdio};

use super::{BIN, host_port, run};
use crate::support::{AppOptions, Ledger, spawn_app};

/// Runs the binary with a stdout whose reader closed before it started:
/// its first write meets EPIPE, every time (a reader that is merely slow
/// to go, as `head -1` is, would make the test a race).
async fn run_into_closed_pipe(args: Vec<String>) -> std::process::Output {
    tokio::task::spawn_blocking(move || {
        let mut fds = [0; 2];
        // SAFETY: pipe(2) fills both descriptors or fails; both are owned
        // below and closed exactly once.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0, "pipe(2)");
        let (reader, writer) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        drop(reader);
        Command::new(BIN)
            .args(&args)
            .env_remove("VOLUME_RECONCILER_SERVER")
            .stdout(Stdio::from(writer))
            .stderr(Stdio::piped())
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn every_command_that_prints_ends_quietly_when_its_reader_is_gone() {
    let app = spawn_app(AppOptions::default().on(Ledger::Embedded)).await;
    let (server, volume) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    let op = app
        .client
        .attach(
            "pipe-1",
            &server.to_string(),
            &volume.to_string(),
            Default::default(),
            std::time::Duration::from_secs(30),
        )
        .await
        .expect("the attach succeeds");
    let grpc = host_port(&app.grpc_url);
    let with_server = |args: &[&str]| {
        let mut v: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        v.extend(["--server".to_string(), grpc.clone()]);
        v
    };
    let commands: Vec<Vec<String>> = vec![
        with_server(&["ops", "list"]),
        with_server(&["ops", "list", "-o", "json"]),
        with_server(&["ops", "list", "-o", "yaml"]),
        with_server(&["ops", "list", "-o", "name"]),
        with_server(&["ops", "show", &op.id]),
        with_server(&["ops", "show", &op.id, "-o", "wide"]),
        with_server(&["ops", "stats"]),
        with_server(&["ops", "watch", &op.id]),
        with_server(&[
            "ops",
            "detach",
            "--server-id",
            &server.to_string(),
            "--volume-id",
            &volume.to_string(),
            "--idempotency-key",
            "pipe-2",
        ]),
        vec!["completions".into(), "bash".into()],
        vec!["man".into()],
        vec!["config".into(), "show".into()],
        vec!["config".into(), "show".into(), "-o".into(), "json".into()],
        vec!["bench".into(), "pgbench-script".into()],
        vec!["--help".into()],
    ];
    for args in commands {
        let out = run_into_closed_pipe(args.clone()).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && stderr.is_empty(),
            "{args:?} into a closed pipe: {:?}, stderr:\n{stderr}",
            out.status
        );
    }
    // And as people write it: `set -o pipefail; ops list | head -1` is
    // the header line and success.
    let line = format!("set -o pipefail; '{BIN}' ops list --server {grpc} | head -1");
    let out = tokio::task::spawn_blocking(move || {
        Command::new("bash").args(["-c", &line]).output().unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "{:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .trim_start()
            .starts_with("ID ")
    );
    // Errors still fail: only a closed stdout is quiet.
    let r = run(&["ops", "show", "no-such-id", "--server", &grpc], &[]).await;
    assert!(!r.ok, "{}", r.stdout);
    app.stop().await;
}
