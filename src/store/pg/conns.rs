//! The store's own connections to PostgreSQL, every round trip bounded.
//!
//! sqlx's pool waits without a bound where it matters here: it pings
//! every connection it takes back (in a task, with no timeout), so a
//! connection that stopped answering without closing (a NAT or a load
//! balancer that lost its state, a failover whose old connections were
//! not reset) holds its slot for ever, and once every slot is held so,
//! every request waits out its deadline and the replica never recovers.
//! These pools keep that out:
//!
//! - A connection is lent out (`Lent`) and comes back only when the round
//!   trip it was lent for ended with an answer; one dropped mid-statement
//!   (its round trip timed out, its caller went away) or whose connection
//!   failed is closed, never reused: its state is unknown.
//! - Every round trip is bounded (`Bounds::round_trip`), and a connection
//!   idle for a while is pinged, bounded too, before it is lent again.
//!   Once one connection of a pool has gone silent, the other idle ones
//!   are dropped as well (they went quiet the same way, as a rule: a lost
//!   NAT mapping loses them all), and new ones are opened.
//! - A pool with `max` connections lends at most that many at once; the
//!   wait for one is bounded by the caller's.
//!
//! Every session also carries the server side's bounds
//! (`Bounds::session_options`, in `bounds`): its statements and idle transactions are ended by
//! the server too, and its TCP keepalives find a client that vanished, so
//! the locks a dead session holds are released.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use futures_util::future::BoxFuture;
use sqlx::Connection as _;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::bounds::Bounds;
use super::health::{self, Health};
use crate::store::{DbFailure, DbObserver, RoundTrip, StoreError};

/// A writer's connection idle this long is pinged before it is used again
/// (cheaper than sqlx's ping at every use: one more round trip per write).
const PING_IF_IDLE_FOR: Duration = Duration::from_secs(1);

/// Reports each round trip: to the database metrics, and to the store's
/// knowledge of whether PostgreSQL is there (`health`), which every
/// connection of one store shares.
#[derive(Clone, Default)]
pub(super) struct Observer {
    metrics: Arc<OnceLock<Arc<dyn DbObserver>>>,
    pub(super) health: Arc<Health>,
}

impl Observer {
    pub(super) fn set(&self, o: Arc<dyn DbObserver>) {
        // Set once, at start; a second observer is ignored on purpose
        // (the first stays the one the metrics read).
        if self.metrics.set(o).is_err() {
            tracing::debug!("a database observer was already set");
        }
    }

    pub(super) fn round_trip(&self, kind: RoundTrip, started: Instant, outcome: &'static str) {
        match outcome {
            "ok" => self.health.answered(),
            _ => self.health.failed(),
        }
        if let Some(o) = self.metrics.get() {
            o.round_trip(kind.as_str(), started.elapsed().as_secs_f64(), outcome);
        }
    }
}

pub(super) struct Conns {
    /// What these connections are for, in log lines and errors.
    name: &'static str,
    options: PgConnectOptions,
    idle: Mutex<Vec<(PgConnection, Instant)>>,
    /// Idle connections kept, at most.
    keep: usize,
    /// Connections lent at once, at most (`None`: as many as asked, for
    /// the writers, whose number is fixed).
    permits: Option<Arc<Semaphore>>,
    max: usize,
    bounds: Bounds,
    observer: Observer,
}

/// A connection lent for one round trip: back to the pool only through
/// `finish` with an answer; dropped otherwise.
pub(super) struct Lent<'a> {
    conn: Option<PgConnection>,
    /// Taken from the idle list (so possibly gone stale), not opened now.
    pub(super) reused: bool,
    pool: &'a Conns,
    _permit: Option<OwnedSemaphorePermit>,
}

impl Lent<'_> {
    pub(super) fn conn(&mut self) -> &mut PgConnection {
        // Present until `finish` or drop take it.
        self.conn.as_mut().expect("a lent connection is present")
    }

    /// Ends the loan after a round trip that answered: healthy, the
    /// connection goes back; one whose connection failed is dropped.
    pub(super) fn finish<T>(mut self, outcome: &Result<T, StoreError>) {
        let healthy = match outcome {
            Ok(_) => true,
            Err(e) => !e.is_connection_lost(),
        };
        if let Some(conn) = self.conn.take()
            && healthy
        {
            self.pool.put(conn);
        }
    }
}

/// Whether a round trip may be made again on another connection when its
/// connection failed or went silent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Repeat {
    /// Reads, and writes whose second run finds the first's effect.
    Safe,
    /// A write whose second run would act again (or answer otherwise).
    Never,
}

impl Conns {
    pub(super) fn new(
        name: &'static str,
        options: PgConnectOptions,
        keep: usize,
        max: Option<usize>,
        bounds: Bounds,
        observer: Observer,
    ) -> Self {
        Self {
            name,
            options,
            idle: Mutex::new(Vec::new()),
            keep,
            permits: max.map(|n| Arc::new(Semaphore::new(n.max(1)))),
            max: max.unwrap_or(0).max(1),
            bounds,
            observer,
        }
    }

    pub(super) fn bounds(&self) -> Bounds {
        self.bounds
    }

    fn idle(&self) -> MutexGuard<'_, Vec<(PgConnection, Instant)>> {
        // A panic while holding this lock leaves a plain Vec behind: usable.
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn put(&self, conn: PgConnection) {
        let mut idle = self.idle();
        if idle.len() < self.keep {
            idle.push((conn, Instant::now()));
        }
    }

    /// Drops every idle connection (they close as they drop).
    fn flush(&self) {
        let dropped = std::mem::take(&mut *self.idle());
        if !dropped.is_empty() {
            tracing::info!(
                pool = self.name,
                dropped = dropped.len(),
                "a database connection went silent; dropping the idle ones too"
            );
        }
    }

    /// Connections lent out now, and the most that may be (for the
    /// pool-in-use gauge); `None` for a pool without a cap.
    pub(super) fn in_use(&self) -> Option<(usize, usize)> {
        let p = self.permits.as_ref()?;
        Some((self.max.saturating_sub(p.available_permits()), self.max))
    }

    /// Lends a connection by `until`: an idle one (pinged first if it sat
    /// idle), or a new one when `fresh` or none is idle.
    pub(super) async fn lend(&self, fresh: bool, until: Instant) -> Result<Lent<'_>, StoreError> {
        let permit = match &self.permits {
            None => None,
            Some(p) => Some(
                tokio::time::timeout_at(until, p.clone().acquire_owned())
                    .await
                    .map_err(|_| {
                        StoreError::database(
                            "waiting for a database connection",
                            DbFailure::Unavailable,
                            format!(
                                "all {} connections of the {} pool stayed busy",
                                self.max, self.name
                            ),
                        )
                    })?
                    .map_err(|_| {
                        StoreError::database(
                            "waiting for a database connection",
                            DbFailure::Unavailable,
                            "the store is closing",
                        )
                    })?,
            ),
        };
        let lent = |conn, reused| Lent {
            conn: Some(conn),
            reused,
            pool: self,
            _permit: permit,
        };
        if !fresh && let Some(conn) = self.take_idle(until).await {
            return Ok(lent(conn, true));
        }
        let conn = self.open(until).await?;
        Ok(lent(conn, false))
    }

    /// An idle connection that answers (pinged when it sat idle), or none.
    async fn take_idle(&self, until: Instant) -> Option<PgConnection> {
        loop {
            let popped = self.idle().pop();
            let (mut conn, since) = popped?;
            if since.elapsed() < PING_IF_IDLE_FOR {
                return Some(conn);
            }
            let by = until.min(Instant::now() + self.bounds.ping());
            match tokio::time::timeout_at(by, conn.ping()).await {
                Ok(Ok(())) => return Some(conn),
                // Gone stale (the database restarted, a proxy closed it):
                // dropped; the next one is tried, or a new one opened.
                Ok(Err(e)) => {
                    tracing::info!(pool = self.name, error = %e, "dropping a stale database connection")
                }
                Err(_) => {
                    drop(conn);
                    self.flush();
                    return None;
                }
            }
        }
    }

    /// A new connection by `until` (and the connect bound); refused at
    /// once while PostgreSQL is known to be away (`health`).
    pub(super) async fn open(&self, until: Instant) -> Result<PgConnection, StoreError> {
        const WHAT: &str = "opening a database connection";
        let health = &self.observer.health;
        if let Some(refused) = health.refuse(WHAT) {
            return Err(refused);
        }
        let by = until.min(Instant::now() + self.bounds.connect);
        let started = Instant::now();
        match tokio::time::timeout_at(by, PgConnection::connect_with(&self.options)).await {
            Ok(Ok(conn)) => {
                health.answered();
                // Keepalive and TCP_USER_TIMEOUT on our end of it.
                super::sockets::tune(&self.options, self.bounds).await;
                Ok(conn)
            }
            Ok(Err(e)) => {
                health.connect_failed(started, health::is_unreachable(&e), &e);
                Err(StoreError::connect(WHAT)(e))
            }
            Err(_) => {
                // Counted by the observer; an outage only when the server
                // had time to answer.
                self.observer
                    .round_trip(RoundTrip::Connect, started, "timeout");
                let cause = format!(
                    "no connection within {} ms",
                    by.saturating_duration_since(started).as_millis()
                );
                // Silent only when it had the whole connect bound: one cut
                // short by its caller's deadline says nothing, and a
                // server answering within the bound is healthy however
                // slow (a 2.7 s reply latency, fsync-bound commits under
                // load, must not read as an outage).
                let silent = health::waited_silent(started.elapsed(), self.bounds.connect);
                health.connect_failed(started, silent, &cause);
                Err(StoreError::database(WHAT, DbFailure::Unavailable, cause))
            }
        }
    }

    /// The failure that refuses a write not yet sent while PostgreSQL is
    /// known to be away; `None` otherwise.
    pub(super) fn refuse(&self, what: &'static str) -> Option<StoreError> {
        self.observer.health.refuse(what)
    }

    /// Whether PostgreSQL is known to be away now.
    pub(super) fn is_down(&self) -> bool {
        self.observer.health.is_down()
    }

    /// Runs `f` on a lent connection within one round-trip bound (and
    /// `until`); a round trip that did not end by then is given up and its
    /// connection dropped. With `Repeat::Safe`, a round trip whose reused
    /// connection failed or went silent runs once more on a new one, as
    /// long as `until` allows.
    pub(super) async fn run<T, F>(
        &self,
        kind: RoundTrip,
        what: &'static str,
        repeat: Repeat,
        until: Instant,
        f: F,
    ) -> Result<T, StoreError>
    where
        F: for<'c> Fn(&'c mut PgConnection) -> BoxFuture<'c, Result<T, sqlx::Error>>,
    {
        let mut fresh = false;
        loop {
            let mut lent = self.lend(fresh, until).await?;
            let reused = lent.reused;
            let result = self.bounded(kind, what, until, f(lent.conn())).await;
            lent.finish(&result);
            match result {
                Err(e)
                    if repeat == Repeat::Safe
                        && !fresh
                        && reused
                        && e.is_connection_lost()
                        && Instant::now() < until =>
                {
                    tracing::info!(pool = self.name, error = %e, "database connection lost; once more on a new one");
                    fresh = true;
                }
                other => return other,
            }
        }
    }

    /// One round trip, bounded by `Bounds::round_trip` and `until`,
    /// observed; on expiry the future (and with it the statement) is
    /// dropped and a `TimedOut` failure returned.
    pub(super) async fn bounded<T>(
        &self,
        kind: RoundTrip,
        what: &'static str,
        until: Instant,
        fut: impl std::future::Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, StoreError> {
        self.timed(kind, what, until, async {
            fut.await.map_err(StoreError::db(what))
        })
        .await
    }

    /// `bounded`, for a future that classifies its own errors.
    pub(super) async fn timed<T>(
        &self,
        kind: RoundTrip,
        what: &'static str,
        until: Instant,
        fut: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let by = until.min(started + self.bounds.round_trip);
        match tokio::time::timeout_at(by, fut).await {
            Ok(r) => {
                let outcome = match &r {
                    Ok(_) => "ok",
                    Err(e) if e.is_timed_out() => "timeout",
                    Err(_) => "error",
                };
                self.observer.round_trip(kind, started, outcome);
                r
            }
            Err(_) => {
                self.observer.round_trip(kind, started, "timeout");
                Err(StoreError::database(
                    what,
                    DbFailure::TimedOut,
                    format!(
                        "PostgreSQL did not answer within {} ms ({} connection dropped)",
                        by.saturating_duration_since(started).as_millis(),
                        self.name
                    ),
                ))
            }
        }
    }

    /// Closes the idle connections (at shutdown).
    pub(super) async fn close(&self) {
        if let Some(p) = &self.permits {
            p.close();
        }
        let conns: Vec<_> = self.idle().drain(..).collect();
        for (conn, _) in conns {
            match tokio::time::timeout(self.bounds.ping(), conn.close()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(error = %e, "closing a database connection"),
                // Dropped as it stands: the server ends the session.
                Err(_) => tracing::debug!("closing a database connection timed out"),
            }
        }
    }
}
