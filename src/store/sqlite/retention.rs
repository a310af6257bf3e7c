//! Retention on the embedded store: one process, one connection, so a
//! batch (tombstones, events, operations) is one transaction that no
//! intent can interleave with; one round at a time in the process.

use std::sync::Arc;

use async_trait::async_trait;
use sqlx::sqlite::SqlitePool;
use tokio::sync::{Mutex, OwnedMutexGuard};

use super::write::{db, now_us};
use crate::domain::KeyHash;
use crate::store::{PruneCounts, PruneParams, PruneRound, StoreError};

pub(super) struct SqliteRound {
    pool: SqlitePool,
    _one_at_a_time: OwnedMutexGuard<()>,
}

pub(super) fn begin(pool: &SqlitePool, lock: &Arc<Mutex<()>>) -> Option<Box<dyn PruneRound>> {
    let guard = lock.clone().try_lock_owned().ok()?;
    Some(Box::new(SqliteRound {
        pool: pool.clone(),
        _one_at_a_time: guard,
    }))
}

/// The cutoff in microseconds: `keep` before now, as if the clock read
/// `ahead` later.
/// The oldest decisions before `?1`, at most `?2`: by `operations_decided`.
pub(super) const VICTIMS: &str = "SELECT id, caller, idempotency_key, completed_at,
         (ensure OR key_retired_at IS NOT NULL) AS keyless FROM operations
     WHERE completed_at IS NOT NULL AND completed_at < ?1 ORDER BY completed_at LIMIT ?2";

/// When the oldest decision was made: by `operations_decided`.
pub(super) const OLDEST_DECIDED: &str =
    "SELECT min(completed_at) FROM operations WHERE completed_at IS NOT NULL";

fn cutoff_us(keep: std::time::Duration, ahead: std::time::Duration) -> i64 {
    now_us() + ahead.as_micros() as i64 - keep.as_micros() as i64
}

#[async_trait]
impl PruneRound for SqliteRound {
    async fn prune_batch(&mut self, p: &PruneParams) -> Result<PruneCounts, StoreError> {
        const WHAT: &str = "retention: pruning decided operations";
        let mut tx = self.pool.begin().await.map_err(db(WHAT))?;
        let victims: Vec<(String, Option<String>, String, i64, bool)> = sqlx::query_as(VICTIMS)
            .bind(cutoff_us(p.keep, p.ahead))
            .bind(i64::from(p.limit))
            .fetch_all(&mut *tx)
            .await
            .map_err(db(WHAT))?;
        let mut counts = PruneCounts::default();
        let now = now_us();
        for (id, caller, key, decided, keyless) in &victims {
            // No key of its own to keep: an Ensure call's operation, or one
            // whose key a replay handed on (the key's live operation
            // leaves the tombstone when its turn comes).
            let written = if *keyless {
                None
            } else {
                Some(
                    sqlx::query(
                "INSERT INTO idempotency_tombstones (key_hash, decided_at, pruned_at) VALUES (?, ?, ?)
                 ON CONFLICT (key_hash) DO NOTHING",
            )
                    .bind(KeyHash::of(caller.as_deref(), key).bytes().to_vec())
                    .bind(decided)
                    .bind(now)
                    .execute(&mut *tx)
                    .await
                    .map_err(db(WHAT))?,
                )
            };
            counts.tombstones_written += written.map_or(0, |w| w.rows_affected());
            // Its log: the rows of before the log became a row per write,
            // and the rows since (one count of both, as PostgreSQL's).
            for delete in [
                "DELETE FROM operation_events WHERE operation_id = ?",
                "DELETE FROM operation_log WHERE operation_id = ?",
            ] {
                let events = sqlx::query(delete)
                    .bind(id)
                    .execute(&mut *tx)
                    .await
                    .map_err(db(WHAT))?;
                counts.events += events.rows_affected();
            }
            let op =
                sqlx::query("DELETE FROM operations WHERE id = ? AND completed_at IS NOT NULL")
                    .bind(id)
                    .execute(&mut *tx)
                    .await
                    .map_err(db(WHAT))?;
            counts.operations += op.rows_affected();
        }
        tx.commit().await.map_err(db(WHAT))?;
        Ok(counts)
    }

    async fn expire_batch(&mut self, p: &PruneParams) -> Result<u64, StoreError> {
        let Some(keep_keys) = p.keep_keys else {
            return Ok(0);
        };
        let done = sqlx::query(
            "DELETE FROM idempotency_tombstones WHERE key_hash IN
                (SELECT key_hash FROM idempotency_tombstones WHERE decided_at < ? LIMIT ?)",
        )
        .bind(cutoff_us(keep_keys, p.ahead))
        .bind(i64::from(p.limit))
        .execute(&self.pool)
        .await
        .map_err(db("retention: expiring tombstones"))?;
        Ok(done.rows_affected())
    }

    async fn end(self: Box<Self>) {}
}
