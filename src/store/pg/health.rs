//! Whether PostgreSQL is known to be away, and what the store does then.
//!
//! An outage is *known* once two connection attempts in a row could not
//! be opened (refused, reset, unreachable, or silent for the whole connect
//! bound: a server answering within it is healthy, however slowly)
//! and no round trip answered since the first of them began: every way to
//! the server failed, not one connection (a reset can catch a connection
//! mid-handshake while the next one works). From then until a connection
//! succeeds again:
//!
//! - a write that was never sent, and every new connection, is refused at
//!   once (`DbFailure::Unavailable`: nothing sent, so nothing recorded, and
//!   the caller hears `DATABASE_UNAVAILABLE` with a retry hint) instead of
//!   waiting out its deadline for a server that is not there; a write that
//!   may have been sent keeps trying until its deadline, as ever (its
//!   outcome is not known);
//! - a probe of the store's own opens a connection every `PROBE_PAUSE`
//!   (bounded by the connect bound), so the outage ends as soon as the
//!   server accepts one, whether or not anything else asks;
//! - the log says so at its edges, once each ("PostgreSQL unreachable
//!   since …", "PostgreSQL reachable again after …"), and sums it up once
//!   per `SUMMARY_INTERVAL` in between (kind `database outage`, with the
//!   calls refused and the round trips failed), instead of a line per call.
//!
//! An answer on any connection ends an outage: the hot path (a round trip
//! that answered while all is well) is two atomic operations.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use sqlx::Connection as _;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::bounds::Bounds;
use crate::store::{DbFailure, StoreError};

/// The pause between two probes of a server known to be away: a server
/// back is noticed within it (or a connect bound, for one that accepts
/// slowly).
pub const PROBE_PAUSE: Duration = Duration::from_millis(500);

/// How often an outage is summed up in the log while it lasts.
const SUMMARY_INTERVAL: Duration = crate::telemetry::summary::SUMMARY_INTERVAL;

/// An outage in progress.
struct Outage {
    since: SystemTime,
    started: Instant,
    first_error: String,
    /// Calls refused at once (writes not sent, connections not opened),
    /// since it began and since the last summary.
    refused: u64,
    refused_now: u64,
    /// Round trips and connection attempts that failed meanwhile.
    failed: u64,
    failed_now: u64,
}

pub(super) struct Health {
    /// Set while an outage is known: an answer takes the lock only then.
    down: AtomicBool,
    outage: Mutex<Option<Outage>>,
    /// When a round trip or a connection last answered (ms since `epoch`;
    /// 0: never).
    last_answer: AtomicU64,
    /// When the first of a row of failed connection attempts began (ms
    /// since `epoch`; 0: none, or an answer came since). Written under the
    /// outage's lock.
    suspect: AtomicU64,
    epoch: Instant,
    /// Told when an outage begins (the probe waits for it).
    began: Notify,
}

impl Default for Health {
    fn default() -> Self {
        Self {
            down: AtomicBool::new(false),
            outage: Mutex::new(None),
            last_answer: AtomicU64::new(0),
            suspect: AtomicU64::new(0),
            epoch: Instant::now(),
            began: Notify::new(),
        }
    }
}

impl Health {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Outage>> {
        // A panicked holder leaves counts still worth reporting.
        self.outage.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn ms(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.epoch).as_millis() as u64 + 1
    }

    /// Whether an outage is known now.
    pub(super) fn is_down(&self) -> bool {
        self.down.load(Ordering::Acquire)
    }

    /// A round trip or a connection answered: the server is there. Ends a
    /// known outage (one info line).
    pub(super) fn answered(&self) {
        self.last_answer
            .fetch_max(self.ms(Instant::now()), Ordering::Relaxed);
        if !self.is_down() {
            return;
        }
        let ended = {
            let mut outage = self.lock();
            self.down.store(false, Ordering::Release);
            outage.take()
        };
        if let Some(o) = ended {
            tracing::info!(
                kind = "database outage",
                down_for_seconds = o.started.elapsed().as_secs(),
                refused = o.refused,
                failed = o.failed,
                first_error = %o.first_error,
                "PostgreSQL reachable again after {}; {} ledger call(s) were refused at once meanwhile (nothing sent), {} round trip(s) failed",
                render(o.started.elapsed()),
                o.refused,
                o.failed
            );
        }
    }

    /// A round trip failed (its connection lost, or no answer in time):
    /// counted in a known outage; alone it says nothing about the server.
    pub(super) fn failed(&self) {
        if self.is_down()
            && let Some(o) = self.lock().as_mut()
        {
            o.failed += 1;
            o.failed_now += 1;
        }
    }

    /// A connection attempt begun at `started` failed. `unreachable`: the
    /// failure was the way to the server (refused, reset, unreachable, or
    /// silent for the whole connect bound), not an answer of the server's. The
    /// second such failure in a row, with nothing answered since the first
    /// began, begins an outage (one warn line).
    pub(super) fn connect_failed(
        &self,
        started: Instant,
        unreachable: bool,
        error: &dyn std::fmt::Display,
    ) {
        let last_answer = self.last_answer.load(Ordering::Relaxed);
        if !unreachable || last_answer >= self.ms(started) {
            self.failed();
            return;
        }
        let mut outage = self.lock();
        if let Some(o) = outage.as_mut() {
            o.failed += 1;
            o.failed_now += 1;
            return;
        }
        let first = self.suspect.load(Ordering::Relaxed);
        if first == 0 || last_answer >= first {
            // The first of a row: suspected, not known yet.
            self.suspect.store(self.ms(started), Ordering::Relaxed);
            return;
        }
        self.suspect.store(0, Ordering::Relaxed);
        let o = Outage {
            since: SystemTime::now(),
            started: Instant::now(),
            first_error: error.to_string(),
            refused: 0,
            refused_now: 0,
            failed: 1,
            failed_now: 1,
        };
        tracing::warn!(
            kind = "database outage",
            since = %humantime::format_rfc3339_seconds(o.since),
            first_error = %o.first_error,
            "PostgreSQL unreachable since {} ({}); ledger writes not yet sent and new connections are refused at once (DATABASE_UNAVAILABLE, nothing recorded) until a connection succeeds again, tried every {} ms",
            humantime::format_rfc3339_seconds(o.since),
            o.first_error,
            PROBE_PAUSE.as_millis()
        );
        *outage = Some(o);
        self.down.store(true, Ordering::Release);
        drop(outage);
        self.began.notify_one();
    }

    /// `None` while the server is not known to be away; else the failure
    /// that refuses `what` at once, counted. Nothing of `what` is sent.
    pub(super) fn refuse(&self, what: &'static str) -> Option<StoreError> {
        if !self.is_down() {
            return None;
        }
        let mut outage = self.lock();
        let o = outage.as_mut()?;
        o.refused += 1;
        o.refused_now += 1;
        Some(StoreError::database(
            what,
            DbFailure::Unavailable,
            format!(
                "PostgreSQL unreachable since {} ({}); not sent",
                humantime::format_rfc3339_seconds(o.since),
                o.first_error
            ),
        ))
    }

    /// While an outage lasts, one warn line per `SUMMARY_INTERVAL` that
    /// sums it up; nothing when none is known.
    fn summarize(&self) {
        let mut outage = self.lock();
        let Some(o) = outage.as_mut() else { return };
        let (refused, failed) = (o.refused_now, o.failed_now);
        (o.refused_now, o.failed_now) = (0, 0);
        tracing::warn!(
            kind = "database outage",
            down_for_seconds = o.started.elapsed().as_secs(),
            refused,
            failed,
            first_error = %o.first_error,
            "PostgreSQL unreachable for {}: {refused} ledger call(s) refused at once, {failed} round trip(s) failed in the last {}",
            render(o.started.elapsed()),
            render(SUMMARY_INTERVAL)
        );
    }

    /// Until `stop`: while an outage is known, opens a connection every
    /// `PROBE_PAUSE` (bounded by `bounds.connect`) to learn when it ends,
    /// and sums it up every `SUMMARY_INTERVAL`.
    pub(super) async fn probe(
        self: std::sync::Arc<Self>,
        options: PgConnectOptions,
        bounds: Bounds,
        stop: CancellationToken,
    ) {
        loop {
            let began = self.began.notified();
            tokio::pin!(began);
            // Registered before the check: an outage that begins between
            // the check and the wait is not missed.
            began.as_mut().enable();
            if !self.is_down() {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = began => {}
                }
            }
            let mut next_summary = Instant::now() + SUMMARY_INTERVAL;
            while self.is_down() {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(PROBE_PAUSE) => {}
                }
                if Instant::now() >= next_summary {
                    self.summarize();
                    next_summary += SUMMARY_INTERVAL;
                }
                let attempt =
                    tokio::time::timeout(bounds.connect, PgConnection::connect_with(&options));
                match attempt.await {
                    Ok(Ok(conn)) => {
                        self.answered();
                        // The probe's answer is in; its goodbye changes
                        // nothing of it.
                        drop(tokio::time::timeout(bounds.ping(), conn.close()).await);
                    }
                    // The probe's own tries are not counted: the summary
                    // says what the outage cost the service's work.
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "probing PostgreSQL: no connection yet")
                    }
                    Err(_) => tracing::debug!(
                        "probing PostgreSQL: no connection within {} ms",
                        bounds.connect.as_millis()
                    ),
                }
            }
        }
    }
}

/// Whether a failure to connect was the way to the server (refused,
/// reset, unreachable), not an answer of the server's (a full server, a
/// wrong password) or a mistake of ours (TLS, the URL).
pub(super) fn is_unreachable(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Io(_))
}

/// Whether a connection attempt that got no answer for `waited` says the
/// server is silent: only one that waited the whole connect bound
/// (`bound`, the round-trip bound). A server that answers within it is
/// healthy, however slowly; an attempt its caller's deadline cut shorter
/// says nothing.
pub(super) fn waited_silent(waited: Duration, bound: Duration) -> bool {
    waited >= bound
}

fn render(d: Duration) -> String {
    humantime::format_duration(Duration::from_secs(d.as_secs().max(1))).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_is_known_only_when_connecting_failed_twice_and_nothing_answered_since() {
        let h = Health::default();
        let before = Instant::now();
        h.answered();
        // Begun before the last answer: says nothing of now.
        h.connect_failed(before, true, &"connection refused");
        assert!(!h.is_down());
        // An answer of the server's (it is there): no outage.
        h.connect_failed(Instant::now(), false, &"too many connections");
        assert!(!h.is_down());
        assert!(h.refuse("writing").is_none());
        std::thread::sleep(Duration::from_millis(5));
        // One connection that failed: suspected only (the next may work).
        h.connect_failed(Instant::now(), true, &"connection reset");
        assert!(!h.is_down());
        std::thread::sleep(Duration::from_millis(5));
        h.answered();
        std::thread::sleep(Duration::from_millis(5));
        h.connect_failed(Instant::now(), true, &"connection refused");
        assert!(!h.is_down(), "an answer in between: a new row");
        h.connect_failed(Instant::now(), true, &"connection refused");
        assert!(h.is_down());
        let refused = h.refuse("writing to the ledger").expect("refused");
        assert!(!refused.may_have_written(), "{refused:?}");
        assert!(refused.is_transient(), "{refused:?}");
        assert!(
            refused.to_string().contains("connection refused"),
            "{refused}"
        );
        h.failed();
        assert_eq!(
            h.lock().as_ref().map(|o| (o.refused, o.failed)),
            Some((1, 2))
        );
        h.answered();
        assert!(!h.is_down());
        assert!(h.refuse("writing").is_none());
    }
}
