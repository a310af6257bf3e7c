//! The ledger stays true over a volume's whole life (issue #15): one test
//! per numbered item, named after its scenario, through the real server
//! chain, the simulator over HTTP and its ground truth, on PostgreSQL and,
//! where the item concerns the store, on the embedded store too. Items 1
//! to 7 here (drift, deleted servers, live work, intents, late effects,
//! leases, windows); 8, 9 and 11 in `lifecycle_calls.rs`; 10 in
//! `store_conformance.rs`.
//!
//! Assertions are on final states and on what Nova really saw (the
//! simulator's truth, its request and effect logs), not on the exact
//! sequence of events, which may change with how a decision is confirmed.

use crate::on_both_ledgers;
use crate::support;

use std::sync::Arc;
use std::time::Duration;

use support::lifecycle::*;
use support::{AppOptions, Ledger, TestApp, error_info, eventually, spawn_app, with_timeout};
use tokio::time::Instant;
use tonic::Code;
use uuid::Uuid;
use volume_reconciler::domain::{OperationEvent, Reason, Resolution, State};
use volume_reconciler::grpc::pb;
use volume_reconciler::sim::{Fault, FaultOp, FaultRule, SimConfig};

// ---------------------------------------------------------------------
// 1. Drift is a change no recorded operation explains.
// ---------------------------------------------------------------------

/// Attach then detach of one volume (both succeeded): neither drifted. A
/// failed operation on a volume already in that state: no drift. An
/// attachment removed behind the service's back: drift, within the
/// verification window.
async fn drift_is_only_a_change_no_recorded_operation_explains(ledger: Ledger) {
    // Both verifications come 2 s after a decision (the verifier's floor).
    let app = spawn_app(
        with_history(ledger)
            .arg("--verify-after", "300ms")
            .arg("--verify-window", "1s"),
    )
    .await;
    let mut c = app.raw();
    let t = secs(10.0);
    let s = Uuid::new_v4();
    // A: attached, then detached by the service itself.
    let va = Uuid::new_v4();
    let a1 = c
        .attach_volume(with_timeout(attach("a-attach", s, va), t))
        .await
        .unwrap()
        .into_inner();
    let a2 = c
        .detach_volume(with_timeout(detach("a-detach", s, va), t))
        .await
        .unwrap()
        .into_inner();
    // C1: the attach is refused (device path in use) and FAILED; the
    // volume stays as it was before, attached nowhere.
    let vc1 = Uuid::new_v4();
    app.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::DeviceInUse).volume(vc1));
    let mut req = attach("c1-attach", s, vc1);
    req.device = "/dev/vdb".into();
    let e = c.attach_volume(with_timeout(req, t)).await.unwrap_err();
    assert_eq!(error_info(&e).0, "NOVA_DEVICE_IN_USE", "{e:?}");
    let c1 = error_info(&e).1["operation_id"].parse::<Uuid>().unwrap();
    // C2: attached to another server before; the attach here FAILED.
    let (elsewhere, vc2) = ids();
    app.sim.seed_attachment(elsewhere, vc2);
    let e = c
        .attach_volume(with_timeout(attach("c2-attach", s, vc2), t))
        .await
        .unwrap_err();
    assert_eq!(error_info(&e).0, "ALREADY_ATTACHED_ELSEWHERE", "{e:?}");
    let c2 = error_info(&e).1["operation_id"].parse::<Uuid>().unwrap();
    // B: attached, then detached behind the service's back (decided last,
    // so once its drift is recorded, the verifier has passed the others).
    let vb = Uuid::new_v4();
    let b = c
        .attach_volume(with_timeout(attach("b-attach", s, vb), t))
        .await
        .unwrap()
        .into_inner();
    assert!(app.sim.detach_out_of_band(s, vb));
    let b_id = id_of(&b);
    let b_row = reconcile_until(
        &app,
        b_id,
        secs(30.0),
        "the removed attachment is reported as drift",
        |op| op.drifted,
    )
    .await;
    let b_log = log(&app, b_id).await;
    let drift = b_log
        .iter()
        .find(|e| e.kind == "drift_detected")
        .expect("a drift event");
    let after = drift.at - b_row.completed_at.unwrap();
    assert!(
        after < chrono::Duration::seconds(2 + 8),
        "reported {after} after the decision: within the verification window (2 s here), give or take a loaded machine"
    );
    assert_eq!(
        b_row.state,
        State::Succeeded,
        "drift is reported, not acted on"
    );
    // Every verification of the others is due by now; one more round.
    app.reconciler.run_once().await.unwrap();
    for (what, id) in [
        ("the attach a later detach undid", id_of(&a1)),
        ("the detach", id_of(&a2)),
        ("the refused attach of a volume left as it was", c1),
        ("the refused attach of a volume attached elsewhere", c2),
    ] {
        let op = row(&app, id).await;
        assert!(!op.drifted, "{what} is not drift: {op:?}");
        assert_eq!(count(&log(&app, id).await, "drift_detected"), 0, "{what}");
    }
    let listed = c
        .list_operations(pb::ListOperationsRequest {
            drifted_only: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let drifted: Vec<Uuid> = listed.operations.iter().map(id_of).collect();
    assert_eq!(
        drifted,
        vec![b_id],
        "only the unexplained change is listed as drift"
    );
    // Ground truth: the one change nobody recorded is the out-of-band one.
    let truth = app.sim.truth();
    let oob: Vec<_> = truth
        .effects
        .iter()
        .filter(|e| e.cause == volume_reconciler::sim::Cause::OutOfBand)
        .map(|e| e.volume_id)
        .collect();
    assert_eq!(oob, vec![vb]);
    assert!(!app.sim.is_attached(s, va) && !app.sim.is_attached(s, vb));
    assert!(!app.sim.is_attached(s, vc1) && app.sim.is_attached(elsewhere, vc2));
    assert_eq!(app.sim.attach_effects(vc1), 0);
    app.stop().await;
}
on_both_ledgers!(drift_is_only_a_change_no_recorded_operation_explains);

// ---------------------------------------------------------------------
// 2. A server that no longer exists is an answer; nothing stays open
//    forever.
// ---------------------------------------------------------------------

/// An attach left UNKNOWN whose server is then deleted (an autoscaler's
/// scale-down) is decided FAILED NOVA_SERVER_NOT_FOUND at the next pass,
/// not deferred forever, and its volume is free for an attach elsewhere.
async fn an_unknown_attach_whose_server_is_deleted_fails_and_frees_its_volume(ledger: Ledger) {
    let app = spawn_app(with_history(ledger)).await; // settle windows: the defaults (31 min)
    let mut c = app.raw();
    let (s, v) = ids();
    let other = Uuid::new_v4();
    // A load balancer answers 504 and Nova never attaches: unknown.
    app.sim.add_fault(
        FaultRule::new(
            FaultOp::Attach,
            Fault::ProxyError {
                code: 504,
                effect: false,
            },
        )
        .volume(v),
    );
    let e = c
        .attach_volume(with_timeout(attach("lost", s, v), secs(4.0)))
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), error_info(&e).0.as_str()),
        (Code::DeadlineExceeded, "OUTCOME_UNKNOWN")
    );
    let id = recorded(&app, "lost").await.id;
    assert_eq!(row(&app, id).await.state, State::Unknown);
    let busy = c
        .attach_volume(with_timeout(attach("elsewhere-1", other, v), secs(5.0)))
        .await
        .unwrap_err();
    assert_eq!(
        error_info(&busy).0,
        "VOLUME_BUSY",
        "the open attach holds the volume"
    );
    app.sim.remove_server(s);
    let op = reconcile_until(
        &app,
        id,
        secs(15.0),
        "the attach to the deleted server is decided",
        |op| op.state.is_terminal(),
    )
    .await;
    assert_eq!(
        (op.state, op.resolution, reason(&op)),
        (
            State::Failed,
            Some(Resolution::Reconciler),
            Some(Reason::NovaServerNotFound)
        )
    );
    let ok = c
        .attach_volume(with_timeout(attach("elsewhere-2", other, v), secs(10.0)))
        .await
        .expect("the volume is free for an attach elsewhere")
        .into_inner();
    assert_eq!(ok.state, pb::State::Succeeded as i32);
    assert!(app.sim.is_attached(other, v));
    assert_eq!(
        app.sim.attach_effects(v),
        1,
        "only the attach elsewhere took effect"
    );
    app.stop().await;
}
on_both_ledgers!(an_unknown_attach_whose_server_is_deleted_fails_and_frees_its_volume);

/// A detach Nova accepted (202) whose server is deleted before the volume
/// left it: deleting the server detached the volume, so the detach has
/// SUCCEEDED.
async fn an_accepted_detach_whose_server_is_deleted_succeeded(ledger: Ledger) {
    let app = spawn_app(
        AppOptions {
            sim: SimConfig {
                record_history: true,
                // A guest that takes its time to let the volume go.
                detach_delay_ms: 60_000,
                ..SimConfig::default()
            },
            ..AppOptions::default()
        }
        .on(ledger),
    )
    .await;
    let (s, v) = ids();
    app.sim.seed_attachment(s, v);
    let e = app
        .raw()
        .detach_volume(with_timeout(detach("slow", s, v), secs(4.0)))
        .await
        .unwrap_err();
    assert_eq!(error_info(&e).0, "OUTCOME_UNKNOWN", "{e:?}");
    let id = recorded(&app, "slow").await.id;
    app.sim.remove_server(s);
    let op = reconcile_until(&app, id, secs(15.0), "the detach is decided", |op| {
        op.state.is_terminal()
    })
    .await;
    assert_eq!(
        (op.state, op.resolution),
        (State::Succeeded, Some(Resolution::Reconciler))
    );
    assert!(!app.sim.is_attached(s, v));
    assert_eq!(app.sim.detach_requests(v), 1, "one DELETE, not sent again");
    app.stop().await;
}
on_both_ledgers!(an_accepted_detach_whose_server_is_deleted_succeeded);

/// A detach refused while its server is locked, retried until the server
/// is deleted: Nova's 404 for the server is the answer, SUCCEEDED.
#[tokio::test]
async fn a_detach_retried_until_its_server_is_gone_succeeded() {
    let app = spawn_app(with_history(Ledger::Postgres)).await;
    let (s, v) = ids();
    app.sim.seed_attachment(s, v);
    app.sim.lock_server(s, true);
    let mut c = app.raw();
    let call = tokio::spawn(async move {
        c.detach_volume(with_timeout(detach("locked", s, v), secs(15.0)))
            .await
    });
    let sim = app.sim.clone();
    eventually(secs(10.0), "the locked server refused a detach", || {
        let sim = sim.clone();
        async move { sim.detach_requests(v) >= 1 }
    })
    .await;
    app.sim.remove_server(s);
    let op = call
        .await
        .unwrap()
        .expect("the detach succeeds")
        .into_inner();
    assert_eq!(
        (op.state, op.resolution),
        (pb::State::Succeeded as i32, pb::Resolution::Response as i32)
    );
    let row = row(&app, id_of(&op)).await;
    assert_eq!(row.state, State::Succeeded);
    assert!(!app.sim.is_attached(s, v));
    let truth = app.sim.truth();
    assert!(
        truth
            .effects
            .iter()
            .any(|e| e.volume_id == v && e.cause == volume_reconciler::sim::Cause::ServerDeleted),
        "the server's deletion detached it"
    );
    app.stop().await;
}

/// The server's attachments cannot be listed, pass after pass: past the
/// operation's deadline and settle window it is escalated (counted,
/// listed, left to people), not retried forever; identical failed looks
/// add nothing to the log.
async fn an_observation_error_that_persists_is_escalated_without_growing_the_log(ledger: Ledger) {
    let app = spawn_app(
        with_history(ledger)
            .arg("--settle-window", "1s")
            .arg("--reconcile-max-backoff", "1s"),
    )
    .await;
    let mut c = app.raw();
    let (s, v) = ids();
    app.sim.add_fault(
        FaultRule::new(
            FaultOp::Attach,
            Fault::ProxyError {
                code: 504,
                effect: false,
            },
        )
        .volume(v),
    );
    let e = c
        .attach_volume(with_timeout(attach("dark", s, v), secs(4.0)))
        .await
        .unwrap_err();
    assert_eq!(error_info(&e).0, "OUTCOME_UNKNOWN");
    let id = recorded(&app, "dark").await.id;
    // From now on every list of the server fails (Nova's 500).
    app.sim.add_fault(
        FaultRule::new(
            FaultOp::List,
            Fault::Status {
                code: 500,
                effect: false,
            },
        )
        .server(s)
        .always(),
    );
    // Rounds until it is escalated: count the passes, and the log's
    // length after the first.
    let passes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let after_first_pass = Arc::new(std::sync::Mutex::new(None));
    let (store, reconciler) = (app.store.clone(), app.reconciler.clone());
    eventually(secs(30.0), "the operation is escalated", || {
        let (store, reconciler) = (store.clone(), reconciler.clone());
        let (passes, first) = (passes.clone(), after_first_pass.clone());
        async move {
            let counts = reconciler.run_once().await.unwrap();
            passes.fetch_add(counts.claimed, std::sync::atomic::Ordering::SeqCst);
            let op = store.operation_get(id).await.unwrap().unwrap();
            if op.escalated_at.is_some() {
                return true;
            }
            if counts.claimed > 0 && first.lock().unwrap().is_none() {
                let n = store.operation_events(id).await.unwrap().len();
                *first.lock().unwrap() = Some(n);
            }
            false
        }
    })
    .await;
    let passes = passes.load(std::sync::atomic::Ordering::SeqCst);
    let after_first_pass = *after_first_pass.lock().unwrap();
    assert!(passes >= 3, "several passes looked and failed ({passes})");
    let events = log(&app, id).await;
    let before_escalation = after_first_pass.expect("a pass before the escalation");
    assert_eq!(
        events.len(),
        before_escalation + 1,
        "the failed looks after the first added nothing, the escalation one line: {events:#?}"
    );
    assert_eq!(count(&events, "escalated"), 1);
    let op = row(&app, id).await;
    assert_eq!(op.state, State::Unknown, "still open: people decide");
    assert_eq!(reason(&op), Some(Reason::NotObservable));
    // Not retried any more.
    let lists = app.sim.list_requests();
    for _ in 0..3 {
        assert_eq!(app.reconciler.run_once().await.unwrap().claimed, 0);
    }
    assert_eq!(app.sim.list_requests(), lists, "no more looks");
    assert_eq!(log(&app, id).await.len(), events.len());
    let listed = c
        .list_operations(pb::ListOperationsRequest {
            escalated_only: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        listed.operations.iter().map(id_of).collect::<Vec<_>>(),
        vec![id]
    );
    assert!(!listed.operations[0].escalation.is_empty());
    let escalated = metric(&app, "volume_reconciler_reconciler_decisions_total").await;
    assert!(
        escalated
            .iter()
            .any(|(k, v)| k.contains("escalated") && *v == 1.0),
        "counted: {escalated:?}"
    );
    assert_eq!(app.sim.attach_effects(v), 0);
    app.stop().await;
}
on_both_ledgers!(an_observation_error_that_persists_is_escalated_without_growing_the_log);

// ---------------------------------------------------------------------
// 3. ReconcileOperation never takes over live work.
// ---------------------------------------------------------------------

/// During an attach still waiting for Nova, ReconcileOperation on it (same
/// replica) reports the operation as it stands, or waits for its decision;
/// it never claims it. The caller gets Nova's answer, and the log shows
/// no takeover.
async fn reconcile_operation_on_a_live_attach_waits_and_never_takes_it_over(ledger: Ledger) {
    let app = spawn_app(with_history(ledger)).await;
    let (s, v) = ids();
    app.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::DelayBeforeEffect { ms: 10_000 }).volume(v),
    );
    let mut caller = app.raw();
    let call = tokio::spawn(async move {
        caller
            .attach_volume(with_timeout(attach("live", s, v), secs(30.0)))
            .await
    });
    let id = recorded(&app, "live").await.id;
    let mut operator = app.raw();
    let reconcile = |timeout: f64| {
        with_timeout(
            pb::ReconcileOperationRequest {
                operation_id: id.to_string(),
            },
            secs(timeout),
        )
    };
    // A short deadline (short against Nova's 10 s, with room for the
    // ledger reads on a loaded CI machine): the operation as it stands,
    // still Nova's to answer.
    let now = operator
        .reconcile_operation(reconcile(4.0))
        .await
        .expect("the current state, within the caller's deadline")
        .into_inner();
    assert_eq!(now.state, pb::State::InProgress as i32, "{now:?}");
    // A longer one: waits for the decision.
    let waited = operator
        .reconcile_operation(reconcile(20.0))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (waited.state, waited.resolution),
        (pb::State::Succeeded as i32, pb::Resolution::Response as i32)
    );
    let answer = call
        .await
        .unwrap()
        .expect("the caller gets Nova's answer")
        .into_inner();
    assert_eq!(
        (answer.state, answer.resolution),
        (pb::State::Succeeded as i32, pb::Resolution::Response as i32)
    );
    let events = log(&app, id).await;
    assert_eq!(count(&events, "claimed"), 0, "no takeover: {events:#?}");
    assert_eq!(
        count(&events, "unresolved"),
        0,
        "never written UNKNOWN: {events:#?}"
    );
    assert_eq!(count(&events, "response"), 1, "Nova's answer is in the log");
    assert!(app.sim.is_attached(s, v));
    assert_eq!(
        (app.sim.attach_requests(v), app.sim.attach_effects(v)),
        (1, 1)
    );
    app.stop().await;
}
on_both_ledgers!(reconcile_operation_on_a_live_attach_waits_and_never_takes_it_over);

// ---------------------------------------------------------------------
// 4. An intent always has a driver; a request is logged once it left.
// ---------------------------------------------------------------------

/// Holds every write to a service's ledger until released: on
/// PostgreSQL, an exclusive lock on the operations table in another
/// session; on the embedded store, the database's write lock held by
/// another connection.
enum WritesHeld {
    Postgres(support::pg::Admin),
    Embedded(sqlx::SqliteConnection),
}

impl WritesHeld {
    async fn take(app: &TestApp) -> Self {
        use sqlx::Connection as _;
        match app.ledger {
            Ledger::Postgres => {
                let mut admin = support::pg::Admin::connect(&app.db_url).await;
                admin
                    .run("BEGIN; LOCK TABLE operations IN EXCLUSIVE MODE")
                    .await;
                WritesHeld::Postgres(admin)
            }
            Ledger::Embedded => {
                let mut conn = sqlx::SqliteConnection::connect(&app.db_url).await.unwrap();
                sqlx::raw_sql("BEGIN IMMEDIATE")
                    .execute(&mut conn)
                    .await
                    .unwrap();
                WritesHeld::Embedded(conn)
            }
        }
    }

    /// Returns once the service's intent write waits behind the hold.
    async fn until_a_write_waits(&self, app: &TestApp) {
        match self {
            WritesHeld::Postgres(_) => {
                let url = app.db_url.clone();
                eventually(secs(15.0), "the intent write waits for the lock", || {
                    let url = url.clone();
                    async move { pg_waiting_inserts(&url).await > 0 }
                })
                .await;
            }
            WritesHeld::Embedded(_) => {
                // The embedded store has one connection: while the intent
                // write holds it (waiting for the file's write lock), a
                // read through the store waits too.
                let store = app.store.clone();
                eventually(secs(15.0), "the intent write holds the ledger", || {
                    let store = store.clone();
                    async move {
                        tokio::time::timeout(secs(1.0), store.operation_get(Uuid::nil()))
                            .await
                            .is_err()
                    }
                })
                .await;
            }
        }
    }

    async fn release(self) {
        match self {
            WritesHeld::Postgres(mut admin) => {
                admin.run("COMMIT").await;
            }
            WritesHeld::Embedded(mut c) => {
                sqlx::raw_sql("COMMIT").execute(&mut c).await.unwrap();
            }
        }
    }
}

/// Intent writes of the database at `url` waiting for a lock.
async fn pg_waiting_inserts(url: &str) -> i64 {
    support::pg::Admin::connect(url)
        .await
        .number(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'
               AND query ILIKE '%INSERT INTO operations%'",
        )
        .await
}

/// How many AttachVolume calls the service counted as cancelled (their
/// caller went away before the answer).
async fn cancelled_attaches(app: &TestApp) -> f64 {
    metric(app, "volume_reconciler_grpc_requests_total")
        .await
        .iter()
        .filter(|(k, _)| k.contains("method=\"AttachVolume\"") && k.contains("code=\"CANCELLED\""))
        .map(|(_, v)| v)
        .sum()
}

/// The caller disconnects while its intent write waits in the ledger: the
/// operation's own task records it and drives it to a true decision at
/// once (not left in progress until its deadline), and the log has one
/// request, the one Nova received.
async fn a_caller_gone_while_its_intent_write_waits_still_gets_a_true_decision(ledger: Ledger) {
    let app = spawn_app(with_history(ledger)).await;
    let (s, v) = ids();
    let held = WritesHeld::take(&app).await;
    let mut c = app.raw();
    let call = tokio::spawn(async move {
        c.attach_volume(with_timeout(attach("gone", s, v), secs(60.0)))
            .await
    });
    held.until_a_write_waits(&app).await;
    call.abort(); // the caller goes away (RST_STREAM)
    if app.ledger == Ledger::Postgres {
        // (On the embedded store even a metrics scrape waits for the one
        // connection the intent write holds; it is checked afterwards.)
        let app = &app;
        eventually(secs(10.0), "the service saw the caller go", || async move {
            cancelled_attaches(app).await >= 1.0
        })
        .await;
    }
    held.release().await;
    let id = recorded(&app, "gone").await.id;
    // Decided by its own task: well before the caller's 60 s deadline.
    let op = decided(&app, id, secs(15.0)).await;
    assert_eq!(
        (op.state, op.resolution),
        (State::Succeeded, Some(Resolution::Response))
    );
    assert!(app.sim.is_attached(s, v));
    let sent = count(&log(&app, id).await, "request_sent");
    assert_eq!(
        (sent, requests_of(&app, id).len()),
        (1, 1),
        "logged as Nova received it"
    );
    assert_eq!(cancelled_attaches(&app).await, 1.0, "the caller had gone");
    app.stop().await;
}
on_both_ledgers!(a_caller_gone_while_its_intent_write_waits_still_gets_a_true_decision);

/// The caller's deadline fires while its intent write waits in the
/// ledger: nothing was sent, so either nothing is recorded, or the
/// operation is decided at once as failed without a request; never an
/// operation left open (volume busy) that claims a request Nova never saw.
async fn a_deadline_that_fires_while_the_intent_write_waits_leaves_nothing_open(ledger: Ledger) {
    let app = spawn_app(with_history(ledger)).await;
    let (s, v) = ids();
    // One operation first: the ledger's connections have their statements
    // prepared, as in a service that has been running (a first statement
    // waits for the lock before it could even be run).
    let warm = app
        .raw()
        .attach_volume(with_timeout(attach("warm", s, Uuid::new_v4()), secs(10.0)))
        .await
        .unwrap();
    assert_eq!(warm.into_inner().state, pb::State::Succeeded as i32);
    let held = WritesHeld::take(&app).await;
    let mut c = app.raw();
    let call = tokio::spawn(async move {
        // 3 s: long enough for the check that the write waits (a 1 s
        // probe on the embedded store) to start before the deadline fires.
        c.attach_volume(with_timeout(attach("late", s, v), secs(3.0)))
            .await
    });
    held.until_a_write_waits(&app).await;
    let e = call.await.unwrap().expect_err("the deadline fired");
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
    held.release().await;
    if app.ledger == Ledger::Postgres {
        // The statement that waited has ended (committed or not).
        let url = app.db_url.clone();
        eventually(secs(10.0), "the intent write is done", || {
            let url = url.clone();
            async move { pg_waiting_inserts(&url).await == 0 }
        })
        .await;
    }
    let store = app.store.clone();
    eventually(secs(10.0), "no operation is left open", || {
        let store = store.clone();
        async move {
            store
                .operation_get_by_key(&crate::support::ck(None, "late"))
                .await
                .unwrap()
                .is_none_or(|op| op.state.is_terminal())
        }
    })
    .await;
    if let Some(op) = row_by_key(&app, "late").await {
        assert_eq!(op.state, State::Failed, "{op:?}");
        assert_eq!(count(&log(&app, op.id).await, "request_sent"), 0);
    }
    assert_eq!(app.sim.attach_requests(v), 0, "nothing reached Nova");
    // The volume is free at once.
    let ok = app
        .raw()
        .attach_volume(with_timeout(attach("again", s, v), secs(10.0)))
        .await
        .expect("the volume is not busy")
        .into_inner();
    assert_eq!(ok.state, pb::State::Succeeded as i32);
    app.stop().await;
}
on_both_ledgers!(a_deadline_that_fires_while_the_intent_write_waits_leaves_nothing_open);

// ---------------------------------------------------------------------
// 5. After a request that may still take effect, a refusal decides
//    nothing on one look, and nothing is sent again.
// ---------------------------------------------------------------------

/// Attempt 1 is answered 504 by a load balancer while Nova goes on; any
/// later attempt would be refused (409). The operation is UNKNOWN at the
/// caller's deadline, not FAILED; when the late effect lands the
/// reconciler decides SUCCEEDED; Nova received exactly one request.
#[tokio::test]
async fn an_attach_answered_504_while_nova_goes_on_is_unknown_then_succeeded_sent_once() {
    // (Passes come at most a second apart.)
    let app = spawn_app(with_history(Ledger::Postgres).arg("--reconcile-max-backoff", "1s")).await;
    let (s, v) = ids();
    app.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::LateEffect { ms: 10_000 }).volume(v));
    app.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::Conflict)
            .volume(v)
            .always(),
    );
    let e = app
        .raw()
        .attach_volume(with_timeout(attach("late", s, v), secs(5.0)))
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), error_info(&e).0.as_str()),
        (Code::DeadlineExceeded, "OUTCOME_UNKNOWN")
    );
    let id = recorded(&app, "late").await.id;
    assert_eq!(row(&app, id).await.state, State::Unknown, "not FAILED");
    let op = reconcile_until(&app, id, secs(30.0), "the late attach is seen", |op| {
        op.state.is_terminal()
    })
    .await;
    assert_eq!(
        (op.state, op.resolution),
        (State::Succeeded, Some(Resolution::Reconciler))
    );
    assert!(app.sim.is_attached(s, v));
    assert_eq!(
        requests_of(&app, id).len(),
        1,
        "never sent again while it could take effect"
    );
    assert_eq!(
        (app.sim.attach_requests(v), app.sim.attach_effects(v)),
        (1, 1)
    );
    app.stop().await;
}

/// The same for a detach: answered 504 while Nova goes on, UNKNOWN, then
/// SUCCEEDED once the volume is gone; one DELETE.
#[tokio::test]
async fn a_detach_answered_504_while_nova_goes_on_is_unknown_then_succeeded_sent_once() {
    let app = spawn_app(with_history(Ledger::Postgres).arg("--reconcile-max-backoff", "1s")).await;
    let (s, v) = ids();
    app.sim.seed_attachment(s, v);
    app.sim
        .add_fault(FaultRule::new(FaultOp::Detach, Fault::LateEffect { ms: 10_000 }).volume(v));
    app.sim.add_fault(
        FaultRule::new(FaultOp::Detach, Fault::Conflict)
            .volume(v)
            .always(),
    );
    let e = app
        .raw()
        .detach_volume(with_timeout(detach("late", s, v), secs(5.0)))
        .await
        .unwrap_err();
    assert_eq!(error_info(&e).0, "OUTCOME_UNKNOWN", "{e:?}");
    let id = recorded(&app, "late").await.id;
    assert_eq!(row(&app, id).await.state, State::Unknown, "not FAILED");
    let op = reconcile_until(&app, id, secs(30.0), "the late detach is seen", |op| {
        op.state.is_terminal()
    })
    .await;
    assert_eq!(
        (op.state, op.resolution),
        (State::Succeeded, Some(Resolution::Reconciler))
    );
    assert!(!app.sim.is_attached(s, v));
    assert_eq!(requests_of(&app, id).len(), 1);
    assert_eq!(app.sim.detach_requests(v), 1);
    app.stop().await;
}

// ---------------------------------------------------------------------
// 6. Leases: short, renewed while their holder lives, on the database's
//    clock.
// ---------------------------------------------------------------------

/// Two replicas on one PostgreSQL (each in a runtime of its own, killable
/// as kill -9 kills a process), the chaos run's cluster.
async fn cluster(
    db: &str,
    sim: &volume_reconciler::sim::SimHandle,
    skews: Vec<chrono::Duration>,
) -> volume_reconciler::cli::chaos::cluster::Cluster {
    cluster_with(db, sim, skews, &[]).await
}

/// [`cluster`] with more flags for every replica.
async fn cluster_with(
    db: &str,
    sim: &volume_reconciler::sim::SimHandle,
    skews: Vec<chrono::Duration>,
    more: &[&str],
) -> volume_reconciler::cli::chaos::cluster::Cluster {
    use volume_reconciler::cli::chaos::cluster::{Cluster, ClusterConfig};
    Cluster::start(ClusterConfig {
        database_url: db.to_string(),
        nova_url: sim.nova_url.clone(),
        cinder_url: sim.cinder_url.clone(),
        replicas: skews.len(),
        clients: 1,
        skews,
        extra_args: [
            "--db-statement-timeout",
            "1s",
            "--lease",
            "3s",
            "--heartbeat",
            "250ms",
            "--reconcile-interval",
            "100ms",
            "--reconcile-max-backoff",
            "1s",
            "--reconcile-batch",
            "1",
        ]
        .iter()
        .chain(more)
        .map(|s| s.to_string())
        .collect(),
    })
    .await
    .expect("the replicas start")
}

/// An orchestrator's client of one replica (the cluster's callers have
/// tokens).
async fn cluster_client(
    url: &str,
) -> pb::volume_reconciler_client::VolumeReconcilerClient<tonic::transport::Channel> {
    pb::volume_reconciler_client::VolumeReconcilerClient::connect(url.to_string())
        .await
        .unwrap()
}

fn as_cluster_caller<T>(msg: T, timeout: Duration) -> tonic::Request<T> {
    use volume_reconciler::cli::chaos::cluster::{caller_name, token_of};
    let mut r = with_timeout(msg, timeout);
    r.metadata_mut().insert(
        "authorization",
        format!("Bearer {}", token_of(&caller_name(0)))
            .parse()
            .unwrap(),
    );
    r
}

/// A replica dies (kill -9) while it holds an attach still waiting for
/// Nova: the other replica takes the operation over within a lease (3
/// heartbeats), not the caller's deadline, and decides it from what Nova
/// did; Nova received one request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replicas_operation_is_taken_over_within_three_heartbeats() {
    support::init_logs();
    let sim = volume_reconciler::sim::start(
        "127.0.0.1:0".parse().unwrap(),
        SimConfig {
            record_history: true,
            ..SimConfig::default()
        },
    )
    .await
    .unwrap();
    let db = support::pg::fresh_database().await;
    let cluster = cluster(&db, &sim, vec![chrono::Duration::zero(); 2]).await;
    let store = volume_reconciler::store::open(&db, 2).await.unwrap();
    let (s, v) = ids();
    // Nova takes 6 s to attach; the caller allows two minutes.
    sim.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::DelayBeforeEffect { ms: 6000 }).volume(v),
    );
    let mut c = cluster_client(&cluster.live()[0]).await;
    let call = tokio::spawn(async move {
        c.attach_volume(as_cluster_caller(attach("held", s, v), secs(120.0)))
            .await
    });
    let sim_ref = sim.sim.clone();
    eventually(secs(15.0), "the attach reached Nova", || {
        let sim = sim_ref.clone();
        async move { sim.attach_requests(v) == 1 }
    })
    .await;
    let caller = volume_reconciler::cli::chaos::cluster::caller_name(0);
    let id = store
        .operation_get_by_key(&crate::support::ck(Some(&caller), "held"))
        .await
        .unwrap()
        .expect("recorded")
        .id;
    cluster.kill(0);
    let killed = Instant::now();
    let by_b = |events: &[OperationEvent]| {
        events
            .iter()
            .any(|e| e.kind == "claimed" && e.replica == cluster.name(1))
    };
    let store_ref = store.clone();
    eventually(secs(30.0), "the other replica takes it over", || {
        let store = store_ref.clone();
        async move { by_b(&store.operation_events(id).await.unwrap()) }
    })
    .await;
    let took = killed.elapsed();
    println!("taken over {took:?} after the kill (lease 3 s, heartbeat 1 s)");
    assert!(
        took < secs(3.0 + 6.0),
        "within a lease (and a loaded machine's slack), not the caller's 120 s: {took:?}"
    );
    let call = call.await.unwrap();
    assert!(
        call.is_err(),
        "the killed replica's caller lost its connection: {call:?}"
    );
    eventually(secs(30.0), "the operation is decided", || {
        let store = store_ref.clone();
        async move {
            store
                .operation_get(id)
                .await
                .unwrap()
                .unwrap()
                .state
                .is_terminal()
        }
    })
    .await;
    let op = store.operation_get(id).await.unwrap().unwrap();
    assert_eq!(
        (op.state, op.resolution),
        (State::Succeeded, Some(Resolution::Reconciler))
    );
    assert!(sim.sim.is_attached(s, v));
    assert_eq!(
        (sim.sim.attach_requests(v), sim.sim.attach_effects(v)),
        (1, 1),
        "never sent twice"
    );
    cluster.stop().await;
    sim.stop().await;
}

/// A replica dies after its detach took effect in Nova but before it
/// logged the answer, and someone attaches the volume again before the
/// other replica takes over (found by the history checker on PostgreSQL). The successor
/// finds the volume attached, but by another attachment than the one the
/// detach was asked to remove (Cinder's id, logged before the request):
/// SUCCEEDED, and the new attachment is not removed (no second request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detach_whose_volume_is_attached_again_before_a_takeover_is_not_sent_twice() {
    support::init_logs();
    let sim = volume_reconciler::sim::start(
        "127.0.0.1:0".parse().unwrap(),
        SimConfig {
            record_history: true,
            ..SimConfig::default()
        },
    )
    .await
    .unwrap();
    let db = support::pg::fresh_database().await;
    // Settle windows short enough that, without the check, the successor
    // re-sends within the test's wait.
    let cluster = cluster_with(
        &db,
        &sim,
        vec![chrono::Duration::zero(); 2],
        &["--settle-window", "1s"],
    )
    .await;
    let store = volume_reconciler::store::open(&db, 2).await.unwrap();
    let (s, v) = ids();
    sim.sim.seed_attachment(s, v);
    // Nova detaches at once, and answers 20 s later.
    sim.sim.add_fault(
        FaultRule::new(FaultOp::Detach, Fault::DelayAfterEffect { ms: 20_000 }).volume(v),
    );
    let mut c = cluster_client(&cluster.live()[0]).await;
    let call = tokio::spawn(async move {
        c.detach_volume(as_cluster_caller(detach("lost", s, v), secs(120.0)))
            .await
    });
    let sim_ref = sim.sim.clone();
    eventually(secs(15.0), "the detach took effect in Nova", || {
        let sim = sim_ref.clone();
        async move { sim.detach_requests(v) == 1 && !sim.is_attached(s, v) }
    })
    .await;
    let caller = volume_reconciler::cli::chaos::cluster::caller_name(0);
    let id = store
        .operation_get_by_key(&crate::support::ck(Some(&caller), "lost"))
        .await
        .unwrap()
        .expect("recorded")
        .id;
    cluster.kill(0);
    assert!(
        sim.sim.attach_out_of_band(s, v),
        "attached again by someone"
    );
    let store_ref = store.clone();
    eventually(secs(60.0), "the operation is decided", || {
        let store = store_ref.clone();
        async move {
            store
                .operation_get(id)
                .await
                .unwrap()
                .unwrap()
                .state
                .is_terminal()
        }
    })
    .await;
    let call = call.await.unwrap();
    assert!(
        call.is_err(),
        "the killed replica's caller lost its connection"
    );
    let op = store.operation_get(id).await.unwrap().unwrap();
    assert_eq!(
        (op.state, op.resolution),
        (State::Succeeded, Some(Resolution::Reconciler)),
        "{op:?}"
    );
    assert_eq!(sim.sim.detach_requests(v), 1, "never sent twice");
    assert!(
        sim.sim.is_attached(s, v),
        "the new attachment is not this operation's to remove"
    );
    cluster.stop().await;
    sim.stop().await;
}

/// A replica whose clock is two minutes ahead sees every lease as long
/// expired by its own clock; leases are the database's, so it takes over
/// nothing the other replica is still working on (its reconciler is busy
/// meanwhile: it takes a dead holder's operation).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_clock_is_off_takes_over_no_live_work() {
    support::init_logs();
    let sim = volume_reconciler::sim::start(
        "127.0.0.1:0".parse().unwrap(),
        SimConfig {
            record_history: true,
            ..SimConfig::default()
        },
    )
    .await
    .unwrap();
    let db = support::pg::fresh_database().await;
    let skews = vec![chrono::Duration::zero(), chrono::Duration::minutes(2)];
    let cluster = cluster(&db, &sim, skews).await;
    let store = volume_reconciler::store::open(&db, 2).await.unwrap();
    // Operations whose holder died (their leases ran out), taken one a
    // round: the skewed replica's reconciler takes some, proof that it
    // runs and claims what it may. Forty, four seconds of rounds: with ten
    // the other replica's reconciler took them all on a loaded machine
    // before the skewed one's first round (1 in 3 runs beside the suite).
    let mut dead = Vec::new();
    for _ in 0..40 {
        let (ds, dv) = ids();
        sim.sim.seed_attachment(ds, dv);
        dead.push(dead_holders_attach(store.as_ref(), ds, dv).await);
    }
    // A live attach on the replica with the right clock: Nova takes 6 s,
    // two leases.
    let (s, v) = ids();
    sim.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::DelayBeforeEffect { ms: 6000 }).volume(v),
    );
    let mut c = cluster_client(&cluster.live()[0]).await;
    let answer = c
        .attach_volume(as_cluster_caller(attach("live", s, v), secs(60.0)))
        .await
        .expect("answered by the replica that ran it")
        .into_inner();
    assert_eq!(
        (answer.state, answer.resolution),
        (pb::State::Succeeded as i32, pb::Resolution::Response as i32)
    );
    let id = id_of(&answer);
    let events = store.operation_events(id).await.unwrap();
    assert_eq!(
        count(&events, "claimed"),
        0,
        "nobody took it over: {events:#?}"
    );
    assert!(
        events.iter().all(|e| e.replica == cluster.name(0)),
        "{events:#?}"
    );
    let store_ref = store.clone();
    let dead_ref = dead.clone();
    eventually(
        secs(30.0),
        "the dead holders' operations are taken over",
        || {
            let (store, dead) = (store_ref.clone(), dead_ref.clone());
            async move {
                for id in dead {
                    if !store
                        .operation_get(id)
                        .await
                        .unwrap()
                        .unwrap()
                        .state
                        .is_terminal()
                    {
                        return false;
                    }
                }
                true
            }
        },
    )
    .await;
    let mut by_skewed = 0;
    for id in &dead {
        let events = store.operation_events(*id).await.unwrap();
        by_skewed += events
            .iter()
            .filter(|e| e.kind == "claimed" && e.replica == cluster.name(1))
            .count();
    }
    assert!(
        by_skewed > 0,
        "the skewed replica's reconciler took over dead holders' work"
    );
    assert_eq!(
        (sim.sim.attach_requests(v), sim.sim.attach_effects(v)),
        (1, 1)
    );
    cluster.stop().await;
    sim.stop().await;
}

/// Records an attach as a replica that died would have left it: a request
/// sent, no lease left, its volume attached meanwhile (so a pass decides it).
async fn dead_holders_attach(
    store: &dyn volume_reconciler::store::Store,
    server: Uuid,
    volume: Uuid,
) -> Uuid {
    use volume_reconciler::domain::NewEvent;
    let new = volume_reconciler::store::NewOperation {
        state: State::InProgress,
        attempts: 1,
        events: vec![NewEvent::new("recorded", "left by a replica that died")],
        ..support::pending_attach_on(
            &format!("dead-{volume}"),
            "a-dead-replica",
            Duration::ZERO,
            secs(60.0),
            server,
            volume,
        )
    };
    support::record_new(store, new).await
}

// ---------------------------------------------------------------------
// 7. Settle and verification windows follow the flags; the verifier
//    looks more than once; every answer's Nova request id is logged.
// ---------------------------------------------------------------------

/// An attach and a detach whose requests were lost are decided once their
/// own settle window (`--settle-window-attach`, `--settle-window-detach`)
/// has passed since their last request, not before.
#[tokio::test]
async fn settle_windows_follow_the_flags_per_action() {
    let app = spawn_app(
        with_history(Ledger::Postgres)
            .arg("--settle-window-attach", "9s")
            .arg("--settle-window-detach", "5s")
            .arg("--reconcile-max-backoff", "1s"),
    )
    .await;
    let mut c = app.raw();
    let lost = Fault::ProxyError {
        code: 504,
        effect: false,
    };
    let (sa, va) = ids();
    app.sim
        .add_fault(FaultRule::new(FaultOp::Attach, lost.clone()).volume(va));
    let (sd, vd) = ids();
    app.sim.seed_attachment(sd, vd);
    app.sim
        .add_fault(FaultRule::new(FaultOp::Detach, lost).volume(vd));
    let e = c
        .attach_volume(with_timeout(attach("a", sa, va), secs(4.0)))
        .await
        .unwrap_err();
    assert_eq!(error_info(&e).0, "OUTCOME_UNKNOWN");
    let e = c
        .detach_volume(with_timeout(detach("d", sd, vd), secs(4.0)))
        .await
        .unwrap_err();
    assert_eq!(error_info(&e).0, "OUTCOME_UNKNOWN");
    let (a, d) = (recorded(&app, "a").await.id, recorded(&app, "d").await.id);
    let d_op = reconcile_until(&app, d, secs(20.0), "the detach is decided", |op| {
        op.state.is_terminal()
    })
    .await;
    let a_op = row(&app, a).await;
    assert!(
        !a_op.state.is_terminal(),
        "the attach waits out its longer window: {a_op:?}"
    );
    let a_op = reconcile_until(&app, a, secs(30.0), "the attach is decided", |op| {
        op.state.is_terminal()
    })
    .await;
    // (Both windows end after the operations' deadlines: no time is left
    // to send again, so not seen means failed.)
    for (op, window) in [(&a_op, 9), (&d_op, 5)] {
        assert_eq!(
            (op.state, reason(op)),
            (State::Failed, Some(Reason::NotObserved)),
            "{op:?}"
        );
        let waited = op.completed_at.unwrap() - op.last_request_at.unwrap();
        assert!(
            waited >= chrono::Duration::seconds(window),
            "{} decided {waited} after its last request, before its {window} s window",
            op.action.as_str()
        );
        let meta = &op.last_error.as_ref().unwrap().metadata;
        assert_eq!(meta.get("settle_window_s"), Some(&window.to_string()));
    }
    assert!(
        d_op.completed_at.unwrap() - d_op.last_request_at.unwrap() < chrono::Duration::seconds(9),
        "the detach did not wait for the attach's window"
    );
    assert_eq!(
        (app.sim.attach_effects(va), app.sim.attach_requests(va)),
        (0, 1)
    );
    assert!(app.sim.is_attached(sd, vd));
    app.stop().await;
}

/// An attach decided FAILED whose effect lands after the first
/// verification and before the end of the verification window is still
/// caught: the verifier looks twice.
#[tokio::test]
async fn a_late_effect_after_the_first_verification_is_caught_by_the_second() {
    let app = spawn_app(
        with_history(Ledger::Postgres)
            .arg("--settle-window", "0s")
            .arg("--verify-after", "300ms")
            .arg("--verify-window", "20s")
            .arg("--reconcile-max-backoff", "1s"),
    )
    .await;
    let (s, v) = ids();
    // Nova attaches 12 s after a load balancer answered 504 (the caller
    // waits 4 s: its unknown decision is written in the reserve's last
    // quarter, 200 ms, on a loaded CI machine).
    app.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::LateEffect { ms: 12_000 }).volume(v));
    let e = app
        .raw()
        .attach_volume(with_timeout(attach("late", s, v), secs(4.0)))
        .await
        .unwrap_err();
    assert_eq!(error_info(&e).0, "OUTCOME_UNKNOWN");
    let op = recorded(&app, "late").await;
    let id = op.id;
    // Its deadline passes (no time left to send again), then a pass
    // decides: not seen, and the settle window (none here) is over.
    let store = app.store.clone();
    eventually(secs(10.0), "the operation's deadline passes", || {
        let store = store.clone();
        async move { store.now().await.unwrap() > op.deadline_at }
    })
    .await;
    let op = reconcile_until(&app, id, secs(20.0), "the attach is decided", |op| {
        op.state.is_terminal()
    })
    .await;
    assert_eq!(
        (op.state, reason(&op)),
        (State::Failed, Some(Reason::NotObserved))
    );
    // The first verification (2 s after the decision, the verifier's
    // floor) finds nothing: the effect has not landed.
    let reconciler = app.reconciler.clone();
    eventually(secs(20.0), "the first verification", || {
        let reconciler = reconciler.clone();
        async move { reconciler.run_once().await.unwrap().verified > 0 }
    })
    .await;
    assert!(
        !app.sim.is_attached(s, v),
        "the first look came before the late effect"
    );
    assert!(!row(&app, id).await.drifted);
    let op = reconcile_until(&app, id, secs(30.0), "the late effect is reported", |op| {
        op.drifted
    })
    .await;
    assert_eq!(op.state, State::Failed, "reported, not acted on");
    let events = log(&app, id).await;
    let drift = events.iter().find(|e| e.kind == "drift_detected").unwrap();
    assert_eq!(
        drift.metadata.get("verification").map(String::as_str),
        Some("last")
    );
    assert!(app.sim.is_attached(s, v), "the truth: Nova did attach");
    app.stop().await;
}

/// Every answer Nova gave (a 200, a 202, a refusal) is in the log with
/// Nova's own request id, the one Nova answered that request with.
#[tokio::test]
async fn every_answer_in_the_log_carries_novas_request_id() {
    let app = spawn_app(with_history(Ledger::Postgres)).await;
    let mut c = app.raw();
    let (s, v) = ids();
    let t = secs(10.0);
    let attached = c
        .attach_volume(with_timeout(attach("a", s, v), t))
        .await
        .unwrap()
        .into_inner();
    let detached = c
        .detach_volume(with_timeout(detach("d", s, v), t))
        .await
        .unwrap()
        .into_inner();
    let v2 = Uuid::new_v4();
    app.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::DeviceInUse).volume(v2));
    let e = c
        .attach_volume(with_timeout(attach("r", s, v2), t))
        .await
        .unwrap_err();
    let refused: Uuid = error_info(&e).1["operation_id"].parse().unwrap();
    for id in [id_of(&attached), id_of(&detached), refused] {
        let novas: Vec<String> = requests_of(&app, id)
            .into_iter()
            .map(|r| r.local_id)
            .collect();
        assert_eq!(novas.len(), 1, "one request of {id}");
        let events = log(&app, id).await;
        let answers: Vec<&OperationEvent> = events
            .iter()
            .filter(|e| {
                e.kind == "response"
                    || (e.kind == "request_failed" && e.metadata.contains_key("http_status"))
            })
            .collect();
        assert_eq!(answers.len(), 1, "{events:#?}");
        for a in answers {
            assert_eq!(
                a.metadata.get("nova_request_id"),
                Some(&novas[0]),
                "{} of {id} names Nova's request id",
                a.kind
            );
        }
    }
    app.stop().await;
}
