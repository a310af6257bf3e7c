//! The reconciler, the operator RPCs, metrics and health, through the real
//! server, a real PostgreSQL and the simulator.

use crate::support;

use std::collections::HashMap;
use std::time::Duration;

use support::{AppOptions, TestApp, spawn_app, with_timeout};
use tokio::time::Instant;
use uuid::Uuid;
use volume_reconciler::domain::{
    Action, NewEvent, RequestParams, Resolution, State, request_fingerprint,
};
use volume_reconciler::grpc::pb;
use volume_reconciler::sim::{Fault, FaultOp, FaultRule};
use volume_reconciler::store::{CreateOutcome, NewOperation, Store, Transition};

/// Records an operation as a crashed replica would have left it: a request
/// sent, its outcome unknown, its lease expired.
async fn unknown_op(
    store: &dyn Store,
    server: Uuid,
    volume: Uuid,
    deadline_in: chrono::Duration,
) -> Uuid {
    left_op(
        store,
        Action::Attach,
        State::Unknown,
        server,
        volume,
        deadline_in,
    )
    .await
}

/// Records an operation as a replica that stopped would have left it, in
/// `state` (a request sent unless PENDING), its lease expired.
async fn left_op(
    store: &dyn Store,
    action: Action,
    state: State,
    server: Uuid,
    volume: Uuid,
    deadline_in: chrono::Duration,
) -> Uuid {
    let id = Uuid::now_v7();
    let params = RequestParams::default();
    let new = NewOperation {
        labels: Default::default(),
        id,
        key: volume_reconciler::domain::CallerKey::parse(None, &format!("u-{id}"))
            .unwrap()
            .into(),
        fingerprint: request_fingerprint(
            action,
            server,
            volume,
            &params,
            &volume_reconciler::domain::Labels::none(),
        ),
        action,
        server_id: server,
        volume_id: volume,
        params,
        state,
        attempts: i32::from(state != State::Pending),
        deadline_in: deadline_in.to_std().unwrap_or_default(),
        lease_owner: "crashed".into(),
        lease_for: Duration::ZERO,
        trace: None,
        replica: "crashed".into(),
        events: vec![NewEvent::new("recorded", "seeded by the test")],
        record_by: None,
    };
    match store
        .operation_create(new, Instant::now() + Duration::from_secs(30))
        .await
        .unwrap()
    {
        CreateOutcome::Created(op) => op.id,
        CreateOutcome::Existing(_) => unreachable!(),
    }
}

/// One reconciler pass over operation `id` now (ReconcileOperation); the
/// operation as it left it.
async fn reconcile_now(
    c: &mut pb::volume_reconciler_client::VolumeReconcilerClient<tonic::transport::Channel>,
    id: Uuid,
) -> pb::Operation {
    c.reconcile_operation(pb::ReconcileOperationRequest {
        operation_id: id.to_string(),
    })
    .await
    .unwrap()
    .into_inner()
}

fn replica_b(a: &TestApp, extra: &[(&str, &str)]) -> AppOptions {
    let mut o = AppOptions {
        db_url: Some(a.db_url.clone()),
        nova_url: Some(a.sim_handle.as_ref().unwrap().nova_url.clone()),
        replica: "test-b".into(),
        ..Default::default()
    };
    for (f, v) in extra {
        o = o.arg(f, v);
    }
    o
}

async fn open_count(store: &dyn Store) -> usize {
    let mut n = 0;
    let mut after = None;
    loop {
        let page = store
            .operation_list(&Default::default(), after, 500)
            .await
            .unwrap();
        n += page
            .operations
            .iter()
            .filter(|o| !o.state.is_terminal())
            .count();
        match page.next_cursor {
            Some(c) => after = Some(c),
            None => return n,
        }
    }
}

#[tokio::test]
async fn two_replicas_decide_a_thousand_unknown_operations_exactly_once_and_share_the_work() {
    let flags = [
        ("--settle-window", "0s"),
        ("--reconcile-rate-limit", "100000"),
        ("--reconcile-batch", "50"),
    ];
    let mut a_opts = AppOptions::default();
    for (f, v) in flags {
        a_opts = a_opts.arg(f, v);
    }
    let a = spawn_app(a_opts).await;
    let b = spawn_app(replica_b(&a, &flags)).await;
    let server = Uuid::new_v4();
    let mut expected = HashMap::new();
    for i in 0..1000 {
        let v = Uuid::new_v4();
        // Half took effect in Nova; the other half never did, and their
        // deadline has passed.
        let attached = i % 2 == 0;
        if attached {
            a.sim.seed_attachment(server, v);
        }
        let id = unknown_op(a.store.as_ref(), server, v, chrono::Duration::seconds(-1)).await;
        expected.insert(id, attached);
    }
    let (ra, rb) = (a.reconciler.clone(), b.reconciler.clone());
    let run = |r: std::sync::Arc<volume_reconciler::reconciler::Reconciler>,
               store: std::sync::Arc<dyn Store>| async move {
        let deadline = Instant::now() + Duration::from_secs(120);
        while open_count(store.as_ref()).await > 0 {
            assert!(Instant::now() < deadline, "reconcilers did not finish");
            r.run_once().await.unwrap();
        }
    };
    tokio::join!(run(ra, a.store.clone()), run(rb, b.store.clone()));
    let mut by_replica: HashMap<String, usize> = HashMap::new();
    for (id, attached) in &expected {
        let op = a.store.operation_get(*id).await.unwrap().unwrap();
        let want = if *attached {
            State::Succeeded
        } else {
            State::Failed
        };
        assert_eq!(op.state, want, "{id}");
        assert_eq!(op.resolution, Some(Resolution::Reconciler));
        if !attached {
            assert_eq!(
                op.last_error.as_ref().unwrap().reason.as_str(),
                "NOT_OBSERVED"
            );
        }
        let decisions: Vec<_> = a
            .store
            .operation_events(*id)
            .await
            .unwrap()
            .into_iter()
            .filter(|e| e.kind == "resolved")
            .collect();
        assert_eq!(decisions.len(), 1, "{id} decided {} times", decisions.len());
        *by_replica.entry(decisions[0].replica.clone()).or_default() += 1;
    }
    assert_eq!(by_replica.values().sum::<usize>(), 1000);
    assert!(
        by_replica.get("test-a").copied().unwrap_or(0) > 0
            && by_replica.get("test-b").copied().unwrap_or(0) > 0,
        "both replicas worked: {by_replica:?}"
    );
    b.stop().await;
    a.stop().await;
}

#[tokio::test]
async fn a_decision_taken_under_an_old_lease_is_refused() {
    let app = spawn_app(AppOptions::default()).await;
    let (s, v) = (Uuid::new_v4(), Uuid::new_v4());
    let id = unknown_op(app.store.as_ref(), s, v, chrono::Duration::seconds(60)).await;
    let first = app
        .store
        .operation_claim_one(id, "r1", Duration::from_millis(1))
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await; // let r1's 1 ms lease lapse
    let second = app
        .store
        .operation_claim_one(id, "r2", Duration::from_secs(60))
        .await
        .unwrap()
        .expect("the lapsed lease is taken over");
    assert_eq!(second.lease_epoch, first.lease_epoch + 1);
    // r1 wakes up late and tries to write its decision.
    let mut late = Transition::new(&first, State::Failed, "r1");
    late.resolution = Some(Resolution::Reconciler);
    let r = app
        .store
        .operation_transition(late, Instant::now() + Duration::from_secs(5))
        .await
        .unwrap();
    assert!(r.is_none(), "the stale epoch is fenced out");
    let mut current = Transition::new(&second, State::Succeeded, "r2");
    current.resolution = Some(Resolution::Reconciler);
    let op = app
        .store
        .operation_transition(current, Instant::now() + Duration::from_secs(5))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(op.state, State::Succeeded);
    // And nothing overwrites a terminal decision.
    let again = Transition::new(&op, State::Failed, "r2");
    assert!(
        app.store
            .operation_transition(again, Instant::now() + Duration::from_secs(5))
            .await
            .unwrap()
            .is_none()
    );
    app.stop().await;
}

#[tokio::test]
async fn a_nova_outage_keeps_operations_open_under_the_rate_limit_until_nova_returns() {
    let app = spawn_app(
        AppOptions::default()
            .arg("--with-reconciler", "")
            .arg("--settle-window", "0s")
            .arg("--reconcile-interval", "50ms")
            .arg("--reconcile-rate-limit", "10"),
    )
    .await;
    let server = Uuid::new_v4();
    app.sim.add_fault(
        FaultRule::new(
            FaultOp::List,
            Fault::Status {
                code: 503,
                effect: false,
            },
        )
        .always(),
    );
    let mut ids = Vec::new();
    for _ in 0..40 {
        let v = Uuid::new_v4();
        app.sim.seed_attachment(server, v);
        ids.push(unknown_op(app.store.as_ref(), server, v, chrono::Duration::seconds(60)).await);
    }
    let before = app.sim.list_requests();
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await; // observing a rate: a fixed window is the measurement
    let elapsed = started.elapsed().as_secs_f64();
    let sent = app.sim.list_requests() - before;
    assert!(
        (sent as f64) <= 10.0 * elapsed + 12.0,
        "{sent} list requests in {elapsed:.1}s exceed the 10/s limit"
    );
    assert!(sent > 0, "it keeps trying");
    assert_eq!(
        open_count(app.store.as_ref()).await,
        40,
        "nothing decided during the outage"
    );
    app.sim.clear_faults();
    let store = app.store.clone();
    support::eventually(
        Duration::from_secs(60),
        "every operation resolves once Nova is back",
        || {
            let store = store.clone();
            async move { open_count(store.as_ref()).await == 0 }
        },
    )
    .await;
    for id in ids {
        let op = app.store.operation_get(id).await.unwrap().unwrap();
        assert_eq!(
            (op.state, op.resolution),
            (State::Succeeded, Some(Resolution::Reconciler))
        );
        let events = app.store.operation_events(id).await.unwrap();
        assert!(
            events
                .iter()
                .any(|e| e.kind == "observed" && e.detail.contains("observation failed")),
            "the outage is in the log"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn watch_delivers_the_terminal_state_decided_by_another_replica() {
    let a = spawn_app(AppOptions::default().arg("--settle-window", "0s")).await;
    let b = spawn_app(replica_b(&a, &[("--settle-window", "0s")])).await;
    let (s, v) = (Uuid::new_v4(), Uuid::new_v4());
    let id = unknown_op(a.store.as_ref(), s, v, chrono::Duration::seconds(60)).await;
    a.sim.seed_attachment(s, v);
    let mut stream = a
        .raw()
        .watch_operation(pb::WatchOperationRequest {
            operation_id: id.to_string(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.state, pb::State::Unknown as i32);
    let counts = b.reconciler.run_once().await.unwrap();
    assert_eq!(counts.succeeded, 1);
    let last = tokio::time::timeout(Duration::from_secs(10), async {
        let mut last = first;
        while let Some(op) = stream.message().await.unwrap() {
            last = op;
        }
        last
    })
    .await
    .expect("the stream ends after the terminal state");
    assert_eq!(
        (last.state, last.resolution),
        (
            pb::State::Succeeded as i32,
            pb::Resolution::Reconciler as i32
        )
    );
    b.stop().await;
    a.stop().await;
}

/// How many watches `operation_watches` holds for `id`.
async fn watches(db_url: &str, id: Uuid) -> i64 {
    support::pg::Admin::connect(db_url)
        .await
        .number(&format!(
            "SELECT count(*) FROM operation_watches WHERE operation_id = '{id}' AND until > now()"
        ))
        .await
}

/// A WatchOperation stream registers as a watcher, so the replica that
/// decides notifies it (decisions nobody watches notify nobody).
#[tokio::test]
async fn a_watch_stream_registers_for_other_replicas_decisions() {
    let a = spawn_app(AppOptions::default()).await;
    let b = spawn_app(replica_b(&a, &[("--settle-window", "0s")])).await;
    let (s, v) = (Uuid::new_v4(), Uuid::new_v4());
    let id = unknown_op(a.store.as_ref(), s, v, chrono::Duration::seconds(60)).await;
    a.sim.seed_attachment(s, v);
    let mut stream = a
        .raw()
        .watch_operation(pb::WatchOperationRequest {
            operation_id: id.to_string(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.state, pb::State::Unknown as i32);
    let db = a.db_url.clone();
    support::eventually(
        Duration::from_secs(10),
        "the stream's watch is registered",
        || {
            let db = db.clone();
            async move { watches(&db, id).await == 1 }
        },
    )
    .await;
    let mut rx = a.store.subscribe();
    assert_eq!(b.reconciler.run_once().await.unwrap().succeeded, 1);
    // Replica a decided nothing: the id can only come from b's NOTIFY.
    tokio::time::timeout(Duration::from_secs(10), async {
        while rx.recv().await.unwrap() != id {}
    })
    .await
    .expect("the other replica's decision is notified to the watching one");
    let last = tokio::time::timeout(Duration::from_secs(10), async {
        let mut last = first;
        while let Some(op) = stream.message().await.unwrap() {
            last = op;
        }
        last
    })
    .await
    .expect("the stream ends after the terminal state");
    assert_eq!(last.state, pb::State::Succeeded as i32);
    b.stop().await;
    a.stop().await;
}

/// A replay on another replica of a call still waiting for Nova waits for
/// its decision as a registered watcher, and both callers get the one
/// answer Nova gave (one request, one effect).
#[tokio::test]
async fn a_replay_on_another_replica_waits_as_a_registered_watcher() {
    let a = spawn_app(AppOptions::default()).await;
    let b = spawn_app(replica_b(&a, &[])).await;
    let (s, v) = (Uuid::new_v4(), Uuid::new_v4());
    a.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::DelayBeforeEffect { ms: 5000 }).volume(v),
    );
    let request = pb::AttachVolumeRequest {
        idempotency_key: "replayed-elsewhere".into(),
        server_id: s.to_string(),
        volume_id: v.to_string(),
        ..Default::default()
    };
    let mut first = a.raw();
    let sent = request.clone();
    let call = tokio::spawn(async move {
        first
            .attach_volume(with_timeout(sent, Duration::from_secs(30)))
            .await
    });
    let store = a.store.clone();
    support::eventually(
        Duration::from_secs(10),
        "the first call is recorded",
        || {
            let store = store.clone();
            async move {
                store
                    .operation_get_by_key(&crate::support::ck(None, "replayed-elsewhere"))
                    .await
                    .unwrap()
                    .is_some()
            }
        },
    )
    .await;
    let id = a
        .store
        .operation_get_by_key(&crate::support::ck(None, "replayed-elsewhere"))
        .await
        .unwrap()
        .unwrap()
        .id;
    let mut second = b.raw();
    let replay = tokio::spawn(async move {
        second
            .attach_volume(with_timeout(request, Duration::from_secs(30)))
            .await
    });
    let db = a.db_url.clone();
    support::eventually(
        Duration::from_secs(10),
        "the replay's wait is registered",
        || {
            let db = db.clone();
            async move { watches(&db, id).await == 1 }
        },
    )
    .await;
    // Replica b decides nothing: the id can only reach it by a's NOTIFY.
    let mut rx = b.store.subscribe();
    let answer = call
        .await
        .unwrap()
        .expect("the first call's answer")
        .into_inner();
    let replayed = replay
        .await
        .unwrap()
        .expect("the replay's answer")
        .into_inner();
    assert_eq!(answer.state, pb::State::Succeeded as i32, "{answer:?}");
    assert_eq!(
        (replayed.id, replayed.state),
        (answer.id, answer.state),
        "the replay gets the first call's decision"
    );
    tokio::time::timeout(Duration::from_secs(10), async {
        while rx.recv().await.unwrap() != id {}
    })
    .await
    .expect("the deciding replica notified the waiting one");
    assert_eq!(
        (a.sim.attach_requests(v), a.sim.attach_effects(v)),
        (1, 1),
        "Nova saw one request"
    );
    b.stop().await;
    a.stop().await;
}

/// A watch on an operation that does not change ends at its idle bound,
/// not at the caller's much later deadline (the stream re-reads the row
/// every 2 s; those re-reads must not restart the bound).
#[tokio::test]
async fn a_watch_with_no_change_ends_at_its_idle_bound() {
    // Test apps run no background reconciler: nothing changes the row.
    let a = spawn_app(AppOptions::default().arg("--watch-idle-timeout", "3s")).await;
    let id = unknown_op(
        a.store.as_ref(),
        Uuid::new_v4(),
        Uuid::new_v4(),
        chrono::Duration::seconds(600),
    )
    .await;
    let started = Instant::now();
    let mut stream = a
        .raw()
        .watch_operation(with_timeout(
            pb::WatchOperationRequest {
                operation_id: id.to_string(),
            },
            Duration::from_secs(60),
        ))
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.state, pb::State::Unknown as i32);
    let end = tokio::time::timeout(Duration::from_secs(50), stream.message())
        .await
        .expect("the stream ends before the caller's deadline")
        .expect_err("it ends with the idle status");
    assert_eq!(end.code(), tonic::Code::DeadlineExceeded, "{end:?}");
    assert_eq!(support::error_info(&end).0, "WATCH_IDLE", "{end:?}");
    assert!(
        end.message()
            .contains("no change within the watch idle bound"),
        "{end:?}"
    );
    // Wide margin on a loaded machine; the deadline is 60 s.
    assert!(
        started.elapsed() < Duration::from_secs(40),
        "{:?}",
        started.elapsed()
    );
    a.stop().await;
}

/// A watch of an id no operation has is NOT_FOUND at once, naming the id,
/// and leaves no registration behind: nobody can ever decide that id.
#[tokio::test]
async fn a_watch_of_an_unknown_id_is_not_found_and_registers_nothing() {
    let a = spawn_app(AppOptions::default()).await;
    let id = Uuid::now_v7();
    let err = a
        .raw()
        .watch_operation(with_timeout(
            pb::WatchOperationRequest {
                operation_id: id.to_string(),
            },
            Duration::from_secs(30),
        ))
        .await
        .expect_err("no such operation");
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
    assert!(err.message().contains(&id.to_string()), "{err:?}");
    // Every row, expired or not: the registration would outlive the call.
    let rows = support::pg::Admin::connect(&a.db_url)
        .await
        .number(&format!(
            "SELECT count(*) FROM operation_watches WHERE operation_id = '{id}'"
        ))
        .await;
    assert_eq!(rows, 0, "a watch of an unknown id registered a wait");
    a.stop().await;
}

#[tokio::test]
async fn an_operator_resolution_is_audited_and_final() {
    let app = spawn_app(AppOptions::default()).await;
    let (s, v) = (Uuid::new_v4(), Uuid::new_v4());
    let id = unknown_op(app.store.as_ref(), s, v, chrono::Duration::seconds(60)).await;
    let mut c = app.raw();
    let err = c
        .resolve_operation(pb::ResolveOperationRequest {
            operation_id: id.to_string(),
            state: pb::State::Failed as i32,
            reason: " ".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(support::error_info(&err).1["field"], "reason");
    let op = c
        .resolve_operation(pb::ResolveOperationRequest {
            operation_id: id.to_string(),
            state: pb::State::Failed as i32,
            reason: "checked on the hypervisor: never attached".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (op.state, op.resolution),
        (pb::State::Failed as i32, pb::Resolution::Operator as i32)
    );
    let events = app.store.operation_events(id).await.unwrap();
    let audit = events
        .iter()
        .find(|e| e.kind == "operator_resolved")
        .expect("audited");
    assert_eq!(audit.detail, "checked on the hypervisor: never attached");
    let err = c
        .resolve_operation(pb::ResolveOperationRequest {
            operation_id: id.to_string(),
            state: pb::State::Succeeded as i32,
            reason: "again".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert_eq!(support::error_info(&err).0, "OPERATION_ALREADY_DECIDED");
    app.stop().await;
}

#[tokio::test]
async fn a_verification_that_comes_after_its_window_is_counted_not_recorded() {
    // The verifier fell behind (say, at its Nova rate limit): by the time
    // it gets to an operation, the window has passed. It does not pretend
    // to have verified it; it counts the miss for the operator.
    let app = spawn_app(
        AppOptions::default()
            .arg("--settle-window", "0s")
            .arg("--verify-after", "300ms")
            .arg("--verify-window", "300ms"),
    )
    .await;
    let (s, v) = (Uuid::new_v4(), Uuid::new_v4());
    let id = unknown_op(app.store.as_ref(), s, v, chrono::Duration::seconds(-1)).await;
    let counts = app.reconciler.run_once().await.unwrap();
    assert_eq!(counts.failed, 1, "{counts:?}");
    // The attach materializes after all: a late effect the verifier would
    // report, had it come in time. It falls behind: nothing verifies until
    // both verifications are a whole window past due (the first is due 2 s
    // after the decision at the earliest).
    app.sim.seed_attachment(s, v);
    let decided = app.store.operation_get(id).await.unwrap().unwrap();
    let behind = decided.completed_at.unwrap() + chrono::Duration::milliseconds(2300 + 500);
    let store = app.store.clone();
    support::eventually(Duration::from_secs(15), "the verifier is behind", || {
        let store = store.clone();
        async move { store.now().await.unwrap() > behind }
    })
    .await;
    app.reconciler.run_once().await.unwrap();
    let metrics = reqwest::get(format!("{}/metrics", app.admin_url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("volume_reconciler_verification_missed_total{reason=\"late\"} 2"),
        "both verifications missed: {metrics}"
    );
    let events = app.store.operation_events(id).await.unwrap();
    assert!(
        !events.iter().any(|e| e.kind == "drift_detected"),
        "{events:?}"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_late_effect_after_the_decision_is_reported_as_drift() {
    let app = spawn_app(
        AppOptions::default()
            .arg("--settle-window", "0s")
            .arg("--verify-after", "300ms"),
    )
    .await;
    let (s, v) = (Uuid::new_v4(), Uuid::new_v4());
    let id = unknown_op(app.store.as_ref(), s, v, chrono::Duration::seconds(-1)).await;
    let counts = app.reconciler.run_once().await.unwrap();
    assert_eq!(counts.failed, 1, "not observed and out of time: {counts:?}");
    // The attach materializes after all (Nova was still processing it).
    app.sim.seed_attachment(s, v);
    let drifted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (r, d) = (app.reconciler.clone(), drifted.clone());
    support::eventually(
        Duration::from_secs(10),
        "the verification round runs",
        || {
            let (r, d) = (r.clone(), d.clone());
            async move {
                let c = r.run_once().await.unwrap();
                d.fetch_add(c.drifted, std::sync::atomic::Ordering::SeqCst);
                c.verified > 0
            }
        },
    )
    .await;
    assert_eq!(drifted.load(std::sync::atomic::Ordering::SeqCst), 1);
    let op = app.store.operation_get(id).await.unwrap().unwrap();
    assert!(op.drifted);
    assert_eq!(
        op.state,
        State::Failed,
        "the reconciler does not act on drift by itself"
    );
    let listed = app
        .raw()
        .list_operations(pb::ListOperationsRequest {
            drifted_only: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.operations.len(), 1);
    assert!(listed.operations[0].drifted);
    let events = app.store.operation_events(id).await.unwrap();
    assert!(events.iter().any(|e| e.kind == "drift_detected"));
    // Verified once only.
    let counts = app.reconciler.run_once().await.unwrap();
    assert_eq!(counts.verified, 0);
    app.stop().await;
}

#[tokio::test]
async fn reconcile_operation_runs_one_pass_now() {
    let app = spawn_app(AppOptions::default()).await; // default 2 min settle window
    let (s, v) = (Uuid::new_v4(), Uuid::new_v4());
    let id = unknown_op(app.store.as_ref(), s, v, chrono::Duration::seconds(60)).await;
    let mut c = app.raw();
    let op = reconcile_now(&mut c, id).await;
    assert_eq!(
        op.state,
        pb::State::Unknown as i32,
        "not observed, inside the settle window: still unknown"
    );
    let events = app.store.operation_events(id).await.unwrap();
    assert!(
        events
            .iter()
            .any(|e| e.kind == "retry_scheduled" && e.detail.contains("settle window"))
    );
    app.sim.seed_attachment(s, v);
    let op = reconcile_now(&mut c, id).await;
    assert_eq!(
        (op.state, op.resolution),
        (
            pb::State::Succeeded as i32,
            pb::Resolution::Reconciler as i32
        )
    );
    app.stop().await;
}

/// A detach whose replica recorded the intent and stopped before sending
/// (PENDING), of a volume that is not on its server (attached to another):
/// the reconciler decides it SUCCEEDED, nothing sent, as the pre-check
/// would have, also once its deadline has passed. It re-sent instead, and
/// near or past the deadline failed a detach of a volume detached all
/// along (chaos seeds 1577 and 1585: "detach FAILED, but the volume was
/// detached all along").
#[tokio::test]
async fn a_detach_left_before_its_request_of_a_volume_not_on_the_server_succeeds_unsent() {
    let app = spawn_app(AppOptions::default()).await;
    let mut c = app.raw();
    for deadline_in in [chrono::Duration::zero(), chrono::Duration::seconds(60)] {
        let (s, elsewhere, v) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        app.sim.seed_attachment(elsewhere, v);
        let id = left_op(
            app.store.as_ref(),
            Action::Detach,
            State::Pending,
            s,
            v,
            deadline_in,
        )
        .await;
        let op = reconcile_now(&mut c, id).await;
        assert_eq!(
            (op.state, op.resolution),
            (
                pb::State::Succeeded as i32,
                pb::Resolution::Reconciler as i32
            ),
            "deadline in {deadline_in}: {op:?}"
        );
        assert_eq!(app.sim.detach_requests(v), 0, "nothing was sent");
        let events = app.store.operation_events(id).await.unwrap();
        assert!(
            events
                .iter()
                .any(|e| e.kind == "resolved" && e.detail.contains("nothing to detach")),
            "{events:?}"
        );
    }
    app.stop().await;
}

/// Parses Prometheus/OpenMetrics text into family → (type, samples).
fn parse_metrics(text: &str) -> HashMap<String, (String, Vec<(String, f64)>)> {
    let mut families: HashMap<String, (String, Vec<(String, f64)>)> = HashMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            let (name, kind) = (
                it.next().unwrap().to_string(),
                it.next().unwrap().to_string(),
            );
            families.insert(name, (kind, Vec::new()));
        } else if !line.starts_with('#') && !line.trim().is_empty() {
            let (series, value) = line.rsplit_once(' ').unwrap();
            let name = series.split('{').next().unwrap();
            let value: f64 = value
                .parse()
                .unwrap_or_else(|_| panic!("bad sample value in {line:?}"));
            let family = families
                .keys()
                .filter(|f| name.starts_with(f.as_str()))
                .max_by_key(|f| f.len())
                .cloned()
                .unwrap_or_else(|| panic!("sample {name} without a TYPE line"));
            families
                .get_mut(&family)
                .unwrap()
                .1
                .push((series.to_string(), value));
        }
    }
    families
}

#[tokio::test]
async fn metrics_and_health_are_exposed_after_a_scripted_run() {
    let app = spawn_app(AppOptions::default().arg("--settle-window", "0s")).await;
    let (s, v) = (Uuid::new_v4(), Uuid::new_v4());
    let mut c = app.raw();
    app.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::CloseAfterEffect).volume(v));
    c.attach_volume(with_timeout(
        pb::AttachVolumeRequest {
            idempotency_key: "m-1".into(),
            server_id: s.to_string(),
            volume_id: v.to_string(),
            ..Default::default()
        },
        Duration::from_secs(10),
    ))
    .await
    .unwrap();
    c.attach_volume(pb::AttachVolumeRequest {
        idempotency_key: "m-2".into(),
        server_id: s.to_string(),
        volume_id: Uuid::new_v4().to_string(),
        ..Default::default()
    })
    .await
    .unwrap();
    c.get_operation(pb::GetOperationRequest {
        operation_id: "bad".into(),
        ..Default::default()
    })
    .await
    .unwrap_err();
    unknown_op(
        app.store.as_ref(),
        s,
        Uuid::new_v4(),
        chrono::Duration::seconds(-1),
    )
    .await;
    app.reconciler.run_once().await.unwrap();

    let http = reqwest::Client::new();
    let text = http
        .get(format!("{}/metrics", app.admin_url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let m = parse_metrics(&text);
    let want = [
        ("volume_reconciler_grpc_requests", "counter"),
        (
            "volume_reconciler_grpc_deadline_remaining_seconds",
            "histogram",
        ),
        (
            "volume_reconciler_grpc_requests_without_deadline",
            "counter",
        ),
        (
            "volume_reconciler_nova_outbound_deadline_seconds",
            "histogram",
        ),
        (
            "volume_reconciler_nova_request_duration_seconds",
            "histogram",
        ),
        ("volume_reconciler_decisions", "counter"),
        ("volume_reconciler_open_operations", "gauge"),
        ("volume_reconciler_responses_lost", "counter"),
        ("volume_reconciler_responses_recovered", "counter"),
        ("volume_reconciler_reconciler_passes", "counter"),
        ("volume_reconciler_reconciler_decisions", "counter"),
        ("volume_reconciler_nova_slot_wait_seconds", "histogram"),
        ("volume_reconciler_drift_detected", "counter"),
        ("volume_reconciler_verification_missed", "counter"),
    ];
    for (name, kind) in want {
        let (k, samples) = m
            .get(name)
            .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{text}"));
        assert_eq!(k, kind, "{name}");
        assert!(!samples.is_empty(), "{name} has no samples");
    }
    let sample = |family: &str, needle: &str| -> f64 {
        m[family]
            .1
            .iter()
            .filter(|(s, _)| s.contains(needle))
            .map(|(_, v)| *v)
            .sum()
    };
    assert_eq!(
        sample(
            "volume_reconciler_grpc_requests",
            "method=\"AttachVolume\",code=\"OK\""
        ),
        2.0
    );
    assert_eq!(
        sample(
            "volume_reconciler_grpc_requests",
            "code=\"INVALID_ARGUMENT\""
        ),
        1.0
    );
    assert!(sample("volume_reconciler_grpc_requests_without_deadline", "total") >= 2.0);
    assert_eq!(sample("volume_reconciler_responses_lost", "total"), 1.0);
    assert_eq!(
        sample("volume_reconciler_responses_recovered", "total"),
        1.0
    );
    assert_eq!(
        sample(
            "volume_reconciler_decisions",
            "state=\"succeeded\",resolution=\"reobserved\""
        ),
        1.0
    );
    assert_eq!(
        sample(
            "volume_reconciler_reconciler_decisions",
            "decision=\"failed\""
        ),
        1.0
    );

    let health = http
        .get(format!("{}/healthz", app.admin_url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    let ready = http
        .get(format!("{}/readyz", app.admin_url))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    let channel = tonic::transport::Endpoint::from_shared(app.grpc_url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut hc = tonic_health::pb::health_client::HealthClient::new(channel);
    let st = hc
        .check(tonic_health::pb::HealthCheckRequest {
            service: "volume_reconciler.v1.VolumeReconciler".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        st.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    app.stop().await;
}
