//! The reconciler room's metrics: its passes and what they decided, the
//! drift it found and the verifications it missed (by reason), and its backlogs (the oldest
//! UNKNOWN operation, the verifications due; set at each scrape). Its looks
//! at Nova are timed into the Nova room's families (`nova`). Registered at
//! start-up (`startup`).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::metrics::Metrics;
use crate::nova::metrics::NovaMetrics;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub decision: String,
}

/// The reasons a verification is missed (`MissedLabels::reason`).
pub const MISSED_REASONS: [&str; 2] = ["unanswered", "late"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MissedLabels {
    /// `unanswered`: every look failed until the window closed (Nova or
    /// Cinder away that long); `late`: reached a whole window after it was
    /// due (the verifier fell behind).
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabels {
    /// `first` (`--verify-after`) or `last` (the end of `--verify-window`).
    pub stage: String,
}

pub struct ReconcilerMetrics {
    pub passes: Counter,
    pub decisions: Family<DecisionLabels, Counter>,
    pub drift_detected: Counter,
    pub verification_missed: Family<MissedLabels, Counter>,
    /// How long the oldest decision due for verification has waited past
    /// its due time, per stage (0: up to date; NaN: not readable).
    pub verification_backlog: Family<StageLabels, Gauge<f64, AtomicU64>>,
    /// Verifications waiting to be made again: their look failed, or Nova
    /// or Cinder was away when their turn came (set at each round).
    pub verification_waiting: Gauge,
    /// Seconds since Nova was last asked about the oldest UNKNOWN operation
    /// (since it was recorded, if no request went out); 0 when there is none.
    /// Set at each scrape (see `startup`).
    pub oldest_unknown_age: Gauge<f64, AtomicU64>,
    /// The looks at Nova the reconciler times.
    pub nova: Arc<NovaMetrics>,
}

impl ReconcilerMetrics {
    /// The families, registered into `metrics`; `nova`: the Nova room's,
    /// registered already.
    pub fn new(metrics: &Metrics, nova: Arc<NovaMetrics>) -> Arc<Self> {
        let m = Arc::new(Self {
            passes: Counter::default(),
            decisions: Family::default(),
            drift_detected: Counter::default(),
            verification_missed: Family::default(),
            verification_backlog: Family::default(),
            verification_waiting: Gauge::default(),
            oldest_unknown_age: Gauge::default(),
            nova,
        });
        // Both series from the start, at 0: `increase()` (the alert's)
        // sees the first miss only on a series that existed before it.
        for reason in MISSED_REASONS {
            m.missed(reason, 0);
        }
        metrics.register(|r| m.register(r));
        m
    }

    /// Families in a registry of their own, which nobody scrapes (tests
    /// and benchmarks that build a reconciler alone).
    pub fn unscraped() -> Arc<Self> {
        let metrics = Metrics::new();
        Self::new(&metrics, NovaMetrics::new(&metrics))
    }

    fn register(&self, r: &mut Registry) {
        r.register(
            "oldest_unknown_operation_age_seconds",
            "Seconds since Nova was last asked about the oldest UNKNOWN operation (0: none)",
            self.oldest_unknown_age.clone(),
        );
        r.register(
            "reconciler_passes",
            "Reconciler passes over one operation",
            self.passes.clone(),
        );
        r.register(
            "reconciler_decisions",
            "Reconciler decisions by kind",
            self.decisions.clone(),
        );
        r.register(
            "drift_detected",
            "Terminal operations whose later observation disagreed",
            self.drift_detected.clone(),
        );
        r.register(
            "verification_missed",
            "Verifications of decided operations that could not be made within their window, by reason: unanswered (every look failed until the window closed: Nova or Cinder away that long), late (reached a whole window after they were due: the verifier fell behind its rate limit)",
            self.verification_missed.clone(),
        );
        r.register(
            "verification_waiting",
            "Verifications waiting to be made again, each before its window closes: their look failed, or Nova or Cinder was away when their turn came (the verifier then takes no new ones and probes now and then)",
            self.verification_waiting.clone(),
        );
        r.register(
            "verification_backlog_seconds",
            "How long the oldest decision due for verification has waited past its due time, by stage (first: --verify-after, last: end of --verify-window; 0: up to date). Past --verify-window, verifications are missed",
            self.verification_backlog.clone(),
        );
    }

    /// `n` verifications missed for `reason` (see [`MissedLabels`]).
    pub fn missed(&self, reason: &str, n: u64) {
        self.verification_missed
            .get_or_create(&MissedLabels {
                reason: reason.to_string(),
            })
            .inc_by(n);
    }

    pub fn decision(&self, decision: &str) {
        self.decisions
            .get_or_create(&DecisionLabels {
                decision: decision.to_string(),
            })
            .inc();
    }
}
