//! `Application::build(config)` → `run_until(shutdown)`: the one way the
//! server is put together, used by `main` and by the tests, so the tests
//! exercise the real chain.
//!
//! Shutdown is staged (see README "Rolling restarts"): not ready at once;
//! keep serving for `--shutdown-delay`; then stop accepting and drain
//! HTTP/2 with the two-phase GOAWAY; wait for in-flight RPCs up to
//! `--drain-timeout`; hand unfinished operations to the other replicas'
//! reconcilers; close the database pool last.

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
use crate::metrics::Metrics;
use crate::nova::NovaClient;
use crate::reconciler::Reconciler;
use crate::store::Store;

pub struct Application {
    cfg: ServeArgs,
    grpc_listener: TcpListener,
    admin_listener: TcpListener,
    pub store: Arc<dyn Store>,
    pub exec: Arc<Executor>,
    pub reconciler: Arc<Reconciler>,
    pub metrics: Arc<Metrics>,
    /// The TLS configuration, when TLS is on (reloadable).
    pub tls: Option<Arc<crate::tls::Reloadable>>,
    ready: Arc<AtomicBool>,
}

#[derive(Clone)]
struct AdminState {
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
}

impl Application {
    /// Binds both listeners, connects to the database (applying pending
    /// migrations) and wires the executor and the reconciler.
    pub async fn build(cfg: ServeArgs) -> anyhow::Result<Self> {
        let nova_cfg = cfg.nova_config()?;
        let grpc_listener = TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on {} (gRPC): {e}", cfg.listen))?;
        let admin_listener = TcpListener::bind(cfg.admin_listen)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on {} (admin): {e}", cfg.admin_listen))?;
        let store: Arc<dyn Store> =
            crate::store::open(&cfg.database_url, cfg.db_max_connections).await?;
        let metrics = Arc::new(Metrics::new());
        let slot_metrics = metrics.clone();
        let nova = Arc::new(NovaClient::new(nova_cfg).with_slot_wait_observer(Arc::new(
            move |waited| slot_metrics.nova_slot_wait.observe(waited.as_secs_f64()),
        )));
        nova.announce_confirmation();
        let exec = Executor::new(
            store.clone(),
            nova,
            cfg.budget_policy(),
            cfg.replica(),
            cfg.exec_settings(),
            metrics.clone(),
        );
        let reconciler = Reconciler::new(exec.clone(), cfg.reconciler_settings());
        let tls = match (&cfg.tls_cert, &cfg.tls_key) {
            (Some(cert), Some(key)) => Some(crate::tls::Reloadable::new(crate::tls::TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: cfg.tls_client_ca.clone(),
            })?),
            _ => None,
        };
        Ok(Self {
            tls,
            cfg,
            grpc_listener,
            admin_listener,
            store,
            exec,
            reconciler,
            metrics,
            ready: Arc::new(AtomicBool::new(false)),
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
            metrics,
            tls,
            ready,
        } = self;
        let (health, health_svc) = tonic_health::server::health_reporter();
        health.set_serving::<VolumeReconcilerServer<Api>>().await;
        let admin_stop = CancellationToken::new();
        let admin_task = serve_admin(
            admin_listener,
            AdminState {
                store: store.clone(),
                metrics: metrics.clone(),
                ready: ready.clone(),
            },
            admin_stop.clone(),
        );
        let reconciler_stop = CancellationToken::new();
        let reconciler_task = (!cfg.no_reconciler)
            .then(|| tokio::spawn(reconciler.clone().run(reconciler_stop.clone())));
        let api = Api {
            exec: exec.clone(),
            reconciler: reconciler.clone(),
            metrics: metrics.clone(),
            watch_idle: cfg.watch_idle_timeout,
        };
        let drain = CancellationToken::new();
        if let Some(tls) = &tls {
            tls.watch(admin_stop.clone());
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
        reconciler_stop.cancel();
        if let Some(t) = reconciler_task
            && let Err(e) = t.await
        {
            tracing::warn!(error = %e, "reconciler task ended abnormally");
        }
        stages.hand_over(&store, drain_deadline).await;

        // The admin listener, then the database pool last.
        admin_stop.cancel();
        if let Err(e) = admin_task.await {
            tracing::warn!(error = %e, "admin task ended abnormally");
        }
        store.close().await;
        tracing::info!(phase = "stopped", "shutdown complete");
        Ok(())
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
        let handed = match store.operation_release_leases(&self.exec.replica).await {
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
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| anyhow::anyhow!("building the reflection service: {e}"))?;
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
    let tokens = crate::grpc::auth::TokenSet::parse(cfg.auth_tokens.as_deref().unwrap_or(""))
        .map_err(|e| anyhow::anyhow!("--auth-tokens: {e}"))?;
    if tokens.is_empty() && cfg.tls_client_ca.is_none() {
        tracing::warn!(
            "no caller authentication configured (--auth-tokens, --tls-client-ca): anyone who reaches the gRPC port can attach volumes"
        );
    }
    let router = builder
        .layer(DeadlineLayer::new(
            cfg.default_deadline,
            cfg.budget_policy(),
            metrics.clone(),
        ))
        .layer(crate::grpc::auth::AuthLayer::new(tokens))
        .layer(crate::grpc::overload::OverloadLayer::new(
            cfg.max_inflight_mutations,
            cfg.caller_rate_limit,
            cfg.caller_burst,
        ))
        .layer(crate::grpc::overload::MessageLimitLayer {
            limit: cfg.max_message_bytes,
        })
        .add_service(health_svc)
        .add_service(reflection)
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

async fn readyz(State(st): State<AdminState>) -> (StatusCode, &'static str) {
    if !st.ready.load(Ordering::SeqCst) {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining\n");
    }
    match tokio::time::timeout(Duration::from_secs(2), st.store.ping()).await {
        Ok(Ok(())) => (StatusCode::OK, "ready\n"),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "readiness: database check failed");
            (StatusCode::SERVICE_UNAVAILABLE, "database unreachable\n")
        }
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "database did not answer within 2s\n",
        ),
    }
}

async fn metrics_text(
    State(st): State<AdminState>,
) -> (StatusCode, [(&'static str, &'static str); 1], String) {
    match st.store.operation_count_by_state().await {
        Ok(counts) => st.metrics.set_operation_counts(&counts),
        Err(e) => tracing::warn!(error = %e, "metrics: could not count operations"),
    }
    (
        StatusCode::OK,
        [(
            "content-type",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        st.metrics.render(),
    )
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
