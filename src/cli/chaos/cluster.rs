//! The replicas a chaos run drives: each `serve` replica built exactly as
//! `main` builds it, in a runtime of its own, so that killing it is what
//! kill -9 is to a process: its tasks stop where they are, its database
//! connections drop, nothing is handed over. Freezing it is what SIGSTOP
//! then SIGCONT are: every worker thread of its runtime is held, so none
//! of its tasks (executor runs, heartbeat, reconciler, gRPC) is polled and
//! none of its timers fires, while its sockets stay open and the kernel
//! keeps taking in what arrives; on release, the monotonic clock has moved
//! on by the pause, as it has for a stopped process.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::ServeArgs;
use crate::startup::Application;
use crate::store::Store;

/// The callers a run uses: orchestrators `c0`, `c1`, ... and an operator.
pub const OPERATOR: &str = "chaos-operator";

pub fn caller_name(client: usize) -> String {
    format!("c{client}")
}

/// Replica `i`'s name (its `--replica-id`).
pub fn replica_name(i: usize) -> String {
    format!("chaos-{i}")
}

/// The worker threads of a replica's runtime (all held by a freeze).
const WORKERS: usize = 2;

/// How long a freeze waits for every worker to be held: a worker busy in
/// a long poll takes the holding task from the runtime's queue after it.
const FREEZE_TAKES_HOLD_WITHIN: Duration = Duration::from_secs(5);

/// The workers a freeze holds, and whether it still holds them.
#[derive(Default)]
struct FreezeGate {
    state: std::sync::Mutex<(usize, bool)>,
    changed: std::sync::Condvar,
}

impl FreezeGate {
    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, bool)> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Holds the calling worker thread until the freeze ends.
    fn hold(&self) {
        let mut s = self.lock();
        s.0 += 1;
        self.changed.notify_all();
        while s.1 {
            s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Waits (blocking) until `n` workers are held, or `within` passed;
    /// how many are.
    fn wait_held(&self, n: usize, within: Duration) -> usize {
        let mut s = self.lock();
        let until = std::time::Instant::now() + within;
        while s.0 < n {
            let left = until.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            s = self
                .changed
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        s.0
    }

    fn release(&self) {
        self.lock().1 = false;
        self.changed.notify_all();
    }
}

/// Ends a freeze however its waiter ends (dropped mid-sleep too): a
/// runtime left held would never run again.
struct Thaw(Arc<FreezeGate>);

impl Drop for Thaw {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// How long a replica may take to start: its wait for the database
/// (`--db-connect-timeout`, 60 s) and its migrations, with room to spare.
const START_WITHIN: Duration = Duration::from_secs(90);

pub fn token_of(caller: &str) -> String {
    format!("chaos-token-{caller}")
}

/// How the replicas are set up.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// The replicas' database (see `Cluster::start_each` for a URL of
    /// each replica's own).
    pub database_url: String,
    pub nova_url: String,
    /// The simulator's Cinder: the replicas confirm with it, as a cloud's
    /// catalog would have them do.
    pub cinder_url: String,
    pub replicas: usize,
    pub clients: usize,
    /// Each replica's clock skew (missing: none).
    pub skews: Vec<chrono::Duration>,
    /// Further `serve` flags for every replica (they win over the run's).
    pub extra_args: Vec<String>,
}

struct Replica {
    name: String,
    skew: chrono::Duration,
    grpc_url: Option<String>,
    runtime: Option<tokio::runtime::Runtime>,
    stop: CancellationToken,
    run: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    /// The replica's own store (the embedded one cannot be opened twice).
    store: Option<Arc<dyn Store>>,
}

/// The running replicas.
pub struct Cluster {
    cfg: ClusterConfig,
    /// Each replica's own database URL (through its fault proxy), where
    /// it has one.
    urls: Vec<String>,
    replicas: Mutex<Vec<Replica>>,
}

impl Drop for Cluster {
    /// Whatever still runs stops at once (a runtime may not be dropped, and
    /// so waited for, inside an asynchronous context).
    fn drop(&mut self) {
        let replicas = self.replicas.get_mut().unwrap_or_else(|p| p.into_inner());
        for r in replicas.iter_mut() {
            if let Some(rt) = r.runtime.take() {
                rt.shutdown_background();
            }
        }
    }
}

impl Cluster {
    pub async fn start(cfg: ClusterConfig) -> anyhow::Result<Cluster> {
        Self::start_each(cfg, Vec::new()).await
    }

    /// As `start`, replica `i` reaching the database at `urls[i]` (its own
    /// fault proxy) rather than `cfg.database_url`.
    pub async fn start_each(cfg: ClusterConfig, urls: Vec<String>) -> anyhow::Result<Cluster> {
        let mut replicas = Vec::new();
        for i in 0..cfg.replicas {
            let skew = cfg.skews.get(i).copied().unwrap_or_default();
            replicas.push(Replica {
                name: replica_name(i),
                skew,
                grpc_url: None,
                runtime: None,
                stop: CancellationToken::new(),
                run: None,
                store: None,
            });
        }
        let cluster = Cluster {
            cfg,
            urls,
            replicas: Mutex::new(replicas),
        };
        for i in 0..cluster.cfg.replicas {
            cluster.restart(i).await?;
        }
        Ok(cluster)
    }

    fn replicas(&self) -> std::sync::MutexGuard<'_, Vec<Replica>> {
        self.replicas.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The gRPC URLs of the replicas that are up.
    pub fn live(&self) -> Vec<String> {
        self.replicas()
            .iter()
            .filter_map(|r| r.grpc_url.clone())
            .collect()
    }

    /// The replicas that are up: name and gRPC URL.
    pub fn live_named(&self) -> Vec<(String, String)> {
        self.replicas()
            .iter()
            .filter_map(|r| r.grpc_url.clone().map(|u| (r.name.clone(), u)))
            .collect()
    }

    pub fn len(&self) -> usize {
        self.cfg.replicas
    }

    pub fn is_empty(&self) -> bool {
        self.cfg.replicas == 0
    }

    pub fn is_up(&self, i: usize) -> bool {
        self.replicas().get(i).is_some_and(|r| r.grpc_url.is_some())
    }

    pub fn name(&self, i: usize) -> String {
        self.replicas()
            .get(i)
            .map(|r| r.name.clone())
            .unwrap_or_default()
    }

    fn args(&self, i: usize, name: &str, skew: chrono::Duration) -> Vec<String> {
        let database_url = self.urls.get(i).unwrap_or(&self.cfg.database_url).clone();
        let tokens: Vec<String> = (0..self.cfg.clients)
            .map(caller_name)
            .map(|c| {
                format!(
                    "{c}:orchestrator:{}",
                    crate::grpc::auth::sha256_hex(&token_of(&c))
                )
            })
            .chain(std::iter::once(format!(
                "{OPERATOR}:operator:{}",
                crate::grpc::auth::sha256_hex(&token_of(OPERATOR))
            )))
            .collect();
        let skew = if skew < chrono::Duration::zero() {
            format!("-{}s", -skew.num_seconds())
        } else {
            format!("{}s", skew.num_seconds())
        };
        let mut args: Vec<String> = [
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--database-url",
            &database_url,
            "--nova-url",
            &self.cfg.nova_url,
            "--cinder-url",
            &self.cfg.cinder_url,
            "--replica-id",
            name,
            "--shutdown-delay",
            "0s",
            "--drain-timeout",
            "2s",
            // The default: the ledger writers as shipped (two per kind).
            "--db-max-connections",
            "16",
            "--auth-tokens",
            &tokens.join(","),
            // One argument: a value that starts with '-' would read as a flag.
            &format!("--clock-skew={skew}"),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(self.cfg.extra_args.iter().cloned());
        args
    }

    /// Starts replica `i` (again): a new runtime, the same name and
    /// database, a new port.
    pub async fn restart(&self, i: usize) -> anyhow::Result<()> {
        let (name, skew) = {
            let r = self.replicas();
            (r[i].name.clone(), r[i].skew)
        };
        let cfg = ServeArgs::from_args(self.args(i, &name, skew))
            .map_err(|e| anyhow::anyhow!("chaos replica flags: {e}"))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(WORKERS)
            .thread_name(format!("{name}-worker"))
            .enable_all()
            .build()?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let stop = CancellationToken::new();
        let until = stop.clone();
        let run = runtime.spawn(async move {
            let app = match Application::build(cfg).await {
                Ok(app) => app,
                Err(e) => {
                    let text = format!("{e:#}");
                    // The starter waits on this; if it is gone, nobody
                    // needs the error.
                    drop(tx.send(Err(text)));
                    return Err(e);
                }
            };
            drop(tx.send(Ok((app.grpc_addr(), app.store.clone()))));
            app.run_until(until.cancelled_owned()).await
        });
        let started = match tokio::time::timeout(START_WITHIN, rx).await {
            Ok(started) => started,
            Err(_) => {
                // Stopped as kill -9 would: a start that hangs is a finding
                // the caller reports, not a run that never ends.
                runtime.shutdown_background();
                anyhow::bail!(
                    "replica {name} did not listen within {} s",
                    START_WITHIN.as_secs()
                );
            }
        };
        let listening = started
            .map_err(|_| anyhow::anyhow!("replica {name} ended before it listened"))
            .and_then(|r| r.map_err(|e| anyhow::anyhow!("replica {name}: {e}")));
        let (addr, store) = match listening {
            Ok(l) => l,
            Err(e) => {
                // Its runtime is stopped here, not dropped (dropping one
                // waits for it, which an asynchronous context may not).
                runtime.shutdown_background();
                return Err(e);
            }
        };
        let mut r = self.replicas();
        r[i].grpc_url = Some(format!("http://{addr}"));
        r[i].runtime = Some(runtime);
        r[i].stop = stop;
        r[i].run = Some(run);
        r[i].store = Some(store);
        Ok(())
    }

    /// Replica `i`'s own store handle, while it is up.
    pub fn store(&self, i: usize) -> Option<Arc<dyn Store>> {
        self.replicas().get(i).and_then(|r| r.store.clone())
    }

    /// Kills replica `i` the way kill -9 does.
    pub fn kill(&self, i: usize) {
        let mut r = self.replicas();
        r[i].grpc_url = None;
        r[i].run = None;
        r[i].store = None;
        if let Some(rt) = r[i].runtime.take() {
            rt.shutdown_background();
        }
    }

    /// Freezes replica `i` for `d`, then lets it run on (see the module's
    /// doc); returns whether every worker of it was held (false: it was
    /// down, or a worker did not come free in time, and it ran on partly).
    pub async fn freeze(&self, i: usize, d: Duration) -> bool {
        let Some(handle) = self
            .replicas()
            .get(i)
            .and_then(|r| r.runtime.as_ref().map(|rt| rt.handle().clone()))
        else {
            return false;
        };
        let gate = Arc::new(FreezeGate::default());
        gate.lock().1 = true;
        let thaw = Thaw(gate.clone());
        // Holding tasks spawned from outside the runtime, one at a time,
        // until every worker is held: each lands in the runtime's shared
        // queue and wakes a parked worker; one that finds every worker
        // taken waits there and, the freeze over, ends at once. (Spawned
        // together, a worker could take two into its own queue and block
        // on the first, the second then out of reach of one asleep.)
        let began = std::time::Instant::now();
        let mut held = 0;
        while held < WORKERS && began.elapsed() < FREEZE_TAKES_HOLD_WITHIN {
            let gate_n = gate.clone();
            // Detached: it ends when the freeze does.
            drop(handle.spawn(async move { gate_n.hold() }));
            let waiter = gate.clone();
            let want = held + 1;
            held = match tokio::task::spawn_blocking(move || {
                waiter.wait_held(want, Duration::from_millis(200))
            })
            .await
            {
                Ok(held) => held,
                // The wait itself failed (a panic): the freeze goes on
                // with what it holds, reported as partial.
                Err(_) => break,
            };
        }
        tokio::time::sleep(d).await;
        drop(thaw);
        held == WORKERS
    }

    /// Stops every replica through its staged shutdown.
    pub async fn stop(&self) {
        let runs: Vec<_> = {
            let mut r = self.replicas();
            r.iter_mut()
                .filter_map(|x| {
                    x.grpc_url = None;
                    x.stop.cancel();
                    x.run
                        .take()
                        .map(|run| (x.name.clone(), run, x.runtime.take()))
                })
                .collect()
        };
        for (name, run, runtime) in runs {
            match tokio::time::timeout(Duration::from_secs(30), run).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => {
                    tracing::warn!(replica = %name, error = %e, "replica ended with an error")
                }
                Ok(Err(e)) => tracing::warn!(replica = %name, error = %e, "replica task failed"),
                Err(_) => tracing::warn!(replica = %name, "replica did not stop within 30 s"),
            }
            if let Some(rt) = runtime {
                rt.shutdown_background();
            }
        }
    }
}
