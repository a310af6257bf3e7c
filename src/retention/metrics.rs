//! The retention room's metrics: rows pruned, this replica's last round,
//! the oldest decision kept (set at each scrape) and the keep time.
//! Registered at start-up (`startup`).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::metrics::Metrics;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TableLabels {
    /// `operations`, `events` or `tombstones`.
    pub table: String,
}

pub struct RetentionMetrics {
    /// Rows deleted by retention, by table.
    pub pruned: Family<TableLabels, Counter>,
    /// Seconds the last retention round of this replica took.
    pub last_duration: Gauge<f64, AtomicU64>,
    /// When this replica last finished a retention round (Unix seconds).
    pub last_round: Gauge<f64, AtomicU64>,
    /// Age of the oldest decided operation in the ledger (set at scrape).
    pub oldest_decided_age: Gauge<f64, AtomicU64>,
    /// How long decided operations are kept (0: for ever).
    pub keep: Gauge<f64, AtomicU64>,
}

impl RetentionMetrics {
    /// The families, registered into `metrics`.
    pub fn new(metrics: &Metrics) -> Arc<Self> {
        let m = Arc::new(Self {
            pruned: Family::default(),
            last_duration: Gauge::default(),
            last_round: Gauge::default(),
            oldest_decided_age: Gauge::default(),
            keep: Gauge::default(),
        });
        // Every table from the start: a rate over a counter needs it at 0.
        for table in ["operations", "events", "tombstones"] {
            m.pruned(table, 0);
        }
        metrics.register(|r| m.register(r));
        m
    }

    fn register(&self, r: &mut Registry) {
        r.register(
            "retention_pruned_rows",
            "Rows deleted by retention, by table: operations, their events, expired tombstones",
            self.pruned.clone(),
        );
        r.register(
            "retention_last_round_duration_seconds",
            "How long this replica's last retention round took",
            self.last_duration.clone(),
        );
        r.register(
            "retention_last_round_timestamp_seconds",
            "When this replica last finished a retention round (0: never); one replica prunes at a time",
            self.last_round.clone(),
        );
        r.register(
            "retention_oldest_decided_age_seconds",
            "Age of the oldest decided operation still in the ledger (0: none); above the keep time, pruning is behind",
            self.oldest_decided_age.clone(),
        );
        r.register(
            "retention_keep_seconds",
            "How long decided operations are kept (--retain, at least twice --verify-window); 0: for ever",
            self.keep.clone(),
        );
    }

    /// `n` rows of `table` deleted by retention.
    pub fn pruned(&self, table: &str, n: u64) {
        self.pruned
            .get_or_create(&TableLabels {
                table: table.to_string(),
            })
            .inc_by(n);
    }
}
