//! The reconcile log as callers and operators read it — `ListOperationEvents`,
//! `ops show` and the `WatchOperation` stream — for each path an operation
//! can take (plain, lost response, reconciler, operator, drift), held
//! against golden files under `tests/golden/reconcile_log/` recorded before
//! the ledger's storage of the log changed: whatever the storage, what
//! they show stays the same, on PostgreSQL and on the embedded store
//! alike. Values that differ from run to run (ids, times,
//! durations, ports, trace ids) are normalized; the order, kinds, details,
//! metadata keys and replicas are compared as they are.
//!
//! `UPDATE_GOLDEN=1 cargo test --test store reconcile_log::` rewrites the
//! files (review the diff: that is a change of what operators see).

use crate::support;

use std::collections::HashMap;
use std::time::Duration;

use support::lifecycle::{attach, ids, secs, with_history};
use support::{Ledger, TestApp, spawn_app, with_timeout};
use uuid::Uuid;
use volume_reconciler::grpc::pb;
use volume_reconciler::sim::{Fault, FaultOp, FaultRule};

/// Stable names for the run-to-run values of a text.
struct Normalizer {
    uuids: HashMap<String, usize>,
}

impl Normalizer {
    fn new() -> Self {
        Self {
            uuids: HashMap::new(),
        }
    }

    fn text(&mut self, s: &str) -> String {
        let mut out = String::new();
        let b = s.as_bytes();
        let mut i = 0;
        while i < b.len() {
            // A time as `ops show` prints it (2026-12-02 01:23:05.977Z).
            if i + 24 <= b.len() && is_time(&s[i..i + 24]) {
                out.push_str("<time>");
                i += 24;
                continue;
            }
            // A UUID (36 chars, 8-4-4-4-12 hex): its first-seen number.
            if i + 36 <= b.len() && is_uuid(&s[i..i + 36]) {
                let n = self.uuids.len() + 1;
                let n = *self.uuids.entry(s[i..i + 36].to_string()).or_insert(n);
                out.push_str(&format!("<uuid{n}>"));
                i += 36;
                continue;
            }
            // A run of hex of 16 or more (trace and span ids).
            let hex = b[i..].iter().take_while(|c| c.is_ascii_hexdigit()).count();
            if hex >= 16 {
                out.push_str("<hex>");
                i += hex;
                continue;
            }
            // A run of digits: kept when short (attempt numbers, statuses),
            // else a number (durations, ports, budgets).
            let digits = b[i..].iter().take_while(|c| c.is_ascii_digit()).count();
            if digits > 0 {
                let run = &s[i..i + digits];
                let keep = digits <= 3
                    && !out.ends_with(':')
                    && !out.ends_with("_ms=")
                    && !out.ends_with("times=")
                    && !s[i + digits..].starts_with(" ms")
                    && !s[i + digits..].starts_with("ms");
                out.push_str(if keep { run } else { "<n>" });
                i += digits;
                continue;
            }
            let c = s[i..].chars().next().expect("a char");
            out.push(c);
            i += c.len_utf8();
        }
        out
    }
}

fn is_time(s: &str) -> bool {
    s.len() == 24
        && s.char_indices().all(|(i, c)| match i {
            4 | 7 => c == '-',
            10 => c == ' ',
            13 | 16 => c == ':',
            19 => c == '.',
            23 => c == 'Z',
            _ => c.is_ascii_digit(),
        })
}

fn is_uuid(s: &str) -> bool {
    s.len() == 36
        && s.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        })
}

/// Metadata values that are measurements: their keys are compared, their
/// values normalized whatever they are.
fn measured(key: &str) -> bool {
    key.ends_with("_ms")
        || key.ends_with("_at")
        || key.ends_with("_after_first")
        || key == "times"
        || key == "elapsed"
        || key == "lease_epoch"
}

/// An operation's log as `ListOperationEvents` answers it, normalized; its
/// times must never go backwards.
async fn listed(app: &TestApp, id: Uuid, n: &mut Normalizer) -> String {
    let events = app
        .raw()
        .list_operation_events(pb::ListOperationEventsRequest {
            operation_id: id.to_string(),
        })
        .await
        .expect("the log")
        .into_inner()
        .events;
    let mut out = String::new();
    let mut last = None;
    for e in &events {
        let at = e.at.as_ref().expect("every event has its time");
        let at = (at.seconds, at.nanos);
        if let Some(prev) = last {
            assert!(at >= prev, "the log goes back in time: {events:?}");
        }
        last = Some(at);
        out.push_str(&format!(
            "{} {} | {}\n",
            e.replica,
            e.kind,
            n.text(&e.detail)
        ));
        let mut keys: Vec<_> = e.metadata.iter().collect();
        keys.sort();
        for (k, v) in keys {
            let v = if measured(k) {
                "<measured>".to_string()
            } else {
                n.text(v)
            };
            out.push_str(&format!("    {k}={v}\n"));
        }
    }
    out
}

/// What `ops show ID` prints for it, normalized.
async fn shown(app: &TestApp, id: Uuid, n: &mut Normalizer) -> String {
    // Not blocking: the server runs on this test's runtime.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_volume-reconciler"))
        .args(["ops", "show", &id.to_string(), "--server", &app.grpc_url])
        .env_remove("VOLUME_RECONCILER_TOKEN")
        .output()
        .await
        .expect("ops show runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    // Clock times of the log's lines (HH:MM:SS.mmm) are the run's own.
    text.lines()
        .map(|l| {
            let l = match l.find(|c: char| c.is_ascii_digit()) {
                Some(i) if l[i..].len() >= 12 && l.as_bytes()[i + 2] == b':' => {
                    format!("{}<time>{}", &l[..i], &l[i + 12..])
                }
                _ => l.to_string(),
            };
            n.text(&l)
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

/// The golden file `name`: compared, or written with `UPDATE_GOLDEN=1`.
fn golden(name: &str, actual: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/reconcile_log")
        .join(format!("{name}.txt"));
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (UPDATE_GOLDEN=1 records it)", path.display()));
    if expected != actual {
        panic!(
            "{name}: the reconcile log differs from {}\n--- expected\n{expected}\n--- actual\n{actual}",
            path.display()
        );
    }
}

async fn app(ledger: Ledger) -> TestApp {
    app_settling(ledger, "0s").await
}

async fn app_settling(ledger: Ledger, window: &str) -> TestApp {
    spawn_app(
        with_history(ledger)
            .arg("--settle-window", window)
            .arg("--verify-after", "300ms")
            .arg("--confirm-with", "nova-list"),
    )
    .await
}

async fn attach_once(app: &TestApp, key: &str, s: Uuid, v: Uuid, deadline: Duration) -> Uuid {
    // The answer is what it is (decided, or unknown): the log is the test.
    drop(
        app.raw()
            .attach_volume(with_timeout(attach(key, s, v), deadline))
            .await,
    );
    support::lifecycle::recorded(app, key).await.id
}

#[tokio::test]
async fn the_log_of_a_plain_attach() {
    plain(Ledger::Postgres).await;
}

#[tokio::test]
async fn the_log_of_a_plain_attach_on_the_embedded_store() {
    plain(Ledger::Embedded).await;
}

async fn plain(ledger: Ledger) {
    let app = app(ledger).await;
    let (s, v) = ids();
    let id = attach_once(&app, "plain", s, v, secs(10.0)).await;
    let mut n = Normalizer::new();
    golden("plain", &listed(&app, id, &mut n).await);
    // The watch of a decided operation: its one state, then the end.
    let mut stream = app
        .raw()
        .watch_operation(pb::WatchOperationRequest {
            operation_id: id.to_string(),
        })
        .await
        .unwrap()
        .into_inner();
    let mut states = String::new();
    while let Some(op) = stream.message().await.unwrap() {
        states.push_str(&format!(
            "{:?} {:?} attempts={}\n",
            pb::State::try_from(op.state).unwrap(),
            pb::Resolution::try_from(op.resolution).unwrap(),
            op.attempts
        ));
    }
    golden("plain_watch", &states);
    app.stop().await;
}

#[tokio::test]
async fn the_log_of_a_lost_response_and_ops_show() {
    lost_response(Ledger::Postgres).await;
}

#[tokio::test]
async fn the_log_of_a_lost_response_and_ops_show_on_the_embedded_store() {
    lost_response(Ledger::Embedded).await;
}

async fn lost_response(ledger: Ledger) {
    let app = app(ledger).await;
    let (s, v) = ids();
    app.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::CloseAfterEffect).volume(v));
    let id = attach_once(&app, "lost", s, v, secs(10.0)).await;
    let mut n = Normalizer::new();
    golden("lost_response", &listed(&app, id, &mut n).await);
    let mut n = Normalizer::new();
    golden("lost_response_ops_show", &shown(&app, id, &mut n).await);
    app.stop().await;
}

#[tokio::test]
async fn the_log_of_an_operation_the_reconciler_decides() {
    reconciler_decides(Ledger::Postgres).await;
}

#[tokio::test]
async fn the_log_of_an_operation_the_reconciler_decides_on_the_embedded_store() {
    reconciler_decides(Ledger::Embedded).await;
}

async fn reconciler_decides(ledger: Ledger) {
    // Long enough for Nova's late effect to come within it.
    let app = app_settling(ledger, "6s").await;
    let (s, v) = ids();
    // Nova attaches only after the caller's deadline: unknown, then the
    // reconciler sees it.
    app.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::DelayBeforeEffect { ms: 2500 }).volume(v),
    );
    let id = attach_once(&app, "late", s, v, secs(1.5)).await;
    // One pass, once Nova's late effect is there (passes before it would
    // each log a look: as many as the machine's speed makes).
    let sim = app.sim.clone();
    support::eventually(secs(10.0), "Nova's late effect", || {
        let sim = sim.clone();
        async move { sim.is_attached(s, v) }
    })
    .await;
    let op = support::lifecycle::reconcile_until(&app, id, secs(20.0), "decided", |op| {
        op.state.is_terminal()
    })
    .await;
    assert_eq!(op.state, volume_reconciler::domain::State::Succeeded);
    let mut n = Normalizer::new();
    golden("reconciler", &listed(&app, id, &mut n).await);
    app.stop().await;
}

#[tokio::test]
async fn the_log_of_an_operator_decision() {
    operator_decision(Ledger::Postgres).await;
}

#[tokio::test]
async fn the_log_of_an_operator_decision_on_the_embedded_store() {
    operator_decision(Ledger::Embedded).await;
}

async fn operator_decision(ledger: Ledger) {
    let app = app(ledger).await;
    let (s, v) = ids();
    // Every look fails: the operation stays unknown for people.
    app.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::DelayBeforeEffect { ms: 5000 }).volume(v),
    );
    let id = attach_once(&app, "operator", s, v, secs(1.5)).await;
    app.raw()
        .resolve_operation(pb::ResolveOperationRequest {
            operation_id: id.to_string(),
            state: pb::State::Failed as i32,
            reason: "checked on the hypervisor".into(),
        })
        .await
        .expect("resolved");
    let mut n = Normalizer::new();
    golden("operator", &listed(&app, id, &mut n).await);
    app.stop().await;
}

#[tokio::test]
async fn the_log_of_a_drift() {
    drift(Ledger::Postgres).await;
}

#[tokio::test]
async fn the_log_of_a_drift_on_the_embedded_store() {
    drift(Ledger::Embedded).await;
}

async fn drift(ledger: Ledger) {
    let app = app(ledger).await;
    let (s, v) = ids();
    let id = attach_once(&app, "drift", s, v, secs(10.0)).await;
    // Someone else's hand takes the volume off the server.
    assert!(app.sim.detach_out_of_band(s, v));
    support::lifecycle::reconcile_until(&app, id, secs(20.0), "drift is seen", |op| op.drifted)
        .await;
    let mut n = Normalizer::new();
    golden("drift", &listed(&app, id, &mut n).await);
    app.stop().await;
}
