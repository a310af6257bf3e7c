//! `Application::build(config)` → `run_until(shutdown)`: the one way the
//! server is put together, used by `main` and by the tests, so the tests
//! exercise the real chain.
//!
//! Shutdown is staged (see docs/operating.md, "Rolling restarts"): not ready at once;
//! keep serving for `--shutdown-delay`; then stop accepting and drain
//! HTTP/2 with the two-phase GOAWAY; wait for in-flight RPCs up to
//! `--drain-timeout`; hand unfinished operations to the other replicas'
//! reconcilers; close the database pool last.
//!
//! Why it is long: building the server and its staged shutdown belong
//! together (the shutdown undoes the build in reverse), and the admin
//! endpoints and Nova's start-up checks are the small rest.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::ServeArgs;
use crate::executor::Executor;
use crate::grpc::deadline::DeadlineLayer;
use crate::grpc::pb::volume_reconciler_server::VolumeReconcilerServer;
use crate::grpc::{Api, pb};
use crate::metrics::{GrpcMetricsLayer, Metrics, StageLabels};
use crate::nova::{Microversion, NovaClient};
use crate::reconciler::Reconciler;
use crate::store::Store;

/// Every service the gRPC port serves: the metrics layer takes its method
/// labels from them (any other path is labelled `unknown`).
const SERVED_DESCRIPTOR_SETS: &[&[u8]] = &[
    pb::FILE_DESCRIPTOR_SET,
    tonic_health::pb::FILE_DESCRIPTOR_SET,
    tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET,
];

pub struct Application {
    cfg: ServeArgs,
    grpc_listener: TcpListener,
    admin_listener: TcpListener,
    pub store: Arc<dyn Store>,
    pub exec: Arc<Executor>,
    pub reconciler: Arc<Reconciler>,
    pub pruner: Arc<crate::retention::Pruner>,
    pub metrics: Arc<Metrics>,
    /// The TLS configuration, when TLS is on (reloadable).
    pub tls: Option<Arc<crate::tls::Reloadable>>,
    ready: Arc<AtomicBool>,
    /// Stops background work started by `build` (Nova's version re-check).
    background: CancellationToken,
}

#[derive(Clone)]
struct AdminState {
    store: Arc<dyn Store>,
    /// The operation leases this replica holds (a gauge).
    exec: Arc<Executor>,
    metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
    /// The verification stages (for their backlog gauge).
    verification: [(u8, Duration); 2],
}

impl Application {
    /// Binds both listeners, connects to the database (applying pending
    /// migrations) and wires the executor and the reconciler.
    pub async fn build(cfg: ServeArgs) -> anyhow::Result<Self> {
        cfg.validate()?;
        let nova_cfg = cfg.nova_config()?;
        announce_openstack(&nova_cfg);
        let grpc_listener = TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on {} (gRPC): {e}", cfg.listen))?;
        let admin_listener = TcpListener::bind(cfg.admin_listen)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on {} (admin): {e}", cfg.admin_listen))?;
        let store: Arc<dyn Store> = crate::store::open_with(
            &cfg.database_url,
            cfg.db_max_connections,
            cfg.db_connect_timeout,
            cfg.db_bounds(),
        )
        .await
        .map_err(|e| e.context(crate::config::LEDGER_CONTEXT))?;
        let metrics = Arc::new(Metrics::new());
        store.observe(metrics.clone());
        let mut nova = observed_nova(nova_cfg, &metrics);
        let checked = check_nova(&mut nova, &cfg).await?;
        let nova = Arc::new(nova);
        nova.announce_confirmation();
        if let Some(auth) = nova.auth() {
            metrics.observe_keystone(auth.clone());
        }
        let background = CancellationToken::new();
        if !checked {
            tokio::spawn(recheck_nova(
                nova.clone(),
                cfg.nova_microversion,
                cfg.nova_discovery_timeout,
                background.clone(),
            ));
        }
        let exec = Executor::new(
            store.clone(),
            nova,
            cfg.budget_policy(),
            cfg.replica(),
            cfg.exec_settings(),
            metrics.clone(),
        );
        let reconciler = Reconciler::new(exec.clone(), cfg.reconciler_settings());
        let pruner =
            crate::retention::Pruner::new(store.clone(), cfg.retention_settings(), metrics.clone());
        let tls = match (&cfg.tls_cert, &cfg.tls_key) {
            (Some(cert), Some(key)) => Some(crate::tls::Reloadable::new(crate::tls::TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: cfg.tls_client_ca.clone(),
            })?),
            _ => None,
        };
        if let Some(tls) = &tls {
            metrics.observe_tls(tls.clone());
        }
        Ok(Self {
            tls,
            cfg,
            grpc_listener,
            admin_listener,
            store,
            exec,
            reconciler,
            pruner,
            metrics,
            ready: Arc::new(AtomicBool::new(false)),
            background,
        })
    }

    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_listener.local_addr().unwrap_or(self.cfg.listen)
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_listener
            .local_addr()
            .unwrap_or(self.cfg.admin_listen)
    }

    /// Serves until `shutdown` resolves, then drains in stages.
    pub async fn run_until(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> anyhow::Result<()> {
        let Application {
            cfg,
            grpc_listener,
            admin_listener,
            store,
            exec,
            reconciler,
            pruner,
            metrics,
            tls,
            ready,
            background,
        } = self;
        let (health, health_svc) = tonic_health::server::health_reporter();
        health.set_serving::<VolumeReconcilerServer<Api>>().await;
        let admin = AdminState {
            store: store.clone(),
            exec: exec.clone(),
            metrics: metrics.clone(),
            ready: ready.clone(),
            verification: reconciler.settings.verification_stages(),
        };
        let tasks = Tasks::start(&cfg, admin_listener, admin, &exec, &reconciler, pruner);
        let api = Api {
            exec: exec.clone(),
            reconciler: reconciler.clone(),
            metrics: metrics.clone(),
            watch_idle: cfg.watch_idle_timeout,
        };
        let drain = CancellationToken::new();
        if let Some(tls) = &tls {
            tls.watch(tasks.admin_stop.clone());
        }
        let mut server = spawn_grpc(
            &cfg,
            api,
            health_svc,
            &metrics,
            grpc_listener,
            tls.as_ref(),
            drain.clone(),
        )?;
        ready.store(true, Ordering::SeqCst);
        tracing::info!(replica = %exec.replica, "serving");

        let server_ended_early = tokio::select! {
            _ = shutdown => false,
            r = &mut server => {
                tracing::error!(result = ?r.as_ref().map(|x| x.as_ref().map_err(|e| e.to_string())), "gRPC server ended on its own");
                true
            }
        };
        let drain_deadline = Instant::now() + cfg.drain_timeout;
        let stages = Stages {
            cfg: &cfg,
            exec: &exec,
            ready: &ready,
            health: &health,
        };
        stages.not_ready(server_ended_early).await;
        stages
            .drain(drain, server, drain_deadline, server_ended_early)
            .await;

        // The reconciler stops; operation tasks get what is left of the
        // drain budget, then their leases go to other replicas.
        background.cancel();
        let tasks = tasks.stop_reconciling().await;
        stages.hand_over(&store, drain_deadline).await;
        let stopped = exec.stop_tasks().await;
        if stopped > 0 {
            tracing::info!(
                phase = "stop_tasks",
                stopped,
                "shutdown: operation tasks still running stopped; their leases lapse one lease from now"
            );
        }
        tasks.stop_the_rest().await;
        // The database pool last.
        store.close().await;
        tracing::info!(phase = "stopped", "shutdown complete");
        Ok(())
    }
}

/// Says at start what could surprise an operator later: TLS verification
/// off, and which Keystone identity and endpoint is used.
fn announce_openstack(nova_cfg: &crate::nova::NovaConfig) {
    if nova_cfg.tls.insecure {
        tracing::warn!(
            "TLS CERTIFICATE VERIFICATION IS OFF for Keystone and Nova (verify: false / OS_INSECURE): \
             anyone on the network path can impersonate them and read the credentials and tokens; \
             give their CA with OS_CACERT (or cacert in clouds.yaml) instead"
        );
    }
    if let crate::nova::NovaEndpoint::Keystone(k) = &nova_cfg.endpoint {
        tracing::info!(
            auth_url = %k.auth_url,
            credential = %k.credential.describe(),
            interface = %k.interface,
            region = k.region.as_deref().unwrap_or("-"),
            "Keystone mode"
        );
    }
}

/// The Nova client, reporting its slot waits and reachability as metrics.
fn observed_nova(nova_cfg: crate::nova::NovaConfig, metrics: &Arc<Metrics>) -> NovaClient {
    let slot_metrics = metrics.clone();
    let reach_metrics = metrics.clone();
    NovaClient::new(nova_cfg)
        .with_slot_wait_observer(Arc::new(move |waited| {
            slot_metrics.nova_slot_wait.observe(waited.as_secs_f64())
        }))
        .with_reachability_observer(Arc::new(move |answered| {
            // `set` answers the previous value, of no use here.
            reach_metrics.nova_reachable.set(i64::from(answered));
        }))
}

/// The replica's tasks beside the gRPC server, stopped in two steps: the
/// reconciler and the pruner first (no new work), then, once operation
/// tasks have handed over, the heartbeat and the admin listener.
struct Tasks {
    admin_stop: CancellationToken,
    admin: tokio::task::JoinHandle<()>,
    heartbeat_stop: CancellationToken,
    heartbeat: tokio::task::JoinHandle<()>,
    reconciler_stop: CancellationToken,
    reconciler: Option<tokio::task::JoinHandle<()>>,
    pruner: Option<tokio::task::JoinHandle<()>>,
}

impl Tasks {
    fn start(
        cfg: &ServeArgs,
        admin_listener: TcpListener,
        admin: AdminState,
        exec: &Arc<Executor>,
        reconciler: &Arc<Reconciler>,
        pruner: Arc<crate::retention::Pruner>,
    ) -> Self {
        let admin_stop = CancellationToken::new();
        let admin = serve_admin(admin_listener, admin, admin_stop.clone());
        // The heartbeat keeps this replica's leases while it lives (always,
        // even without a reconciler: executor runs hold leases too).
        let heartbeat_stop = CancellationToken::new();
        let heartbeat = tokio::spawn(exec.clone().heartbeat(heartbeat_stop.clone()));
        let reconciler_stop = CancellationToken::new();
        let reconciler = (!cfg.no_reconciler)
            .then(|| tokio::spawn(reconciler.clone().run(reconciler_stop.clone())));
        // Retention runs in every replica; one prunes at a time.
        let pruner = Some(tokio::spawn(pruner.run(reconciler_stop.clone())));
        Self {
            admin_stop,
            admin,
            heartbeat_stop,
            heartbeat,
            reconciler_stop,
            reconciler,
            pruner,
        }
    }

    async fn stop_reconciling(mut self) -> Self {
        self.reconciler_stop.cancel();
        if let Some(t) = self.reconciler.take() {
            joined(t, "reconciler").await;
        }
        if let Some(t) = self.pruner.take() {
            joined(t, "retention").await;
        }
        self
    }

    async fn stop_the_rest(self) {
        self.heartbeat_stop.cancel();
        joined(self.heartbeat, "heartbeat").await;
        self.admin_stop.cancel();
        joined(self.admin, "admin").await;
    }
}

/// Waits for a task; a panic or cancellation is logged, not propagated:
/// shutdown goes on with the next stage.
async fn joined(task: tokio::task::JoinHandle<()>, what: &str) {
    if let Err(e) = task.await {
        tracing::warn!(error = %e, "{what} task ended abnormally");
    }
}

/// Reads Nova's version document at start (`--nova-discovery-timeout`):
/// logs the range it supports, and speaks `--nova-microversion` only if it
/// lies in it (`latest`: its maximum). `Ok(false)`: Nova or Keystone could
/// not be reached, which is a warning (and `nova_reachable` 0), not a
/// failure — unless the microversion is `latest`, which needs the
/// document.
async fn check_nova(nova: &mut NovaClient, cfg: &ServeArgs) -> anyhow::Result<bool> {
    let wanted = cfg.nova_microversion;
    let deadline = Instant::now() + cfg.nova_discovery_timeout;
    match nova.discover(deadline).await {
        Ok((url, range)) => {
            nova.adopt(range).map_err(|e| {
                anyhow::anyhow!("--nova-microversion: {e} (its version document: {url})")
            })?;
            tracing::info!(
                url = %url,
                supported = %range,
                using = %nova.microversion(),
                "Nova's microversions"
            );
            Ok(true)
        }
        Err(e) if wanted == Microversion::Latest => anyhow::bail!(
            "--nova-microversion latest needs Nova's version document at start, and it could not be read: {e}"
        ),
        Err(e) if e.status.is_some() => {
            tracing::warn!(
                error = %e,
                microversion = %wanted,
                "Nova answered, but not with a version document: --nova-microversion is not checked"
            );
            Ok(true)
        }
        Err(e) if e.kind == crate::nova::NovaErrorKind::AuthFailed => {
            tracing::warn!(
                error = %e,
                "no Keystone token at start; serving anyway: requests fail with KEYSTONE_AUTH_FAILED until Keystone answers"
            );
            Ok(false)
        }
        Err(e) => {
            tracing::warn!(
                error = %e,
                "Nova is unreachable at start; serving anyway: requests fail with NOVA_UNREACHABLE until it answers"
            );
            Ok(false)
        }
    }
}

/// After an unreachable start: fetches Nova's version document again,
/// backing off to 30 s, until Nova answers; then says whether the
/// configured microversion is one it supports (it is too late to refuse
/// to start: the answer is an error in the log).
async fn recheck_nova(
    nova: Arc<NovaClient>,
    wanted: Microversion,
    timeout: Duration,
    stop: CancellationToken,
) {
    use backon::BackoffBuilder as _;
    let mut pauses = backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_secs(1))
        .with_max_delay(Duration::from_secs(30))
        .with_jitter()
        .without_max_times()
        .build();
    loop {
        let pause = pauses.next().unwrap_or(Duration::from_secs(30));
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        let found = tokio::select! {
            _ = stop.cancelled() => return,
            r = nova.discover(Instant::now() + timeout) => r,
        };
        match found {
            Ok((url, range)) => {
                match range.choose(wanted) {
                    Ok(_) => {
                        tracing::info!(url = %url, supported = %range, using = %nova.microversion(), "Nova answers; its microversions")
                    }
                    Err(e) => tracing::error!(
                        url = %url,
                        "--nova-microversion: {e}: Nova refuses every request (406) until the setting is changed and the service restarted"
                    ),
                }
                return;
            }
            Err(e) if e.status.is_some() => return,
            Err(e) => tracing::debug!(error = %e, "Nova's version document: still unreachable"),
        }
    }
}

type GrpcServer = tokio::task::JoinHandle<Result<(), tonic::transport::Error>>;

/// The staged shutdown's steps (see the module's comment).
struct Stages<'a> {
    cfg: &'a ServeArgs,
    exec: &'a Arc<Executor>,
    ready: &'a AtomicBool,
    health: &'a tonic_health::server::HealthReporter,
}

impl Stages<'_> {
    /// Phase 1: not ready, but still serving while load balancers notice.
    async fn not_ready(&self, server_ended_early: bool) {
        self.ready.store(false, Ordering::SeqCst);
        self.health
            .set_not_serving::<VolumeReconcilerServer<Api>>()
            .await;
        self.health
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
        tracing::info!(
            phase = "not_ready",
            running_operations = self.exec.running(),
            delay_ms = self.cfg.shutdown_delay.as_millis() as u64,
            "shutdown: reporting NOT_SERVING; still serving while load balancers notice"
        );
        if !server_ended_early {
            tokio::time::sleep(self.cfg.shutdown_delay).await;
        }
    }

    /// Phase 2: stop accepting; GOAWAY; wait for in-flight RPCs.
    async fn drain(
        &self,
        drain: CancellationToken,
        mut server: GrpcServer,
        drain_deadline: Instant,
        server_ended_early: bool,
    ) {
        tracing::info!(
            phase = "drain",
            running_operations = self.exec.running(),
            timeout_ms = self.cfg.drain_timeout.as_millis() as u64,
            "shutdown: closing the listener and draining connections (GOAWAY)"
        );
        drain.cancel();
        if server_ended_early {
            return;
        }
        match tokio::time::timeout_at(drain_deadline, &mut server).await {
            Ok(Ok(Ok(()))) => tracing::info!(phase = "drained", "shutdown: all connections closed"),
            Ok(Ok(Err(e))) => {
                tracing::warn!(error = %e, "shutdown: the gRPC server ended with an error")
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "shutdown: the gRPC server task failed"),
            Err(_) => {
                tracing::warn!(
                    phase = "drain_timeout",
                    running_operations = self.exec.running(),
                    "shutdown: drain timeout; closing the remaining connections"
                );
                server.abort();
            }
        }
    }

    /// Phase 3: operation tasks get what is left of the drain budget; the
    /// leases of those still running go to the other replicas.
    async fn hand_over(&self, store: &Arc<dyn Store>, drain_deadline: Instant) {
        let idle = self
            .exec
            .wait_idle(drain_deadline.max(Instant::now() + Duration::from_millis(10)))
            .await;
        // Leases of operations whose task still runs here stay this
        // replica's until the process ends (they lapse one lease later):
        // released now, another replica could take one over while its
        // task here may still send a request.
        let running = self.exec.held();
        let handed = match store
            .operation_release_leases(&self.exec.replica, &running)
            .await
        {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "shutdown: could not release leases; they expire by themselves");
                0
            }
        };
        tracing::info!(
            phase = "handover",
            operations_unfinished = self.exec.running(),
            leases_released = handed,
            all_tasks_done = idle,
            "shutdown: unfinished operations handed to the other replicas' reconcilers"
        );
    }
}

/// The admin listener: /healthz, /readyz, /metrics, until `stop`.
fn serve_admin(
    listener: TcpListener,
    state: AdminState,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let admin = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(state);
    tokio::spawn(async move {
        let r = axum::serve(listener, admin)
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await;
        if let Err(e) = r {
            tracing::error!(error = %e, "admin listener failed");
        }
    })
}

/// The gRPC server chain, with the deadline layer outermost of ours,
/// serving `listener` (through TLS when on) until `drain`.
fn spawn_grpc(
    cfg: &ServeArgs,
    api: Api,
    health_svc: tonic_health::pb::health_server::HealthServer<
        impl tonic_health::pb::health_server::Health,
    >,
    metrics: &Arc<Metrics>,
    listener: TcpListener,
    tls: Option<&Arc<crate::tls::Reloadable>>,
    drain: CancellationToken,
) -> anyhow::Result<GrpcServer> {
    let reflection_v1 = reflection()
        .build_v1()
        .map_err(|e| anyhow::anyhow!("building the reflection service (v1): {e}"))?;
    let reflection_v1alpha = reflection()
        .build_v1alpha()
        .map_err(|e| anyhow::anyhow!("building the reflection service (v1alpha): {e}"))?;
    let service = VolumeReconcilerServer::new(api).max_decoding_message_size(cfg.max_message_bytes);
    let mut builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(cfg.http2_keepalive_interval))
        .http2_keepalive_timeout(Some(cfg.http2_keepalive_timeout))
        .max_concurrent_streams(Some(cfg.max_concurrent_streams))
        .http2_max_header_list_size(Some(cfg.max_metadata_bytes))
        .tcp_nodelay(true);
    if let Some(age) = cfg.max_connection_age {
        // Only the age, never `max_connection_age_grace`: in tonic
        // 0.14.9 the grace drops connections without a GOAWAY.
        builder = builder.max_connection_age(age);
    }
    let auth = crate::grpc::auth::AuthPolicy::from_settings(
        cfg.auth_tokens.as_deref(),
        cfg.tls_client_ca.is_some(),
        cfg.tls_client_roles.as_deref(),
    )?;
    // The metrics layer outermost: it sees every answer, those of the
    // layers below included.
    let grpc_metrics = GrpcMetricsLayer::new(metrics.clone(), SERVED_DESCRIPTOR_SETS)?;
    let router = builder
        .layer(grpc_metrics)
        .layer(DeadlineLayer::new(
            cfg.default_deadline,
            cfg.budget_policy(),
            metrics.clone(),
        ))
        .layer(crate::grpc::auth::AuthLayer::new(auth))
        .layer(crate::grpc::overload::OverloadLayer::new(
            &crate::grpc::overload::Limits {
                max_inflight_mutations: cfg.max_inflight_mutations as usize,
                max_inflight_reads: cfg.max_inflight_reads as usize,
                max_watch_streams: cfg.max_watch_streams as usize,
                caller_rate: cfg.caller_rate_limit,
                caller_burst: cfg.caller_burst,
            },
            metrics.clone(),
        ))
        .layer(crate::grpc::overload::MessageLimitLayer {
            limit: cfg.max_message_bytes,
        })
        .add_service(health_svc)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(service);
    let shutdown = async move { drain.cancelled().await };
    Ok(match tls {
        Some(tls) => {
            let incoming = crate::tls::incoming(listener, tls.clone(), cfg.tls_handshake_timeout);
            tokio::spawn(router.serve_with_incoming_shutdown(incoming, shutdown))
        }
        None => {
            tokio::spawn(router.serve_with_incoming_shutdown(plain_incoming(listener), shutdown))
        }
    })
}

/// What reflection describes: the API, health, and the types an error's
/// details are made of (`google.rpc.Status`, `ErrorInfo`, `BadRequest`...,
/// with the well-known `Any` and `Duration` they import; `Timestamp` comes
/// with the API), so a tool like grpcurl decodes `ErrorInfo` instead of
/// printing bytes. Served as v1 and as v1alpha, which many clients
/// (Postman, Kreya, older grpcurl) still ask for.
fn reflection() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
        // Each version lists both reflection services, not only itself.
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET)
}

/// How long readiness waits for the database: within a probe's usual
/// timeout (Kubernetes' default is 1 s, the kit's 3 s).
const READY_DB_CHECK: Duration = Duration::from_secs(2);

/// `/readyz`: 200 when serving and the database answers; else 503 with
/// what is wrong (draining; the database's error, or its silence).
async fn readyz(State(st): State<AdminState>) -> (StatusCode, String) {
    if !st.ready.load(Ordering::SeqCst) {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining\n".into());
    }
    match tokio::time::timeout(READY_DB_CHECK, st.store.ping()).await {
        Ok(Ok(())) => (StatusCode::OK, "ready\n".into()),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "readiness: database check failed");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("database unreachable: {e}\n"),
            )
        }
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "database did not answer within {} ms (its connections may have gone silent; they are being replaced)\n",
                READY_DB_CHECK.as_millis()
            ),
        ),
    }
}

async fn metrics_text(
    State(st): State<AdminState>,
) -> (StatusCode, [(&'static str, &'static str); 1], String) {
    let database_ok = match st.store.operation_open_by_state().await {
        Ok(counts) => {
            st.metrics.set_open_operations(&counts);
            let unknown: i64 = counts
                .iter()
                .filter(|c| c.state == crate::domain::State::Unknown.as_str())
                .map(|c| c.count)
                .sum();
            let age = if unknown == 0 {
                Ok(0.0)
            } else {
                oldest_unknown_age(st.store.as_ref()).await
            };
            match age {
                Ok(secs) => {
                    st.metrics.oldest_unknown_age.set(secs);
                }
                Err(e) => {
                    // NaN, not a stale value: an alert on it stays quiet
                    // rather than firing on (or hiding behind) old data.
                    tracing::warn!(error = %e, "metrics: could not read the UNKNOWN operations");
                    st.metrics.oldest_unknown_age.set(f64::NAN);
                }
            }
            true
        }
        Err(e) => {
            tracing::warn!(error = %e, "metrics: could not count the open operations");
            false
        }
    };
    if database_ok {
        retention_age(&st).await;
        verification_backlog(&st).await;
    }
    st.metrics.set_saturation(st.store.saturation());
    st.metrics.leases_held.set(st.exec.held().len() as i64);
    st.metrics
        .ready
        .set(i64::from(st.ready.load(Ordering::SeqCst) && database_ok));
    (
        StatusCode::OK,
        [(
            "content-type",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        st.metrics.render(),
    )
}

/// Sets the age of the oldest decided operation (0: none), on the
/// database's clock; NaN when it cannot be read (an alert on it stays
/// quiet rather than firing on stale data).
async fn retention_age(st: &AdminState) {
    let read = async {
        let oldest = st.store.retention_oldest_decided().await?;
        let now = st.store.now().await?;
        Ok::<_, crate::store::StoreError>(
            oldest.map_or(0.0, |t| (now - t).num_milliseconds().max(0) as f64 / 1000.0),
        )
    };
    match read.await {
        Ok(age) => st.metrics.retention_oldest_decided_age.set(age),
        Err(e) => {
            tracing::warn!(error = %e, "metrics: could not read the oldest decision");
            st.metrics.retention_oldest_decided_age.set(f64::NAN)
        }
    };
}

/// Sets, per verification stage, how long its oldest due decision has
/// waited past its due time (0: up to date), on the database's clock; NaN
/// when it cannot be read.
async fn verification_backlog(st: &AdminState) {
    for (stage, delay) in st.verification {
        let read = async {
            let Some(decided) = st.store.verification_backlog(stage, delay).await? else {
                return Ok(0.0);
            };
            let now = st.store.now().await?;
            let due = decided + chrono::Duration::from_std(delay).unwrap_or_default();
            Ok::<_, crate::store::StoreError>((now - due).num_milliseconds().max(0) as f64 / 1000.0)
        };
        let name = if stage == 0 { "first" } else { "last" };
        let secs = match read.await {
            Ok(secs) => secs,
            Err(e) => {
                tracing::warn!(error = %e, stage = name, "metrics: could not read the verification backlog");
                f64::NAN
            }
        };
        // The family's guard is not held across an await.
        st.metrics
            .verification_backlog
            .get_or_create(&StageLabels { stage: name.into() })
            .set(secs);
    }
}

/// Seconds since Nova was last asked about the oldest UNKNOWN operation
/// (since it was recorded, if it never was).
async fn oldest_unknown_age(store: &dyn Store) -> Result<f64, crate::store::StoreError> {
    Ok(match store.oldest_unknown_since().await? {
        Some(since) => (chrono::Utc::now() - since).num_milliseconds().max(0) as f64 / 1000.0,
        None => 0.0,
    })
}

/// Accepted plaintext gRPC connections, each with Nagle's algorithm off.
/// tonic's `tcp_nodelay(true)` applies only to listeners tonic binds itself;
/// on a socket accepted here with Nagle on, a client that does not piggyback
/// its ACKs waits out the peer's delayed ACK (~40 ms) on every call.
fn plain_incoming(
    listener: TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt as _;
    tokio_stream::wrappers::TcpListenerStream::new(listener).map(|accepted| {
        accepted.inspect(|tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                // The connection still works, only slower for some clients.
                tracing::warn!(error = %e, "could not turn Nagle's algorithm off on a gRPC connection");
            }
        })
    })
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = term => tracing::info!("SIGTERM received"),
        r = tokio::signal::ctrl_c() => match r {
            Ok(()) => tracing::info!("SIGINT received"),
            Err(e) => { tracing::error!(error = %e, "cannot listen for SIGINT"); std::future::pending::<()>().await }
        },
    }
}
