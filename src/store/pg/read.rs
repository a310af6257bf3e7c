//! How the PostgreSQL store reads: a read on the read pool (run again on a
//! new connection if the first went silent, up to a bound of its own), a
//! write there that must run once, the reads of the open operations under
//! index plans, and the few reads and writes that are a short transaction
//! of several statements (a verification slice, a drift mark, the pass
//! over the whole ledger). The statements are `sql`'s.

use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use sqlx::postgres::{PgArguments, PgConnection, Postgres};
use tokio::time::Instant;
use uuid::Uuid;

use super::PgStore;
use super::bind::{self, Jsonb};
use super::bounds::Bounds;
use super::conns::{Conns, Repeat};
use super::sql::{self, NOTIFY_CHANNEL};
use crate::domain::{KeyHash, Operation};
use crate::store::rows;
use crate::store::{
    Cancel, Cancelled, DbFailure, ListCursor, NewOperation, OperationFilter, RoundTrip, StateCount,
    Store, StoreError, query, within,
};

type Query<'q> = sqlx::query::Query<'q, Postgres, PgArguments>;

/// A read's future on a lent connection.
pub(super) type ReadFut<'c, T> = BoxFuture<'c, Result<T, sqlx::Error>>;

/// How long `ops stats`' pass over the whole ledger may take.
const STATS_TIMEOUT: Duration = Duration::from_secs(120);

/// Runs `q` in a transaction of its own under `sql::INDEX_PLANS`.
pub(super) async fn fetch_all_by_index(
    c: &mut PgConnection,
    q: Query<'static>,
) -> Result<Vec<sqlx::postgres::PgRow>, sqlx::Error> {
    // Rolled back if dropped before the commit.
    let mut tx = sqlx::Connection::begin(c).await?;
    sqlx::query(sql::INDEX_PLANS).execute(&mut *tx).await?;
    let rows = q.fetch_all(&mut *tx).await?;
    tx.commit().await?;
    Ok(rows)
}

impl PgStore {
    /// The latest instant a read may end: a round trip, and once more on a
    /// new connection if the first one's went silent.
    pub(super) fn read_until(&self) -> Instant {
        let b = self.reads.bounds();
        Instant::now() + 2 * b.round_trip + b.connect
    }

    /// A read (or a write safe to repeat) on the read pool.
    pub(super) async fn read<T, F>(
        &self,
        kind: RoundTrip,
        what: &'static str,
        f: F,
    ) -> Result<T, StoreError>
    where
        F: for<'c> Fn(&'c mut PgConnection) -> ReadFut<'c, T>,
    {
        self.reads
            .run(kind, what, Repeat::Safe, self.read_until(), f)
            .await
    }

    /// A write on the read pool whose second run would act again: made
    /// once; a lost connection is reported as such.
    pub(super) async fn write_once<T, F>(
        &self,
        kind: RoundTrip,
        what: &'static str,
        f: F,
    ) -> Result<T, StoreError>
    where
        F: for<'c> Fn(&'c mut PgConnection) -> ReadFut<'c, T>,
    {
        self.reads
            .run(kind, what, Repeat::Never, self.read_until(), f)
            .await
    }

    /// Why an intent row was not inserted (see `rows::not_inserted`).
    pub(super) async fn why_not_inserted(
        &self,
        new: &NewOperation,
    ) -> Result<Option<rows::Conflict>, StoreError> {
        let (hash, volume) = (new.key_hash().uuid(), new.volume_id);
        let found = self
            .read(
                RoundTrip::Read,
                "looking up why an intent was not recorded",
                move |c| {
                    let q = sqlx::query(sqlx::AssertSqlSafe(sql::CONFLICT.as_str()))
                        .bind(hash)
                        .bind(volume);
                    Box::pin(q.fetch_optional(c))
                },
            )
            .await?;
        if let Some(why) = rows::not_inserted(new, found.as_ref()) {
            return Ok(Some(why));
        }
        // No operation has the key: its tombstone kept the intent out ...
        if let Some(key) = new.key.keyed()
            && let Some(pruned_at) = self.operation_key_expired(key).await?
        {
            return Ok(Some(rows::Conflict::Answer(Err(StoreError::KeyExpired {
                key: key.key().as_str().to_string(),
                pruned_at,
            }))));
        }
        // ... or its guard: the database's clock read past `record_by`
        // (this read corrects the bound it was drawn from, if the server's
        // clock stepped forward). Nothing was recorded, and it never will
        // be: another try with the key is a new intent.
        if let Some(by) = new.record_by {
            let now = self.now().await?;
            if now >= by {
                return Ok(Some(rows::Conflict::Answer(Err(StoreError::database(
                    "recording the operation",
                    DbFailure::Contention,
                    format!(
                        "the database's clock ({now}) was past the time the intent had to be \
                         recorded by ({by}) when it ran; nothing was recorded"
                    ),
                )))));
            }
        }
        Ok(None)
    }

    /// Gives back what the claim tagged `tag` took for `replica`, if it
    /// committed (its reply was lost): released, those operations are the
    /// next round's to claim, anyone's, with no settle window started
    /// again. One bounded try: what it cannot release lapses after a lease.
    pub(super) async fn release_claimed(&self, replica: &str, tag: Uuid) {
        let replica = replica.to_string();
        let released = self
            .write_once(
                RoundTrip::Reconcile,
                "releasing a claim of unknown outcome",
                move |c| {
                    let replica = replica.clone();
                    Box::pin(async move {
                        sqlx::query(sql::RELEASE_CLAIMED)
                            .bind(replica)
                            .bind(tag)
                            .execute(c)
                            .await
                    })
                },
            )
            .await;
        match released {
            Ok(done) if done.rows_affected() > 0 => tracing::info!(
                released = done.rows_affected(),
                "a claim whose reply was lost had committed: released what it took"
            ),
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e,
                "could not release what a claim of unknown outcome took; it lapses after one lease"),
        }
    }

    /// Hands a key that saved no result (`old`: FAILED, `Operation::frees_key`)
    /// on to `new`, in one transaction: `old` gives up its key's hash and
    /// `new` is inserted under the key, each with an event saying so. The
    /// new row; `None` when another replay handed the key on first (the
    /// caller looks again why); `VolumeBusy` when the volume has another
    /// open operation (nothing changed: the key stays the old one's).
    /// Made once: a lost acknowledgement is an outcome the executor reads
    /// back by the new operation's id.
    pub(super) async fn hand_key_on(
        &self,
        old: &Operation,
        new: &NewOperation,
    ) -> Result<Option<Operation>, StoreError> {
        let (on_old, on_new) = crate::domain::key_handed_on(old, new.id);
        let mut new = new.clone();
        new.events.push(on_new);
        let (old_id, live) = (old.id, new.key_hash().uuid());
        let retired = KeyHash::unkeyed("retired", old_id).uuid();
        let (write, replica) = (Uuid::now_v7(), new.replica.clone());
        let events = bind::events_array(&[on_old]);
        let new = std::sync::Arc::new(new);
        let row = self
            .write_once(RoundTrip::Intent, "handing a key on", |c| {
                let (events, replica, new) = (events.clone(), replica.clone(), new.clone());
                Box::pin(async move {
                    let mut tx = sqlx::Connection::begin(c).await?;
                    let took: Option<Uuid> = sqlx::query_scalar(sql::write::RETIRE_KEY)
                        .bind(old_id)
                        .bind(retired)
                        .bind(live)
                        .bind(write)
                        .bind(replica)
                        .bind(events)
                        .fetch_optional(&mut *tx)
                        .await?;
                    if took.is_none() {
                        return Ok(None);
                    }
                    let row = bind::create_guarded(&new).fetch_optional(&mut *tx).await?;
                    if row.is_some() {
                        tx.commit().await?;
                        return Ok(Some(Ok(row)));
                    }
                    // Not inserted: the volume's open operation stood in
                    // the way (rolled back with the transaction).
                    let busy: Option<Uuid> =
                        sqlx::query_scalar(sqlx::AssertSqlSafe(sql::OPEN_ON_VOLUME.as_str()))
                            .bind(new.volume_id)
                            .fetch_optional(&mut *tx)
                            .await?;
                    Ok(busy.map(Err))
                })
            })
            .await?;
        match row {
            None => Ok(None),
            Some(Ok(r)) => r.map(|r| bind::intent_of(&new, &r)).transpose(),
            Some(Err(holder)) => Err(StoreError::VolumeBusy {
                volume_id: new.volume_id,
                operation_id: holder,
            }),
        }
    }

    /// Cancels `old`, an attach `new` (a detach of its volume) supersedes:
    /// `None` when the volume is free for `new` now, else the operation
    /// that keeps it busy (an attach no longer cancellable).
    pub(super) async fn supersede(
        &self,
        old: &Operation,
        new: &NewOperation,
        deadline: Instant,
    ) -> Result<Option<Uuid>, StoreError> {
        let cancel = Cancel::superseded_by(old, new);
        let found = within(
            deadline,
            "recording the operation",
            self.operation_cancel(&cancel),
        )
        .await?;
        Ok(match found {
            Cancelled::Done(_) | Cancelled::NotFound => None,
            Cancelled::Not(op) if op.state.is_terminal() => None,
            Cancelled::Not(op) => Some(op.id),
        })
    }

    /// The operations a query returns (by id or by key: at most one).
    pub(super) async fn fetch_operations<F>(
        &self,
        kind: RoundTrip,
        what: &'static str,
        repeat: Repeat,
        query: F,
    ) -> Result<Vec<Operation>, StoreError>
    where
        F: Fn() -> Query<'static> + Send + Sync,
    {
        let rows = self
            .reads
            .run(kind, what, repeat, self.read_until(), |c| {
                Box::pin(query().fetch_all(c))
            })
            .await?;
        rows::operations(&rows)
    }
}

/// The list query for `filter` (`query::list`: its SQL and arguments
/// built together), bound as PostgreSQL's columns take them.
pub(super) fn list_query(
    filter: &OperationFilter,
    after: Option<ListCursor>,
    limit: u32,
) -> Query<'static> {
    let built = query::list(filter, after, limit, query::Dialect::Postgres);
    let mut q = sqlx::query(sqlx::AssertSqlSafe(built.sql));
    for arg in built.args {
        q = match arg {
            query::Arg::Text(t) => q.bind(t),
            query::Arg::Uuid(u) => q.bind(u),
            query::Arg::Int(i) => q.bind(i),
            query::Arg::Time(t) => q.bind(t),
            query::Arg::Labels(l) => q.bind(bind::jsonb(l.as_map())),
        };
    }
    q
}

/// A verification stage's next slice after its cursor, the cursor moved
/// past it, in one short transaction: the cursor row is locked for its
/// length, so replicas take consecutive slices, never the same one.
pub(super) async fn verification_slice(
    c: &mut PgConnection,
    stage: u8,
    delay: Duration,
    limit: u32,
) -> Result<Vec<sqlx::postgres::PgRow>, sqlx::Error> {
    use sqlx::Connection as _;
    let mut tx = c.begin().await?;
    let (decided_at, last_id): (DateTime<Utc>, Uuid) =
        sqlx::query_as(sql::VERIFICATION_CURSOR_HELD)
            .bind(i16::from(stage))
            .fetch_one(&mut *tx)
            .await?;
    // The position as parameters, not joined from the cursor row: with the
    // row comparison on parameters the index scan starts at the cursor;
    // joined, it read every verified decision since the first and filtered
    // them (measured: 54 ms at 50,000 decided operations, linear, while
    // holding the cursor's lock).
    let rows = sqlx::query(sqlx::AssertSqlSafe(sql::verification_statement()))
        .bind(decided_at)
        .bind(last_id)
        .bind(delay.as_secs_f64() * 1000.0)
        .bind(i64::from(limit))
        .fetch_all(&mut *tx)
        .await?;
    if let Some(last) = rows.last() {
        use sqlx::Row as _;
        let at: DateTime<Utc> = last.try_get("completed_at")?;
        let id: Uuid = last.try_get("id")?;
        sqlx::query(sql::VERIFICATION_CURSOR_MOVE)
            .bind(i16::from(stage))
            .bind(at)
            .bind(id)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(rows)
}

/// Marks an operation drifted and logs why, notified; `false` (nothing
/// written: the transaction rolls back with `tx` dropped) when the
/// operation is gone.
pub(super) async fn mark_drift(
    c: &mut PgConnection,
    id: Uuid,
    replica: String,
    events: Jsonb,
) -> Result<bool, sqlx::Error> {
    use sqlx::Connection as _;
    let mut tx = c.begin().await?;
    let marked = sqlx::query(sql::MARK_DRIFT)
        .bind(id)
        .execute(&mut *tx)
        .await?;
    if marked.rows_affected() == 0 {
        return Ok(false);
    }
    sqlx::query(sql::LOG_EVENTS)
        .bind(id)
        .bind(replica)
        .bind(events)
        .execute(&mut *tx)
        .await?;
    sqlx::query(sql::NOTIFY)
        .bind(NOTIFY_CHANNEL)
        .bind(id.to_string())
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(true)
}

impl PgStore {
    /// Every operation by state and resolution: a pass over the whole
    /// table, on a connection of its own with a bound of its own
    /// (`STATS_TIMEOUT`, on both ends), never the sessions' round-trip
    /// bound.
    pub(super) async fn count_whole_ledger(&self) -> Result<Vec<StateCount>, StoreError> {
        const WHAT: &str = "counting the ledger's operations";
        let until = Instant::now() + STATS_TIMEOUT;
        let conns = Conns::new(
            "stats",
            self.options.clone(),
            0,
            None,
            Bounds {
                round_trip: STATS_TIMEOUT,
                connect: self.reads.bounds().connect,
            },
            self.observer.clone(),
        );
        let mut conn = conns.open(until).await?;
        let rows = conns
            .bounded(RoundTrip::Scrape, WHAT, until, async {
                use sqlx::Connection as _;
                let mut tx = conn.begin().await?;
                sqlx::query(sqlx::AssertSqlSafe(sql::statement_timeout(
                    STATS_TIMEOUT.as_millis(),
                )))
                .execute(&mut *tx)
                .await?;
                let rows = sqlx::query(sql::COUNT_BY_STATE).fetch_all(&mut *tx).await?;
                tx.commit().await?;
                Ok(rows)
            })
            .await?;
        rows::counts(&rows)
    }

    /// When the first decision due for verification stage `stage` after
    /// its cursor was made, if one was at least `delay` ago.
    pub(super) async fn first_due(
        &self,
        stage: u8,
        delay: Duration,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        const WHAT: &str = "reading the verification backlog";
        self.read(RoundTrip::Scrape, WHAT, move |c| {
            Box::pin(async move {
                let (decided_at, last_id): (DateTime<Utc>, Uuid) =
                    sqlx::query_as(sql::VERIFICATION_CURSOR)
                        .bind(i16::from(stage))
                        .fetch_one(&mut *c)
                        .await?;
                sqlx::query_scalar(sql::VERIFICATION_BACKLOG)
                    .bind(decided_at)
                    .bind(last_id)
                    .bind(delay.as_secs_f64() * 1000.0)
                    .fetch_optional(&mut *c)
                    .await
            })
        })
        .await
    }
}
