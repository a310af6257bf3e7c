//! What a chaos run tells: the count of what it played (histories, calls,
//! faults, happenings, kills, database faults, checks), and each failing
//! history with its violations, the smallest history that still shows
//! them, and the ledger rows, answers, outages and effects involved.

use std::collections::BTreeMap;
use std::time::Duration;

use super::check::{self, Violation};
use super::history::{Happening, History};
use super::play::{self, Played};
use crate::sim;

/// One failing history.
pub struct Failure {
    pub seed: u64,
    pub violations: Vec<Violation>,
    /// The smallest history that still failed (the original when not
    /// shrunk).
    pub history: History,
    /// The ledger rows involved, and their logs.
    pub rows: String,
}

/// What a run did.
#[derive(Default)]
pub struct Summary {
    pub histories: u64,
    pub operations: u64,
    pub calls: u64,
    pub faults: BTreeMap<String, u64>,
    pub happenings: BTreeMap<String, u64>,
    pub kills: u64,
    /// Database faults played (and skipped), by kind.
    pub db_faults: BTreeMap<String, u64>,
    /// Where the ledger was.
    pub ledger: String,
    pub checks: u64,
    pub failures: Vec<Failure>,
    pub elapsed: Duration,
}

fn fault_name(f: &sim::Fault) -> String {
    let json = serde_json::to_value(f).unwrap_or_default();
    json["kind"].as_str().unwrap_or("fault").to_string()
}

fn happening_name(h: &Happening) -> &'static str {
    match h {
        Happening::DeleteServer(_) => "server deleted",
        Happening::DeleteVolume(_) => "volume deleted",
        Happening::AttachOutOfBand { .. } => "out-of-band attach",
        Happening::DetachOutOfBand { .. } => "out-of-band detach",
        Happening::Reconcile(_) => "operator reconcile",
        Happening::Resolve(..) => "operator resolve",
        Happening::Db(_) => "database fault drawn",
    }
}

/// The ledger rows a violation names, with their logs.
fn rows_of(p: &Played, violations: &[Violation]) -> String {
    let mut out = String::new();
    for r in &p.ops {
        if !violations.iter().any(|v| v.operation == Some(r.op.id)) {
            continue;
        }
        let o = &r.op;
        out.push_str(&format!(
            "  operation {} key {:?} caller {:?} {} server {} volume {}: {} {:?} reason {:?} drifted={} created {} decided {:?} deadline {}\n",
            o.id,
            o.idempotency_key,
            o.caller,
            o.action.as_str(),
            o.server_id,
            o.volume_id,
            o.state.as_str(),
            o.resolution.map(|r| r.as_str()),
            o.last_error.as_ref().map(|e| e.reason.to_string()),
            o.drifted,
            o.created_at,
            o.completed_at,
            o.deadline_at,
        ));
        for e in &r.events {
            out.push_str(&format!(
                "      {} {:<10} {:<16} {}\n",
                e.at.format("%H:%M:%S%.3f"),
                e.replica,
                e.kind,
                e.detail
            ));
        }
    }
    for a in &p.answers {
        out.push_str(&format!(
            "  answer to call {} ({} key {:?}, by {}) sent {} answered {}: {}\n",
            a.call,
            a.caller,
            a.key,
            a.replica.as_deref().unwrap_or("-"),
            a.sent_at.format("%H:%M:%S%.3f"),
            a.answered_at.format("%H:%M:%S%.3f"),
            match &a.outcome {
                play::Outcome::Decided { op_id, state } => format!("{} {op_id}", state.as_str()),
                play::Outcome::Refused {
                    code,
                    reason,
                    op_id,
                    message,
                    ..
                } => format!("{code:?} {reason} {op_id:?}: {message}"),
                play::Outcome::Cancelled => "cancelled".into(),
            }
        ));
    }
    let first = p.answers.iter().map(|a| a.sent_at).min();
    for o in &p.outages {
        if first.is_some_and(|f| o.until(chrono::Utc::now()) >= f - chrono::Duration::seconds(30)) {
            let latency = o
                .latency
                .map(|l| format!(" ({} ms replies)", l.as_millis()))
                .unwrap_or_default();
            out.push_str(&format!(
                "  database: {}{latency} on {} from {} to {}\n",
                o.what,
                o.replica.as_deref().unwrap_or("every replica"),
                o.from.format("%H:%M:%S%.3f"),
                o.to.map_or("-".into(), |t| t.format("%H:%M:%S%.3f").to_string()),
            ));
        }
    }
    for e in &p.effects {
        out.push_str(&format!(
            "  effect {} {:?} server {} volume {} by {:?}\n",
            e.at.format("%H:%M:%S%.3f"),
            e.change,
            e.server_id,
            e.volume_id,
            e.cause
        ));
    }
    out
}

/// Counts one played history and keeps it when it broke an invariant.
pub(super) fn record(
    summary: &mut Summary,
    progress: Option<&crate::cli::output::Progress>,
    played: Played,
    violations: Vec<Violation>,
) {
    tally(summary, &played);
    if violations.is_empty() {
        return;
    }
    if let Some(p) = progress {
        p.println(format!(
            "history {} broke {} invariant(s)",
            played.history.seed,
            violations.len()
        ));
    }
    summary.failures.push(Failure {
        seed: played.history.seed,
        rows: rows_of(&played, &violations),
        violations,
        history: played.history,
    });
}

fn tally(s: &mut Summary, p: &Played) {
    s.histories += 1;
    s.operations += p.ops.len() as u64;
    s.calls += p.answers.len() as u64;
    s.checks += (check::INVARIANTS.len() * p.ops.len().max(1)) as u64;
    for c in &p.history.calls {
        for f in &c.faults {
            *s.faults.entry(fault_name(&f.fault)).or_default() += 1;
        }
    }
    for t in &p.history.happenings {
        *s.happenings
            .entry(happening_name(&t.what).to_string())
            .or_default() += 1;
    }
}

impl Summary {
    /// The summary table and every failure, as printed.
    pub fn report(&self) -> String {
        use crate::cli::output::{align_right, plain_table};
        let mut t = plain_table(["", "count"]);
        t.add_row(vec!["histories".to_string(), self.histories.to_string()]);
        t.add_row(vec!["calls".to_string(), self.calls.to_string()]);
        t.add_row(vec!["operations".to_string(), self.operations.to_string()]);
        for (k, v) in &self.faults {
            t.add_row(vec![format!("fault: {k}"), v.to_string()]);
        }
        for (k, v) in &self.happenings {
            t.add_row(vec![k.clone(), v.to_string()]);
        }
        t.add_row(vec!["replicas killed".to_string(), self.kills.to_string()]);
        for (k, v) in &self.db_faults {
            t.add_row(vec![format!("database: {k}"), v.to_string()]);
        }
        t.add_row(vec![
            "invariant checks".to_string(),
            self.checks.to_string(),
        ]);
        t.add_row(vec![
            "violations".to_string(),
            self.failures
                .iter()
                .map(|f| f.violations.len())
                .sum::<usize>()
                .to_string(),
        ]);
        align_right(&mut t, &[1]);
        let mut out = format!(
            "{t}\n  ledger: {}\n  took {:.0} s\n",
            self.ledger,
            self.elapsed.as_secs_f64()
        );
        for f in &self.failures {
            out.push_str(&format!("\nseed {} broke:\n", f.seed));
            for v in &f.violations {
                out.push_str(&format!("  - {v}\n"));
            }
            out.push_str(&format!("{}", f.history));
            out.push_str("ledger rows and effects involved:\n");
            out.push_str(&f.rows);
        }
        out
    }
}
