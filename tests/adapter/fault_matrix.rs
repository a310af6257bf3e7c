//! The fault matrix of AttachVolume/DetachVolume through the real server,
//! against the simulator, with a real PostgreSQL. Every test checks three
//! things: the RPC's answer, the ledger row, and what Nova really did.

use crate::support;

use std::time::Duration;

use support::lifecycle::{attach, detach, ids};
use support::{AppOptions, TestApp, error_info, spawn_app, with_timeout};
use tokio::time::Instant;
use tonic::Code;
use uuid::Uuid;
use volume_reconciler::domain::{Operation, Resolution, State};
use volume_reconciler::grpc::pb;
use volume_reconciler::sim::{self, Fault, FaultOp, FaultRule, SimConfig};

async fn row(app: &TestApp, id: &str) -> Operation {
    app.store
        .operation_get(id.parse().unwrap())
        .await
        .unwrap()
        .expect("the row exists")
}

async fn row_by_key(app: &TestApp, key: &str) -> Operation {
    app.store
        .operation_get_by_key(&crate::support::ck(None, key))
        .await
        .unwrap()
        .expect("the row exists")
}

async fn event_kinds(app: &TestApp, id: Uuid) -> Vec<String> {
    app.store
        .operation_events(id)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .collect()
}

#[tokio::test]
async fn a_lost_attach_response_is_recorded_as_success_after_reobserving() {
    let app = spawn_app(AppOptions::default()).await;
    let (s, v) = ids();
    // Nova acts, then answers long after the outbound deadline.
    app.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::DelayAfterEffect { ms: 8000 }).volume(v));
    let started = Instant::now();
    // 5 s: the look and the durable decision fit in the reserve (1 s) on
    // a loaded CI machine.
    let op = app
        .raw()
        .attach_volume(with_timeout(attach("lost-1", s, v), Duration::from_secs(5)))
        .await
        .expect("the lost response is recovered by re-observation")
        .into_inner();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "answered before the caller's deadline"
    );
    assert_eq!(op.state, pb::State::Succeeded as i32);
    assert_eq!(op.resolution, pb::Resolution::Reobserved as i32);
    let r = row(&app, &op.id).await;
    assert_eq!(
        (r.state, r.resolution),
        (State::Succeeded, Some(Resolution::Reobserved))
    );
    assert!(
        r.attachment.is_some(),
        "attachment details come from the observation"
    );
    assert_eq!(
        app.sim.attach_effects(v),
        1,
        "exactly one attach took effect"
    );
    assert!(app.sim.is_attached(s, v));
    let kinds = event_kinds(&app, r.id).await;
    for k in [
        "recorded",
        "request_sent",
        "request_failed",
        "observed",
        "resolved",
    ] {
        assert!(
            kinds.iter().any(|x| x == k),
            "{k} missing from the reconcile log: {kinds:?}"
        );
    }
    let events = app.store.operation_events(r.id).await.unwrap();
    let failed = events.iter().find(|e| e.kind == "request_failed").unwrap();
    assert_eq!(failed.metadata["error_class"], "deadline_exceeded");
    assert_eq!(failed.metadata["stage"], "await_headers");
    app.stop().await;
}

#[tokio::test]
async fn a_connection_closed_after_the_attach_is_recorded_as_success() {
    let app = spawn_app(AppOptions::default()).await;
    let (s, v) = ids();
    app.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::CloseAfterEffect).volume(v));
    let op = app
        .raw()
        .attach_volume(with_timeout(
            attach("close-1", s, v),
            Duration::from_secs(5),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (op.state, op.resolution),
        (
            pb::State::Succeeded as i32,
            pb::Resolution::Reobserved as i32
        )
    );
    assert_eq!(row(&app, &op.id).await.state, State::Succeeded);
    assert_eq!(app.sim.attach_effects(v), 1);
    assert_eq!(
        app.sim.attach_requests(v),
        1,
        "found on the first look, no retry"
    );
    app.stop().await;
}

#[tokio::test]
async fn slow_nova_inside_the_callers_deadline_succeeds_on_its_response_without_retry() {
    let app = spawn_app(AppOptions::default()).await;
    let (s, v) = ids();
    app.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::DelayAfterEffect { ms: 3000 }).volume(v));
    let op = app
        .raw()
        .attach_volume(with_timeout(
            attach("slow-1", s, v),
            Duration::from_secs(10),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (op.state, op.resolution, op.attempts),
        (
            pb::State::Succeeded as i32,
            pb::Resolution::Response as i32,
            1
        )
    );
    assert_eq!(
        row(&app, &op.id).await.resolution,
        Some(Resolution::Response)
    );
    assert_eq!(app.sim.attach_requests(v), 1);
    assert_eq!(app.sim.attach_effects(v), 1);
    app.stop().await;
}

#[tokio::test]
async fn a_caller_deadline_longer_than_the_server_default_is_never_shortened() {
    let app = spawn_app(AppOptions::default().arg("--default-deadline", "1s")).await;
    let (s, v) = ids();
    app.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::DelayAfterEffect { ms: 2500 }).volume(v));
    let op = app
        .raw()
        .attach_volume(with_timeout(
            attach("long-1", s, v),
            Duration::from_secs(10),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (op.state, op.resolution),
        (pb::State::Succeeded as i32, pb::Resolution::Response as i32)
    );
    assert_eq!(app.sim.attach_effects(v), 1);
    app.stop().await;
}

#[tokio::test]
async fn without_a_caller_deadline_the_server_default_bounds_the_call() {
    // Goes through the chain exactly as `main` builds it. Without the
    // deadline layer this call would wait for Nova's 30 s answer and
    // succeed; with it, the default (5 s) answers DEADLINE_EXCEEDED. (5 s,
    // not less: the reserve's last quarter, 250 ms, is the time the unknown
    // decision has to be written in, on a loaded CI machine.)
    let app = spawn_app(AppOptions::default().arg("--default-deadline", "5s")).await;
    let (s, v) = ids();
    app.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::DelayBeforeEffect { ms: 30_000 }).volume(v),
    );
    app.sim.add_fault(
        FaultRule::new(FaultOp::List, Fault::DelayBeforeEffect { ms: 30_000 })
            .server(s)
            .always(),
    );
    let started = Instant::now();
    let mut c = app.raw();
    let call = c.attach_volume(tonic::Request::new(attach("nodl-1", s, v)));
    let err = tokio::time::timeout(Duration::from_secs(40), call)
        .await
        .expect("the server answers on its own")
        .unwrap_err();
    let took = started.elapsed();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    assert!(
        took >= Duration::from_millis(4000) && took < Duration::from_secs(15),
        "answered by the default: {took:?}"
    );
    let (reason, meta) = error_info(&err);
    assert_eq!(reason, "OUTCOME_UNKNOWN", "{meta:?}");
    let r = row(&app, &meta["operation_id"]).await;
    assert_eq!(r.state, State::Unknown);
    assert!(!app.sim.is_attached(s, v), "nothing took effect yet");
    app.stop().await;
}

#[tokio::test]
async fn a_budget_below_the_minimum_never_calls_nova() {
    // A 2 s minimum and a 1 s deadline: 750 ms for Nova after the margin
    // and the reserve, below the minimum; and time enough for the ledger
    // read that looks for a decided replay first, on a loaded machine.
    let app = spawn_app(AppOptions::default().arg("--min-budget", "2s")).await;
    let (s, v) = ids();
    let err = app
        .raw()
        .attach_volume(with_timeout(
            attach("tiny-1", s, v),
            Duration::from_millis(1000),
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded);
    let (reason, meta) = error_info(&err);
    assert_eq!(reason, "BUDGET_TOO_SMALL");
    assert!(meta.contains_key("available_ms") && meta.contains_key("minimum_ms"));
    assert_eq!(app.sim.attach_requests(v), 0, "Nova was not called");
    assert!(
        app.store
            .operation_get_by_key(&crate::support::ck(None, "tiny-1"))
            .await
            .unwrap()
            .is_none(),
        "nothing recorded: the key stays free"
    );
    app.stop().await;
}

/// A 5xx is no proof that nothing happened (a 500 can follow the cast to
/// the compute host; a 503 from a proxy comes while Nova goes on): it is
/// watched, never re-sent on the spot; not seen by the deadline it is
/// UNKNOWN, and the reconciler decides after the settle window.
#[tokio::test]
async fn a_503_without_effect_is_watched_not_resent_and_the_reconciler_decides_it() {
    // The settle window (6 s) outlasts the deadline (4 s): once it has
    // passed, no re-send fits in the operation's deadline, so the
    // reconciler must decide from what it sees.
    let app = spawn_app(AppOptions::default().arg("--settle-window", "6s")).await;
    let (s, v) = ids();
    app.sim.add_fault(
        FaultRule::new(
            FaultOp::Attach,
            Fault::Status {
                code: 503,
                effect: false,
            },
        )
        .volume(v),
    );
    let err = app
        .raw()
        .attach_volume(with_timeout(attach("503-1", s, v), Duration::from_secs(4)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    let (reason, meta) = error_info(&err);
    assert_eq!(reason, "OUTCOME_UNKNOWN", "{meta:?}");
    assert_eq!(app.sim.attach_requests(v), 1, "never re-sent");
    let r = row_by_key(&app, "503-1").await;
    assert_eq!((r.state, r.attempts), (State::Unknown, 1));
    let kinds = event_kinds(&app, r.id).await;
    assert!(
        kinds.contains(&"observed".to_string()),
        "it looked for the effect: {kinds:?}"
    );
    // Past its deadline and the settle window, not observed: FAILED, and
    // never re-sent.
    let id = r.id;
    support::eventually(Duration::from_secs(20), "the reconciler decides", || {
        let app = &app;
        async move {
            app.reconciler.run_once().await.unwrap();
            app.store.operation_get(id).await.unwrap().unwrap().state == State::Failed
        }
    })
    .await;
    let r = row(&app, &id.to_string()).await;
    assert_eq!(r.resolution, Some(Resolution::Reconciler));
    assert_eq!(
        r.last_error.map(|e| e.reason.to_string()).as_deref(),
        Some("NOT_OBSERVED")
    );
    assert_eq!(app.sim.attach_requests(v), 1);
    assert!(!app.sim.is_attached(s, v));
    app.stop().await;
}

#[tokio::test]
async fn a_500_that_took_effect_is_recorded_as_success_without_a_second_attach() {
    let app = spawn_app(AppOptions::default()).await;
    let (s, v) = ids();
    app.sim.add_fault(
        FaultRule::new(
            FaultOp::Attach,
            Fault::Status {
                code: 500,
                effect: true,
            },
        )
        .volume(v),
    );
    let op = app
        .raw()
        .attach_volume(with_timeout(attach("500-1", s, v), Duration::from_secs(10)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (op.state, op.resolution),
        (
            pb::State::Succeeded as i32,
            pb::Resolution::Reobserved as i32
        )
    );
    assert_eq!(app.sim.attach_requests(v), 1);
    assert_eq!(app.sim.attach_effects(v), 1);
    app.stop().await;
}

#[tokio::test]
async fn a_refused_connection_is_retried_until_nova_is_up() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let app = spawn_app(AppOptions {
        nova_url: Some(format!("http://{addr}/v2.1")),
        ..Default::default()
    })
    .await;
    let (s, v) = ids();
    let mut c = app.raw();
    let call = tokio::spawn(async move {
        c.attach_volume(with_timeout(
            attach("refused-1", s, v),
            Duration::from_secs(15),
        ))
        .await
    });
    let store = app.store.clone();
    support::eventually(
        Duration::from_secs(10),
        "a connect failure is recorded",
        || {
            let store = store.clone();
            async move {
                match store
                    .operation_get_by_key(&crate::support::ck(None, "refused-1"))
                    .await
                    .unwrap()
                {
                    Some(op) => store
                        .operation_events(op.id)
                        .await
                        .unwrap()
                        .iter()
                        .any(|e| e.kind == "retry_scheduled"),
                    None => false,
                }
            }
        },
    )
    .await;
    let h = sim::start(addr, SimConfig::default()).await.unwrap();
    let op = call.await.unwrap().unwrap().into_inner();
    assert_eq!(op.state, pb::State::Succeeded as i32);
    assert!(op.attempts >= 2, "{}", op.attempts);
    assert_eq!(h.sim.attach_effects(v), 1);
    let events = app
        .store
        .operation_events(op.id.parse().unwrap())
        .await
        .unwrap();
    assert!(events.iter().any(|e| e.kind == "request_failed"
        && e.metadata.get("error_class").map(String::as_str) == Some("connect_failed")));
    app.stop().await;
}

/// Confirming with Nova's list, Nova's 400 "already attached" decides
/// (its servers looked at); with Cinder, its pre-check does, before any
/// request (cinder-csi's check).
#[tokio::test]
async fn already_attached_here_is_success_and_attached_elsewhere_is_a_failure_naming_the_server() {
    for (mode, failed_by, requests) in [
        ("nova-list", Resolution::Response, 1),
        ("cinder", Resolution::Reobserved, 0),
    ] {
        already_attached(mode, failed_by, requests).await;
    }
}

async fn already_attached(mode: &str, failed_by: Resolution, requests: u32) {
    let app = spawn_app(AppOptions::default().arg("--confirm-with", mode)).await;
    let (s, v) = ids();
    app.sim.seed_attachment(s, v);
    let op = app
        .raw()
        .attach_volume(with_timeout(
            attach("here-1", s, v),
            Duration::from_secs(10),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (op.state, op.resolution),
        (
            pb::State::Succeeded as i32,
            pb::Resolution::Reobserved as i32
        )
    );
    assert_eq!(app.sim.attach_effects(v), 0, "no second attachment");
    assert!(app.sim.is_attached(s, v));

    let (other, v2) = ids();
    app.sim.seed_attachment(other, v2);
    let err = app
        .raw()
        .attach_volume(with_timeout(
            attach("else-1", s, v2),
            Duration::from_secs(10),
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let (reason, meta) = error_info(&err);
    assert_eq!(reason, "ALREADY_ATTACHED_ELSEWHERE");
    assert_eq!(meta["attached_to"], other.to_string());
    let r = row_by_key(&app, "else-1").await;
    assert_eq!(
        (r.state, r.resolution),
        (State::Failed, Some(failed_by)),
        "{mode}"
    );
    assert_eq!(app.sim.attach_requests(v2), requests, "{mode}");
    assert_eq!(app.sim.attach_requests(v), requests, "{mode}");
    assert!(!app.sim.is_attached(s, v2));
    app.stop().await;
}

#[tokio::test]
async fn a_locked_server_is_retried_until_unlocked_and_fails_as_conflict_if_never() {
    let app = spawn_app(AppOptions::default()).await;
    let (s, v) = ids();
    app.sim.lock_server(s, true);
    let sim = app.sim.clone();
    let mut c = app.raw();
    let call = tokio::spawn(async move {
        c.attach_volume(with_timeout(
            attach("lock-1", s, v),
            Duration::from_secs(15),
        ))
        .await
    });
    let store = app.store.clone();
    support::eventually(
        Duration::from_secs(10),
        "a retry is scheduled on the conflict",
        || {
            let store = store.clone();
            async move {
                match store
                    .operation_get_by_key(&crate::support::ck(None, "lock-1"))
                    .await
                    .unwrap()
                {
                    Some(op) => op.attempts >= 2,
                    None => false,
                }
            }
        },
    )
    .await;
    sim.lock_server(s, false);
    let op = call.await.unwrap().unwrap().into_inner();
    assert_eq!(op.state, pb::State::Succeeded as i32);
    assert!(op.attempts >= 2);
    assert_eq!(app.sim.attach_effects(v), 1);

    let (s2, v2) = ids();
    app.sim.lock_server(s2, true);
    let err = app
        .raw()
        .attach_volume(with_timeout(
            attach("lock-2", s2, v2),
            Duration::from_secs(2),
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Aborted, "{err:?}");
    let (reason, meta) = error_info(&err);
    assert_eq!(reason, "NOVA_CONFLICT");
    assert_eq!(meta["http_status"], "409");
    let r = row_by_key(&app, "lock-2").await;
    assert_eq!(r.state, State::Failed);
    assert!(r.attempts >= 2, "it did retry within the budget");
    assert_eq!(app.sim.attach_effects(v2), 0);
    app.stop().await;
}

#[tokio::test]
async fn a_missing_server_is_not_found_with_all_the_context() {
    let app = spawn_app(AppOptions::default()).await;
    let (s, v) = ids();
    app.sim.remove_server(s);
    let err = app
        .raw()
        .attach_volume(with_timeout(attach("404-1", s, v), Duration::from_secs(10)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let (reason, meta) = error_info(&err);
    assert_eq!(reason, "NOVA_SERVER_NOT_FOUND");
    for key in [
        "operation_id",
        "method",
        "url",
        "http_status",
        "nova_fault",
        "nova_message",
        "cause",
        "stage",
    ] {
        assert!(meta.contains_key(key), "{key} missing: {meta:?}");
    }
    assert_eq!(meta["method"], "POST");
    assert_eq!(meta["http_status"], "404");
    assert_eq!(meta["nova_fault"], "itemNotFound");
    assert!(meta["nova_message"].contains(&s.to_string()));
    let r = row(&app, &meta["operation_id"]).await;
    assert_eq!(
        (r.state, r.resolution),
        (State::Failed, Some(Resolution::Response))
    );
    assert_eq!(r.attempts, 1);
    // A replay answers the same, without calling Nova again.
    let again = app
        .raw()
        .attach_volume(with_timeout(attach("404-1", s, v), Duration::from_secs(10)))
        .await
        .unwrap_err();
    assert_eq!(again.code(), Code::NotFound);
    assert_eq!(app.sim.attach_requests(v), 1);
    app.stop().await;
}

#[tokio::test]
async fn at_microversion_2_101_an_accepted_attach_is_confirmed_by_observation() {
    let app = spawn_app(AppOptions::default().arg("--nova-microversion", "2.101")).await;
    let (s, v) = ids();
    let op = app
        .raw()
        .attach_volume(with_timeout(
            attach("async-1", s, v),
            Duration::from_secs(10),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (op.state, op.resolution),
        (
            pb::State::Succeeded as i32,
            pb::Resolution::Reobserved as i32
        )
    );
    let att = op.attachment.expect("details from the list");
    assert!(
        !att.id.is_empty() && att.id != v.to_string(),
        "the 2.89+ attachment id: {att:?}"
    );
    assert_eq!(app.sim.attach_effects(v), 1);
    app.stop().await;
}

#[tokio::test]
async fn a_body_stalled_until_the_deadline_is_deadline_exceeded_not_internal() {
    let app = spawn_app(AppOptions::default().arg("--settle-window", "0s")).await;
    let (s, v) = ids();
    app.sim.add_fault(
        FaultRule::new(
            FaultOp::Attach,
            Fault::StallBody {
                ms: 30_000,
                effect: true,
            },
        )
        .volume(v),
    );
    app.sim.add_fault(
        FaultRule::new(
            FaultOp::List,
            Fault::StallBody {
                ms: 30_000,
                effect: true,
            },
        )
        .server(s)
        .always(),
    );
    let err = app
        .raw()
        .attach_volume(with_timeout(
            attach("stall-1", s, v),
            Duration::from_secs(4),
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    let (reason, meta) = error_info(&err);
    assert_eq!(reason, "OUTCOME_UNKNOWN");
    assert_eq!(meta["stage"], "read_body");
    assert_eq!(meta["error_class"], "deadline_exceeded");
    let r = row(&app, &meta["operation_id"]).await;
    assert_eq!(r.state, State::Unknown);
    assert!(app.sim.is_attached(s, v), "the truth: it took effect");
    // Once Nova answers again, the reconciler finds it.
    app.sim.clear_faults();
    let counts = app.reconciler.run_once().await.unwrap();
    assert_eq!(counts.succeeded, 1, "{counts:?}");
    let r = row(&app, &meta["operation_id"]).await;
    assert_eq!(
        (r.state, r.resolution),
        (State::Succeeded, Some(Resolution::Reconciler))
    );
    assert_eq!(app.sim.attach_effects(v), 1);
    app.stop().await;
}

#[tokio::test]
async fn a_caller_that_disconnects_mid_call_still_gets_the_true_state_recorded() {
    let app = spawn_app(AppOptions::default()).await;
    let (s, v) = ids();
    app.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::DelayAfterEffect { ms: 1500 }).volume(v));
    let mut c = app.raw();
    let call = tokio::spawn(async move {
        c.attach_volume(with_timeout(
            attach("gone-1", s, v),
            Duration::from_secs(10),
        ))
        .await
    });
    let store = app.store.clone();
    support::eventually(Duration::from_secs(10), "the attach is in flight", || {
        let store = store.clone();
        async move {
            store
                .operation_get_by_key(&crate::support::ck(None, "gone-1"))
                .await
                .unwrap()
                .is_some()
        }
    })
    .await;
    call.abort(); // the caller goes away (RST_STREAM)
    let store = app.store.clone();
    support::eventually(
        Duration::from_secs(15),
        "the operation is decided anyway",
        || {
            let store = store.clone();
            async move {
                store
                    .operation_get_by_key(&crate::support::ck(None, "gone-1"))
                    .await
                    .unwrap()
                    .unwrap()
                    .state
                    .is_terminal()
            }
        },
    )
    .await;
    let r = row_by_key(&app, "gone-1").await;
    assert_eq!(
        (r.state, r.resolution),
        (State::Succeeded, Some(Resolution::Response))
    );
    assert!(app.sim.is_attached(s, v));
    assert_eq!(app.sim.attach_effects(v), 1);
    app.stop().await;
}

#[tokio::test]
async fn detach_waits_until_the_volume_is_gone_and_recovers_lost_responses() {
    let app = spawn_app(AppOptions {
        sim: SimConfig {
            detach_delay_ms: 400,
            ..SimConfig::default()
        },
        ..Default::default()
    })
    .await;
    let (s, v) = ids();
    app.sim.seed_attachment(s, v);
    let op = app
        .raw()
        .detach_volume(with_timeout(detach("d-1", s, v), Duration::from_secs(10)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (op.state, op.resolution),
        (
            pb::State::Succeeded as i32,
            pb::Resolution::Reobserved as i32
        )
    );
    assert!(!app.sim.is_attached(s, v), "gone when the RPC answered");

    // Not attached: 404 "not attached" means done.
    let op = app
        .raw()
        .detach_volume(with_timeout(detach("d-2", s, v), Duration::from_secs(10)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(op.state, pb::State::Succeeded as i32);

    // The response is lost after Nova accepted the detach.
    let (s2, v2) = ids();
    app.sim.seed_attachment(s2, v2);
    app.sim
        .add_fault(FaultRule::new(FaultOp::Detach, Fault::CloseAfterEffect).volume(v2));
    let op = app
        .raw()
        .detach_volume(with_timeout(detach("d-3", s2, v2), Duration::from_secs(10)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (op.state, op.resolution),
        (
            pb::State::Succeeded as i32,
            pb::Resolution::Reobserved as i32
        )
    );
    assert!(!app.sim.is_attached(s2, v2));
    let log = app
        .store
        .operation_events(op.id.parse().unwrap())
        .await
        .unwrap();
    assert_eq!(
        app.sim.detach_requests(v2),
        1,
        "no duplicate detach: {log:#?}"
    );

    app.stop().await;
}

/// A detach from a server that no longer exists has succeeded: nothing is
/// attached to a server that is gone. Confirming with Nova's list, Nova's
/// 404 says so, and a look at the server (`GET /servers/{id}`) agrees;
/// with Cinder, its pre-check sees the volume attached nowhere and nothing
/// is sent.
#[tokio::test]
async fn a_detach_from_a_deleted_server_succeeds_in_both_confirmation_modes() {
    for (mode, resolution, requests) in [
        ("nova-list", pb::Resolution::Response, 1),
        ("cinder", pb::Resolution::Reobserved, 0),
    ] {
        let app = spawn_app(
            AppOptions {
                sim: SimConfig {
                    record_history: true,
                    ..SimConfig::default()
                },
                ..AppOptions::default()
            }
            .arg("--confirm-with", mode),
        )
        .await;
        let (s, v) = ids();
        app.sim.seed_attachment(s, v);
        app.sim.remove_server(s);
        let op = app
            .raw()
            .detach_volume(with_timeout(
                detach("d-gone", s, v),
                Duration::from_secs(10),
            ))
            .await
            .expect("a detach from a deleted server succeeds")
            .into_inner();
        assert_eq!(
            (op.state, op.resolution),
            (pb::State::Succeeded as i32, resolution as i32),
            "{mode}"
        );
        assert_eq!(app.sim.detach_requests(v), requests, "{mode}");
        assert!(!app.sim.is_attached(s, v));
        assert_eq!(
            server_looks(&app, s),
            requests,
            "{mode}: the 404 decided after a look at the server"
        );
        app.stop().await;
    }
}

/// `GET /servers/{id}` requests the simulator received for `server`.
fn server_looks(app: &TestApp, server: Uuid) -> u32 {
    let path = format!("/v2.1/servers/{server}");
    app.sim
        .truth()
        .http
        .iter()
        .filter(|r| r.method == "GET" && r.path == path)
        .count() as u32
}

/// What something in front of Nova answers instead of Nova.
fn page(code: u16, content_type: &str, body: &str, effect: bool) -> Fault {
    Fault::Page {
        code,
        content_type: content_type.into(),
        body: body.into(),
        effect,
    }
}

const NGINX_404: &str = "<html>\r\n<head><title>404 Not Found</title></head>\r\n<body>\r\n<center><h1>404 Not Found</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n";

fn with_history() -> AppOptions {
    AppOptions {
        sim: SimConfig {
            record_history: true,
            ..SimConfig::default()
        },
        ..AppOptions::default()
    }
}

/// An ingress in front of Nova lost its route: every compute request about
/// the server is answered with its HTML 404 page, while the server and the
/// attachment are there. Nothing of that is Nova's word: the detach is
/// UNKNOWN (never SUCCEEDED "the server is gone"), as Nova holds it.
#[tokio::test]
async fn a_detach_answered_by_an_ingresss_404_page_while_attached_is_not_succeeded() {
    let app = spawn_app(with_history().arg("--confirm-with", "nova-list")).await;
    let (s, v) = ids();
    app.sim.seed_attachment(s, v);
    for op in [
        FaultOp::Detach,
        FaultOp::List,
        FaultOp::Server,
        FaultOp::Show,
    ] {
        app.sim.add_fault(
            FaultRule::new(op, page(404, "text/html", NGINX_404, false))
                .server(s)
                .always(),
        );
    }
    let err = app
        .raw()
        .detach_volume(with_timeout(
            detach("ingress-404", s, v),
            Duration::from_secs(4),
        ))
        .await
        .expect_err("nothing could be known");
    let (reason, meta) = error_info(&err);
    assert_eq!(
        (err.code(), reason.as_str()),
        (Code::DeadlineExceeded, "OUTCOME_UNKNOWN"),
        "{meta:?}"
    );
    let r = row(&app, &meta["operation_id"]).await;
    // The ledger agrees with Nova: still attached, not decided detached.
    assert!(app.sim.is_attached(s, v), "Nova still holds the attachment");
    assert_eq!(r.state, State::Unknown);
    assert_eq!(app.sim.detach_requests(v), 1, "never sent again");
    let events = app.store.operation_events(r.id).await.unwrap();
    let failed = events
        .iter()
        .find(|e| e.kind == "request_failed")
        .expect("the answer is logged");
    assert_eq!(failed.metadata["error_class"], "foreign_answer");
    assert_eq!(failed.metadata["reason"], "NOVA_BAD_RESPONSE");
    assert_eq!(failed.metadata["http_status"], "404");
    assert!(!failed.metadata.contains_key("nova_fault"), "{failed:?}");
    app.stop().await;
}

/// An attach answered by something in front of Nova — its 404 page after
/// Nova attached, a 502 page after Nova attached, a captive proxy's 200
/// page while Nova did nothing — is decided by what Nova's list shows,
/// never by the page, and never sent again.
#[tokio::test]
async fn an_attach_answered_by_a_proxys_page_is_decided_by_what_nova_holds() {
    let app = spawn_app(AppOptions::default()).await;
    for (key, code, body, effect) in [
        ("page-404", 404, NGINX_404, true),
        (
            "page-502",
            502,
            "<html><head><title>502 Bad Gateway</title></head><body><h1>502 Bad Gateway</h1></body></html>",
            true,
        ),
        (
            "page-200",
            200,
            "<html><body>Welcome! Please accept the terms of use to continue.</body></html>",
            false,
        ),
    ] {
        let (s, v) = ids();
        app.sim.add_fault(
            FaultRule::new(FaultOp::Attach, page(code, "text/html", body, effect)).volume(v),
        );
        let got = app
            .raw()
            .attach_volume(with_timeout(attach(key, s, v), Duration::from_secs(4)))
            .await;
        let r = row_by_key(&app, key).await;
        assert_eq!(app.sim.attach_requests(v), 1, "{key}: never sent again");
        assert_eq!(app.sim.is_attached(s, v), effect, "{key}");
        if effect {
            let op = got.unwrap_or_else(|e| panic!("{key}: {e:?}")).into_inner();
            assert_eq!(
                (op.state, op.resolution),
                (
                    pb::State::Succeeded as i32,
                    pb::Resolution::Reobserved as i32
                ),
                "{key}"
            );
            assert_eq!(r.state, State::Succeeded, "{key}");
        } else {
            let err = got.expect_err(key);
            assert_eq!(error_info(&err).0, "OUTCOME_UNKNOWN", "{key}: {err:?}");
            assert_eq!(r.state, State::Unknown, "{key}");
        }
    }
    app.stop().await;
}

/// Nova's own 404 "Instance … could not be found" on a detach, while the
/// server exists (a request routed to a cell or region that does not hold
/// it): the look at the server finds it, so the 404 decides nothing and
/// the attachment list does — still attached: UNKNOWN; not attached:
/// SUCCEEDED by observation, not by the 404.
#[tokio::test]
async fn a_novas_404_for_a_server_that_exists_does_not_decide_a_detach() {
    let app = spawn_app(with_history().arg("--confirm-with", "nova-list")).await;
    let (s, v) = ids();
    app.sim.seed_attachment(s, v);
    app.sim
        .add_fault(FaultRule::new(FaultOp::Detach, Fault::ServerNotFound).volume(v));
    let err = app
        .raw()
        .detach_volume(with_timeout(
            detach("misrouted-1", s, v),
            Duration::from_secs(4),
        ))
        .await
        .expect_err("still attached: not decided");
    let (reason, meta) = error_info(&err);
    assert_eq!(reason, "OUTCOME_UNKNOWN", "{meta:?}");
    assert_eq!(row(&app, &meta["operation_id"]).await.state, State::Unknown);
    assert!(app.sim.is_attached(s, v), "Nova still holds it");
    assert_eq!(app.sim.detach_requests(v), 1);
    assert_eq!(server_looks(&app, s), 1, "the server was looked at");
    // The same 404 where nothing is attached: the list decides.
    let (s2, v2) = ids();
    app.sim
        .add_fault(FaultRule::new(FaultOp::Detach, Fault::ServerNotFound).volume(v2));
    let op = app
        .raw()
        .detach_volume(with_timeout(
            detach("misrouted-2", s2, v2),
            Duration::from_secs(4),
        ))
        .await
        .expect("nothing attached: done")
        .into_inner();
    assert_eq!(
        (op.state, op.resolution),
        (
            pb::State::Succeeded as i32,
            pb::Resolution::Reobserved as i32
        )
    );
    assert_eq!(server_looks(&app, s2), 1);
    app.stop().await;
}

/// A server that is really gone, whose look fails (something in front
/// answers `GET /servers/{id}` with a 502 page): neither the detach's 404
/// nor the list's decides alone — "the server is gone" needs a look at the
/// server that agrees — so the detach is UNKNOWN at the caller's deadline;
/// once the look answers, a reconciler pass decides it SUCCEEDED.
#[tokio::test]
async fn a_detach_from_a_deleted_server_whose_look_fails_waits_for_a_look_that_agrees() {
    let app = spawn_app(with_history().arg("--confirm-with", "nova-list")).await;
    let (s, v) = ids();
    app.sim.seed_attachment(s, v);
    app.sim.remove_server(s);
    app.sim.add_fault(
        FaultRule::new(
            FaultOp::Server,
            page(502, "text/html", "<html>502 Bad Gateway</html>", false),
        )
        .server(s)
        .always(),
    );
    let err = app
        .raw()
        .detach_volume(with_timeout(detach("gone-1", s, v), Duration::from_secs(4)))
        .await
        .expect_err("no look at the server agreed");
    let (reason, meta) = error_info(&err);
    assert_eq!(reason, "OUTCOME_UNKNOWN", "{meta:?}");
    let id: Uuid = meta["operation_id"].parse().unwrap();
    assert_eq!(row(&app, &meta["operation_id"]).await.state, State::Unknown);
    assert!(
        server_looks(&app, s) >= 2,
        "the detach's 404 and the list's were each checked"
    );
    assert_eq!(app.sim.detach_requests(v), 1, "never sent again");
    app.sim.clear_faults();
    let r = support::lifecycle::reconcile_until(
        &app,
        id,
        Duration::from_secs(20),
        "the reconciler decides once the look agrees",
        |op| op.state.is_terminal(),
    )
    .await;
    assert_eq!(
        (r.state, r.resolution),
        (State::Succeeded, Some(Resolution::Reconciler))
    );
    assert!(!app.sim.is_attached(s, v));
    app.stop().await;
}

/// Nova's 404 fault for `instance`.
fn instance_not_found(instance: Uuid) -> String {
    format!(
        r#"{{"itemNotFound": {{"code": 404, "message": "Instance {instance} could not be found."}}}}"#
    )
}

/// An attached volume whose detach Nova answers 500 with nothing done,
/// and whose server's attachment list then answers Nova's 404 naming the
/// instance `named` gives for the server.
async fn detach_answered_500_then_a_list_404_naming(
    named: impl FnOnce(Uuid) -> Uuid,
) -> (TestApp, Uuid, Uuid) {
    let app = spawn_app(with_history().arg("--confirm-with", "nova-list")).await;
    let (s, v) = ids();
    app.sim.seed_attachment(s, v);
    app.sim.add_fault(
        FaultRule::new(
            FaultOp::Detach,
            Fault::Status {
                code: 500,
                effect: false,
            },
        )
        .volume(v),
    );
    app.sim.add_fault(
        FaultRule::new(
            FaultOp::List,
            page(
                404,
                "application/json; charset=UTF-8",
                &instance_not_found(named(s)),
                false,
            ),
        )
        .server(s)
        .always(),
    );
    (app, s, v)
}

/// A detach answered 500 with nothing done; the attachment list then
/// answers Nova's 404 naming another instance, while `GET /servers/{id}`
/// shows this one. That 404 is no word about this server: the detach is
/// not decided (UNKNOWN at the caller's deadline), no reconciler pass
/// decides it either, and the ledger agrees with Nova, which still holds
/// the attachment.
#[tokio::test]
async fn a_list_404_naming_another_instance_does_not_decide_a_detach() {
    let (app, s, v) = detach_answered_500_then_a_list_404_naming(|_| Uuid::new_v4()).await;
    let err = app
        .raw()
        .detach_volume(with_timeout(
            detach("other-404", s, v),
            Duration::from_secs(4),
        ))
        .await
        .expect_err("nothing about this server was said");
    let (reason, meta) = error_info(&err);
    assert_eq!(
        (err.code(), reason.as_str()),
        (Code::DeadlineExceeded, "OUTCOME_UNKNOWN"),
        "{meta:?}"
    );
    let id: Uuid = meta["operation_id"].parse().unwrap();
    assert_eq!(row(&app, &meta["operation_id"]).await.state, State::Unknown);
    assert!(app.sim.is_attached(s, v), "Nova still holds the attachment");
    assert_eq!(app.sim.detach_requests(v), 1, "never sent again");
    // The reconciler reads the same list: it looks, and leaves it open.
    let op = app
        .raw()
        .reconcile_operation(with_timeout(
            pb::ReconcileOperationRequest {
                operation_id: id.to_string(),
            },
            Duration::from_secs(10),
        ))
        .await
        .expect("one pass")
        .into_inner();
    assert_eq!(op.state, pb::State::Unknown as i32, "{op:?}");
    let events = app.store.operation_events(id).await.unwrap();
    assert!(
        events.iter().any(|e| e.kind == "observed"
            && e.detail.starts_with("observation failed")
            && e.metadata
                .get("nova_message")
                .is_some_and(|m| !m.contains(&s.to_string()))),
        "the reconciler's look failed on the other instance's 404: {events:?}"
    );
    assert_eq!(row(&app, &meta["operation_id"]).await.state, State::Unknown);
    assert!(app.sim.is_attached(s, v));
    app.stop().await;
}

/// The list's 404 names this server, but `GET /servers/{id}` shows it (a
/// list routed to a cell that does not hold it): the look that must agree
/// does not, so a detach answered 500 is not SUCCEEDED: it is left
/// UNKNOWN, as Nova holds it.
#[tokio::test]
async fn a_list_404_for_a_server_that_a_look_shows_decides_nothing() {
    let (app, s, v) = detach_answered_500_then_a_list_404_naming(|s| s).await;
    let err = app
        .raw()
        .detach_volume(with_timeout(
            detach("shown-404", s, v),
            Duration::from_secs(4),
        ))
        .await
        .expect_err("the look at the server did not agree");
    let (reason, meta) = error_info(&err);
    assert_eq!(reason, "OUTCOME_UNKNOWN", "{meta:?}");
    assert_eq!(row(&app, &meta["operation_id"]).await.state, State::Unknown);
    assert!(app.sim.is_attached(s, v), "Nova still holds the attachment");
    assert!(server_looks(&app, s) >= 1, "the server was looked at");
    app.stop().await;
}

/// Nova's message with a NUL in it (PostgreSQL's text and jsonb refuse
/// U+0000): the refusal is recorded all the same, the NUL replaced.
#[tokio::test]
async fn a_nul_in_novas_message_does_not_make_the_decision_unwritable() {
    let app = spawn_app(AppOptions::default()).await;
    let (s, v) = ids();
    app.sim.add_fault(
        FaultRule::new(
            FaultOp::Attach,
            page(
                409,
                "application/json; charset=UTF-8",
                r#"{"conflictingRequest": {"code": 409, "message": "Instance is locked\u0000 by an admin"}}"#,
                false,
            ),
        )
        .volume(v)
        .always(),
    );
    let err = app
        .raw()
        .attach_volume(with_timeout(attach("nul-1", s, v), Duration::from_secs(3)))
        .await
        .expect_err("locked all along");
    let (reason, meta) = error_info(&err);
    assert_eq!(reason, "NOVA_CONFLICT", "{err:?}");
    let r = row(&app, &meta["operation_id"]).await;
    assert_eq!(r.state, State::Failed);
    let last = r.last_error.expect("the refusal is recorded");
    assert!(
        last.message.contains("locked\u{FFFD} by an admin"),
        "{}",
        last.message
    );
    assert!(
        last.metadata.values().all(|v| !v.contains('\0')),
        "{last:?}"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_hundred_concurrent_attaches_with_random_faults_all_match_the_truth() {
    let app = spawn_app(AppOptions::default().arg("--settle-window", "500ms")).await;
    let faults = [
        None,
        Some(Fault::DelayAfterEffect { ms: 6000 }),
        Some(Fault::CloseAfterEffect),
        Some(Fault::CloseBeforeEffect),
        Some(Fault::Status {
            code: 500,
            effect: true,
        }),
        Some(Fault::Status {
            code: 503,
            effect: false,
        }),
        Some(Fault::ProxyError {
            code: 502,
            effect: false,
        }),
        Some(Fault::ProxyError {
            code: 504,
            effect: true,
        }),
        Some(Fault::Conflict),
        Some(Fault::DelayBeforeEffect { ms: 400 }),
        Some(Fault::StallBody {
            ms: 6000,
            effect: true,
        }),
    ];
    let server = Uuid::new_v4();
    let mut volumes = Vec::new();
    let mut calls = Vec::new();
    for i in 0..100 {
        let v = Uuid::new_v4();
        if let Some(f) = faults[(i * 7 + i / 11) % faults.len()].clone() {
            app.sim
                .add_fault(FaultRule::new(FaultOp::Attach, f).volume(v));
        }
        volumes.push(v);
        let mut c = app.raw();
        calls.push(tokio::spawn(async move {
            c.attach_volume(with_timeout(
                attach(&format!("rnd-{i}"), server, v),
                Duration::from_secs(4),
            ))
            .await
        }));
    }
    let mut codes = std::collections::BTreeMap::new();
    for call in calls {
        let code = match call.await.unwrap() {
            Ok(_) => Code::Ok,
            Err(s) => {
                assert!(
                    matches!(
                        s.code(),
                        Code::DeadlineExceeded
                            | Code::Aborted
                            | Code::FailedPrecondition
                            | Code::Unavailable
                    ),
                    "{s:?}"
                );
                s.code()
            }
        };
        *codes.entry(format!("{code:?}")).or_insert(0) += 1;
    }
    // Whatever could not be known in time, the reconciler resolves.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let open = app
            .store
            .operation_list(&Default::default(), None, 500)
            .await
            .unwrap()
            .operations
            .into_iter()
            .filter(|o| !o.state.is_terminal())
            .count();
        if open == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{open} operations still open");
        app.reconciler.run_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut disagreements = Vec::new();
    for (i, v) in volumes.iter().enumerate() {
        let r = row_by_key(&app, &format!("rnd-{i}")).await;
        let attached = app.sim.is_attached(server, *v);
        let effects = app.sim.attach_effects(*v);
        assert!(effects <= 1, "volume {v} attached {effects} times");
        if (r.state == State::Succeeded) != attached {
            disagreements.push(format!(
                "rnd-{i}: ledger {:?}/{:?}, Nova attached={attached}",
                r.state, r.resolution
            ));
        }
    }
    assert!(
        disagreements.is_empty(),
        "ledger disagrees with the truth ({codes:?}): {disagreements:#?}"
    );
    app.stop().await;
}

#[tokio::test]
async fn the_settle_window_of_a_request_that_waited_for_a_slot_starts_when_it_left() {
    // One connection slot to Nova, held 3 s by another attach: the second
    // attach's intent is recorded at once, its request leaves 3 s later,
    // and its answer is lost with Nova's lists failing: UNKNOWN, for the
    // reconciler to settle. Its settle window (from `last_request_at`) must
    // start no earlier than when the request reached Nova, or the
    // reconciler would conclude "not attached" of an attach still running
    // in Nova for as long as the request waited.
    let app = spawn_app(with_history().arg("--nova-max-concurrency", "1")).await;
    let (s1, v1) = ids();
    let (s2, v2) = ids();
    let mut hold = FaultRule::new(FaultOp::Attach, Fault::DelayBeforeEffect { ms: 3_000 });
    hold.volume_id = Some(v1);
    app.sim.add_fault(hold);
    let mut lost = FaultRule::new(FaultOp::Attach, Fault::CloseAfterEffect);
    lost.volume_id = Some(v2);
    app.sim.add_fault(lost);
    for op in [FaultOp::List, FaultOp::Show, FaultOp::Cinder] {
        let mut rule = FaultRule::new(
            op,
            Fault::Status {
                code: 500,
                effect: false,
            },
        )
        .always();
        rule.server_id = Some(s2);
        app.sim.add_fault(rule);
    }
    let mut c1 = app.raw();
    let first = tokio::spawn(async move {
        c1.attach_volume(with_timeout(
            attach("slot-holder", s1, v1),
            Duration::from_secs(20),
        ))
        .await
    });
    let sim = app.sim.clone();
    support::eventually(
        Duration::from_secs(10),
        "the first attach holds the slot",
        || {
            let sim = sim.clone();
            async move { sim.attach_requests(v1) == 1 }
        },
    )
    .await;
    let e = app
        .raw()
        .attach_volume(with_timeout(
            attach("waited", s2, v2),
            Duration::from_secs(8),
        ))
        .await
        .expect_err("its answer was lost and nothing can be observed");
    let (reason, meta) = error_info(&e);
    assert_eq!(reason, "OUTCOME_UNKNOWN", "{e:?}");
    let op = row(&app, &meta["operation_id"]).await;
    assert_eq!(op.state, State::Unknown);
    let (_, requests) = app.sim.truth_of(&[v2].into_iter().collect());
    let reached = requests
        .iter()
        .find(|r| r.op == "attach" && r.volume_id == v2)
        .expect("the second attach reached Nova")
        .received_at;
    let last = op.last_request_at.expect("a request was sent");
    assert!(
        last + chrono::Duration::milliseconds(500) >= reached,
        "the settle window starts at {last}, before the request reached Nova at {reached} (it waited for the slot from {})",
        op.created_at
    );
    assert!(
        first.await.expect("the first call's task").is_ok(),
        "the slot holder attached"
    );
    app.stop().await;
}
