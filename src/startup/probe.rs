//! Reachability measured, not inferred from traffic: what every Nova
//! request says of Nova feeds its [`Reach`] and the `nova_reachable` and
//! `nova_last_contact_timestamp_seconds` gauges; when no request reached
//! Nova for a whole `--nova-probe-interval`, a probe (one GET of Nova's
//! version document, bounded by `--nova-probe-timeout`, below the
//! interval) asks instead, so the gauges follow Nova in quiet hours too.
//! The database is checked the same way (a `SELECT 1` every
//! [`DB_CHECK_INTERVAL`]), which readiness reads (`admin`).
//!
//! Contact with Nova is any HTTP answer of Nova's own, its errors
//! included; a gateway's 502, 503 or 504 without Nova's request id is not
//! (see `nova::Reached`).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::reach::Reach;
use crate::nova::metrics::NovaMetrics;
use crate::nova::{NovaClient, Reached};
use crate::store::Store;

/// How often the database is checked.
pub const DB_CHECK_INTERVAL: Duration = Duration::from_secs(5);
/// How long one database check waits for its answer: within the interval,
/// and within a readiness probe's usual timeout.
pub const DB_CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// Nova answered: the gauges and the outage, if one was open.
pub fn nova_contact(metrics: &NovaMetrics, reach: &Reach) {
    metrics.reachable.set(1);
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    metrics.last_contact.set(now.as_secs_f64());
    reach.answered();
}

/// Nova could not be reached: the gauge, and the outage's first line.
pub fn nova_lost(metrics: &NovaMetrics, reach: &Reach, error: &dyn std::fmt::Display) {
    metrics.reachable.set(0);
    reach.unreachable(error);
}

/// The Nova client's reachability observer: each request's answer (or
/// its absence) as [`nova_contact`] and [`nova_lost`] say.
pub fn nova_observer(
    metrics: Arc<NovaMetrics>,
    reach: Arc<Reach>,
) -> crate::nova::client::ReachabilityObserver {
    Arc::new(move |reached| match reached {
        Reached::Answered => nova_contact(&metrics, &reach),
        Reached::Unreachable(e) => nova_lost(&metrics, &reach, e),
        Reached::Failed => reach.failed(),
    })
}

/// The probe of Nova's version document.
pub struct NovaProbe {
    pub nova: Arc<NovaClient>,
    pub reach: Arc<Reach>,
    pub metrics: Arc<NovaMetrics>,
    pub interval: Duration,
    pub timeout: Duration,
}

impl NovaProbe {
    /// Probes Nova unless a request reached it (or failed to) within the
    /// interval: `None` when skipped, else whether Nova answered.
    pub async fn run_once(&self) -> Option<bool> {
        if self.reach.heard_within(self.interval) {
            return None;
        }
        match self.nova.probe(Instant::now() + self.timeout).await {
            Ok(true) => {
                nova_contact(&self.metrics, &self.reach);
                Some(true)
            }
            // Not asked (no Keystone token): nothing learned of Nova.
            Ok(false) => None,
            Err(e) => {
                tracing::debug!(error = %e, "Nova's probe got no answer");
                nova_lost(&self.metrics, &self.reach, &e);
                Some(false)
            }
        }
    }

    /// Probes every interval until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        every(self.interval, stop, || self.run_once()).await
    }
}

/// The database check readiness reads.
pub struct DbCheck {
    pub store: Arc<dyn Store>,
    pub reach: Arc<Reach>,
}

impl DbCheck {
    /// One `SELECT 1`, bounded by [`DB_CHECK_TIMEOUT`]: whether it answered.
    pub async fn run_once(&self) -> bool {
        match tokio::time::timeout(DB_CHECK_TIMEOUT, self.store.ping()).await {
            Ok(Ok(())) => {
                self.reach.answered();
                true
            }
            Ok(Err(e)) => {
                self.reach.unreachable(&e);
                false
            }
            Err(_) => {
                self.reach.unreachable(&format_args!(
                    "no answer to a check within {} ms",
                    DB_CHECK_TIMEOUT.as_millis()
                ));
                false
            }
        }
    }

    /// Checks every [`DB_CHECK_INTERVAL`] until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        every(DB_CHECK_INTERVAL, stop, || self.run_once()).await
    }
}

/// Runs `once` every `interval` (the first a whole interval from now)
/// until `stop`.
async fn every<F, T>(interval: Duration, stop: CancellationToken, once: impl Fn() -> F)
where
    F: std::future::Future<Output = T>,
{
    let mut tick = tokio::time::interval_at(Instant::now() + interval, interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = once() => {}
        }
    }
}

/// The store's round trips, to the metrics, and (failed ones) to the
/// database's [`Reach`], which counts them in an open outage.
pub struct ObservedDb {
    pub metrics: Arc<crate::store::metrics::StoreMetrics>,
    pub reach: Arc<Reach>,
}

impl crate::store::DbObserver for ObservedDb {
    fn round_trip(&self, kind: &'static str, seconds: f64, outcome: &'static str) {
        crate::store::DbObserver::round_trip(self.metrics.as_ref(), kind, seconds, outcome);
        if outcome != "ok" {
            self.reach.failed();
        }
    }
}
