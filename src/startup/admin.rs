//! The admin listener, beside the gRPC port: `/healthz` (always 200: it
//! never waits on the database), `/readyz` (see [`readiness`]), and
//! `/metrics`, whose scrape first sets the gauges read from
//! the ledger and the store (open operations, the oldest UNKNOWN, retention
//! and verification ages, saturation, leases held).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use prometheus_client::metrics::gauge::Gauge;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::executor::Executor;
use crate::metrics::Metrics;
use crate::reconciler::metrics::{ReconcilerMetrics, StageLabels};
use crate::retention::metrics::RetentionMetrics;
use crate::store::Store;
use crate::store::metrics::StoreMetrics;

/// The readiness gauge, registered into `metrics`: set at each scrape, so
/// `sum()` over replicas counts the ready ones.
pub(super) fn ready_gauge(metrics: &Metrics) -> Gauge {
    let gauge = Gauge::default();
    metrics.register(|r| {
        r.register(
            "ready",
            "1 while this replica is ready (serving, not draining, database reachable)",
            gauge.clone(),
        )
    });
    gauge
}

#[derive(Clone)]
pub(super) struct AdminState {
    pub(super) store: Arc<dyn Store>,
    /// The operation leases this replica holds (a gauge).
    pub(super) exec: Arc<Executor>,
    /// The registry `/metrics` renders.
    pub(super) metrics: Arc<Metrics>,
    /// The families set at each scrape (besides the executor's leases).
    pub(super) store_metrics: Arc<StoreMetrics>,
    pub(super) reconciler_metrics: Arc<ReconcilerMetrics>,
    pub(super) retention_metrics: Arc<RetentionMetrics>,
    /// 1 while this replica would answer `/readyz` with 200.
    pub(super) ready_gauge: Gauge,
    pub(super) ready: Arc<AtomicBool>,
    /// The database's reachability, as the periodic check finds it.
    pub(super) db: Arc<super::reach::Reach>,
    /// `--ready-db-grace`.
    pub(super) ready_db_grace: Duration,
    /// The verification stages (for their backlog gauge).
    pub(super) verification: [(u8, Duration); 2],
}

/// The admin listener: /healthz, /readyz, /metrics, until `stop`.
pub(super) fn serve_admin(
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

/// Whether this replica should receive traffic, and why: not while it
/// drains, nor once the database has been unreachable for longer than
/// `--ready-db-grace` (by the periodic check, `probe::DbCheck`). Within
/// the grace it stays ready: a database blip shared by every replica must
/// not take them all out of the Service at once, and callers meanwhile get
/// the service's own DATABASE_UNAVAILABLE with a retry hint rather than a
/// connection error. Never waits on the database itself.
pub(super) fn readiness(st: &AdminState) -> Result<String, String> {
    if !st.ready.load(Ordering::SeqCst) {
        return Err("draining\n".into());
    }
    match st.db.down_for() {
        None => Ok("ready\n".into()),
        Some((down, error)) if down > st.ready_db_grace => Err(format!(
            "database unreachable for {} (longer than --ready-db-grace {}): {error}\n",
            super::reach::render(down),
            crate::domain::parse::render_duration(st.ready_db_grace)
        )),
        Some((down, error)) => Ok(format!(
            "ready (database unreachable for {}; not ready after --ready-db-grace {}): {error}\n",
            super::reach::render(down),
            crate::domain::parse::render_duration(st.ready_db_grace)
        )),
    }
}

/// `/readyz`: 200 or 503 as [`readiness`] decides, with its reason.
async fn readyz(State(st): State<AdminState>) -> (StatusCode, String) {
    match readiness(&st) {
        Ok(why) => (StatusCode::OK, why),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
    }
}

async fn metrics_text(
    State(st): State<AdminState>,
) -> (StatusCode, [(&'static str, &'static str); 1], String) {
    let database_ok = match st.store.operation_open_by_state().await {
        Ok(counts) => {
            st.store_metrics.set_open_operations(&counts);
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
                    st.reconciler_metrics.oldest_unknown_age.set(secs);
                }
                Err(e) => {
                    // NaN, not a stale value: an alert on it stays quiet
                    // rather than firing on (or hiding behind) old data.
                    tracing::warn!(error = %e, "metrics: could not read the UNKNOWN operations");
                    st.reconciler_metrics.oldest_unknown_age.set(f64::NAN);
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
    st.store_metrics.set_saturation(st.store.saturation());
    st.exec
        .metrics()
        .leases_held
        .set(st.exec.held().len() as i64);
    st.ready_gauge.set(i64::from(readiness(&st).is_ok()));
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
        Ok(age) => st.retention_metrics.oldest_decided_age.set(age),
        Err(e) => {
            tracing::warn!(error = %e, "metrics: could not read the oldest decision");
            st.retention_metrics.oldest_decided_age.set(f64::NAN)
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
            let due = decided + crate::reconciler::window(delay);
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
        st.reconciler_metrics
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
