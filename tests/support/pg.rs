//! A throwaway PostgreSQL for tests, without Docker. One cluster per test
//! binary (initdb is the slow part), one fresh database per test so tests
//! run in parallel. With `DATABASE_URL` set, that server is used instead.
//!
//! As root, initdb refuses to run, so the cluster runs as the `postgres`
//! user (uid/gid set on the child; no sudo needed). The server is spawned
//! from a thread that lives as long as the test process, with a parent-death
//! signal, so it never outlives the tests.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use sqlx::Connection;

static ADMIN_URL: OnceLock<Result<String, String>> = OnceLock::new();

fn find_bin_dir() -> Result<PathBuf, String> {
    if let Ok(dir) = std::env::var("PG_BIN") {
        return Ok(PathBuf::from(dir));
    }
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output()
        && out.status.success()
    {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if dir.join("initdb").exists() {
            return Ok(dir);
        }
    }
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        let mut dirs: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
            .filter(|p| p.join("initdb").exists())
            .collect();
        dirs.sort();
        if let Some(d) = dirs.pop() {
            return Ok(d);
        }
    }
    for dir in std::env::var("PATH").unwrap_or_default().split(':') {
        if Path::new(dir).join("initdb").exists() {
            return Ok(PathBuf::from(dir));
        }
    }
    Err(
        "PostgreSQL server binaries (initdb, postgres) were not found. Install them \
         (Debian: `apt-get install -y postgresql`), set PG_BIN to their directory, \
         or set DATABASE_URL to a server the tests may create databases on."
            .into(),
    )
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("local addr").port()
}

fn start_cluster() -> Result<String, String> {
    if let Ok(url) = std::env::var("DATABASE_URL") {
        return Ok(url);
    }
    let bin = find_bin_dir()?;
    let root = unsafe { libc::getuid() } == 0;
    let ids = if root {
        Some(volume_reconciler::cli::chaos::postgres::postgres_ids().map_err(|e| e.to_string())?)
    } else {
        None
    };
    let base = std::env::temp_dir();
    volume_reconciler::cli::chaos::postgres::sweep_old(&base, "vr-pg-");
    let dir = base.join(format!(
        "vr-pg-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let data = dir.join("data");
    if let Some((uid, gid)) = ids {
        std::os::unix::fs::chown(&dir, Some(uid), Some(gid))
            .map_err(|e| format!("chown {}: {e}", dir.display()))?;
    }
    volume_reconciler::cli::chaos::postgres::initdb(&bin, &data, ids).map_err(|e| e.to_string())?;
    let port = free_port();
    let spec = Spec {
        bin,
        ids,
        dir: dir.clone(),
        port,
    };
    let pid = spec.spawn()?;
    SPEC.set(spec)
        .map_err(|_| "the cluster was started twice".to_string())?;
    remove_at_exit(pid, dir);
    Ok(format!("postgres://postgres@127.0.0.1:{port}/postgres"))
}

/// How the cluster's server is started (again, after a crash).
struct Spec {
    bin: PathBuf,
    ids: Option<(u32, u32)>,
    dir: PathBuf,
    port: u16,
}

static SPEC: OnceLock<Spec> = OnceLock::new();

impl Spec {
    /// Starts the server on the cluster's data; its pid.
    fn spawn(&self) -> Result<u32, String> {
        let mut cmd = Command::new(self.bin.join("postgres"));
        cmd.arg("-D")
            .arg(self.dir.join("data"))
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(&self.dir)
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
                "-c",
                "max_connections=400",
                "-c",
                "shared_buffers=64MB",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(self.dir.join("server.log"))
                    .map_err(|e| e.to_string())?,
            );
        if let Some((uid, gid)) = self.ids {
            cmd.uid(uid).gid(gid);
        }
        unsafe {
            cmd.pre_exec(|| {
                // Immediate shutdown when the thread that spawned us (which
                // lives as long as the test process) goes away.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGQUIT);
                Ok(())
            });
        }
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let r = cmd.spawn().map_err(|e| format!("starting postgres: {e}"));
            let ok = r.is_ok();
            // The receiver waits for this message; it cannot be gone yet.
            drop(tx.send(r.map(|child| child.id())));
            if ok {
                loop {
                    std::thread::park();
                }
            }
        });
        rx.recv().map_err(|e| e.to_string())?
    }
}

/// Crashes the tests' PostgreSQL (an immediate shutdown: no checkpoint,
/// recovery from its WAL at the next start, as after a crash), waits for it
/// to be gone, and starts it again on the same data and port. For a
/// test that holds its binary's cluster alone (tests/whole_cluster).
pub fn crash_and_restart() {
    let spec = SPEC
        .get()
        .expect("the tests' own cluster (not DATABASE_URL)");
    let pid = CLUSTER_PID.load(std::sync::atomic::Ordering::SeqCst) as libc::pid_t;
    unsafe { libc::kill(pid, libc::SIGQUIT) };
    let mut status = 0;
    let gone = (0..200).any(|_| {
        let reaped = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } != 0;
        if !reaped {
            std::thread::sleep(Duration::from_millis(25));
        }
        reaped
    });
    assert!(gone, "PostgreSQL (pid {pid}) did not stop within 5 s");
    let pid = spec.spawn().expect("PostgreSQL starts again");
    CLUSTER_PID.store(pid, std::sync::atomic::Ordering::SeqCst);
}

/// The cluster's server's pid now (a restart changes it).
static CLUSTER_PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// The cluster this process started: its server's pid and its directory.
static CLUSTER: OnceLock<(u32, PathBuf)> = OnceLock::new();

/// At the test process's exit, stops the cluster and removes its
/// directory, so a test run leaves nothing in the temporary folder. Kept
/// for reading (its `server.log`) when the server had died on its own, or
/// with `VR_KEEP_PG=1`; a process killed outright leaves it too. Either
/// way `sweep_old` removes it at the next run.
fn remove_at_exit(pid: u32, dir: PathBuf) {
    extern "C" fn at_exit() {
        let Some((_, dir)) = CLUSTER.get() else {
            return;
        };
        let pid = CLUSTER_PID.load(std::sync::atomic::Ordering::SeqCst) as libc::pid_t;
        let mut status = 0;
        if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } != 0 {
            say(&format!(
                "the tests' PostgreSQL had stopped before the tests ended: its log is in {}",
                dir.join("server.log").display()
            ));
            return;
        }
        if std::env::var_os("VR_KEEP_PG").is_some_and(|v| v == "1") {
            say(&format!(
                "VR_KEEP_PG=1: the tests' PostgreSQL data is left in {}",
                dir.display()
            ));
            return;
        }
        unsafe { libc::kill(pid, libc::SIGQUIT) };
        // The server is this process's child: reaped here once it is gone
        // (an immediate shutdown takes milliseconds), at most 5 s.
        for _ in 0..100 {
            if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } != 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Best effort at exit: nobody is left to report a failure to, and a
        // leftover directory only costs disk space until the next sweep.
        drop(std::fs::remove_dir_all(dir));
    }
    /// A line on stderr; never a panic at exit (stderr may be closed, and
    /// there is nobody left to tell).
    fn say(line: &str) {
        use std::io::Write;
        drop(writeln!(std::io::stderr(), "{line}"));
    }
    CLUSTER_PID.store(pid, std::sync::atomic::Ordering::SeqCst);
    if CLUSTER.set((pid, dir)).is_ok() {
        unsafe { libc::atexit(at_exit) };
    }
}

/// The URL of a database of the cluster that tests may create databases on.
pub fn admin_url() -> String {
    match ADMIN_URL.get_or_init(start_cluster) {
        Ok(u) => u.clone(),
        Err(e) => panic!("no PostgreSQL for the tests: {e}"),
    }
}

/// A new, empty database for one test.
pub async fn fresh_database() -> String {
    let admin = admin_url();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut conn = loop {
        match sqlx::PgConnection::connect(&admin).await {
            Ok(c) => break c,
            Err(e) if tokio::time::Instant::now() < deadline => {
                tracing::debug!(error = %e, "waiting for the test cluster");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("the test PostgreSQL did not accept connections within 60s: {e}"),
        }
    };
    let name = format!("t_{}", uuid::Uuid::new_v4().simple());
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut conn)
        .await
        .expect("CREATE DATABASE");
    // Closing is best effort: the connection is not needed any more.
    drop(conn.close().await);
    let (base, _) = admin.rsplit_once('/').expect("URL has a database");
    format!("{base}/{name}")
}

/// A session on a test database beside the service's own, acting as an
/// administrator (or an outage) would: tests say what they do in SQL
/// without naming the driver.
pub struct Admin(sqlx::PgConnection);

impl Admin {
    pub async fn connect(url: &str) -> Admin {
        match sqlx::PgConnection::connect(url).await {
            Ok(c) => Admin(c),
            Err(e) => panic!("connecting to {url}: {e}"),
        }
    }

    /// Runs statements (several, `;`-separated, without parameters) and
    /// counts the rows they return.
    pub async fn run(&mut self, sql: &str) -> usize {
        match sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
            .fetch_all(&mut self.0)
            .await
        {
            Ok(rows) => rows.len(),
            Err(e) => panic!("{e}: {sql}"),
        }
    }

    /// The first column of every row a query returns, as text (cast it in
    /// the query when it is not).
    pub async fn texts(&mut self, sql: &str) -> Vec<String> {
        match sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string()))
            .fetch_all(&mut self.0)
            .await
        {
            Ok(v) => v,
            Err(e) => panic!("{e}: {sql}"),
        }
    }

    /// Runs a statement the database must refuse, and says how: its
    /// SQLSTATE and the constraint it named ('' when none).
    pub async fn refusal(&mut self, sql: &str) -> (String, String) {
        match sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
            .execute(&mut self.0)
            .await
        {
            Ok(_) => panic!("the database accepted: {sql}"),
            Err(sqlx::Error::Database(e)) => (
                e.code().map(|c| c.into_owned()).unwrap_or_default(),
                e.constraint().unwrap_or_default().to_string(),
            ),
            Err(e) => panic!("{e}: {sql}"),
        }
    }

    /// Sessions of this database waiting for a lock now.
    pub async fn waiting_on_locks(&mut self) -> i64 {
        self.number(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .await
    }

    /// The number a query returns (a `count(*)` and the like).
    pub async fn number(&mut self, sql: &str) -> i64 {
        match sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string()))
            .fetch_one(&mut self.0)
            .await
        {
            Ok(n) => n,
            Err(e) => panic!("{e}: {sql}"),
        }
    }
}
