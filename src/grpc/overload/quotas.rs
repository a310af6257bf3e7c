//! The caller table's quotas as the load-shedding layer enforces them
//! (`--caller-quotas`): each row's bucket, which its callers share, and
//! its places for operations in flight.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{Quota, RateLimiter};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::domain::quota::{CallerQuotas, Quota as QuotaRow};

/// One row of the caller table as the layer enforces it: its bucket (a
/// row's callers share it) and its places for operations in flight.
pub(super) struct Row {
    pub(super) label: String,
    rate: f64,
    bucket: Option<governor::DefaultDirectRateLimiter>,
    /// Its operations in flight, and its quota (0: none; the places are
    /// then as many as a semaphore has, counted for the metrics only).
    pub(super) places: (Arc<Semaphore>, usize),
}

impl Row {
    fn of(label: &str, q: &QuotaRow) -> Self {
        let bucket = (q.rate > 0.0 && q.rate.is_finite())
            .then(|| Quota::with_period(Duration::from_secs_f64(1.0 / q.rate)))
            .flatten()
            .map(|quota| {
                RateLimiter::direct(
                    quota.allow_burst(NonZeroU32::new(q.burst).unwrap_or(NonZeroU32::MIN)),
                )
            });
        Self {
            label: label.to_string(),
            rate: q.rate,
            bucket,
            places: (
                Arc::new(Semaphore::new(if q.inflight > 0 {
                    q.inflight as usize
                } else {
                    Semaphore::MAX_PERMITS
                })),
                q.inflight as usize,
            ),
        }
    }
}

/// The caller table's rows, by index (`CallerQuotas::row_of`).
pub(super) struct Rows {
    table: Arc<CallerQuotas>,
    pub(super) rows: Vec<Row>,
    clock: DefaultClock,
}

/// Why a row refused a call: the quota's name, what it says, and how long
/// to wait.
pub(super) struct OverQuota {
    pub(super) quota: &'static str,
    pub(super) says: String,
    pub(super) wait: Duration,
}

impl Rows {
    pub(super) fn new(table: Arc<CallerQuotas>) -> Self {
        let rows = (0..table.len())
            .map(|r| Row::of(table.label(r), table.quota(r)))
            .collect();
        Self {
            table,
            rows,
            clock: DefaultClock::default(),
        }
    }

    /// A call of `caller` (its name; `""`: anonymous) let in by its row,
    /// with its place in the row's operations in flight, if it has a cap.
    pub(super) fn admit(
        &self,
        caller: &str,
    ) -> Result<Option<OwnedSemaphorePermit>, (&Row, OverQuota)> {
        let row = &self.rows[self.table.row_of(caller)];
        if let Some(bucket) = &row.bucket
            && let Err(not_until) = bucket.check()
        {
            return Err((
                row,
                OverQuota {
                    quota: "rate",
                    says: format!("rate: {} calls a second, in bursts", row.rate),
                    wait: not_until.wait_time_from(self.clock.now()),
                },
            ));
        }
        let (places, limit) = &row.places;
        match places.clone().try_acquire_owned() {
            Ok(p) => Ok(Some(p)),
            Err(_) => Err((
                row,
                OverQuota {
                    quota: "inflight",
                    says: format!("inflight: {limit} operations running"),
                    wait: Duration::from_secs(1),
                },
            )),
        }
    }
}
