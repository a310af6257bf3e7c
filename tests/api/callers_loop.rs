//! The caller's loop, not only the call: what a stateless caller that asks
//! again until the world holds sees, call after call (docs/api.md, "Calls
//! again: keys and make it so"). Through the real server chain and the
//! simulator, each checked against the simulator's truth: the operation
//! kept at the deadline (a replay in the last moments answers it, never
//! "too small"); a refusal that proved nothing took effect does not stick
//! to its key; "make it so" calls (EnsureAttached, EnsureDetached) never
//! answer a stale decision, join the open operation of their identity,
//! and send nothing when the world already is as asked.

use std::time::Duration;

use crate::support;

use support::lifecycle::*;
use support::{Ledger, TestApp, error_info, spawn_app, with_timeout};
use tonic::Code;
use uuid::Uuid;
use volume_reconciler::domain::{Reason, State};
use volume_reconciler::grpc::pb;
use volume_reconciler::sim::{Fault, FaultOp, FaultRule};

fn ensure_attached(server: Uuid, volume: Uuid) -> pb::EnsureAttachedRequest {
    pb::EnsureAttachedRequest {
        server_id: server.to_string(),
        volume_id: volume.to_string(),
        ..Default::default()
    }
}

fn ensure_detached(server: Uuid, volume: Uuid) -> pb::EnsureDetachedRequest {
    pb::EnsureDetachedRequest {
        labels: Default::default(),
        server_id: server.to_string(),
        volume_id: volume.to_string(),
    }
}

/// A service whose only judge is Nova's list (no Cinder confirmation).
async fn app_on(ledger: Ledger) -> TestApp {
    spawn_app(with_history(ledger).arg("--confirm-with", "nova-list")).await
}

/// The answer's code, reason and operation id.
fn said(s: &tonic::Status) -> (Code, String, Option<String>) {
    let (reason, md) = error_info(s);
    (s.code(), reason, md.get("operation_id").cloned())
}

// ---------------------------------------------------------------------
// The operation kept at the deadline.
// ---------------------------------------------------------------------

/// Nova takes the attach and holds its answer, and its list fails: the
/// call is answered `OUTCOME_UNKNOWN` with the operation's id, a margin
/// before its deadline; a replay of the key in the last moments (300 ms,
/// and 120 ms: below the least a new request needs) answers the same
/// operation, not
/// `BUDGET_TOO_SMALL`; once the list answers, the reconciler decides it
/// `SUCCEEDED`, with exactly one request at Nova.
async fn the_operation_is_kept_at_the_deadline(deadline: Duration) {
    let app = app_on(Ledger::Postgres).await;
    let (s, v) = ids();
    let held = deadline.as_millis() as u64 + 60_000;
    app.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::DelayAfterEffect { ms: held }).volume(v));
    app.sim.add_fault(list_fails(s));
    let key = format!("kept-{}", deadline.as_secs());
    let mut c = app.raw();
    let started = tokio::time::Instant::now();
    let first = c
        .attach_volume(with_timeout(attach(&key, s, v), deadline))
        .await
        .expect_err("the outcome is not known by the deadline");
    let took = started.elapsed();
    let (code, reason, id) = said(&first);
    assert_eq!(
        (code, reason.as_str()),
        (Code::DeadlineExceeded, "OUTCOME_UNKNOWN"),
        "{first:?}"
    );
    let id: Uuid = id.expect("the operation's id is kept").parse().unwrap();
    assert!(
        took < deadline,
        "answered {took:?}, at or past the {deadline:?} deadline"
    );
    // The caller's last moments: 300 ms, and 120 ms (less than a new
    // request needs: the 100 ms minimum after the margin and the reserve).
    for last in [secs(0.3), secs(0.12)] {
        let replay = c
            .attach_volume(with_timeout(attach(&key, s, v), last))
            .await
            .expect_err("still not known");
        let (code, reason, again) = said(&replay);
        assert_eq!(code, Code::DeadlineExceeded, "{last:?}: {replay:?}");
        assert!(
            reason == "OUTCOME_UNKNOWN" || reason == "OPERATION_IN_PROGRESS",
            "a replay of an open key in {last:?} answers its operation, not {reason}: {replay:?}"
        );
        assert_eq!(
            again.as_deref(),
            Some(id.to_string().as_str()),
            "{replay:?}"
        );
    }
    // The list answers again: the reconciler decides from it.
    app.sim.clear_faults();
    let op = reconcile_until(&app, id, secs(60.0), "the operation is decided", |op| {
        op.state.is_terminal()
    })
    .await;
    assert_eq!(op.state, State::Succeeded, "{op:?}");
    assert_eq!(app.sim.attach_requests(v), 1, "exactly one POST");
    assert_eq!(app.sim.attach_effects(v), 1);
    assert!(app.sim.is_attached(s, v));
    app.stop().await;
}

#[tokio::test]
async fn a_3s_caller_keeps_its_operation_at_the_deadline() {
    the_operation_is_kept_at_the_deadline(secs(3.0)).await
}

#[tokio::test]
async fn a_10s_caller_keeps_its_operation_at_the_deadline() {
    the_operation_is_kept_at_the_deadline(secs(10.0)).await
}

#[tokio::test]
async fn a_30s_caller_keeps_its_operation_at_the_deadline() {
    the_operation_is_kept_at_the_deadline(secs(30.0)).await
}

/// A decided key answers its decision whatever the replay's time, and a
/// key that saved no result cannot start anything in 50 ms: too small.
async fn a_replay_too_short_to_start_anything_answers_what_the_key_has(ledger: Ledger) {
    let app = app_on(ledger).await;
    let (s, v) = ids();
    let mut c = app.raw();
    let done = c
        .attach_volume(with_timeout(attach("short-done", s, v), secs(10.0)))
        .await
        .unwrap()
        .into_inner();
    let again = c
        .attach_volume(with_timeout(attach("short-done", s, v), secs(0.05)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.id, done.id, "the decision, whatever the time");
    // A refusal that saved no result: a replay would start a new
    // operation, which 50 ms cannot.
    let (s2, v2) = ids();
    app.sim.add_fault(nova_busy(v2));
    let refused = c
        .attach_volume(with_timeout(attach("short-freed", s2, v2), secs(2.0)))
        .await
        .unwrap_err();
    assert_eq!(said(&refused).1, "NOVA_CONFLICT", "{refused:?}");
    let short = c
        .attach_volume(with_timeout(attach("short-freed", s2, v2), secs(0.05)))
        .await
        .unwrap_err();
    assert_eq!(said(&short).1, "BUDGET_TOO_SMALL", "{short:?}");
    assert!(
        !short.message().contains("Nova was not called"),
        "it says what this call did, not what the key did: {}",
        short.message()
    );
    assert_eq!(app.sim.attach_effects(v2), 0);
    app.stop().await;
}
crate::on_both_ledgers!(a_replay_too_short_to_start_anything_answers_what_the_key_has);

// ---------------------------------------------------------------------
// A refusal that proved nothing took effect does not stick.
// ---------------------------------------------------------------------

/// Nova answers 409 (the server busy in a task state) for longer than the
/// call's deadline: `ABORTED NOVA_CONFLICT`, nothing attached. Once Nova
/// is healthy, the caller's next call with the same key (the documented
/// recipe) starts a new operation under the key and attaches: one
/// effect. The ledger keeps both, each saying so, and the key names the
/// new one.
async fn a_transient_refusal_does_not_stick_to_its_key(ledger: Ledger) {
    let app = app_on(ledger).await;
    let (s, v) = ids();
    app.sim.add_fault(nova_busy(v));
    let mut c = app.raw();
    let refused = c
        .attach_volume(with_timeout(attach("busy-key", s, v), secs(3.0)))
        .await
        .expect_err("Nova stayed busy for the whole deadline");
    let (code, reason, first) = said(&refused);
    assert_eq!(
        (code, reason.as_str()),
        (Code::Aborted, "NOVA_CONFLICT"),
        "{refused:?}"
    );
    let first: Uuid = first.unwrap().parse().unwrap();
    assert_eq!(app.sim.attach_effects(v), 0);
    let old = row(&app, first).await;
    assert_eq!(
        (old.state, old.last_error.as_ref().map(|e| e.reason)),
        (State::Failed, Some(Reason::NovaConflict))
    );
    app.sim.clear_faults();
    // The same key, as a stateless caller asks again.
    let attached = c
        .attach_volume(with_timeout(attach("busy-key", s, v), secs(10.0)))
        .await
        .expect("the next call attaches")
        .into_inner();
    assert_ne!(id_of(&attached), first, "a new operation under the key");
    assert_eq!(attached.state, pb::State::Succeeded as i32);
    assert_eq!(attached.idempotency_key, "busy-key");
    assert_eq!(app.sim.attach_effects(v), 1, "one effect");
    assert!(app.sim.is_attached(s, v));
    // The key names the new operation; the old one stays, and says so.
    let by_key = row_by_key(&app, "busy-key")
        .await
        .expect("the key's operation");
    assert_eq!(by_key.id, id_of(&attached));
    assert_eq!(row(&app, first).await.state, State::Failed);
    let handed = |id| {
        let app = &app;
        async move { count(&log(app, id).await, "key_handed_on") }
    };
    assert_eq!(
        handed(first).await,
        1,
        "the old operation says its key moved on"
    );
    assert_eq!(
        handed(id_of(&attached)).await,
        1,
        "the new one says where it came from"
    );
    // A replay now answers the decision: a success is the key's for good.
    let again = c
        .attach_volume(with_timeout(attach("busy-key", s, v), secs(5.0)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.id, attached.id);
    assert_eq!(
        app.sim.attach_requests(v),
        attached.attempts + old.attempts as u32
    );
    app.stop().await;
}
crate::on_both_ledgers!(a_transient_refusal_does_not_stick_to_its_key);

/// The same through "make it so": the refusal is answered, and the next
/// EnsureAttached, once Nova is healthy, attaches (one effect). A
/// decided operation is never the next call's answer.
async fn a_transient_refusal_never_answers_the_next_ensure_call(ledger: Ledger) {
    let app = app_on(ledger).await;
    let (s, v) = ids();
    app.sim.add_fault(nova_busy(v));
    let mut c = app.raw();
    let refused = c
        .ensure_attached(with_timeout(ensure_attached(s, v), secs(3.0)))
        .await
        .expect_err("Nova stayed busy");
    assert_eq!(said(&refused).1, "NOVA_CONFLICT", "{refused:?}");
    app.sim.clear_faults();
    let op = c
        .ensure_attached(with_timeout(ensure_attached(s, v), secs(10.0)))
        .await
        .expect("attached")
        .into_inner();
    assert_eq!(op.state, pb::State::Succeeded as i32);
    assert!(op.ensure && op.idempotency_key.is_empty(), "{op:?}");
    assert_eq!(app.sim.attach_effects(v), 1);
    app.stop().await;
}
crate::on_both_ledgers!(a_transient_refusal_never_answers_the_next_ensure_call);

// ---------------------------------------------------------------------
// "Make it so".
// ---------------------------------------------------------------------

/// A CSI controller's publish, unpublish and publish of one (volume,
/// node), each asked as EnsureAttached/EnsureDetached: attached at the
/// end, one effect per attach, no stale success (the second publish is
/// not answered with the first's decision: it attaches again). Asked
/// again while it holds, a call sends nothing and answers SUCCEEDED at
/// once, as a new operation (the ledger keeps every one).
async fn publish_unpublish_publish_attaches_again(ledger: Ledger) {
    let app = app_on(ledger).await;
    let (s, v) = ids();
    let mut c = app.raw();
    let first = c
        .ensure_attached(with_timeout(ensure_attached(s, v), secs(10.0)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.state, pb::State::Succeeded as i32);
    assert_eq!(app.sim.attach_effects(v), 1);
    // Asked again while it holds: nothing sent.
    let requests = app.sim.attach_requests(v);
    let holds = c
        .ensure_attached(with_timeout(ensure_attached(s, v), secs(10.0)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(holds.state, pb::State::Succeeded as i32);
    assert_ne!(
        holds.id, first.id,
        "a new operation, never the old decision"
    );
    assert_eq!(holds.attempts, 0, "nothing sent: {holds:?}");
    assert_eq!(app.sim.attach_requests(v), requests);
    let off = c
        .ensure_detached(with_timeout(ensure_detached(s, v), secs(10.0)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(off.state, pb::State::Succeeded as i32);
    support::eventually(secs(10.0), "the volume is detached", || {
        let sim = app.sim.clone();
        async move { !sim.is_attached(s, v) }
    })
    .await;
    let again = c
        .ensure_attached(with_timeout(ensure_attached(s, v), secs(10.0)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.state, pb::State::Succeeded as i32);
    assert_ne!(again.id, first.id);
    assert!(again.attempts >= 1, "it attached again: {again:?}");
    assert!(app.sim.is_attached(s, v), "attached at the end");
    assert_eq!(app.sim.attach_effects(v), 2, "one effect per attach");
    // The identity's history, newest first.
    let listed = c
        .list_operations(with_timeout(
            pb::ListOperationsRequest {
                volume_id: v.to_string(),
                ..Default::default()
            },
            secs(5.0),
        ))
        .await
        .unwrap()
        .into_inner();
    let ids: Vec<_> = listed.operations.iter().map(|o| o.id.clone()).collect();
    assert_eq!(ids, [again.id, off.id, holds.id, first.id]);
    app.stop().await;
}
crate::on_both_ledgers!(publish_unpublish_publish_attaches_again);

/// An unpublish of a volume that is not attached, or of a server that is
/// gone, is done at once, nothing sent; an EnsureAttached to a server
/// that is gone is NOT_FOUND.
async fn ensure_calls_send_nothing_when_the_world_is_as_asked(ledger: Ledger) {
    let app = app_on(ledger).await;
    let (s, v) = ids();
    let mut c = app.raw();
    let done = c
        .ensure_detached(with_timeout(ensure_detached(s, v), secs(10.0)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(done.state, pb::State::Succeeded as i32);
    assert_eq!(done.attempts, 0);
    assert_eq!(app.sim.detach_requests(v), 0);
    let gone = Uuid::new_v4();
    app.sim.remove_server(gone);
    let off = c
        .ensure_detached(with_timeout(ensure_detached(gone, v), secs(10.0)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(off.state, pb::State::Succeeded as i32);
    let missing = c
        .ensure_attached(with_timeout(ensure_attached(gone, v), secs(10.0)))
        .await
        .unwrap_err();
    assert_eq!(
        (missing.code(), said(&missing).1.as_str()),
        (Code::NotFound, "NOVA_SERVER_NOT_FOUND"),
        "{missing:?}"
    );
    assert_eq!(app.sim.attach_requests(v), 0, "nothing sent");
    app.stop().await;
}
crate::on_both_ledgers!(ensure_calls_send_nothing_when_the_world_is_as_asked);

/// Per-volume serialization stays: an Ensure call for the other state, or
/// of another caller, while one is open answers `ABORTED VOLUME_BUSY`;
/// one of the same identity joins it.
async fn an_ensure_call_joins_its_identity_and_no_other(ledger: Ledger) {
    let app = app_on(ledger).await;
    let (s, v) = ids();
    app.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::DelayBeforeEffect { ms: 2000 }).volume(v),
    );
    let mut c = app.raw();
    let mut c2 = app.raw();
    let first = tokio::spawn(async move {
        c2.ensure_attached(with_timeout(ensure_attached(s, v), secs(15.0)))
            .await
    });
    let open = recorded_ensure(&app, v).await;
    let joined = c
        .ensure_attached(with_timeout(ensure_attached(s, v), secs(15.0)))
        .await
        .unwrap()
        .into_inner();
    let first = first.await.unwrap().unwrap().into_inner();
    assert_eq!(
        joined.id, first.id,
        "the open operation of its identity, joined"
    );
    assert_eq!(id_of(&first), open);
    assert_eq!(app.sim.attach_requests(v), 1);
    // The other state while one is open: busy.
    app.sim.add_fault(
        FaultRule::new(FaultOp::Detach, Fault::DelayBeforeEffect { ms: 2000 }).volume(v),
    );
    let mut c3 = app.raw();
    let detaching = tokio::spawn(async move {
        c3.ensure_detached(with_timeout(ensure_detached(s, v), secs(15.0)))
            .await
    });
    let open = recorded_ensure(&app, v).await;
    let busy = c
        .ensure_attached(with_timeout(ensure_attached(s, v), secs(5.0)))
        .await
        .unwrap_err();
    assert_eq!(
        said(&busy),
        (Code::Aborted, "VOLUME_BUSY".into(), Some(open.to_string())),
        "{busy:?}"
    );
    detaching.await.unwrap().unwrap();
    app.stop().await;
}
crate::on_both_ledgers!(an_ensure_call_joins_its_identity_and_no_other);

/// The open operation of volume `v`, once recorded.
async fn recorded_ensure(app: &TestApp, v: Uuid) -> Uuid {
    let open = |store: std::sync::Arc<dyn volume_reconciler::store::Store>| async move {
        let filter = volume_reconciler::store::OperationFilter {
            volume_id: Some(v),
            ..Default::default()
        };
        let page = store.operation_list(&filter, None, 10).await.unwrap();
        page.operations
            .iter()
            .find(|o| !o.state.is_terminal())
            .map(|o| o.id)
    };
    let store = app.store.clone();
    support::eventually(secs(10.0), "the operation is recorded", || {
        let store = store.clone();
        async move { open(store).await.is_some() }
    })
    .await;
    open(app.store.clone()).await.expect("still open")
}

/// A hundred stateless callers, two per volume on fifty volumes, each
/// asking EnsureAttached until it holds, while a fifth of the attaches
/// lose their answer after taking effect: every volume attached exactly
/// once, and the two callers of a volume answered with the same operation.
#[tokio::test]
async fn a_hundred_ensure_callers_with_lost_answers_attach_each_volume_once() {
    let app = app_on(Ledger::Postgres).await;
    let server = Uuid::new_v4();
    let volumes: Vec<Uuid> = (0..50).map(|_| Uuid::new_v4()).collect();
    for (i, v) in volumes.iter().enumerate() {
        // Every attach takes a moment (both callers of a volume meet its
        // open operation); one in five takes effect and loses its answer
        // (its body never completes within the request's deadline).
        let fault = if i % 5 == 0 {
            Fault::StallBody {
                ms: 120_000,
                effect: true,
            }
        } else {
            Fault::DelayBeforeEffect { ms: 1500 }
        };
        app.sim
            .add_fault(FaultRule::new(FaultOp::Attach, fault).volume(*v));
    }
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(100));
    let mut callers = Vec::new();
    for v in &volumes {
        for _ in 0..2 {
            let (mut c, v, start) = (app.raw(), *v, start.clone());
            callers.push(tokio::spawn(async move {
                start.wait().await;
                // Level-triggered: ask until it holds.
                for _ in 0..20 {
                    match c
                        .ensure_attached(with_timeout(ensure_attached(server, v), secs(20.0)))
                        .await
                    {
                        Ok(op) => return (v, op.into_inner().id),
                        Err(e)
                            if matches!(
                                e.code(),
                                Code::DeadlineExceeded | Code::Aborted | Code::Unavailable
                            ) => {}
                        Err(e) => panic!("{v}: {e:?}"),
                    }
                }
                panic!("{v}: never attached")
            }));
        }
    }
    let mut answered = std::collections::HashMap::<Uuid, Vec<String>>::new();
    for c in callers {
        let (v, id) = c.await.unwrap();
        answered.entry(v).or_default().push(id);
    }
    for v in &volumes {
        assert_eq!(app.sim.attach_effects(*v), 1, "{v}: attached exactly once");
        assert!(app.sim.is_attached(server, *v));
        let ids = &answered[v];
        assert_eq!(
            ids[0], ids[1],
            "{v}: both callers answered the same operation"
        );
    }
    app.stop().await;
}
