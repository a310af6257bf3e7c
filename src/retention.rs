//! Retention: decided operations older than `--retain` are deleted with
//! their events, in small batches with a pause between, by one replica at
//! a time (the store's round lock); each leaves a tombstone of its
//! (caller, key), so a replay of a pruned key is refused
//! (`IDEMPOTENCY_KEY_EXPIRED`), never run again, until `--retain-keys`
//! after its decision. Open operations are never touched, nor decided ones
//! the verifier may still look at (twice `--verify-window`).
//!
//! `run_once()` does one round and returns counts; `run()` is a thin loop
//! around it on a shutdown token (rule 9). Every time is the database's.
//!
//! - `metrics`: retention's metric families.

pub mod metrics;

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::store::{PruneCounts, PruneParams, PruneRound, Store, StoreError};
use metrics::RetentionMetrics;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetentionSettings {
    /// Decided operations are kept this long after their decision; zero
    /// keeps everything.
    pub retain: Duration,
    /// A pruned key's tombstone lives this long after the decision; zero:
    /// for ever.
    pub retain_keys: Duration,
    /// Pause between rounds.
    pub interval: Duration,
    /// Operations (or tombstones) per statement.
    pub batch: u32,
    /// Pause between two batches of a round.
    pub pause: Duration,
    /// How long a batch waits for transactions older than its tombstones
    /// (PostgreSQL; see `store::pg::retention`).
    pub horizon_wait: Duration,
    /// The reconciler's `--verify-window`: a decision is kept at least
    /// twice as long (its last look, and the lateness allowed it).
    pub verify_window: Duration,
}

impl RetentionSettings {
    /// The built-in defaults: the one source of the flags' defaults too
    /// (`config/serve.rs`; a test checks they agree).
    pub const DEFAULT: Self = Self {
        retain: Duration::from_secs(90 * 24 * 3600),
        retain_keys: Duration::from_secs(365 * 24 * 3600),
        interval: Duration::from_secs(60),
        batch: 1000,
        pause: Duration::from_millis(100),
        horizon_wait: Duration::from_secs(10),
        verify_window: crate::reconciler::ReconcilerSettings::DEFAULT.verify_window,
    };

    /// How long decided operations are kept: `--retain`, but never less
    /// than the verifier may still need them; `None`: for ever.
    pub fn keep(&self) -> Option<Duration> {
        (!self.retain.is_zero()).then(|| self.retain.max(self.verify_window * 2))
    }

    /// How long a pruned key stays refused after its decision (at least
    /// as long as operations are kept); `None`: for ever.
    pub fn keep_keys(&self) -> Option<Duration> {
        let keep = self.keep()?;
        (!self.retain_keys.is_zero()).then(|| self.retain_keys.max(keep))
    }

    /// Problems with the settings, each naming its flags.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if !self.retain.is_zero() && self.retain < Duration::from_secs(60) {
            out.push(format!(
                "--retain ({}) must be 0 (keep everything) or at least 1m",
                humantime::format_duration(self.retain)
            ));
        }
        if !self.retain.is_zero() && !self.retain_keys.is_zero() && self.retain_keys < self.retain {
            out.push(format!(
                "--retain-keys ({}) must be 0 (for ever) or at least --retain ({}): a key must stay refused at least as long as it was honoured",
                humantime::format_duration(self.retain_keys),
                humantime::format_duration(self.retain)
            ));
        }
        if self.batch == 0 {
            out.push("--retain-batch must be at least 1".into());
        }
        out
    }
}

impl Default for RetentionSettings {
    fn default() -> Self {
        Self::DEFAULT
    }
}

pub struct Pruner {
    store: Arc<dyn Store>,
    pub settings: RetentionSettings,
    pub metrics: Arc<RetentionMetrics>,
}

impl Pruner {
    pub fn new(
        store: Arc<dyn Store>,
        settings: RetentionSettings,
        metrics: Arc<RetentionMetrics>,
    ) -> Arc<Self> {
        metrics
            .keep
            .set(settings.keep().map_or(0.0, |k| k.as_secs_f64()));
        Arc::new(Self {
            store,
            settings,
            metrics,
        })
    }

    /// Rounds every `interval` until `stop`; nothing when `--retain 0`.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        if self.settings.keep().is_none() {
            tracing::info!("retention: --retain 0, every operation is kept");
            return;
        }
        loop {
            // Jittered, so replicas started together do not all try at once.
            let pause = self.settings.interval.mul_f64(rand::random_range(0.5..1.5));
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(pause) => {}
            }
            match self.round(Duration::ZERO, &stop).await {
                Ok(Some(c)) if c != PruneCounts::default() => tracing::info!(
                    operations = c.operations,
                    events = c.events,
                    tombstones_written = c.tombstones_written,
                    tombstones_expired = c.tombstones_expired,
                    deferred = c.deferred,
                    "retention round"
                ),
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "retention round failed; trying again next round")
                }
            }
        }
    }

    /// One round now; `None` when retention is off or another replica's
    /// round runs.
    pub async fn run_once(&self) -> Result<Option<PruneCounts>, StoreError> {
        self.round(Duration::ZERO, &CancellationToken::new()).await
    }

    /// One round as if the database's clock read `ahead` later: the same
    /// statements, for tests of what ages out when.
    pub async fn run_once_ahead(&self, ahead: Duration) -> Result<Option<PruneCounts>, StoreError> {
        self.round(ahead, &CancellationToken::new()).await
    }

    async fn round(
        &self,
        ahead: Duration,
        stop: &CancellationToken,
    ) -> Result<Option<PruneCounts>, StoreError> {
        let Some(keep) = self.settings.keep() else {
            return Ok(None);
        };
        let started = Instant::now();
        let Some(mut round) = self.store.retention_begin().await? else {
            return Ok(None);
        };
        let params = PruneParams {
            keep,
            keep_keys: self.settings.keep_keys(),
            limit: self.settings.batch.max(1),
            ahead,
            horizon_wait: self.settings.horizon_wait,
        };
        let result = self.batches(round.as_mut(), &params, stop).await;
        round.end().await;
        let counts = result?;
        self.metrics
            .last_duration
            .set(started.elapsed().as_secs_f64());
        self.metrics.last_round.set(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
        );
        if counts.deferred > 0 {
            tracing::info!(
                deferred = counts.deferred,
                "retention: operations left for the next round: a transaction older than their tombstones was still running"
            );
        }
        Ok(Some(counts))
    }

    /// Batches until nothing is left (or `stop`): operations, then
    /// tombstones, a pause between two batches.
    async fn batches(
        &self,
        round: &mut dyn PruneRound,
        p: &PruneParams,
        stop: &CancellationToken,
    ) -> Result<PruneCounts, StoreError> {
        let mut total = PruneCounts::default();
        loop {
            let c = round.prune_batch(p).await?;
            self.metrics.pruned("operations", c.operations);
            self.metrics.pruned("events", c.events);
            total.add(c);
            let full = c.operations + c.deferred >= u64::from(p.limit);
            if c.deferred > 0 || !full || !self.pause(stop).await {
                break;
            }
        }
        loop {
            let n = round.expire_batch(p).await?;
            self.metrics.pruned("tombstones", n);
            total.tombstones_expired += n;
            if n < u64::from(p.limit) || !self.pause(stop).await {
                break;
            }
        }
        Ok(total)
    }

    /// The pause between batches; false when `stop` came first.
    async fn pause(&self, stop: &CancellationToken) -> bool {
        tokio::select! {
            _ = stop.cancelled() => false,
            _ = tokio::time::sleep(self.settings.pause) => true,
        }
    }
}
