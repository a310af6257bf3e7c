//! A throwaway PostgreSQL cluster of chaos's own, so that it can crash the
//! server and restart it (a server named by `--database-url` is somebody
//! else's: its connections can be faulted, not its process). The same way
//! as the tests' harness (`tests/support/pg.rs`, which a binary cannot
//! share): initdb and the postmaster run as the `postgres` user when
//! chaos runs as root (initdb refuses root), from the binaries in
//! `--postgres-bin`, `PG_BIN`, `pg_config --bindir`,
//! `/usr/lib/postgresql/*/bin` or `PATH`, under a temporary folder removed
//! at the end.
//!
//! The postmaster is spawned, crashed and reaped by one thread that lives
//! as long as the cluster, with a parent-death signal: if chaos itself is
//! killed, the server stops too (`PR_SET_PDEATHSIG` fires when the thread
//! that spawned the child ends).
//!
//! Durability: `fsync` and `full_page_writes` are off (a crash here is the
//! process's, never the machine's: what was written stays in the page
//! cache), but `synchronous_commit` stays on: with it off, a commit is
//! acknowledged before its WAL is written, and a crash of the server would
//! lose decisions callers were told — the database's fault, not the
//! service's, and not one the checker could tell apart.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::sync::Mutex;
use std::sync::mpsc;
use std::time::Duration;

use sqlx::Connection as _;
use tokio::time::Instant;

/// How the server is crashed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Crash {
    /// SIGKILL of the postmaster: its backends notice and exit on their
    /// own; the next start recovers from the WAL.
    Kill,
    /// `pg_ctl stop -m immediate` (SIGQUIT to the postmaster): every
    /// backend is stopped at once, no checkpoint.
    Immediate,
}

/// What the supervising thread is asked to do.
enum Cmd {
    /// Spawn the postmaster; its pid.
    Spawn(mpsc::Sender<Result<u32, String>>),
    /// Whether it has exited (without waiting).
    TryWait(mpsc::Sender<Option<ExitStatus>>),
    /// Wait until it has exited.
    Wait(mpsc::Sender<Option<ExitStatus>>),
}

/// A running (or crashed) cluster of chaos's own.
pub struct OwnPostgres {
    dir: PathBuf,
    url: String,
    ctl: Mutex<Option<mpsc::Sender<Cmd>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The postmaster now (none while crashed).
    pid: Mutex<Option<u32>>,
}

/// The folder of PostgreSQL's server binaries.
pub fn find_bin_dir(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    let has = |d: &Path| d.join("initdb").exists() && d.join("postgres").exists();
    if let Some(d) = given {
        anyhow::ensure!(
            has(d),
            "--postgres-bin {}: no initdb and postgres there",
            d.display()
        );
        return Ok(d.to_path_buf());
    }
    if let Some(d) = std::env::var_os("PG_BIN").map(PathBuf::from)
        && has(&d)
    {
        return Ok(d);
    }
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output()
        && out.status.success()
    {
        let d = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if has(&d) {
            return Ok(d);
        }
    }
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        // An entry that cannot be read is not a candidate.
        let mut dirs: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
            .filter(|d| has(d))
            .collect();
        dirs.sort();
        if let Some(d) = dirs.pop() {
            return Ok(d);
        }
    }
    for d in std::env::var("PATH").unwrap_or_default().split(':') {
        if has(Path::new(d)) {
            return Ok(PathBuf::from(d));
        }
    }
    anyhow::bail!(
        "PostgreSQL's server binaries (initdb, postgres) were not found: install them \
         (Debian: apt-get install -y postgresql), name their folder with --postgres-bin \
         or PG_BIN, or use --database-url (no crashes then) or --embedded"
    )
}

/// The `postgres` user's uid and gid (the server's, when chaos is root).
/// The uid and gid of the `postgres` user, to run PostgreSQL as when this
/// process is root (initdb refuses root).
pub fn postgres_ids() -> anyhow::Result<(u32, u32)> {
    let id = |flag: &str| -> anyhow::Result<u32> {
        let out = Command::new("id").args([flag, "postgres"]).output()?;
        anyhow::ensure!(
            out.status.success(),
            "running as root, and there is no `postgres` user to run PostgreSQL as (initdb \
             refuses root); Debian's postgresql package creates it"
        );
        Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
    };
    Ok((id("-u")?, id("-g")?))
}

fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// Removes the folders under `base` named `{prefix}{pid}-…` whose process
/// is gone (one killed outright leaves its folder behind): the chaos
/// runs' and the test support's.
pub fn sweep_old(base: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if let Some(pid) = name.strip_prefix(prefix).and_then(|r| r.split('-').next())
            && !Path::new(&format!("/proc/{pid}")).exists()
            && let Err(err) = std::fs::remove_dir_all(e.path())
        {
            // Only disk space is lost; the next sweep tries again.
            tracing::debug!(error = %err, path = %e.path().display(), "could not remove an old chaos cluster");
        }
    }
}

impl OwnPostgres {
    /// initdb and a first start (blocking: call it off the runtime's
    /// threads); the server accepts connections when this returns.
    pub fn start(bin: Option<&Path>) -> anyhow::Result<OwnPostgres> {
        let bin = find_bin_dir(bin)?;
        let root = unsafe { libc::getuid() } == 0;
        let ids = if root { Some(postgres_ids()?) } else { None };
        let base = std::env::temp_dir();
        sweep_old(&base, "vr-chaos-pg-");
        let dir = base.join(format!(
            "vr-chaos-pg-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir)?;
        if let Some((uid, gid)) = ids {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid))?;
        }
        let data = dir.join("data");
        initdb(&bin, &data, ids)?;
        let port = free_port()?;
        let log = dir.join("server.log");
        let (ctl, rx) = mpsc::channel::<Cmd>();
        let (bin2, data2, dir2) = (bin.clone(), data.clone(), dir.clone());
        let thread = std::thread::Builder::new()
            .name("chaos-postgres".into())
            .spawn(move || supervise(rx, bin2, data2, dir2, log, port, ids))?;
        let pg = OwnPostgres {
            url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            dir,
            ctl: Mutex::new(Some(ctl)),
            thread: Mutex::new(Some(thread)),
            pid: Mutex::new(None),
        };
        Ok(pg)
    }

    /// The server's URL (no proxy in between).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The cluster's folder (its `server.log`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Asks the supervising thread (on a blocking thread: its answers
    /// may wait for a process to exit); `None` once it is gone.
    async fn ask<T: Send + 'static>(
        &self,
        make: impl FnOnce(mpsc::Sender<T>) -> Cmd + Send + 'static,
    ) -> Option<T> {
        let ctl = self.ctl.lock().unwrap_or_else(|p| p.into_inner()).clone()?;
        // A send or a receive fails only once the supervising thread has
        // ended, and the blocking task only if it panicked: either way
        // there is no answer, which is what `None` says.
        let asked = tokio::task::spawn_blocking(move || {
            let (tx, rx) = mpsc::channel();
            ctl.send(make(tx)).ok()?;
            rx.recv().ok()
        });
        asked.await.ok().flatten()
    }

    /// Starts the postmaster (again) and waits, up to `within`, until it
    /// accepts connections; a start that fails (the old server's backends
    /// still hold its shared memory after a SIGKILL) is tried again.
    pub async fn up(&self, within: Duration) -> anyhow::Result<()> {
        let until = Instant::now() + within;
        let mut last = String::from("not started");
        while Instant::now() < until {
            let spawned = self
                .ask(Cmd::Spawn)
                .await
                .ok_or_else(|| anyhow::anyhow!("the PostgreSQL supervisor is gone"))?;
            let pid = spawned.map_err(|e| anyhow::anyhow!("starting PostgreSQL: {e}"))?;
            *self.pid.lock().unwrap_or_else(|p| p.into_inner()) = Some(pid);
            loop {
                match tokio::time::timeout(
                    Duration::from_secs(2),
                    sqlx::PgConnection::connect(&self.url),
                )
                .await
                {
                    Ok(Ok(conn)) => {
                        if let Err(e) = conn.close().await {
                            tracing::debug!(error = %e, "closing the probe connection");
                        }
                        return Ok(());
                    }
                    Ok(Err(e)) => last = e.to_string(),
                    Err(_) => last = "no answer within 2 s".into(),
                }
                let exited = self.ask(Cmd::TryWait).await.flatten();
                if let Some(status) = exited {
                    last = format!("the postmaster exited ({status}); see {}", self.log());
                    break;
                }
                if Instant::now() >= until {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        anyhow::bail!(
            "PostgreSQL did not accept connections within {} s: {last}",
            within.as_secs()
        )
    }

    fn log(&self) -> String {
        self.dir.join("server.log").display().to_string()
    }

    /// Crashes the server (`how`) and waits until the postmaster is gone.
    pub async fn crash(&self, how: Crash) {
        let Some(pid) = self.pid.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return;
        };
        let signal = match how {
            Crash::Kill => libc::SIGKILL,
            Crash::Immediate => libc::SIGQUIT,
        };
        // The pid is our own child's, not reaped yet: it is still ours.
        if unsafe { libc::kill(pid as libc::pid_t, signal) } != 0 {
            tracing::warn!(pid, error = %std::io::Error::last_os_error(), "chaos: could not signal the postmaster");
        }
        if self.ask(Cmd::Wait).await.flatten().is_none() {
            tracing::warn!(pid, "chaos: the crashed postmaster could not be reaped");
        }
    }
}

impl Drop for OwnPostgres {
    /// Stops the server at once (the supervisor's end sends an immediate
    /// stop and reaps it) and removes the cluster's folder.
    fn drop(&mut self) {
        self.ctl.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take()
            && t.join().is_err()
        {
            tracing::warn!("chaos: the PostgreSQL supervisor panicked");
        }
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            tracing::warn!(error = %e, path = %self.dir.display(), "chaos: could not remove the PostgreSQL folder");
        }
    }
}

/// The supervising thread: spawns, watches and reaps the postmaster; when
/// the cluster is dropped (the channel closes), stops it at once and reaps
/// it.
fn supervise(
    rx: mpsc::Receiver<Cmd>,
    bin: PathBuf,
    data: PathBuf,
    dir: PathBuf,
    log: PathBuf,
    port: u16,
    ids: Option<(u32, u32)>,
) {
    let mut child: Option<Child> = None;
    while let Ok(cmd) = rx.recv() {
        // Each reply's receiver waits for it; if it is gone, so is the
        // question.
        match cmd {
            Cmd::Spawn(reply) => {
                let r = spawn(&bin, &data, &dir, &log, port, ids).map(|c| {
                    let pid = c.id();
                    child = Some(c);
                    pid
                });
                drop(reply.send(r));
            }
            Cmd::TryWait(reply) => {
                // An error here (the child not waitable) is answered as
                // "still running": `up` then keeps probing, bounded.
                let status = child.as_mut().and_then(|c| c.try_wait().ok().flatten());
                if status.is_some() {
                    child = None;
                }
                if reply.send(status).is_err() {
                    tracing::debug!("chaos: nobody waits for the postmaster's status");
                }
            }
            Cmd::Wait(reply) => {
                // An error (not waitable) is `None`: the caller logs that
                // the postmaster could not be reaped.
                let status = child.take().and_then(|mut c| c.wait().ok());
                if reply.send(status).is_err() {
                    tracing::debug!("chaos: nobody waits for the postmaster's exit");
                }
            }
        }
    }
    if let Some(mut c) = child {
        // An immediate stop: nothing of this cluster is kept.
        unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGQUIT) };
        if let Err(e) = c.wait() {
            tracing::warn!(error = %e, "chaos: reaping PostgreSQL");
        }
    }
}

fn spawn(
    bin: &Path,
    data: &Path,
    dir: &Path,
    log: &Path,
    port: u16,
    ids: Option<(u32, u32)>,
) -> Result<Child, String> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| format!("{}: {e}", log.display()))?;
    let mut cmd = Command::new(bin.join("postgres"));
    cmd.arg("-D")
        .arg(data)
        .args(["-p", &port.to_string(), "-k"])
        .arg(dir)
        .args([
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            "fsync=off",
            "-c",
            "full_page_writes=off",
            "-c",
            "max_connections=300",
            "-c",
            "shared_buffers=64MB",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(log);
    if let Some((uid, gid)) = ids {
        cmd.uid(uid).gid(gid);
    }
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork
    // and exec.
    unsafe {
        cmd.pre_exec(|| {
            // An immediate stop when this thread (the cluster's life) ends.
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGQUIT);
            Ok(())
        });
    }
    cmd.spawn().map_err(|e| format!("spawning postgres: {e}"))
}

/// A new cluster in `data` (initdb: superuser `postgres`, trust, UTF-8, C
/// locale, no fsync of its own files), made as the user and group `ids`
/// when given (initdb refuses root). The test support makes its clusters
/// with it too.
pub fn initdb(bin: &Path, data: &Path, ids: Option<(u32, u32)>) -> anyhow::Result<()> {
    let mut initdb = Command::new(bin.join("initdb"));
    initdb
        .arg("-D")
        .arg(data)
        .args([
            "-U",
            "postgres",
            "--auth=trust",
            "-N",
            "-E",
            "UTF8",
            "--locale=C",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    if let Some((uid, gid)) = ids {
        initdb.uid(uid).gid(gid);
    }
    let out = initdb
        .output()
        .map_err(|e| anyhow::anyhow!("running initdb from {}: {e}", bin.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "initdb failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}
