//! The Nova room's metrics: requests to Nova and Cinder, the wait for a
//! per-host connection slot, Nova's reachability, and the Keystone token
//! (read at each scrape). Registered at start-up (`startup`); recorded by
//! the executor, the reconciler and Nova's probe, which time the requests.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::metrics::{Metrics, seconds_buckets};

/// What a request was for, and how it ended (`ok` or its error's kind).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NovaLabels {
    pub operation: String,
    pub outcome: String,
}

pub struct NovaMetrics {
    pub outbound_deadline: Histogram,
    pub latency: Family<NovaLabels, Histogram>,
    /// Cinder's volume reads by what they were for (`operation`: the
    /// pre-check, waiting for a volume being created, the confirmation,
    /// naming the attachment, the verifier's look) and outcome: with Cinder
    /// confirming, two are on every attach's path.
    pub cinder_latency: Family<NovaLabels, Histogram>,
    pub slot_wait: Histogram,
    /// 1 while Nova answers, 0 from a request or probe that got no answer
    /// of Nova's own (see `startup::probe`).
    pub reachable: Gauge,
    /// When Nova last answered (Unix seconds; 0: never).
    pub last_contact: Gauge<f64, AtomicU64>,
}

impl NovaMetrics {
    /// The families, registered into `metrics`.
    pub fn new(metrics: &Metrics) -> Arc<Self> {
        let m = Arc::new(Self {
            outbound_deadline: Histogram::new(seconds_buckets()),
            latency: Family::new_with_constructor(|| Histogram::new(seconds_buckets())),
            cinder_latency: Family::new_with_constructor(|| Histogram::new(seconds_buckets())),
            slot_wait: Histogram::new(seconds_buckets()),
            reachable: Gauge::default(),
            last_contact: Gauge::default(),
        });
        metrics.register(|r| m.register(r));
        m
    }

    fn register(&self, r: &mut Registry) {
        r.register(
            "nova_outbound_deadline_seconds",
            "Deadline given to each outbound Nova request",
            self.outbound_deadline.clone(),
        );
        r.register(
            "nova_request_duration_seconds",
            "Nova request latency by operation and outcome class",
            self.latency.clone(),
        );
        r.register(
            "cinder_request_duration_seconds",
            "Cinder volume read latency by what it was for (precheck, wait_ready, confirm, name_attachment, verify) and outcome class",
            self.cinder_latency.clone(),
        );
        r.register(
            "nova_slot_wait_seconds",
            "Time spent waiting for a per-host Nova connection slot",
            self.slot_wait.clone(),
        );
        r.register(
            "nova_reachable",
            "1 while Nova answers, 0 since a request got no answer of Nova's own (connection failed, or a gateway's 502/503/504 without Nova's request id); set by every request, and by a probe of Nova's version document when no request reached Nova for --nova-probe-interval",
            self.reachable.clone(),
        );
        r.register(
            "nova_last_contact_timestamp_seconds",
            "When Nova last answered a request or the probe (Unix seconds; 0: never): any HTTP answer of Nova's own, errors included, a gateway's 502/503/504 without Nova's request id excluded",
            self.last_contact.clone(),
        );
    }

    /// A Nova request: `operation` says which, `outcome` is `ok`,
    /// `accepted` or its error's kind.
    pub fn request(&self, operation: &str, outcome: &str, secs: f64) {
        self.latency
            .get_or_create(&NovaLabels {
                operation: operation.to_string(),
                outcome: outcome.to_string(),
            })
            .observe(secs);
    }

    /// A Cinder volume read: `operation` says what it was for, `outcome` is
    /// `ok` or its error's kind.
    pub fn cinder(&self, operation: &str, outcome: &str, secs: f64) {
        self.cinder_latency
            .get_or_create(&NovaLabels {
                operation: operation.to_string(),
                outcome: outcome.to_string(),
            })
            .observe(secs);
    }
}

/// Reads the Keystone token's time left and the failed renewals at each
/// scrape (Keystone mode only: called when there is a token to read).
pub fn observe_keystone(metrics: &Metrics, auth: Arc<super::auth::KeystoneAuth>) {
    metrics.register(|r| r.register_collector(Box::new(Keystone(auth))));
}

/// The Keystone token's saturation, read from it at each scrape (a
/// collector, so each value is exactly what the token says at that instant).
struct Keystone(Arc<super::auth::KeystoneAuth>);

impl std::fmt::Debug for Keystone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keystone")
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

impl Collector for Keystone {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let auth = &self.0;
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
        Ok(())
    }
}
