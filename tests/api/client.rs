//! The Rust client against the real server: keyed retries absorb transport
//! failures within the caller's deadline, and never outlive it.

use crate::support;

use std::sync::Mutex;
use std::time::Duration;

use support::{AppOptions, eventually, spawn_app, uuid};
use tokio::time::Instant;
use tonic::Code;
use volume_reconciler::client::{Client, RetryStats};

fn free_addr() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

#[tokio::test]
async fn a_call_made_before_the_server_is_up_is_retried_with_its_key_until_it_lands() {
    support::init_logs();
    let addr = free_addr();
    let client = Client::connect_lazy(&format!("http://{addr}")).unwrap();
    let stats = std::sync::Arc::new(Mutex::new(RetryStats::default()));
    let (s, v) = (uuid(), uuid());
    let call = tokio::spawn({
        let (client, stats, s, v) = (client.clone(), stats.clone(), s.clone(), v.clone());
        async move {
            client
                .attach_counted("early-1", &s, &v, Duration::from_secs(30), &stats)
                .await
        }
    });
    // Nothing listens yet: the call fails to connect and pauses, again and again.
    eventually(
        Duration::from_secs(10),
        "a refused connection is retried",
        || {
            let stats = stats.clone();
            async move { stats.lock().unwrap().retries >= 2 }
        },
    )
    .await;
    let app = spawn_app(AppOptions::default().arg("--listen", &addr.to_string())).await;
    let op = call.await.unwrap().expect("the retried call lands");
    let retries = stats.lock().unwrap().clone();
    assert!(
        retries.by_code.get("UNAVAILABLE").copied().unwrap_or(0) >= 2,
        "{retries:?}"
    );
    let row = app
        .store
        .operation_get_by_key(&crate::support::ck(None, "early-1"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.id.to_string(), op.id, "one operation for the key");
    assert_eq!(app.sim.attach_effects(v.parse().unwrap()), 1);
    app.stop().await;
}

#[tokio::test]
async fn retries_stop_at_the_callers_deadline() {
    let (_refusing, addr) = support::refusing_port();
    let client = Client::connect_lazy(&format!("http://{addr}")).unwrap();
    let started = Instant::now();
    let err = client
        .attach(
            "late-1",
            &uuid(),
            &uuid(),
            Default::default(),
            Duration::from_millis(600),
        )
        .await
        .unwrap_err();
    let took = started.elapsed();
    assert!(
        matches!(err.code, Code::Unavailable | Code::DeadlineExceeded),
        "{err}"
    );
    assert!(err.retries >= 1, "it did retry: {err}");
    // Wide margin for a loaded machine, but never long past the deadline.
    assert!(took < Duration::from_secs(3), "took {took:?}");
}

// ---- client options: bearer tokens and mutual TLS, for the Rust client
// and for the `ops` binary (the same options) ----

const BIN: &str = env!("CARGO_BIN_EXE_volume-reconciler");

fn tokens_flag() -> String {
    use volume_reconciler::grpc::auth::sha256_hex;
    format!(
        "ci:orchestrator:{},alice:operator:{}",
        sha256_hex("orch-token-1"),
        sha256_hex("oper-token-1")
    )
}

fn host_port(app: &support::TestApp) -> String {
    app.grpc_url.trim_start_matches("http://").to_string()
}

/// Runs the binary with a clean environment of its own settings.
async fn cli(args: Vec<String>, envs: Vec<(&'static str, String)>) -> (bool, String, String) {
    tokio::task::spawn_blocking(move || {
        let mut cmd = std::process::Command::new(BIN);
        cmd.args(&args);
        for (k, _) in std::env::vars() {
            if k.starts_with("VOLUME_RECONCILER_") {
                cmd.env_remove(k);
            }
        }
        cmd.envs(envs);
        let out = cmd.output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    })
    .await
    .unwrap()
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

#[tokio::test]
async fn the_rust_client_sends_its_token_and_the_ledger_names_the_caller() {
    let app = spawn_app(AppOptions::default().arg("--auth-tokens", &tokens_flag())).await;
    let opts = |token: Option<&str>| volume_reconciler::client::ConnectOptions {
        server: host_port(&app),
        token: token.map(str::to_string),
        tls: None,
    };
    let client = Client::connect(&opts(Some("orch-token-1"))).unwrap();
    let (s, v) = (uuid(), uuid());
    let op = client
        .attach("tok-1", &s, &v, Default::default(), Duration::from_secs(10))
        .await
        .expect("a caller with a token is served");
    assert_eq!(op.caller, "ci");
    let row = app
        .store
        .operation_get_by_key(&crate::support::ck(Some("ci"), "tok-1"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.caller.as_deref(), Some("ci"));
    assert_eq!(app.sim.attach_effects(v.parse().unwrap()), 1);

    let anonymous = Client::connect(&opts(None)).unwrap();
    let err = anonymous
        .attach(
            "tok-2",
            &uuid(),
            &uuid(),
            Default::default(),
            Duration::from_secs(10),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code, Code::Unauthenticated, "{err}");
    let wrong = Client::connect(&opts(Some("not-a-token"))).unwrap();
    let err = wrong
        .detach("tok-3", &s, &v, Duration::from_secs(10))
        .await
        .unwrap_err();
    assert_eq!(err.code, Code::Unauthenticated, "{err}");
    assert!(
        app.store
            .operation_get_by_key(&crate::support::ck(None, "tok-2"))
            .await
            .unwrap()
            .is_none()
    );
    app.stop().await;
}

#[tokio::test]
async fn the_rust_client_attaches_over_mutual_tls() {
    let pki = support::pki::Pki::new();
    let app = spawn_app(pki.server_flags(AppOptions::default())).await;
    let tls = |with_identity: bool| {
        volume_reconciler::client::ClientTls::from_files(
            Some(pki.server_ca.as_ref()),
            with_identity.then_some(pki.client_cert.as_ref()),
            with_identity.then_some(pki.client_key.as_ref()),
        )
        .unwrap()
    };
    // No scheme: TLS because TLS options are given; the server's
    // certificate names 127.0.0.1.
    let client = Client::connect(&volume_reconciler::client::ConnectOptions {
        server: host_port(&app),
        token: None,
        tls: Some(tls(true)),
    })
    .unwrap();
    let v = uuid();
    let op = client
        .attach(
            "mtls-1",
            &uuid(),
            &v,
            Default::default(),
            Duration::from_secs(10),
        )
        .await
        .expect("a client with a certificate from the CA is served");
    assert_eq!(op.idempotency_key, "mtls-1");
    assert_eq!(app.sim.attach_effects(v.parse().unwrap()), 1);

    let no_cert = Client::connect(&volume_reconciler::client::ConnectOptions {
        server: format!("https://{}", host_port(&app)),
        token: None,
        tls: Some(tls(false)),
    })
    .unwrap();
    let err = no_cert
        .attach(
            "mtls-2",
            &uuid(),
            &uuid(),
            Default::default(),
            Duration::from_secs(3),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(
            err.code,
            Code::Unavailable | Code::DeadlineExceeded | Code::Unknown
        ),
        "refused at the handshake: {err}"
    );
    assert!(
        app.store
            .operation_get_by_key(&crate::support::ck(None, "mtls-2"))
            .await
            .unwrap()
            .is_none()
    );
    app.stop().await;
}

#[tokio::test]
async fn ops_takes_a_token_from_a_flag_a_file_or_the_environment_and_pages_with_a_caller_column() {
    let app = spawn_app(AppOptions::default().arg("--auth-tokens", &tokens_flag())).await;
    let server = host_port(&app);
    let client = Client::connect(&volume_reconciler::client::ConnectOptions {
        server: server.clone(),
        token: Some("orch-token-1".into()),
        tls: None,
    })
    .unwrap();
    for i in 0..5 {
        client
            .attach(
                &format!("page-{i}"),
                &uuid(),
                &uuid(),
                Default::default(),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
    }
    let token_file = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("vr-token-{}", uuid::Uuid::new_v4().simple()));
    std::fs::write(&token_file, "oper-token-1\n").unwrap();
    let list = |extra: &[&str]| {
        let mut a = strings(&["ops", "list", "--server", &server]);
        a.extend(strings(extra));
        a
    };

    // Flag: the first page of two, with the caller and where to go on.
    let (ok, out, err) = cli(list(&["--token", "oper-token-1", "--limit", "2"]), vec![]).await;
    assert!(ok, "{err}");
    let header = out.lines().next().unwrap();
    assert!(header.contains("CALLER"), "{out}");
    let rows: Vec<&str> = out
        .lines()
        .skip(1)
        .filter(|l| l.contains("attach"))
        .collect();
    assert_eq!(rows.len(), 2, "{out}");
    assert!(
        rows.iter().all(|r| r.split_whitespace().any(|w| w == "ci")),
        "{out}"
    );
    let next = out
        .lines()
        .find_map(|l| l.strip_prefix("more: --page-token "))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_else(|| panic!("no next page in:\n{out}"))
        .to_string();

    // File: the page after it.
    let file = token_file.to_string_lossy().to_string();
    let (ok, out, err) = cli(
        list(&["--token-file", &file, "--limit", "2", "--page-token", &next]),
        vec![],
    )
    .await;
    assert!(ok, "{err}");
    let second: Vec<&str> = out.lines().filter(|l| l.contains("attach")).collect();
    assert_eq!(second.len(), 2, "{out}");
    assert!(
        second.iter().all(|r| !rows.contains(r)),
        "a new page:\n{out}"
    );

    // Environment: every page, as JSON with RFC 3339 timestamps.
    let (ok, out, err) = cli(
        list(&["--all", "--limit", "2", "--output", "json"]),
        vec![("VOLUME_RECONCILER_TOKEN", "orch-token-1".to_string())],
    )
    .await;
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let ops = v["operations"].as_array().unwrap();
    assert_eq!(ops.len(), 5, "{out}");
    assert_eq!(v["next_page_token"], "");
    let created = ops[0]["created_at"].as_str().unwrap();
    chrono::DateTime::parse_from_rfc3339(created).unwrap_or_else(|e| panic!("{created}: {e}"));
    assert!(created.ends_with('Z'), "{created}");
    assert_eq!(ops[0]["caller"], "ci");
    assert!(err.is_empty(), "nothing on stderr: {err}");

    // No token: one readable line; JSON only when asked for.
    let (ok, out, err) = cli(list(&[]), vec![]).await;
    assert!(!ok && out.is_empty());
    assert_eq!(err.lines().count(), 1, "printed once:\n{err}");
    assert!(
        err.starts_with("error: ") && err.contains("UNAUTHENTICATED"),
        "{err}"
    );
    assert!(!err.contains('{'), "not JSON: {err}");
    let (ok, _, err) = cli(list(&["--output", "json"]), vec![]).await;
    assert!(!ok);
    let e: serde_json::Value =
        serde_json::from_str(err.trim()).unwrap_or_else(|_| panic!("JSON: {err}"));
    assert_eq!(e["error"]["code"], "UNAUTHENTICATED", "{err}");
    let (ok, _, err) = cli(list(&["--token", "x", "--token-file", &file]), vec![]).await;
    assert!(!ok && err.contains("--token-file"), "{err}");
    std::fs::remove_file(&token_file).unwrap();
    app.stop().await;
}

#[tokio::test]
async fn ops_talks_mutual_tls_with_a_ca_and_a_client_certificate() {
    let pki = support::pki::Pki::new();
    let app = spawn_app(pki.server_flags(AppOptions::default())).await;
    let server = host_port(&app);
    let tls = strings(&[
        "--ca",
        &pki.server_ca,
        "--cert",
        &pki.client_cert,
        "--key",
        &pki.client_key,
    ]);
    for target in [server.clone(), format!("https://{server}")] {
        let mut args = strings(&["ops", "list", "--output", "json", "--server", &target]);
        args.extend(tls.clone());
        let (ok, out, err) = cli(args, vec![]).await;
        assert!(ok, "{target}: {err}");
        let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
        assert!(v["operations"].is_array(), "{out}");
    }
    // Without the client certificate the handshake is refused: one error line.
    let (ok, _, err) = cli(
        strings(&[
            "ops",
            "list",
            "--timeout",
            "5s",
            "--server",
            &server,
            "--ca",
            &pki.server_ca,
        ]),
        vec![],
    )
    .await;
    assert!(
        !ok && err.lines().count() == 1 && err.starts_with("error: "),
        "{err}"
    );
    // TLS options with an http:// server are a usage error, not a hang.
    let mut args = strings(&["ops", "list", "--server", &format!("http://{server}")]);
    args.extend(tls);
    let (ok, _, err) = cli(args, vec![]).await;
    assert!(!ok && err.contains("https://"), "{err}");
    app.stop().await;
}
