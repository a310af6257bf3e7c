//! Starting up, through the real binary where what an operator sees is the
//! point: a database that comes up late is waited for (and said so), one
//! that never comes up ends the start with its last error, one that
//! refuses for good is not waited for; Nova's settings are checked at start
//! against the flags and against Nova's own version document; a Nova that
//! refuses connections for a caller's whole budget is reported as
//! unreachable and recorded as failed.

use crate::support;

use std::net::SocketAddr;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use tokio::time::Instant;

const BIN: &str = env!("CARGO_BIN_EXE_volume-reconciler");

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// A log file of its own for each process a test starts.
fn log_file(name: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "vr-startup-{name}-{}.log",
        uuid::Uuid::new_v4().simple()
    ))
}

/// The binary with human logs at `info`, whatever the caller's environment.
fn command(args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(args)
        .env_remove("DATABASE_URL")
        .env("VOLUME_RECONCILER_LOG", "info")
        .env("VOLUME_RECONCILER_LOG_FORMAT", "human")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null());
    c
}

/// Runs the binary to its end, killing it after a minute (a start that
/// should have failed and serves instead must not hang the test).
async fn run(mut c: Command) -> (Output, Duration) {
    let started = Instant::now();
    let (out_path, err_path) = (log_file("stdout"), log_file("stderr"));
    let mut child = c
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .expect("the binary runs");
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if started.elapsed() > Duration::from_secs(60) {
            // Test cleanup: the assertions report what it printed.
            drop(child.kill());
            break child.wait().expect("wait");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let took = started.elapsed();
    let out = Output {
        status,
        stdout: std::fs::read(&out_path).unwrap_or_default(),
        stderr: std::fs::read(&err_path).unwrap_or_default(),
    };
    (out, took)
}

/// `url` with its host and port replaced by `addr`.
fn at(url: &str, addr: SocketAddr) -> String {
    let mut u = reqwest::Url::parse(url).expect("a database URL");
    u.set_host(Some(&addr.ip().to_string())).unwrap();
    u.set_port(Some(addr.port())).unwrap();
    u.to_string()
}

/// The host and port `url` names.
fn addr_of(url: &str) -> String {
    let u = reqwest::Url::parse(url).expect("a database URL");
    format!(
        "{}:{}",
        u.host_str().expect("a host"),
        u.port().unwrap_or(5432)
    )
}

/// From `at` on, forwards every connection to `upstream`: a PostgreSQL
/// that is down until then (connections refused), then the real server.
async fn forward_from(addr: SocketAddr, upstream: String, at: Instant) {
    tokio::time::sleep_until(at).await;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .expect("the late database's port is still free");
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let upstream = upstream.clone();
            tokio::spawn(async move {
                match tokio::net::TcpStream::connect(&upstream).await {
                    Ok(mut server) => {
                        // Either side closing ends the relay; how is no matter.
                        drop(tokio::io::copy_bidirectional(&mut client, &mut server).await);
                    }
                    Err(e) => eprintln!("forwarder: cannot reach {upstream}: {e}"),
                }
            });
        }
    });
}

struct Served {
    child: Child,
    log: std::path::PathBuf,
}

impl Served {
    fn start(args: &[&str], name: &str) -> Served {
        let log = log_file(name);
        let child = command(args)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("the binary starts");
        Served { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, then the exit status.
    async fn stop(mut self) -> std::process::ExitStatus {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let mut child = std::mem::replace(
            &mut self.child,
            Command::new("true").spawn().expect("a placeholder"),
        );
        tokio::task::spawn_blocking(move || child.wait().expect("wait"))
            .await
            .unwrap()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        // Test cleanup: the process may be gone already.
        drop(self.child.kill());
        drop(self.child.wait());
    }
}

/// Whether the admin endpoint answers ready (a short bound per try: the
/// listener is bound before the service serves it).
async fn ready(admin: SocketAddr) -> bool {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    matches!(
        client.get(format!("http://{admin}/readyz")).send().await,
        Ok(r) if r.status() == 200
    )
}

#[tokio::test]
async fn serve_waits_for_a_database_that_comes_up_10_s_late_and_says_so() {
    support::init_logs();
    let db = support::pg::fresh_database().await;
    let late = free_addr();
    let sim = volume_reconciler::sim::start(
        "127.0.0.1:0".parse().unwrap(),
        volume_reconciler::sim::SimConfig::default(),
    )
    .await
    .unwrap();
    let (grpc, admin) = (free_addr(), free_addr());
    let started = Instant::now();
    let served = Served::start(
        &[
            "serve",
            "--listen",
            &grpc.to_string(),
            "--admin-listen",
            &admin.to_string(),
            "--database-url",
            &at(&db, late),
            "--nova-url",
            &sim.nova_url,
            "--shutdown-delay",
            "0s",
        ],
        "late-db",
    );
    let waiting = format!("waiting for PostgreSQL at {late} (connection refused)");
    support::eventually(
        Duration::from_secs(10),
        "the wait is logged twice",
        || async { served.log().matches(&waiting).count() >= 2 },
    )
    .await;
    // The scenario: the database appears 10 s after the service started.
    forward_from(late, addr_of(&db), started + Duration::from_secs(10)).await;
    support::eventually(
        Duration::from_secs(40),
        "the service is ready once the database is up",
        || ready(admin),
    )
    .await;
    let log = served.log();
    assert!(
        started.elapsed() >= Duration::from_secs(10),
        "not ready before the database was up"
    );
    assert!(
        log.matches(&waiting).count() >= 3,
        "a line every few seconds while waiting:\n{log}"
    );
    assert!(
        log.contains(&format!("PostgreSQL at {late} accepts connections")),
        "{log}"
    );
    // It serves: an attach goes through and is recorded.
    let client =
        volume_reconciler::client::Client::connect_lazy(&format!("http://{grpc}")).unwrap();
    let (s, v) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    let op = client
        .attach(
            "late-db-1",
            &s.to_string(),
            &v.to_string(),
            volume_reconciler::client::AttachOptions::default(),
            Duration::from_secs(10),
        )
        .await
        .expect("an attach through the late database");
    assert_eq!(
        op.state,
        volume_reconciler::grpc::pb::State::Succeeded as i32
    );
    assert_eq!(sim.sim.attach_effects(v), 1);
    let mut admin_db = support::pg::Admin::connect(&db).await;
    assert_eq!(
        admin_db
            .number("SELECT count(*) FROM operations WHERE idempotency_key = 'late-db-1' AND state = 'succeeded'")
            .await,
        1
    );
    assert!(served.stop().await.success());
    sim.stop().await;
}

#[tokio::test]
async fn migrate_and_serve_give_up_on_a_database_that_never_comes_up() {
    let never = free_addr();
    let url = format!("postgres://postgres@{never}/postgres");
    let waiting = format!("waiting for PostgreSQL at {never} (connection refused)");
    let (admin, grpc) = (free_addr(), free_addr());
    for args in [
        vec![
            "migrate",
            "--database-url",
            &url,
            "--db-connect-timeout",
            "3s",
        ],
        vec![
            "serve",
            "--database-url",
            &url,
            "--db-connect-timeout",
            "3s",
            "--nova-url",
            "http://127.0.0.1:9/v2.1",
            "--listen",
            &grpc.to_string(),
            "--admin-listen",
            &admin.to_string(),
        ],
    ] {
        let (out, took) = run(command(&args)).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{} must fail:\n{stderr}", args[0]);
        assert!(
            took >= Duration::from_secs(3) && took < Duration::from_secs(30),
            "{} gave up after {took:?}",
            args[0]
        );
        assert!(stderr.contains(&waiting), "{}:\n{stderr}", args[0]);
        for needle in [
            "did not accept connections within 3s",
            "last error: connection refused",
            "--db-connect-timeout",
        ] {
            assert!(
                stderr.contains(needle),
                "{} names {needle:?}:\n{stderr}",
                args[0]
            );
        }
    }
}

#[tokio::test]
async fn a_database_that_refuses_for_good_is_not_waited_for() {
    support::init_logs();
    let db = support::pg::fresh_database().await;
    let (base, _) = db.rsplit_once('/').unwrap();
    let missing = format!("{base}/no_such_database_here");
    let (out, took) = run(command(&["migrate", "--database-url", &missing])).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        took < Duration::from_secs(20),
        "no wait for an answer waiting cannot change ({took:?})"
    );
    assert!(stderr.contains("no_such_database_here"), "{stderr}");
    assert!(!stderr.contains("waiting for PostgreSQL"), "{stderr}");
    // The database that exists is migrated.
    let (out, _) = run(command(&["migrate", "--database-url", &db])).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn migrate_says_what_it_applied_or_that_the_ledger_is_up_to_date_and_status_names_unknown_ones()
 {
    support::init_logs();
    let db = support::pg::fresh_database().await;
    let known = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/pg"))
        .unwrap()
        .count();
    let migrate = |args: &[&str]| {
        let mut all = vec!["migrate"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--database-url", &db]);
        run(command(&all))
    };
    let text = |b: &[u8]| String::from_utf8_lossy(b).to_string();
    let (out, _) = migrate(&["status"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).ends_with(&format!(
            "0 applied, {known} pending, 0 unknown to this build\n"
        )),
        "{}",
        text(&out.stdout)
    );
    // The first run applies every migration and names each.
    let (out, _) = migrate(&[]).await;
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        stdout
            .lines()
            .filter(|l| l.starts_with("applied 2"))
            .count(),
        known,
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("{known} migration(s) applied")),
        "{stdout}"
    );
    // The second has nothing to do, and says so.
    let (out, _) = migrate(&[]).await;
    let stdout = text(&out.stdout);
    assert!(
        stdout.starts_with("the ledger is up to date: nothing to apply"),
        "{stdout}"
    );
    assert!(!stdout.contains("applied 2"), "{stdout}");
    // A later release's migration: reported, and warned of.
    let mut admin = support::pg::Admin::connect(&db).await;
    admin
        .run(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
             VALUES (29991231000001, 'from a later release', true, '\\x00', 0)",
        )
        .await;
    let (out, _) = migrate(&["status"]).await;
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("unknown  29991231000001  from a later release"),
        "{stdout}"
    );
    // The report names it; no warning says it again.
    assert_eq!(stdout.matches("29991231000001").count(), 1, "{stdout}");
    assert!(
        !text(&out.stderr).contains("29991231000001"),
        "{}",
        text(&out.stderr)
    );
    assert!(
        stdout.ends_with(&format!(
            "{known} applied, 0 pending, 1 unknown to this build\n"
        )),
        "{stdout}"
    );
    let (out, _) = migrate(&[]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("1 migration(s) this build does not know"),
        "{stderr}"
    );
    // Warned once, naming it once.
    assert_eq!(stderr.matches("does not know").count(), 1, "{stderr}");
    assert_eq!(stderr.matches("29991231000001").count(), 1, "{stderr}");
    assert!(text(&out.stdout).starts_with("the ledger is up to date"));
}

/// A database file of its own, for starts whose subject is not the ledger.
fn sqlite_url() -> String {
    format!(
        "sqlite://{}",
        std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("vr-startup-{}.db", uuid::Uuid::new_v4().simple()))
            .display()
    )
}

#[tokio::test]
async fn invalid_nova_settings_stop_the_start_naming_the_flag() {
    let sim = volume_reconciler::sim::start(
        "127.0.0.1:0".parse().unwrap(),
        volume_reconciler::sim::SimConfig::default(),
    )
    .await
    .unwrap();
    let dead = free_addr();
    let (grpc, admin) = (free_addr(), free_addr());
    let serve = |nova_url: &str, extra: &[&str]| {
        let mut args: Vec<String> = [
            "serve",
            "--database-url",
            &sqlite_url(),
            "--listen",
            &grpc.to_string(),
            "--admin-listen",
            &admin.to_string(),
            "--nova-url",
            nova_url,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    let cases: Vec<(Vec<String>, &[&str])> = vec![
        (serve("ftp://x", &[]), &["--nova-url", "ftp"]),
        (serve("http://", &[]), &["--nova-url"]),
        (
            serve(&sim.nova_url, &["--nova-microversion", "banana"]),
            &["--nova-microversion", "banana", "2.N"],
        ),
        // Well-formed, but more than this Nova supports.
        (
            serve(&sim.nova_url, &["--nova-microversion", "2.200"]),
            &["--nova-microversion", "2.200", "2.1 to 2.104"],
        ),
        // `latest` needs the version document.
        (
            serve(
                &format!("http://{dead}/v2.1"),
                &["--nova-microversion", "latest"],
            ),
            &[
                "--nova-microversion latest",
                "version document",
                "onnection refused",
            ],
        ),
    ];
    for (args, needles) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (out, took) = run(command(&args)).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} must not start:\n{stderr}");
        assert!(took < Duration::from_secs(30), "{args:?} took {took:?}");
        for needle in needles {
            assert!(
                stderr.contains(needle),
                "{args:?}: no {needle:?} in:\n{stderr}"
            );
        }
    }
    // The same check applies to the environment variable.
    let mut c = command(&["serve", "--database-url", &sqlite_url()]);
    c.env("VOLUME_RECONCILER_NOVA_URL", "ftp://x");
    let (out, _) = run(c).await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--nova-url"));
    sim.stop().await;
}

/// A settle or verification window past chrono's range was read as 0 —
/// "decide at once" — by a `serve` that started; it must not start, and
/// must say which flag (and its environment variable) is wrong.
#[tokio::test]
async fn an_out_of_range_window_stops_the_start_naming_the_flag() {
    let (grpc, admin) = (free_addr(), free_addr());
    let base = [
        "serve",
        "--database-url",
        &sqlite_url(),
        "--listen",
        &grpc.to_string(),
        "--admin-listen",
        &admin.to_string(),
        "--nova-url",
        "http://127.0.0.1:9/v2.1",
    ]
    .map(str::to_string);
    for (flag, env) in [
        (
            "--settle-window-detach",
            "VOLUME_RECONCILER_SETTLE_WINDOW_DETACH",
        ),
        ("--verify-window", "VOLUME_RECONCILER_VERIFY_WINDOW"),
    ] {
        let mut args: Vec<&str> = base.iter().map(String::as_str).collect();
        args.extend([flag, "600000000years"]);
        let mut by_env = command(&base.iter().map(String::as_str).collect::<Vec<_>>());
        by_env.env(env, "600000000years");
        for c in [command(&args), by_env] {
            let (out, took) = run(c).await;
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{flag} must not start:\n{stderr}");
            assert!(took < Duration::from_secs(30), "{flag}: took {took:?}");
            assert!(
                stderr.contains(&format!("{flag} (")) && stderr.contains("must be at most"),
                "{flag}: not named in:\n{stderr}"
            );
        }
    }
}

#[tokio::test]
async fn latest_resolves_to_the_clouds_maximum_from_its_version_document() {
    let app =
        support::spawn_app(support::AppOptions::default().arg("--nova-microversion", "latest"))
            .await;
    assert_eq!(
        app.exec.nova_microversion(),
        "2.104",
        "the simulator's maximum"
    );
    assert_eq!(
        nova_reachable(&app.admin_url).await,
        Some(1),
        "the version document came: Nova is reachable"
    );
    let (s, v) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    let op = app
        .raw()
        .attach_volume(support::with_timeout(
            volume_reconciler::grpc::pb::AttachVolumeRequest {
                idempotency_key: "latest-1".into(),
                server_id: s.to_string(),
                volume_id: v.to_string(),
                ..Default::default()
            },
            Duration::from_secs(10),
        ))
        .await
        .unwrap()
        .into_inner();
    // From 2.101 an attach is answered 202 and only the list tells.
    assert_eq!(
        (op.state, op.resolution),
        (
            volume_reconciler::grpc::pb::State::Succeeded as i32,
            volume_reconciler::grpc::pb::Resolution::Reobserved as i32
        )
    );
    assert_eq!(app.sim.attach_effects(v), 1);
    app.stop().await;
}

/// The `volume_reconciler_nova_reachable` gauge as `/metrics` shows it.
async fn nova_reachable(admin_url: &str) -> Option<i64> {
    let text = reqwest::get(format!("{admin_url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix("volume_reconciler_nova_reachable "))
        .map(|v| v.trim().parse().expect("a number"))
}

#[tokio::test]
async fn a_nova_refusing_connections_for_the_whole_budget_is_unreachable_and_the_operation_failed()
{
    let nova = free_addr();
    // Nobody listens: starting is a warning, not a crash.
    let app = support::spawn_app(support::AppOptions {
        nova_url: Some(format!("http://{nova}/v2.1")),
        ..Default::default()
    })
    .await;
    assert_eq!(nova_reachable(&app.admin_url).await, Some(0));
    let (s, v) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    let started = Instant::now();
    let err = app
        .raw()
        .attach_volume(support::with_timeout(
            volume_reconciler::grpc::pb::AttachVolumeRequest {
                idempotency_key: "refused-all-along".into(),
                server_id: s.to_string(),
                volume_id: v.to_string(),
                ..Default::default()
            },
            Duration::from_secs(3),
        ))
        .await
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "answered within the deadline"
    );
    let (reason, meta) = support::error_info(&err);
    assert_eq!(
        (err.code(), reason.as_str()),
        (tonic::Code::Unavailable, "NOVA_UNREACHABLE"),
        "a request provably never sent is not an unknown outcome: {err:?}"
    );
    assert_eq!(
        meta.get("error_class").map(String::as_str),
        Some("connect_failed"),
        "{meta:?}"
    );
    let op = app
        .store
        .operation_get_by_key(&crate::support::ck(None, "refused-all-along"))
        .await
        .unwrap()
        .expect("recorded");
    assert_eq!(op.state, volume_reconciler::domain::State::Failed, "{op:?}");
    assert_eq!(
        op.last_error.as_ref().map(|e| e.reason.as_str()),
        Some("NOVA_UNREACHABLE"),
        "{op:?}"
    );
    assert!(
        op.attempts >= 2,
        "retried while the budget allowed: {}",
        op.attempts
    );
    // Nova comes up: the next request reaches it and the gauge says so.
    let h = volume_reconciler::sim::start(nova, volume_reconciler::sim::SimConfig::default())
        .await
        .unwrap();
    let w = uuid::Uuid::new_v4();
    let op = app
        .raw()
        .attach_volume(support::with_timeout(
            volume_reconciler::grpc::pb::AttachVolumeRequest {
                idempotency_key: "after-the-outage".into(),
                server_id: s.to_string(),
                volume_id: w.to_string(),
                ..Default::default()
            },
            Duration::from_secs(10),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        op.state,
        volume_reconciler::grpc::pb::State::Succeeded as i32
    );
    assert_eq!(
        h.sim.attach_effects(v),
        0,
        "the refused one never reached Nova"
    );
    assert_eq!(h.sim.attach_effects(w), 1);
    assert_eq!(nova_reachable(&app.admin_url).await, Some(1));
    // And goes away again: the next refused connection says so.
    h.stop().await;
    let gone = app
        .raw()
        .attach_volume(support::with_timeout(
            volume_reconciler::grpc::pb::AttachVolumeRequest {
                idempotency_key: "nova-gone-again".into(),
                server_id: s.to_string(),
                volume_id: uuid::Uuid::new_v4().to_string(),
                ..Default::default()
            },
            Duration::from_secs(2),
        ))
        .await;
    assert!(gone.is_err(), "{gone:?}");
    assert_eq!(nova_reachable(&app.admin_url).await, Some(0));
    app.stop().await;
}
