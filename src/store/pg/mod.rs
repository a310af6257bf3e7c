//! PostgreSQL implementation of `Store`, the production one: one round trip
//! per write on the hot path (data-modifying CTEs write the row and its
//! events together), durable writes group-committed by a few writers on
//! connections of their own (`batch`, `conns`, `statements`), runtime
//! checked queries tested against a real database, LISTEN/NOTIFY as the
//! wake-up hint for watchers (`listen`).
//!
//! - `batch`: group commit by a few writer tasks.
//! - `statements`: the group commit's statements and their binding.
//! - `conns`: the store's own connections, every round trip bounded.
//! - `bounds`: how long a round trip may take, and both ends' TCP bounds.
//! - `clock`: the database's clock as the round trips bound it.
//! - [`sockets`]: keepalive and the user timeout on this process's sockets.
//! - `listen`: LISTEN/NOTIFY to the store's subscribers.
//! - `retention`: pruning, one round at a time across replicas.
//! - `wait`: waiting for PostgreSQL at start.
//!
//! Why it is long: it is one `Store` trait implementation, method by method,
//! each method a statement and its row mapping; the statements themselves,
//! the batch writer and the connections are already in files of their own.

mod batch;
mod bounds;
mod clock;
mod conns;
mod listen;
mod retention;
pub mod sockets;
mod statements;
mod wait;

pub use bounds::Bounds;
pub use statements::{pgbench_script, writer_statements};

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use sqlx::postgres::{PgArguments, PgConnectOptions, PgConnection, PgPoolOptions, Postgres};
use tokio::sync::broadcast;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use self::batch::{Payload, Writer};
use self::conns::{Conns, Observer, Repeat};
use self::statements::{Append, NOTIFY_CHANNEL};
use super::rows::{self, COLUMNS, Id, Json, OPEN, Time, column};
use super::{
    CreateOutcome, DbFailure, DbObserver, HeldLease, NewOperation, OperationFilter, OperationPage,
    PruneRound, Renewal, RoundTrip, Saturation, StateCount, Store, StoreError, Transition, within,
};
use crate::domain::{NewEvent, Operation, OperationEvent, State, event};

/// The embedded migrations of `migrations/pg` (src/store/migrations.rs).
pub static MIGRATOR: std::sync::LazyLock<sqlx::migrate::Migrator> =
    std::sync::LazyLock::new(|| super::migrations::migrator(super::migrations::PG));

column!(Postgres, Id, Uuid, |v| Ok(Id(v)));
column!(Postgres, Time, DateTime<Utc>, |v| Ok(Time(v)));
column!(Postgres, Json, serde_json::Value, |v| Ok(Json::Value(v)));

type Query<'q> = sqlx::query::Query<'q, Postgres, PgArguments>;

/// The operation a caller's key names (`$1` its hash, `$2` the caller or
/// '', `$3` the key), by `operations_key`; the caller and key compared too
/// (a hash collision names nothing).
static BY_KEY_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT {COLUMNS} FROM operations
         WHERE key_hash = $1 AND COALESCE(caller, '') = $2 AND idempotency_key = $3"
    )
});

/// What stands in the way of a new intent (`$1` its key's hash, `$2` its
/// volume): the operation with that hash (`by_key`; `rows::not_inserted`
/// compares caller and key), else the open operation of its volume (at most
/// one, by `operations_open`).
static CONFLICT_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT {COLUMNS}, (key_hash = $1) AS by_key FROM operations
         WHERE key_hash = $1 OR (volume_id = $2 AND {OPEN})
         ORDER BY by_key DESC LIMIT 1"
    )
});

/// Every index of `operations`, with a statement of the service's that
/// reads through it (its parameter types, as `PREPARE` takes them): each
/// index earns its place by a query, and a plan test
/// (`tests/store/store_conformance.rs`) holds each statement to its index and the
/// table to exactly these indexes.
pub fn index_queries() -> Vec<(&'static str, String, &'static str)> {
    vec![
        // Reads and decisions by id.
        ("operations_pkey", rows::by_id_sql(), "uuid"),
        // Pages of the whole ledger, newest first (keyset on `seq`).
        (
            "operations_seq_key",
            list_statement(&OperationFilter::default(), Some(10), 50),
            "bigint",
        ),
        // A caller's key: replays, and why an intent was not inserted.
        ("operations_key", BY_KEY_SQL.clone(), "uuid, text, text"),
        // The open operations: one per volume (the guarantee), the gauge
        // of open work, the oldest UNKNOWN one, the reconciler's claims.
        ("operations_open", OPEN_BY_STATE.clone(), ""),
        // Pages by server, and by volume (also the verifier's per-volume
        // probe of later operations).
        (
            "operations_server",
            list_statement(
                &OperationFilter {
                    server_id: Some(Uuid::nil()),
                    ..Default::default()
                },
                None,
                50,
            ),
            "uuid",
        ),
        (
            "operations_volume",
            list_statement(
                &OperationFilter {
                    volume_id: Some(Uuid::nil()),
                    ..Default::default()
                },
                None,
                50,
            ),
            "uuid",
        ),
        // Decisions by time: the verifier's cursor, retention's oldest.
        (
            "operations_decided",
            verification_statement(),
            "timestamptz, uuid, float8, bigint",
        ),
    ]
}

/// How long `ops stats`' pass over the whole ledger may take.
const STATS_TIMEOUT: Duration = Duration::from_secs(120);

/// The open operations by state, by an index-only scan of
/// `operations_open` (it holds the state).
static OPEN_BY_STATE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT state, NULL::text AS resolution, count(*)::int8 AS n FROM operations
         WHERE {OPEN} GROUP BY state ORDER BY state"
    )
});

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

/// The reads of the open operations that run on their own, again and
/// again (the reconciler's claim, at every round; the gauge of open work
/// and the oldest UNKNOWN operation, at every scrape) run under the
/// writers' reason (`WRITER_SETTINGS`) on a read connection: their plans,
/// made once per connection and generic, find the open operations through
/// their index whatever the statistics say. Until autovacuum first
/// analyzes a fresh ledger, PostgreSQL does not know that the open
/// operations are few, and plans a sequential scan (measured at 100,000
/// operations: 23 ms per claim, 24 ms for the gauge, 18 ms for the oldest
/// UNKNOWN, against 0.03–0.1 ms through `operations_open`). Three more
/// statements each (a transaction): a claim about once a second, the two
/// others once a scrape.
const INDEX_PLANS: &str = "SET LOCAL enable_seqscan = off";

/// Runs `q` in a transaction of its own under `INDEX_PLANS`.
async fn fetch_all_by_index(
    c: &mut PgConnection,
    q: Query<'static>,
) -> Result<Vec<sqlx::postgres::PgRow>, sqlx::Error> {
    // Rolled back if dropped before the commit.
    let mut tx = sqlx::Connection::begin(c).await?;
    sqlx::query(INDEX_PLANS).execute(&mut *tx).await?;
    let rows = q.fetch_all(&mut *tx).await?;
    tx.commit().await?;
    Ok(rows)
}

/// What the store connects to, with how many connections, and the bounds
/// of each round trip.
#[derive(Debug, Clone)]
pub struct PgSettings {
    pub url: String,
    pub max_connections: u32,
    pub bounds: Bounds,
}

pub struct PgStore {
    /// Reads, the reconciler's statements, operators' decisions.
    reads: Conns,
    /// Lease renewals and releases: apart from the reads, so a busy read
    /// pool never delays the heartbeat past a lease.
    leases: Conns,
    changes: broadcast::Sender<Uuid>,
    stop: CancellationToken,
    writer: Writer,
    observer: Observer,
    /// A new retention round's connection is opened from these.
    options: PgConnectOptions,
}

/// A read's future on a lent connection.
type ReadFut<'c, T> = BoxFuture<'c, Result<T, sqlx::Error>>;

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
        let base = PgConnectOptions::from_str(&settings.url)
            .map_err(|e| anyhow::anyhow!("invalid database URL: {e}"))?
            .application_name("volume-reconciler")
            // The hot statements are prepared once per connection and their
            // shape never changes: plan them once, not at every execution.
            .options([("plan_cache_mode", "force_generic_plan")]);
        wait::until_accepting(&base, wait).await?;
        let server = wait::server_of(&base);
        migrate(&base, &server).await?;
        // Every session of the service carries the server's half of the
        // round-trip bounds (migrations, which may run long, do not).
        let bounds = settings.bounds;
        let session = bounds.session_options();
        let options = base
            .clone()
            .options(session.iter().map(|(k, v)| (*k, v.as_str())));
        let writer_options = options.clone().options(WRITER_SETTINGS.iter().copied());
        // Two writers per kind of write (intents; decisions) from 16
        // connections up (the default), one below: a batch forms while the
        // other kind's (and, once it is large, the other writer's of its
        // kind) commits.
        // A writer sends a batch while another of its kind is in flight
        // only once it is large (`batch::SECOND_BATCH`): more, smaller
        // batches cost more than they overlap, since a batch's fixed cost
        // (executor start-up, commit) is most of a small one's (at c=64,
        // four writers that took whatever waited did no better than two,
        // BENCHMARKS.md stop 44; four that wait for 16 writes did 7-9 %
        // better, stop 45). They hold connections of their own (writers +
        // 1); the heartbeat and the change listener one each; the reads the
        // rest.
        let writers = 2 * (settings.max_connections / 8).clamp(1, 2);
        let reads_size = settings.max_connections.saturating_sub(writers + 3).max(3) as usize;
        let observer = Observer::default();
        let reads = Conns::new(
            "read",
            options.clone(),
            reads_size,
            Some(reads_size),
            bounds,
            observer.clone(),
        );
        let leases = Conns::new(
            "lease",
            options.clone(),
            1,
            Some(2),
            bounds,
            observer.clone(),
        );
        // The server just accepted a connection; if it went away again
        // meanwhile, say so within the bound of one more connect.
        let first = reads
            .lend(true, Instant::now() + SETUP_CONNECT_TIMEOUT)
            .await
            .map_err(|e| anyhow::anyhow!("cannot connect to PostgreSQL at {server}: {e}"))?;
        first.finish::<()>(&Ok(()));
        let (changes, _) = broadcast::channel(4096);
        let stop = CancellationToken::new();
        tokio::time::timeout(
            SETUP_CONNECT_TIMEOUT,
            listen::spawn_listener(
                options.clone(),
                bounds,
                changes.clone(),
                stop.clone(),
                observer.clone(),
            ),
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
            bounds,
            changes.clone(),
            stop.clone(),
            observer.clone(),
        )
        .await
        .map_err(|e| anyhow::anyhow!("cannot connect to PostgreSQL (ledger writer): {e}"))?;
        Ok(Self {
            reads,
            leases,
            changes,
            stop,
            writer,
            observer,
            options,
        })
    }

    /// The latest instant a read may end: a round trip, and once more on a
    /// new connection if the first one's went silent.
    fn read_until(&self) -> Instant {
        let b = self.reads.bounds();
        Instant::now() + 2 * b.round_trip + b.connect
    }

    /// A read (or a write safe to repeat) on the read pool.
    async fn read<T, F>(&self, kind: RoundTrip, what: &'static str, f: F) -> Result<T, StoreError>
    where
        F: for<'c> Fn(&'c mut PgConnection) -> ReadFut<'c, T>,
    {
        self.reads
            .run(kind, what, Repeat::Safe, self.read_until(), f)
            .await
    }

    /// A write on the read pool whose second run would act again: made
    /// once; a lost connection is reported as such.
    async fn write_once<T, F>(
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
    async fn why_not_inserted(
        &self,
        new: &NewOperation,
    ) -> Result<Option<Result<CreateOutcome, StoreError>>, StoreError> {
        let (hash, volume) = (
            Uuid::from_bytes(rows::key_hash(new.caller.as_deref(), &new.idempotency_key)),
            new.volume_id,
        );
        let found = self
            .read(
                RoundTrip::Read,
                "looking up why an intent was not recorded",
                move |c| {
                    let q = sqlx::query(sqlx::AssertSqlSafe(CONFLICT_SQL.as_str()))
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
        let expired = self
            .operation_key_expired(new.caller.as_deref(), &new.idempotency_key)
            .await?;
        if let Some(pruned_at) = expired {
            return Ok(Some(Err(StoreError::KeyExpired {
                key: new.idempotency_key.clone(),
                pruned_at,
            })));
        }
        // ... or its guard: the database's clock read past `record_by`
        // (this read corrects the bound it was drawn from, if the server's
        // clock stepped forward). Nothing was recorded, and it never will
        // be: another try with the key is a new intent.
        if let Some(by) = new.record_by {
            let now = self.now().await?;
            if now >= by {
                return Ok(Some(Err(StoreError::database(
                    "recording the operation",
                    DbFailure::Contention,
                    format!(
                        "the database's clock ({now}) was past the time the intent had to be \
                         recorded by ({by}) when it ran; nothing was recorded"
                    ),
                ))));
            }
        }
        Ok(None)
    }

    /// The operations a query returns (by id or by key: at most one).
    async fn fetch_operations<F>(
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

/// Applies pending migrations on a connection of their own, without the
/// sessions' statement bound (a migration may rewrite a table: work, not a
/// server that stopped answering); serialized across replicas by sqlx's
/// advisory lock.
async fn migrate(base: &PgConnectOptions, server: &str) -> anyhow::Result<()> {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(SETUP_CONNECT_TIMEOUT)
        .connect_lazy_with(base.clone());
    let run = MIGRATOR.run(&pool).await;
    pool.close().await;
    run.map_err(|e| anyhow::anyhow!("applying migrations to PostgreSQL at {server}: {e}"))
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
/// Lease expiries count from the moment of the claim (`clock_timestamp()`).
fn claim_sql(target: &str, also: &str) -> String {
    format!(
        "WITH target AS ({target}), claimed AS (
            UPDATE operations o SET
                lease_owner = $1,
                lease_expires_at = clock_timestamp() + $2 * interval '1 millisecond',
                lease_epoch = o.lease_epoch + 1,
                passes = o.passes + 1,
                updated_at = now()
            FROM target WHERE o.id = target.id {also}
            RETURNING o.*, target.prev_owner
         ), ev AS (
            INSERT INTO operation_log (operation_id, write_id, at, replica, events)
            SELECT claimed.id, gen_random_uuid(), clock_timestamp(), $1, jsonb_build_array(jsonb_build_object(
                   'kind', '{claimed}',
                   'detail', 'taken over from ' || claimed.prev_owner || ', whose lease expired',
                   'metadata', jsonb_build_object('lease_epoch', claimed.lease_epoch::text,
                                                  'previous_holder', claimed.prev_owner),
                   'ago_ms', 0))
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
            INSERT INTO operation_log (operation_id, write_id, at, replica, events)
            SELECT upd.id, gen_random_uuid(), clock_timestamp(), $4, jsonb_build_array(jsonb_build_object(
                   'kind', '{kind}', 'detail', $3::text,
                   'metadata', jsonb_build_object('state', $2::text, 'caller', COALESCE($5, '')),
                   'ago_ms', 0))
            FROM upd
         )
         SELECT {COLUMNS}, pg_notify('{NOTIFY_CHANNEL}', id::text) FROM upd",
        kind = event::OPERATOR_RESOLVED,
    )
}

#[async_trait]
impl Store for PgStore {
    fn operation_create(
        &self,
        new: NewOperation,
        deadline: Instant,
    ) -> futures_util::future::BoxFuture<'_, Result<CreateOutcome, StoreError>> {
        // Shared with the batch that writes it (and each try of it), not
        // cloned per try; the future below holds the pointer only.
        let new = Arc::new(new);
        Box::pin(async move {
            // A volume-busy conflict can race with the busy operation
            // finishing; a few tries settle it either way.
            for _ in 0..3 {
                // The deadline bounds the write: one not started by then is
                // not made, and one still waiting then (a lock, a slow
                // commit) has its connection dropped. It may commit even so
                // (an autocommit statement behind a lock goes on without its
                // client): its outcome is unknown (`may_have_written`), and the
                // executor reads it back and drives what it finds
                // (tests/faults/db_faults.rs, an intent held up past its answer
                // time).
                // Matched in place: a row bound to a name would keep its
                // room (512 bytes) through the cold path's await below.
                if let Some(op) = self
                    .writer
                    .submit(Payload::Create(new.clone()), deadline)
                    .await?
                {
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
        })
    }

    async fn operation_get(&self, id: Uuid) -> Result<Option<Operation>, StoreError> {
        let q = move || sqlx::query(sqlx::AssertSqlSafe(rows::by_id_sql())).bind(id);
        Ok(self
            .fetch_operations(RoundTrip::Read, "reading an operation", Repeat::Safe, q)
            .await?
            .pop())
    }

    async fn operation_get_by_key(
        &self,
        caller: Option<&str>,
        key: &str,
    ) -> Result<Option<Operation>, StoreError> {
        let (caller, key) = (caller.unwrap_or("").to_string(), key.to_string());
        let hash = Uuid::from_bytes(rows::key_hash(Some(&caller), &key));
        let q = move || {
            sqlx::query(sqlx::AssertSqlSafe(BY_KEY_SQL.as_str()))
                .bind(hash)
                .bind(caller.clone())
                .bind(key.clone())
        };
        Ok(self
            .fetch_operations(
                RoundTrip::Read,
                "reading an operation by key",
                Repeat::Safe,
                q,
            )
            .await?
            .pop())
    }

    async fn operation_list(
        &self,
        filter: &OperationFilter,
        after: Option<i64>,
        limit: u32,
    ) -> Result<OperationPage, StoreError> {
        let filter = filter.clone();
        let rows = self
            .read(RoundTrip::Read, "listing operations", move |c| {
                Box::pin(list_query(&filter, after, limit).fetch_all(c))
            })
            .await?;
        rows::page(&rows, limit)
    }

    async fn operation_events(&self, id: Uuid) -> Result<Vec<OperationEvent>, StoreError> {
        let rows = self
            .read(RoundTrip::Read, "reading the reconcile log", move |c| {
                Box::pin(sqlx::query(statements::LOG).bind(id).fetch_all(c))
            })
            .await?;
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
        held: &[Uuid],
    ) -> Result<Vec<Operation>, StoreError> {
        // `$4`: the operations a task of this replica works on now; their
        // lease lapsed only if this replica stalled, and they are not
        // taken over by it a second time (its own run would go on under
        // the old epoch beside the new one).
        let target = format!(
            "SELECT id, lease_owner AS prev_owner FROM operations
             WHERE {OPEN}
               AND (lease_expires_at IS NULL OR lease_expires_at < now())
               AND (next_attempt_at IS NULL OR next_attempt_at <= now())
               AND escalated_at IS NULL
               AND NOT (id = ANY($4))
             ORDER BY next_attempt_at NULLS FIRST, seq
             LIMIT $3
             FOR UPDATE SKIP LOCKED"
        );
        let sql = claim_sql(&target, "");
        let (replica, held) = (replica.to_string(), held.to_vec());
        let q = move || {
            sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
                .bind(replica.clone())
                .bind(lease.as_millis() as f64)
                .bind(i64::from(limit))
                .bind(held.clone())
        };
        // Safe to run again: rows a lost first run claimed are this
        // replica's until their lease expires, then claimed anew.
        let rows = self
            .read(RoundTrip::Reconcile, "claiming operations", |c| {
                Box::pin(fetch_all_by_index(c, q()))
            })
            .await?;
        rows::operations(&rows)
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
        let replica = replica.to_string();
        let q = move || {
            sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
                .bind(replica.clone())
                .bind(lease.as_millis() as f64)
                .bind(id)
        };
        // Made once: a second run after a lost first one would find the
        // lease held (by this replica) and claim nothing.
        Ok(self
            .fetch_operations(
                RoundTrip::Reconcile,
                "claiming an operation",
                Repeat::Never,
                q,
            )
            .await?
            .pop())
    }

    async fn operation_renew_leases(
        &self,
        replica: &str,
        held: &[HeldLease],
        lease: Duration,
    ) -> Result<Vec<(Uuid, Renewal)>, StoreError> {
        type Found = Vec<(Uuid, String)>;
        if held.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<Uuid> = held.iter().map(|h| h.id).collect();
        let epochs: Vec<i64> = held.iter().map(|h| h.epoch).collect();
        let replica = replica.to_string();
        let until = Instant::now() + lease;
        let found: Found = self
            .leases
            .run(
                RoundTrip::Lease,
                "renewing leases",
                Repeat::Safe,
                until,
                move |c| {
                    let q = sqlx::query_as(statements::RENEW_LEASES)
                        .bind(ids.clone())
                        .bind(epochs.clone())
                        .bind(replica.clone())
                        .bind(lease.as_secs_f64() * 1000.0);
                    Box::pin(q.fetch_all(c))
                },
            )
            .await?;
        Ok(found
            .into_iter()
            .map(|(id, found)| (id, statements::renewal(&found)))
            .collect())
    }

    async fn verification_backlog(
        &self,
        stage: u8,
        delay: Duration,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        const WHAT: &str = "reading the verification backlog";
        self.read(RoundTrip::Scrape, WHAT, move |c| {
            Box::pin(async move {
                let (decided_at, last_id): (DateTime<Utc>, Uuid) = sqlx::query_as(
                    "SELECT decided_at, last_id FROM verification_cursors WHERE stage = $1",
                )
                .bind(i16::from(stage))
                .fetch_one(&mut *c)
                .await?;
                // The position as parameters (see `verification_next`): the
                // index scan starts at the cursor and stops at the first
                // entry.
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
                .fetch_optional(&mut *c)
                .await
            })
        })
        .await
    }

    async fn verification_next(
        &self,
        stage: u8,
        delay: Duration,
        limit: u32,
    ) -> Result<Vec<Operation>, StoreError> {
        const WHAT: &str = "taking decisions to verify";
        // Made once: a first run whose answer was lost may have moved the
        // cursor past the slice it took.
        let rows = self
            .write_once(RoundTrip::Reconcile, WHAT, move |c| {
                Box::pin(verification_slice(c, stage, delay, limit))
            })
            .await?;
        rows::operations(&rows)
    }

    async fn operation_mark_drift(
        &self,
        id: Uuid,
        replica: &str,
        events: Vec<NewEvent>,
    ) -> Result<(), StoreError> {
        const WHAT: &str = "marking drift";
        let (replica, events) = (replica.to_string(), statements::events_array(&events));
        let marked = self
            .write_once(RoundTrip::Reconcile, WHAT, move |c| {
                Box::pin(mark_drift(c, id, replica.clone(), events.clone()))
            })
            .await?;
        // Logged only when the row is there (the update holds it until the
        // commit): no event outlives its operation.
        if marked {
            Ok(())
        } else {
            Err(StoreError::NotFound(id))
        }
    }

    async fn operation_resolve_by_operator(
        &self,
        id: Uuid,
        state: State,
        reason: &str,
        replica: &str,
        caller: Option<&str>,
    ) -> Result<Operation, StoreError> {
        let (reason, replica, caller) = (
            reason.to_string(),
            replica.to_string(),
            caller.map(str::to_string),
        );
        let q = move || {
            sqlx::query(sqlx::AssertSqlSafe(resolve_sql()))
                .bind(id)
                .bind(state.as_str())
                .bind(reason.clone())
                .bind(replica.clone())
                .bind(caller.clone())
        };
        // Made once: a second run after a lost first one would find the
        // operation decided (by the first) and refuse.
        match self
            .fetch_operations(
                RoundTrip::Resolve,
                "resolving by operator",
                Repeat::Never,
                q,
            )
            .await?
            .pop()
        {
            Some(op) => Ok(op),
            None => Err(rows::not_resolvable(id, self.operation_get(id).await?)),
        }
    }

    async fn operation_release_leases(
        &self,
        replica: &str,
        keep: &[Uuid],
    ) -> Result<u64, StoreError> {
        let (replica, keep) = (replica.to_string(), keep.to_vec());
        let until = Instant::now() + 2 * self.leases.bounds().round_trip;
        self.leases
            .run(
                RoundTrip::Lease,
                "releasing leases",
                Repeat::Safe,
                until,
                move |c| {
                    let q = sqlx::query(
                        "WITH rel AS (
                            UPDATE operations SET lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
                            WHERE lease_owner = $1 AND state NOT IN ('succeeded', 'failed')
                              AND NOT (id = ANY($2))
                            RETURNING id
                         )
                         INSERT INTO operation_log (operation_id, write_id, at, replica, events)
                         SELECT rel.id, gen_random_uuid(), clock_timestamp(), $1, jsonb_build_array(jsonb_build_object(
                                'kind', 'handed_over',
                                'detail', 'replica shut down; lease released for another reconciler',
                                'metadata', '{}'::jsonb, 'ago_ms', 0))
                         FROM rel",
                    )
                    .bind(replica.clone())
                    .bind(keep.clone());
                    Box::pin(async move { Ok(q.execute(c).await?.rows_affected()) })
                },
            )
            .await
    }

    async fn operation_count_by_state(&self) -> Result<Vec<StateCount>, StoreError> {
        const WHAT: &str = "counting the ledger's operations";
        // A pass over the whole table: on a connection of its own with a
        // bound of its own (`STATS_TIMEOUT`, on both ends), never the
        // sessions' round-trip bound.
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
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SET LOCAL statement_timeout = {}",
                    STATS_TIMEOUT.as_millis()
                )))
                .execute(&mut *tx)
                .await?;
                let rows = sqlx::query(
                    "SELECT state, resolution, count(*)::int8 AS n FROM operations
                     GROUP BY state, resolution ORDER BY state, resolution",
                )
                .fetch_all(&mut *tx)
                .await?;
                tx.commit().await?;
                Ok(rows)
            })
            .await?;
        rows::counts(&rows)
    }

    async fn operation_open_by_state(&self) -> Result<Vec<StateCount>, StoreError> {
        let rows = self
            .read(RoundTrip::Scrape, "counting the open operations", |c| {
                let q = sqlx::query(sqlx::AssertSqlSafe(OPEN_BY_STATE.as_str()));
                Box::pin(fetch_all_by_index(c, q))
            })
            .await?;
        rows::counts(&rows)
    }

    async fn oldest_unknown_since(&self) -> Result<Option<DateTime<Utc>>, StoreError> {
        self.read(
            RoundTrip::Scrape,
            "reading the oldest UNKNOWN operation",
            |c| {
                let q = sqlx::query(sqlx::AssertSqlSafe(rows::OLDEST_UNKNOWN.as_str()));
                Box::pin(async move {
                    let rows = fetch_all_by_index(c, q).await?;
                    // An aggregate without GROUP BY: one row, NULL when
                    // nothing is UNKNOWN.
                    match rows.first() {
                        Some(row) => sqlx::Row::try_get(row, 0),
                        None => Ok(None),
                    }
                })
            },
        )
        .await
    }

    async fn volumes_latest_operation(
        &self,
        volumes: &[Uuid],
    ) -> Result<Vec<(Uuid, DateTime<Utc>)>, StoreError> {
        let volumes = volumes.to_vec();
        // One index probe per volume (operations_volume: volume_id, seq).
        self.read(
            RoundTrip::Reconcile,
            "reading volumes' latest operations",
            move |c| {
                Box::pin(
                    sqlx::query_as(
                        "SELECT v.id, latest.created_at FROM unnest($1::uuid[]) AS v(id)
                         CROSS JOIN LATERAL (SELECT created_at FROM operations
                                             WHERE volume_id = v.id ORDER BY seq DESC LIMIT 1) latest",
                    )
                    .bind(volumes.clone())
                    .fetch_all(c),
                )
            },
        )
        .await
    }

    async fn now(&self) -> Result<DateTime<Utc>, StoreError> {
        // The reconciler reads it every round: the intents' bound of the
        // database's clock stays fresh (and is corrected if the server's
        // clock stepped forward) even while no intent is written.
        let sent = Instant::now();
        let now = self
            .read(RoundTrip::Read, "reading the database's clock", |c| {
                Box::pin(sqlx::query_scalar("SELECT now()").fetch_one(c))
            })
            .await?;
        self.writer.clock.observe(sent, Instant::now(), now);
        Ok(now)
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
        self.read(
            RoundTrip::Watch,
            "registering a wait for a decision",
            move |c| {
                let q = sqlx::query(
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
                .bind(wait.as_secs_f64() * 1000.0);
                Box::pin(async move { q.execute(c).await.map(drop) })
            },
        )
        .await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.read(RoundTrip::Ping, "checking the database", |c| {
            Box::pin(async move { sqlx::query("SELECT 1").execute(c).await.map(drop) })
        })
        .await
    }

    async fn retention_begin(&self) -> Result<Option<Box<dyn PruneRound>>, StoreError> {
        retention::begin(&self.options, self.reads.bounds(), self.observer.clone()).await
    }

    async fn retention_oldest_decided(&self) -> Result<Option<DateTime<Utc>>, StoreError> {
        // The first entry of `operations_decided`.
        self.read(RoundTrip::Scrape, "reading the oldest decision", |c| {
            Box::pin(
                sqlx::query_scalar(
                    "SELECT min(completed_at) FROM operations WHERE completed_at IS NOT NULL",
                )
                .fetch_one(c),
            )
        })
        .await
    }

    async fn operation_key_expired(
        &self,
        caller: Option<&str>,
        key: &str,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        let (caller, key) = (caller.map(str::to_string), key.to_string());
        self.read(RoundTrip::Read, "reading a key's tombstone", move |c| {
            Box::pin(
                sqlx::query_scalar(
                    "SELECT pruned_at FROM idempotency_tombstones WHERE key_hash = volume_reconciler_key_hash($1, $2)",
                )
                .bind(caller.clone())
                .bind(key.clone())
                .fetch_optional(c),
            )
        })
        .await
    }

    async fn close(&self) {
        self.stop.cancel();
        self.writer.close().await;
        self.leases.close().await;
        self.reads.close().await;
    }

    fn observe(&self, observer: std::sync::Arc<dyn DbObserver>) {
        self.observer.set(observer);
    }

    fn round_trip_bound(&self) -> Duration {
        self.reads.bounds().round_trip
    }

    fn intent_record_by(&self, deadline: Instant) -> Option<DateTime<Utc>> {
        // A second of margin, for clocks that drift apart faster than the
        // bound allows (a clock being slewed hard).
        self.writer
            .clock
            .latest_at(deadline)
            .map(|t| t + chrono::Duration::seconds(1))
    }

    /// Settled once the database's clock is past `record_by` by the
    /// statement bound (no statement of the intent can pass its guard any
    /// more, and every one that did has finished executing, or been
    /// cancelled by `statement_timeout`) and no transaction that began
    /// before `record_by` and wrote anything is still running (one that
    /// inserted it may still be committing: a slow flush, a synchronous
    /// standby away). Read-only transactions (a backup's) do not hold it.
    async fn intent_settled(&self, record_by: DateTime<Utc>) -> Result<bool, StoreError> {
        let bound_ms = self.round_trip_bound().as_secs_f64() * 1000.0;
        self.read(
            RoundTrip::Read,
            "asking whether an intent can still be recorded",
            move |c| {
                Box::pin(
                    sqlx::query_scalar(
                        "SELECT now() >= $1 + $2 * interval '1 millisecond'
                            AND NOT EXISTS (SELECT 1 FROM pg_stat_activity
                                WHERE datname = current_database()
                                  AND backend_xid IS NOT NULL AND xact_start < $1)",
                    )
                    .bind(record_by)
                    .bind(bound_ms)
                    .fetch_one(c),
                )
            },
        )
        .await
    }

    fn saturation(&self) -> Saturation {
        let (pool_in_use, pool_size) = self.reads.in_use().unwrap_or((0, 0));
        Saturation {
            pool_in_use,
            pool_size,
            writes_pending: self.writer.pending(),
        }
    }
}

/// A verification stage's next slice after its cursor, the cursor moved
/// past it, in one short transaction: the cursor row is locked for its
/// length, so replicas take consecutive slices, never the same one.
async fn verification_slice(
    c: &mut PgConnection,
    stage: u8,
    delay: Duration,
    limit: u32,
) -> Result<Vec<sqlx::postgres::PgRow>, sqlx::Error> {
    use sqlx::Connection as _;
    let mut tx = c.begin().await?;
    let (decided_at, last_id): (DateTime<Utc>, Uuid) = sqlx::query_as(
        "SELECT decided_at, last_id FROM verification_cursors WHERE stage = $1 FOR UPDATE",
    )
    .bind(i16::from(stage))
    .fetch_one(&mut *tx)
    .await?;
    // The position as parameters, not joined from the cursor row: with the
    // row comparison on parameters the index scan starts at the cursor;
    // joined, it read every verified decision since the first and filtered
    // them (measured: 54 ms at 50,000 decided operations, linear, while
    // holding the cursor's lock).
    let rows = sqlx::query(sqlx::AssertSqlSafe(verification_statement()))
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
        sqlx::query(
            "UPDATE verification_cursors SET decided_at = $2, last_id = $3 WHERE stage = $1",
        )
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
async fn mark_drift(
    c: &mut PgConnection,
    id: Uuid,
    replica: String,
    events: statements::Jsonb,
) -> Result<bool, sqlx::Error> {
    use sqlx::Connection as _;
    let mut tx = c.begin().await?;
    let marked =
        sqlx::query("UPDATE operations SET drifted = true, updated_at = now() WHERE id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await?;
    if marked.rows_affected() == 0 {
        return Ok(false);
    }
    sqlx::query(
        "INSERT INTO operation_log (operation_id, write_id, at, replica, events)
         VALUES ($1, gen_random_uuid(), clock_timestamp(), $2, $3::jsonb)",
    )
    .bind(id)
    .bind(replica)
    .bind(events)
    .execute(&mut *tx)
    .await?;
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(NOTIFY_CHANNEL)
        .bind(id.to_string())
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(true)
}

/// The migrations applied to the database `url` names, by version, with
/// their descriptions (none: a database not migrated yet); waits up to
/// `wait` for PostgreSQL to accept connections. For `migrate` and
/// `migrate status`: it changes nothing.
pub async fn applied_migrations(url: &str, wait: Duration) -> anyhow::Result<Vec<(i64, String)>> {
    use sqlx::Connection as _;
    let options = PgConnectOptions::from_str(url)
        .map_err(|e| anyhow::anyhow!("invalid database URL: {e}"))?
        .application_name("volume-reconciler migrate");
    wait::until_accepting(&options, wait).await?;
    let server = wait::server_of(&options);
    let what = |e| anyhow::anyhow!("reading the migrations of PostgreSQL at {server}: {e}");
    let mut conn = sqlx::PgConnection::connect_with(&options)
        .await
        .map_err(what)?;
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .fetch_one(&mut conn)
        .await
        .map_err(what)?;
    let applied = if exists {
        sqlx::query_as(
            "SELECT version, description FROM _sqlx_migrations WHERE success ORDER BY version",
        )
        .fetch_all(&mut conn)
        .await
        .map_err(what)?
    } else {
        Vec::new()
    };
    // The answer is read; a failed goodbye changes nothing of it.
    drop(conn.close().await);
    Ok(applied)
}
