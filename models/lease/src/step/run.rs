//! What a holder does with its lease: record an attempt, pass the gate and
//! send, await the answer, watch, look, decide or defer; and Nova acting
//! on requests, the settle window passing, the deadline coming.

use super::{answer_of, forget, lease, reply, stamp, task_of, wanted};
use crate::{
    Answer, Caller, Decision, LeaseModel, MAX_ATTEMPTS, Phase, Reply, Request, RowState, State,
    Task,
};

/// Would a write of `task` pass the fence (`transition_sql`: `lease_epoch
/// = $epoch AND completed_at IS NULL`; the owner is not checked)?
fn fence_passes(m: &LeaseModel, s: &State, task: &Task) -> bool {
    let row = &s.rows[task.op as usize];
    (!m.guards.fence_epoch || row.epoch == task.epoch)
        && (!m.guards.fence_open || !row.state.decided())
}

pub(super) fn task_step(m: &LeaseModel, s: &State, n: &mut State, r: u8, t: u8) -> Option<()> {
    let task = task_of(s, r, t)?.clone();
    let op = task.op;
    let row = &s.rows[op as usize];
    match task.phase {
        Phase::RecordAttempt => {
            if row.deadline {
                // No time to send again: look once more, then UNKNOWN.
                n.replicas[r as usize].tasks[t as usize].phase = Phase::Watch;
            } else if fence_passes(m, s, &task) {
                let row = &mut n.rows[op as usize];
                row.state = RowState::InProgress;
                row.attempts += 1;
                row.wait_settle = false;
                // The trigger `operations_stamp_attempt`: the row's epoch,
                // and not unsent.
                row.attempt_epoch = row.epoch;
                row.unsent = false;
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
        Phase::ReadBack => {
            // A read, then a renewal: both wait for the database.
            if s.replicas[r as usize].db_held {
                return None;
            }
            lease::read_back(s, n, r, t, &task);
        }
        Phase::Look => look(m, s, n, r, t, &task),
        Phase::Write(d) => write(m, s, n, r, t, &task, d),
        Phase::MarkUnsent => lease::mark_unsent(m, s, n, r, t, &task),
        Phase::Reply(rp) => super::finish(s, n, r, t, rp),
        Phase::PreSend | Phase::AwaitNova => return None,
    }
    Some(())
}

/// A reconciler pass's look, and what it leads to. It reads the row as
/// its claim returned it (`saw_unsent`) and the settle window as the
/// database's clock has it now.
fn look(m: &LeaseModel, s: &State, n: &mut State, r: u8, t: u8, task: &Task) {
    let op = task.op as usize;
    let row = &s.rows[op];
    let unsent = m.guards.unsent_mark && task.saw_unsent;
    let next = if wanted(s, task.op) {
        Phase::Write(Decision::Succeeded)
    } else if m.guards.settle_window && !row.settled && !unsent {
        if s.ghost.window_ended[op] {
            n.ghost.window_waited_again = true;
        }
        Phase::Write(Decision::Defer)
    } else {
        if row.settled {
            n.ghost.window_ended[op] = true;
        }
        if !row.deadline && row.attempts < MAX_ATTEMPTS {
            // A re-send within the operation's deadline: the pass becomes
            // the run (same lease, same epoch).
            Phase::RecordAttempt
        } else {
            Phase::Write(Decision::Failed)
        }
    };
    n.replicas[r as usize].tasks[t as usize].phase = next;
}

fn write(m: &LeaseModel, s: &State, n: &mut State, r: u8, t: u8, task: &Task, d: Decision) {
    if !fence_passes(m, s, task) {
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
            forget(n, task.op);
            Some(answer_of(state))
        }
        Decision::Unknown => {
            row.state = RowState::Unknown;
            stamp(n, task.op);
            Some(Answer::Unknown)
        }
        Decision::Defer => {
            row.state = RowState::Unknown;
            // `next_attempt_at`: the window's end; or now, for a row marked
            // unsent since the pass read it.
            let keep_due = m.guards.deferral_keeps_unsent_due && row.unsent && !task.saw_unsent;
            row.wait_settle = !row.settled && !keep_due;
            None
        }
    };
    reply(s, n, r, t, Reply::Written(answer));
}

/// The gate, then the request's first byte.
pub(super) fn send(m: &LeaseModel, s: &State, n: &mut State, r: u8, t: u8) -> Option<()> {
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
        if !lease::renews(m, s, r, op) {
            lease::lose(s, n, r, t);
            return Some(());
        }
        lease::confirm(n, r, op);
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

pub(super) fn read_answer(s: &State, n: &mut State, r: u8, t: u8) -> Option<()> {
    let task = task_of(s, r, t).filter(|k| k.phase == Phase::AwaitNova)?;
    let key = (r, task.op, task.attempt);
    let i = s.answers.iter().position(|x| *x == key)?;
    n.answers.remove(i);
    n.replicas[r as usize].tasks[t as usize].phase = Phase::Write(Decision::Succeeded);
    Some(())
}

pub(super) fn nova_act(s: &State, n: &mut State, i: u8, answered: bool) -> Option<()> {
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

/// The settle window after the last stamp passes: Nova has given up on
/// every request that left within its margin; one that left later may
/// still act. A claim that waited for it (a deferral's `next_attempt_at`)
/// may come now.
pub(super) fn settle(s: &State, n: &mut State, op: u8) -> Option<()> {
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
    if row.wait_settle {
        if s.ghost.unsent_known[op as usize] {
            n.ghost.unsent_waited = true;
        }
        if s.ghost.window_ended[op as usize] {
            n.ghost.window_waited_again = true;
        }
    }
    n.rows[op as usize].settled = true;
    n.nova.retain(|q| q.op != op || !q.prompt);
    Some(())
}

pub(super) fn deadline(s: &State, n: &mut State, op: u8) -> Option<()> {
    let row = &s.rows[op as usize];
    if row.state == RowState::Absent || row.state.decided() || row.deadline {
        return None;
    }
    n.rows[op as usize].deadline = true;
    // The caller's deadline is the operation's: it is answered then,
    // whatever runs (DEADLINE_EXCEEDED, outcome unknown).
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
    Some(())
}
