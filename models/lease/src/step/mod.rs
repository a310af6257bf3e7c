//! The steps: what each actor may do in a state, and what it changes.
//! `apply` returns `None` when a step is not enabled (or changes nothing).
//!
//! - `lease.rs`: who holds an operation: the intent, claims, renewals,
//!   expiry, a lease heard lost and the unsent mark, faults of replicas;
//! - `run.rs`: what a holder does with it: record, send, look, decide,
//!   and Nova and the settle window.

mod lease;
mod run;

use crate::{Action, Answer, Caller, LeaseModel, Phase, REPLICAS, Reply, RowState, State, Task};

/// Every step that might be enabled; `apply` tells which are.
pub(crate) fn candidates(m: &LeaseModel, s: &State, out: &mut Vec<Action>) {
    for op in 0..m.ops as u8 {
        for r in 0..REPLICAS as u8 {
            out.extend([
                Action::Submit { op, r },
                Action::SubmitReplyLost { op, r },
                Action::Claim { op, r },
                Action::ClaimReplyLost { op, r },
            ]);
        }
        out.extend([
            Action::Notify { op },
            Action::Expire { op },
            Action::Settle { op },
            Action::Deadline { op },
        ]);
    }
    for r in 0..REPLICAS as u8 {
        for t in 0..s.replicas[r as usize].tasks.len() as u8 {
            out.extend([
                Action::Task { r, t },
                Action::Send { r, t },
                Action::ReadAnswer { r, t },
                Action::Timeout { r, t },
                Action::Renew { r, t },
                Action::SlotWait { r, t },
            ]);
        }
        out.extend([
            Action::Resume { r },
            Action::ReleaseDb { r },
            Action::Fast { r },
            Action::Crash { r },
            Action::Pause { r },
            Action::HoldDb { r },
            Action::Slow { r },
        ]);
    }
    for i in 0..s.nova.len() as u8 {
        out.extend([
            Action::NovaAct { i },
            Action::NovaActUnanswered { i },
            Action::NovaLose { i },
        ]);
    }
}

pub(crate) fn apply(m: &LeaseModel, s: &State, a: Action) -> Option<State> {
    let mut n = s.clone();
    match a {
        Action::Submit { op, r } => lease::submit(s, &mut n, op, r, false)?,
        Action::SubmitReplyLost { op, r } => lease::submit(s, &mut n, op, r, true)?,
        Action::Claim { op, r } => lease::claim(m, s, &mut n, op, r, true)?,
        Action::ClaimReplyLost { op, r } => lease::claim(m, s, &mut n, op, r, false)?,
        Action::Task { r, t } => run::task_step(m, s, &mut n, r, t)?,
        Action::Send { r, t } => run::send(m, s, &mut n, r, t)?,
        Action::ReadAnswer { r, t } => run::read_answer(s, &mut n, r, t)?,
        Action::Timeout { r, t } => {
            let task = task_of(s, r, t).filter(|k| k.phase == Phase::AwaitNova)?;
            let key = (r, task.op, task.attempt);
            n.answers.retain(|x| *x != key);
            n.replicas[r as usize].tasks[t as usize].phase = Phase::Watch;
        }
        Action::Renew { r, t } => lease::renew(m, s, &mut n, r, t)?,
        Action::Notify { op } => {
            let row = &s.rows[op as usize];
            let Caller::Joined(r) = s.callers[op as usize] else {
                return None;
            };
            let rep = &s.replicas[r as usize];
            if !row.state.decided() || rep.paused || rep.db_held {
                return None;
            }
            n.callers[op as usize] = Caller::Answered(answer_of(row.state));
        }
        Action::NovaAct { i } => run::nova_act(s, &mut n, i, true)?,
        Action::NovaActUnanswered { i } => run::nova_act(s, &mut n, i, false)?,
        Action::NovaLose { i } => {
            if i as usize >= s.nova.len() {
                return None;
            }
            n.nova.remove(i as usize);
        }
        Action::Expire { op } => lease::expire(m, s, &mut n, op)?,
        Action::Settle { op } => run::settle(s, &mut n, op)?,
        Action::Deadline { op } => run::deadline(s, &mut n, op)?,
        Action::Resume { r } => {
            if !s.replicas[r as usize].paused {
                return None;
            }
            n.replicas[r as usize].paused = false;
        }
        Action::ReleaseDb { r } => {
            if !s.replicas[r as usize].db_held {
                return None;
            }
            let rep = &mut n.replicas[r as usize];
            rep.db_held = false;
            for task in rep.tasks.iter_mut() {
                task.held = false;
            }
        }
        Action::Fast { r } => {
            if !s.replicas[r as usize].slow {
                return None;
            }
            n.replicas[r as usize].slow = false;
        }
        Action::Crash { r } => lease::crash(&mut n, r),
        Action::Pause { r } => {
            let rep = &mut n.replicas[r as usize];
            if rep.paused {
                return None;
            }
            rep.paused = true;
            // A pause may outlast the settle window's margin.
            for task in rep.tasks.iter_mut() {
                task.prompt = false;
            }
        }
        Action::HoldDb { r } => {
            let rep = &mut n.replicas[r as usize];
            if rep.db_held || rep.paused {
                return None;
            }
            // What waits on the database now waits longer (its reply is
            // held: `reply`); a request waiting for a slot does not.
            rep.db_held = true;
        }
        Action::Slow { r } => {
            let rep = &mut n.replicas[r as usize];
            // Only where it could matter: a replica holding a lease.
            if rep.slow || rep.paused || rep.db_held || rep.tasks.is_empty() {
                return None;
            }
            rep.slow = true;
        }
        Action::SlotWait { r, t } => {
            task_of(s, r, t).filter(|k| k.phase == Phase::PreSend && k.prompt)?;
            n.replicas[r as usize].tasks[t as usize].prompt = false;
        }
    }
    sort(&mut n);
    (n != *s).then_some(n)
}

fn sort(n: &mut State) {
    n.nova.sort();
    n.answers.sort();
    for rep in n.replicas.iter_mut() {
        rep.tasks.sort();
    }
}

/// Whether `op`'s wanted state shows in Nova (attach: attached; detach:
/// not).
fn wanted(s: &State, op: u8) -> bool {
    if op == 0 { s.attached } else { !s.attached }
}

/// A step of a replica's own (not paused; `t` its task, not waiting on a
/// held reply).
fn task_of(s: &State, r: u8, t: u8) -> Option<&Task> {
    let rep = &s.replicas[r as usize];
    if rep.paused {
        return None;
    }
    rep.tasks.get(t as usize).filter(|task| !task.held)
}

/// A timeout is a fault (a late answer) when the request is still in Nova
/// or its answer waits to be read; free when the answer was lost.
pub(crate) fn timeout_is_late(s: &State, r: u8, t: u8) -> bool {
    let Some(task) = s.replicas[r as usize].tasks.get(t as usize) else {
        return false;
    };
    s.nova
        .iter()
        .any(|q| q.from == r && q.op == task.op && q.attempt == task.attempt)
        || s.answers.contains(&(r, task.op, task.attempt))
}

/// Whether `task` is one the replica's hold of its operation stands for
/// (renewed by the heartbeat, its epoch the hold's): not an intent being
/// read back (its epoch not known yet), nor a run that heard its lease
/// lost.
fn in_hold(task: &Task) -> bool {
    !matches!(task.phase, Phase::ReadBack | Phase::MarkUnsent)
}

/// Ends task `t`'s database step with `reply`, or leaves the reply held
/// until the replica's database replies flow again.
fn reply(s: &State, n: &mut State, r: u8, t: u8, reply: Reply) {
    if s.replicas[r as usize].db_held {
        let task = &mut n.replicas[r as usize].tasks[t as usize];
        task.phase = Phase::Reply(reply);
        task.held = true;
        // Held for longer than the settle window's margin, maybe.
        task.prompt = false;
        return;
    }
    finish(s, n, r, t, reply);
}

/// What task `t` does on its database step's reply.
fn finish(s: &State, n: &mut State, r: u8, t: u8, reply: Reply) {
    match reply {
        Reply::Recorded => n.replicas[r as usize].tasks[t as usize].phase = Phase::PreSend,
        Reply::Written(answer) => {
            let task = n.replicas[r as usize].tasks.remove(t as usize);
            if let (true, Some(a)) = (task.caller, answer) {
                n.callers[task.op as usize] = Caller::Answered(a);
            }
        }
        Reply::Fenced => lease::lose(s, n, r, t),
    }
}

/// A write of the last request's time: a new settle window, covering the
/// requests in Nova and those about to leave. What the liveness ghosts
/// say of the operation's last attempt and its window is then past.
fn stamp(n: &mut State, op: u8) {
    n.rows[op as usize].settled = false;
    for q in n.nova.iter_mut().filter(|q| q.op == op) {
        q.prompt = true;
    }
    for rep in n.replicas.iter_mut() {
        for task in rep.tasks.iter_mut().filter(|k| k.op == op) {
            task.prompt = true;
        }
    }
    forget(n, op);
}

/// The liveness ghosts of `op` no longer apply (a new request, or a
/// decision).
fn forget(n: &mut State, op: u8) {
    n.ghost.unsent_known[op as usize] = false;
    n.ghost.window_ended[op as usize] = false;
}

fn answer_of(state: RowState) -> Answer {
    match state {
        RowState::Succeeded => Answer::Succeeded,
        RowState::Failed => Answer::Failed,
        _ => Answer::Unknown,
    }
}
