//! Retention on PostgreSQL: one round at a time across replicas (a session
//! advisory lock on a connection of the round's own, released with it if
//! the replica dies), and each batch in two steps so that a key being
//! pruned is never run again.
//!
//! Why two steps: a replay of a key inserts its intent with `ON CONFLICT DO
//! NOTHING ... WHERE NOT EXISTS (tombstone)`. If the tombstone were written
//! and the operation deleted in one transaction, a replay whose statement
//! began before that commit (no tombstone in its snapshot) and reached the
//! unique index after it (the operation gone) would insert: a second run.
//! So a batch first commits the tombstones, then waits until no other
//! session holds a snapshot older than that commit (`backend_xmin` in
//! `pg_stat_activity`), and only then deletes the operations: any replay
//! either sees the tombstone or meets the operation.

use std::time::Duration;

use async_trait::async_trait;
use sqlx::Connection as _;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use tokio::time::Instant;
use uuid::Uuid;

use super::bounds::Bounds;
use super::conns::{Conns, Observer};
use super::sql::retention as sql;
use crate::store::{PruneCounts, PruneParams, PruneRound, RoundTrip, StoreError};

/// The round's session ends on the server once idle this long (its client
/// gone without a word), releasing the advisory lock it holds: a round is
/// idle only for a pause between batches.
const ROUND_IDLE_SESSION_TIMEOUT: Duration = Duration::from_secs(60);

/// The advisory lock of retention rounds (`b"vr:retnt"` as a number).
const LOCK_KEY: i64 = 0x7672_3a72_6574_6e74;

/// How often a batch looks whether older snapshots are gone.
const HORIZON_POLL: Duration = Duration::from_millis(20);

/// A round holding the lock on its own connection; each of its round
/// trips bounded (`conns.bounded`).
pub(super) struct PgRound {
    conn: PgConnection,
    conns: Conns,
}

/// Takes the lock on a connection of the round's own (never pooled: it
/// must not go back holding the lock); `None` while another holds it.
pub(super) async fn begin(
    options: &PgConnectOptions,
    bounds: Bounds,
    observer: Observer,
) -> Result<Option<Box<dyn PruneRound>>, StoreError> {
    const WHAT: &str = "beginning a retention round";
    let options = options.clone().options([(
        "idle_session_timeout",
        ROUND_IDLE_SESSION_TIMEOUT.as_millis().to_string(),
    )]);
    let conns = Conns::new("retention", options, 0, None, bounds, observer);
    let until = Instant::now() + bounds.connect + bounds.round_trip;
    let mut conn = conns.open(until).await?;
    let locked: bool = conns
        .bounded(
            RoundTrip::Retention,
            WHAT,
            until,
            sqlx::query_scalar(sql::LOCK)
                .bind(LOCK_KEY)
                .fetch_one(&mut conn),
        )
        .await?;
    if !locked {
        close(conn).await;
        return Ok(None);
    }
    Ok(Some(Box::new(PgRound { conn, conns })))
}

async fn close(conn: PgConnection) {
    match tokio::time::timeout(Duration::from_secs(1), conn.close()).await {
        Ok(Ok(())) => {}
        // The session ends either way, and its locks with it.
        Ok(Err(e)) => tracing::debug!(error = %e, "retention: closing the round's connection"),
        Err(_) => tracing::debug!("retention: closing the round's connection timed out"),
    }
}

/// No bound of its own beyond each round trip's (retention has no
/// caller's deadline).
fn far() -> Instant {
    Instant::now() + Duration::from_secs(24 * 3600)
}

/// Milliseconds before the database's now that a cutoff `keep` back lies,
/// as if the clock read `ahead` later.
fn cutoff_ms(keep: Duration, ahead: Duration) -> f64 {
    keep.as_secs_f64() * 1000.0 - ahead.as_secs_f64() * 1000.0
}

impl PgRound {
    /// Waits until no other session holds a snapshot older than `horizon`,
    /// up to `wait`; whether they are gone.
    async fn older_snapshots_gone(
        &mut self,
        horizon: i64,
        wait: Duration,
    ) -> Result<bool, StoreError> {
        let until = Instant::now() + wait;
        loop {
            let older: i64 = self
                .conns
                .bounded(
                    RoundTrip::Retention,
                    "retention: waiting for older transactions",
                    far(),
                    sqlx::query_scalar(sql::OLDER_SNAPSHOTS)
                        .bind(horizon)
                        .fetch_one(&mut self.conn),
                )
                .await?;
            if older == 0 {
                return Ok(true);
            }
            if Instant::now() >= until {
                return Ok(false);
            }
            tokio::time::sleep(HORIZON_POLL).await;
        }
    }
}

#[async_trait]
impl PruneRound for PgRound {
    async fn prune_batch(&mut self, p: &PruneParams) -> Result<PruneCounts, StoreError> {
        const WHAT: &str = "retention: pruning decided operations";
        let rows: Vec<(Uuid, i64)> = self
            .conns
            .bounded(
                RoundTrip::Retention,
                WHAT,
                far(),
                sqlx::query_as(sql::MARK)
                    .bind(cutoff_ms(p.keep, p.ahead))
                    .bind(i64::from(p.limit))
                    .fetch_all(&mut self.conn),
            )
            .await?;
        let Some(&(_, marked)) = rows.first() else {
            return Ok(PruneCounts::default());
        };
        let ids: Vec<Uuid> = rows.into_iter().map(|(id, _)| id).collect();
        let horizon: i64 = self
            .conns
            .bounded(
                RoundTrip::Retention,
                WHAT,
                far(),
                sqlx::query_scalar(sql::HORIZON).fetch_one(&mut self.conn),
            )
            .await?;
        let mut counts = PruneCounts {
            tombstones_written: marked as u64,
            ..PruneCounts::default()
        };
        if !self.older_snapshots_gone(horizon, p.horizon_wait).await? {
            counts.deferred = ids.len() as u64;
            return Ok(counts);
        }
        let conn = &mut self.conn;
        let (deleted, events) = self
            .conns
            .bounded(RoundTrip::Retention, WHAT, far(), async move {
                let mut tx = conn.begin().await?;
                let deleted: Vec<Uuid> = sqlx::query_scalar(sql::DELETE_OPERATIONS)
                    .bind(&ids)
                    .fetch_all(&mut *tx)
                    .await?;
                let events: i64 = sqlx::query_scalar(sql::DELETE_EVENTS)
                    .bind(&deleted)
                    .fetch_one(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok((deleted.len() as u64, events as u64))
            })
            .await?;
        counts.operations = deleted;
        counts.events = events;
        Ok(counts)
    }

    async fn expire_batch(&mut self, p: &PruneParams) -> Result<u64, StoreError> {
        let Some(keep_keys) = p.keep_keys else {
            return Ok(0);
        };
        let done = self
            .conns
            .bounded(
                RoundTrip::Retention,
                "retention: expiring tombstones",
                far(),
                sqlx::query(sql::EXPIRE)
                    .bind(cutoff_ms(keep_keys, p.ahead))
                    .bind(i64::from(p.limit))
                    .execute(&mut self.conn),
            )
            .await?;
        Ok(done.rows_affected())
    }

    async fn end(mut self: Box<Self>) {
        let unlocked = self
            .conns
            .bounded(
                RoundTrip::Retention,
                "retention: unlocking",
                far(),
                sqlx::query_scalar::<_, bool>(sql::UNLOCK)
                    .bind(LOCK_KEY)
                    .fetch_one(&mut self.conn),
            )
            .await;
        if let Err(e) = unlocked {
            // Closing the connection releases it all the same.
            tracing::debug!(error = %e, "retention: unlocking");
        }
        close(self.conn).await;
    }
}
