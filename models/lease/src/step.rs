//! The steps: what each actor may do in a state, and what it changes.
//! `apply` returns `None` when a step is not enabled (or changes nothing).

use crate::{
    Action, Answer, Caller, Decision, LeaseModel, MAX_ATTEMPTS, Phase, REPLICAS, Reply, Request,
    RowState, State, Task,
};

/// Every step that might be enabled; `apply` tells which are.
pub(crate) fn candidates(m: &LeaseModel, s: &State, out: &mut Vec<Action>) {
    for op in 0..m.ops as u8 {
        for r in 0..REPLICAS as u8 {
            out.push(Action::Submit { op, r });
            out.push(Action::Claim { op, r });
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
            Action::Crash { r },
            Action::Pause { r },
            Action::HoldDb { r },
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

/// Would renewing `task`'s lease on replica `r` succeed (the renewal's
/// `WHERE`: owner, epoch when the guard holds, still open)?
fn renews(m: &LeaseModel, s: &State, r: u8, task: &Task) -> bool {
    let row = &s.rows[task.op as usize];
    row.owner == Some(r) && !row.state.decided() && (!m.guards.epoch || row.epoch == task.epoch)
}

/// Would a write of `task` pass the fence?
fn fence_passes(m: &LeaseModel, s: &State, r: u8, task: &Task) -> bool {
    let row = &s.rows[task.op as usize];
    !m.guards.fence || (row.owner == Some(r) && row.epoch == task.epoch && !row.state.decided())
}

pub(crate) fn apply(m: &LeaseModel, s: &State, a: Action) -> Option<State> {
    let mut n = s.clone();
    match a {
        Action::Submit { op, r } => submit(s, &mut n, op, r)?,
        Action::Claim { op, r } => claim(m, s, &mut n, op, r)?,
        Action::Task { r, t } => task_step(m, s, &mut n, r, t)?,
        Action::Send { r, t } => send(m, s, &mut n, r, t)?,
        Action::ReadAnswer { r, t } => {
            let task = task_of(s, r, t).filter(|k| k.phase == Phase::AwaitNova)?;
            let key = (r, task.op, task.attempt);
            let i = s.answers.iter().position(|x| *x == key)?;
            n.answers.remove(i);
            n.replicas[r as usize].tasks[t as usize].phase = Phase::Write(Decision::Succeeded);
        }
        Action::Timeout { r, t } => {
            let task = task_of(s, r, t).filter(|k| k.phase == Phase::AwaitNova)?;
            let key = (r, task.op, task.attempt);
            n.answers.retain(|x| *x != key);
            n.replicas[r as usize].tasks[t as usize].phase = Phase::Watch;
        }
        Action::Renew { r, t } => renew(m, s, &mut n, r, t)?,
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
        Action::NovaAct { i } => nova_act(s, &mut n, i, true)?,
        Action::NovaActUnanswered { i } => nova_act(s, &mut n, i, false)?,
        Action::NovaLose { i } => {
            if i as usize >= s.nova.len() {
                return None;
            }
            n.nova.remove(i as usize);
        }
        Action::Expire { op } => expire(m, s, &mut n, op)?,
        Action::Settle { op } => settle(s, &mut n, op)?,
        Action::Deadline { op } => {
            let row = &s.rows[op as usize];
            if row.state == RowState::Absent || row.state.decided() || row.deadline {
                return None;
            }
            n.rows[op as usize].deadline = true;
            // The caller's deadline is the operation's: it is answered
            // then, whatever runs (DEADLINE_EXCEEDED, outcome unknown).
            if matches!(
                s.callers[op as usize],
                Caller::Waiting(_) | Caller::Joined(_)
            ) {
                n.callers[op as usize] = Caller::Answered(Answer::Unknown);
                for rep in n.replicas.iter_mut() {
                    for task in rep.tasks.iter_mut().filter(|k| k.op == op) {
                        task.caller = false;
                    }
                }
            }
        }
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
        Action::Crash { r } => crash(&mut n, r),
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

fn answer_of(state: RowState) -> Answer {
    match state {
        RowState::Succeeded => Answer::Succeeded,
        RowState::Failed => Answer::Failed,
        _ => Answer::Unknown,
    }
}

fn submit(s: &State, n: &mut State, op: u8, r: u8) -> Option<()> {
    let rep = &s.replicas[r as usize];
    let row = &s.rows[op as usize];
    // One open operation per volume (VOLUME_BUSY): the detach comes once
    // the attach is decided.
    if row.state != RowState::Absent
        || rep.paused
        || rep.db_held
        || (op > 0 && !s.rows[op as usize - 1].state.decided())
    {
        return None;
    }
    let row = &mut n.rows[op as usize];
    row.state = RowState::InProgress;
    row.owner = Some(r);
    row.epoch = 1;
    row.attempts = 1;
    n.callers[op as usize] = Caller::Waiting(r);
    n.replicas[r as usize].tasks.push(Task {
        op,
        epoch: 1,
        phase: Phase::PreSend,
        known_live: true,
        held: false,
        caller: true,
        attempt: 1,
        prompt: true,
    });
    Some(())
}

fn claim(m: &LeaseModel, s: &State, n: &mut State, op: u8, r: u8) -> Option<()> {
    let rep = &s.replicas[r as usize];
    let row = &s.rows[op as usize];
    let free = row.owner.is_none() || row.expired;
    let own_run = rep.tasks.iter().any(|k| k.op == op);
    if rep.paused
        || row.state == RowState::Absent
        || row.state.decided()
        || !free
        || (row.wait_settle && !row.settled)
        || (m.guards.claim_skips_own_runs && own_run)
    {
        return None;
    }
    if m.guards.takeover_restamps && row.owner.is_some() {
        // A takeover: every request of the old holder left before its
        // lease ended, so the window from that end covers them all.
        n.rows[op as usize].settled = false;
        for q in n.nova.iter_mut().filter(|q| q.op == op) {
            q.prompt = true;
        }
    }
    let row = &mut n.rows[op as usize];
    row.owner = Some(r);
    row.epoch += 1;
    row.expired = false;
    let epoch = row.epoch;
    n.replicas[r as usize].tasks.push(Task {
        op,
        epoch,
        phase: Phase::Look,
        known_live: !rep.db_held,
        held: rep.db_held,
        caller: false,
        attempt: 0,
        prompt: true,
    });
    Some(())
}

/// Heard that the lease is lost (a renewal, the gate or a write found the
/// row another's or decided): the task stops, and its caller is answered
/// from the row, or waits for its decision as a replay would.
fn lose(s: &State, n: &mut State, r: u8, t: u8) {
    let task = n.replicas[r as usize].tasks.remove(t as usize);
    if task.caller {
        let row = &s.rows[task.op as usize];
        n.callers[task.op as usize] = if row.state.decided() {
            Caller::Answered(answer_of(row.state))
        } else {
            Caller::Joined(r)
        };
    }
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
        Reply::Fenced => lose(s, n, r, t),
    }
}

/// A write of the last request's time: a new settle window, covering the
/// requests in Nova and those about to leave.
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
}

fn task_step(m: &LeaseModel, s: &State, n: &mut State, r: u8, t: u8) -> Option<()> {
    let task = task_of(s, r, t)?.clone();
    let op = task.op;
    let row = &s.rows[op as usize];
    match task.phase {
        Phase::RecordAttempt => {
            if row.deadline {
                // No time to send again: look once more, then UNKNOWN.
                n.replicas[r as usize].tasks[t as usize].phase = Phase::Watch;
            } else if fence_passes(m, s, r, &task) {
                let row = &mut n.rows[op as usize];
                row.state = RowState::InProgress;
                row.attempts += 1;
                row.wait_settle = false;
                let attempt = row.attempts;
                stamp(n, op);
                n.replicas[r as usize].tasks[t as usize].attempt = attempt;
                reply(s, n, r, t, Reply::Recorded);
            } else {
                reply(s, n, r, t, Reply::Fenced);
            }
        }
        Phase::Watch => {
            let d = if wanted(s, op) {
                Decision::Succeeded
            } else if row.deadline {
                Decision::Unknown
            } else {
                return None;
            };
            n.replicas[r as usize].tasks[t as usize].phase = Phase::Write(d);
        }
        Phase::Look => look(m, s, n, r, t, &task),
        Phase::Write(d) => write(m, s, n, r, t, &task, d),
        Phase::Reply(rp) => finish(s, n, r, t, rp),
        Phase::PreSend | Phase::AwaitNova => return None,
    }
    Some(())
}

/// A reconciler pass's look, and what it leads to.
fn look(m: &LeaseModel, s: &State, n: &mut State, r: u8, t: u8, task: &Task) {
    let row = &s.rows[task.op as usize];
    let next = if wanted(s, task.op) {
        Phase::Write(Decision::Succeeded)
    } else if m.guards.settle_window && !row.settled {
        Phase::Write(Decision::Defer)
    } else if !row.deadline && row.attempts < MAX_ATTEMPTS {
        // A re-send within the operation's deadline: the pass becomes the
        // run (same lease, same epoch).
        Phase::RecordAttempt
    } else {
        Phase::Write(Decision::Failed)
    };
    n.replicas[r as usize].tasks[t as usize].phase = next;
}

fn write(m: &LeaseModel, s: &State, n: &mut State, r: u8, t: u8, task: &Task, d: Decision) {
    if !fence_passes(m, s, r, task) {
        return reply(s, n, r, t, Reply::Fenced);
    }
    let op = task.op as usize;
    let row = &mut n.rows[op];
    row.owner = None;
    row.expired = false;
    let answer = match d {
        Decision::Succeeded | Decision::Failed => {
            let (state, truth) = if d == Decision::Succeeded {
                (RowState::Succeeded, wanted(s, task.op))
            } else {
                (RowState::Failed, !wanted(s, task.op))
            };
            row.state = state;
            if !truth {
                n.ghost.wrong_decision = true;
            }
            n.ghost.decided[op].get_or_insert(state);
            Some(answer_of(state))
        }
        Decision::Unknown => {
            row.state = RowState::Unknown;
            stamp(n, task.op);
            Some(Answer::Unknown)
        }
        Decision::Defer => {
            row.state = RowState::Unknown;
            row.wait_settle = !row.settled;
            None
        }
    };
    reply(s, n, r, t, Reply::Written(answer));
}

/// The gate, then the request's first byte.
fn send(m: &LeaseModel, s: &State, n: &mut State, r: u8, t: u8) -> Option<()> {
    let task = task_of(s, r, t)
        .filter(|k| k.phase == Phase::PreSend)?
        .clone();
    let rep = &s.replicas[r as usize];
    let op = task.op;
    if s.rows[op as usize].deadline {
        // Out of time before sending: nothing leaves; look, then UNKNOWN.
        n.replicas[r as usize].tasks[t as usize].phase = Phase::Watch;
        return Some(());
    }
    if m.guards.send_gate && !task.known_live {
        // A renewal now (the gate waits for its reply).
        if rep.db_held {
            return None;
        }
        if !renews(m, s, r, &task) {
            lose(s, n, r, t);
            return Some(());
        }
        n.rows[op as usize].expired = false;
        n.replicas[r as usize].tasks[t as usize].known_live = true;
    }
    if s.nova.iter().any(|q| q.op == op) {
        n.ghost.overlap = true;
    }
    n.nova.push(Request {
        op,
        from: r,
        attempt: task.attempt,
        prompt: task.prompt,
    });
    n.replicas[r as usize].tasks[t as usize].phase = Phase::AwaitNova;
    Some(())
}

fn renew(m: &LeaseModel, s: &State, n: &mut State, r: u8, t: u8) -> Option<()> {
    let task = task_of(s, r, t)?.clone();
    if s.replicas[r as usize].db_held || matches!(task.phase, Phase::Reply(_)) {
        return None;
    }
    if renews(m, s, r, &task) {
        if task.known_live && !s.rows[task.op as usize].expired {
            return None;
        }
        n.rows[task.op as usize].expired = false;
        n.replicas[r as usize].tasks[t as usize].known_live = true;
    } else {
        lose(s, n, r, t);
    }
    Some(())
}

fn nova_act(s: &State, n: &mut State, i: u8, answered: bool) -> Option<()> {
    let q = *s.nova.get(i as usize)?;
    n.nova.remove(i as usize);
    let attach = q.op == 0;
    if s.attached != attach {
        n.attached = attach;
        n.effects[q.op as usize] += 1;
        if s.rows[q.op as usize].state.decided() {
            n.ghost.late_effect = true;
        }
    }
    let awaited = s.replicas[q.from as usize]
        .tasks
        .iter()
        .any(|k| k.op == q.op && k.attempt == q.attempt && k.phase == Phase::AwaitNova);
    if answered && awaited {
        n.answers.push((q.from, q.op, q.attempt));
    }
    Some(())
}

/// A lease expires only when its holder cannot renew it.
fn expire(m: &LeaseModel, s: &State, n: &mut State, op: u8) -> Option<()> {
    let row = &s.rows[op as usize];
    let owner = row.owner?;
    if row.expired || row.state.decided() {
        return None;
    }
    let rep = &s.replicas[owner as usize];
    let renewing = rep
        .tasks
        .iter()
        .any(|k| k.op == op && !k.held && renews(m, s, owner, k));
    if !rep.paused && !rep.db_held && renewing {
        return None;
    }
    n.rows[op as usize].expired = true;
    for rep in n.replicas.iter_mut() {
        for task in rep.tasks.iter_mut().filter(|k| k.op == op) {
            task.known_live = false;
        }
    }
    Some(())
}

/// The settle window after the last stamp passes: Nova has given up on
/// every request that left within its margin; one that left later may
/// still act.
fn settle(s: &State, n: &mut State, op: u8) -> Option<()> {
    let row = &s.rows[op as usize];
    if row.state == RowState::Absent || row.state.decided() || row.settled {
        return None;
    }
    let prompt_to_leave = s.replicas.iter().any(|rep| {
        rep.tasks
            .iter()
            .any(|k| k.op == op && k.prompt && matches!(k.phase, Phase::PreSend))
    });
    if prompt_to_leave {
        return None;
    }
    n.rows[op as usize].settled = true;
    n.nova.retain(|q| q.op != op || !q.prompt);
    Some(())
}

fn crash(n: &mut State, r: u8) {
    let rep = &mut n.replicas[r as usize];
    rep.tasks.clear();
    rep.paused = false;
    rep.db_held = false;
    n.answers.retain(|x| x.0 != r);
    for c in n.callers.iter_mut() {
        if matches!(*c, Caller::Waiting(x) | Caller::Joined(x) if x == r) {
            *c = Caller::Answered(Answer::Unknown);
        }
    }
}
