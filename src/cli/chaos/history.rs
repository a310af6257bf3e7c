//! Histories: a small world (servers, volumes), a few orchestrators that
//! attach and detach with fresh or replayed keys and random deadlines, the
//! faults their requests meet, and what happens around them (servers and
//! volumes deleted, someone else's hand, an operator). Everything follows
//! from one seed, so a history is reproduced from its number.

use std::fmt;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use uuid::Uuid;

use crate::domain::{Action, State};
use crate::sim::{Fault, FaultOp};

pub const SERVERS: usize = 3;
pub const VOLUMES: usize = 6;

/// Which key a call uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyChoice {
    /// A key of its own.
    Fresh,
    /// The key of an earlier call of the same client (a replay; with other
    /// parameters, a reuse).
    Replay(usize),
    /// The key of another client's earlier call: another caller's key is
    /// never joined, read or revealed.
    Foreign(usize),
}

/// A fault the call's request meets at the simulator.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedFault {
    pub op: FaultOp,
    pub fault: Fault,
    /// How many matching requests it hits.
    pub times: u32,
}

/// One orchestrator call.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub client: usize,
    pub action: Action,
    pub server: usize,
    pub volume: usize,
    pub key: KeyChoice,
    pub deadline_ms: u64,
    /// The caller gives up this long after sending (drops the call).
    pub cancel_after_ms: Option<u64>,
    /// Think time before the call.
    pub pause_ms: u64,
    pub faults: Vec<PlannedFault>,
    /// An operator acts on this call's operation this long after it was
    /// sent (while it may still run): reconcile it, or resolve it.
    pub operator: Option<(u64, Option<State>)>,
}

/// Something that happens at an instant, whatever the calls do.
#[derive(Debug, Clone, PartialEq)]
pub enum Happening {
    DeleteServer(usize),
    DeleteVolume(usize),
    AttachOutOfBand {
        server: usize,
        volume: usize,
    },
    DetachOutOfBand {
        server: usize,
        volume: usize,
    },
    /// `ReconcileOperation` on the operation of call `n` (as soon as it
    /// exists).
    Reconcile(usize),
    /// `ResolveOperation` on the operation of call `n`, if still open.
    Resolve(usize, State),
    /// A fault in the database or the way to it (PostgreSQL only).
    Db(DbFault),
}

/// A fault in what the replicas stand on: PostgreSQL, and each replica's
/// way to it (a fault proxy of its own). Durations are drawn on both sides
/// of the callers' deadlines (0.3 to 4 s) and of the service's statement
/// bound (`--db-statement-timeout`, 5 s).
#[derive(Debug, Clone, PartialEq)]
pub enum DbFault {
    /// Replica `replica`'s open connections go silent for `ms` (kept open,
    /// nothing forwarded either way: a NAT that lost its state); with
    /// `new_too`, every connection it opens meanwhile as well.
    Silent {
        replica: usize,
        new_too: bool,
        ms: u64,
    },
    /// Open connections reset (RST) in the middle of whatever they carry
    /// (batches of intents and decisions), `times` times `every_ms` apart:
    /// one replica's, or every replica's (`None`).
    Reset {
        replica: Option<usize>,
        times: u32,
        every_ms: u64,
    },
    /// New connections refused for `ms` (and, with `reset_open`, the open
    /// ones reset first, so that new ones are needed at once).
    Refused {
        replica: Option<usize>,
        ms: u64,
        reset_open: bool,
    },
    /// PostgreSQL itself crashes — SIGKILL of the postmaster (`kill`), or
    /// an immediate stop (`pg_ctl stop -m immediate`) — and is restarted
    /// after `pause_ms` (only on a server of chaos's own).
    Crash { kill: bool, pause_ms: u64 },
    /// Replica `replica` frozen for `ms`, mostly past its lease (what
    /// SIGSTOP, then SIGCONT, do to a process: `Cluster::freeze`).
    Freeze { replica: usize, ms: u64 },
    /// The database's replies to replica `replica` held for `ms`, then
    /// delivered; its statements still arrive and are acted on.
    HoldReplies { replica: usize, ms: u64 },
    /// The database slow for `ms`: each of its replies to one replica's
    /// connections, or to every replica's (`None`), delivered `latency_ms`
    /// (2 to 5 s) after it was sent — connecting too (a handshake is
    /// replies) — as a loaded server or a congested link would.
    Slow {
        replica: Option<usize>,
        latency_ms: u64,
        ms: u64,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Timed {
    pub at_ms: u64,
    pub what: Happening,
}

/// One history.
#[derive(Debug, Clone, PartialEq)]
pub struct History {
    pub seed: u64,
    /// Which run of the seed (a re-run, when shrinking, gets a new world
    /// and new keys: the ledger and the simulator remember the last one).
    pub run: u32,
    pub servers: [Uuid; SERVERS],
    pub volumes: [Uuid; VOLUMES],
    pub calls: Vec<Call>,
    pub happenings: Vec<Timed>,
}

/// How histories are drawn.
#[derive(Debug, Clone)]
pub struct Shape {
    pub clients: usize,
    pub calls_per_client: usize,
    /// The longest late effect a fault may schedule: the service's settle
    /// window must cover it.
    pub max_late_effect_ms: u64,
    /// The share of histories that meet database faults (0: none).
    pub db_faults: f64,
    /// Whether those may crash PostgreSQL itself (a server of chaos's own).
    pub db_crash: bool,
    /// The replicas a database fault may pick from.
    pub replicas: usize,
    /// The share of histories that meet a replica frozen or its database
    /// replies held (0: none); their calls' deadlines are sometimes long
    /// (`LONG_DEADLINE_MS`), so that a caller can wait on a replica that
    /// lost its operation.
    pub pauses: f64,
    /// The share of histories that meet a slow database (`DbFault::Slow`;
    /// 0: none).
    pub db_slow: f64,
    /// The run's slow databases one at a time, this long apart (the one a
    /// history draws is skipped when another is under way or ended less
    /// than this long ago: `dbfaults::DbFaults`); `None`: each history's
    /// when it draws it, overlapping.
    pub db_slow_quiet: Option<std::time::Duration>,
}

/// The deadline of a long call in a history with a pause: longer than a
/// pause and the wait the checker allows after a decision together.
pub const LONG_DEADLINE_MS: u64 = 20_000;

impl Default for Shape {
    fn default() -> Self {
        Self {
            clients: 3,
            calls_per_client: 4,
            max_late_effect_ms: 1200,
            db_faults: 0.0,
            db_crash: false,
            replicas: 1,
            pauses: 0.0,
            db_slow: 0.0,
            db_slow_quiet: Some(std::time::Duration::from_secs(30)),
        }
    }
}

fn uuid(rng: &mut StdRng) -> Uuid {
    uuid::Builder::from_random_bytes(rng.random()).into_uuid()
}

impl History {
    /// The history of `seed`.
    pub fn generate(seed: u64, shape: &Shape) -> History {
        let mut rng = StdRng::seed_from_u64(seed);
        let servers = std::array::from_fn(|_| uuid(&mut rng));
        let volumes = std::array::from_fn(|_| uuid(&mut rng));
        let mut calls = Vec::new();
        for round in 0..shape.calls_per_client {
            for client in 0..shape.clients {
                calls.push(Self::call(&mut rng, shape, client, round, &calls));
            }
        }
        let mut happenings = Vec::new();
        let span = (shape.calls_per_client as u64) * 1500;
        let chance = |rng: &mut StdRng, p: f64| rng.random_bool(p);
        if chance(&mut rng, 0.25) {
            happenings.push(Timed {
                at_ms: rng.random_range(0..span),
                what: Happening::DeleteServer(rng.random_range(0..SERVERS)),
            });
        }
        if chance(&mut rng, 0.15) {
            happenings.push(Timed {
                at_ms: rng.random_range(0..span),
                what: Happening::DeleteVolume(rng.random_range(0..VOLUMES)),
            });
        }
        for _ in 0..rng.random_range(0..3) {
            let (server, volume) = (rng.random_range(0..SERVERS), rng.random_range(0..VOLUMES));
            let what = if rng.random_bool(0.5) {
                Happening::AttachOutOfBand { server, volume }
            } else {
                Happening::DetachOutOfBand { server, volume }
            };
            happenings.push(Timed {
                at_ms: rng.random_range(0..span),
                what,
            });
        }
        if chance(&mut rng, 0.3) {
            let n = rng.random_range(0..calls.len());
            happenings.push(Timed {
                at_ms: rng.random_range(0..span),
                what: Happening::Reconcile(n),
            });
        }
        happenings.extend(db_faults(seed, shape, span));
        happenings.extend(slow_faults(seed, shape, span));
        let pauses = pause_faults(seed, shape, span);
        if !pauses.is_empty() {
            long_deadlines(seed, &mut calls);
        }
        happenings.extend(pauses);
        happenings.sort_by_key(|t| t.at_ms);
        History {
            seed,
            run: 0,
            servers,
            volumes,
            calls,
            happenings,
        }
    }

    fn call(
        rng: &mut StdRng,
        shape: &Shape,
        client: usize,
        round: usize,
        earlier: &[Call],
    ) -> Call {
        let key = choose_key(rng, client, earlier);
        let (action, server, volume) = choose_target(rng, client, round, earlier, &key);
        let deadline_ms = *[300u64, 800, 1500, 2500, 4000]
            .get(rng.random_range(0..5))
            .unwrap_or(&1500);
        let cancel_after_ms = rng.random_bool(0.12).then(|| {
            // Often very early: during the intent write.
            if rng.random_bool(0.5) {
                rng.random_range(0..4)
            } else {
                rng.random_range(0..deadline_ms)
            }
        });
        let faults = if rng.random_bool(0.45) {
            planned_faults(rng, action, shape)
        } else {
            Vec::new()
        };
        let operator = choose_operator(rng, deadline_ms);
        Call {
            client,
            action,
            server,
            volume,
            key,
            deadline_ms,
            cancel_after_ms,
            pause_ms: rng.random_range(0..400),
            faults,
            operator,
        }
    }
}

/// The database faults of history `seed`, drawn from a stream of their
/// own: a history without them is the very history it was before they
/// existed (its seed still shows what it showed).
fn db_faults(seed: u64, shape: &Shape, span: u64) -> Vec<Timed> {
    if shape.db_faults <= 0.0 {
        return Vec::new();
    }
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6462_6661_756c_7473);
    if !rng.random_bool(shape.db_faults.min(1.0)) {
        return Vec::new();
    }
    let n = if rng.random_bool(0.25) { 2 } else { 1 };
    (0..n)
        .map(|_| Timed {
            at_ms: rng.random_range(0..span),
            what: Happening::Db(db_fault(&mut rng, shape)),
        })
        .collect()
}

/// A replica frozen, or its database replies held, in a share of the
/// histories; drawn from a stream of their own, as the database faults.
fn pause_faults(seed: u64, shape: &Shape, span: u64) -> Vec<Timed> {
    if shape.pauses <= 0.0 || shape.replicas < 2 {
        return Vec::new();
    }
    let mut rng = StdRng::seed_from_u64(seed ^ 0x7061_7573_6573);
    if !rng.random_bool(shape.pauses.min(1.0)) {
        return Vec::new();
    }
    let replica = rng.random_range(0..shape.replicas);
    // Mostly past the lease (3 s), sometimes within it.
    let ms = if rng.random_bool(0.8) {
        rng.random_range(3_500..8_000)
    } else {
        rng.random_range(500..3_000)
    };
    let what = if rng.random_bool(0.6) {
        DbFault::Freeze { replica, ms }
    } else {
        DbFault::HoldReplies { replica, ms }
    };
    vec![Timed {
        at_ms: rng.random_range(0..span),
        what: Happening::Db(what),
    }]
}

/// A slow database in a share of the histories, drawn from a stream of
/// its own (a history without one is the very history it was before they
/// existed). Its latency is past every caller's deadline (0.3 to 4 s) but
/// within the statement bound (5 s), so that statements still answer; its
/// length spans the history's calls, and passes the lease (3 s).
fn slow_faults(seed: u64, shape: &Shape, span: u64) -> Vec<Timed> {
    if shape.db_slow <= 0.0 {
        return Vec::new();
    }
    let mut rng = StdRng::seed_from_u64(seed ^ 0x736c_6f77);
    if !rng.random_bool(shape.db_slow.min(1.0)) {
        return Vec::new();
    }
    let replica = rng.random_range(0..shape.replicas.max(1));
    let what = DbFault::Slow {
        replica: rng.random_bool(0.6).then_some(replica),
        latency_ms: rng.random_range(2_000..5_000),
        ms: rng.random_range(4_000..12_000),
    };
    vec![Timed {
        at_ms: rng.random_range(0..span),
        what: Happening::Db(what),
    }]
}

/// Gives a third of the calls a long deadline (from a stream of its own):
/// the callers a replica that lost its operation could hold.
fn long_deadlines(seed: u64, calls: &mut [Call]) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6c6f_6e67);
    for c in calls.iter_mut() {
        if rng.random_bool(0.33) {
            c.deadline_ms = LONG_DEADLINE_MS;
        }
    }
}

fn db_fault(rng: &mut StdRng, shape: &Shape) -> DbFault {
    let replica = rng.random_range(0..shape.replicas.max(1));
    let one_or_all = rng.random_bool(0.7).then_some(replica);
    // Shorter than most deadlines; longer than the callers' deadlines but
    // shorter than the statement bound; longer than both.
    let ms = match rng.random_range(0..3) {
        0 => rng.random_range(100..2000),
        1 => rng.random_range(2000..5000),
        _ => rng.random_range(5000..10_000),
    };
    let roll = rng.random_range(0..20);
    match roll {
        0..=5 => DbFault::Silent {
            replica,
            new_too: false,
            ms,
        },
        6..=9 => DbFault::Silent {
            replica,
            new_too: true,
            ms,
        },
        13..=16 => DbFault::Refused {
            replica: one_or_all,
            ms: ms.min(6000),
            reset_open: rng.random_bool(0.7),
        },
        17.. if shape.db_crash => DbFault::Crash {
            kill: rng.random_bool(0.5),
            pause_ms: rng.random_range(100..5000),
        },
        _ => DbFault::Reset {
            replica: one_or_all,
            times: rng.random_range(1..4),
            every_ms: rng.random_range(50..400),
        },
    }
}

/// Fresh mostly; sometimes a replay of one of this client's earlier keys,
/// or another client's key.
fn choose_key(rng: &mut StdRng, client: usize, earlier: &[Call]) -> KeyChoice {
    let own: Vec<usize> = (0..earlier.len())
        .filter(|i| earlier[*i].client == client && earlier[*i].key == KeyChoice::Fresh)
        .collect();
    let others: Vec<usize> = (0..earlier.len())
        .filter(|i| earlier[*i].client != client && earlier[*i].key == KeyChoice::Fresh)
        .collect();
    let roll: f64 = rng.random();
    if roll < 0.15 && !own.is_empty() {
        KeyChoice::Replay(own[rng.random_range(0..own.len())])
    } else if roll < 0.22 && !others.is_empty() {
        KeyChoice::Foreign(others[rng.random_range(0..others.len())])
    } else {
        KeyChoice::Fresh
    }
}

/// What a call asks for: a replay mostly asks for the same thing as what
/// it replays; orchestrators mostly attach, then detach what they attached.
fn choose_target(
    rng: &mut StdRng,
    client: usize,
    round: usize,
    earlier: &[Call],
    key: &KeyChoice,
) -> (Action, usize, usize) {
    let copied = match key {
        KeyChoice::Replay(n) | KeyChoice::Foreign(n) if rng.random_bool(0.8) => {
            Some((earlier[*n].action, earlier[*n].server, earlier[*n].volume))
        }
        _ => None,
    };
    let attached: Vec<(usize, usize)> = earlier
        .iter()
        .filter(|c| c.client == client && c.action == Action::Attach)
        .map(|c| (c.server, c.volume))
        .collect();
    copied.unwrap_or_else(|| {
        let action = if round.is_multiple_of(2) || rng.random_bool(0.3) {
            Action::Attach
        } else {
            Action::Detach
        };
        match action {
            Action::Detach if !attached.is_empty() && rng.random_bool(0.75) => {
                let (s, v) = attached[rng.random_range(0..attached.len())];
                (action, s, v)
            }
            _ => (
                action,
                rng.random_range(0..SERVERS),
                rng.random_range(0..VOLUMES),
            ),
        }
    })
}

/// Sometimes an operator acts on the call's operation while it runs:
/// reconciles it, or (a fifth of those) resolves it by hand.
fn choose_operator(rng: &mut StdRng, deadline_ms: u64) -> Option<(u64, Option<State>)> {
    rng.random_bool(0.12).then(|| {
        let after = rng.random_range(0..deadline_ms.max(1));
        let resolve = rng.random_bool(0.2).then(|| {
            if rng.random_bool(0.5) {
                State::Succeeded
            } else {
                State::Failed
            }
        });
        (after, resolve)
    })
}

/// One fault, sometimes a sequence (a lost request, then refusals).
fn planned_faults(rng: &mut StdRng, action: Action, shape: &Shape) -> Vec<PlannedFault> {
    let op = match action {
        Action::Attach => FaultOp::Attach,
        Action::Detach => FaultOp::Detach,
    };
    let one = |fault: Fault| PlannedFault {
        op,
        fault,
        times: 1,
    };
    let effect = rng.random_bool(0.5);
    let late = rng.random_range(100..shape.max_late_effect_ms.max(101));
    match rng.random_range(0..18) {
        0 => vec![one(Fault::DelayAfterEffect {
            ms: rng.random_range(100..3000),
        })],
        1 => vec![one(Fault::CloseAfterEffect)],
        2 => vec![one(Fault::CloseBeforeEffect)],
        3 => vec![one(Fault::StallBody {
            ms: rng.random_range(200..3000),
            effect,
        })],
        4 => vec![one(Fault::TruncateBody { effect })],
        5 => vec![one(Fault::GarbageBody)],
        6 => vec![one(Fault::Status { code: 500, effect })],
        7 => vec![one(Fault::ProxyError { code: 504, effect })],
        8 => vec![one(Fault::LateEffect { ms: late })],
        // The request is lost while Nova goes on; every retry is refused
        // as locked until the budget ends.
        9 => vec![
            one(Fault::LateEffect { ms: late }),
            PlannedFault {
                op,
                fault: Fault::Conflict,
                times: 20,
            },
        ],
        10 => vec![PlannedFault {
            op,
            fault: Fault::Conflict,
            times: rng.random_range(1..4),
        }],
        11 => vec![PlannedFault {
            op,
            fault: Fault::Status {
                code: 500,
                effect: false,
            },
            times: 30,
        }],
        // Nova takes its time, within its bounds (the settle window).
        12 => vec![one(Fault::DelayBeforeEffect {
            ms: rng.random_range(100..shape.max_late_effect_ms.max(101)),
        })],
        13 => vec![PlannedFault {
            op: FaultOp::List,
            fault: Fault::Status {
                code: 503,
                effect: false,
            },
            times: rng.random_range(1..6),
        }],
        14 if action == Action::Detach => vec![one(Fault::DetachRefused)],
        15 if action == Action::Attach => vec![one(Fault::VolumeNotReady {
            status: "creating".into(),
        })],
        16 if action == Action::Attach => vec![one(Fault::DeviceInUse)],
        // Nova answers, then the hypervisor fails it and Nova rolls back.
        17 if action == Action::Attach => vec![one(Fault::RollBack)],
        _ => vec![one(Fault::Status { code: 503, effect })],
    }
}

impl History {
    /// The same history in a new world (new server and volume ids, new
    /// keys), to play it again.
    pub fn replayed(&self) -> History {
        let mut rng = StdRng::seed_from_u64(self.seed ^ (u64::from(self.run) + 1).rotate_left(32));
        History {
            run: self.run + 1,
            servers: std::array::from_fn(|_| uuid(&mut rng)),
            volumes: std::array::from_fn(|_| uuid(&mut rng)),
            ..self.clone()
        }
    }

    /// The number of steps a shrink can drop (calls, faults, happenings).
    pub fn size(&self) -> usize {
        self.calls.len()
            + self
                .calls
                .iter()
                .map(|c| {
                    c.faults.len()
                        + usize::from(c.operator.is_some())
                        + usize::from(c.cancel_after_ms.is_some())
                })
                .sum::<usize>()
            + self.happenings.len()
    }
}

impl fmt::Display for History {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "history {} (servers s0..s{}, volumes v0..v{}):",
            self.seed,
            SERVERS - 1,
            VOLUMES - 1
        )?;
        for (i, s) in self.servers.iter().enumerate() {
            write!(f, "  s{i}={s}")?;
        }
        writeln!(f)?;
        for (i, v) in self.volumes.iter().enumerate() {
            write!(f, "  v{i}={v}")?;
        }
        writeln!(f)?;
        for (n, c) in self.calls.iter().enumerate() {
            write!(
                f,
                "  call {n}: client {} {} s{} v{} key {:?} deadline {} ms",
                c.client,
                c.action.as_str(),
                c.server,
                c.volume,
                c.key,
                c.deadline_ms
            )?;
            if let Some(ms) = c.cancel_after_ms {
                write!(f, ", cancelled after {ms} ms")?;
            }
            for pf in &c.faults {
                write!(f, "; fault {:?} x{} on {:?}", pf.fault, pf.times, pf.op)?;
            }
            if let Some((after, resolve)) = c.operator {
                match resolve {
                    Some(s) => write!(
                        f,
                        "; an operator resolves it {} after {after} ms",
                        s.as_str()
                    )?,
                    None => write!(f, "; an operator reconciles it after {after} ms")?,
                }
            }
            writeln!(f)?;
        }
        for t in &self.happenings {
            writeln!(f, "  at {} ms: {:?}", t.at_ms, t.what)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_always_gives_the_same_history_and_seeds_differ() {
        let shape = Shape::default();
        assert_eq!(History::generate(7, &shape), History::generate(7, &shape));
        assert_ne!(History::generate(7, &shape), History::generate(8, &shape));
        let h = History::generate(7, &shape);
        assert_eq!(h.calls.len(), shape.clients * shape.calls_per_client);
    }
}
