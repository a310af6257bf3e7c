//! The change listener: LISTEN on the notification channel, and each id a
//! notification carries sent to the store's subscribers.
//!
//! Its connection is idle most of the time, so a connection that went
//! silent (no FIN: a NAT or a proxy that lost its state) would go
//! unnoticed for ever, and with it every notification. So after
//! `LIVENESS_AFTER` without a message it asks the server for one (a
//! bounded `SELECT 1` on the same connection); a connection that does not
//! answer is dropped and a new one listens, and the subscribers re-read
//! (the `Uuid::nil()` wake-up: notifications may have been missed).

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions};
use tokio::sync::broadcast;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::bounds::Bounds;
use super::conns::Observer;
use super::sql::{self, NOTIFY_CHANNEL};
use crate::store::RoundTrip;

/// A listener this long without a message checks its connection answers.
const LIVENESS_AFTER: Duration = Duration::from_secs(10);

/// The listener's pool: one connection, re-opened by sqlx when it breaks.
fn pool(options: &PgConnectOptions, bounds: Bounds) -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(bounds.connect)
        // The listener pings its connection itself (bounded); sqlx's own
        // pings are not.
        .test_before_acquire(false)
        .connect_lazy_with(options.clone())
}

async fn listener(
    options: &PgConnectOptions,
    bounds: Bounds,
) -> Result<(PgPool, PgListener), sqlx::Error> {
    let pool = pool(options, bounds);
    let mut listener = PgListener::connect_with(&pool).await?;
    listener.listen(NOTIFY_CHANNEL).await?;
    super::sockets::tune(options, bounds).await;
    Ok((pool, listener))
}

pub(super) async fn spawn_listener(
    options: PgConnectOptions,
    bounds: Bounds,
    changes: broadcast::Sender<Uuid>,
    stop: CancellationToken,
    observer: Observer,
) -> anyhow::Result<()> {
    let (mut pool, mut listener) = listener(&options, bounds)
        .await
        .map_err(|e| anyhow::anyhow!("cannot LISTEN {NOTIFY_CHANNEL}: {e}"))?;
    tokio::spawn(async move {
        loop {
            let next = tokio::select! {
                _ = stop.cancelled() => break,
                n = tokio::time::timeout(LIVENESS_AFTER, listener.try_recv()) => n,
            };
            let healthy = match next {
                Ok(Ok(Some(n))) => {
                    announce(&changes, n.payload());
                    true
                }
                // The connection was lost and re-established: notifications
                // may have been missed, so every watcher re-reads.
                Ok(Ok(None)) => {
                    drop(changes.send(Uuid::nil()));
                    true
                }
                Ok(Err(_)) if stop.is_cancelled() => break,
                // Info: listening anew is routine (the watchers re-read);
                // `reopen` warns when it cannot.
                Ok(Err(e)) => {
                    tracing::info!(error = %e, "change listener failed; listening anew");
                    false
                }
                Err(_) => alive(&mut listener, bounds, &observer).await,
            };
            if !healthy {
                drop(changes.send(Uuid::nil()));
                match reopen(&options, bounds, &stop).await {
                    Some((p, l)) => {
                        // The old pool is marked closed first (its close
                        // future marks it before it is polled), so its
                        // connection, dropped with the old listener, is
                        // closed rather than pinged (sqlx's unbounded ping
                        // on a silent connection would never end).
                        drop(pool.close());
                        (pool, listener) = (p, l);
                        drop(changes.send(Uuid::nil()));
                    }
                    None => break,
                }
            }
        }
        pool.close().await;
    });
    Ok(())
}

/// Each id a notification carries, to the subscribers: one notification
/// per committed batch, the ids comma separated.
fn announce(changes: &broadcast::Sender<Uuid>, payload: &str) {
    for part in payload.split(',').filter(|p| !p.is_empty()) {
        match Uuid::parse_str(part) {
            // A send error only means nobody listens now.
            Ok(id) => drop(changes.send(id)),
            Err(e) => tracing::warn!(payload = part, error = %e, "unexpected notification payload"),
        }
    }
}

/// Whether the listener's connection answers a `SELECT 1` within a ping's
/// bound.
async fn alive(listener: &mut PgListener, bounds: Bounds, observer: &Observer) -> bool {
    let started = Instant::now();
    let by = bounds.round_trip.min(Duration::from_secs(1));
    let answered = tokio::time::timeout(by, sqlx::query(sql::PING).execute(&mut *listener)).await;
    match answered {
        Ok(Ok(_)) => {
            observer.round_trip(RoundTrip::Listen, started, "ok");
            true
        }
        Ok(Err(e)) => {
            observer.round_trip(RoundTrip::Listen, started, "error");
            tracing::warn!(error = %e, "change listener: its connection failed");
            false
        }
        Err(_) => {
            observer.round_trip(RoundTrip::Listen, started, "timeout");
            tracing::warn!(
                "change listener: its connection did not answer within {} ms; listening on a new one",
                by.as_millis()
            );
            false
        }
    }
}

/// A new listener, tried every second until one listens or `stop`. The
/// first failure is a warn line, the tries after it debug (an outage of
/// the database would otherwise write one a second: the store sums it up),
/// and listening again one info line.
async fn reopen(
    options: &PgConnectOptions,
    bounds: Bounds,
    stop: &CancellationToken,
) -> Option<(PgPool, PgListener)> {
    let since = Instant::now();
    let mut tries = 0u64;
    loop {
        let attempt = tokio::time::timeout(
            bounds.connect + bounds.round_trip,
            listener(options, bounds),
        );
        let e = tokio::select! {
            _ = stop.cancelled() => return None,
            r = attempt => match r {
                Ok(Ok(found)) => {
                    if tries > 0 {
                        tracing::info!(tries, "change listener: listening again after {} s", since.elapsed().as_secs());
                    }
                    return Some(found);
                }
                Ok(Err(e)) => e.to_string(),
                Err(_) => "no connection in time".to_string(),
            },
        };
        if tries == 0 {
            tracing::warn!(error = %e, "change listener: cannot listen yet; trying again every 1s");
        } else {
            tracing::debug!(error = %e, tries, "change listener: cannot listen yet");
        }
        tries += 1;
        tokio::select! {
            _ = stop.cancelled() => return None,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}
