//! The embedded implementation of `Store` (SQLite through sqlx), for a
//! single process: the default when no `--database-url` is given. The same
//! guarantees as PostgreSQL for one process — unique keys, one open
//! operation per volume (partial unique index), transactions around every
//! state change, fenced decisions, writes that apply once when repeated —
//! with in-process change notifications.
//!
//! One connection serializes every statement (SQLite has one writer anyway).
//! A second process on the same file is refused at start (`lock`). The
//! statements inside its transactions are in `write`. Rows are read as the
//! PostgreSQL store reads them (`rows`); only the storage of ids (text),
//! timestamps (microseconds) and JSON (text) differs.
//!
//! - `write`: the statements inside its transactions.
//! - `log`: the reconcile log as it reads.
//! - `lock`: one process per database file.
//! - `retention`: pruning in one transaction per batch.
//!
//! Why it is long: it is one `Store` trait implementation, method by method,
//! as in the PostgreSQL store; the transactions' statements are in `write`.

mod lock;
mod log;
mod retention;
mod write;

use std::fs::File;
use std::str::FromStr;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use chrono::DateTime;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{Sqlite, Transaction};
use tokio::sync::broadcast;
use tokio::time::Instant;
use uuid::Uuid;

use self::write::{
    corrupt, db, get_in, insert_events, insert_intent, now_us, to_json, update_fenced,
};
use super::rows::{self, COLUMNS, Id, Json, OPEN, Time, column};
use super::{
    Cancel, Cancelled, CreateOutcome, DbFailure, HeldLease, ListCursor, NewOperation,
    OperationFilter, OperationPage, OperatorDecision, PruneRound, Renewal, StateCount, Store,
    StoreError, Transition, within,
};
use crate::domain::{CallerKey, NewEvent, Operation, OperationError, OperationEvent, State, event};

/// The embedded migrations of `migrations/sqlite` (src/store/migrations.rs).
pub static MIGRATOR: std::sync::LazyLock<sqlx::migrate::Migrator> =
    std::sync::LazyLock::new(|| super::migrations::migrator(super::migrations::SQLITE));

column!(Sqlite, Id, String, |s: String| Uuid::parse_str(&s)
    .map(Id)
    .map_err(Into::into));
column!(Sqlite, Time, i64, |us: i64| {
    DateTime::from_timestamp_micros(us)
        .map(Time)
        .ok_or_else(|| format!("timestamp {us} µs is out of range").into())
});
column!(Sqlite, Json, String, |t| Ok(Json::Text(t)));

/// The operations a claim may take (`?1` now, `?2` how many): open, not
/// leased or the lease expired, due, not left to people; by
/// `operations_open`. (The ids this replica's tasks hold are left out by
/// the claim itself.)
static CLAIMABLE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT id, lease_owner FROM operations
         WHERE {OPEN}
           AND (lease_expires_at IS NULL OR lease_expires_at < ?1)
           AND (next_attempt_at IS NULL OR next_attempt_at <= ?1)
           AND escalated_at IS NULL
         ORDER BY next_attempt_at IS NOT NULL, next_attempt_at, seq
         LIMIT ?2"
    )
});

/// The open operations a replica holds (`?1`), by `operations_open`.
static LEASED_BY: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!("SELECT id FROM operations WHERE lease_owner = ?1 AND {OPEN}")
});

/// Open work by state (the gauge at scrape), by `operations_open`.
static OPEN_BY_STATE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT state, NULL AS resolution, count(*) AS n FROM operations
         WHERE {OPEN} GROUP BY state ORDER BY state"
    )
});

/// The decisions due for verification stage `?1` after its cursor,
/// decided at or before `?2`, in decision order (`FROM` on): by
/// `operations_decided`.
const DUE_FOR_VERIFICATION: &str = "operations, verification_cursors c
     WHERE c.stage = ?1 AND verify_expect IS NOT NULL
       AND (completed_at > c.decided_at OR (completed_at = c.decided_at AND id > c.last_id))
       AND completed_at <= ?2
     ORDER BY completed_at, id";

/// When a volume's latest operation was recorded (`?1`), by
/// `operations_volume`.
const LATEST_OF_VOLUME: &str =
    "SELECT created_at FROM operations WHERE volume_id = ?1 ORDER BY seq DESC LIMIT 1";

/// `operation_list`'s statement for `filter` (`query::list`, SQLite's).
fn list_statement(filter: &OperationFilter, after: Option<ListCursor>, limit: u32) -> String {
    super::query::list(filter, after, limit, super::query::Dialect::Sqlite).sql
}

/// Every index of `operations`, with a statement of the store's that reads
/// through it: each index earns its place by a query, and a plan test
/// (`tests/store/store_conformance.rs`) holds each statement to its index and the
/// table to exactly these indexes (SQLite's own for `id UNIQUE` included).
pub fn index_queries() -> Vec<(&'static str, String)> {
    let by = |server_id, volume_id| OperationFilter {
        server_id,
        volume_id,
        ..Default::default()
    };
    let any = Some(Uuid::nil());
    vec![
        // Reads and decisions by id.
        ("sqlite_autoindex_operations_1", rows::by_id_sql()),
        // A caller's key: replays, and why an intent was not inserted.
        ("operations_caller_key", rows::by_key_sql()),
        // The open operations: one per volume (the guarantee), the claims,
        // a replica's leases, the gauge of open work, the oldest UNKNOWN.
        ("operations_open", CLAIMABLE.clone()),
        ("operations_open", LEASED_BY.clone()),
        ("operations_open", OPEN_BY_STATE.clone()),
        ("operations_open", rows::OLDEST_UNKNOWN.clone()),
        // Pages by server, and by volume; a volume's latest operation.
        (
            "operations_server",
            list_statement(&by(any, None), None, 50),
        ),
        (
            "operations_volume",
            list_statement(&by(None, any), None, 50),
        ),
        ("operations_volume", LATEST_OF_VOLUME.to_string()),
        // Pages of the open operations in a state.
        (
            "operations_open",
            list_statement(
                &OperationFilter {
                    state: Some(State::Unknown),
                    ..Default::default()
                },
                None,
                50,
            ),
        ),
        // Decisions by time: the verifier's cursor, retention's oldest.
        (
            "operations_decided",
            format!("SELECT {COLUMNS} FROM {DUE_FOR_VERIFICATION} LIMIT ?3"),
        ),
        ("operations_decided", retention::VICTIMS.to_string()),
        ("operations_decided", retention::OLDEST_DECIDED.to_string()),
    ]
}

pub struct SqliteStore {
    pool: SqlitePool,
    changes: broadcast::Sender<Uuid>,
    lock: Mutex<Option<File>>,
    /// One retention round at a time in the process.
    retention: std::sync::Arc<tokio::sync::Mutex<()>>,
}

/// How many migrations the database records as applied (none on a new
/// file).
async fn applied_migrations(conn: &mut sqlx::SqliteConnection) -> anyhow::Result<i64> {
    let what = |e| anyhow::anyhow!("reading the embedded database's migrations: {e}");
    let exists: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations'",
    )
    .fetch_one(&mut *conn)
    .await
    .map_err(what)?;
    if exists == 0 {
        return Ok(0);
    }
    sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations")
        .fetch_one(&mut *conn)
        .await
        .map_err(what)
}

/// Applies the embedded migrations with foreign keys off, then, when any
/// ran, checks every foreign key before the store serves. A migration that
/// rebuilds a table the log rows reference (SQLite cannot change a table's
/// constraints in place: a new table, the rows copied, the old one dropped,
/// the new one renamed) would otherwise fail on the drop as soon as the
/// table has log rows, and SQLite ignores the switch inside a migration's
/// transaction.
async fn migrate(pool: &SqlitePool) -> anyhow::Result<()> {
    let mut conn = pool
        .acquire()
        .await
        .map_err(|e| anyhow::anyhow!("opening the embedded database to migrate it: {e}"))?;
    let before = applied_migrations(&mut conn).await?;
    sqlx::query("PRAGMA foreign_keys = OFF")
        .execute(&mut *conn)
        .await
        .map_err(|e| anyhow::anyhow!("migrating the embedded database: {e}"))?;
    // `run` on a connection (not a pool) is `run_direct` with nothing
    // skipped; `run` itself makes the future `!Send` here (sqlx's note on
    // `run_direct`: its `Acquire` bound is "not general enough").
    let migrated = MIGRATOR
        .run_direct(None, &mut *conn, false)
        .await
        .map_err(|e| anyhow::anyhow!("applying embedded migrations: {e}"));
    // Whatever the migrations did, foreign keys are enforced again before
    // the connection goes back to the pool (it is the store's only one).
    sqlx::query("PRAGMA foreign_keys = ON")
        .execute(&mut *conn)
        .await
        .map_err(|e| anyhow::anyhow!("migrating the embedded database: {e}"))?;
    migrated?;
    let after = applied_migrations(&mut conn).await?;
    if after == before {
        // Nothing migrated: nothing ran without its foreign keys.
        return Ok(());
    }
    let broken: Vec<(String, i64, String)> =
        sqlx::query_as("SELECT \"table\", rowid, parent FROM pragma_foreign_key_check")
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| anyhow::anyhow!("checking the embedded database's foreign keys: {e}"))?;
    if let Some((table, rowid, parent)) = broken.first() {
        anyhow::bail!(
            "the embedded database is inconsistent after its migrations: {} row(s) point at \
             nothing, the first {table} rowid {rowid} (its {parent} is missing)",
            broken.len()
        );
    }
    Ok(())
}

impl SqliteStore {
    /// Opens (creating it on first start) and migrates the database.
    pub async fn connect(url: &str) -> anyhow::Result<Self> {
        let lock = match lock::file_of(url) {
            Some(path) => Some(lock::take_lock(&path)?),
            None => None,
        };
        let options = SqliteConnectOptions::from_str(url)
            .map_err(|e| anyhow::anyhow!("invalid SQLite URL {url:?}: {e}"))?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            // One connection, so no statement ever waits for another
            // process; this bound only matters if something else touches
            // the file despite the lock.
            .busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .acquire_timeout(Duration::from_secs(3600))
            .connect_with(options)
            .await
            .map_err(|e| anyhow::anyhow!("cannot open the embedded database {url}: {e}"))?;
        migrate(&pool).await?;
        let (changes, _) = broadcast::channel(4096);
        Ok(Self {
            pool,
            changes,
            lock: Mutex::new(lock),
            retention: std::sync::Arc::default(),
        })
    }

    fn notify(&self, id: Uuid) {
        // No subscriber right now is fine.
        drop(self.changes.send(id));
    }

    async fn begin(&self) -> Result<Transaction<'static, Sqlite>, StoreError> {
        self.pool
            .begin()
            .await
            .map_err(db("starting a transaction"))
    }

    /// A transaction that writes from its first statement: it takes the
    /// write lock at once (waiting up to the busy timeout), instead of
    /// reading first and then failing at once with SQLITE_BUSY when it
    /// must upgrade while another connection writes.
    async fn begin_write(&self) -> Result<Transaction<'static, Sqlite>, StoreError> {
        self.pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(db("starting a transaction"))
    }

    async fn fetch_one_operation(
        &self,
        sql: String,
        keys: &[&str],
        what: &'static str,
    ) -> Result<Option<Operation>, StoreError> {
        let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
        for k in keys {
            q = q.bind(k.to_string());
        }
        let row = q.fetch_optional(&self.pool).await.map_err(db(what))?;
        row.as_ref().map(rows::operation).transpose()
    }
}

/// The log line of a claim that takes over a lease somebody held.
fn taken_over(prev: &str, epoch: i64) -> NewEvent {
    NewEvent::new(
        event::CLAIMED,
        format!("taken over from {prev}, whose lease expired"),
    )
    .with("lease_epoch", epoch)
    .with("previous_holder", prev)
}

#[async_trait]
impl Store for SqliteStore {
    fn operation_create(
        &self,
        new: NewOperation,
        deadline: Instant,
    ) -> futures_util::future::BoxFuture<'_, Result<CreateOutcome, StoreError>> {
        Box::pin(self.create(new, deadline))
    }

    async fn operation_get(&self, id: Uuid) -> Result<Option<Operation>, StoreError> {
        self.fetch_one_operation(
            rows::by_id_sql(),
            &[&id.to_string()],
            "reading an operation",
        )
        .await
    }

    async fn operation_get_by_key(&self, key: &CallerKey) -> Result<Option<Operation>, StoreError> {
        self.fetch_one_operation(
            rows::by_key_sql(),
            &[key.caller().as_str(), key.key().as_str()],
            "reading an operation by key",
        )
        .await
    }

    async fn operation_list(
        &self,
        filter: &OperationFilter,
        after: Option<ListCursor>,
        limit: u32,
    ) -> Result<OperationPage, StoreError> {
        // Its SQL and arguments built together (`query::list`), bound as
        // this store keeps its columns.
        use super::query::{Arg, Dialect, list};
        let built = list(filter, after, limit, Dialect::Sqlite);
        let mut q = sqlx::query(sqlx::AssertSqlSafe(built.sql));
        for arg in built.args {
            q = match arg {
                Arg::Text(t) => q.bind(t),
                Arg::Uuid(u) => q.bind(u.to_string()),
                Arg::Int(i) => q.bind(i),
                Arg::Time(t) => q.bind(write::micros(t)),
                Arg::Labels(l) => q.bind(l.to_json()),
            };
        }
        let rows = q
            .fetch_all(&self.pool)
            .await
            .map_err(db("listing operations"))?;
        rows::page(&rows, limit)
    }

    async fn operation_events(&self, id: Uuid) -> Result<Vec<OperationEvent>, StoreError> {
        log::read(&self.pool, id).await
    }

    async fn operation_transition(
        &self,
        t: Transition,
        deadline: Instant,
    ) -> Result<Option<Operation>, StoreError> {
        within(deadline, "recording a state change", async {
            let mut tx = self.begin().await?;
            let Some(op) = update_fenced(&mut tx, &t).await? else {
                // Fenced out, or this very write was made before (same
                // write, same epoch): then its row as it left it.
                let made = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SELECT {COLUMNS} FROM operations WHERE id = $1 AND lease_epoch = $2 AND last_write = $3"
                )))
                .bind(t.id.to_string())
                .bind(t.lease_epoch)
                .bind(t.write_id.to_string())
                .fetch_optional(&mut *tx)
                .await
                .map_err(db("recording a state change"))?;
                tx.rollback()
                    .await
                    .map_err(db("recording a state change"))?;
                return made.as_ref().map(rows::operation).transpose();
            };
            insert_events(&mut tx, t.id, &t.replica, Some(t.write_id), &t.events).await?;
            tx.commit().await.map_err(db("recording a state change"))?;
            self.notify(t.id);
            Ok(Some(op))
        })
        .await
    }

    async fn operation_append_events(
        &self,
        id: Uuid,
        replica: &str,
        events: Vec<NewEvent>,
    ) -> Result<(), StoreError> {
        let mut tx = self.begin().await?;
        // One transaction, never re-run; named like PostgreSQL's appends.
        let write = Some(Uuid::now_v7());
        insert_events(&mut tx, id, replica, write, &events).await?;
        tx.commit()
            .await
            .map_err(db("appending to the reconcile log"))
    }

    async fn operation_claim(
        &self,
        replica: &str,
        lease: Duration,
        limit: u32,
        held: &[Uuid],
    ) -> Result<Vec<Operation>, StoreError> {
        let mut tx = self.begin().await?;
        let now = now_us();
        // The held ones are passed over in the query's order and the limit
        // counts only the others: as many more are read as are held.
        let held: std::collections::HashSet<String> = held.iter().map(Uuid::to_string).collect();
        let mut ids: Vec<(String, Option<String>)> =
            sqlx::query_as(sqlx::AssertSqlSafe(CLAIMABLE.as_str()))
                .bind(now)
                .bind(i64::from(limit) + held.len() as i64)
                .fetch_all(&mut *tx)
                .await
                .map_err(db("claiming operations"))?;
        ids.retain(|(id, _)| !held.contains(id));
        ids.truncate(limit as usize);
        let mut out = Vec::with_capacity(ids.len());
        for (id, prev_owner) in ids {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "UPDATE operations SET lease_owner = ?2, lease_expires_at = ?3, lease_epoch = lease_epoch + 1,
                    passes = passes + 1, last_request_at = {TAKEOVER_RESTAMP}, claim_attempts = attempts,
                    updated_at = ?4 WHERE id = ?1"
            )))
            .bind(&id)
            .bind(replica)
            .bind(now + lease.as_micros() as i64)
            .bind(now)
            .execute(&mut *tx)
            .await
            .map_err(db("claiming operations"))?;
            let uuid = Uuid::parse_str(&id).map_err(|e| corrupt(&id, e.to_string()))?;
            let op = get_in(&mut tx, uuid)
                .await?
                .ok_or_else(|| corrupt(&id, "claimed row vanished"))?;
            if let Some(prev) = prev_owner {
                insert_events(
                    &mut tx,
                    uuid,
                    replica,
                    None,
                    &[taken_over(&prev, op.lease_epoch)],
                )
                .await?;
            }
            out.push(op);
        }
        tx.commit().await.map_err(db("claiming operations"))?;
        Ok(out)
    }

    async fn operation_claim_one(
        &self,
        id: Uuid,
        replica: &str,
        lease: Duration,
    ) -> Result<Option<Operation>, StoreError> {
        let mut tx = self.begin().await?;
        let now = now_us();
        let prev_owner: Option<String> =
            sqlx::query_scalar("SELECT lease_owner FROM operations WHERE id = ?")
                .bind(id.to_string())
                .fetch_optional(&mut *tx)
                .await
                .map_err(db("claiming an operation"))?
                .flatten();
        let r = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE operations SET lease_owner = ?2, lease_expires_at = ?3, lease_epoch = lease_epoch + 1,
                passes = passes + 1, last_request_at = {TAKEOVER_RESTAMP}, claim_attempts = attempts,
                    updated_at = ?4
             WHERE id = ?1 AND {OPEN} AND (lease_expires_at IS NULL OR lease_expires_at < ?4)"
        )))
        .bind(id.to_string())
        .bind(replica)
        .bind(now + lease.as_micros() as i64)
        .bind(now)
        .execute(&mut *tx)
        .await
        .map_err(db("claiming an operation"))?;
        if r.rows_affected() == 0 {
            tx.rollback().await.map_err(db("claiming an operation"))?;
            return Ok(None);
        }
        let op = get_in(&mut tx, id).await?;
        if let (Some(op), Some(prev)) = (&op, prev_owner) {
            insert_events(
                &mut tx,
                id,
                replica,
                None,
                &[taken_over(&prev, op.lease_epoch)],
            )
            .await?;
        }
        tx.commit().await.map_err(db("claiming an operation"))?;
        Ok(op)
    }

    async fn operation_renew_leases(
        &self,
        replica: &str,
        held: &[HeldLease],
        lease: Duration,
    ) -> Result<Vec<(Uuid, Renewal)>, StoreError> {
        let mut found = Vec::with_capacity(held.len());
        let mut tx = self.begin().await?;
        let until = now_us() + lease.as_micros() as i64;
        for h in held {
            let r = sqlx::query(sqlx::AssertSqlSafe(format!(
                "UPDATE operations SET lease_expires_at = ?3
                 WHERE id = ?1 AND lease_owner = ?2 AND lease_epoch = ?4 AND {OPEN}"
            )))
            .bind(h.id.to_string())
            .bind(replica)
            .bind(until)
            .bind(h.epoch)
            .execute(&mut *tx)
            .await
            .map_err(db("renewing leases"))?;
            // One writer: no row is ever held by another statement here,
            // so what is not renewed is decided or another's.
            let renewal = if r.rows_affected() > 0 {
                Renewal::Renewed
            } else {
                let decided: Option<bool> = sqlx::query_scalar(
                    "SELECT completed_at IS NOT NULL FROM operations WHERE id = ?",
                )
                .bind(h.id.to_string())
                .fetch_optional(&mut *tx)
                .await
                .map_err(db("renewing leases"))?;
                match decided {
                    Some(true) => Renewal::Decided,
                    _ => Renewal::Lost,
                }
            };
            found.push((h.id, renewal));
        }
        tx.commit().await.map_err(db("renewing leases"))?;
        Ok(found)
    }

    async fn verification_backlog(
        &self,
        stage: u8,
        delay: Duration,
    ) -> Result<Option<DateTime<chrono::Utc>>, StoreError> {
        const WHAT: &str = "reading the verification backlog";
        let oldest: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT completed_at FROM {DUE_FOR_VERIFICATION} LIMIT 1"
        )))
        .bind(i64::from(stage))
        .bind(now_us() - delay.as_micros() as i64)
        .fetch_optional(&self.pool)
        .await
        .map_err(db(WHAT))?;
        oldest
            .map(|us| {
                DateTime::from_timestamp_micros(us)
                    .ok_or_else(|| corrupt("verification backlog", format!("timestamp {us} µs")))
            })
            .transpose()
    }

    async fn verification_next(
        &self,
        stage: u8,
        delay: Duration,
        limit: u32,
    ) -> Result<Vec<Operation>, StoreError> {
        const WHAT: &str = "taking decisions to verify";
        let mut tx = self.begin().await?;
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM {DUE_FOR_VERIFICATION} LIMIT ?3"
        )))
        .bind(i64::from(stage))
        .bind(now_us() - delay.as_micros() as i64)
        .bind(i64::from(limit))
        .fetch_all(&mut *tx)
        .await
        .map_err(db(WHAT))?;
        let ops = rows::operations(&rows)?;
        if let Some(last) = ops.last() {
            sqlx::query(
                "UPDATE verification_cursors SET decided_at = ?2, last_id = ?3 WHERE stage = ?1",
            )
            .bind(i64::from(stage))
            .bind(last.completed_at.map(write::micros))
            .bind(last.id.to_string())
            .execute(&mut *tx)
            .await
            .map_err(db(WHAT))?;
        }
        tx.commit().await.map_err(db(WHAT))?;
        Ok(ops)
    }

    async fn operation_mark_drift(
        &self,
        id: Uuid,
        replica: &str,
        events: Vec<NewEvent>,
    ) -> Result<(), StoreError> {
        let mut tx = self.begin().await?;
        sqlx::query("UPDATE operations SET drifted = 1, updated_at = ? WHERE id = ?")
            .bind(now_us())
            .bind(id.to_string())
            .execute(&mut *tx)
            .await
            .map_err(db("marking drift"))?;
        insert_events(&mut tx, id, replica, None, &events).await?;
        tx.commit().await.map_err(db("marking drift"))?;
        self.notify(id);
        Ok(())
    }

    async fn operation_resolve_by_operator(
        &self,
        d: &OperatorDecision,
    ) -> Result<Operation, StoreError> {
        let (id, state) = (d.id, d.state);
        let mut tx = self.begin().await?;
        let now = now_us();
        let caller = d.caller.as_deref().unwrap_or("");
        let last_error = (state == State::Failed).then(|| {
            to_json(
                &OperationError::new(crate::domain::Reason::OperatorResolved, &d.reason)
                    .with("caller", caller),
            )
        });
        let r = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE operations SET state = ?2, resolution = 'operator', completed_at = ?3, updated_at = ?3,
                lease_owner = NULL, lease_expires_at = NULL, lease_epoch = lease_epoch + 1, next_attempt_at = NULL,
                last_error = COALESCE(?4, last_error)
             WHERE id = ?1 AND {OPEN} AND (?5 IS NULL OR state = ?5)"
        )))
        .bind(id.to_string())
        .bind(state.as_str())
        .bind(now)
        .bind(last_error)
        .bind(d.expect.map(State::as_str))
        .execute(&mut *tx)
        .await
        .map_err(db("resolving by operator"))?;
        if r.rows_affected() == 0 {
            let current = get_in(&mut tx, id).await?;
            tx.rollback().await.map_err(db("resolving by operator"))?;
            return Err(rows::not_resolvable(id, d.expect, current));
        }
        let mut ev = NewEvent::new(event::OPERATOR_RESOLVED, &d.reason)
            .with("state", state.as_str())
            .with("caller", caller);
        for (k, v) in &d.audit {
            ev = ev.with(k, v);
        }
        insert_events(&mut tx, id, &d.replica, None, &[ev]).await?;
        let op = get_in(&mut tx, id).await?.ok_or(StoreError::NotFound(id))?;
        tx.commit().await.map_err(db("resolving by operator"))?;
        self.notify(id);
        Ok(op)
    }

    async fn operation_cancel(&self, c: &Cancel) -> Result<Cancelled, StoreError> {
        const WHAT: &str = "cancelling an operation";
        let mut tx = self.begin_write().await?;
        if !write::cancel_in(&mut tx, c).await? {
            let current = get_in(&mut tx, c.id).await?;
            tx.rollback().await.map_err(db(WHAT))?;
            return Ok(current.map_or(Cancelled::NotFound, Cancelled::Not));
        }
        let op = get_in(&mut tx, c.id)
            .await?
            .ok_or(StoreError::NotFound(c.id))?;
        tx.commit().await.map_err(db(WHAT))?;
        self.notify(c.id);
        Ok(Cancelled::Done(op))
    }

    async fn operation_release_leases(
        &self,
        replica: &str,
        keep: &[Uuid],
    ) -> Result<u64, StoreError> {
        let mut tx = self.begin().await?;
        let mut ids: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(LEASED_BY.as_str()))
            .bind(replica)
            .fetch_all(&mut *tx)
            .await
            .map_err(db("releasing leases"))?;
        let keep: Vec<String> = keep.iter().map(Uuid::to_string).collect();
        ids.retain(|id| !keep.contains(id));
        for id in &ids {
            sqlx::query("UPDATE operations SET lease_owner = NULL, lease_expires_at = NULL, updated_at = ? WHERE id = ?")
                .bind(now_us())
                .bind(id)
                .execute(&mut *tx)
                .await
                .map_err(db("releasing leases"))?;
            let uuid = Uuid::parse_str(id).map_err(|e| corrupt(id, e.to_string()))?;
            let ev = NewEvent::new(
                event::HANDED_OVER,
                "replica shut down; lease released for another reconciler",
            );
            insert_events(&mut tx, uuid, replica, None, &[ev]).await?;
        }
        tx.commit().await.map_err(db("releasing leases"))?;
        Ok(ids.len() as u64)
    }

    async fn operation_count_by_state(&self) -> Result<Vec<StateCount>, StoreError> {
        // One pass over the whole table, on demand (`ops stats`): nothing
        // keeps counts as the ledger changes.
        let rows = sqlx::query(
            "SELECT state, resolution, count(*) AS n FROM operations
             GROUP BY state, resolution ORDER BY state, resolution",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(db("counting operations"))?;
        rows::counts(&rows)
    }

    async fn operation_open_by_state(&self) -> Result<Vec<StateCount>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(OPEN_BY_STATE.as_str()))
            .fetch_all(&self.pool)
            .await
            .map_err(db("counting the open operations"))?;
        rows::counts(&rows)
    }

    async fn oldest_unknown_since(&self) -> Result<Option<DateTime<chrono::Utc>>, StoreError> {
        let since: Option<i64> =
            sqlx::query_scalar(sqlx::AssertSqlSafe(rows::OLDEST_UNKNOWN.as_str()))
                .fetch_one(&self.pool)
                .await
                .map_err(db("reading the oldest UNKNOWN operation"))?;
        since
            .map(|us| {
                DateTime::from_timestamp_micros(us)
                    .ok_or_else(|| corrupt("oldest UNKNOWN", format!("timestamp {us} µs")))
            })
            .transpose()
    }

    async fn volumes_latest_operation(
        &self,
        volumes: &[Uuid],
    ) -> Result<Vec<(Uuid, chrono::DateTime<chrono::Utc>)>, StoreError> {
        let mut out = Vec::new();
        for v in volumes {
            let latest: Option<i64> = sqlx::query_scalar(LATEST_OF_VOLUME)
                .bind(v.to_string())
                .fetch_optional(&self.pool)
                .await
                .map_err(db("reading volumes' latest operations"))?;
            if let Some(us) = latest {
                let at = DateTime::from_timestamp_micros(us)
                    .ok_or_else(|| corrupt(&v.to_string(), format!("timestamp {us} µs")))?;
                out.push((*v, at));
            }
        }
        Ok(out)
    }

    async fn now(&self) -> Result<chrono::DateTime<chrono::Utc>, StoreError> {
        // One process: its clock is the ledger's.
        Ok(chrono::Utc::now())
    }

    fn subscribe(&self) -> broadcast::Receiver<Uuid> {
        self.changes.subscribe()
    }

    /// Nothing to register: one process, and every change is announced to
    /// its subscribers.
    async fn watch(&self, _id: Uuid, _wait: Duration) -> Result<(), StoreError> {
        Ok(())
    }

    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1")
            .execute(&self.pool)
            .await
            .map_err(db("checking the database"))?;
        Ok(())
    }

    async fn retention_begin(&self) -> Result<Option<Box<dyn PruneRound>>, StoreError> {
        Ok(retention::begin(&self.pool, &self.retention))
    }

    async fn retention_oldest_decided(
        &self,
    ) -> Result<Option<chrono::DateTime<chrono::Utc>>, StoreError> {
        let us: Option<i64> = sqlx::query_scalar(retention::OLDEST_DECIDED)
            .fetch_one(&self.pool)
            .await
            .map_err(db("reading the oldest decision"))?;
        us.map(|us| instant_of(us, "operations", "completed_at"))
            .transpose()
    }

    async fn operation_key_expired(
        &self,
        key: &CallerKey,
    ) -> Result<Option<chrono::DateTime<chrono::Utc>>, StoreError> {
        let us: Option<i64> =
            sqlx::query_scalar("SELECT pruned_at FROM idempotency_tombstones WHERE key_hash = ?")
                .bind(key.hash().bytes().to_vec())
                .fetch_optional(&self.pool)
                .await
                .map_err(db("reading a key's tombstone"))?;
        us.map(|us| instant_of(us, "idempotency_tombstones", "pruned_at"))
            .transpose()
    }

    async fn operation_mark_unsent(
        &self,
        id: Uuid,
        epoch: i64,
        attempts: i32,
        replica: &str,
    ) -> Result<bool, StoreError> {
        const WHAT: &str = "marking an attempt that never left";
        let mut tx = self.begin_write().await?;
        let now = now_us();
        let done = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE operations SET unsent_attempt = ?3, next_attempt_at = ?1, updated_at = ?1
             WHERE id = ?2 AND attempts = ?3 AND {OPEN} AND unsent_attempt IS NOT ?3"
        )))
        .bind(now)
        .bind(id.to_string())
        .bind(attempts)
        .execute(&mut *tx)
        .await
        .map_err(db(WHAT))?;
        let marked = done.rows_affected() > 0;
        if marked {
            let ev = crate::store::pg::unsent_event(epoch, attempts);
            insert_events(&mut tx, id, replica, None, &[ev]).await?;
        }
        tx.commit().await.map_err(db(WHAT))?;
        Ok(marked)
    }

    async fn close(&self) {
        self.pool.close().await;
        // Dropping the file releases the lock: another process may start.
        drop(self.lock.lock().unwrap_or_else(|p| p.into_inner()).take());
    }
}

/// A stored instant (µs since the epoch) of `table`'s `column`; one out of
/// range is a corrupt row, named.
fn instant_of(us: i64, table: &str, column: &str) -> Result<DateTime<chrono::Utc>, StoreError> {
    DateTime::from_timestamp_micros(us).ok_or_else(|| corrupt(table, format!("{column} {us} µs")))
}

impl SqliteStore {
    /// `Store::operation_create`.
    async fn create(
        &self,
        new: NewOperation,
        deadline: Instant,
    ) -> Result<CreateOutcome, StoreError> {
        // Until its commit the intent is bounded by the deadline (dropped,
        // the transaction rolls back); the commit itself is awaited to its
        // end, whatever the time (see `Store::operation_create`).
        let mut superseded = None;
        let prepared = within(deadline, "recording the operation", async {
            let mut tx = self.begin_write().await?;
            // A pruned key is refused (its tombstone), never run again.
            if let Some(pruned_at) = write::tombstone_of(&mut tx, &new).await? {
                tx.rollback().await.map_err(db("recording the operation"))?;
                return Err(StoreError::KeyExpired {
                    key: new.stored_key(),
                    pruned_at,
                });
            }
            let mut new = std::borrow::Cow::Borrowed(&new);
            let mut inserted = insert_intent(&mut tx, &new).await?;
            if inserted.is_none() {
                match conflict_in(&mut tx, &new).await? {
                    Some(rows::Conflict::FreedKey(old)) => {
                        // The key saved no result: handed on to this
                        // intent, in this transaction.
                        let (on_old, on_new) = crate::domain::key_handed_on(&old, new.id);
                        if write::retire_key(&mut tx, &old, &new.lease_owner, on_old).await? {
                            new.to_mut().events.push(on_new);
                            inserted = insert_intent(&mut tx, &new).await?;
                        }
                    }
                    Some(rows::Conflict::Supersede(old)) => {
                        // A detach cancels its caller's unsent attach of
                        // the volume, in this transaction, and takes its
                        // place.
                        let cancel = super::Cancel::superseded_by(&old, &new);
                        if write::cancel_in(&mut tx, &cancel).await? {
                            superseded = Some(old.id);
                            inserted = insert_intent(&mut tx, &new).await?;
                        }
                    }
                    _ => {}
                }
            }
            let Some(op) = inserted else {
                // The key exists (a replay joins even while its volume is
                // busy with itself), or the volume is busy.
                let found = conflict_in(&mut tx, &new).await?;
                tx.rollback().await.map_err(db("recording the operation"))?;
                let answer = match found {
                    Some(rows::Conflict::Answer(answer)) => answer,
                    // Handed on in this transaction, yet in the way: the
                    // key's new operation is another's write (one writer:
                    // never).
                    Some(rows::Conflict::FreedKey(old) | rows::Conflict::Supersede(old)) => {
                        Err(StoreError::database(
                            "recording the operation",
                            DbFailure::Constraint,
                            format!(
                                "operation {} stayed in the way after it was handed on or cancelled",
                                old.id
                            ),
                        ))
                    }
                    // Neither, in the same transaction: the only other
                    // unique column, the id, is another key's.
                    None => Err(StoreError::database(
                        "recording the operation",
                        DbFailure::Constraint,
                        format!("operation id {} belongs to another key", new.id),
                    )),
                };
                return answer.map(Err);
            };
            // The intent's `recorded` event is in its row (`intent`); the
            // events after it (Cinder's word before sending) are logged
            // under the operation's id as their write.
            let after_recorded = match new.events.split_first() {
                Some((first, rest)) if first.kind == event::RECORDED => rest,
                _ => &new.events[..],
            };
            // Under the lease holder's name, as PostgreSQL logs them.
            insert_events(
                &mut tx,
                new.id,
                &new.lease_owner,
                Some(new.id),
                after_recorded,
            )
            .await?;
            Ok(Ok((tx, op)))
        })
        .await?;
        match prepared {
            Ok((tx, op)) => {
                tx.commit().await.map_err(db("recording the operation"))?;
                if let Some(old) = superseded {
                    self.notify(old);
                }
                self.notify(op.id);
                Ok(CreateOutcome::Created(op))
            }
            // The key's operation (a replay), found inside the deadline.
            Err(existing) => Ok(existing),
        }
    }
}

/// What stands in the way of `new` (see `rows::not_inserted`), read in
/// the intent's transaction.
async fn conflict_in(
    tx: &mut sqlx::Transaction<'static, sqlx::Sqlite>,
    new: &NewOperation,
) -> Result<Option<rows::Conflict>, StoreError> {
    let found = sqlx::query(sqlx::AssertSqlSafe(rows::conflict_sql()))
        .bind(new.stored_key())
        .bind(new.volume_id.to_string())
        .bind(new.key.caller().as_str())
        .fetch_optional(&mut **tx)
        .await
        .map_err(db("looking up why an intent was not recorded"))?;
    Ok(rows::not_inserted(new, found.as_ref()))
}

/// The new `last_request_at` of a claimed row, as PostgreSQL's claim
/// writes it (`store::pg::sql`'s `TAKEOVER_RESTAMP`, which says why): at a
/// takeover of an expired lease under which an attempt was recorded (and
/// not known unsent), the old lease's end when it is later. SQLite reads
/// every column of a `SET` from the row before the update.
const TAKEOVER_RESTAMP: &str =
    "CASE WHEN lease_owner IS NOT NULL AND last_request_at < lease_expires_at
                      AND attempts > claim_attempts
                      AND unsent_attempt IS NOT attempts
                     THEN lease_expires_at ELSE last_request_at END";
