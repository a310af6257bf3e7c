//! The store room's metrics: the database's round trips (recorded through
//! [`DbObserver`]), its read pool and the ledger writers' queue (set at each
//! scrape from [`Saturation`]), and the ledger's open operations by state
//! (read at each scrape). Registered at start-up (`startup`).

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::{DbObserver, RoundTrip, Saturation, StateCount};
use crate::metrics::{Metrics, rpc_buckets};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DbLabels {
    /// The kind of round trip (`intent`, `decision`, `read`, `lease`, ...).
    pub kind: String,
    /// `ok`, `error` or `timeout`.
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpenLabels {
    pub state: String,
}

pub struct StoreMetrics {
    /// Round trips to the database by kind and outcome.
    pub round_trip: Family<DbLabels, Histogram>,
    /// Round trips to the database that got no answer within their bound.
    pub timeouts: Family<KindLabels, Counter>,
    /// Connections of the read pool lent out, and its size (set at scrape).
    pub pool_in_use: Gauge,
    pub pool_size: Gauge,
    /// Ledger writes waiting for (or being written by) the writers.
    pub writes_pending: Gauge,
    /// Open operations of the whole ledger by state, read at each scrape
    /// from the open operations' index (its cost grows with open work, not
    /// with the ledger).
    pub open_operations: Family<OpenLabels, Gauge>,
}

impl StoreMetrics {
    /// The families, registered into `metrics`.
    pub fn new(metrics: &Metrics) -> Arc<Self> {
        let m = Arc::new(Self {
            round_trip: Family::new_with_constructor(|| Histogram::new(rpc_buckets())),
            timeouts: Family::default(),
            pool_in_use: Gauge::default(),
            pool_size: Gauge::default(),
            writes_pending: Gauge::default(),
            open_operations: Family::default(),
        });
        // Every kind from the start: a rate over a counter needs it at 0.
        for kind in RoundTrip::ALL {
            m.timeouts
                .get_or_create(&KindLabels {
                    kind: kind.as_str().to_string(),
                })
                .inc_by(0);
        }
        metrics.register(|r| m.register(r));
        m
    }

    fn register(&self, r: &mut Registry) {
        r.register(
            "open_operations",
            "Open operations of the ledger by state (pending, in_progress, unknown), read at scrape: every replica reports the same numbers",
            self.open_operations.clone(),
        );
        r.register(
            "db_round_trip_duration_seconds",
            "Round trips to the database (a statement, a short transaction, a ping, a connect) by kind and outcome (ok, error, timeout)",
            self.round_trip.clone(),
        );
        r.register(
            "db_timeouts",
            "Round trips to the database that got no answer within --db-statement-timeout (their connection dropped), by kind",
            self.timeouts.clone(),
        );
        r.register(
            "db_pool_connections_in_use",
            "Connections of the read pool lent out now (set at scrape)",
            self.pool_in_use.clone(),
        );
        r.register(
            "db_pool_connections",
            "Size of the read pool (set at scrape)",
            self.pool_size.clone(),
        );
        r.register(
            "ledger_writes_pending",
            "Ledger writes waiting for or being written by the ledger writers (set at scrape)",
            self.writes_pending.clone(),
        );
    }

    /// Sets the store's saturation gauges.
    pub fn set_saturation(&self, s: Saturation) {
        self.pool_in_use.set(s.pool_in_use as i64);
        self.pool_size.set(s.pool_size as i64);
        self.writes_pending.set(s.writes_pending as i64);
    }

    /// The open operations by state, fresh (every open state present, 0
    /// when none).
    pub fn set_open_operations(&self, counts: &[StateCount]) {
        for state in [
            crate::domain::State::Pending,
            crate::domain::State::InProgress,
            crate::domain::State::Unknown,
        ] {
            let n = counts
                .iter()
                .filter(|c| c.state == state.as_str())
                .map(|c| c.count)
                .sum();
            self.open_operations
                .get_or_create(&OpenLabels {
                    state: state.as_str().to_string(),
                })
                .set(n);
        }
    }
}

impl DbObserver for StoreMetrics {
    fn round_trip(&self, kind: &'static str, seconds: f64, outcome: &'static str) {
        self.round_trip
            .get_or_create(&DbLabels {
                kind: kind.to_string(),
                outcome: outcome.to_string(),
            })
            .observe(seconds);
        if outcome == "timeout" {
            self.timeouts
                .get_or_create(&KindLabels {
                    kind: kind.to_string(),
                })
                .inc();
        }
    }
}
