//! PostgreSQL implementation of `Store`, the production one: one round trip
//! per write on the hot path (data-modifying CTEs write the row and its
//! events together), durable writes group-committed by a few writers on
//! connections of their own, runtime checked queries tested against a real
//! database, LISTEN/NOTIFY as the wake-up hint for watchers.
//!
//! This file is the `Store` trait implementation alone, method by method;
//! what a method needs lives beside it:
//! - `sql`: every statement's text (and `sql::write`, the group commit's).
//! - `connect`: opening the store: sessions, migrations, its connections.
//! - `read`: reads on the read pool, and the short transactions of several
//!   statements.
//! - `batch`: group commit by a few writer tasks; `bind`: a batch bound to
//!   its statements and run.
//! - `conns`: the store's own connections, every round trip bounded.
//! - `health`: whether PostgreSQL is known to be away, and what the store
//!   does then (refuses at once what it would only wait for, probes, logs).
//! - `bounds`: how long a round trip may take, and both ends' TCP bounds.
//! - `clock`: the database's clock as the round trips bound it.
//! - [`sockets`]: keepalive and the user timeout on this process's sockets.
//! - `listen`: LISTEN/NOTIFY to the store's subscribers.
//! - `retention`: pruning, one round at a time across replicas.
//! - `wait`: waiting for PostgreSQL at start.
//! - [`tooling`]: for plan tests and benchmark scripts only: each index
//!   with its statement, the writers' statements, a pgbench script.

mod batch;
mod bind;
mod bounds;
mod clock;
mod connect;
mod conns;
mod health;
mod listen;
mod read;
mod retention;
pub mod sockets;
mod sql;
pub mod tooling;
mod wait;

pub use bounds::Bounds;
pub use connect::{MIGRATOR, PgSettings, applied_migrations};
pub use health::PROBE_PAUSE;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::postgres::{PgConnectOptions, Postgres};
use tokio::sync::broadcast;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use self::batch::Writer;
use self::bind::{Append, Payload};
use self::conns::{Conns, Observer, Repeat};
use super::rows::{self, Id, Json, Time, column};
use super::{
    Cancel, Cancelled, CreateOutcome, DbFailure, DbObserver, HeldLease, ListCursor, NewOperation,
    OperationFilter, OperationPage, OperatorDecision, PruneRound, Renewal, RoundTrip, Saturation,
    StateCount, Store, StoreError, Transition, within,
};
use crate::domain::{CallerKey, NewEvent, Operation, OperationEvent};

column!(Postgres, Id, Uuid, |v| Ok(Id(v)));
column!(Postgres, Time, DateTime<Utc>, |v| Ok(Time(v)));
column!(Postgres, Json, serde_json::Value, |v| Ok(Json::Value(v)));

/// Appending events has no caller's deadline (background work); a write
/// that waits this long for the group commit is given up and reported.
const APPEND_DEADLINE: Duration = Duration::from_secs(60);

/// The event an attempt marked unsent logs (both stores).
pub(crate) fn unsent_event(epoch: i64, attempts: i32) -> NewEvent {
    NewEvent::new(
        crate::domain::event::ATTEMPT_UNSENT,
        "its holder lost the lease before this attempt's request left, and no earlier request \
         may still take effect: decided as never sent (re-sent within its deadline, else FAILED NOT_SENT)",
    )
    .with("lease_epoch", epoch)
    .with("attempts", attempts)
}

/// The PostgreSQL ledger (`connect` opens it).
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
                // Taken apart before the next await: a scrutinee matched
                // across it would keep its room (536 bytes) in every
                // waiting intent's future.
                let (old, superseded) = match Box::pin(why).await? {
                    Some(rows::Conflict::Answer(found)) => return found,
                    Some(rows::Conflict::FreedKey(old)) => (old, false),
                    Some(rows::Conflict::Supersede(old)) => (old, true),
                    None => continue,
                };
                if superseded {
                    // A detach cancels its caller's unsent attach of the
                    // volume, then takes its place (the next try); an
                    // attach no longer cancellable keeps it busy. (A cold
                    // path, boxed.)
                    match Box::pin(self.supersede(&old, &new, deadline)).await? {
                        None => continue,
                        Some(busy) => {
                            return Err(StoreError::VolumeBusy {
                                volume_id: new.volume_id,
                                operation_id: busy,
                            });
                        }
                    }
                }
                // The key saved no result: handed on to this intent, unless
                // another replay took it first (then the next try joins
                // that one).
                let handed = within(
                    deadline,
                    "recording the operation",
                    Box::pin(self.hand_key_on(&old, &new)),
                );
                if let Some(op) = Box::pin(handed).await? {
                    return Ok(CreateOutcome::Created(op));
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

    async fn operation_get_by_key(&self, key: &CallerKey) -> Result<Option<Operation>, StoreError> {
        let hash = key.hash().uuid();
        let (caller, key) = (
            key.caller().as_str().to_string(),
            key.key().as_str().to_string(),
        );
        let q = move || {
            sqlx::query(sqlx::AssertSqlSafe(sql::BY_KEY.as_str()))
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
        after: Option<ListCursor>,
        limit: u32,
    ) -> Result<OperationPage, StoreError> {
        let filter = filter.clone();
        let rows = self
            .read(RoundTrip::Read, "listing operations", move |c| {
                Box::pin(read::list_query(&filter, after, limit).fetch_all(c))
            })
            .await?;
        rows::page(&rows, limit)
    }

    async fn operation_events(&self, id: Uuid) -> Result<Vec<OperationEvent>, StoreError> {
        let rows = self
            .read(RoundTrip::Read, "reading the reconcile log", move |c| {
                Box::pin(sqlx::query(sql::LOG).bind(id).fetch_all(c))
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
        let sql = sql::claim_many_sql();
        // The claim's rows carry its tag (`last_write`), so that a claim
        // whose reply was lost can give back what it may have taken.
        let tag = Uuid::now_v7();
        let (name, held) = (replica.to_string(), held.to_vec());
        let q = move || {
            sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
                .bind(name.clone())
                .bind(lease.as_millis() as f64)
                .bind(i64::from(limit))
                .bind(held.clone())
                .bind(tag)
        };
        // Made once, never run blind again: a second run would claim
        // other rows while the first run's, had it committed, waited out
        // their lease with nobody working on them.
        let claimed = self
            .write_once(RoundTrip::Reconcile, "claiming operations", |c| {
                Box::pin(read::fetch_all_by_index(c, q()))
            })
            .await;
        match claimed {
            Ok(rows) => rows::operations(&rows),
            Err(e) => {
                if e.may_have_written() {
                    self.release_claimed(replica, tag).await;
                }
                Err(e)
            }
        }
    }

    async fn operation_claim_one(
        &self,
        id: Uuid,
        replica: &str,
        lease: Duration,
    ) -> Result<Option<Operation>, StoreError> {
        let sql = sql::claim_one_sql();
        let replica = replica.to_string();
        let tag = Uuid::now_v7();
        let q = move || {
            sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
                .bind(replica.clone())
                .bind(lease.as_millis() as f64)
                .bind(id)
                .bind(tag)
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
                    let q = sqlx::query_as(sql::RENEW_LEASES)
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
            .map(|(id, found)| (id, bind::renewal(&found)))
            .collect())
    }

    async fn verification_backlog(
        &self,
        stage: u8,
        delay: Duration,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        self.first_due(stage, delay).await
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
                Box::pin(read::verification_slice(c, stage, delay, limit))
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
        let (replica, events) = (replica.to_string(), bind::events_array(&events));
        let marked = self
            .write_once(RoundTrip::Reconcile, WHAT, move |c| {
                Box::pin(read::mark_drift(c, id, replica.clone(), events.clone()))
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
        d: &OperatorDecision,
    ) -> Result<Operation, StoreError> {
        let id = d.id;
        let (state, reason, replica, caller) = (
            d.state,
            d.reason.clone(),
            d.replica.clone(),
            d.caller.clone(),
        );
        let expect = d.expect.map(|s| s.as_str().to_string());
        let audit = bind::jsonb(&rows::Pairs(&d.audit));
        let q = move || {
            sqlx::query(sqlx::AssertSqlSafe(sql::resolve_sql()))
                .bind(id)
                .bind(state.as_str())
                .bind(reason.clone())
                .bind(replica.clone())
                .bind(caller.clone())
                .bind(expect.clone())
                .bind(audit.clone())
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
            None => Err(rows::not_resolvable(
                id,
                d.expect,
                self.operation_get(id).await?,
            )),
        }
    }

    async fn operation_cancel(&self, c: &Cancel) -> Result<Cancelled, StoreError> {
        let id = c.id;
        let error = bind::jsonb(&c.error);
        let events = bind::events_array(std::slice::from_ref(&c.event));
        let replica = c.replica.clone();
        let (action, server, caller) = match &c.only_attach_of {
            Some((server, caller)) => (
                Some(crate::domain::Action::Attach.as_str()),
                Some(*server),
                Some(caller.as_str().to_string()),
            ),
            None => (None, None, None),
        };
        let q = move || {
            sqlx::query(sqlx::AssertSqlSafe(sql::cancel_sql()))
                .bind(id)
                .bind(error.clone())
                .bind(replica.clone())
                .bind(events.clone())
                .bind(action)
                .bind(server)
                .bind(caller.clone())
        };
        // Made once: a second run after a lost first one would find the
        // operation decided (by the first) and say so.
        let done = self
            .fetch_operations(
                RoundTrip::Resolve,
                "cancelling an operation",
                Repeat::Never,
                q,
            )
            .await?
            .pop();
        Ok(match done {
            Some(op) => Cancelled::Done(op),
            None => match self.operation_get(id).await? {
                Some(op) => Cancelled::Not(op),
                None => Cancelled::NotFound,
            },
        })
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
                    let q = sqlx::query(sql::RELEASE_LEASES)
                        .bind(replica.clone())
                        .bind(keep.clone());
                    Box::pin(async move { Ok(q.execute(c).await?.rows_affected()) })
                },
            )
            .await
    }

    async fn operation_count_by_state(&self) -> Result<Vec<StateCount>, StoreError> {
        self.count_whole_ledger().await
    }

    async fn operation_open_by_state(&self) -> Result<Vec<StateCount>, StoreError> {
        let rows = self
            .read(RoundTrip::Scrape, "counting the open operations", |c| {
                let q = sqlx::query(sqlx::AssertSqlSafe(sql::OPEN_BY_STATE.as_str()));
                Box::pin(read::fetch_all_by_index(c, q))
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
                    let rows = read::fetch_all_by_index(c, q).await?;
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
        self.read(
            RoundTrip::Reconcile,
            "reading volumes' latest operations",
            move |c| {
                Box::pin(
                    sqlx::query_as(sql::VOLUMES_LATEST)
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
                Box::pin(sqlx::query_scalar(sql::NOW).fetch_one(c))
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
        // See `sql::WATCH`.
        self.read(
            RoundTrip::Watch,
            "registering a wait for a decision",
            move |c| {
                let q = sqlx::query(sql::WATCH)
                    .bind(id)
                    .bind(wait.as_secs_f64() * 1000.0);
                Box::pin(async move { q.execute(c).await.map(drop) })
            },
        )
        .await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.read(RoundTrip::Ping, "checking the database", |c| {
            Box::pin(async move { sqlx::query(sql::PING).execute(c).await.map(drop) })
        })
        .await
    }

    async fn retention_begin(&self) -> Result<Option<Box<dyn PruneRound>>, StoreError> {
        retention::begin(&self.options, self.reads.bounds(), self.observer.clone()).await
    }

    async fn retention_oldest_decided(&self) -> Result<Option<DateTime<Utc>>, StoreError> {
        // The first entry of `operations_decided`.
        self.read(RoundTrip::Scrape, "reading the oldest decision", |c| {
            Box::pin(sqlx::query_scalar(sql::OLDEST_DECIDED).fetch_one(c))
        })
        .await
    }

    async fn operation_key_expired(
        &self,
        key: &CallerKey,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        let hash = key.hash().uuid();
        self.read(RoundTrip::Read, "reading a key's tombstone", move |c| {
            Box::pin(
                sqlx::query_scalar(sql::KEY_TOMBSTONE)
                    .bind(hash)
                    .fetch_optional(c),
            )
        })
        .await
    }

    async fn operation_mark_unsent(
        &self,
        id: Uuid,
        epoch: i64,
        attempts: i32,
        replica: &str,
    ) -> Result<bool, StoreError> {
        let events = bind::events_array(&[unsent_event(epoch, attempts)]);
        let (write, replica) = (Uuid::now_v7(), replica.to_string());
        let n: i64 = self
            .write_once(
                RoundTrip::Lease,
                "marking an attempt that never left",
                move |c| {
                    let (events, replica) = (events.clone(), replica.clone());
                    Box::pin(
                        sqlx::query_scalar(sql::MARK_UNSENT)
                            .bind(id)
                            .bind(epoch)
                            .bind(attempts)
                            .bind(write)
                            .bind(replica)
                            .bind(events)
                            .fetch_one(c),
                    )
                },
            )
            .await?;
        Ok(n > 0)
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
                    sqlx::query_scalar(sql::INTENT_SETTLED)
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
