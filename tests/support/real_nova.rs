//! Real Nova for the tests: Nova 34's own functional-test stack served on a
//! loopback port by the project's server (`real_nova/server.py`), a
//! Keystone whose catalog names the fault proxy (`real_nova/fault_proxy.rs`)
//! in front of it, and the ground truth read from Nova itself.
//!
//! One Nova per test binary, shared by its tests (each uses a project and
//! servers of its own): booting it takes seconds and 200 MB, a test's
//! servers take one. The first use builds the virtual environment under
//! `target/` (pinned by `real_nova/requirements.txt`, rebuilt when that file
//! changes); a machine without what it needs fails the test with a message
//! saying what to install, never a skip.
//!
//! The Python process is killed when the test binary exits (a parent-death
//! signal, its stdin closing, and an exit hook that also removes its
//! directory: Nova's sqlite files and its log).

pub mod fault_proxy;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use serde_json::{Value, json};
use uuid::Uuid;

use fault_proxy::FaultProxy;

/// The password every user of the harness's Keystone has.
pub const PASSWORD: &str = "pw-real-nova-7Qx";
/// Nova's Cinder fixture's one multiattach volume (any other id is an
/// available 1 GiB volume that is not).
pub const MULTIATTACH_VOLUME: &str = "4757d51f-54eb-4442-8684-3399a6431f67";
/// The image and flavor of Nova's Glance fixture and default flavors.
const IMAGE: &str = "155d900f-4e14-4e4c-a73d-069cbf4541e6";
const FLAVOR: &str = "1";

/// The Nova of this test binary.
pub struct RealNova {
    /// Nova itself (tests' own calls: servers, locks, the truth).
    pub base_url: String,
    /// Keystone (`OS_AUTH_URL`).
    pub auth_url: String,
    /// What the catalog names as the compute endpoint: the fault proxy.
    pub proxy: FaultProxy,
    /// Nova's log (INFO and up), for a failing test to read.
    pub log: PathBuf,
    /// server.py's stderr (and its thread dumps, on SIGUSR1).
    stderr: PathBuf,
    pid: u32,
}

/// How long one call of a test to Nova, Keystone or the harness may take.
/// Each answers in well under a second here; minutes mean Nova stopped
/// answering, and then every later test would wait on it too.
const CALL_BOUND: Duration = Duration::from_secs(120);
/// How long a test of this tier may last, hung or not (the longest takes
/// about 100 s here on a loaded machine). Past it, the binary says why and
/// ends: a hang anywhere (Nova, the service, the test's own code, blocking
/// or not) must fail CI with a diagnosis, not run out its clock.
const TEST_BOUND: Duration = Duration::from_secs(600);

/// Why this binary's Nova is no longer usable (the first call it did not
/// answer): later tests fail at once with it instead of each waiting out
/// their own bound.
static WEDGED: OnceLock<String> = OnceLock::new();

impl RealNova {
    /// What a hung test needs to be understood: every thread's stack in
    /// Nova (faulthandler, on SIGUSR1) and the tail of Nova's log.
    pub fn diagnose(&self, why: &str) -> String {
        let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        let before = size(&self.stderr);
        // SIGUSR1: server.py's Python handler (every thread, named; it runs
        // when the main thread's loop wakes). SIGUSR2 when that wrote
        // nothing: faulthandler, from C (at most 100 threads).
        let mut sent = Vec::new();
        for (sig, name, within) in [
            (libc::SIGUSR1, "SIGUSR1", Duration::from_secs(5)),
            (libc::SIGUSR2, "SIGUSR2", Duration::from_secs(5)),
        ] {
            // SAFETY: kill(2) on the pid of our own child; server.py
            // registers both signals to dump its threads, never to end.
            if unsafe { libc::kill(self.pid as libc::pid_t, sig) } != 0 {
                continue;
            }
            sent.push(name);
            // A bounded wait for the dump's first bytes, then for it to
            // stop growing.
            let until = std::time::Instant::now() + within;
            let mut last = before;
            let mut wrote = false;
            while std::time::Instant::now() < until {
                std::thread::sleep(Duration::from_millis(200));
                let now = size(&self.stderr);
                wrote = now > before;
                if wrote && now == last {
                    break;
                }
                last = now;
            }
            if wrote {
                break;
            }
        }
        let sent = sent.join(", then ");
        let stacks = match std::fs::read(&self.stderr) {
            Ok(b) => String::from_utf8_lossy(&b[(before as usize).min(b.len())..]).into_owned(),
            Err(e) => format!("(reading {}: {e})", self.stderr.display()),
        };
        let log = match std::fs::read_to_string(&self.log) {
            Ok(t) => {
                let lines: Vec<&str> = t.lines().collect();
                lines[lines.len().saturating_sub(150)..].join("\n")
            }
            Err(e) => format!("(reading {}: {e})", self.log.display()),
        };
        // What the services under test last exchanged with Nova.
        let all = self.proxy.exchanges("");
        let exchanges: Vec<String> = all[all.len().saturating_sub(30)..]
            .iter()
            .map(|e| {
                format!(
                    "{:>7.1} s ago  {} {} -> {:?} (fault {:?}, delivered {})",
                    e.at.elapsed().as_secs_f64(),
                    e.method,
                    e.path,
                    e.nova_status,
                    e.fault,
                    e.delivered
                )
            })
            .collect();
        format!(
            "{why}\n\n--- Nova's threads (sent {sent}) ---\n{stacks}\n\
             --- the last 150 lines of Nova's log ({}) ---\n{log}\n\
             --- the last 30 of {} exchanges through the fault proxy ---\n{}\n--- end ---",
            self.log.display(),
            all.len(),
            exchanges.join("\n")
        )
    }

    /// Nova did not answer `what` within CALL_BOUND: the tier cannot go
    /// on with it.
    fn wedged(&self, what: &str) -> ! {
        let why = format!("Nova did not answer {what} within {CALL_BOUND:?}");
        let d = self.diagnose(&why);
        // The first is kept; a later one says the same.
        drop(WEDGED.set(why));
        panic!("{d}");
    }
}

/// Started by every test of the tier (in `Api::new`): ends the test binary,
/// after printing a diagnosis, if the test outlives TEST_BOUND. Dropped
/// with the test's `Api`, which stops it.
struct Watchdog {
    _alive: std::sync::mpsc::Sender<()>,
}

impl Watchdog {
    fn start(nova: &'static RealNova) -> Watchdog {
        // libtest names the test's thread after the test.
        let test = std::thread::current()
            .name()
            .unwrap_or("a real-Nova test")
            .to_string();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let name = format!("watchdog {test}");
        let spawned = std::thread::Builder::new().name(name).spawn(move || {
            // Nothing is ever sent: the test's end drops the sender
            // (Disconnected), its hang lets the bound pass (Timeout).
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(TEST_BOUND) {
                let d = nova.diagnose(&format!("{test} did not end within {TEST_BOUND:?}"));
                // Straight to fd 2: libtest captures print macros, and
                // its capture is never shown when the process exits.
                let mut err = std::io::stderr().lock();
                drop(writeln!(err, "\n=== real Nova tier: a hung test ===\n{d}"));
                drop(err.flush());
                std::process::exit(101);
            }
        });
        if let Err(e) = spawned {
            panic!("a watchdog thread for a real-Nova test: {e}");
        }
        Watchdog { _alive: tx }
    }
}

static NOVA: OnceLock<Result<RealNova, String>> = OnceLock::new();

/// The Nova of this test binary, started on first use.
pub fn nova() -> &'static RealNova {
    match NOVA.get_or_init(start) {
        Ok(n) => n,
        Err(e) => panic!("real Nova could not start: {e}"),
    }
}

fn target_dir() -> PathBuf {
    // CARGO_TARGET_TMPDIR is <target>/tmp, whatever CARGO_TARGET_DIR says.
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("the target directory")
        .to_path_buf()
}

fn source_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/real_nova")
}

/// Runs a command, returning its stdout, or an error with its stderr.
fn run(cmd: &mut Command, what: &str) -> Result<String, String> {
    let out = cmd
        .output()
        .map_err(|e| format!("{what}: cannot run {cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{what} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Checks the machine has a Python that can make virtual environments.
fn check_python() -> Result<String, String> {
    let version = run(
        Command::new("python3").args([
            "-c",
            "import sys; print('%d.%d' % sys.version_info[:2])",
        ]),
        "python3",
    )
    .map_err(|e| {
        format!("{e}\nThe real-Nova tests need Python 3.11 or newer (Debian: `apt-get install -y python3 python3-venv`; .ci/run installs it).")
    })?;
    let version = version.trim().to_string();
    let (major, minor) = version.split_once('.').unwrap_or(("0", "0"));
    let (major, minor): (u32, u32) = (major.parse().unwrap_or(0), minor.parse().unwrap_or(0));
    if (major, minor) < (3, 11) {
        return Err(format!(
            "python3 is {version}; Nova 34 needs Python 3.11 or newer (Debian 12 or later)."
        ));
    }
    run(
        Command::new("python3").args(["-c", "import venv, ensurepip"]),
        "python3 -m venv",
    )
    .map_err(|e| {
        format!("{e}\nPython's venv module is missing: install python3-venv (Debian: `apt-get install -y python3-venv`; .ci/run does).")
    })?;
    Ok(version)
}

/// The virtual environment with the pinned set, built once under
/// `target/` (under a lock: test binaries may start at once).
fn ensure_venv() -> Result<PathBuf, String> {
    let python_version = check_python()?;
    let target = target_dir();
    std::fs::create_dir_all(&target).map_err(|e| format!("creating {}: {e}", target.display()))?;
    let venv = target.join("real-nova-venv");
    let requirements = source_dir().join("requirements.txt");
    let pins = std::fs::read(&requirements)
        .map_err(|e| format!("reading {}: {e}", requirements.display()))?;
    let mut h = ring::digest::Context::new(&ring::digest::SHA256);
    h.update(&pins);
    h.update(python_version.as_bytes());
    let want: String = h
        .finish()
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let marker = venv.join(".vr-requirements-sha256");
    let lock_path = target.join("real-nova-venv.lock");
    let lock = std::fs::File::create(&lock_path)
        .map_err(|e| format!("creating {}: {e}", lock_path.display()))?;
    use std::os::fd::AsRawFd;
    // Held until `lock` is dropped at the end of this function.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(format!(
            "locking {}: {}",
            lock_path.display(),
            std::io::Error::last_os_error()
        ));
    }
    if std::fs::read_to_string(&marker).is_ok_and(|m| m.trim() == want) {
        return Ok(venv);
    }
    eprintln!(
        "real Nova: building the virtual environment in {} (first run only; about two minutes)",
        venv.display()
    );
    if venv.exists() {
        std::fs::remove_dir_all(&venv)
            .map_err(|e| format!("removing the stale {}: {e}", venv.display()))?;
    }
    run(
        Command::new("python3").args(["-m", "venv"]).arg(&venv),
        "python3 -m venv",
    )
    .map_err(|e| format!("{e}\n(Debian: `apt-get install -y python3-venv`.)"))?;
    let log = target.join("real-nova-venv.log");
    let log_file =
        std::fs::File::create(&log).map_err(|e| format!("creating {}: {e}", log.display()))?;
    let status = Command::new(venv.join("bin/python"))
        // `python -m pip`: a venv's pip script has the venv's path in its
        // shebang, which breaks when target/ moves. `--no-deps`: the file
        // is the whole frozen set, so pip installs exactly it (resolving
        // would wander through SQLAlchemy 2.1 wheels for oslo.db's extra).
        .args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-deps",
            "-r",
        ])
        .arg(&requirements)
        .stdout(log_file.try_clone().map_err(|e| e.to_string())?)
        .stderr(log_file)
        .status()
        .map_err(|e| format!("running pip: {e}"))?;
    if !status.success() {
        let tail = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: Vec<&str> = tail.lines().rev().take(30).collect();
        return Err(format!(
            "pip install of {} failed ({status}); its log is {} (PyPI must be reachable):\n{}",
            requirements.display(),
            log.display(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        ));
    }
    run(
        Command::new(venv.join("bin/python")).args(["-m", "pip", "check"]),
        "pip check (the pinned set is incomplete or inconsistent)",
    )?;
    run(
        Command::new(venv.join("bin/python")).args([
            "-c",
            "import nova, placement, waitress, wsgi_intercept, oslotest",
        ]),
        "the new virtual environment",
    )?;
    std::fs::write(&marker, &want).map_err(|e| format!("writing {}: {e}", marker.display()))?;
    Ok(venv)
}

/// Removes the directories of runs whose process is gone.
fn sweep_old(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if let Some(pid) = name
            .strip_prefix("real-nova-")
            .and_then(|r| r.split('-').next())
            && !Path::new(&format!("/proc/{pid}")).exists()
        {
            // Best effort: a leftover directory only costs disk space.
            drop(std::fs::remove_dir_all(e.path()));
        }
    }
}

/// This process's Nova: its pid and its directory, for the exit hook.
static RUN: OnceLock<(u32, PathBuf)> = OnceLock::new();

fn remove_at_exit(pid: u32, dir: PathBuf) {
    extern "C" fn at_exit() {
        let Some((pid, dir)) = RUN.get() else {
            return;
        };
        let pid = *pid as libc::pid_t;
        unsafe { libc::kill(pid, libc::SIGKILL) };
        let mut status = 0;
        // Our child: reaped once gone (SIGKILL takes milliseconds), at most
        // 5 s; then its directory goes. Best effort at exit: nobody is left
        // to report to, and the next run's sweep removes what stays.
        for _ in 0..100 {
            if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } != 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if std::env::var_os("VR_KEEP_NOVA").is_none_or(|v| v != "1") {
            drop(std::fs::remove_dir_all(dir));
        }
    }
    if RUN.set((pid, dir)).is_ok() {
        unsafe { libc::atexit(at_exit) };
    }
}

fn start() -> Result<RealNova, String> {
    let venv = ensure_venv()?;
    let base = Path::new(env!("CARGO_TARGET_TMPDIR")).to_path_buf();
    std::fs::create_dir_all(&base).map_err(|e| format!("creating {}: {e}", base.display()))?;
    sweep_old(&base);
    let dir = base.join(format!(
        "real-nova-{}-{}",
        std::process::id(),
        Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let log = dir.join("nova.log");
    let stderr_path = dir.join("stderr.log");
    let proxy = FaultProxy::start();
    let mut cmd = Command::new(venv.join("bin/python"));
    cmd.arg(source_dir().join("server.py"))
        .arg("--paste-config")
        .arg(venv.join("etc/nova/api-paste.ini"))
        .args(["--password", PASSWORD, "--compute-url", &proxy.url()])
        .arg("--log-file")
        .arg(&log)
        // Nova's sqlite files (tempfile) live in the run's directory.
        .env("TMPDIR", &dir)
        .env_remove("OS_TEST_TIMEOUT")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(
            std::fs::File::create(&stderr_path)
                .map_err(|e| format!("creating {}: {e}", stderr_path.display()))?,
        );
    unsafe {
        cmd.pre_exec(|| {
            // Killed when the thread that spawned it (which lives as long
            // as the test process) goes away.
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("real-nova".into())
        .spawn(move || {
            let mut child = match cmd.spawn() {
                Ok(c) => c,
                Err(e) => {
                    // The receiver waits for this message; it is there.
                    drop(tx.send(Err(format!("starting server.py: {e}"))));
                    return;
                }
            };
            let pid = child.id();
            let stdout = child.stdout.take().expect("piped stdout");
            // Its stdin stays open as long as this thread: the server
            // ends itself when it closes.
            let _stdin = child.stdin.take();
            let mut ready = None;
            let mut lines = BufReader::new(stdout).lines();
            for line in lines.by_ref() {
                let Ok(line) = line else { break };
                if let Some(url) = line.strip_prefix("READY ") {
                    ready = Some(url.trim().to_string());
                    break;
                }
            }
            let ready = ready
                .ok_or_else(|| "server.py ended before it was ready".to_string())
                .map(|u| (pid, u));
            // The receiver waits for this message; it is there.
            drop(tx.send(ready));
            // Whatever it prints later is drained (a full pipe would stall
            // it) until it ends; then this thread stays, holding its stdin.
            for line in lines {
                drop(line);
            }
            loop {
                std::thread::park();
            }
        })
        .map_err(|e| format!("a thread for Nova: {e}"))?;
    // A cold start on a loaded 2-core machine: imports, databases,
    // services; 5-15 s here. The bound is for a process that hangs.
    let started = rx
        .recv_timeout(Duration::from_secs(240))
        .map_err(|_| "server.py did not say READY within 240 s".to_string())
        .and_then(|r| r);
    let (pid, base_url) = match started {
        Ok(x) => x,
        Err(e) => {
            let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
            return Err(format!(
                "{e}; its stderr ({}):\n{stderr}",
                stderr_path.display()
            ));
        }
    };
    remove_at_exit(pid, dir);
    let addr = base_url
        .strip_prefix("http://")
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| format!("server.py said READY at {base_url}"))?;
    proxy.set_upstream(addr);
    // Shown with --nocapture: where to look when a test fails.
    let mut err = std::io::stderr();
    drop(writeln!(
        err,
        "real Nova at {base_url} (log {}), proxy {}",
        log.display(),
        proxy.url()
    ));
    Ok(RealNova {
        auth_url: format!("{base_url}/identity/v3"),
        base_url,
        proxy,
        log,
        stderr: stderr_path,
        pid,
    })
}

/// One BDM Nova created or destroyed.
#[derive(Debug, Clone)]
pub struct Effect {
    pub at: DateTime<Utc>,
    pub attached: bool,
    pub server: Uuid,
    pub volume: Uuid,
}

/// An entry of Nova's attachment list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub volume: Uuid,
    pub attachment_id: Option<String>,
}

/// How many tests use the binary's Nova at once, whatever the test threads
/// (`.cargo/config.toml` runs more for the other binaries, whose tests
/// mostly wait): Nova is one Python process, and with six tests at once its
/// answers slowed past a test's own deadline (a look in the reserve came
/// too late: a failure of the machine, not of the service).
static AT_ONCE: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

/// A test's view of the Nova: its own HTTP client (a client's pool must not
/// outlive the runtime that made its connections) and a project.
pub struct Api {
    /// This test's turn on the binary's Nova, held to its end.
    _turn: tokio::sync::SemaphorePermit<'static>,
    pub nova: &'static RealNova,
    http: reqwest::Client,
    _watchdog: Watchdog,
    /// The test's project (its servers are its own).
    pub project: String,
    tokens: tokio::sync::Mutex<HashMap<(String, String), String>>,
}

impl Api {
    /// A fresh project on the binary's Nova (started here on first use),
    /// once it is this test's turn: at most `AT_ONCE` tests at a time.
    pub async fn new() -> Api {
        super::init_logs();
        let turn = AT_ONCE.acquire().await.expect("the gate is never closed");
        let nova = tokio::task::spawn_blocking(nova)
            .await
            .expect("starting Nova (see the panic above)");
        if let Some(why) = WEDGED.get() {
            panic!(
                "this binary's Nova is unusable since an earlier test: {why} (that test's failure shows Nova's threads and log)"
            );
        }
        Api {
            _turn: turn,
            nova,
            _watchdog: Watchdog::start(nova),
            http: reqwest::Client::builder()
                .no_proxy()
                .connect_timeout(Duration::from_secs(10))
                .timeout(CALL_BOUND)
                .build()
                .expect("an HTTP client"),
            project: format!("p-{}", Uuid::new_v4().simple()),
            tokens: Default::default(),
        }
    }

    /// A call of the test's own that failed: a timeout means Nova stopped
    /// answering (diagnosed, and the tier's later tests told); anything else
    /// is this call's failure.
    fn failed(&self, what: &str, e: reqwest::Error) -> ! {
        if e.is_timeout() {
            self.nova.wedged(what)
        }
        panic!("{what}: {e:#}")
    }

    /// A token of `user` for `project` from the harness's Keystone.
    pub async fn token(&self, user: &str, project: &str) -> String {
        let key = (user.to_string(), project.to_string());
        if let Some(t) = self.tokens.lock().await.get(&key) {
            return t.clone();
        }
        let body = json!({"auth": {
            "identity": {"methods": ["password"], "password": {"user": {
                "name": user, "domain": {"name": "Default"}, "password": PASSWORD}}},
            "scope": {"project": {"name": project, "domain": {"name": "Default"}}}}});
        let r = self
            .http
            .post(format!("{}/auth/tokens", self.nova.auth_url))
            .json(&body)
            .send()
            .await
            .unwrap_or_else(|e| self.failed(&format!("a token for {user}"), e));
        assert_eq!(r.status(), 201, "Keystone refused {user}");
        let t = r.headers()["x-subject-token"]
            .to_str()
            .expect("a token")
            .to_string();
        self.tokens.lock().await.insert(key, t.clone());
        t
    }

    /// A call to Nova directly (not through the proxy) as `user` of this
    /// project, or as the cloud's admin.
    pub async fn call(
        &self,
        admin: bool,
        method: reqwest::Method,
        path: &str,
        microversion: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let token = if admin {
            self.token("admin", "admin").await
        } else {
            self.token("tester", &self.project).await
        };
        let mut req = self
            .http
            .request(method.clone(), format!("{}/v2.1{path}", self.nova.base_url))
            .header("X-Auth-Token", token)
            .header("OpenStack-API-Version", format!("compute {microversion}"));
        if let Some(b) = body {
            req = req.json(&b);
        }
        let what = format!("{method} {path}");
        let r = req.send().await.unwrap_or_else(|e| self.failed(&what, e));
        let status = r.status().as_u16();
        let text = r.text().await.unwrap_or_else(|e| self.failed(&what, e));
        let v = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        (status, v)
    }

    async fn harness(&self, method: reqwest::Method, path: &str, body: Value) -> Value {
        let r = self
            .http
            .request(method, format!("{}/_harness/{path}", self.nova.base_url))
            .json(&body)
            .send()
            .await
            .unwrap_or_else(|e| self.failed(&format!("harness {path}"), e));
        assert!(r.status().is_success(), "harness {path}: {}", r.status());
        r.json()
            .await
            .unwrap_or_else(|e| self.failed(&format!("harness {path}"), e))
    }

    /// Servers of this project, created through Nova's API, once ACTIVE.
    pub async fn servers(&self, n: usize) -> Vec<Uuid> {
        let mut ids = Vec::new();
        for i in 0..n {
            let (status, v) = self
                .call(
                    false,
                    reqwest::Method::POST,
                    "/servers",
                    "2.89",
                    Some(
                        json!({"server": {"name": format!("vr-{i}"), "imageRef": IMAGE,
                        "flavorRef": FLAVOR, "networks": "none"}}),
                    ),
                )
                .await;
            assert_eq!(status, 202, "server create: {v}");
            ids.push(
                v["server"]["id"]
                    .as_str()
                    .expect("an id")
                    .parse()
                    .expect("a uuid"),
            );
        }
        for id in &ids {
            let path = format!("/servers/{id}");
            super::eventually(Duration::from_secs(90), "the server is ACTIVE", || {
                let path = path.clone();
                async move {
                    let (_, v) = self
                        .call(false, reqwest::Method::GET, &path, "2.89", None)
                        .await;
                    let status = v["server"]["status"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string();
                    assert_ne!(status, "ERROR", "the server failed to build: {v}");
                    status == "ACTIVE"
                }
            })
            .await;
        }
        ids
    }

    pub async fn server(&self) -> Uuid {
        self.servers(1).await[0]
    }

    /// The cloud's admin locks (or unlocks) a server.
    pub async fn lock(&self, server: Uuid, locked: bool) {
        let body = if locked {
            json!({"lock": {"locked_reason": "maintenance"}})
        } else {
            json!({"unlock": null})
        };
        let (status, v) = self
            .call(
                true,
                reqwest::Method::POST,
                &format!("/servers/{server}/action"),
                "2.73",
                Some(body),
            )
            .await;
        assert_eq!(status, 202, "lock={locked}: {v}");
    }

    /// Nova's attachment list of a server, read directly (as the admin).
    pub async fn attachments(&self, server: Uuid) -> Vec<Listed> {
        let (status, v) = self
            .call(
                true,
                reqwest::Method::GET,
                &format!("/servers/{server}/os-volume_attachments"),
                "2.89",
                None,
            )
            .await;
        assert_eq!(status, 200, "{v}");
        v["volumeAttachments"]
            .as_array()
            .expect("a list")
            .iter()
            .map(|a| Listed {
                volume: a["volumeId"]
                    .as_str()
                    .expect("volumeId")
                    .parse()
                    .expect("a uuid"),
                attachment_id: a["attachment_id"].as_str().map(str::to_string),
            })
            .collect()
    }

    pub async fn is_attached(&self, server: Uuid, volume: Uuid) -> bool {
        self.attachments(server)
            .await
            .iter()
            .any(|a| a.volume == volume)
    }

    /// Every BDM change Nova made, in order (the ground truth's history).
    pub async fn effects(&self) -> Vec<Effect> {
        let v = self
            .harness(reqwest::Method::GET, "effects", Value::Null)
            .await;
        v["effects"]
            .as_array()
            .expect("effects")
            .iter()
            .map(|e| {
                let t = e["t"].as_f64().expect("an instant");
                Effect {
                    at: Utc
                        .timestamp_micros((t * 1e6) as i64)
                        .single()
                        .expect("a time"),
                    attached: e["change"] == "attached",
                    server: e["server_id"]
                        .as_str()
                        .expect("server")
                        .parse()
                        .expect("uuid"),
                    volume: e["volume_id"]
                        .as_str()
                        .expect("volume")
                        .parse()
                        .expect("uuid"),
                }
            })
            .collect()
    }

    /// Nova's BDMs of `volume` created on `server` (its attach effects).
    pub async fn attach_effects(&self, server: Uuid, volume: Uuid) -> usize {
        self.effects()
            .await
            .iter()
            .filter(|e| e.attached && e.server == server && e.volume == volume)
            .count()
    }

    /// The harness's Cinder fails Nova's next `count` attachment_create
    /// calls for `volume` (CinderConnectionFailed).
    pub async fn fail_cinder_attach(&self, volume: Uuid, count: u32) {
        self.harness(
            reqwest::Method::POST,
            "faults/cinder-attach",
            json!({"volume_id": volume.to_string(), "count": count}),
        )
        .await;
    }

    /// The hypervisor fails every attach of `volume`.
    pub async fn fail_compute_attach(&self, volume: Uuid) {
        self.harness(
            reqwest::Method::POST,
            "faults/compute-attach",
            json!({"volume_id": volume.to_string()}),
        )
        .await;
    }

    /// Revokes every token of `user`; how many there were.
    pub async fn revoke(&self, user: &str) -> u64 {
        let v = self
            .harness(
                reqwest::Method::POST,
                "tokens/revoke",
                json!({"user": user}),
            )
            .await;
        v["revoked"].as_u64().expect("a count")
    }

    /// How many tokens Keystone issued to `user`.
    pub async fn issued(&self, user: &str) -> u64 {
        let v = self
            .harness(reqwest::Method::GET, "tokens", Value::Null)
            .await;
        v["issued"][user].as_u64().unwrap_or(0)
    }

    /// A server's instance actions, newest first, each with its events.
    pub async fn actions(&self, server: Uuid) -> Vec<Value> {
        let (status, v) = self
            .call(
                true,
                reqwest::Method::GET,
                &format!("/servers/{server}/os-instance-actions"),
                "2.84",
                None,
            )
            .await;
        assert_eq!(status, 200, "{v}");
        let mut out = Vec::new();
        for a in v["instanceActions"].as_array().expect("actions") {
            let id = a["request_id"].as_str().expect("request_id");
            let (status, d) = self
                .call(
                    true,
                    reqwest::Method::GET,
                    &format!("/servers/{server}/os-instance-actions/{id}"),
                    "2.84",
                    None,
                )
                .await;
            assert_eq!(status, 200, "{d}");
            out.push(d["instanceAction"].clone());
        }
        out
    }

    /// The flags that run the service in Keystone mode against this Nova
    /// as `user` of this project, through the fault proxy, at
    /// `microversion`.
    pub fn service_args(&self, user: &str, microversion: &str) -> Vec<String> {
        [
            "--os-auth-url",
            &self.nova.auth_url,
            "--os-username",
            user,
            "--os-password",
            PASSWORD,
            "--os-project-name",
            &self.project,
            "--os-user-domain-name",
            "Default",
            "--os-project-domain-name",
            "Default",
            "--os-region-name",
            "RegionOne",
            "--nova-microversion",
            microversion,
            // Nova's Cinder is a fixture inside Nova: the catalog has no
            // block-storage endpoint, so Nova's list decides (said here
            // rather than warned about at start).
            "--confirm-with",
            "nova-list",
            "--nova-discovery-timeout",
            "30s",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }
}

/// Whether Nova had `volume` on `server` at `at`, by its BDM history.
pub fn attached_at(effects: &[Effect], server: Uuid, volume: Uuid, at: DateTime<Utc>) -> bool {
    let mut live: i64 = 0;
    for e in effects
        .iter()
        .filter(|e| e.server == server && e.volume == volume && e.at <= at)
    {
        live += if e.attached { 1 } else { -1 };
    }
    live > 0
}
