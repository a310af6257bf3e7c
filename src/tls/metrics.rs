//! The TLS room's metric: the served certificate's notAfter, read at each
//! scrape (registered at start-up when TLS is on).

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;

use crate::metrics::Metrics;

/// Reads the served certificate's notAfter at each scrape.
pub fn observe(metrics: &Metrics, tls: Arc<super::Reloadable>) {
    metrics.register(|r| r.register_collector(Box::new(Expiry(tls))));
}

/// A collector, so the value is the certificate in force at that instant
/// (reloads included).
struct Expiry(Arc<super::Reloadable>);

impl std::fmt::Debug for Expiry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Expiry")
    }
}

impl Collector for Expiry {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        if let Some(not_after) = self.0.not_after() {
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
