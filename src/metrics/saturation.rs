//! The saturation metrics: what is full or about to be, read at each
//! scrape from what holds it (docs/operating.md, "Observability"): the
//! load-shedding caps' places in use, the Keystone token's time left and
//! its failed renewals, the served certificate's notAfter.

use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use super::labels::ClassLabels;

/// One load-shedding cap: `limit` places, those free in `places`.
pub(super) struct InFlight {
    pub(super) class: &'static str,
    pub(super) places: Arc<tokio::sync::Semaphore>,
    pub(super) limit: usize,
}

#[derive(Default)]
pub(super) struct Observed {
    pub(super) caps: Vec<InFlight>,
    pub(super) keystone: Option<Arc<crate::nova::auth::KeystoneAuth>>,
    pub(super) tls: Option<Arc<crate::tls::Reloadable>>,
}

/// The saturation metrics read at each scrape from what holds them (a
/// collector, so each is exactly what its holder says at that instant; a
/// family whose holder is absent — no Keystone, no TLS — is left out).
#[derive(Clone, Default)]
pub(super) struct Saturation(Arc<Mutex<Observed>>);

impl Saturation {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Observed> {
        // A poisoned lock only means a panic elsewhere; the sources are intact.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl std::fmt::Debug for Saturation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        f.debug_struct("Saturation")
            .field("caps", &s.caps.iter().map(|c| c.class).collect::<Vec<_>>())
            .field("keystone", &s.keystone.is_some())
            .field("tls", &s.tls.is_some())
            .finish()
    }
}

/// Seconds of validity the Keystone token held has left: 0 without one (or
/// past its expiry), +Inf for a token Keystone gave no expiry.
fn token_remaining(expires: Option<Option<chrono::DateTime<chrono::Utc>>>) -> f64 {
    match expires {
        None => 0.0,
        Some(None) => f64::INFINITY,
        Some(Some(at)) => ((at - chrono::Utc::now()).num_milliseconds().max(0) as f64) / 1000.0,
    }
}

impl Collector for Saturation {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = self.lock();
        if !s.caps.is_empty() {
            for (name, help, in_use) in [
                (
                    "requests_in_flight",
                    "Places in use under each load-shedding cap, by class: mutation (attach/detach operations whose task runs, whether or not their caller waits), read (unary reads until their answer is sent), watch (WatchOperation streams open)",
                    true,
                ),
                (
                    "requests_in_flight_limit",
                    "Each load-shedding cap, by class: mutation (--max-inflight-mutations), read (--max-inflight-reads), watch (--max-watch-streams); beyond it, RESOURCE_EXHAUSTED",
                    false,
                ),
            ] {
                let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
                for cap in &s.caps {
                    let value = if in_use {
                        cap.limit.saturating_sub(cap.places.available_permits())
                    } else {
                        cap.limit
                    };
                    let labels = ClassLabels {
                        class: cap.class.to_string(),
                    };
                    ConstGauge::new(value as i64).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        if let Some(auth) = &s.keystone {
            let m = ConstGauge::new(token_remaining(auth.token_expires_at()));
            m.encode(encoder.encode_descriptor(
                "keystone_token_remaining_seconds",
                "Seconds until the Keystone token held expires (0: none held, or expired); renewed on demand from 120 s before it expires",
                None,
                m.metric_type(),
            )?)?;
            let m = ConstCounter::new(auth.renewal_failures());
            m.encode(encoder.encode_descriptor(
                "keystone_renewal_failures",
                "Keystone token renewals that failed (each backs off 1 s doubling to 30 s; the token held serves while it is valid)",
                None,
                m.metric_type(),
            )?)?;
        }
        if let Some(not_after) = s.tls.as_ref().and_then(|t| t.not_after()) {
            let m = ConstGauge::new(not_after.timestamp() as f64);
            m.encode(encoder.encode_descriptor(
                "tls_certificate_expiry_timestamp_seconds",
                "notAfter of the certificate served on the gRPC port (the one in force, reloads included), in Unix seconds",
                None,
                m.metric_type(),
            )?)?;
        }
        Ok(())
    }
}
