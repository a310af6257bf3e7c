//! The staged shutdown's steps, in the order `run_until` takes them (see
//! the module `startup`): not ready while still serving for
//! `--shutdown-delay`; stop accepting and drain HTTP/2 with the two-phase
//! GOAWAY, up to `--drain-timeout`; hand the unfinished operations over to
//! the other replicas. And the signals that start it: SIGTERM, SIGINT.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::ServeArgs;
use crate::executor::Executor;
use crate::grpc::Api;
use crate::grpc::pb::volume_reconciler_server::VolumeReconcilerServer;
use crate::store::Store;

/// The gRPC server's task: it ends when the server has drained.
pub(super) type GrpcServer = tokio::task::JoinHandle<Result<(), tonic::transport::Error>>;

/// The staged shutdown's steps (see the module's comment).
pub(super) struct Stages<'a> {
    pub(super) cfg: &'a ServeArgs,
    pub(super) exec: &'a Arc<Executor>,
    pub(super) ready: &'a AtomicBool,
    pub(super) health: &'a tonic_health::server::HealthReporter,
}

impl Stages<'_> {
    /// Phase 1: not ready, but still serving while load balancers notice.
    pub(super) async fn not_ready(&self, server_ended_early: bool) {
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
    pub(super) async fn drain(
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
    pub(super) async fn hand_over(&self, store: &Arc<dyn Store>, drain_deadline: Instant) {
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
            .operation_release_leases(self.exec.replica(), &running)
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

/// Resolves on SIGTERM or SIGINT.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send {
    use tokio::signal::unix::{SignalKind, signal};
    // Listened for from this call on, not from the future's first poll: a
    // signal sent once it returned (after `dev`'s "Ctrl-C to stop") ends
    // the process in order instead of killing it.
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    async move {
        let term = async {
            match term {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot listen for SIGTERM");
                    std::future::pending::<()>().await;
                }
            }
        };
        let int = async {
            match int {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot listen for SIGINT");
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::select! {
            _ = term => tracing::info!("SIGTERM received"),
            _ = int => tracing::info!("SIGINT received"),
        }
    }
}
