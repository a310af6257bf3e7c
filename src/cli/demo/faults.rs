//! The demo's workload: which volumes, and the faults the simulator
//! injects for them (seeded: the same seed, the same faults).

use std::collections::BTreeMap;

use rand::{RngExt, SeedableRng};
use uuid::Uuid;

use super::{DemoArgs, SERVERS};
use crate::sim::{self, Fault, FaultOp, FaultRule};

/// The volumes to attach and detach, and the faults injected for them.
pub struct Plan {
    pub volumes: Vec<(Uuid, Uuid)>,
    pub injected: BTreeMap<&'static str, usize>,
}

/// Seeds the simulator's faults: the same seed, the same faults.
pub fn plan_faults(sim: &sim::Sim, args: &DemoArgs) -> Plan {
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let servers: Vec<Uuid> = (0..SERVERS).map(|_| Uuid::new_v4()).collect();
    let mut plan = Plan {
        volumes: Vec::new(),
        injected: BTreeMap::new(),
    };
    let late = u64::try_from(args.deadline.as_millis()).unwrap_or(u64::MAX) + 2000;
    for i in 0..args.volumes {
        let (s, v) = (servers[i % servers.len()], Uuid::new_v4());
        if let Some((name, f)) = attach_fault(rng.random(), late) {
            sim.add_fault(FaultRule::new(FaultOp::Attach, f).volume(v));
            *plan.injected.entry(name).or_default() += 1;
        }
        let roll: f64 = rng.random();
        let detach_fault = if roll < 0.08 {
            Some(("lost detach response", Fault::CloseAfterEffect))
        } else if roll < 0.12 {
            Some(("409 on detach", Fault::Conflict))
        } else {
            None
        };
        if let Some((name, f)) = detach_fault {
            sim.add_fault(FaultRule::new(FaultOp::Detach, f).volume(v));
            *plan.injected.entry(name).or_default() += 1;
        }
        plan.volumes.push((s, v));
    }
    plan
}

/// The attach fault for a roll in 0..1 (about half the attaches get one).
fn attach_fault(roll: f64, late_ms: u64) -> Option<(&'static str, Fault)> {
    Some(match roll {
        r if r < 0.12 => (
            "lost response (answer too late)",
            Fault::DelayAfterEffect { ms: late_ms },
        ),
        r if r < 0.20 => ("lost response (connection closed)", Fault::CloseAfterEffect),
        r if r < 0.30 => ("slow answer (1 s)", Fault::DelayAfterEffect { ms: 1000 }),
        r if r < 0.36 => ("409 conflict, then clears", Fault::Conflict),
        r if r < 0.42 => (
            "503 without effect",
            Fault::Status {
                code: 503,
                effect: false,
            },
        ),
        r if r < 0.46 => (
            "500 after taking effect",
            Fault::Status {
                code: 500,
                effect: true,
            },
        ),
        r if r < 0.49 => (
            "502 proxy page",
            Fault::ProxyError {
                code: 502,
                effect: false,
            },
        ),
        r if r < 0.53 => ("rolled back after Nova's 200", Fault::RollBack),
        _ => return None,
    })
}
