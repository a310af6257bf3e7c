//! Group commit at the application level for PostgreSQL: the durable writes
//! of concurrent operations are queued to a few writer tasks by kind
//! (intents; decisions and appends), each of which runs whatever of its
//! kind is waiting as one statement — one round trip, one WAL flush and
//! (for the decisions a waiter on another replica watches) one NOTIFY per
//! batch instead of one per operation. Decisions are announced to this
//! replica's own waiters in-process once committed.
//!
//! The rule "an operation's intent is durable before its request leaves"
//! holds: a caller gets its row only after the batch that wrote it has
//! committed. A statement error aborts its batch; the batch is then re-run
//! one job per transaction, so one bad job never fails the others.
//!
//! Every write is safe to run twice, because a batch may be: its connection
//! can die after the server committed it (only the acknowledgement lost),
//! and then it runs again. Intents conflict on their own id and are found
//! by their caller, decisions and appends carry a write id that their
//! first run left behind (see `bind`). A job whose deadline passed is
//! never run again: its caller was told the deadline expired.
//!
//! The writers use connections of their own (`conns`), not the pool's.
//! Each round trip of theirs is bounded; one that failed for now (its
//! connection lost or silent, no connection to be had) is run again on a
//! new connection after a short pause, until its jobs' deadlines: a
//! database that comes back within a caller's deadline costs that caller
//! nothing but time. Once PostgreSQL is known to be away (`health`), a
//! write not yet sent is refused at once instead: nothing recorded, the
//! caller answered `DATABASE_UNAVAILABLE` with a retry hint.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use std::time::Duration;

use backon::BackoffBuilder as _;
use sqlx::postgres::PgConnectOptions;
use tokio::sync::{Mutex, Notify, broadcast, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::bind::{Payload, Written, batch_on};
use super::bounds::Bounds;
use super::clock::DbClock;
use super::conns::{Conns, Observer};
use super::sql;
use crate::domain::Operation;
use crate::store::{DbFailure, RoundTrip, StoreError};

/// What a queued write is answered with: the operation boxed, so that the
/// channel each waiting write holds has room for a pointer, not a row.
type Answer = Result<Option<Box<Operation>>, StoreError>;
type Reply = oneshot::Sender<Answer>;

/// A write's result as it is sent back to a queued writer.
fn answer(written: Written) -> Answer {
    written.map(|op| op.map(Box::new))
}

struct Job {
    payload: Payload,
    deadline: Instant,
    reply: Reply,
}

#[derive(Clone)]
pub(super) struct Writer {
    /// Intents, and everything else (decisions, appends): a batch holds
    /// writes of one kind, so it is one autocommit statement, one round
    /// trip, instead of a transaction of four.
    queues: [mpsc::Sender<Job>; 2],
    conns: Arc<Conns>,
    /// The database's clock as the intents' round trips bound it.
    pub(super) clock: Arc<DbClock>,
    /// Writes submitted and not yet answered, on any path.
    pending: Arc<AtomicUsize>,
    /// Writes of a kind waiting for a writer, at most (each queue's
    /// bound).
    queued: usize,
    /// This replica's change announcements: its own decisions are
    /// announced here once committed (other replicas' arrive by NOTIFY,
    /// for the operations somebody watches).
    changes: broadcast::Sender<Uuid>,
}

/// Largest batch: bounds a transaction's length and the NOTIFY payload.
const MAX_BATCH: usize = 128;

/// The size at which a batch is sent while another of its kind is in
/// flight. At 64 concurrent callers batches hold 13-15 writes; measured on
/// the service with two writers per kind, a threshold of 8 gained less
/// than 16 and 32 did, and letting two batches be in flight at any size
/// (four writers per kind) gained nothing.
const SECOND_BATCH: usize = 16;

impl Writer {
    pub(super) async fn start(
        options: PgConnectOptions,
        writers: usize,
        queued: usize,
        bounds: Bounds,
        changes: broadcast::Sender<Uuid>,
        stop: CancellationToken,
        observer: Observer,
    ) -> Result<Self, StoreError> {
        let per_kind = (writers / 2).max(1);
        let writers = 2 * per_kind;
        let conns = Arc::new(Conns::new(
            "writer",
            options,
            writers + 1,
            None,
            bounds,
            observer,
        ));
        // One connection now: the first write should not pay for it. It
        // reads the server's clock too: an intent is bound by it from the
        // first (`DbClock`).
        let clock = Arc::new(DbClock::default());
        let mut first = conns.lend(true, Instant::now() + bounds.connect).await?;
        let sent = Instant::now();
        let now = conns
            .timed(
                RoundTrip::Ping,
                "reading the database's clock",
                sent + bounds.round_trip,
                async {
                    sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>(sql::NOW)
                        .fetch_one(first.conn())
                        .await
                        .map_err(StoreError::db("reading the database's clock"))
                },
            )
            .await;
        first.finish(&now);
        clock.observe(sent, Instant::now(), now?);
        // Bounded (`--max-queued-writes`; by default larger than the cap
        // on mutations in flight): a full queue means the database has
        // fallen far behind, and the caller is told so at once instead of
        // waiting out its deadline.
        let queues = [(); 2].map(|()| {
            let (tx, rx) = mpsc::channel(queued);
            let kind = Arc::new(Kind {
                rx: Mutex::new(rx),
                in_flight: AtomicUsize::new(0),
                answered: Notify::new(),
            });
            for _ in 0..per_kind {
                tokio::spawn(writer_loop(
                    conns.clone(),
                    clock.clone(),
                    kind.clone(),
                    stop.clone(),
                ));
            }
            tx
        });
        Ok(Self {
            queues,
            conns,
            clock,
            pending: Arc::new(AtomicUsize::new(0)),
            queued,
            changes,
        })
    }

    /// Closes the idle writer connections (at shutdown, after the drain).
    pub(super) async fn close(&self) {
        self.conns.close().await;
    }

    /// Writes submitted and not yet answered.
    pub(super) fn pending(&self) -> usize {
        self.pending.load(Ordering::Relaxed)
    }

    /// Writes and returns the committed result: inline when no other write
    /// is in flight (nothing to group with; saves two task hops), else
    /// through the bounded queue, grouped with whatever else is waiting.
    pub(super) async fn submit(&self, payload: Payload, deadline: Instant) -> Written {
        let decision = matches!(payload, Payload::Transition(_));
        let written = self.write(payload, deadline).await;
        if decision && let Ok(Some(op)) = &written {
            // Committed: this replica's waiters learn of it at once. A send
            // error only means nobody subscribes now.
            drop(self.changes.send(op.id));
        }
        written
    }

    async fn write(&self, payload: Payload, deadline: Instant) -> Written {
        struct Pending<'a>(&'a AtomicUsize);
        impl Drop for Pending<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        // PostgreSQL known to be away: refused at once, never queued
        // behind writers that wait for it (nothing sent, so nothing
        // recorded: the caller may ask again).
        if let Some(refused) = self.conns.refuse("writing to the ledger") {
            return Err(refused);
        }
        let alone = self.pending.fetch_add(1, Ordering::SeqCst) == 0;
        let _pending = Pending(&self.pending);
        if alone {
            // Boxed: the batch state machine is large, and every write waiting
            // in the queue would otherwise carry room for it.
            return Box::pin(try_one(&self.conns, &self.clock, &payload, deadline)).await;
        }
        let (reply, rx) = oneshot::channel();
        let queue = match payload {
            Payload::Create(_) => &self.queues[0],
            Payload::Transition(_) | Payload::Append(_) => &self.queues[1],
        };
        queue
            .try_send(Job {
                payload,
                deadline,
                reply,
            })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => StoreError::Overloaded {
                    queued: self.queued,
                },
                mpsc::error::TrySendError::Closed(_) => StoreError::database(
                    "queueing a write",
                    DbFailure::Unavailable,
                    "the ledger writers have stopped",
                ),
            })?;
        // Each write is answered by its own deadline, not its batch's: a
        // batch runs until the latest deadline among its writes (retried on
        // new connections meanwhile), and a short one waiting for it would
        // be answered long after its caller's time. Cut here, the write
        // may still commit with its batch: its outcome is unknown
        // (`DeadlineExceeded` says "may have written"), as for a write cut
        // by its own bound, and the writer reads it back.
        let answer = match tokio::time::timeout_at(deadline, rx).await {
            Ok(answer) => answer.map_err(|_| {
                StoreError::database(
                    "awaiting a write",
                    DbFailure::ConnectionLost,
                    "the ledger writer stopped before answering; the write may or may not have committed",
                )
            })?,
            Err(_) => {
                return Err(StoreError::DeadlineExceeded {
                    what: "waiting for the group commit's batch",
                });
            }
        };
        answer.map(|op| op.map(|op| *op))
    }
}

/// One kind's queue, shared by its writers.
struct Kind {
    rx: Mutex<mpsc::Receiver<Job>>,
    /// Batches of this kind sent and not yet answered.
    in_flight: AtomicUsize,
    /// Told each time a batch of this kind is answered.
    answered: Notify,
}

async fn writer_loop(
    conns: Arc<Conns>,
    clock: Arc<DbClock>,
    kind: Arc<Kind>,
    stop: CancellationToken,
) {
    loop {
        let (jobs, in_flight) = {
            let mut rx = kind.rx.lock().await;
            let first = tokio::select! {
                _ = stop.cancelled() => return,
                j = rx.recv() => match j { Some(j) => j, None => return },
            };
            let mut jobs = vec![first];
            drain(&mut rx, &mut jobs);
            // Another batch of this kind in flight (waiting on its commit's
            // flush, mostly): this one goes beside it only once it holds
            // `SECOND_BATCH` writes, else when that one is answered, as
            // with one writer. A small batch beside another would cost the
            // database more per write (its fixed cost) than the overlap
            // gives back. (A caller whose deadline comes meanwhile is
            // answered by the store's bound on every write; `run_batch`
            // then skips its write.)
            if jobs.len() < SECOND_BATCH {
                let answered = kind.answered.notified();
                tokio::pin!(answered);
                // Registered before the check: an answer between the check
                // and the wait is not missed.
                answered.as_mut().enable();
                while jobs.len() < SECOND_BATCH && kind.in_flight.load(Ordering::SeqCst) > 0 {
                    tokio::select! {
                        _ = &mut answered => break,
                        j = rx.recv() => match j {
                            Some(j) => {
                                jobs.push(j);
                                drain(&mut rx, &mut jobs);
                            }
                            None => break,
                        },
                        // Stopping: what was taken is written, not dropped.
                        _ = stop.cancelled() => break,
                    }
                }
            }
            // Counted before the queue is let go: the other writer, next
            // to take it, sees this batch in flight.
            (jobs, InFlight::start(&kind))
        };
        run_batch(&conns, &clock, jobs).await;
        drop(in_flight);
    }
}

/// A batch of a kind in flight: its end (even by a panic) is counted and
/// told to the kind's other writer, which may be waiting for it.
struct InFlight<'a>(&'a Kind);

impl<'a> InFlight<'a> {
    fn start(kind: &'a Kind) -> Self {
        kind.in_flight.fetch_add(1, Ordering::SeqCst);
        Self(kind)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.0.answered.notify_waiters();
    }
}

/// Whatever else is waiting, up to a full batch.
fn drain(rx: &mut mpsc::Receiver<Job>, jobs: &mut Vec<Job>) {
    while jobs.len() < MAX_BATCH {
        match rx.try_recv() {
            Ok(j) => jobs.push(j),
            Err(_) => break,
        }
    }
}

async fn run_batch(conns: &Conns, clock: &DbClock, jobs: Vec<Job>) {
    // A write whose caller's deadline already passed is not made: the
    // caller is told so, and nothing is recorded behind its back.
    let now = Instant::now();
    let (live, expired): (Vec<Job>, Vec<Job>) = jobs.into_iter().partition(|j| j.deadline > now);
    for j in expired {
        // The caller may have stopped waiting; that is fine.
        drop(j.reply.send(Err(self::expired())));
    }
    if live.is_empty() {
        return;
    }
    let batch: Vec<(&Payload, Instant)> = live.iter().map(|j| (&j.payload, j.deadline)).collect();
    match try_batch(conns, clock, &batch).await {
        Ok(results) => {
            for (job, r) in live.into_iter().zip(results) {
                drop(job.reply.send(answer(r)));
            }
        }
        Err(e) if live.len() == 1 => {
            if let Some(job) = live.into_iter().next() {
                drop(job.reply.send(Err(e)));
            }
        }
        Err(e) => {
            // Safe to run again, each alone: a batch that failed as a whole
            // wrote nothing, or (its acknowledgement lost) wrote what each
            // write recognises as its own.
            tracing::debug!(error = %e, jobs = live.len(), "batch failed; writing its jobs one by one");
            for job in live {
                let r = try_one(conns, clock, &job.payload, job.deadline).await;
                drop(job.reply.send(answer(r)));
            }
        }
    }
}

/// One write as a batch of its own, unless its deadline already passed.
async fn try_one(conns: &Conns, clock: &DbClock, payload: &Payload, deadline: Instant) -> Written {
    if deadline <= Instant::now() {
        return Err(expired());
    }
    match try_batch(conns, clock, &[(payload, deadline)]).await {
        Ok(mut v) => v.pop().unwrap_or(Ok(None)),
        Err(e) => Err(e),
    }
}

/// The answer to a job whose deadline passed before it could be run.
fn expired() -> StoreError {
    StoreError::DeadlineExceeded {
        what: "waiting for the group commit",
    }
}

/// The answer to a job whose connection died under it and whose deadline
/// passed before it could be run again: it may or may not have committed.
fn expired_before_rerun() -> StoreError {
    StoreError::DeadlineExceeded {
        what: "writing again after a lost connection",
    }
}

/// A write of a batch refused because PostgreSQL is known to be away
/// (counted; `None` from the check only if the outage ended just now).
fn refused_write(conns: &Conns) -> StoreError {
    conns.refuse("writing to the ledger").unwrap_or_else(|| {
        StoreError::database(
            "writing to the ledger",
            DbFailure::Unavailable,
            "PostgreSQL unreachable; not sent",
        )
    })
}

/// The pauses between tries of a batch that failed for now: 50 ms doubling
/// to 1 s, jittered.
fn retry_pauses() -> backon::ExponentialBackoff {
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(50))
        .with_max_delay(Duration::from_secs(1))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .build()
}

/// Runs the payloads atomically on a writer connection: one autocommit
/// statement when they are all of one kind (the common case: one round
/// trip), else one transaction. `Err` when it failed as a whole (then
/// nothing of it was written, or, if the connection died after the server
/// committed, all of it). Decisions carry their own NOTIFY (one per
/// statement, not per row).
///
/// A try that failed for now (the connection lost or silent, the server
/// unreachable, a conflict) is made again on a new connection, without
/// the jobs whose deadline passed meanwhile (answered as expired), until
/// none is left: each write recognises its own effect if an earlier try
/// committed it. The intents' answers carry the server's clock: they
/// bound it (`clock`).
async fn try_batch(
    conns: &Conns,
    clock: &DbClock,
    batch: &[(&Payload, Instant)],
) -> Result<Vec<Written>, StoreError> {
    const WHAT: &str = "writing to the ledger";
    let kind = match batch.first().map(|(p, _)| *p) {
        Some(Payload::Create(_)) => RoundTrip::Intent,
        _ => RoundTrip::Decision,
    };
    let mut answers: Vec<Option<Written>> = batch.iter().map(|_| None).collect();
    let mut fresh = false;
    // Whether an earlier try may have committed (its connection broke or
    // went silent mid-statement): then an expired job may be written.
    let mut maybe_written = false;
    let mut pauses = retry_pauses();
    loop {
        let now = Instant::now();
        let mut live = Vec::new();
        for (i, (_, deadline)) in batch.iter().enumerate() {
            if answers[i].is_some() {
                continue;
            }
            if *deadline > now {
                live.push(i);
            } else if maybe_written {
                answers[i] = Some(Err(expired_before_rerun()));
            } else {
                answers[i] = Some(Err(expired()));
            }
        }
        let Some(until) = live.iter().map(|i| batch[*i].1).max() else {
            break;
        };
        // PostgreSQL known to be away, and no try of these writes sent:
        // each is refused at once (nothing recorded) rather than tried
        // until its deadline. Once a try may have committed, they are
        // tried until then: their outcome is not known.
        if !maybe_written && conns.is_down() {
            for i in live {
                answers[i] = Some(Err(refused_write(conns)));
            }
            break;
        }
        let payloads: Vec<&Payload> = live.iter().map(|i| batch[*i].0).collect();
        let tried = async {
            let mut lent = conns.lend(fresh, until).await?;
            let sent = Instant::now();
            let written = conns
                .timed(kind, WHAT, until, batch_on(lent.conn(), &payloads))
                .await;
            lent.finish(&written);
            if let Ok(written) = &written
                && let Some(Ok(Some(op))) = written.first()
                && kind == RoundTrip::Intent
            {
                clock.observe(sent, Instant::now(), op.created_at);
            }
            written
        }
        .await;
        match tried {
            Ok(written) => {
                for (i, w) in live.into_iter().zip(written) {
                    answers[i] = Some(w);
                }
                break;
            }
            Err(e) if e.is_transient() => {
                maybe_written |= e.is_connection_lost();
                fresh = true;
                let pause = pauses.next().unwrap_or(Duration::from_secs(1));
                tracing::info!(error = %e, jobs = live.len(), pause_ms = pause.as_millis() as u64,
                    "ledger write failed for now; writing the batch again on a new connection");
                tokio::time::sleep_until((Instant::now() + pause).min(until)).await;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(answers.into_iter().map(|a| a.unwrap_or(Ok(None))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every write waiting in the queue holds a channel with room for its
    /// answer (10,000 intents can wait at once): a pointer to the row, not
    /// the row (512 bytes).
    #[test]
    fn a_queued_write_waits_for_a_pointer_not_a_row() {
        let answer = std::mem::size_of::<Answer>();
        assert!(answer <= 80, "a queued write's answer: {answer} bytes");
        assert!(std::mem::size_of::<Operation>() > 2 * answer);
    }
}
