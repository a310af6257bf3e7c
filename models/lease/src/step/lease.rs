//! Who holds an operation: the intent, claims, renewals, expiry, a lease
//! heard lost and the unsent mark that follows, and a replica's crash.

use super::{in_hold, reply, task_of};
use crate::{Answer, Caller, LeaseModel, Phase, Reply, RowState, State, Task};

/// A caller's submission to replica `r`: the intent row (its first
/// attempt counted under epoch 1, leased to `r`) and the executor task.
/// `reply_lost`: the intent committed but its reply was lost; the caller
/// is answered at once (outcome unknown) and the task reads the row back
/// (`intent_fate`). With `r`'s replies held, the task hears late.
pub(super) fn submit(s: &State, n: &mut State, op: u8, r: u8, reply_lost: bool) -> Option<()> {
    let rep = &s.replicas[r as usize];
    let row = &s.rows[op as usize];
    // One open operation per volume (VOLUME_BUSY): the detach comes once
    // the attach is decided.
    if row.state != RowState::Absent
        || rep.paused
        || (reply_lost && rep.db_held)
        || (op > 0 && !s.rows[op as usize - 1].state.decided())
    {
        return None;
    }
    let row = &mut n.rows[op as usize];
    row.state = RowState::InProgress;
    row.owner = Some(r);
    row.epoch = 1;
    row.attempts = 1;
    row.attempt_epoch = 1;
    let mut task = Task {
        op,
        epoch: 1,
        phase: Phase::PreSend,
        known_live: true,
        held: false,
        caller: true,
        attempt: 1,
        prompt: true,
        saw_unsent: false,
    };
    if reply_lost {
        n.callers[op as usize] = Caller::Answered(Answer::Unknown);
        task.caller = false;
        task.phase = Phase::ReadBack;
        task.known_live = false;
        // The read back may take longer than the settle window's margin.
        task.prompt = false;
    } else {
        n.callers[op as usize] = Caller::Waiting(r);
        if rep.db_held {
            task.phase = Phase::Reply(Reply::Recorded);
            task.held = true;
            task.prompt = false;
        }
    }
    n.replicas[r as usize].tasks.push(task);
    Some(())
}

/// The reconciler of `r` claims `op` (`heard`: and hears its reply; else
/// the row is `r`'s under the new epoch and no task works on it: it lapses
/// after one lease, as one the claim cannot release does).
pub(super) fn claim(
    m: &LeaseModel,
    s: &State,
    n: &mut State,
    op: u8,
    r: u8,
    heard: bool,
) -> Option<()> {
    let rep = &s.replicas[r as usize];
    let row = &s.rows[op as usize];
    let free = row.owner.is_none() || row.expired;
    let own_run = rep.tasks.iter().any(|k| k.op == op);
    if rep.paused
        || (!heard && rep.db_held)
        || row.state == RowState::Absent
        || row.state.decided()
        || !free
        || (row.wait_settle && !row.settled)
        || (m.guards.claim_skips_own_runs && own_run)
    {
        return None;
    }
    // A takeover: every request of the old holder left before its lease
    // ended, so the window from that end covers them all; a lease under
    // which no attempt was recorded, or whose attempt is known unsent,
    // sent nothing, and the window stands.
    let attempted = row.attempt_epoch == row.epoch && !row.unsent;
    if m.guards.takeover_restamps
        && row.owner.is_some()
        && (attempted || !m.guards.restamp_needs_an_attempt)
    {
        n.rows[op as usize].settled = false;
        for q in n.nova.iter_mut().filter(|q| q.op == op) {
            q.prompt = true;
        }
    }
    let saw_unsent = row.unsent;
    let row = &mut n.rows[op as usize];
    row.owner = Some(r);
    row.epoch += 1;
    row.expired = false;
    let epoch = row.epoch;
    // A hold under a newer epoch starts afresh: nothing confirms it until
    // a renewal (`Holds::hold`), for every task of `r` on the operation.
    for task in n.replicas[r as usize].tasks.iter_mut() {
        if task.op == op {
            task.known_live = false;
        }
    }
    if heard {
        n.replicas[r as usize].tasks.push(Task {
            op,
            epoch,
            phase: Phase::Look,
            known_live: false,
            held: rep.db_held,
            caller: false,
            attempt: 0,
            prompt: true,
            saw_unsent,
        });
    }
    Some(())
}

/// The epoch replica `r` holds `op` under: one hold per operation (its
/// newest epoch), whatever number of tasks work on it there.
fn hold_epoch(s: &State, r: u8, op: u8) -> Option<u8> {
    s.replicas[r as usize]
        .tasks
        .iter()
        .filter(|k| k.op == op && in_hold(k))
        .map(|k| k.epoch)
        .max()
}

/// Would renewing `r`'s hold of `op` succeed (`RENEW_LEASES`: the owner,
/// the epoch when the guard holds, still open)?
pub(super) fn renews(m: &LeaseModel, s: &State, r: u8, op: u8) -> bool {
    let row = &s.rows[op as usize];
    let Some(epoch) = hold_epoch(s, r, op) else {
        return false;
    };
    row.owner == Some(r) && !row.state.decided() && (!m.guards.renewal_epoch || row.epoch == epoch)
}

/// A renewal of `r`'s hold of `op` came back renewed: the lease holds, as
/// every task of `r` on it knows (`Holds::confirm` is per operation).
pub(super) fn confirm(n: &mut State, r: u8, op: u8) {
    n.rows[op as usize].expired = false;
    for task in n.replicas[r as usize].tasks.iter_mut() {
        if task.op == op && in_hold(task) {
            task.known_live = true;
        }
    }
}

/// Heard that the lease is lost (a renewal, the gate, a read back or a
/// write found the row another's or decided): the caller is answered from
/// the row, or waits for its decision as a replay would; a run whose
/// recorded attempt never passed the gate goes on to mark it unsent, any
/// other stops.
pub(super) fn lose(s: &State, n: &mut State, r: u8, t: u8) {
    let task = n.replicas[r as usize].tasks[t as usize].clone();
    if task.caller {
        let row = &s.rows[task.op as usize];
        n.callers[task.op as usize] = if row.state.decided() {
            Caller::Answered(super::answer_of(row.state))
        } else {
            Caller::Joined(r)
        };
    }
    let never_sent = matches!(task.phase, Phase::PreSend | Phase::ReadBack) && task.attempt > 0;
    if never_sent {
        let k = &mut n.replicas[r as usize].tasks[t as usize];
        k.phase = Phase::MarkUnsent;
        k.caller = false;
        k.known_live = false;
    } else {
        n.replicas[r as usize].tasks.remove(t as usize);
    }
}

/// The heartbeat renews the hold of task `t`'s operation.
pub(super) fn renew(m: &LeaseModel, s: &State, n: &mut State, r: u8, t: u8) -> Option<()> {
    let task = task_of(s, r, t)?.clone();
    if s.replicas[r as usize].db_held || matches!(task.phase, Phase::Reply(_)) || !in_hold(&task) {
        return None;
    }
    if renews(m, s, r, task.op) {
        let all_known = s.replicas[r as usize]
            .tasks
            .iter()
            .filter(|k| k.op == task.op && in_hold(k))
            .all(|k| k.known_live);
        if all_known && !s.rows[task.op as usize].expired {
            return None;
        }
        confirm(n, r, task.op);
    } else {
        lose(s, n, r, t);
    }
    Some(())
}

/// After a lost intent reply: the row read back (`intent_fate`); still
/// this replica's under the intent's epoch and open, its lease renewed
/// (`renew_intent`) and the run goes on; decided, the run ends; else taken
/// over before anything of it was sent: it says so.
pub(super) fn read_back(s: &State, n: &mut State, r: u8, t: u8, task: &Task) {
    let row = &s.rows[task.op as usize];
    if row.state.decided() {
        n.replicas[r as usize].tasks.remove(t as usize);
    } else if row.owner == Some(r) && row.epoch == task.epoch {
        n.replicas[r as usize].tasks[t as usize].phase = Phase::PreSend;
        confirm(n, r, task.op);
    } else {
        lose(s, n, r, t);
    }
}

/// The unsent mark (`MARK_UNSENT`): the run's attempt, if it is still the
/// row's last and the row open, is marked never sent and due for a pass
/// now. Then the run stops: its holder is gone, having said what it knew.
pub(super) fn mark_unsent(m: &LeaseModel, s: &State, n: &mut State, r: u8, t: u8, task: &Task) {
    let op = task.op as usize;
    let row = &s.rows[op];
    let its = row.attempt_epoch == task.epoch && row.attempts == task.attempt;
    let open = !row.state.decided();
    if its && open {
        n.ghost.unsent_known[op] = true;
    }
    if m.guards.unsent_mark && its && (open || !m.guards.fence_open) {
        n.rows[op].unsent = true;
        n.rows[op].wait_settle = false;
    }
    reply(s, n, r, t, Reply::Written(None));
}

/// A lease expires only when its holder cannot renew it within the
/// round-trip bound: paused, its replies held, or no task holding it.
pub(super) fn expire(m: &LeaseModel, s: &State, n: &mut State, op: u8) -> Option<()> {
    let row = &s.rows[op as usize];
    let owner = row.owner?;
    if row.expired || row.state.decided() {
        return None;
    }
    let rep = &s.replicas[owner as usize];
    let renewing = rep
        .tasks
        .iter()
        .any(|k| k.op == op && !k.held && in_hold(k) && renews(m, s, owner, op));
    let live = !rep.paused && !rep.db_held && renewing;
    // A slow database (replies within the round-trip bound) keeps a
    // lease sized for it.
    let lapses_when_slow = rep.slow && !m.guards.lease_outlasts_slow_renewals;
    if live && !lapses_when_slow {
        return None;
    }
    if live {
        n.ghost.live_lease_lapsed = true;
    }
    n.rows[op as usize].expired = true;
    for rep in n.replicas.iter_mut() {
        for task in rep.tasks.iter_mut().filter(|k| k.op == op) {
            task.known_live = false;
        }
    }
    Some(())
}

/// The replica restarts with nothing running (and fresh connections).
pub(super) fn crash(n: &mut State, r: u8) {
    let rep = &mut n.replicas[r as usize];
    rep.tasks.clear();
    rep.paused = false;
    rep.db_held = false;
    rep.slow = false;
    n.answers.retain(|x| x.0 != r);
    for c in n.callers.iter_mut() {
        if matches!(*c, Caller::Waiting(x) | Caller::Joined(x) if x == r) {
            *c = Caller::Answered(Answer::Unknown);
        }
    }
}
