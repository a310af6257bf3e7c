//! The ledger writers' connections, kept apart from the pool: sqlx's pool
//! pings every connection it takes back (one more round trip per write, and
//! a task to run it). A writer's connection is pinged only after it sat idle
//! long enough to have gone stale, and one whose write was cut short (the
//! caller's deadline fired mid-statement) or whose connection failed is
//! dropped, never reused.

use std::time::Duration;

use sqlx::Connection as _;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use tokio::time::Instant;

use crate::store::{DbFailure, StoreError};

/// A writer connection idle this long is pinged before it is used again.
const PING_IF_IDLE_FOR: Duration = Duration::from_secs(1);

/// Opening a writer connection, at most: connection setup stays short.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

pub(super) struct Conns {
    options: PgConnectOptions,
    idle: std::sync::Mutex<Vec<(PgConnection, Instant)>>,
    /// Idle connections kept, at most (one per writer, one inline).
    keep: usize,
}

impl Conns {
    pub(super) fn new(options: PgConnectOptions, keep: usize) -> Self {
        Self {
            options,
            idle: std::sync::Mutex::new(Vec::new()),
            keep,
        }
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<(PgConnection, Instant)>> {
        // A panic while holding this lock leaves a plain Vec behind: usable.
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An idle connection (`true`: reused) or a new one.
    pub(super) async fn take(&self) -> Result<(PgConnection, bool), StoreError> {
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

    pub(super) async fn open(&self) -> Result<PgConnection, StoreError> {
        const WHAT: &str = "opening a ledger connection";
        match tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(&self.options)).await
        {
            Ok(r) => r.map_err(StoreError::connect(WHAT)),
            Err(_) => Err(StoreError::database(
                WHAT,
                DbFailure::Unavailable,
                format!("no connection within {CONNECT_TIMEOUT:?}"),
            )),
        }
    }

    /// Takes a connection back after a write that ran to its end. One whose
    /// connection failed (I/O, protocol, the server ended the session) is
    /// dropped instead.
    pub(super) fn put<T>(&self, conn: PgConnection, outcome: &Result<T, StoreError>) {
        let healthy = match outcome {
            Ok(_) => true,
            Err(e) => !e.is_connection_lost(),
        };
        let mut idle = self.idle();
        if healthy && idle.len() < self.keep {
            idle.push((conn, Instant::now()));
        }
    }

    pub(super) async fn close(&self) {
        let conns: Vec<_> = self.idle().drain(..).collect();
        for (conn, _) in conns {
            if let Err(e) = conn.close().await {
                tracing::debug!(error = %e, "closing a ledger connection");
            }
        }
    }
}
