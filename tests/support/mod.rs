//! Test support: a throwaway PostgreSQL cluster (one per test binary, one
//! database per test), the Nova simulator over real sockets, and the server
//! built exactly as `main` builds it (`Application::build` → `run_until`).
#![allow(dead_code)]

pub mod header_proxy;
pub mod lifecycle;
pub mod pg;
pub mod pki;
pub mod proxy;
pub mod real_nova;

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use volume_reconciler::client::Client;
use volume_reconciler::config::ServeArgs;
use volume_reconciler::executor::Executor;
use volume_reconciler::grpc::pb::volume_reconciler_client::VolumeReconcilerClient;
use volume_reconciler::reconciler::Reconciler;
use volume_reconciler::sim::{self, Sim, SimConfig, SimHandle};
use volume_reconciler::startup::Application;
use volume_reconciler::store::Store;

pub struct TestApp {
    pub grpc_url: String,
    pub admin_url: String,
    pub client: Client,
    pub sim: Arc<Sim>,
    pub sim_handle: Option<SimHandle>,
    pub db_url: String,
    pub store: Arc<dyn Store>,
    pub exec: Arc<Executor>,
    pub reconciler: Arc<Reconciler>,
    pub pruner: Arc<volume_reconciler::retention::Pruner>,
    pub tls: Option<Arc<volume_reconciler::tls::Reloadable>>,
    pub ledger: Ledger,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
    _embedded: Option<EmbeddedDir>,
}

/// Which ledger the service runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ledger {
    /// A fresh database of the test cluster (or `db_url`'s).
    Postgres,
    /// The embedded store in a fresh temporary file (one process).
    Embedded,
}

impl Ledger {
    pub const BOTH: [Ledger; 2] = [Ledger::Postgres, Ledger::Embedded];
}

/// The folder of an embedded ledger, removed with the test's app.
struct EmbeddedDir(std::path::PathBuf);

impl EmbeddedDir {
    fn new() -> Self {
        let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("vr-ledger-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("a temporary folder for the embedded ledger");
        Self(dir)
    }

    fn url(&self) -> String {
        format!("sqlite://{}", self.0.join("ledger.db").display())
    }
}

impl Drop for EmbeddedDir {
    fn drop(&mut self) {
        // Best effort: a leftover temporary folder harms nothing.
        drop(std::fs::remove_dir_all(&self.0));
    }
}

pub struct AppOptions {
    pub args: Vec<String>,
    pub sim: SimConfig,
    /// Use this database instead of a fresh one (several replicas).
    pub db_url: Option<String>,
    /// Use this Nova URL instead of a fresh simulator.
    pub nova_url: Option<String>,
    /// Keystone mode: no simulator and no `--nova-url` (`args` carry the
    /// `--os-*` settings; the real-Nova tier).
    pub keystone: bool,
    pub replica: String,
    /// The ledger, when `db_url` names none.
    pub ledger: Ledger,
}

impl Default for AppOptions {
    fn default() -> Self {
        Self {
            args: Vec::new(),
            sim: SimConfig::default(),
            db_url: None,
            nova_url: None,
            keystone: false,
            replica: "test-a".into(),
            ledger: Ledger::Postgres,
        }
    }
}

impl AppOptions {
    /// These options on `ledger`.
    pub fn on(mut self, ledger: Ledger) -> Self {
        self.ledger = ledger;
        self
    }

    pub fn arg(mut self, flag: &str, value: &str) -> Self {
        self.args.push(flag.to_string());
        self.args.push(value.to_string());
        self
    }
}

/// `opts` in Keystone mode against `sim`'s Keystone (the password of its
/// user, scoped to its project): no `--nova-url`, Nova and Cinder from the
/// catalog, as against a cloud.
pub fn keystone_mode(sim: &SimHandle, opts: AppOptions) -> AppOptions {
    let cfg = sim.sim.config();
    AppOptions {
        keystone: true,
        ..opts
    }
    .arg("--os-auth-url", &sim.auth_url)
    .arg("--os-username", &cfg.username)
    .arg("--os-password", &cfg.password)
    .arg("--os-project-name", &cfg.project_name)
}

pub fn init_logs() {
    volume_reconciler::tls::install_crypto_provider();
    let filter = std::env::var("TEST_LOG").unwrap_or_else(|_| "warn".into());
    volume_reconciler::telemetry::init(volume_reconciler::telemetry::LogFormat::Human, &filter);
}

pub async fn spawn_app(opts: AppOptions) -> TestApp {
    init_logs();
    volume_reconciler::tls::install_crypto_provider();
    let (sim, sim_handle, nova_url) = match opts.nova_url {
        _ if opts.keystone => (Sim::new(SimConfig::default()), None, None),
        Some(url) => (Sim::new(SimConfig::default()), None, Some(url)),
        None => {
            let h = sim::start("127.0.0.1:0".parse().unwrap(), opts.sim)
                .await
                .expect("simulator starts");
            let (s, u) = (h.sim.clone(), h.nova_url.clone());
            (s, Some(h), Some(u))
        }
    };
    let mut embedded = None;
    let db_url = match (opts.db_url, opts.ledger) {
        (Some(u), _) => u,
        (None, Ledger::Postgres) => pg::fresh_database().await,
        (None, Ledger::Embedded) => embedded.insert(EmbeddedDir::new()).url(),
    };
    let ledger = if db_url.starts_with("sqlite:") {
        Ledger::Embedded
    } else {
        Ledger::Postgres
    };
    let mut args: Vec<String> = [
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--database-url",
        &db_url,
        "--replica-id",
        &opts.replica,
        "--shutdown-delay",
        "0s",
        "--drain-timeout",
        "5s",
        "--db-max-connections",
        "8",
        // The lease follows the round-trip bound (2 × 2s + 500ms + 500ms:
        // 5s): a dead replica's work is taken over within seconds, and a
        // statement of a loaded machine has four times the room it needs.
        "--db-statement-timeout",
        "2s",
        "--heartbeat",
        "500ms",
        "--no-reconciler",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if let Some(url) = nova_url {
        args.extend(["--nova-url".to_string(), url]);
    }
    // Its own simulator serves Cinder too, as a cloud does (a test that
    // wants Nova's list passes `--confirm-with nova-list`).
    if let Some(h) = &sim_handle {
        args.extend(["--cinder-url".to_string(), h.cinder_url.clone()]);
    }
    // Later flags win: tests may override any of the above.
    args.extend(opts.args);
    let cfg = ServeArgs::from_args(dedupe_flags(args)).expect("test flags parse");
    let app = Application::build(cfg).await.expect("application builds");
    let grpc_url = format!("http://{}", app.grpc_addr());
    let admin_url = format!("http://{}", app.admin_addr());
    let store = app.store.clone();
    let exec = app.exec.clone();
    let reconciler = app.reconciler.clone();
    let pruner = app.pruner.clone();
    let tls = app.tls.clone();
    let stop = CancellationToken::new();
    let s = stop.clone();
    let task = tokio::spawn(app.run_until(async move { s.cancelled().await }));
    let client = Client::connect_lazy(&grpc_url).expect("client");
    TestApp {
        grpc_url,
        admin_url,
        client,
        sim,
        sim_handle,
        db_url,
        store,
        exec,
        reconciler,
        pruner,
        tls,
        ledger,
        stop,
        task,
        _embedded: embedded,
    }
}

/// Keeps the last value of each `--flag value` pair, and bare flags once.
fn dedupe_flags(args: Vec<String>) -> Vec<String> {
    let bare = ["--no-reconciler"];
    let mut pairs: Vec<(String, Option<String>)> = Vec::new();
    let mut it = args.into_iter();
    while let Some(flag) = it.next() {
        let value = if bare.contains(&flag.as_str()) {
            None
        } else {
            it.next()
        };
        if flag == "--with-reconciler" {
            pairs.retain(|(f, _)| f != "--no-reconciler");
            continue;
        }
        pairs.retain(|(f, _)| *f != flag);
        pairs.push((flag, value));
    }
    pairs
        .into_iter()
        .flat_map(|(f, v)| std::iter::once(f).chain(v))
        .collect()
}

impl TestApp {
    pub fn raw(&self) -> VolumeReconcilerClient<Channel> {
        self.client.raw()
    }

    /// Stops the server through its staged shutdown and waits for it.
    pub async fn stop(self) {
        self.stop.cancel();
        match tokio::time::timeout(Duration::from_secs(30), self.task).await {
            Ok(Ok(Ok(()))) => {}
            other => panic!("server did not stop cleanly: {other:?}"),
        }
    }
}

/// Polls `check` every 50 ms until it holds, failing the test after
/// `within`. The one way tests wait for something to happen.
pub async fn eventually<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    eventually_explained(within, what, || {
        let fut = check();
        async move {
            if fut.await {
                Ok(())
            } else {
                Err(String::new())
            }
        }
    })
    .await
}

/// `eventually`, with why it does not hold yet: the last reason is in the
/// test's failure.
pub async fn eventually_explained<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let why = match check().await {
            Ok(()) => return,
            Err(why) => why,
        };
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {within:?} waiting for: {what}\n{why}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A request with a deadline (sent as `grpc-timeout`).
pub fn with_timeout<T>(msg: T, timeout: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(timeout);
    r
}

/// The `ErrorInfo` of a status: (reason, metadata).
pub fn error_info(s: &tonic::Status) -> (String, std::collections::HashMap<String, String>) {
    use tonic_types::StatusExt;
    let d = s.get_error_details();
    let info = d
        .error_info()
        .unwrap_or_else(|| panic!("status without ErrorInfo: {s:?}"));
    assert_eq!(info.domain, "volume-reconciler");
    (info.reason.clone(), info.metadata.clone())
}

pub fn uuid() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// A port that refuses connections and stays the caller's while it holds
/// the socket: bound, never listened on. (A port merely found free can be
/// taken meanwhile by another test's server, whose answer — a 404 — a test
/// of "nothing listens" would read instead.)
pub fn refusing_port() -> (tokio::net::TcpSocket, std::net::SocketAddr) {
    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    socket.bind("127.0.0.1:0".parse().unwrap()).expect("bound");
    let addr = socket.local_addr().expect("its address");
    (socket, addr)
}

/// A `pending` attach of `key` on a fresh server and volume, recorded by
/// replica `by` (its lease `lease_for` long, no attempt made, the caller's
/// deadline `deadline_in` away). Tests change the rest with struct update
/// syntax.
pub fn pending_attach(
    key: &str,
    by: &str,
    lease_for: Duration,
    deadline_in: Duration,
) -> volume_reconciler::store::NewOperation {
    let (server, volume) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    pending_attach_on(key, by, lease_for, deadline_in, server, volume)
}

/// [`pending_attach`] of `volume` on `server`.
pub fn pending_attach_on(
    key: &str,
    by: &str,
    lease_for: Duration,
    deadline_in: Duration,
    server: uuid::Uuid,
    volume: uuid::Uuid,
) -> volume_reconciler::store::NewOperation {
    use volume_reconciler::domain::{Action, NewEvent, RequestParams, State, request_fingerprint};
    let params = RequestParams::default();
    volume_reconciler::store::NewOperation {
        labels: Default::default(),
        id: uuid::Uuid::now_v7(),
        key: volume_reconciler::domain::CallerKey::parse(None, key)
            .unwrap()
            .into(),
        fingerprint: request_fingerprint(
            Action::Attach,
            server,
            volume,
            &params,
            &volume_reconciler::domain::Labels::none(),
        ),
        action: Action::Attach,
        server_id: server,
        volume_id: volume,
        params,
        state: State::Pending,
        attempts: 0,
        deadline_in,
        lease_owner: by.into(),
        lease_for,
        trace: None,
        replica: by.into(),
        events: vec![NewEvent::new("recorded", "seeded by the test")],
        record_by: None,
    }
}

/// Records `new` in `store`, whose key must be fresh; its id.
pub async fn record_new(
    store: &dyn volume_reconciler::store::Store,
    new: volume_reconciler::store::NewOperation,
) -> uuid::Uuid {
    use volume_reconciler::store::CreateOutcome;
    match store
        .operation_create(new, tokio::time::Instant::now() + Duration::from_secs(30))
        .await
        .expect("the intent is recorded")
    {
        CreateOutcome::Created(op) => op.id,
        CreateOutcome::Existing(op) => panic!("a fresh key joined {op:?}"),
    }
}

/// An attach left `UNKNOWN` by a replica that crashed after sending it:
/// its deadline passed and its lease over, so only the settle window
/// holds it open.
pub fn left_unknown_by_a_crash() -> volume_reconciler::store::NewOperation {
    volume_reconciler::store::NewOperation {
        state: volume_reconciler::domain::State::Unknown,
        attempts: 1,
        ..pending_attach(
            &format!("u-{}", uuid::Uuid::new_v4()),
            "crashed",
            Duration::ZERO,
            Duration::ZERO,
        )
    }
}

/// A caller's key, as a test names it (`None`: the anonymous caller).
pub fn ck(caller: Option<&str>, key: &str) -> volume_reconciler::domain::CallerKey {
    volume_reconciler::domain::CallerKey::parse(caller, key).expect("a valid key")
}
