//! `Application::build(config)` → `run_until(shutdown)`: the one way the
//! server is put together, used by `main` and by the tests, so the tests
//! exercise the real chain.
//!
//! Shutdown is staged (see docs/operating.md, "Rolling restarts"): not ready at once;
//! keep serving for `--shutdown-delay`; then stop accepting and drain
//! HTTP/2 with the two-phase GOAWAY; wait for in-flight RPCs up to
//! `--drain-timeout`; hand unfinished operations to the other replicas'
//! reconcilers; close the database pool last. `run_until` calls the stages
//! in that order, undoing the build in reverse.
//!
//! - `shutdown`: the staged shutdown's steps, and the signals that start it.
//! - `admin`: the admin listener: `/healthz`, `/readyz`, `/metrics`.
//! - `nova_checks`: Nova's version document read at start, and read again
//!   until Nova answers when it could not be at start.
//! - `reach`: Nova's and the database's reachability, edge by edge (one
//!   line when it goes, one when it comes back).
//! - `probe`: what feeds them: every Nova request, a probe of Nova when
//!   no request reached it for an interval, a periodic database check.

mod admin;
mod nova_checks;
pub mod probe;
pub mod reach;
mod shutdown;

pub use shutdown::shutdown_signal;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::ServeArgs;
use crate::executor::Executor;
use crate::executor::metrics::ExecutorMetrics;
use crate::grpc::deadline::DeadlineLayer;
use crate::grpc::metrics::{GrpcMetrics, GrpcMetricsLayer};
use crate::grpc::pb::volume_reconciler_server::VolumeReconcilerServer;
use crate::grpc::{Api, pb};
use crate::metrics::Metrics;
use crate::nova::NovaClient;
use crate::nova::metrics::NovaMetrics;
use crate::reconciler::Reconciler;
use crate::reconciler::metrics::ReconcilerMetrics;
use crate::retention::metrics::RetentionMetrics;
use crate::store::Store;
use crate::store::metrics::StoreMetrics;
use admin::{AdminState, serve_admin};
use nova_checks::{check_nova, recheck_nova};
use shutdown::{GrpcServer, Stages};

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
    /// The Nova client the executor and the reconciler share (its probe's
    /// too).
    pub nova: Arc<NovaClient>,
    pub reconciler: Arc<Reconciler>,
    pub pruner: Arc<crate::retention::Pruner>,
    pub metrics: Arc<Metrics>,
    /// The families the scrape sets and the server chain records into
    /// (the others are held by what records them).
    store_metrics: Arc<StoreMetrics>,
    grpc_metrics: Arc<GrpcMetrics>,
    ready_gauge: prometheus_client::metrics::gauge::Gauge,
    /// The TLS configuration, when TLS is on (reloadable).
    pub tls: Option<Arc<crate::tls::Reloadable>>,
    ready: Arc<AtomicBool>,
    /// Stops background work started by `build` (Nova's version re-check)
    /// and by `run_until` (the probes, the failure summaries).
    background: CancellationToken,
    /// Nova's and the database's reachability.
    nova_reach: Arc<reach::Reach>,
    db_reach: Arc<reach::Reach>,
}

impl Application {
    /// Binds both listeners, connects to the database (applying pending
    /// migrations) and wires the executor and the reconciler. Long on
    /// purpose: the whole assembly of the service in the order it happens,
    /// the one place to read what `main` builds.
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
            cfg.max_queued_writes,
        )
        .await
        .map_err(|e| e.context(crate::config::LEDGER_CONTEXT))?;
        // Each room's families, registered into the one registry.
        let metrics = Arc::new(Metrics::new());
        let store_metrics = StoreMetrics::new(&metrics);
        let nova_metrics = NovaMetrics::new(&metrics);
        let grpc_metrics = GrpcMetrics::new(&metrics);
        let ready_gauge = admin::ready_gauge(&metrics);
        let db_reach = Arc::new(reach::Reach::new("database", "round trip"));
        store.observe(Arc::new(probe::ObservedDb {
            metrics: store_metrics.clone(),
            reach: db_reach.clone(),
        }));
        let nova_reach = Arc::new(reach::Reach::new("Nova", "request"));
        let mut nova = observed_nova(nova_cfg, &nova_metrics, &nova_reach);
        let checked = check_nova(&mut nova, &cfg).await?;
        let nova = Arc::new(nova);
        nova.announce_confirmation();
        if let Some(auth) = nova.auth() {
            crate::nova::metrics::observe_keystone(&metrics, auth.clone());
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
            nova.clone(),
            cfg.budget_policy(),
            cfg.replica(),
            cfg.exec_settings(),
            ExecutorMetrics::new(&metrics, nova_metrics.clone()),
        );
        exec.set_quotas(Arc::new(cfg.caller_quotas()?));
        let reconciler = reconciler_of(
            &cfg,
            &exec,
            &store,
            &nova,
            ReconcilerMetrics::new(&metrics, nova_metrics),
        );
        let pruner = crate::retention::Pruner::new(
            store.clone(),
            cfg.retention_settings(),
            RetentionMetrics::new(&metrics),
        );
        let tls = match (&cfg.tls_cert, &cfg.tls_key) {
            (Some(cert), Some(key)) => Some(crate::tls::Reloadable::new(crate::tls::TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: cfg.tls_client_ca.clone(),
            })?),
            _ => None,
        };
        if let Some(tls) = &tls {
            crate::tls::metrics::observe(&metrics, tls.clone());
        }
        Ok(Self {
            tls,
            cfg,
            grpc_listener,
            admin_listener,
            store,
            exec,
            nova,
            reconciler,
            pruner,
            metrics,
            store_metrics,
            grpc_metrics,
            ready_gauge,
            ready: Arc::new(AtomicBool::new(false)),
            background,
            nova_reach,
            db_reach,
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
    ///
    /// Why it is long: it is the replica's life in order (what serves
    /// beside the gRPC server is started, then the stages of the shutdown,
    /// each logged), and a reader follows one sequence, not a call tree.
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
            nova,
            reconciler,
            pruner,
            metrics,
            store_metrics,
            grpc_metrics,
            ready_gauge,
            tls,
            ready,
            background,
            nova_reach,
            db_reach,
        } = self;
        let (health, health_svc) = tonic_health::server::health_reporter();
        health.set_serving::<VolumeReconcilerServer<Api>>().await;
        let admin = AdminState {
            store: store.clone(),
            exec: exec.clone(),
            metrics: metrics.clone(),
            store_metrics,
            reconciler_metrics: reconciler.metrics.clone(),
            retention_metrics: pruner.metrics.clone(),
            ready_gauge,
            ready: ready.clone(),
            db: db_reach.clone(),
            ready_db_grace: cfg.ready_db_grace,
            verification: reconciler.settings.verification_stages(),
        };
        spawn_watchers(
            &cfg,
            &nova,
            &reconciler.metrics.nova,
            nova_reach,
            db_reach,
            &store,
            &background,
        );
        // The failure summaries' warn lines (the executor's and its
        // reconciler's), until the same stop.
        let failures = exec.failures().clone();
        let stop = background.clone();
        tokio::spawn(async move {
            failures
                .run(crate::telemetry::summary::SUMMARY_INTERVAL, stop)
                .await
        });
        let tasks = Tasks::start(&cfg, admin_listener, admin, &exec, &reconciler, pruner);
        let api = Api {
            exec: exec.clone(),
            store: store.clone(),
            reconciler: reconciler.clone(),
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
            &grpc_metrics,
            grpc_listener,
            tls.as_ref(),
            drain.clone(),
        )?;
        ready.store(true, Ordering::SeqCst);
        tracing::info!(replica = %exec.replica(), "serving");

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

/// The Nova client, reporting its slot waits as metrics and what each
/// request says of Nova's reachability to `reach` (and its gauges).
fn observed_nova(
    nova_cfg: crate::nova::NovaConfig,
    metrics: &Arc<NovaMetrics>,
    reach: &Arc<reach::Reach>,
) -> NovaClient {
    let slot_metrics = metrics.clone();
    NovaClient::new(nova_cfg)
        .with_slot_wait_observer(Arc::new(move |waited| {
            slot_metrics.slot_wait.observe(waited.as_secs_f64())
        }))
        .with_reachability_observer(probe::nova_observer(metrics.clone(), reach.clone()))
}

/// The reconciler beside `exec`, given its own dependencies (the same
/// store, Nova client and metrics; the executor's policy, replica name,
/// lease and failure summaries).
fn reconciler_of(
    cfg: &ServeArgs,
    exec: &Arc<Executor>,
    store: &Arc<dyn Store>,
    nova: &Arc<NovaClient>,
    metrics: Arc<ReconcilerMetrics>,
) -> Arc<Reconciler> {
    let deps = crate::reconciler::Deps {
        store: store.clone(),
        nova: nova.clone(),
        policy: cfg.budget_policy(),
        replica: cfg.replica(),
        lease: cfg.exec_settings().lease,
        metrics,
        failures: exec.failures().clone(),
    };
    Reconciler::new(exec.clone(), deps, cfg.reconciler_settings())
}

/// The watchers beside serving, until `stop`: Nova's probe and the
/// database check (readiness reads it).
fn spawn_watchers(
    cfg: &ServeArgs,
    nova: &Arc<NovaClient>,
    nova_metrics: &Arc<crate::nova::metrics::NovaMetrics>,
    nova_reach: Arc<reach::Reach>,
    db_reach: Arc<reach::Reach>,
    store: &Arc<dyn Store>,
    stop: &CancellationToken,
) {
    let nova_probe = probe::NovaProbe {
        nova: nova.clone(),
        reach: nova_reach,
        metrics: nova_metrics.clone(),
        interval: cfg.nova_probe_interval,
        timeout: cfg.nova_probe_timeout,
    };
    tokio::spawn(nova_probe.run(stop.clone()));
    let db_check = probe::DbCheck {
        store: store.clone(),
        reach: db_reach,
    };
    tokio::spawn(db_check.run(stop.clone()));
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

/// The gRPC server chain, with the deadline layer outermost of ours,
/// serving `listener` (through TLS when on) until `drain`.
fn spawn_grpc(
    cfg: &ServeArgs,
    api: Api,
    health_svc: tonic_health::pb::health_server::HealthServer<
        impl tonic_health::pb::health_server::Health,
    >,
    metrics: &Arc<GrpcMetrics>,
    listener: TcpListener,
    tls: Option<&Arc<crate::tls::Reloadable>>,
    drain: CancellationToken,
) -> anyhow::Result<GrpcServer> {
    let quotas = api.exec.quotas();
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
                quotas: quotas.clone(),
            },
            metrics.clone(),
        ))
        .layer(crate::grpc::message_limit::MessageLimitLayer {
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
