//! Prometheus metrics (served on the admin listener at `/metrics`). One
//! struct owns the registry; no globals, so each test's server has its own.

use std::sync::Mutex;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GrpcLabels {
    pub method: String,
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NovaLabels {
    pub operation: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub state: String,
    pub resolution: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub decision: String,
}

pub struct Metrics {
    registry: Mutex<Registry>,
    pub grpc_requests: Family<GrpcLabels, Counter>,
    pub deadline_remaining: Histogram,
    pub requests_without_deadline: Counter,
    pub nova_outbound_deadline: Histogram,
    pub nova_latency: Family<NovaLabels, Histogram>,
    pub operations: Family<StateLabels, Gauge>,
    pub responses_lost: Counter,
    pub responses_recovered: Counter,
    pub reconciler_passes: Counter,
    pub reconciler_decisions: Family<DecisionLabels, Counter>,
    pub nova_slot_wait: Histogram,
    pub drift_detected: Counter,
    pub verification_missed: Counter,
    pub ledger_write: Family<NovaLabels, Histogram>,
    /// 1 while Nova answers (any HTTP answer), 0 after a connection to it
    /// failed or its version document could not be fetched at start.
    pub nova_reachable: Gauge,
}

fn seconds_buckets() -> impl Iterator<Item = f64> {
    [
        0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
    ]
    .into_iter()
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let m = Self {
            registry: Mutex::new(Registry::with_prefix("volume_reconciler")),
            grpc_requests: Family::default(),
            deadline_remaining: Histogram::new(seconds_buckets()),
            requests_without_deadline: Counter::default(),
            nova_outbound_deadline: Histogram::new(seconds_buckets()),
            nova_latency: Family::new_with_constructor(|| Histogram::new(seconds_buckets())),
            operations: Family::default(),
            responses_lost: Counter::default(),
            responses_recovered: Counter::default(),
            reconciler_passes: Counter::default(),
            reconciler_decisions: Family::default(),
            nova_slot_wait: Histogram::new(seconds_buckets()),
            drift_detected: Counter::default(),
            verification_missed: Counter::default(),
            ledger_write: Family::new_with_constructor(|| Histogram::new(seconds_buckets())),
            nova_reachable: Gauge::default(),
        };
        {
            let mut r = m.registry.lock().unwrap_or_else(|p| p.into_inner());
            r.register(
                "grpc_requests",
                "gRPC requests by method and status code",
                m.grpc_requests.clone(),
            );
            r.register(
                "grpc_deadline_remaining_seconds",
                "Deadline remaining when a request arrived (caller-sent deadlines only)",
                m.deadline_remaining.clone(),
            );
            r.register(
                "grpc_requests_without_deadline",
                "Requests that arrived with no deadline (the server default applied)",
                m.requests_without_deadline.clone(),
            );
            r.register(
                "nova_outbound_deadline_seconds",
                "Deadline given to each outbound Nova request",
                m.nova_outbound_deadline.clone(),
            );
            r.register(
                "nova_request_duration_seconds",
                "Nova request latency by operation and outcome class",
                m.nova_latency.clone(),
            );
            r.register(
                "operations",
                "Operations in the ledger by state and resolution",
                m.operations.clone(),
            );
            r.register(
                "responses_lost",
                "Nova requests whose outcome was unknown (lost or ambiguous response)",
                m.responses_lost.clone(),
            );
            r.register(
                "responses_recovered",
                "Lost or ambiguous responses whose outcome re-observation established",
                m.responses_recovered.clone(),
            );
            r.register(
                "reconciler_passes",
                "Reconciler passes over one operation",
                m.reconciler_passes.clone(),
            );
            r.register(
                "reconciler_decisions",
                "Reconciler decisions by kind",
                m.reconciler_decisions.clone(),
            );
            r.register(
                "nova_slot_wait_seconds",
                "Time spent waiting for a per-host Nova connection slot",
                m.nova_slot_wait.clone(),
            );
            r.register(
                "drift_detected",
                "Terminal operations whose later observation disagreed",
                m.drift_detected.clone(),
            );
            r.register(
                "verification_missed",
                "Terminal operations whose late-effect verification came after its window (the verifier fell behind, e.g. at its Nova rate limit)",
                m.verification_missed.clone(),
            );
            r.register(
                "ledger_write_duration_seconds",
                "Durable ledger writes on the request path (intent, decision), queueing included",
                m.ledger_write.clone(),
            );
            r.register(
                "nova_reachable",
                "1 while Nova answers, 0 since a connection to it failed (set at start by version discovery, then by every request)",
                m.nova_reachable.clone(),
            );
        }
        m
    }

    pub fn grpc(&self, method: &str, code: tonic::Code) {
        self.grpc_requests
            .get_or_create(&GrpcLabels {
                method: method.to_string(),
                code: format!("{code:?}"),
            })
            .inc();
    }

    pub fn nova(&self, operation: &str, outcome: &str, secs: f64) {
        self.nova_latency
            .get_or_create(&NovaLabels {
                operation: operation.to_string(),
                outcome: outcome.to_string(),
            })
            .observe(secs);
    }

    pub fn ledger(&self, operation: &str, outcome: &str, secs: f64) {
        self.ledger_write
            .get_or_create(&NovaLabels {
                operation: operation.to_string(),
                outcome: outcome.to_string(),
            })
            .observe(secs);
    }

    pub fn decision(&self, decision: &str) {
        self.reconciler_decisions
            .get_or_create(&DecisionLabels {
                decision: decision.to_string(),
            })
            .inc();
    }

    /// Replaces the per-state gauges with fresh counts.
    pub fn set_operation_counts(&self, counts: &[crate::store::StateCount]) {
        self.operations.clear();
        for c in counts {
            self.operations
                .get_or_create(&StateLabels {
                    state: c.state.clone(),
                    resolution: c.resolution.clone().unwrap_or_default(),
                })
                .set(c.count);
        }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let r = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        // Writing into a String cannot fail.
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &r) {
            out.push_str(&format!("# encoding failed: {e}\n"));
        }
        out
    }
}
