//! PostgreSQL implementation of `Store`, the production one: one round trip
//! per write on the hot path (data-modifying CTEs write the row and its
//! events together), durable writes group-committed by a few writers on
//! connections of their own (`batch`, `conns`, `statements`), runtime
//! checked queries tested against a real database, LISTEN/NOTIFY as the
//! wake-up hint for watchers (`listen`).
//!
//! Why it is long: it is one `Store` trait implementation, method by method,
//! each method a statement and its row mapping; the statements themselves,
//! the batch writer and the connections are already in files of their own.

mod batch;
mod conns;
mod listen;
mod retention;
mod statements;
mod wait;

pub use statements::{pgbench_script, writer_statements};

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::postgres::{PgArguments, PgConnectOptions, PgPool, PgPoolOptions, Postgres};
use tokio::sync::broadcast;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use self::batch::{Payload, Writer};
use self::statements::{Append, NOTIFY_CHANNEL};
use super::rows::{self, COLUMNS, Id, Json, OPEN, Time, column};
use super::{
    CreateOutcome, DbFailure, NewOperation, OperationFilter, OperationPage, PruneRound, StateCount,
    Store, StoreError, Transition, within,
};
use crate::domain::{NewEvent, Operation, OperationEvent, State, event};

/// The embedded migrations of `migrations/pg` (src/store/migrations.rs).
pub static MIGRATOR: std::sync::LazyLock<sqlx::migrate::Migrator> =
    std::sync::LazyLock::new(|| super::migrations::migrator(super::migrations::PG));

column!(Postgres, Id, Uuid, |v| Ok(Id(v)));
column!(Postgres, Time, DateTime<Utc>, |v| Ok(Time(v)));
column!(Postgres, Json, serde_json::Value, |v| Ok(Json::Value(v)));

type Query<'q> = sqlx::query::Query<'q, Postgres, PgArguments>;

/// The advisory lock the folds of the state counts take turns on (any
/// number unique to this schema: "vrcounts" in ASCII).
const COUNTS_FOLD_LOCK: i64 = 0x7672_636f_756e_7473;

/// Appending events has no caller's deadline (background work); a write
/// that waits this long for the group commit is given up and reported.
const APPEND_DEADLINE: Duration = Duration::from_secs(60);

/// Opening a connection once the server accepted one at start (the pool's
/// first, the listener's): a server that vanished right then is reported
/// within this, not after the pool's hour.
const SETUP_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The ledger writers' session settings, on top of every connection's.
///
/// Every row a writer touches is found by a key (an operation's id, a
/// tombstone's key hash, and the foreign-key checks of the events it
/// appends). Plans are generic and made once per connection: on a fresh
/// ledger they were made while the tables were empty, and a sequential
/// scan of an empty table is cheapest then, and stays in the plan while the
/// table grows until autovacuum first analyzes it (up to a minute: 40,000
/// operations at full load, each decision batch scanning them all).
/// Measured on a fresh database at 64 callers: 16–54 ms per decision batch.
pub const WRITER_SETTINGS: &[(&str, &str)] = &[("enable_seqscan", "off")];

/// Pool settings. The acquire timeout is a liveness backstop only: every
/// request-path wait is bounded by its own deadline through `within`.
#[derive(Debug, Clone)]
pub struct PgSettings {
    pub url: String,
    pub max_connections: u32,
}

pub struct PgStore {
    pool: PgPool,
    changes: broadcast::Sender<Uuid>,
    stop: CancellationToken,
    writer: Writer,
}

impl PgStore {
    /// Connects (waiting up to `super::DEFAULT_CONNECT_TIMEOUT` for a
    /// server that is not up yet), applies pending migrations and starts
    /// the change listener: `connect_within` with the default wait.
    pub async fn connect(settings: &PgSettings) -> anyhow::Result<Self> {
        Self::connect_within(settings, super::DEFAULT_CONNECT_TIMEOUT).await
    }

    /// Connects, waiting up to `wait` for the server to accept connections
    /// (logging each try), then applies pending migrations (serialized
    /// across replicas by sqlx's advisory lock; not bounded by `wait`: a
    /// long migration is work, not a server that is down) and starts the
    /// change listener.
    pub async fn connect_within(settings: &PgSettings, wait: Duration) -> anyhow::Result<Self> {
        let options = PgConnectOptions::from_str(&settings.url)
            .map_err(|e| anyhow::anyhow!("invalid database URL: {e}"))?
            .application_name("volume-reconciler")
            // The hot statements are prepared once per connection and their
            // shape never changes: plan them once, not at every execution.
            .options([("plan_cache_mode", "force_generic_plan")]);
        wait::until_accepting(&options, wait).await?;
        let server = wait::server_of(&options);
        let writer_options = options.clone().options(WRITER_SETTINGS.iter().copied());
        // One writer per kind of write (intents; decisions) per 16
        // connections, at most two each: a batch forms while the other
        // kind's commits, and batches stay large. More writers make smaller
        // batches, and a batch's fixed cost (executor start-up, triggers,
        // commit) is most of a small one's: at c=64, four general writers
        // did 2,100 ops/s, two 2,750 (BENCHMARKS.md "Less work per call").
        // They hold connections of their own (writers + 1), the pool the rest.
        let writers = 2 * (settings.max_connections / 16).clamp(1, 2);
        let pool_size = settings.max_connections.saturating_sub(writers + 1).max(3);
        let pool = PgPoolOptions::new()
            .max_connections(pool_size)
            // Not a request bound (those use the request's deadline); only a
            // backstop for background work if the database is gone.
            .acquire_timeout(Duration::from_secs(3600))
            .connect_lazy_with(options);
        // The server just accepted a connection; if it went away again
        // meanwhile, say so within the bound of one more connect rather
        // than the pool's hour.
        let conn = tokio::time::timeout(SETUP_CONNECT_TIMEOUT, pool.acquire())
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "PostgreSQL at {server} accepted a connection, then none within {SETUP_CONNECT_TIMEOUT:?}"
                )
            })?
            .map_err(|e| anyhow::anyhow!("cannot connect to PostgreSQL at {server}: {e}"))?;
        // Back to the pool, which the migrator takes it from: running it on
        // `&mut *conn` makes this future not `Send` (sqlx's `Acquire` is
        // not general enough over the connection's lifetime).
        drop(conn);
        MIGRATOR
            .run(&pool)
            .await
            .map_err(|e| anyhow::anyhow!("applying migrations: {e}"))?;
        let (changes, _) = broadcast::channel(4096);
        let stop = CancellationToken::new();
        tokio::time::timeout(
            SETUP_CONNECT_TIMEOUT,
            listen::spawn_listener(pool.clone(), changes.clone(), stop.clone()),
        )
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "PostgreSQL at {server}: no LISTEN connection within {SETUP_CONNECT_TIMEOUT:?}"
            )
        })??;
        let writer = Writer::start(
            writer_options,
            writers as usize,
            changes.clone(),
            stop.clone(),
        )
        .await
        .map_err(|e| anyhow::anyhow!("cannot connect to PostgreSQL (ledger writer): {e}"))?;
        Ok(Self {
            pool,
            changes,
            stop,
            writer,
        })
    }

    /// Why an intent row was not inserted (see `rows::not_inserted`).
    async fn why_not_inserted(
        &self,
        new: &NewOperation,
    ) -> Result<Option<Result<CreateOutcome, StoreError>>, StoreError> {
        let found = sqlx::query(sqlx::AssertSqlSafe(rows::conflict_sql()))
            .bind(&new.idempotency_key)
            .bind(new.volume_id)
            .bind(new.caller.as_deref().unwrap_or(""))
            .fetch_optional(&self.pool)
            .await
            .map_err(StoreError::db("looking up why an intent was not recorded"))?;
        if let Some(why) = rows::not_inserted(new, found.as_ref()) {
            return Ok(Some(why));
        }
        // No operation has the key: its tombstone kept the intent out.
        let expired = self
            .operation_key_expired(new.caller.as_deref(), &new.idempotency_key)
            .await?;
        Ok(expired.map(|pruned_at| {
            Err(StoreError::KeyExpired {
                key: new.idempotency_key.clone(),
                pruned_at,
            })
        }))
    }

    /// The operations a query returns (by id or by key: at most one).
    async fn fetch_operations(
        &self,
        q: Query<'_>,
        what: &'static str,
    ) -> Result<Vec<Operation>, StoreError> {
        let rows = q
            .fetch_all(&self.pool)
            .await
            .map_err(StoreError::db(what))?;
        rows::operations(&rows)
    }
}

/// The list query for `filter`, naming only the conditions it sets: under
/// the connection's generic plans, a condition written `($1 IS NULL OR
/// server_id = $1)` can use no index, and every listing read the whole
/// table (measured: a sequential scan and a sort at 50,000 rows). An open
/// state is also looked for among the open operations (their partial
/// index); a terminal one walks `seq` backwards, as unfiltered pages do.
fn list_query(filter: &OperationFilter, after: Option<i64>, limit: u32) -> Query<'static> {
    let mut q = sqlx::query(sqlx::AssertSqlSafe(list_statement(filter, after, limit)));
    // Bound in the order `list_statement` numbers them.
    if let Some(state) = filter.state {
        q = q.bind(state.as_str());
    }
    if let Some(server) = filter.server_id {
        q = q.bind(server);
    }
    if let Some(volume) = filter.volume_id {
        q = q.bind(volume);
    }
    if let Some(after) = after {
        q = q.bind(after);
    }
    if let Some(caller) = &filter.caller {
        q = q.bind(caller.clone());
    }
    q
}

/// The statement `operation_list` runs (public for plan tests): `$1`… are
/// the state, server, volume, position and caller, those `filter` and
/// `after` set, in that order.
pub fn list_statement(filter: &OperationFilter, after: Option<i64>, limit: u32) -> String {
    // Conditions on a parameter (`?`, numbered below), then the others.
    let mut with_param: Vec<&str> = Vec::new();
    let mut plain: Vec<&str> = Vec::new();
    if let Some(state) = filter.state {
        with_param.push("state = ?");
        if !state.is_terminal() {
            plain.push(OPEN);
        }
    }
    if filter.server_id.is_some() {
        with_param.push("server_id = ?");
    }
    if filter.volume_id.is_some() {
        with_param.push("volume_id = ?");
    }
    if after.is_some() {
        with_param.push("seq < ?");
    }
    if filter.caller.is_some() {
        with_param.push("COALESCE(caller, '') = ?");
    }
    if filter.drifted_only {
        plain.push("drifted");
    }
    if filter.escalated_only {
        plain.push("escalated_at IS NOT NULL");
    }
    let conds: Vec<String> = with_param
        .iter()
        .enumerate()
        .map(|(i, c)| c.replace('?', &format!("${}", i + 1)))
        .chain(plain.iter().map(|c| c.to_string()))
        .collect();
    format!(
        "SELECT {COLUMNS}, seq FROM operations {where_} ORDER BY seq DESC LIMIT {limit}",
        where_ = if conds.is_empty() {
            String::new()
        } else {
            format!("WHERE {}", conds.join(" AND "))
        },
        // A number, not a parameter: a generic plan with LIMIT $n cannot
        // tell a page from the whole table.
        limit = u64::from(limit) + 1,
    )
}

/// The decisions due for a verification stage after its cursor (`$1`
/// decision time, `$2` id), decided at least `$3` milliseconds ago, at most
/// `$4` (public for plan tests). The position is given as parameters, not
/// joined from the cursor row: so the index scan starts at the cursor;
/// joined, it read every verified decision since the first and filtered
/// them (measured: 54 ms at 50,000 decided operations, linear, while
/// holding the cursor's lock).
pub fn verification_statement() -> String {
    format!(
        "SELECT {COLUMNS} FROM operations
         WHERE verify_expect IS NOT NULL
           AND (completed_at, id) > ($1, $2)
           AND completed_at <= now() - $3 * interval '1 millisecond'
         ORDER BY completed_at, id
         LIMIT $4"
    )
}

/// Leases the rows `target` (a query of ids) selects to replica `$1` for
/// `$2` milliseconds, each under a new epoch, where `also` holds; returns
/// the claimed rows. A claim that takes over a lease somebody held (its
/// holder stopped renewing it: dead, or cut off) is logged; a routine pass
/// over a released operation is not (its log would grow at every pass).
fn claim_sql(target: &str, also: &str) -> String {
    format!(
        "WITH target AS ({target}), claimed AS (
            UPDATE operations o SET
                lease_owner = $1,
                lease_expires_at = now() + $2 * interval '1 millisecond',
                lease_epoch = o.lease_epoch + 1,
                passes = o.passes + 1,
                updated_at = now()
            FROM target WHERE o.id = target.id {also}
            RETURNING o.*, target.prev_owner
         ), ev AS (
            INSERT INTO operation_events (operation_id, kind, detail, metadata, replica)
            SELECT claimed.id, '{claimed}',
                   'taken over from ' || claimed.prev_owner || ', whose lease expired',
                   jsonb_build_object('lease_epoch', claimed.lease_epoch::text,
                                      'previous_holder', claimed.prev_owner), $1
            FROM claimed WHERE claimed.prev_owner IS NOT NULL
         )
         SELECT {COLUMNS} FROM claimed",
        claimed = event::CLAIMED
    )
}

/// An operator's decision: ends the operation whatever its lease (the epoch
/// moves on), with its audit event, notified.
fn resolve_sql() -> String {
    format!(
        "WITH upd AS (
            UPDATE operations SET
                state = $2, resolution = 'operator', completed_at = now(), updated_at = now(),
                lease_owner = NULL, lease_expires_at = NULL, lease_epoch = lease_epoch + 1,
                next_attempt_at = NULL,
                last_error = CASE WHEN $2 = 'failed'
                    THEN jsonb_build_object('reason', 'OPERATOR_RESOLVED', 'message', $3::text,
                                            'metadata', jsonb_build_object('caller', COALESCE($5, '')))
                    ELSE last_error END
            WHERE id = $1 AND completed_at IS NULL
            -- open = completed_at IS NULL, not a state test: see TRANSITION_MANY
            RETURNING *
         ), ev AS (
            INSERT INTO operation_events (operation_id, kind, detail, metadata, replica)
            SELECT upd.id, '{kind}', $3,
                   jsonb_build_object('state', $2::text, 'caller', COALESCE($5, '')), $4
            FROM upd
         )
         SELECT {COLUMNS}, pg_notify('{NOTIFY_CHANNEL}', id::text) FROM upd",
        kind = event::OPERATOR_RESOLVED,
    )
}

fn events_json(events: &[NewEvent]) -> serde_json::Value {
    serde_json::Value::Array(
        events
            .iter()
            .map(|e| {
                serde_json::json!({
                    "kind": e.kind,
                    "detail": e.detail,
                    "metadata": e.metadata_json(),
                })
            })
            .collect(),
    )
}

#[async_trait]
impl Store for PgStore {
    async fn operation_create(
        &self,
        new: NewOperation,
        deadline: Instant,
    ) -> Result<CreateOutcome, StoreError> {
        // A volume-busy conflict can race with the busy operation
        // finishing; a few tries settle it either way.
        for _ in 0..3 {
            // The deadline bounds when the intent may still be written (a
            // write not started by then is not made), not how long one
            // that started may take: given up on while it waits (a lock, a
            // slow commit), it could still commit, an intent that nothing
            // drives. Awaited to its end, it is the caller's to drive (or
            // to decide at once when no time is left).
            let written = self
                .writer
                .submit(Payload::Create(Box::new(new.clone())), deadline)
                .await?;
            if let Some(op) = written {
                return Ok(CreateOutcome::Created(op));
            }
            // Nothing inserted: the key exists (perhaps our own row, if
            // the write was re-run after a lost connection), or the
            // volume is busy. (A cold path, boxed so the common future
            // stays small.)
            let why = within(
                deadline,
                "recording the operation",
                Box::pin(self.why_not_inserted(&new)),
            );
            if let Some(found) = Box::pin(why).await? {
                return found;
            }
        }
        Err(StoreError::database(
            "recording the operation",
            DbFailure::Contention,
            "the volume was busy and free in turns; giving up after 3 tries",
        ))
    }

    async fn operation_get(&self, id: Uuid) -> Result<Option<Operation>, StoreError> {
        let q = sqlx::query(sqlx::AssertSqlSafe(rows::by_id_sql())).bind(id);
        Ok(self
            .fetch_operations(q, "reading an operation")
            .await?
            .pop())
    }

    async fn operation_get_by_key(
        &self,
        caller: Option<&str>,
        key: &str,
    ) -> Result<Option<Operation>, StoreError> {
        let q = sqlx::query(sqlx::AssertSqlSafe(rows::by_key_sql()))
            .bind(caller.unwrap_or(""))
            .bind(key);
        Ok(self
            .fetch_operations(q, "reading an operation by key")
            .await?
            .pop())
    }

    async fn operation_list(
        &self,
        filter: &OperationFilter,
        after: Option<i64>,
        limit: u32,
    ) -> Result<OperationPage, StoreError> {
        let q = list_query(filter, after, limit);
        let rows = q
            .fetch_all(&self.pool)
            .await
            .map_err(StoreError::db("listing operations"))?;
        rows::page(&rows, limit)
    }

    async fn operation_events(&self, id: Uuid) -> Result<Vec<OperationEvent>, StoreError> {
        let rows = sqlx::query(rows::EVENTS)
            .bind(id)
            .fetch_all(&self.pool)
            .await
            .map_err(StoreError::db("reading the reconcile log"))?;
        rows::events(id, &rows)
    }

    async fn operation_transition(
        &self,
        t: Transition,
        deadline: Instant,
    ) -> Result<Option<Operation>, StoreError> {
        within(
            deadline,
            "recording a state change",
            self.writer
                .submit(Payload::Transition(Box::new(t)), deadline),
        )
        .await
    }

    async fn operation_append_events(
        &self,
        id: Uuid,
        replica: &str,
        events: Vec<NewEvent>,
    ) -> Result<(), StoreError> {
        // Through the group commit: a verification round appends to many
        // operations at once, and those share one statement and one flush.
        let append = Append {
            id,
            write_id: Uuid::now_v7(),
            replica: replica.to_string(),
            events,
        };
        self.writer
            .submit(
                Payload::Append(Box::new(append)),
                Instant::now() + APPEND_DEADLINE,
            )
            .await
            .map_err(|e| e.during("appending to the reconcile log"))?;
        Ok(())
    }

    async fn operation_claim(
        &self,
        replica: &str,
        lease: Duration,
        limit: u32,
    ) -> Result<Vec<Operation>, StoreError> {
        let target = format!(
            "SELECT id, lease_owner AS prev_owner FROM operations
             WHERE {OPEN}
               AND (lease_expires_at IS NULL OR lease_expires_at < now())
               AND (next_attempt_at IS NULL OR next_attempt_at <= now())
               AND escalated_at IS NULL
             ORDER BY next_attempt_at NULLS FIRST, seq
             LIMIT $3
             FOR UPDATE SKIP LOCKED"
        );
        let sql = claim_sql(&target, "");
        let q = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(replica)
            .bind(lease.as_millis() as f64)
            .bind(i64::from(limit));
        self.fetch_operations(q, "claiming operations").await
    }

    async fn operation_claim_one(
        &self,
        id: Uuid,
        replica: &str,
        lease: Duration,
    ) -> Result<Option<Operation>, StoreError> {
        // Open = completed_at IS NULL, not a state test: see TRANSITION_MANY.
        let sql = claim_sql(
            "SELECT id, lease_owner AS prev_owner FROM operations WHERE id = $3 FOR UPDATE",
            "AND o.completed_at IS NULL
             AND (o.lease_expires_at IS NULL OR o.lease_expires_at < now())",
        );
        let q = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(replica)
            .bind(lease.as_millis() as f64)
            .bind(id);
        Ok(self
            .fetch_operations(q, "claiming an operation")
            .await?
            .pop())
    }

    async fn operation_renew_leases(
        &self,
        replica: &str,
        ids: &[Uuid],
        lease: Duration,
    ) -> Result<u64, StoreError> {
        if ids.is_empty() {
            return Ok(0);
        }
        // Open = completed_at IS NULL, not a state test: see TRANSITION_MANY.
        // Rows another transaction holds (a decision being written, in its
        // own order) are skipped, not waited for: waiting made the two
        // deadlock under load (seen in the retention soak), and a row being
        // written now is renewed at the next beat, well inside the lease.
        let renewed = sqlx::query(
            "UPDATE operations o SET lease_expires_at = now() + $3 * interval '1 millisecond'
             FROM (SELECT id FROM operations
                   WHERE id = ANY($1) AND lease_owner = $2 AND completed_at IS NULL
                   ORDER BY id FOR UPDATE SKIP LOCKED) held
             WHERE o.id = held.id",
        )
        .bind(ids)
        .bind(replica)
        .bind(lease.as_secs_f64() * 1000.0)
        .execute(&self.pool)
        .await
        .map_err(StoreError::db("renewing leases"))?;
        Ok(renewed.rows_affected())
    }

    async fn verification_backlog(
        &self,
        stage: u8,
        delay: Duration,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        const WHAT: &str = "reading the verification backlog";
        let (decided_at, last_id): (DateTime<Utc>, Uuid) =
            sqlx::query_as("SELECT decided_at, last_id FROM verification_cursors WHERE stage = $1")
                .bind(i16::from(stage))
                .fetch_one(&self.pool)
                .await
                .map_err(StoreError::db(WHAT))?;
        // The position as parameters (see `verification_next`): the index
        // scan starts at the cursor and stops at the first entry.
        sqlx::query_scalar(
            "SELECT completed_at FROM operations
             WHERE verify_expect IS NOT NULL
               AND (completed_at, id) > ($1, $2)
               AND completed_at <= now() - $3 * interval '1 millisecond'
             ORDER BY completed_at, id
             LIMIT 1",
        )
        .bind(decided_at)
        .bind(last_id)
        .bind(delay.as_secs_f64() * 1000.0)
        .fetch_optional(&self.pool)
        .await
        .map_err(StoreError::db(WHAT))
    }

    async fn verification_next(
        &self,
        stage: u8,
        delay: Duration,
        limit: u32,
    ) -> Result<Vec<Operation>, StoreError> {
        const WHAT: &str = "taking decisions to verify";
        // The cursor row is locked for the length of this short transaction:
        // replicas take consecutive slices, never the same one.
        let mut tx = self.pool.begin().await.map_err(StoreError::db(WHAT))?;
        let (decided_at, last_id): (DateTime<Utc>, Uuid) = sqlx::query_as(
            "SELECT decided_at, last_id FROM verification_cursors WHERE stage = $1 FOR UPDATE",
        )
        .bind(i16::from(stage))
        .fetch_one(&mut *tx)
        .await
        .map_err(StoreError::db(WHAT))?;
        // The position as parameters, not joined from the cursor row: with
        // the row comparison on parameters the index scan starts at the
        // cursor; joined, it read every verified decision since the first
        // and filtered them (measured: 54 ms at 50,000 decided operations,
        // linear, while holding the cursor's lock).
        let due = verification_statement();
        let rows = sqlx::query(sqlx::AssertSqlSafe(due))
            .bind(decided_at)
            .bind(last_id)
            .bind(delay.as_secs_f64() * 1000.0)
            .bind(i64::from(limit))
            .fetch_all(&mut *tx)
            .await
            .map_err(StoreError::db(WHAT))?;
        let ops = rows::operations(&rows)?;
        if let Some(last) = ops.last() {
            sqlx::query(
                "UPDATE verification_cursors SET decided_at = $2, last_id = $3 WHERE stage = $1",
            )
            .bind(i16::from(stage))
            .bind(last.completed_at)
            .bind(last.id)
            .execute(&mut *tx)
            .await
            .map_err(StoreError::db(WHAT))?;
        }
        tx.commit().await.map_err(StoreError::db(WHAT))?;
        Ok(ops)
    }

    async fn operation_mark_drift(
        &self,
        id: Uuid,
        replica: &str,
        events: Vec<NewEvent>,
    ) -> Result<(), StoreError> {
        const WHAT: &str = "marking drift";
        let mut tx = self.pool.begin().await.map_err(StoreError::db(WHAT))?;
        let marked =
            sqlx::query("UPDATE operations SET drifted = true, updated_at = now() WHERE id = $1")
                .bind(id)
                .execute(&mut *tx)
                .await
                .map_err(StoreError::db(WHAT))?;
        // Logged only when the row is there (the update holds it until the
        // commit): no event outlives its operation. The transaction rolls
        // back with `tx` dropped.
        if marked.rows_affected() == 0 {
            return Err(StoreError::NotFound(id));
        }
        sqlx::query(
            "INSERT INTO operation_events (operation_id, kind, detail, metadata, replica)
             SELECT $1, e.kind, e.detail, e.metadata, $2
             FROM jsonb_to_recordset($3::jsonb) AS e(kind text, detail text, metadata jsonb)",
        )
        .bind(id)
        .bind(replica)
        .bind(events_json(&events))
        .execute(&mut *tx)
        .await
        .map_err(StoreError::db(WHAT))?;
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(NOTIFY_CHANNEL)
            .bind(id.to_string())
            .execute(&mut *tx)
            .await
            .map_err(StoreError::db(WHAT))?;
        tx.commit().await.map_err(StoreError::db(WHAT))
    }

    async fn operation_resolve_by_operator(
        &self,
        id: Uuid,
        state: State,
        reason: &str,
        replica: &str,
        caller: Option<&str>,
    ) -> Result<Operation, StoreError> {
        let q = sqlx::query(sqlx::AssertSqlSafe(resolve_sql()))
            .bind(id)
            .bind(state.as_str())
            .bind(reason)
            .bind(replica)
            .bind(caller);
        match self
            .fetch_operations(q, "resolving by operator")
            .await?
            .pop()
        {
            Some(op) => Ok(op),
            None => Err(rows::not_resolvable(id, self.operation_get(id).await?)),
        }
    }

    async fn operation_release_leases(&self, replica: &str) -> Result<u64, StoreError> {
        let result = sqlx::query(
            "WITH rel AS (
                UPDATE operations SET lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
                WHERE lease_owner = $1 AND state NOT IN ('succeeded', 'failed')
                RETURNING id
             )
             INSERT INTO operation_events (operation_id, kind, detail, metadata, replica)
             SELECT rel.id, 'handed_over', 'replica shut down; lease released for another reconciler', '{}'::jsonb, $1
             FROM rel",
        )
        .bind(replica)
        .execute(&self.pool)
        .await
        .map_err(StoreError::db("releasing leases"))?;
        Ok(result.rows_affected())
    }

    async fn operation_count_by_state(&self) -> Result<Vec<StateCount>, StoreError> {
        const WHAT: &str = "counting operations";
        // Sums the deltas the triggers left (see the migration
        // 20261203000001_lean_ledger) and folds them into one row per pair, so a scrape
        // reads as many rows as changes happened since the last one. Folds
        // of two replicas take turns: a fold that ran beside another would
        // miss the rows that one deleted and re-inserted. The lock is taken
        // before the fold's statement, whose snapshot then sees the other's.
        let mut tx = self.pool.begin().await.map_err(StoreError::db(WHAT))?;
        // A fold only rearranges committed deltas, atomically: lost in a
        // crash, the deltas are still there. So the scrape does not wait for
        // its WAL flush (measured: 3 to 15 ms of a loaded disk's fsync, for
        // a fold that takes 0.5 ms).
        sqlx::query("SET LOCAL synchronous_commit = off")
            .execute(&mut *tx)
            .await
            .map_err(StoreError::db(WHAT))?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(COUNTS_FOLD_LOCK)
            .execute(&mut *tx)
            .await
            .map_err(StoreError::db(WHAT))?;
        let rows = sqlx::query(
            "WITH d AS (DELETE FROM operation_counts RETURNING state, resolution, n),
                  s AS (SELECT state, resolution, sum(n)::int8 AS n FROM d
                        GROUP BY state, resolution HAVING sum(n) <> 0),
                  i AS (INSERT INTO operation_counts (state, resolution, n) SELECT * FROM s)
             SELECT state, resolution, n FROM s ORDER BY state, resolution",
        )
        .fetch_all(&mut *tx)
        .await
        .map_err(StoreError::db(WHAT))?;
        tx.commit().await.map_err(StoreError::db(WHAT))?;
        rows::counts(&rows)
    }

    async fn oldest_unknown_since(&self) -> Result<Option<DateTime<Utc>>, StoreError> {
        sqlx::query_scalar(sqlx::AssertSqlSafe(rows::OLDEST_UNKNOWN.as_str()))
            .fetch_one(&self.pool)
            .await
            .map_err(StoreError::db("reading the oldest UNKNOWN operation"))
    }

    async fn volumes_latest_operation(
        &self,
        volumes: &[Uuid],
    ) -> Result<Vec<(Uuid, DateTime<Utc>)>, StoreError> {
        // One index probe per volume (operations_volume: volume_id, seq).
        sqlx::query_as(
            "SELECT v.id, latest.created_at FROM unnest($1::uuid[]) AS v(id)
             CROSS JOIN LATERAL (SELECT created_at FROM operations
                                 WHERE volume_id = v.id ORDER BY seq DESC LIMIT 1) latest",
        )
        .bind(volumes)
        .fetch_all(&self.pool)
        .await
        .map_err(StoreError::db("reading volumes' latest operations"))
    }

    async fn now(&self) -> Result<DateTime<Utc>, StoreError> {
        sqlx::query_scalar("SELECT now()")
            .fetch_one(&self.pool)
            .await
            .map_err(StoreError::db("reading the database's clock"))
    }

    fn subscribe(&self) -> broadcast::Receiver<Uuid> {
        self.changes.subscribe()
    }

    async fn watch(&self, id: Uuid, wait: Duration) -> Result<(), StoreError> {
        if wait.is_zero() {
            // Over before it began: nothing to be woken for.
            return Ok(());
        }
        // The sweep (the CTE) never waits (SKIP LOCKED) and never touches
        // the row being registered (`<> $1`), so the two parts cannot
        // conflict whatever order they run in.
        // Unlogged: its commit waits for no WAL flush. A few expired rows
        // go each time, by the index on `until`, so the table stays as
        // small as the number of waiters. An id no operation has (a watch
        // of a mistyped or pruned id, answered NOT_FOUND by the read that
        // follows) registers nothing: nobody can decide it.
        sqlx::query(
            "WITH expired AS (
                DELETE FROM operation_watches WHERE operation_id IN (
                    SELECT operation_id FROM operation_watches
                    WHERE until < now() AND operation_id <> $1
                    ORDER BY until LIMIT 8 FOR UPDATE SKIP LOCKED)
             )
             INSERT INTO operation_watches (operation_id, until)
             SELECT $1, now() + $2 * interval '1 millisecond'
             WHERE EXISTS (SELECT 1 FROM operations WHERE id = $1)
             ON CONFLICT (operation_id) DO UPDATE
             SET until = GREATEST(operation_watches.until, EXCLUDED.until)",
        )
        .bind(id)
        .bind(wait.as_secs_f64() * 1000.0)
        .execute(&self.pool)
        .await
        .map_err(StoreError::db("registering a wait for a decision"))?;
        Ok(())
    }

    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1")
            .execute(&self.pool)
            .await
            .map_err(StoreError::db("checking the database"))?;
        Ok(())
    }

    async fn retention_begin(&self) -> Result<Option<Box<dyn PruneRound>>, StoreError> {
        retention::begin(&self.pool).await
    }

    async fn retention_oldest_decided(&self) -> Result<Option<DateTime<Utc>>, StoreError> {
        // The oldest of each index of decision time.
        sqlx::query_scalar(
            "SELECT least(
                (SELECT min(completed_at) FROM operations WHERE verify_expect IS NOT NULL AND completed_at IS NOT NULL),
                (SELECT min(completed_at) FROM operations WHERE verify_expect IS NULL AND completed_at IS NOT NULL))",
        )
        .fetch_one(&self.pool)
        .await
        .map_err(StoreError::db("reading the oldest decision"))
    }

    async fn operation_key_expired(
        &self,
        caller: Option<&str>,
        key: &str,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        sqlx::query_scalar(
            "SELECT pruned_at FROM idempotency_tombstones WHERE key_hash = volume_reconciler_key_hash($1, $2)",
        )
        .bind(caller)
        .bind(key)
        .fetch_optional(&self.pool)
        .await
        .map_err(StoreError::db("reading a key's tombstone"))
    }

    async fn close(&self) {
        self.stop.cancel();
        self.writer.close().await;
        self.pool.close().await;
    }
}
