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
//! The writers use connections of their own (`conns`), not the pool's.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use sqlx::Connection as _;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::conns::Conns;
use super::statements::{Append, append_many, create_many, transition_many};
use crate::domain::Operation;
use crate::store::{DbFailure, NewOperation, StoreError, Transition, rows};

pub(super) enum Payload {
    Create(Box<NewOperation>),
    Transition(Box<Transition>),
    /// Events appended to an operation's log, changing nothing else
    /// (verifications): batched like the rest, not notified.
    Append(Box<Append>),
}

type Written = Result<Option<Operation>, StoreError>;
type Reply = oneshot::Sender<Written>;

struct Job {
    payload: Payload,
    deadline: Instant,
    reply: Reply,
}

#[derive(Clone)]
pub(super) struct Writer {
    tx: mpsc::Sender<Job>,
    conns: Arc<Conns>,
    /// Writes submitted and not yet answered, on any path.
    pending: Arc<AtomicUsize>,
}

/// Largest batch: bounds a transaction's length and the NOTIFY payload.
const MAX_BATCH: usize = 128;

/// Writes waiting for a writer, at most.
const QUEUE: usize = 32_768;

impl Writer {
    pub(super) async fn start(
        options: PgConnectOptions,
        writers: usize,
        stop: CancellationToken,
    ) -> Result<Self, StoreError> {
        let writers = writers.max(1);
        let conns = Arc::new(Conns::new(options, writers + 1));
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
            pending: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Closes the idle writer connections (at shutdown, after the drain).
    pub(super) async fn close(&self) {
        self.conns.close().await;
    }

    /// Writes and returns the committed result: inline when no other write
    /// is in flight (nothing to group with; saves two task hops), else
    /// through the bounded queue, grouped with whatever else is waiting.
    pub(super) async fn submit(&self, payload: Payload, deadline: Instant) -> Written {
        struct Pending<'a>(&'a AtomicUsize);
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
                Err(e) => Err(e),
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
                mpsc::error::TrySendError::Closed(_) => StoreError::database(
                    "queueing a write",
                    DbFailure::Unavailable,
                    "the ledger writers have stopped",
                ),
            })?;
        rx.await.map_err(|_| {
            StoreError::database(
                "awaiting a write",
                DbFailure::ConnectionLost,
                "the ledger writer stopped before answering; the write may or may not have committed",
            )
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
                drop(reply.send(Err(e)));
            }
        }
        Err(e) => {
            tracing::debug!(error = %e, jobs = payloads.len(), "batch failed; writing its jobs one by one");
            for (payload, reply) in payloads.into_iter().zip(replies) {
                let one = [payload];
                let r = match try_batch(conns, &one).await {
                    Ok(mut v) => v.pop().unwrap_or(Ok(None)),
                    Err(e) => Err(e),
                };
                drop(reply.send(r));
            }
        }
    }
}

/// Runs the payloads atomically on a writer connection: one autocommit
/// statement when they are all of one kind (the common case: one round
/// trip), else one transaction. `Err` when it failed as a whole (then
/// nothing of it was written). Decisions carry their own NOTIFY (one per
/// statement, not per row).
async fn try_batch(conns: &Conns, payloads: &[Payload]) -> Result<Vec<Written>, StoreError> {
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
                && e.is_connection_lost()
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

/// A batch's payloads by kind; transitions with their place among the
/// batch's transitions.
struct Split<'a> {
    creates: Vec<&'a NewOperation>,
    transitions: Vec<(usize, &'a Transition)>,
    appends: Vec<&'a Append>,
}

impl<'a> Split<'a> {
    fn of(payloads: &'a [Payload]) -> Self {
        let mut split = Split {
            creates: Vec::new(),
            transitions: Vec::new(),
            appends: Vec::new(),
        };
        for p in payloads {
            match p {
                Payload::Create(n) => split.creates.push(n),
                Payload::Transition(t) => split.transitions.push((split.transitions.len(), t)),
                Payload::Append(a) => split.appends.push(a),
            }
        }
        split
    }

    /// One statement does it all: payloads of one kind, and no operation
    /// decided twice (that takes a round per decision).
    fn one_statement(&self) -> bool {
        let kinds = [
            !self.creates.is_empty(),
            !self.transitions.is_empty(),
            !self.appends.is_empty(),
        ];
        let mut ids = HashSet::new();
        kinds.iter().filter(|k| **k).count() == 1
            && self.transitions.iter().all(|(_, t)| ids.insert(t.id))
    }
}

async fn batch_on(
    conn: &mut PgConnection,
    payloads: &[Payload],
) -> Result<Vec<Written>, StoreError> {
    const WHAT: &str = "writing to the ledger";
    let split = Split::of(payloads);
    if split.one_statement() {
        run_statements(conn, payloads, split).await
    } else {
        let mut tx = conn.begin().await.map_err(StoreError::db(WHAT))?;
        let results = run_statements(&mut tx, payloads, split).await?;
        tx.commit().await.map_err(StoreError::db(WHAT))?;
        Ok(results)
    }
}

/// The rows a statement returned, by id.
fn by_id(rows: &[sqlx::postgres::PgRow]) -> HashMap<Uuid, Written> {
    let mut out = HashMap::with_capacity(rows.len());
    for row in rows {
        match rows::operation(row) {
            Ok(op) => {
                out.insert(op.id, Ok(Some(op)));
            }
            // Its write committed; its caller, answered `None`, re-reads
            // the row and meets the same error there.
            Err(e) => tracing::error!(error = %e, "a row the ledger just wrote is unreadable"),
        }
    }
    out
}

async fn run_statements(
    conn: &mut PgConnection,
    payloads: &[Payload],
    split: Split<'_>,
) -> Result<Vec<Written>, StoreError> {
    let mut created = HashMap::new();
    if !split.creates.is_empty() {
        created = by_id(&create_many(conn, &split.creates).await?);
    }
    if !split.appends.is_empty() {
        append_many(conn, &split.appends).await?;
    }
    let mut decided = run_transitions(conn, split.transitions).await?.into_iter();
    Ok(payloads
        .iter()
        .map(|p| match p {
            Payload::Create(n) => created.remove(&n.id).unwrap_or(Ok(None)),
            Payload::Transition(_) => decided.next().unwrap_or(Ok(None)),
            Payload::Append(_) => Ok(None),
        })
        .collect())
}

/// The batch's decisions, in the order of the payloads: one statement per
/// round; an operation appearing twice (never in practice: one flow per
/// operation at a time) waits for the next round.
async fn run_transitions(
    conn: &mut PgConnection,
    mut pending: Vec<(usize, &Transition)>,
) -> Result<Vec<Written>, StoreError> {
    let mut results: Vec<(usize, Written)> = Vec::new();
    while !pending.is_empty() {
        let mut seen = HashSet::new();
        type Indexed<'a> = Vec<(usize, &'a Transition)>;
        let (round, rest): (Indexed, Indexed) =
            pending.into_iter().partition(|(_, t)| seen.insert(t.id));
        let ts: Vec<&Transition> = round.iter().map(|(_, t)| *t).collect();
        let mut updated = by_id(&transition_many(conn, &ts).await?);
        for (i, t) in round {
            results.push((i, updated.remove(&t.id).unwrap_or(Ok(None))));
        }
        pending = rest;
    }
    results.sort_by_key(|(i, _)| *i);
    Ok(results.into_iter().map(|(_, r)| r).collect())
}
