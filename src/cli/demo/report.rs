//! The demo's verdict: the ledger against what Nova really did, the
//! truth table, the callers' view, and the story of one lost response.

use std::collections::BTreeMap;
use std::sync::Arc;

use uuid::Uuid;

use super::faults::Plan;
use super::{Tally, lock, ms};
use crate::cli::output::{align_right, bare_table, plain_table, quantile};
use crate::domain::{Action, CallerKey, Reason, Resolution, State};
use crate::executor::metrics::ExecutorMetrics;
use crate::sim;
use crate::store::Store;

/// The ledger against what Nova really did.
#[derive(Default)]
pub struct Verdict {
    by_outcome: BTreeMap<(String, String), usize>,
    pub disagreements: Vec<String>,
    pub twice: usize,
    /// Attaches the hypervisor rolled back after Nova's 200, and how many
    /// of them the ledger decided FAILED `ATTACH_ROLLED_BACK` when it
    /// answered (not drift found later).
    pub rolled_back: usize,
    pub rolled_back_decided: usize,
    /// Decided operations the verifier reported as drifted.
    pub drifted: usize,
    /// An attach whose response was lost and whose outcome an observation decided.
    pub story: Option<Uuid>,
}

pub async fn compare(store: &dyn Store, sim: &sim::Sim, plan: &Plan) -> anyhow::Result<Verdict> {
    let mut verdict = Verdict::default();
    for (s, v) in &plan.volumes {
        let att = store
            .operation_get_by_key(&CallerKey::parse(None, &format!("demo-attach-{v}"))?)
            .await?;
        let det = store
            .operation_get_by_key(&CallerKey::parse(None, &format!("demo-detach-{v}"))?)
            .await?;
        // Effects that stood: a rolled-back attach did not attach.
        let rollbacks = sim.rollbacks(*v);
        let effects = sim.attach_effects(*v).saturating_sub(rollbacks);
        if rollbacks > 0 {
            verdict.rolled_back += 1;
            if att.as_ref().is_some_and(|o| {
                o.state == State::Failed
                    && o.resolution == Some(Resolution::Reobserved)
                    && o.last_error
                        .as_ref()
                        .is_some_and(|e| e.reason == Reason::AttachRolledBack)
            }) {
                verdict.rolled_back_decided += 1;
            }
        }
        verdict.drifted += att.iter().chain(det.iter()).filter(|o| o.drifted).count();
        if effects > 1 {
            verdict.twice += 1;
        }
        let attached_now = sim.is_attached(*s, *v);
        let attach_ok = att.as_ref().is_some_and(|o| o.state == State::Succeeded);
        let detach_ok = det.as_ref().is_some_and(|o| o.state == State::Succeeded);
        if attach_ok != (effects >= 1) {
            verdict.disagreements.push(format!(
                "attach of {v}: ledger says {}, Nova attached it {effects} times",
                if attach_ok { "succeeded" } else { "failed" }
            ));
        }
        if attached_now != (attach_ok && !detach_ok) {
            verdict.disagreements.push(format!(
                "detach of {v}: ledger says {}, Nova still lists it: {attached_now}",
                if detach_ok { "succeeded" } else { "failed" }
            ));
        }
        for op in att.iter().chain(det.iter()) {
            let res = op.resolution.map(Resolution::as_str).unwrap_or("-");
            *verdict
                .by_outcome
                .entry((op.state.as_str().to_string(), res.to_string()))
                .or_default() += 1;
            if verdict.story.is_none()
                && op.action == Action::Attach
                && op.resolution == Some(Resolution::Reobserved)
                && op.attempts == 1
            {
                verdict.story = Some(op.id);
            }
        }
    }
    Ok(verdict)
}

pub fn print_report(verdict: &Verdict, metrics: &[Arc<ExecutorMetrics>], tally: &Tally) {
    let lost: u64 = metrics.iter().map(|m| m.responses_lost.get()).sum();
    let recovered: u64 = metrics.iter().map(|m| m.responses_recovered.get()).sum();
    let mut lat = lock(&tally.latencies).clone();
    lat.sort();
    let pct = |p: f64| ms(quantile(&lat, p).unwrap_or_default());
    let codes = lock(&tally.codes).clone();
    let mut table = plain_table(["OUTCOME", "DECIDED BY", "OPERATIONS"]);
    for ((state, res), n) in &verdict.by_outcome {
        table.add_row([state.clone(), res.clone(), n.to_string()]);
    }
    align_right(&mut table, &[2]);
    crate::say!();
    crate::say!("{}", table.trim_fmt());
    crate::say!();
    let mut facts = bare_table();
    facts.add_row([
        "responses lost (timeouts, resets, 5xx)".to_string(),
        lost.to_string(),
        String::new(),
    ]);
    facts.add_row([
        "...outcome then established by observation".to_string(),
        recovered.to_string(),
        "(the rest went to retries or the reconciler)".to_string(),
    ]);
    facts.add_row([
        "attaches that took effect twice".to_string(),
        verdict.twice.to_string(),
        "(must be 0)".to_string(),
    ]);
    facts.add_row([
        "attaches rolled back after Nova's 200".to_string(),
        verdict.rolled_back.to_string(),
        format!(
            "({} decided FAILED ATTACH_ROLLED_BACK when answered, by Cinder)",
            verdict.rolled_back_decided
        ),
    ]);
    facts.add_row([
        "drift reported (a change no operation explains)".to_string(),
        verdict.drifted.to_string(),
        "(must be 0: every change here is the demo's own)".to_string(),
    ]);
    facts.add_row([
        "ledger rows that disagree with Nova's truth".to_string(),
        verdict.disagreements.len().to_string(),
        "(must be 0)".to_string(),
    ]);
    align_right(&mut facts, &[1]);
    crate::say!("{}", facts.trim_fmt());
    crate::say!(
        "  caller latency   p50 {}   p90 {}   p99 {}   max {}",
        pct(0.5),
        pct(0.9),
        pct(0.99),
        pct(1.0)
    );
    let answered: Vec<String> = codes.iter().map(|(c, n)| format!("{c} {n}")).collect();
    crate::say!("  calls answered   {}", answered.join(", "));
    for d in verdict.disagreements.iter().take(10) {
        crate::say!("  DISAGREES: {d}");
    }
}

pub async fn print_story(store: &dyn Store, id: Uuid) -> anyhow::Result<()> {
    crate::say!();
    crate::say!("  the story of one lost response ({id}):");
    let mut table = plain_table(["AT", "EVENT", "DETAIL"]);
    for e in store.operation_events(id).await? {
        table.add_row([
            e.at.format("%H:%M:%S%.3f").to_string(),
            e.kind.clone(),
            e.detail.clone(),
        ]);
    }
    for line in table.lines() {
        crate::say!("  {}", line.trim_end());
    }
    Ok(())
}

/// The verifier at work: one more attach, whose attachment someone else
/// then removes behind the service's back; waits (up to `within`) until
/// the verifier reports it, and says how long that took.
pub async fn real_drift(
    client: &crate::client::Client,
    store: &dyn Store,
    sim: &sim::Sim,
    server: Uuid,
    within: std::time::Duration,
) -> anyhow::Result<()> {
    let v = Uuid::new_v4();
    let op = client
        .attach(
            &format!("demo-drift-{v}"),
            &server.to_string(),
            &v.to_string(),
            Default::default(),
            std::time::Duration::from_secs(10),
        )
        .await
        .map_err(|e| anyhow::anyhow!("the drift example's attach: {e}"))?;
    let id: Uuid = op.id.parse()?;
    anyhow::ensure!(
        sim.detach_out_of_band(server, v),
        "the drift example's attachment was not there to remove"
    );
    let removed = tokio::time::Instant::now();
    let by = removed + within;
    while tokio::time::Instant::now() < by {
        if store.operation_get(id).await?.is_some_and(|o| o.drifted) {
            crate::say!(
                "  an attachment removed behind the service's back: reported as drift {} later (ops list --drifted)",
                ms(removed.elapsed())
            );
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    anyhow::bail!(
        "an attachment removed behind the service's back was not reported as drift within {}",
        ms(within)
    )
}
