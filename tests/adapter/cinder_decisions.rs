//! Every decision row of Cinder's confirmation (docs/design.md, "How an
//! outcome is decided", the Cinder rows), through the real server chain and the
//! simulator, on PostgreSQL and on the embedded store. Each test checks the
//! RPC's answer, the ledger row, and what the simulator says happened —
//! at the instant the decision was answered, not later.

use crate::support;

use std::time::Duration;

use support::lifecycle::{attach, detach, ids};
use support::{AppOptions, TestApp, error_info, spawn_app, with_timeout};
use tokio::time::Instant;
use tonic::Code;
use uuid::Uuid;
use volume_reconciler::domain::{Operation, Reason, Resolution, State};
use volume_reconciler::grpc::pb;
use volume_reconciler::sim::{Fault, FaultOp, FaultRule, SimConfig, VolumeSpec};

/// The two stores every test runs on.
#[derive(Clone, Copy, Debug)]
enum Store {
    Postgres,
    Embedded,
}

const STORES: [Store; 2] = [Store::Postgres, Store::Embedded];

fn options(store: Store, sim: SimConfig) -> AppOptions {
    let mut o = AppOptions {
        sim,
        ..AppOptions::default()
    };
    if let Store::Embedded = store {
        let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("vr-confirm-{}", Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        o.db_url = Some(format!("sqlite://{}", dir.join("ledger.db").display()));
    }
    o
}

async fn app(store: Store, sim: SimConfig) -> TestApp {
    spawn_app(options(store, sim)).await
}

async fn row_by_key(app: &TestApp, key: &str) -> Operation {
    app.store
        .operation_get_by_key(&crate::support::ck(None, key))
        .await
        .unwrap()
        .expect("the row exists")
}

/// Cinder's status of `volume` and whether it lists it attached to
/// `server`, as the simulator holds it now.
fn cinder_now(app: &TestApp, server: Uuid, volume: Uuid) -> (String, bool) {
    let v = app.sim.cinder_volume(volume).expect("the volume exists");
    let here = v.attachments.iter().any(|a| a.server_id == server);
    (v.status, here)
}

async fn attach_ok(app: &TestApp, key: &str, s: Uuid, v: Uuid, secs: u64) -> pb::Operation {
    app.raw()
        .attach_volume(with_timeout(attach(key, s, v), Duration::from_secs(secs)))
        .await
        .unwrap_or_else(|e| panic!("{key}: {e:?}"))
        .into_inner()
}

async fn attach_err(app: &TestApp, key: &str, s: Uuid, v: Uuid, secs: u64) -> tonic::Status {
    app.raw()
        .attach_volume(with_timeout(attach(key, s, v), Duration::from_secs(secs)))
        .await
        .expect_err(key)
}

#[tokio::test]
async fn a_volume_already_attached_here_is_succeeded_and_one_attached_elsewhere_failed_without_a_request()
 {
    for store in STORES {
        let app = app(store, SimConfig::default()).await;
        let (s, v) = ids();
        app.sim.seed_attachment(s, v);
        let op = attach_ok(&app, "here", s, v, 10).await;
        assert_eq!(
            (op.state, op.resolution),
            (
                pb::State::Succeeded as i32,
                pb::Resolution::Reobserved as i32
            ),
            "{store:?}"
        );
        assert_eq!(op.attempts, 0, "nothing sent: {store:?}");
        assert!(
            op.attachment.is_some_and(|a| !a.id.is_empty()),
            "an attachment"
        );
        assert_eq!(app.sim.attach_requests(v), 0, "{store:?}");

        let (other, v2) = ids();
        app.sim.seed_attachment(other, v2);
        let err = attach_err(&app, "elsewhere", s, v2, 10).await;
        assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
        let (reason, meta) = error_info(&err);
        assert_eq!(reason, "ALREADY_ATTACHED_ELSEWHERE");
        assert_eq!(meta["attached_to"], other.to_string());
        assert_eq!(app.sim.attach_requests(v2), 0, "{store:?}");
        let r = row_by_key(&app, "elsewhere").await;
        assert_eq!((r.state, r.attempts), (State::Failed, 0), "{store:?}");

        // A multiattach volume attached elsewhere is attached here too.
        let (other, v3) = ids();
        app.sim.set_multiattach(v3);
        app.sim.seed_attachment(other, v3);
        let op = attach_ok(&app, "multi", s, v3, 10).await;
        assert_eq!(op.state, pb::State::Succeeded as i32, "{store:?}");
        assert_eq!(app.sim.attach_requests(v3), 1);
        assert!(app.sim.is_attached(s, v3) && app.sim.is_attached(other, v3));
        app.stop().await;
    }
}

#[tokio::test]
async fn a_volume_being_created_is_waited_for_then_attached_and_never_sent_early() {
    for store in STORES {
        let app = app(
            store,
            SimConfig {
                cinder_create_ms: 1_500,
                ..SimConfig::default()
            },
        )
        .await;
        let s = Uuid::new_v4();
        let v = app.sim.create_volume(VolumeSpec::default()).id;
        let started = Instant::now();
        let op = attach_ok(&app, "created", s, v, 20).await;
        assert_eq!(op.state, pb::State::Succeeded as i32, "{store:?}");
        assert!(started.elapsed() >= Duration::from_millis(1_400));
        // A request sent while it was `creating` would have been refused
        // (and counted): exactly one reached Nova.
        assert_eq!(app.sim.attach_requests(v), 1, "{store:?}");
        assert_eq!(op.attempts, 1);

        // Still creating at the deadline: FAILED, nothing sent.
        app.sim.set_config(SimConfig {
            cinder_create_ms: 600_000,
            ..SimConfig::default()
        });
        let v = app.sim.create_volume(VolumeSpec::default()).id;
        let err = attach_err(&app, "never-ready", s, v, 2).await;
        let (reason, meta) = error_info(&err);
        assert_eq!(reason, Reason::NovaVolumeNotReady.as_str(), "{meta:?}");
        assert_eq!(meta["volume_status"], "creating");
        assert_eq!(app.sim.attach_requests(v), 0, "{store:?}");
        let r = row_by_key(&app, "never-ready").await;
        assert_eq!((r.state, r.attempts), (State::Failed, 0));
        app.stop().await;
    }
}

#[tokio::test]
async fn a_volume_in_error_or_unknown_to_cinder_is_failed_without_a_request() {
    for store in STORES {
        let app = app(store, SimConfig::default()).await;
        let (s, v) = ids();
        app.sim.force_volume_status(v, Some("error".into()));
        let err = attach_err(&app, "in-error", s, v, 10).await;
        assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
        let (reason, meta) = error_info(&err);
        assert_eq!(reason, "VOLUME_IN_ERROR");
        assert_eq!(meta["volume_status"], "error");
        assert_eq!(app.sim.attach_requests(v), 0, "{store:?}");

        let v2 = Uuid::new_v4();
        app.sim.remove_volume(v2);
        let err = attach_err(&app, "no-volume", s, v2, 10).await;
        assert_eq!(err.code(), Code::NotFound, "{err:?}");
        assert_eq!(error_info(&err).0, "NOVA_VOLUME_NOT_FOUND");
        assert_eq!(app.sim.attach_requests(v2), 0, "{store:?}");
        app.stop().await;
    }
}

#[tokio::test]
async fn an_attach_is_succeeded_only_once_cinder_shows_it_in_use() {
    for store in STORES {
        let app = app(
            store,
            SimConfig {
                attach_complete_ms: 1_500,
                ..SimConfig::default()
            },
        )
        .await;
        let (s, v) = ids();
        let started = Instant::now();
        let op = attach_ok(&app, "slow-attach", s, v, 20).await;
        // The truth at the instant of the answer: in-use, listed.
        let (status, here) = cinder_now(&app, s, v);
        assert_eq!(op.state, pb::State::Succeeded as i32, "{store:?}");
        assert_eq!((status.as_str(), here), ("in-use", true), "{store:?}");
        assert!(
            started.elapsed() >= Duration::from_millis(1_400),
            "Nova's 200 came at once; Cinder took its time"
        );
        assert_eq!(app.sim.attach_requests(v), 1);
        let log = app
            .store
            .operation_events(op.id.parse().unwrap())
            .await
            .unwrap();
        assert!(
            log.iter().any(|e| e
                .detail
                .contains("Cinder confirming: the volume is attaching")),
            "watched while attaching: {log:#?}"
        );
        app.stop().await;
    }
}

#[tokio::test]
async fn an_attach_rolled_back_after_its_200_is_failed_at_decision_time_not_found_as_drift() {
    for store in STORES {
        for status in ["available", "error_attaching"] {
            let app = spawn_app(
                options(
                    store,
                    SimConfig {
                        rollback_share: 0.999_999,
                        rollback_delay_ms: 500,
                        rollback_status: status.into(),
                        ..SimConfig::default()
                    },
                )
                .arg("--verify-after", "300ms"),
            )
            .await;
            let (s, v) = ids();
            let err = attach_err(&app, "rolled-back", s, v, 10).await;
            let (reason, meta) = error_info(&err);
            assert_eq!(reason, "ATTACH_ROLLED_BACK", "{store:?} {status}: {meta:?}");
            assert_eq!(meta["volume_status"], status);
            assert!(!app.sim.is_attached(s, v), "the truth at the answer");
            assert_eq!(app.sim.attach_requests(v), 1, "not re-sent");
            let r = row_by_key(&app, "rolled-back").await;
            assert_eq!(r.state, State::Failed);
            // The verifier agrees: no drift, now or later.
            let id = r.id;
            support::eventually(Duration::from_secs(20), "the verification ran", || {
                let app = &app;
                async move {
                    let counts = app.reconciler.run_once().await.unwrap();
                    counts.verified >= 1
                }
            })
            .await;
            let r = app.store.operation_get(id).await.unwrap().unwrap();
            assert!(!r.drifted, "{store:?} {status}");
            app.stop().await;
        }
    }
}

#[tokio::test]
async fn an_attach_still_attaching_at_the_deadline_is_unknown_and_the_reconciler_confirms_it() {
    for store in STORES {
        let app = app(
            store,
            SimConfig {
                // Well past the caller's 5 s (the reserve's last quarter,
                // 250 ms, is what the unknown decision is written in).
                attach_complete_ms: 10_000,
                ..SimConfig::default()
            },
        )
        .await;
        let (s, v) = ids();
        let err = attach_err(&app, "attaching", s, v, 5).await;
        assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
        let (reason, meta) = error_info(&err);
        assert_eq!(reason, "OUTCOME_UNKNOWN", "{meta:?}");
        assert_eq!(cinder_now(&app, s, v), ("attaching".into(), false));
        let r = row_by_key(&app, "attaching").await;
        assert_eq!(r.state, State::Unknown, "{store:?}");
        // While Cinder says attaching, the reconciler waits (no re-send);
        // once in-use, it decides SUCCEEDED.
        let id = r.id;
        support::eventually(
            Duration::from_secs(30),
            "the reconciler confirms it",
            || {
                let app = &app;
                async move {
                    app.reconciler.run_once().await.unwrap();
                    let r = app.store.operation_get(id).await.unwrap().unwrap();
                    if r.state == State::Succeeded {
                        assert!(app.sim.is_attached(s, v), "confirmed only once in use");
                        assert_eq!(cinder_now(app, s, v), ("in-use".into(), true));
                    }
                    r.state == State::Succeeded
                }
            },
        )
        .await;
        assert_eq!(app.sim.attach_requests(v), 1, "never re-sent");
        let r = app.store.operation_get(id).await.unwrap().unwrap();
        assert_eq!(r.resolution, Some(Resolution::Reconciler));
        app.stop().await;
    }
}

#[tokio::test]
async fn a_detach_is_succeeded_once_cinder_no_longer_lists_it_and_a_refused_one_is_not() {
    for store in STORES {
        let app = app(
            store,
            SimConfig {
                detach_delay_ms: 1_000,
                ..SimConfig::default()
            },
        )
        .await;
        let (s, v) = ids();
        app.sim.seed_attachment(s, v);
        let op = app
            .raw()
            .detach_volume(with_timeout(
                detach("slow-detach", s, v),
                Duration::from_secs(10),
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(op.state, pb::State::Succeeded as i32, "{store:?}");
        let (status, here) = cinder_now(&app, s, v);
        assert_eq!((status.as_str(), here), ("available", false));
        assert_eq!(app.sim.detach_requests(v), 1);

        // The guest refuses: Cinder shows it in-use again; never SUCCEEDED.
        let (s2, v2) = ids();
        app.sim.seed_attachment(s2, v2);
        app.sim
            .add_fault(FaultRule::new(FaultOp::Detach, Fault::DetachRefused).volume(v2));
        let err = app
            .raw()
            .detach_volume(with_timeout(
                detach("refused", s2, v2),
                Duration::from_secs(4),
            ))
            .await
            .expect_err("a refused detach does not succeed");
        assert_eq!(error_info(&err).0, "OUTCOME_UNKNOWN", "{err:?}");
        assert!(app.sim.is_attached(s2, v2));
        assert_eq!(row_by_key(&app, "refused").await.state, State::Unknown);

        // Attached nowhere: nothing to detach, nothing sent.
        let (s3, v3) = ids();
        let op = app
            .raw()
            .detach_volume(with_timeout(
                detach("nowhere", s3, v3),
                Duration::from_secs(10),
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (op.state, op.attempts),
            (pb::State::Succeeded as i32, 0),
            "{store:?}"
        );
        assert_eq!(app.sim.detach_requests(v3), 0);

        // In use on another server only (not multiattach): this server has
        // nothing to detach, whatever the caller's deadline; nothing sent.
        let (s4, v4, other) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        app.sim.seed_attachment(other, v4);
        let op = app
            .raw()
            .detach_volume(with_timeout(
                detach("elsewhere", s4, v4),
                // Short, with room for the Cinder look (capped at a quarter
                // of the time to send) and a durable write on a loaded CI
                // machine.
                Duration::from_millis(3000),
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (op.state, op.attempts),
            (pb::State::Succeeded as i32, 0),
            "{store:?}"
        );
        assert_eq!(app.sim.detach_requests(v4), 0);
        assert!(app.sim.is_attached(other, v4), "the other server keeps it");
        app.stop().await;
    }
}

#[tokio::test]
async fn verification_asks_cinder_and_reports_an_attachment_removed_behind_the_service() {
    for store in STORES {
        let app = spawn_app(
            options(store, SimConfig::default())
                .arg("--verify-after", "300ms")
                .arg("--verify-window", "1h"),
        )
        .await;
        let (s, v) = ids();
        let op = attach_ok(&app, "to-drift", s, v, 10).await;
        assert_eq!(op.state, pb::State::Succeeded as i32);
        assert!(app.sim.detach_out_of_band(s, v));
        let id: Uuid = op.id.parse().unwrap();
        let reads_before = app.sim.cinder_read_count(v);
        support::eventually(Duration::from_secs(20), "the drift is found", || {
            let app = &app;
            async move {
                app.reconciler.run_once().await.unwrap();
                app.store.operation_get(id).await.unwrap().unwrap().drifted
            }
        })
        .await;
        let verifier_reads = app.sim.cinder_read_count(v) - reads_before;
        assert!(verifier_reads > 0, "the verifier asked Cinder");
        // Each of its reads timed as the verifier's, as the simulator
        // counted them.
        assert_eq!(
            cinder_reads(&app, "verify", "ok").await,
            verifier_reads as f64,
            "{store:?}"
        );
        let log = app.store.operation_events(id).await.unwrap();
        let drift = log
            .iter()
            .find(|e| e.kind == "drift_detected")
            .expect("a drift event");
        assert!(
            drift.detail.contains("Cinder shows it not attached"),
            "{store:?}: {}",
            drift.detail
        );
        app.stop().await;
    }
}

/// The count of `volume_reconciler_cinder_request_duration_seconds` for
/// reads made for `what` that ended in `outcome` (0 when none yet).
async fn cinder_reads(app: &TestApp, what: &str, outcome: &str) -> f64 {
    let want = format!(
        "volume_reconciler_cinder_request_duration_seconds_count{{operation=\"{what}\",outcome=\"{outcome}\"}}"
    );
    support::lifecycle::metric(
        app,
        "volume_reconciler_cinder_request_duration_seconds_count",
    )
    .await
    .into_iter()
    .find(|(k, _)| *k == want)
    .map_or(0.0, |(_, v)| v)
}

/// With Cinder confirming, two of its reads are on every attach's path:
/// each is timed by what it was for and how it ended, so a slow or failing
/// Cinder shows on `/metrics` before it shows as slow attaches. (Metrics do
/// not depend on the store: PostgreSQL only.)
#[tokio::test]
async fn every_cinder_read_is_timed_by_what_it_was_for_and_how_it_ended() {
    let app = app(Store::Postgres, SimConfig::default()).await;
    let (s, v) = ids();
    let op = attach_ok(&app, "timed", s, v, 10).await;
    assert_eq!(op.state, pb::State::Succeeded as i32);
    assert_eq!(cinder_reads(&app, "precheck", "ok").await, 1.0);
    assert_eq!(cinder_reads(&app, "confirm", "ok").await, 1.0);

    // Cinder refuses the pre-check's read: Nova decides, Cinder confirms.
    let (s2, v2) = ids();
    app.sim.add_fault(
        FaultRule::new(
            FaultOp::Cinder,
            Fault::Status {
                code: 503,
                effect: false,
            },
        )
        .volume(v2),
    );
    let op = attach_ok(&app, "refused", s2, v2, 10).await;
    assert_eq!(op.state, pb::State::Succeeded as i32);
    assert_eq!(app.sim.attach_requests(v2), 1, "Nova was asked");
    assert_eq!(cinder_reads(&app, "precheck", "rejected").await, 1.0);
    assert_eq!(cinder_reads(&app, "precheck", "ok").await, 1.0);
    assert_eq!(cinder_reads(&app, "confirm", "ok").await, 2.0);
    app.stop().await;
}
