//! Metrics per row of the caller table (`--caller-quotas`): requests and
//! their latency by kind of RPC (the methods' table's), refusals by quota,
//! and each row's operations in flight. Labelled by the configured row's
//! name only: a caller the table does not name counts as `default`, so a
//! flood of callers cannot grow the label set.

use std::sync::{Arc, Mutex, OnceLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::domain::quota::{CallerQuotas, DEFAULT_ROW};
use crate::grpc::methods::Kind;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallerCodeLabels {
    /// The caller's row of the table (`default` for any other caller).
    pub caller: String,
    pub kind: &'static str,
    pub code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallerKindLabels {
    pub caller: String,
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QuotaLabels {
    pub caller: String,
    /// `rate` or `inflight`.
    pub quota: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RowLabels {
    caller: String,
}

/// One row's places for operations in flight: its limit, those free.
struct Places {
    caller: String,
    places: Arc<tokio::sync::Semaphore>,
    limit: usize,
}

pub struct CallerMetrics {
    requests: Family<CallerCodeLabels, Counter>,
    duration: Family<CallerKindLabels, Histogram>,
    refusals: Family<QuotaLabels, Counter>,
    table: OnceLock<Arc<CallerQuotas>>,
    inflight: Arc<Mutex<Vec<Places>>>,
}

impl std::fmt::Debug for CallerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallerMetrics").finish_non_exhaustive()
    }
}

impl CallerMetrics {
    pub(super) fn new() -> Self {
        Self {
            requests: Family::default(),
            duration: Family::new_with_constructor(
                || Histogram::new(crate::metrics::rpc_buckets()),
            ),
            refusals: Family::default(),
            table: OnceLock::new(),
            inflight: Arc::default(),
        }
    }

    pub(super) fn register(&self, r: &mut Registry) {
        r.register(
            "caller_requests",
            "gRPC requests of the service's API by caller (the row of --caller-quotas; default for callers it does not name), kind of RPC (mutation, control, read, watch, operator) and canonical status code",
            self.requests.clone(),
        );
        r.register(
            "caller_request_duration_seconds",
            "gRPC request latency from arrival to the last byte of the answer, by caller (its row of --caller-quotas) and kind of RPC",
            self.duration.clone(),
        );
        r.register(
            "caller_quota_refusals",
            "Calls refused RESOURCE_EXHAUSTED CALLER_QUOTA_EXCEEDED, by caller (its row of --caller-quotas) and quota (rate, inflight)",
            self.refusals.clone(),
        );
        r.register_collector(Box::new(InFlight(self.inflight.clone())));
    }

    /// The table whose rows label these metrics (set once, at start).
    pub fn set_table(&self, table: Arc<CallerQuotas>) {
        if self.table.set(table).is_err() {
            tracing::debug!("the caller table of the metrics was set already; kept the first");
        }
    }

    /// The row label of the caller named `name` (`""`: anonymous).
    pub fn label_of(&self, name: &str) -> String {
        self.table.get().map_or(DEFAULT_ROW.to_string(), |t| {
            t.label(t.row_of(name)).to_string()
        })
    }

    /// One finished request of `kind` by the caller named `name`.
    pub fn done(&self, name: &str, kind: Kind, code: tonic::Code, secs: f64) {
        let caller = self.label_of(name);
        self.duration
            .get_or_create(&CallerKindLabels {
                caller: caller.clone(),
                kind: kind.as_str(),
            })
            .observe(secs);
        self.requests
            .get_or_create(&CallerCodeLabels {
                caller,
                kind: kind.as_str(),
                code: super::code_name(code),
            })
            .inc();
    }

    /// One call of row `caller` refused over `quota`.
    pub fn refused(&self, caller: &str, quota: &'static str) {
        self.refusals
            .get_or_create(&QuotaLabels {
                caller: caller.to_string(),
                quota,
            })
            .inc();
    }

    /// Reads row `caller`'s operations in flight at each scrape (`limit`
    /// 0: the row has no quota of them; its places are a semaphore's
    /// most), and counts its refusals from 0.
    pub fn observe_row(&self, caller: &str, places: Arc<tokio::sync::Semaphore>, limit: usize) {
        for quota in ["rate", "inflight"] {
            self.refusals
                .get_or_create(&QuotaLabels {
                    caller: caller.to_string(),
                    quota,
                })
                .inc_by(0);
        }
        let mut rows = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
        rows.retain(|r| r.caller != caller);
        rows.push(Places {
            caller: caller.to_string(),
            places,
            limit,
        });
    }
}

/// Each row's operations in flight and its limit, read at each scrape.
struct InFlight(Arc<Mutex<Vec<Places>>>);

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InFlight")
    }
}

impl Collector for InFlight {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        // A poisoned lock only means a panic elsewhere; the rows are intact.
        let rows = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if rows.is_empty() {
            return Ok(());
        }
        for (name, help, in_use) in [
            (
                "caller_inflight_operations",
                "Operations of each caller row of --caller-quotas whose task runs now (every row: default for the callers the table does not name)",
                true,
            ),
            (
                "caller_inflight_operations_limit",
                "Each caller row's inflight quota (--caller-quotas; 0: none); beyond it, CALLER_QUOTA_EXCEEDED",
                false,
            ),
        ] {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for r in rows.iter() {
                let most = if r.limit == 0 {
                    tokio::sync::Semaphore::MAX_PERMITS
                } else {
                    r.limit
                };
                let value = if in_use {
                    most.saturating_sub(r.places.available_permits())
                } else {
                    r.limit
                };
                let labels = RowLabels {
                    caller: r.caller.clone(),
                };
                ConstGauge::new(value as i64).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}
