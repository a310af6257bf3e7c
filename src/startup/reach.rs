//! Whether something the service stands on (Nova, the database) answers,
//! followed edge by edge: one warn line when it stops answering ("Nova
//! unreachable since <time> (<first error>)"), one info line when it
//! answers again ("Nova reachable again after <duration>, N requests
//! failed"), and nothing in between; per-request detail stays at debug, in
//! the reconcile log and in the metrics.
//!
//! The hot path (an answer while all is well) is two atomic operations;
//! the lock is taken only around an outage.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

/// An outage in progress.
struct Outage {
    since: SystemTime,
    started: Instant,
    first_error: String,
    /// Requests that failed since it began (the one that began it too).
    failed: u64,
}

/// What a [`Reach`] was told last, and the outage it is in, if any.
pub struct Reach {
    /// `Nova`, `database`: the subject of its log lines.
    what: &'static str,
    /// Set while an outage is open: an answer takes the lock only then.
    down: AtomicBool,
    outage: Mutex<Option<Outage>>,
    /// When it was last heard of, answer or failure (ms since `epoch`).
    last_heard: AtomicU64,
    /// When it last answered (Unix ms; 0: never), for the outage's line:
    /// the outage is noticed at a failure, which may come well after (a
    /// hung Nova is noticed when the probe's bound runs out).
    last_answer: AtomicU64,
    epoch: Instant,
    /// What failed during an outage is counted as: `request`, `round trip`.
    noun: &'static str,
}

impl Reach {
    pub fn new(what: &'static str, noun: &'static str) -> Self {
        Self {
            what,
            down: AtomicBool::new(false),
            outage: Mutex::new(None),
            last_heard: AtomicU64::new(0),
            last_answer: AtomicU64::new(0),
            epoch: Instant::now(),
            noun,
        }
    }

    fn heard(&self) {
        let ms = self.epoch.elapsed().as_millis() as u64;
        self.last_heard.store(ms.max(1), Ordering::Relaxed);
    }

    /// Whether anything was heard (answer or failure) within `within`.
    pub fn heard_within(&self, within: Duration) -> bool {
        let last = self.last_heard.load(Ordering::Relaxed);
        last != 0
            && (self.epoch.elapsed().as_millis() as u64).saturating_sub(last)
                < within.as_millis() as u64
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Outage>> {
        // A panicked holder leaves a state still worth reporting.
        self.outage.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// It answered: ends an outage (one info line).
    pub fn answered(&self) {
        self.heard();
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        self.last_answer
            .store(now.as_millis() as u64, Ordering::Relaxed);
        if !self.down.load(Ordering::Acquire) {
            return;
        }
        let ended = {
            let mut outage = self.lock();
            self.down.store(false, Ordering::Release);
            outage.take()
        };
        if let Some(o) = ended {
            tracing::info!(
                down_for_seconds = o.started.elapsed().as_secs(),
                failed = o.failed,
                first_error = %o.first_error,
                "{} reachable again after {}, {} {}(s) failed",
                self.what,
                render(o.started.elapsed()),
                o.failed,
                self.noun
            );
        }
    }

    /// It could not be reached: begins an outage (one warn line) or counts
    /// one more failure in it.
    pub fn unreachable(&self, error: &dyn std::fmt::Display) {
        self.heard();
        let mut outage = self.lock();
        match outage.as_mut() {
            Some(o) => o.failed += 1,
            None => {
                let o = Outage {
                    since: SystemTime::now(),
                    started: Instant::now(),
                    first_error: error.to_string(),
                    failed: 1,
                };
                self.down.store(true, Ordering::Release);
                let last = match self.last_answer.load(Ordering::Relaxed) {
                    0 => "never".to_string(),
                    ms => humantime::format_rfc3339_seconds(
                        SystemTime::UNIX_EPOCH + Duration::from_millis(ms),
                    )
                    .to_string(),
                };
                tracing::warn!(
                    since = %humantime::format_rfc3339_seconds(o.since),
                    last_answer = %last,
                    first_error = %o.first_error,
                    "{} unreachable since {} (last answer: {last}) ({})",
                    self.what,
                    humantime::format_rfc3339_seconds(o.since),
                    o.first_error
                );
                *outage = Some(o);
            }
        }
    }

    /// A request failed in a way that says nothing sure about reachability
    /// (sent, then timed out): counted in an open outage, else nothing.
    pub fn failed(&self) {
        if self.down.load(Ordering::Acquire)
            && let Some(o) = self.lock().as_mut()
        {
            o.failed += 1;
        }
    }

    /// How long the open outage has lasted, and its first error.
    pub fn down_for(&self) -> Option<(Duration, String)> {
        if !self.down.load(Ordering::Acquire) {
            return None;
        }
        self.lock()
            .as_ref()
            .map(|o| (o.started.elapsed(), o.first_error.clone()))
    }
}

/// A duration as an operator reads it: whole seconds (`42s`, `3m 5s`).
pub fn render(d: Duration) -> String {
    humantime::format_duration(Duration::from_secs(d.as_secs().max(1))).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_outage_is_one_change_each_way_and_counts_its_failures() {
        let reach = Reach::new("Nova", "request");
        assert!(!reach.heard_within(Duration::from_secs(60)));
        reach.answered();
        assert!(reach.heard_within(Duration::from_secs(60)));
        for _ in 0..5 {
            reach.unreachable(&"connection refused");
        }
        reach.failed();
        let (_, first) = reach.down_for().expect("down");
        assert_eq!(first, "connection refused");
        assert_eq!(reach.lock().as_ref().map(|o| o.failed), Some(6));
        reach.answered();
        reach.answered();
        assert!(reach.down_for().is_none());
        reach.failed();
        assert!(
            reach.down_for().is_none(),
            "a failure that says nothing opens no outage"
        );
    }
}
