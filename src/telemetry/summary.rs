//! Failures and drift logged in proportion: each is a debug line where it
//! happens (its detail is in the operation's reconcile log too), and one
//! warn line per kind per interval sums them up: how many, the first
//! error (or drift), how many distinct targets (servers). An outage of
//! Nova under load is then a few lines a minute, not one per retry, and a
//! cloud that lost its attachments one line, not one per operation.

use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Distinct targets remembered per window, at most: past it the count
/// still grows, the set does not (a bound on memory in a long outage).
const MAX_TARGETS: usize = 1024;

/// How often the summaries are written by default.
pub const SUMMARY_INTERVAL: Duration = Duration::from_secs(10);

/// The kind of a decision found drifted by its verification (noted with
/// its server and a detail naming the operation): summed up as drift, not
/// as a failure.
pub const DRIFT: &str = "drift";

#[derive(Default)]
struct Window {
    count: u64,
    first_error: String,
    targets: HashSet<String>,
    targets_overflowed: bool,
}

/// The failures of each kind since the last summary.
#[derive(Default)]
pub struct Summaries {
    kinds: Mutex<BTreeMap<&'static str, Window>>,
}

impl Summaries {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<&'static str, Window>> {
        // A panicked holder leaves counts still worth writing.
        self.kinds.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One failure of `kind` (e.g. `"Nova request"`) against `target`, or
    /// one drift ([`DRIFT`]) on a server.
    pub fn note(
        &self,
        kind: &'static str,
        target: &dyn std::fmt::Display,
        error: &dyn std::fmt::Display,
    ) {
        let mut kinds = self.lock();
        let w = kinds.entry(kind).or_default();
        if w.count == 0 {
            w.first_error = error.to_string();
        }
        w.count += 1;
        if w.targets.len() < MAX_TARGETS {
            w.targets.insert(target.to_string());
        } else {
            w.targets_overflowed = true;
        }
    }

    /// Writes one warn line per kind that failed since the last call, and
    /// starts again; returns how many lines it wrote.
    pub fn flush(&self, over: Duration) -> usize {
        let taken = std::mem::take(&mut *self.lock());
        let mut written = 0;
        for (kind, w) in taken.into_iter().filter(|(_, w)| w.count > 0) {
            let targets = w.targets.len();
            let more = if w.targets_overflowed { "+" } else { "" };
            if kind == DRIFT {
                tracing::warn!(
                    kind,
                    count = w.count,
                    targets,
                    first = %w.first_error,
                    "{} operation(s) drifted in the last {} on {targets}{more} server(s) (ops list --drifted); the first: {}",
                    w.count,
                    crate::domain::parse::render_duration(over),
                    w.first_error
                );
                written += 1;
                continue;
            }
            tracing::warn!(
                kind,
                count = w.count,
                targets,
                first_error = %w.first_error,
                "{} {kind}(s) failed in the last {} against {targets}{more} target(s); the first: {}",
                w.count,
                crate::domain::parse::render_duration(over),
                w.first_error
            );
            written += 1;
        }
        written
    }

    /// Flushes every `interval` until `stop`, then once more.
    pub async fn run(&self, interval: Duration, stop: CancellationToken) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick is at once: nothing to write yet.
        tick.tick().await;
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            self.flush(interval);
        }
        self.flush(interval);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_kind_counting_failures_and_distinct_targets() {
        let s = Summaries::default();
        for i in 0..50 {
            s.note("Nova request", &(i % 3), &format!("refused {i}"));
        }
        s.note("verification look", &"a", &"timed out");
        s.note(DRIFT, &"a", &"operation 1: decided succeeded but ...");
        s.note(DRIFT, &"b", &"operation 2: decided succeeded but ...");
        {
            let kinds = s.lock();
            let nova = &kinds["Nova request"];
            assert_eq!((nova.count, nova.targets.len()), (50, 3));
            assert_eq!(nova.first_error, "refused 0");
            let drift = &kinds[DRIFT];
            assert_eq!((drift.count, drift.targets.len()), (2, 2));
        }
        assert_eq!(s.flush(SUMMARY_INTERVAL), 3);
        assert_eq!(s.flush(SUMMARY_INTERVAL), 0, "nothing new: no line");
    }
}
