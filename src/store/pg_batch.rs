//! Group commit at the application level for PostgreSQL: the durable writes
//! of concurrent operations (intent rows and decisions) are queued to a few
//! writer tasks, each of which runs whatever is waiting as one transaction
//! — one WAL flush and one NOTIFY (carrying every changed id) per batch
//! instead of one per operation.
//!
//! The rule "an operation's intent is durable before its request leaves"
//! holds: a caller gets its row only after the batch that wrote it has
//! committed. A statement error aborts its batch; the batch is then re-run
//! one job per transaction, so one bad job never fails the others.
//!
//! The writers use connections of their own, not the pool's: sqlx's pool
//! pings every connection it takes back (one more round trip per write, and
//! a task to run it). A writer's connection is pinged only after it sat idle
//! long enough to have gone stale, and one whose write was cut short (the
//! caller's deadline fired mid-statement) is dropped, never reused.

use std::sync::Arc;

use sqlx::Connection as _;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgRow};
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::postgres::{COLUMNS, NOTIFY_CHANNEL, row_to_operation, to_json};
use super::{NewOperation, StoreError, Transition};
use crate::domain::{NewEvent, Operation};

pub(super) enum Payload {
    Create(Box<NewOperation>),
    Transition(Box<Transition>),
    /// Events appended to an operation's log, changing nothing else
    /// (verifications): batched like the rest, not notified.
    Append(Box<Append>),
}

pub(super) struct Append {
    pub id: Uuid,
    pub replica: String,
    pub events: Vec<NewEvent>,
}

/// A writer connection idle this long is pinged before it is used again.
const PING_IF_IDLE_FOR: std::time::Duration = std::time::Duration::from_secs(1);

/// Opening a writer connection, at most: connection setup stays short.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The writers' connections.
struct Conns {
    options: PgConnectOptions,
    idle: std::sync::Mutex<Vec<(PgConnection, Instant)>>,
    /// Idle connections kept, at most (one per writer, one inline).
    keep: usize,
}

impl Conns {
    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<(PgConnection, Instant)>> {
        // A panic while holding this lock leaves a plain Vec behind: usable.
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An idle connection (`true`: reused) or a new one.
    async fn take(&self) -> Result<(PgConnection, bool), sqlx::Error> {
        loop {
            let popped = self.idle().pop();
            let Some((mut conn, since)) = popped else {
                return self.open().await.map(|c| (c, false));
            };
            if since.elapsed() < PING_IF_IDLE_FOR {
                return Ok((conn, true));
            }
            match conn.ping().await {
                Ok(()) => return Ok((conn, true)),
                // Gone stale (database restarted, proxy timed it out):
                // dropped; the next one is tried, or a fresh one opened.
                Err(e) => tracing::info!(error = %e, "dropping a stale ledger connection"),
            }
        }
    }

    async fn open(&self) -> Result<PgConnection, sqlx::Error> {
        match tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(&self.options)).await
        {
            Ok(r) => r,
            Err(_) => Err(sqlx::Error::PoolTimedOut),
        }
    }

    /// Takes a connection back after a write that ran to its end. One whose
    /// connection failed (I/O, protocol) is dropped instead.
    fn put<T>(&self, conn: PgConnection, outcome: &Result<T, sqlx::Error>) {
        let healthy = match outcome {
            Ok(_) => true,
            Err(e) => !is_connection_error(e),
        };
        let mut idle = self.idle();
        if healthy && idle.len() < self.keep {
            idle.push((conn, Instant::now()));
        }
    }

    async fn close(&self) {
        let conns: Vec<_> = self.idle().drain(..).collect();
        for (conn, _) in conns {
            if let Err(e) = conn.close().await {
                tracing::debug!(error = %e, "closing a ledger connection");
            }
        }
    }
}

type Reply = oneshot::Sender<Result<Option<Operation>, StoreError>>;

pub(super) struct Job {
    pub payload: Payload,
    pub deadline: Instant,
    pub reply: Reply,
}

#[derive(Clone)]
pub(super) struct Writer {
    tx: mpsc::Sender<Job>,
    conns: Arc<Conns>,
    /// Writes submitted and not yet answered, on any path.
    pending: Arc<std::sync::atomic::AtomicUsize>,
}

/// Largest batch: bounds a transaction's length and the NOTIFY payload.
const MAX_BATCH: usize = 128;

/// Writes waiting for a writer, at most.
const QUEUE: usize = 32_768;

impl Writer {
    pub async fn start(
        options: PgConnectOptions,
        writers: usize,
        stop: CancellationToken,
    ) -> Result<Self, sqlx::Error> {
        let writers = writers.max(1);
        let conns = Arc::new(Conns {
            options,
            idle: std::sync::Mutex::new(Vec::new()),
            keep: writers + 1,
        });
        // One connection now: the first write should not pay for it.
        let first = conns.open().await?;
        conns.put::<()>(first, &Ok(()));
        // Bounded, and larger than the cap on mutations in flight: a full
        // queue means the database has fallen far behind, and the caller
        // is told so at once instead of waiting out its deadline.
        let (tx, rx) = mpsc::channel(QUEUE);
        let rx = Arc::new(Mutex::new(rx));
        for _ in 0..writers {
            tokio::spawn(writer_loop(conns.clone(), rx.clone(), stop.clone()));
        }
        Ok(Self {
            tx,
            conns,
            pending: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
        })
    }

    /// Closes the idle writer connections (at shutdown, after the drain).
    pub async fn close(&self) {
        self.conns.close().await;
    }

    /// Writes and returns the committed result: inline when no other write
    /// is in flight (nothing to group with; saves two task hops), else
    /// through the bounded queue, grouped with whatever else is waiting.
    pub async fn submit(
        &self,
        payload: Payload,
        deadline: Instant,
    ) -> Result<Option<Operation>, StoreError> {
        use std::sync::atomic::Ordering;
        struct Pending<'a>(&'a std::sync::atomic::AtomicUsize);
        impl Drop for Pending<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        let alone = self.pending.fetch_add(1, Ordering::SeqCst) == 0;
        let _pending = Pending(&self.pending);
        if alone {
            let one = [payload];
            // Boxed: the batch state machine is large, and every write waiting
            // in the queue would otherwise carry room for it.
            return match Box::pin(try_batch(&self.conns, &one)).await {
                Ok(mut v) => v.pop().unwrap_or(Ok(None)),
                Err(e) => Err(StoreError::Database {
                    what: "writing to the ledger",
                    source: e,
                }),
            };
        }
        let (reply, rx) = oneshot::channel();
        self.tx
            .try_send(Job {
                payload,
                deadline,
                reply,
            })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => StoreError::Overloaded { queued: QUEUE },
                mpsc::error::TrySendError::Closed(_) => StoreError::Database {
                    what: "queueing a write",
                    source: sqlx::Error::PoolClosed,
                },
            })?;
        rx.await.map_err(|_| StoreError::Database {
            what: "awaiting a write",
            source: sqlx::Error::PoolClosed,
        })?
    }
}

async fn writer_loop(
    conns: Arc<Conns>,
    rx: Arc<Mutex<mpsc::Receiver<Job>>>,
    stop: CancellationToken,
) {
    loop {
        let jobs = {
            let mut rx = rx.lock().await;
            let first = tokio::select! {
                _ = stop.cancelled() => return,
                j = rx.recv() => match j { Some(j) => j, None => return },
            };
            let mut jobs = vec![first];
            while jobs.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(j) => jobs.push(j),
                    Err(_) => break,
                }
            }
            jobs
        };
        run_batch(&conns, jobs).await;
    }
}

async fn run_batch(conns: &Conns, jobs: Vec<Job>) {
    // A write whose caller's deadline already passed is not made: the
    // caller is told so, and nothing is recorded behind its back.
    let now = Instant::now();
    let (live, expired): (Vec<Job>, Vec<Job>) = jobs.into_iter().partition(|j| j.deadline > now);
    for j in expired {
        // The caller may have stopped waiting; that is fine.
        drop(j.reply.send(Err(StoreError::DeadlineExceeded {
            what: "waiting for the group commit",
        })));
    }
    if live.is_empty() {
        return;
    }
    let (payloads, replies): (Vec<Payload>, Vec<Reply>) =
        live.into_iter().map(|j| (j.payload, j.reply)).unzip();
    match try_batch(conns, &payloads).await {
        Ok(results) => {
            for (reply, r) in replies.into_iter().zip(results) {
                drop(reply.send(r));
            }
        }
        Err(e) if payloads.len() == 1 => {
            if let Some(reply) = replies.into_iter().next() {
                drop(reply.send(Err(StoreError::Database {
                    what: "writing to the ledger",
                    source: e,
                })));
            }
        }
        Err(e) => {
            tracing::debug!(error = %e, jobs = payloads.len(), "batch failed; writing its jobs one by one");
            for (payload, reply) in payloads.into_iter().zip(replies) {
                let one = [payload];
                let r = match try_batch(conns, &one).await {
                    Ok(mut v) => v.pop().unwrap_or(Ok(None)),
                    Err(e) => Err(StoreError::Database {
                        what: "writing to the ledger",
                        source: e,
                    }),
                };
                drop(reply.send(r));
            }
        }
    }
}

/// Intent rows of a batch, inserted by one statement; a row that hits a
/// unique constraint (key replayed, volume busy) is skipped and reported as
/// `None` (its caller looks up why). Events keep their order. Not notified:
/// nobody can be waiting on an operation whose id has not been handed out
/// yet (watchers and replays look for decisions, which are).
const CREATE_MANY: &str = "WITH ins AS (
        INSERT INTO operations (id, idempotency_key, fingerprint, action, state, server_id, volume_id,
            request, attempts, deadline_at, last_request_at, lease_owner, lease_expires_at, caller)
        SELECT u.id, u.key, u.fp, u.action, u.state, u.server_id, u.volume_id, u.request, u.attempts,
            u.deadline_at, CASE WHEN u.attempts > 0 THEN now() END, u.lease_owner, u.lease_expires_at, u.caller
        FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::uuid[], $7::uuid[],
                    $8::jsonb[], $9::int4[], $10::timestamptz[], $11::text[], $12::timestamptz[], $13::text[])
             AS u(id, key, fp, action, state, server_id, volume_id, request, attempts, deadline_at,
                  lease_owner, lease_expires_at, caller)
        ON CONFLICT DO NOTHING
        RETURNING *
     ), ev AS (
        INSERT INTO operation_events (operation_id, kind, detail, metadata, replica)
        SELECT e.operation_id, e.kind, e.detail, e.metadata, e.replica
        FROM unnest($14::uuid[], $15::text[], $16::text[], $17::jsonb[], $18::text[])
             WITH ORDINALITY AS e(operation_id, kind, detail, metadata, replica, ord)
        JOIN ins ON ins.id = e.operation_id
        ORDER BY e.ord
     )
     SELECT __COLUMNS__ FROM ins";

/// Events appended to existing operations, by one statement.
const APPEND_MANY: &str =
    "INSERT INTO operation_events (operation_id, kind, detail, metadata, replica)
     SELECT e.operation_id, e.kind, e.detail, e.metadata, e.replica
     FROM unnest($1::uuid[], $2::text[], $3::text[], $4::jsonb[], $5::text[])
          WITH ORDINALITY AS e(operation_id, kind, detail, metadata, replica, ord)
     ORDER BY e.ord";

/// Decisions of a batch, by one statement, each fenced by its epoch.
///
/// "Not decided yet" is written `completed_at IS NULL` (the same thing, by
/// the `terminal_has_completion` constraint), not as a test on `state`: the
/// state test matches the predicate of the partial index of open
/// operations, and a generic plan made while that set was small then scans
/// all of it for every row of the batch (measured: 454 ms for 128 decisions
/// with 10,000 operations open, as after a Nova outage, exactly when the
/// reconciler must be fast). Rows are found by primary key.
const TRANSITION_MANY: &str = "WITH u AS (
        SELECT * FROM unnest($1::uuid[], $2::int8[], $3::text[], $4::text[], $5::jsonb[], $6::int4[],
                             $7::bool[], $8::jsonb[], $9::bool[], $10::bool[], $11::timestamptz[], $12::timestamptz[])
             AS u(id, epoch, state, resolution, attachment, add_attempt, set_error, last_error,
                  request_sent, release, next_attempt_at, verify_at)
     ), upd AS (
        UPDATE operations o SET
            state = u.state,
            resolution = u.resolution,
            attachment = COALESCE(u.attachment, o.attachment),
            attempts = o.attempts + u.add_attempt,
            last_error = CASE WHEN u.set_error THEN u.last_error ELSE o.last_error END,
            last_request_at = CASE WHEN u.request_sent THEN now() ELSE o.last_request_at END,
            completed_at = CASE WHEN u.state IN ('succeeded', 'failed') THEN now() END,
            lease_owner = CASE WHEN u.release THEN NULL ELSE o.lease_owner END,
            lease_expires_at = CASE WHEN u.release THEN NULL ELSE o.lease_expires_at END,
            next_attempt_at = u.next_attempt_at,
            verify_at = u.verify_at,
            updated_at = now()
        FROM u
        WHERE o.id = u.id AND o.lease_epoch = u.epoch AND o.completed_at IS NULL
        RETURNING o.*
     ), ev AS (
        INSERT INTO operation_events (operation_id, kind, detail, metadata, replica)
        SELECT e.operation_id, e.kind, e.detail, e.metadata, e.replica
        FROM unnest($13::uuid[], $14::text[], $15::text[], $16::jsonb[], $17::text[])
             WITH ORDINALITY AS e(operation_id, kind, detail, metadata, replica, ord)
        JOIN upd ON upd.id = e.operation_id
        ORDER BY e.ord
     ), n AS (
        SELECT pg_notify('__CHANNEL__', string_agg(id::text, ',')) FROM upd HAVING count(*) > 0
     )
     SELECT __COLUMNS__ FROM upd LEFT JOIN n ON true";

#[derive(Default)]
struct EventCols {
    op: Vec<Uuid>,
    kind: Vec<String>,
    detail: Vec<String>,
    metadata: Vec<serde_json::Value>,
    replica: Vec<String>,
}

impl EventCols {
    fn push(&mut self, id: Uuid, replica: &str, events: &[NewEvent]) {
        for e in events {
            self.op.push(id);
            self.kind.push(e.kind.to_string());
            self.detail.push(e.detail.clone());
            self.metadata.push(e.metadata_json());
            self.replica.push(replica.to_string());
        }
    }
}

async fn create_many(
    conn: &mut PgConnection,
    news: &[&NewOperation],
) -> Result<Vec<PgRow>, sqlx::Error> {
    let mut ev = EventCols::default();
    for n in news {
        ev.push(n.id, &n.replica, &n.events);
    }
    sqlx::query(sqlx::AssertSqlSafe(
        CREATE_MANY.replace("__COLUMNS__", COLUMNS),
    ))
    .bind(news.iter().map(|n| n.id).collect::<Vec<_>>())
    .bind(
        news.iter()
            .map(|n| n.idempotency_key.clone())
            .collect::<Vec<_>>(),
    )
    .bind(
        news.iter()
            .map(|n| n.fingerprint.clone())
            .collect::<Vec<_>>(),
    )
    .bind(
        news.iter()
            .map(|n| n.action.as_str().to_string())
            .collect::<Vec<_>>(),
    )
    .bind(
        news.iter()
            .map(|n| n.state.as_str().to_string())
            .collect::<Vec<_>>(),
    )
    .bind(news.iter().map(|n| n.server_id).collect::<Vec<_>>())
    .bind(news.iter().map(|n| n.volume_id).collect::<Vec<_>>())
    .bind(news.iter().map(|n| to_json(&n.params)).collect::<Vec<_>>())
    .bind(news.iter().map(|n| n.attempts).collect::<Vec<_>>())
    .bind(news.iter().map(|n| n.deadline_at).collect::<Vec<_>>())
    .bind(
        news.iter()
            .map(|n| n.lease_owner.clone())
            .collect::<Vec<_>>(),
    )
    .bind(news.iter().map(|n| n.lease_expires_at).collect::<Vec<_>>())
    .bind(news.iter().map(|n| n.caller.clone()).collect::<Vec<_>>())
    .bind(ev.op)
    .bind(ev.kind)
    .bind(ev.detail)
    .bind(ev.metadata)
    .bind(ev.replica)
    .fetch_all(&mut *conn)
    .await
}

async fn append_many(conn: &mut PgConnection, appends: &[&Append]) -> Result<(), sqlx::Error> {
    let mut ev = EventCols::default();
    for a in appends {
        ev.push(a.id, &a.replica, &a.events);
    }
    sqlx::query(APPEND_MANY)
        .bind(ev.op)
        .bind(ev.kind)
        .bind(ev.detail)
        .bind(ev.metadata)
        .bind(ev.replica)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

async fn transition_many(
    conn: &mut PgConnection,
    ts: &[&Transition],
) -> Result<Vec<PgRow>, sqlx::Error> {
    let mut ev = EventCols::default();
    for t in ts {
        ev.push(t.id, &t.replica, &t.events);
    }
    sqlx::query(sqlx::AssertSqlSafe(
        TRANSITION_MANY
            .replace("__COLUMNS__", COLUMNS)
            .replace("__CHANNEL__", NOTIFY_CHANNEL),
    ))
    .bind(ts.iter().map(|t| t.id).collect::<Vec<_>>())
    .bind(ts.iter().map(|t| t.lease_epoch).collect::<Vec<_>>())
    .bind(
        ts.iter()
            .map(|t| t.state.as_str().to_string())
            .collect::<Vec<_>>(),
    )
    .bind(
        ts.iter()
            .map(|t| t.resolution.map(|r| r.as_str().to_string()))
            .collect::<Vec<_>>(),
    )
    .bind(
        ts.iter()
            .map(|t| t.attachment.as_ref().map(to_json))
            .collect::<Vec<_>>(),
    )
    .bind(
        ts.iter()
            .map(|t| i32::from(t.add_attempt))
            .collect::<Vec<_>>(),
    )
    .bind(
        ts.iter()
            .map(|t| t.last_error.is_some())
            .collect::<Vec<_>>(),
    )
    .bind(
        ts.iter()
            .map(|t| t.last_error.as_ref().and_then(|e| e.as_ref().map(to_json)))
            .collect::<Vec<_>>(),
    )
    .bind(ts.iter().map(|t| t.request_sent).collect::<Vec<_>>())
    .bind(ts.iter().map(|t| t.release_lease).collect::<Vec<_>>())
    .bind(ts.iter().map(|t| t.next_attempt_at).collect::<Vec<_>>())
    .bind(ts.iter().map(|t| t.verify_at).collect::<Vec<_>>())
    .bind(ev.op)
    .bind(ev.kind)
    .bind(ev.detail)
    .bind(ev.metadata)
    .bind(ev.replica)
    .fetch_all(&mut *conn)
    .await
}

/// Runs the payloads atomically on a writer connection: one autocommit
/// statement when they are all of one kind (the common case: one round
/// trip), else one transaction. `Err` when it failed as a whole (then
/// nothing of it was written). Decisions carry their own NOTIFY (one per
/// statement, not per row).
async fn try_batch(
    conns: &Conns,
    payloads: &[Payload],
) -> Result<Vec<Result<Option<Operation>, StoreError>>, sqlx::Error> {
    // Owned by this future: if it is dropped mid-statement, so is the
    // connection, whose state is then unknown.
    let (mut conn, reused) = conns.take().await?;
    let result = batch_on(&mut conn, payloads).await;
    conns.put(conn, &result);
    match result {
        // A reused connection found dead (the database restarted, a proxy
        // dropped it): the batch runs once more on a new one. Safe because
        // intents and decisions are idempotent when re-run: an intent that
        // did commit conflicts on its own id and is found by its caller
        // (`operation_create`), a decision that did commit is fenced out
        // and re-read. Appends are not re-run (they would duplicate).
        Err(e)
            if reused
                && is_connection_error(&e)
                && !payloads.iter().any(|p| matches!(p, Payload::Append(_))) =>
        {
            tracing::info!(error = %e, "ledger connection lost; writing the batch on a new one");
            let mut conn = conns.open().await?;
            let result = batch_on(&mut conn, payloads).await;
            conns.put(conn, &result);
            result
        }
        other => other,
    }
}

/// The connection is gone or unusable (as opposed to a statement refused):
/// I/O and protocol failures, and the server's own notice that it ended the
/// session (SQLSTATE class 08, connection exception; 57P01–57P03, shutdown).
fn is_connection_error(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|c| c.starts_with("08") || c.starts_with("57P")),
        _ => false,
    }
}

async fn batch_on(
    conn: &mut PgConnection,
    payloads: &[Payload],
) -> Result<Vec<Result<Option<Operation>, StoreError>>, sqlx::Error> {
    let (mut creates, mut transitions, mut appends) = (false, false, false);
    let mut ids = std::collections::HashSet::new();
    let mut single_round = true;
    for p in payloads {
        match p {
            Payload::Create(_) => creates = true,
            Payload::Append(_) => appends = true,
            Payload::Transition(t) => {
                transitions = true;
                single_round &= ids.insert(t.id);
            }
        }
    }
    let kinds = usize::from(creates) + usize::from(transitions) + usize::from(appends);
    if single_round && kinds == 1 {
        run_statements(conn, payloads).await
    } else {
        let mut tx = conn.begin().await?;
        let results = run_statements(&mut tx, payloads).await?;
        tx.commit().await?;
        Ok(results)
    }
}

async fn run_statements(
    conn: &mut PgConnection,
    payloads: &[Payload],
) -> Result<Vec<Result<Option<Operation>, StoreError>>, sqlx::Error> {
    let mut by_id: std::collections::HashMap<Uuid, Result<Operation, StoreError>> =
        std::collections::HashMap::new();
    let creates: Vec<&NewOperation> = payloads
        .iter()
        .filter_map(|p| match p {
            Payload::Create(n) => Some(n.as_ref()),
            Payload::Transition(_) | Payload::Append(_) => None,
        })
        .collect();
    if !creates.is_empty() {
        for row in create_many(conn, &creates).await? {
            let op = row_to_operation(&row);
            if let Ok(o) = &op {
                by_id.insert(o.id, op);
            }
        }
    }
    // One statement per round; an operation appearing twice (never in
    // practice: one flow per operation at a time) waits for the next round.
    let mut pending: Vec<(usize, &Transition)> = payloads
        .iter()
        .filter_map(|p| match p {
            Payload::Transition(t) => Some(t.as_ref()),
            Payload::Create(_) | Payload::Append(_) => None,
        })
        .enumerate()
        .collect();
    let appends: Vec<&Append> = payloads
        .iter()
        .filter_map(|p| match p {
            Payload::Append(a) => Some(a.as_ref()),
            Payload::Create(_) | Payload::Transition(_) => None,
        })
        .collect();
    if !appends.is_empty() {
        append_many(conn, &appends).await?;
    }
    let mut transition_results: Vec<(usize, Result<Option<Operation>, StoreError>)> = Vec::new();
    while !pending.is_empty() {
        let mut seen = std::collections::HashSet::new();
        type Indexed<'a> = Vec<(usize, &'a Transition)>;
        let (round, rest): (Indexed, Indexed) =
            pending.into_iter().partition(|(_, t)| seen.insert(t.id));
        let ts: Vec<&Transition> = round.iter().map(|(_, t)| *t).collect();
        let rows = transition_many(conn, &ts).await?;
        let mut updated: std::collections::HashMap<Uuid, Result<Operation, StoreError>> =
            std::collections::HashMap::new();
        for row in rows {
            let op = row_to_operation(&row);
            if let Ok(o) = &op {
                updated.insert(o.id, op);
            }
        }
        for (i, t) in round {
            transition_results.push((i, updated.remove(&t.id).transpose()));
        }
        pending = rest;
    }
    transition_results.sort_by_key(|(i, _)| *i);
    let mut transition_results = transition_results.into_iter().map(|(_, r)| r);
    Ok(payloads
        .iter()
        .map(|p| match p {
            Payload::Create(n) => by_id.remove(&n.id).transpose(),
            Payload::Transition(_) => transition_results.next().unwrap_or(Ok(None)),
            Payload::Append(_) => Ok(None),
        })
        .collect())
}

/// The decision statement as the writers prepare it (`$1`… parameters,
/// array types in `decision_parameter_types`), for plan tests.
pub fn decision_statement() -> String {
    TRANSITION_MANY
        .replace("__COLUMNS__", COLUMNS)
        .replace("__CHANNEL__", NOTIFY_CHANNEL)
}

/// The parameter types of `decision_statement`, in order.
pub const DECISION_PARAMETER_TYPES: &str = "uuid[], int8[], text[], text[], jsonb[], int4[], bool[], jsonb[], bool[], bool[], timestamptz[], timestamptz[], uuid[], text[], text[], jsonb[], text[]";

/// The service's per-operation write pattern as a pgbench script: the very
/// statements above (intent, then decision, each its own durable
/// autocommit statement), with one operation's values in place of the
/// parameters. `scripts/bench` runs it as the database's ceiling.
pub fn pgbench_script() -> String {
    fn substitute(sql: &str, values: &[&str]) -> String {
        // Highest first, so $1 does not eat the start of $12.
        let mut out = sql
            .replace("__COLUMNS__", COLUMNS)
            .replace("__CHANNEL__", NOTIFY_CHANNEL);
        for (i, v) in values.iter().enumerate().rev() {
            out = out.replace(&format!("${}", i + 1), v);
        }
        // The operation's id, the same in both statements, made from two
        // pgbench random numbers (pgbench variables are numbers only).
        out = out.replace(
            "__OPID__",
            "(lpad(to_hex(:hi::int8), 16, '0') || lpad(to_hex(:lo::int8), 16, '0'))::uuid",
        );
        out.split_whitespace().collect::<Vec<_>>().join(" ")
    }
    let create = substitute(
        CREATE_MANY,
        &[
            "ARRAY[__OPID__]",
            "ARRAY['pgbench-' || :n || '-' || random()]",
            "ARRAY['fingerprint']",
            "ARRAY['attach']",
            "ARRAY['in_progress']",
            "ARRAY[gen_random_uuid()]",
            "ARRAY[gen_random_uuid()]",
            "ARRAY['{}'::jsonb]",
            "ARRAY[1]",
            "ARRAY[now() + interval '30 seconds']",
            "ARRAY['pgbench']",
            "ARRAY[now() + interval '90 seconds']",
            "ARRAY[NULL::text]",
            "ARRAY[__OPID__, __OPID__]",
            "ARRAY['recorded', 'request_sent']",
            "ARRAY['attach recorded', 'attach request sent (attempt 1)']",
            "ARRAY['{\"caller_deadline_ms\":\"30000\",\"deadline_from_caller\":\"true\"}'::jsonb, '{\"attempt\":\"1\",\"outbound_deadline_ms\":\"23500\"}'::jsonb]",
            "ARRAY['pgbench', 'pgbench']",
        ],
    );
    let decide = substitute(
        TRANSITION_MANY,
        &[
            "ARRAY[__OPID__]",
            "ARRAY[1::int8]",
            "ARRAY['succeeded']",
            "ARRAY['response']",
            "ARRAY['{\"id\": \"a\", \"device\": \"/dev/vdb\", \"tag\": null, \"delete_on_termination\": false}'::jsonb]",
            "ARRAY[0]",
            "ARRAY[true]",
            "ARRAY[NULL::jsonb]",
            "ARRAY[false]",
            "ARRAY[true]",
            "ARRAY[NULL::timestamptz]",
            "ARRAY[now() + interval '1 minute']",
            "ARRAY[__OPID__, __OPID__]",
            "ARRAY['response', 'resolved']",
            "ARRAY['Nova answered 200: attachment created', 'attached']",
            "ARRAY['{\"status\":\"200\"}'::jsonb, '{\"state\":\"succeeded\"}'::jsonb]",
            "ARRAY['pgbench', 'pgbench']",
        ],
    );
    format!(
        "\\set n random(1, 2000000000)\n\\set hi random(1, 9000000000000000000)\n\\set lo random(1, 9000000000000000000)\n{create};\n{decide};\n"
    )
}
