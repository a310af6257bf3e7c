//! Cancel before send, through the real server chain: a cancel is one
//! compare-and-set with the send claim, so after a successful cancel no
//! request of the operation ever reaches Nova (the simulator), across
//! replicas, and a cancel that lost the race is never reported as a
//! success; a detach supersedes its caller's unsent attach, and nothing
//! is sent for either (docs/api.md, "Cancel before send").

use std::time::Duration;

use crate::support;

use support::lifecycle::*;
use support::{AppOptions, Ledger, TestApp, error_info, spawn_app, with_timeout};
use tonic::Code;
use volume_reconciler::domain::{Reason, Resolution, State};
use volume_reconciler::grpc::pb;
use volume_reconciler::sim::{Fault, FaultOp, FaultRule};

fn cancel(id: &str) -> pb::CancelOperationRequest {
    pb::CancelOperationRequest {
        operation_id: id.to_string(),
        reason: "the pod went away".into(),
    }
}

/// An attach's operation once its row satisfies `ready`.
async fn row_when(
    app: &TestApp,
    key: &str,
    what: &str,
    ready: impl Fn(&volume_reconciler::domain::Operation) -> bool + Clone,
) -> volume_reconciler::domain::Operation {
    let op = recorded(app, key).await;
    let store = app.store.clone();
    support::eventually(secs(20.0), what, || {
        let (store, ready) = (store.clone(), ready.clone());
        async move { ready(&store.operation_get(op.id).await.unwrap().unwrap()) }
    })
    .await;
    row(app, op.id).await
}

/// An attach waiting for its volume to be ready (Cinder shows it
/// `creating`: PENDING, nothing sent) is cancelled: FAILED with the
/// resolution CANCELLED, its caller answered CANCELLED with the id, and
/// nothing is sent for it once the volume is ready; a replay of its key
/// answers the cancelled operation. An attach whose request may be
/// leaving is refused CANCEL_TOO_LATE (and goes on), a decided one
/// OPERATION_ALREADY_DECIDED.
async fn a_cancel_before_anything_left_sends_nothing_ever(ledger: Ledger) {
    let app = spawn_app(with_history(ledger)).await;
    let (s, v) = ids();
    app.sim.force_volume_status(v, Some("creating".into()));
    let call = {
        let mut c = app.raw();
        tokio::spawn(async move {
            c.attach_volume(with_timeout(attach("c1", s, v), secs(30.0)))
                .await
        })
    };
    let pending = row_when(&app, "c1", "the attach waits for its volume", |op| {
        op.state == State::Pending
    })
    .await;
    let mut c = app.raw();
    let cancelled = c
        .cancel_operation(cancel(&pending.id.to_string()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (cancelled.state, cancelled.resolution),
        (pb::State::Failed as i32, pb::Resolution::Cancelled as i32)
    );
    assert_eq!(cancelled.last_error.as_ref().unwrap().reason, "CANCELLED");
    // The volume is ready: the run would send now, were it not cancelled.
    app.sim.force_volume_status(v, None);
    let answer = call.await.unwrap().unwrap_err();
    let (reason, md) = error_info(&answer);
    assert_eq!(
        (answer.code(), reason.as_str()),
        (Code::FailedPrecondition, "CANCELLED"),
        "{answer:?}"
    );
    assert_eq!(md.get("operation_id"), Some(&pending.id.to_string()));
    let now = row(&app, pending.id).await;
    assert_eq!(
        (now.state, now.resolution, now.attempts),
        (State::Failed, Some(Resolution::Cancelled), 0)
    );
    assert!(count(&log(&app, pending.id).await, "cancelled") == 1);
    // A replay of the key: the cancelled operation, not a new one.
    let replay = c.attach_volume(attach("c1", s, v)).await.unwrap_err();
    assert_eq!(error_info(&replay).0, "CANCELLED");
    assert_eq!(
        error_info(&replay).1.get("operation_id"),
        Some(&pending.id.to_string())
    );
    assert_eq!(app.sim.attach_requests(v), 0, "nothing ever reached Nova");
    assert!(!app.sim.is_attached(s, v));

    // A request that may be leaving: too late, and it goes on.
    let (s2, v2) = ids();
    app.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::DelayAfterEffect { ms: 1_500 }).volume(v2),
    );
    let call = {
        let mut c = app.raw();
        tokio::spawn(async move {
            c.attach_volume(with_timeout(attach("c2", s2, v2), secs(30.0)))
                .await
        })
    };
    let sending = row_when(&app, "c2", "its request reached Nova", move |_| true).await;
    support::eventually(secs(10.0), "its request reached Nova", || async {
        app.sim.attach_requests(v2) == 1
    })
    .await;
    let late = c
        .cancel_operation(cancel(&sending.id.to_string()))
        .await
        .unwrap_err();
    let (reason, md) = error_info(&late);
    assert_eq!(
        (late.code(), reason.as_str()),
        (Code::FailedPrecondition, "CANCEL_TOO_LATE"),
        "{late:?}"
    );
    assert_eq!(md.get("operation_id"), Some(&sending.id.to_string()));
    let done = call.await.unwrap().unwrap().into_inner();
    assert_eq!(done.state, pb::State::Succeeded as i32, "it went on");
    assert!(app.sim.is_attached(s2, v2));
    let decided = c
        .cancel_operation(cancel(&sending.id.to_string()))
        .await
        .unwrap_err();
    assert_eq!(error_info(&decided).0, "OPERATION_ALREADY_DECIDED");
    app.stop().await;
}

crate::on_both_ledgers!(a_cancel_before_anything_left_sends_nothing_ever);

/// An attach paused after Nova's 409s (its attempt marked: nothing of it
/// may take effect) is superseded by a detach of the same volume from the
/// same server by the same caller: the attach is cancelled (its caller
/// answered CANCELLED), the detach decided SUCCEEDED from Cinder's look
/// with nothing sent, and Nova saw no detach and no attach but the
/// refused ones.
async fn a_detach_superseding_an_unsent_attach_sends_nothing(ledger: Ledger) {
    let app = spawn_app(with_history(ledger)).await;
    let (s, v) = ids();
    app.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::Conflict)
            .volume(v)
            .always(),
    );
    let call = {
        let mut c = app.raw();
        tokio::spawn(async move {
            c.attach_volume(with_timeout(attach("s1", s, v), secs(30.0)))
                .await
        })
    };
    // A later pause (they grow: 40 ms, doubling to 1.5 s, jittered), so
    // that the detach meets one more often than not.
    let paused = row_when(&app, "s1", "the attach pauses after its third 409", |op| {
        op.attempt_unsent && op.attempts >= 3
    })
    .await;
    let mut c = app.raw();
    // A detach that comes while the attach sends again is refused
    // VOLUME_BUSY (it may take effect), and asked again, as a caller does
    // on ABORTED, at the attach's next pause: each refusal sent nothing.
    let mut busy = 0;
    let detached = loop {
        match c.detach_volume(detach("s1-detach", s, v)).await {
            Ok(op) => break op.into_inner(),
            Err(e) if error_info(&e).0 == "VOLUME_BUSY" && busy < 20 => {
                busy += 1;
                row_when(&app, "s1", "the attach pauses again", |op| {
                    op.attempt_unsent
                })
                .await;
            }
            Err(e) => panic!("after {busy} busy answers: {e:?}"),
        }
    };
    assert_eq!(detached.state, pb::State::Succeeded as i32, "{detached:?}");
    let answer = call.await.unwrap().unwrap_err();
    assert_eq!(error_info(&answer).0, "CANCELLED", "{answer:?}");
    let attach_row = row(&app, paused.id).await;
    assert_eq!(
        (attach_row.state, attach_row.resolution),
        (State::Failed, Some(Resolution::Cancelled))
    );
    let err = attach_row.last_error.unwrap();
    assert_eq!(err.reason, Reason::Cancelled);
    assert_eq!(err.metadata.get("superseded_by"), Some(&detached.id));
    // Nova: the refused attaches only (each answered 409), no detach.
    assert_eq!(app.sim.detach_requests(v), 0, "the detach sent nothing");
    let posts = requests_of(&app, paused.id);
    assert_eq!(posts.len() as i32, attach_row.attempts, "{posts:?}");
    assert!(posts.iter().all(|r| r.status == 409), "{posts:?}");
    assert_eq!(app.sim.attach_effects(v), 0);
    assert!(!app.sim.is_attached(s, v));
    app.stop().await;
}

crate::on_both_ledgers!(a_detach_superseding_an_unsent_attach_sends_nothing);

/// Two replicas on one ledger and one Nova. Thirty attaches (through
/// replica A) meet 3 to 6 of Nova's 409s each before Nova takes them (in
/// 600 ms: a request on its way to an effect), and
/// each is cancelled (through replica B) at a random moment of its first
/// two seconds. After a cancel that succeeded, no request of its
/// operation ever reaches Nova (each one that did arrived before the
/// cancel's commit, and was refused); a cancel that lost the race is never
/// reported as a success (refused CANCEL_TOO_LATE or
/// OPERATION_ALREADY_DECIDED, and the operation decided as its requests
/// made it).
#[tokio::test]
async fn cancels_racing_the_send_across_two_replicas_never_let_a_request_leave_after_success() {
    let a = spawn_app(with_history(Ledger::Postgres)).await;
    let handle = a.sim_handle.as_ref().expect("its own simulator");
    let b = spawn_app(
        AppOptions {
            db_url: Some(a.db_url.clone()),
            nova_url: Some(handle.nova_url.clone()),
            replica: "test-b".into(),
            ..AppOptions::default()
        }
        .arg("--cinder-url", &handle.cinder_url),
    )
    .await;
    let mut calls = Vec::new();
    for i in 0..30u64 {
        let (s, v) = ids();
        let refusals = 3 + (i % 4) as u32;
        a.sim.add_fault(
            FaultRule::new(FaultOp::Attach, Fault::Conflict)
                .volume(v)
                .times(refusals),
        );
        // Then Nova takes its time over the one it accepts: a request on
        // its way to an effect, for a cancel to race.
        a.sim.add_fault(
            FaultRule::new(FaultOp::Attach, Fault::DelayBeforeEffect { ms: 600 }).volume(v),
        );
        let (mut ca, mut cb) = (a.raw(), b.raw());
        let store = a.store.clone();
        let key = format!("race-{i}");
        // A spread of moments, not a clock's tick: i × 67 ms mod 2 s.
        let wait = Duration::from_millis((i * 67) % 2_000);
        calls.push(tokio::spawn(async move {
            let attach_call = tokio::spawn({
                let key = key.clone();
                async move {
                    ca.attach_volume(with_timeout(attach(&key, s, v), secs(30.0)))
                        .await
                }
            });
            let op = loop {
                if let Some(op) = store
                    .operation_get_by_key(&support::ck(None, &key))
                    .await
                    .unwrap()
                {
                    break op;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            };
            tokio::time::sleep(wait).await;
            let cancelled = cb.cancel_operation(cancel(&op.id.to_string())).await;
            let answered = attach_call.await.unwrap();
            (op.id, v, s, cancelled, answered)
        }));
    }
    let (mut won, mut lost) = (0, 0);
    for call in calls {
        let (id, v, s, cancelled, answered) = call.await.unwrap();
        let now = row(&a, id).await;
        let posts = requests_of(&a, id);
        match cancelled {
            Ok(reply) => {
                won += 1;
                let reply = reply.into_inner();
                assert_eq!(reply.resolution, pb::Resolution::Cancelled as i32);
                assert_eq!(
                    (now.state, now.resolution),
                    (State::Failed, Some(Resolution::Cancelled)),
                    "a cancel reported a success: the row says so"
                );
                let at = now.completed_at.unwrap();
                for r in &posts {
                    assert!(
                        r.received_at < at && r.status == 409,
                        "a request of cancelled {id} reached Nova at {} (cancel at {at}), answered {}",
                        r.received_at,
                        r.status
                    );
                }
                assert_eq!(a.sim.attach_effects(v), 0, "{id} took effect");
                assert!(!a.sim.is_attached(s, v));
                assert_eq!(error_info(&answered.unwrap_err()).0, "CANCELLED");
            }
            Err(refused) => {
                lost += 1;
                let reason = error_info(&refused).0;
                assert!(
                    reason == "CANCEL_TOO_LATE" || reason == "OPERATION_ALREADY_DECIDED",
                    "{refused:?}"
                );
                assert_ne!(now.resolution, Some(Resolution::Cancelled), "{now:?}");
                let op = answered.expect("an attach that was not cancelled succeeds");
                assert_eq!(op.into_inner().state, pb::State::Succeeded as i32);
                assert_eq!(a.sim.attach_effects(v), 1);
            }
        }
        assert!(posts.len() as i32 <= now.attempts, "{posts:?} {now:?}");
    }
    assert!(
        won > 0 && lost > 0,
        "the race was run both ways: {won} won, {lost} lost"
    );
    b.stop().await;
    a.stop().await;
}
