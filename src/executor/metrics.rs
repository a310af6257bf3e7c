//! The executor room's metrics: the decisions it commits, the responses
//! it lost and recovered, its ledger writes and the leases it holds (set at
//! each scrape). Its requests to Nova and Cinder are timed into the Nova
//! room's families (`nova`). Registered at start-up (`startup`).

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::metrics::{Metrics, seconds_buckets};
use crate::nova::metrics::NovaMetrics;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecidedLabels {
    pub action: String,
    pub state: String,
    pub resolution: String,
}

/// Which ledger write (`intent`, `decision`) and how it ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LedgerLabels {
    pub operation: String,
    pub outcome: String,
}

pub struct ExecutorMetrics {
    /// Decisions this replica committed (terminal states), counted once
    /// each, after the commit ([`ExecutorMetrics::decided`]: its one call
    /// site is the executor's).
    pub decisions: Family<DecidedLabels, Counter>,
    pub responses_lost: Counter,
    pub responses_recovered: Counter,
    pub ledger_write: Family<LedgerLabels, Histogram>,
    /// Operation leases this replica holds (set at scrape).
    pub leases_held: Gauge,
    /// The requests to Nova and Cinder the executor times.
    pub nova: Arc<NovaMetrics>,
}

impl ExecutorMetrics {
    /// The families, registered into `metrics`; `nova`: the Nova room's,
    /// registered already.
    pub fn new(metrics: &Metrics, nova: Arc<NovaMetrics>) -> Arc<Self> {
        let m = Arc::new(Self {
            decisions: Family::default(),
            responses_lost: Counter::default(),
            responses_recovered: Counter::default(),
            ledger_write: Family::new_with_constructor(|| Histogram::new(seconds_buckets())),
            leases_held: Gauge::default(),
            nova,
        });
        metrics.register(|r| m.register(r));
        m
    }

    /// Families in a registry of their own, which nobody scrapes (tests
    /// and benchmarks that build an executor alone).
    pub fn unscraped() -> Arc<Self> {
        let metrics = Metrics::new();
        Self::new(&metrics, NovaMetrics::new(&metrics))
    }

    fn register(&self, r: &mut Registry) {
        r.register(
            "decisions",
            "Decisions this replica committed, by action, state and resolution (each replica counts its own: sum them; whole-ledger totals: volume-reconciler ops stats)",
            self.decisions.clone(),
        );
        r.register(
            "responses_lost",
            "Nova requests whose outcome was unknown (lost or ambiguous response)",
            self.responses_lost.clone(),
        );
        r.register(
            "responses_recovered",
            "Lost or ambiguous responses whose outcome re-observation established",
            self.responses_recovered.clone(),
        );
        r.register(
            "ledger_write_duration_seconds",
            "Durable ledger writes on the request path (intent, decision), queueing included",
            self.ledger_write.clone(),
        );
        r.register(
            "leases_held",
            "Operation leases this replica holds now (its operation tasks and reconciler passes; renewed by its heartbeat every --heartbeat)",
            self.leases_held.clone(),
        );
    }

    pub fn ledger(&self, operation: &str, outcome: &str, secs: f64) {
        self.ledger_write
            .get_or_create(&LedgerLabels {
                operation: operation.to_string(),
                outcome: outcome.to_string(),
            })
            .observe(secs);
    }

    /// One decision committed by this replica (called once per decision,
    /// after its commit: see `Executor::counted`).
    pub fn decided(&self, op: &crate::domain::Operation) {
        self.decisions
            .get_or_create(&DecidedLabels {
                action: op.action.as_str().to_string(),
                state: op.state.as_str().to_string(),
                resolution: op.resolution.map(|r| r.as_str()).unwrap_or("").to_string(),
            })
            .inc();
    }
}
