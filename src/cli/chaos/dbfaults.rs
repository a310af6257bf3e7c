//! Database faults of a chaos run: each replica reaches PostgreSQL
//! through a fault proxy of its own (`sim::netfault`), so a fault can hit
//! one replica's connections or every replica's; and when chaos runs the
//! server itself (`postgres.rs`), the server can crash and restart.
//!
//! Histories play their faults here (`history::DbFault`, drawn from their
//! seed), a replica frozen (`Cluster::freeze`) among them: to the
//! checker, a frozen replica is one cut off from the database for as long;
//! a slow database is not cut off (its replies come, late: `SLOW`). Histories run concurrently and the faults are the run's, not one
//! history's: they overlap, so each proxy counts the faults holding it
//! (a connection goes quiet again only when the last silence on it ends),
//! and a crash while another is under way is skipped, as is (by default,
//! `Shape::db_slow_quiet`) a slow database while another is under way or
//! ended less than 30 s ago: else the run's many histories would keep the
//! database slow from start to end, and no operation would ever meet the
//! quiet stretch in which `decided-in-time` holds it to be decided. Every fault is
//! logged with its instants (`DbOutage`), which the checker reads for
//! every history, as it reads the replicas killed.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};

use super::cluster::Cluster;
use super::history::DbFault;
use super::postgres::{Crash, OwnPostgres};
use crate::sim::netfault::{FaultProxy, NewConns};

/// One database fault as it happened.
#[derive(Debug, Clone)]
pub struct DbOutage {
    /// The replica whose connections it hit; `None`: every replica's (the
    /// server crashed, or every proxy was faulted).
    pub replica: Option<String>,
    pub what: &'static str,
    pub from: DateTime<Utc>,
    /// When it ended (the server accepted connections again, the proxy
    /// forwarded again); `None` while it lasts.
    pub to: Option<DateTime<Utc>>,
    /// A slow database's reply latency (`SLOW`); `None` for the faults
    /// that cut the replicas off.
    pub latency: Option<Duration>,
}

/// What a slow database is logged as (`DbOutage::what`).
pub const SLOW: &str = "database slow";

impl DbOutage {
    /// Whether it hit the connections of `replica`.
    pub fn hits(&self, replica: &str) -> bool {
        self.replica.as_deref().is_none_or(|r| r == replica)
    }

    /// Whether it cut its replicas off (every fault but a slow database,
    /// whose replies still come).
    pub fn cuts_off(&self) -> bool {
        self.latency.is_none()
    }

    /// Its end, or `now` while it lasts.
    pub fn until(&self, now: DateTime<Utc>) -> DateTime<Utc> {
        self.to.unwrap_or(now)
    }

    /// Whether it lasted into `[from, to]` (its end widened by `tail`).
    pub fn overlaps(&self, from: DateTime<Utc>, to: DateTime<Utc>, tail: chrono::Duration) -> bool {
        self.from <= to && self.until(Utc::now()) + tail >= from
    }
}

/// What holds one proxy's connections now.
#[derive(Default)]
struct Held {
    /// Silences of its open connections (the open-and-new ones too).
    silent: u32,
    /// Silences of new connections.
    silent_new: u32,
    /// Refusals of new connections.
    refused: u32,
    /// The reply latencies of the slow faults on it (the longest holds).
    slow: Vec<Duration>,
}

struct Proxy {
    replica: String,
    proxy: FaultProxy,
    held: Held,
}

pub struct DbFaults {
    proxies: Mutex<Vec<Proxy>>,
    /// The server, when it is chaos's own (crashes need it).
    server: Option<Arc<OwnPostgres>>,
    crashing: Mutex<bool>,
    /// The quiet stretch between two slow databases (`None`: they may
    /// overlap), and when the next may begin (`None`: now; the far future
    /// while one is under way).
    slow_quiet: Option<Duration>,
    slow_from: Mutex<Option<tokio::time::Instant>>,
    /// The replicas frozen now (a second freeze of one is skipped: its
    /// holding tasks would wait behind the first's).
    frozen: Mutex<std::collections::BTreeSet<usize>>,
    log: Mutex<Vec<DbOutage>>,
    /// Faults played, by kind (and those skipped).
    counts: Mutex<BTreeMap<String, u64>>,
}

/// How long a crashed server may take to accept connections again.
const RESTART_WITHIN: Duration = Duration::from_secs(60);

impl DbFaults {
    /// A proxy to `url` for each of `replicas`; the URLs the replicas use.
    pub async fn start(
        url: &str,
        replicas: &[String],
        server: Option<Arc<OwnPostgres>>,
        slow_quiet: Option<Duration>,
    ) -> anyhow::Result<(DbFaults, Vec<String>)> {
        let mut proxies = Vec::new();
        let mut urls = Vec::new();
        for name in replicas {
            let (proxy, through) = FaultProxy::for_url(url)
                .await
                .map_err(|e| anyhow::anyhow!("a fault proxy for {name}: {e}"))?;
            proxies.push(Proxy {
                replica: name.clone(),
                proxy,
                held: Held::default(),
            });
            urls.push(through);
        }
        Ok((
            DbFaults {
                proxies: Mutex::new(proxies),
                server,
                crashing: Mutex::new(false),
                slow_quiet,
                slow_from: Mutex::new(None),
                frozen: Mutex::new(std::collections::BTreeSet::new()),
                log: Mutex::new(Vec::new()),
                counts: Mutex::new(BTreeMap::new()),
            },
            urls,
        ))
    }

    /// Whether the server can be crashed (it is chaos's own).
    pub fn can_crash(&self) -> bool {
        self.server.is_some()
    }

    /// Every fault so far, with its instants.
    pub fn outages(&self) -> Vec<DbOutage> {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Faults played (and skipped), by kind.
    pub fn counts(&self) -> BTreeMap<String, u64> {
        self.counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn count(&self, what: &str) {
        *self
            .counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(what.to_string())
            .or_default() += 1;
    }

    fn begin(&self, replica: Option<String>, what: &'static str) -> usize {
        self.begin_with(replica, what, None)
    }

    fn begin_with(
        &self,
        replica: Option<String>,
        what: &'static str,
        latency: Option<Duration>,
    ) -> usize {
        self.count(what);
        let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        log.push(DbOutage {
            replica,
            what,
            from: Utc::now(),
            to: None,
            latency,
        });
        log.len() - 1
    }

    /// Begins (`on`) or ends a slow fault of `latency` on the proxies
    /// `which`; each replies as slowly as the slowest fault on it says
    /// (slow faults of histories played at once overlap).
    fn slow(&self, which: &[usize], latency: Duration, on: bool) {
        let mut proxies = self.proxies.lock().unwrap_or_else(|p| p.into_inner());
        for &i in which {
            let Some(p) = proxies.get_mut(i) else {
                continue;
            };
            if on {
                p.held.slow.push(latency);
            } else if let Some(at) = p.held.slow.iter().position(|l| *l == latency) {
                p.held.slow.swap_remove(at);
            }
            let now = p.held.slow.iter().max().copied().unwrap_or_default();
            p.proxy.set_reply_latency(now);
        }
    }

    fn end(&self, i: usize) {
        if let Some(o) = self
            .log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(i)
        {
            o.to = Some(Utc::now());
        }
    }

    /// The proxies a fault on `replica` hits (all of them for `None`), by
    /// index; the name it is logged under.
    fn targets(&self, replica: Option<usize>) -> (Vec<usize>, Option<String>) {
        let proxies = self.proxies.lock().unwrap_or_else(|p| p.into_inner());
        match replica {
            Some(r) if !proxies.is_empty() => {
                let i = r % proxies.len();
                (vec![i], Some(proxies[i].replica.clone()))
            }
            _ => ((0..proxies.len()).collect(), None),
        }
    }

    fn each(&self, which: &[usize], f: impl Fn(&FaultProxy)) {
        let proxies = self.proxies.lock().unwrap_or_else(|p| p.into_inner());
        for &i in which {
            if let Some(p) = proxies.get(i) {
                f(&p.proxy);
            }
        }
    }

    /// Changes what holds the proxies `which`, and makes them do what
    /// holds them now: new connections refused while a refusal holds,
    /// silent while a silence of new ones does; open connections silent
    /// until no silence holds.
    fn hold(&self, which: &[usize], change: impl Fn(&mut Held), silence_open: bool) {
        let mut proxies = self.proxies.lock().unwrap_or_else(|p| p.into_inner());
        for &i in which {
            let Some(p) = proxies.get_mut(i) else {
                continue;
            };
            change(&mut p.held);
            if silence_open {
                p.proxy.silence_open();
            } else if p.held.silent == 0 {
                // Forwards again (what the silent ones held is delivered).
                p.proxy.resume();
            }
            p.proxy.set_new(if p.held.refused > 0 {
                NewConns::Refuse
            } else if p.held.silent_new > 0 {
                NewConns::Silent
            } else {
                NewConns::Pass
            });
        }
    }

    /// Plays one fault to its end (a freeze on `cluster`'s replica).
    /// Long on purpose: one arm per kind of fault, each the whole of it
    /// (start, hold, end), so that the kinds read side by side.
    pub async fn play(&self, fault: &DbFault, cluster: &Cluster) {
        match *fault {
            DbFault::Freeze { replica, ms } => {
                let (which, name) = self.targets(Some(replica));
                let Some(&r) = which.first() else { return };
                if !self
                    .frozen
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(r)
                {
                    self.count("replica freeze skipped (frozen already)");
                    return;
                }
                let i = self.begin(name, "replica frozen");
                if !cluster.freeze(r, Duration::from_millis(ms)).await {
                    self.count("replica frozen in part (down, or a worker busy)");
                }
                self.end(i);
                self.frozen
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&r);
            }
            DbFault::HoldReplies { replica, ms } => {
                let (which, name) = self.targets(Some(replica));
                let i = self.begin(name, "database replies held");
                self.each(&which, |p| p.hold_replies(true));
                tokio::time::sleep(Duration::from_millis(ms)).await;
                self.each(&which, |p| p.hold_replies(false));
                self.end(i);
            }
            DbFault::Silent {
                replica,
                new_too,
                ms,
            } => {
                let (which, name) = self.targets(Some(replica));
                let what = if new_too {
                    "silent connections (open and new)"
                } else {
                    "silent connections (open)"
                };
                let i = self.begin(name, what);
                self.hold(
                    &which,
                    |h| {
                        h.silent += 1;
                        h.silent_new += u32::from(new_too);
                    },
                    true,
                );
                tokio::time::sleep(Duration::from_millis(ms)).await;
                self.hold(
                    &which,
                    |h| {
                        h.silent = h.silent.saturating_sub(1);
                        h.silent_new = h.silent_new.saturating_sub(u32::from(new_too));
                    },
                    false,
                );
                self.end(i);
            }
            DbFault::Reset {
                replica,
                times,
                every_ms,
            } => {
                let (which, name) = self.targets(replica);
                let i = self.begin(name, "connections reset");
                for n in 0..times {
                    if n > 0 {
                        tokio::time::sleep(Duration::from_millis(every_ms)).await;
                    }
                    let proxies = self.proxies.lock().unwrap_or_else(|p| p.into_inner());
                    for &p in &which {
                        if let Some(p) = proxies.get(p) {
                            p.proxy.reset_open();
                        }
                    }
                }
                self.end(i);
            }
            DbFault::Refused {
                replica,
                ms,
                reset_open,
            } => {
                let (which, name) = self.targets(replica);
                let i = self.begin(name, "new connections refused");
                self.hold(&which, |h| h.refused += 1, false);
                if reset_open {
                    let proxies = self.proxies.lock().unwrap_or_else(|p| p.into_inner());
                    for &p in &which {
                        if let Some(p) = proxies.get(p) {
                            p.proxy.reset_open();
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(ms)).await;
                self.hold(&which, |h| h.refused = h.refused.saturating_sub(1), false);
                self.end(i);
            }
            DbFault::Slow {
                replica,
                latency_ms,
                ms,
            } => {
                if !self.slow_may_begin() {
                    self.count("database slow skipped (another under way, or too recent)");
                    return;
                }
                let (which, name) = self.targets(replica);
                let latency = Duration::from_millis(latency_ms);
                let i = self.begin_with(name, SLOW, Some(latency));
                self.slow(&which, latency, true);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                self.slow(&which, latency, false);
                self.end(i);
                if let Some(quiet) = self.slow_quiet {
                    *self.slow_from.lock().unwrap_or_else(|p| p.into_inner()) =
                        Some(tokio::time::Instant::now() + quiet);
                }
            }
            DbFault::Crash { kill, pause_ms } => self.crash(kill, pause_ms).await,
        }
    }

    /// Takes the slow database's turn when it is free (`slow_quiet`).
    fn slow_may_begin(&self) -> bool {
        if self.slow_quiet.is_none() {
            return true;
        }
        let mut from = self.slow_from.lock().unwrap_or_else(|p| p.into_inner());
        let now = tokio::time::Instant::now();
        if from.is_some_and(|f| now < f) {
            return false;
        }
        // Under way: nobody else's turn until it ends and sets the next.
        *from = Some(now + Duration::from_secs(24 * 3600));
        true
    }

    async fn crash(&self, kill: bool, pause_ms: u64) {
        let Some(server) = &self.server else {
            self.count("PostgreSQL crash skipped (not chaos's own server)");
            return;
        };
        {
            let mut crashing = self.crashing.lock().unwrap_or_else(|p| p.into_inner());
            if *crashing {
                drop(crashing);
                self.count("PostgreSQL crash skipped (another under way)");
                return;
            }
            *crashing = true;
        }
        let (how, what) = if kill {
            (Crash::Kill, "PostgreSQL killed (SIGKILL)")
        } else {
            (Crash::Immediate, "PostgreSQL stopped (immediate)")
        };
        let i = self.begin(None, what);
        server.crash(how).await;
        tokio::time::sleep(Duration::from_millis(pause_ms)).await;
        if let Err(e) = server.up(RESTART_WITHIN).await {
            // The run cannot go on meaningfully; every later history
            // shows it (decided-in-time), and the log says why.
            tracing::error!(error = %e, "chaos: PostgreSQL did not come back");
            self.count("PostgreSQL restart failed");
        }
        self.end(i);
        *self.crashing.lock().unwrap_or_else(|p| p.into_inner()) = false;
    }
}
