//! Retention (`--retain`): decided operations and their events age out in
//! batches, open and recent ones stay, a pruned key is refused as expired
//! and never run again (on both stores), one replica prunes at a time, and
//! `--retain 0` keeps everything. Time moves by the pruner's
//! `run_once_ahead` (the same statements, the database's clock read that
//! much later); every operation goes through the real server and Nova.

use crate::support;

use std::time::Duration;

use support::{AppOptions, TestApp, error_info, spawn_app, with_timeout};
use uuid::Uuid;
use volume_reconciler::grpc::pb;
use volume_reconciler::sim::{Fault, FaultOp, FaultRule};
use volume_reconciler::store::PruneCounts;

const DAY: Duration = Duration::from_secs(24 * 3600);

/// A server whose retention round starts only when a test says so, with
/// decisions kept a day (`--retain 1d`).
fn options() -> AppOptions {
    AppOptions::default()
        .arg("--retain", "1d")
        .arg("--retain-interval", "1h")
        .arg("--verify-window", "10m")
        .arg("--verify-after", "1m")
        // Looks are Nova's lists (a fault below keeps one operation open).
        .arg("--confirm-with", "nova-list")
}

fn sqlite_options() -> AppOptions {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("vr-retention-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    AppOptions {
        db_url: Some(format!("sqlite://{}/ledger.db", dir.display())),
        ..options()
    }
}

async fn attach(
    app: &TestApp,
    key: &str,
    server: Uuid,
    volume: Uuid,
) -> Result<pb::Operation, tonic::Status> {
    app.raw()
        .attach_volume(with_timeout(
            pb::AttachVolumeRequest {
                idempotency_key: key.into(),
                server_id: server.to_string(),
                volume_id: volume.to_string(),
                ..Default::default()
            },
            // 5 s: an unknown decision gets the reserve's last quarter
            // (250 ms) to be written in, on a loaded CI machine.
            Duration::from_secs(5),
        ))
        .await
        .map(|r| r.into_inner())
}

async fn get_by_key(app: &TestApp, key: &str) -> Result<pb::Operation, tonic::Status> {
    app.raw()
        .get_operation(pb::GetOperationRequest {
            idempotency_key: key.into(),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner())
}

/// An attach left UNKNOWN: its answer lost, every look too slow.
async fn open_attach(app: &TestApp, key: &str) -> Uuid {
    let (server, volume) = (Uuid::new_v4(), Uuid::new_v4());
    app.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::CloseBeforeEffect).volume(volume));
    app.sim.add_fault(
        FaultRule::new(FaultOp::List, Fault::DelayBeforeEffect { ms: 10_000 })
            .server(server)
            .always(),
    );
    let err = attach(app, key, server, volume).await.unwrap_err();
    let (reason, meta) = error_info(&err);
    assert_eq!(reason, "OUTCOME_UNKNOWN", "{err:?}");
    app.sim.clear_faults();
    meta["operation_id"].parse().unwrap()
}

async fn round(app: &TestApp, ahead: Duration) -> PruneCounts {
    app.pruner
        .run_once_ahead(ahead)
        .await
        .unwrap()
        .expect("the round ran")
}

/// The whole story on one store: ages out at `--retain`, not before; open
/// operations never; a replay of the pruned key refused, never run; the
/// tombstone expires at `--retain-keys`.
async fn old_decisions_age_out_and_their_keys_are_refused(app: TestApp) {
    let (server, volume) = (Uuid::new_v4(), Uuid::new_v4());
    let decided = attach(&app, "old-1", server, volume).await.unwrap();
    let decided_id: Uuid = decided.id.parse().unwrap();
    let open_id = open_attach(&app, "open-1").await;
    let events = app.store.operation_events(decided_id).await.unwrap().len() as u64;
    assert!(events >= 2, "{events}");

    // Now, and a little before a day has passed: nothing goes.
    assert_eq!(round(&app, Duration::ZERO).await, PruneCounts::default());
    assert_eq!(
        round(&app, DAY - Duration::from_secs(3600)).await,
        PruneCounts::default()
    );
    // Past a day: the decided one and its events, with a tombstone.
    let c = round(&app, DAY + Duration::from_secs(3600)).await;
    // The log's rows: one per event on the embedded store, one per write
    // on PostgreSQL (its `recorded` event lives in the operation's row).
    assert!(
        (1..=events).contains(&c.events),
        "{c:?} for {events} events"
    );
    assert_eq!(
        (c.operations, c.tombstones_written, c.deferred),
        (1, 1, 0),
        "{c:?}"
    );
    assert!(app.store.operation_get(decided_id).await.unwrap().is_none());
    assert!(
        app.store
            .operation_events(decided_id)
            .await
            .unwrap()
            .is_empty()
    );
    // The open one stays, with its log, whatever its age.
    let open = app.store.operation_get(open_id).await.unwrap().unwrap();
    assert!(!open.state.is_terminal());
    assert!(
        !app.store
            .operation_events(open_id)
            .await
            .unwrap()
            .is_empty()
    );

    // A replay of the pruned key: refused as expired, never sent to Nova.
    let sent_before = app.sim.truth().attach_requests[&volume];
    let err = attach(&app, "old-1", server, volume).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    let (reason, meta) = error_info(&err);
    assert_eq!(reason, "IDEMPOTENCY_KEY_EXPIRED");
    assert_eq!(meta["idempotency_key"], "old-1");
    chrono::DateTime::parse_from_rfc3339(&meta["expired_at"]).expect("an RFC 3339 time");
    assert!(err.message().contains("old-1"), "{}", err.message());
    assert_eq!(app.sim.truth().attach_requests[&volume], sent_before);
    assert_eq!(app.sim.attach_effects(volume), 1, "attached once");
    // Asked for by key, the same reason.
    let err = get_by_key(&app, "old-1").await.unwrap_err();
    assert_eq!(error_info(&err).0, "IDEMPOTENCY_KEY_EXPIRED");

    // The metrics say what went.
    let text = reqwest::get(format!("{}/metrics", app.admin_url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let sample = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name} not in:\n{text}"))
    };
    assert_eq!(
        sample("volume_reconciler_retention_pruned_rows_total{table=\"operations\"}"),
        1.0
    );
    assert_eq!(
        sample("volume_reconciler_retention_pruned_rows_total{table=\"events\"}"),
        c.events as f64
    );
    assert_eq!(sample("volume_reconciler_retention_keep_seconds"), 86400.0);
    assert!(sample("volume_reconciler_retention_last_round_timestamp_seconds") > 0.0);
    // The open work is what is left open (pruning touches decided rows).
    let counted: f64 = text
        .lines()
        .filter(|l| l.starts_with("volume_reconciler_open_operations{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(counted, 1.0, "open operations after pruning:\n{text}");

    // A year on (--retain-keys), the tombstone goes; the key is free again.
    let c = round(&app, 366 * DAY).await;
    assert_eq!((c.operations, c.tombstones_expired), (0, 1), "{c:?}");
    let err = get_by_key(&app, "old-1").await.unwrap_err();
    assert_eq!(error_info(&err).0, "OPERATION_NOT_FOUND");
    assert!(app.store.operation_get(open_id).await.unwrap().is_some());
    app.stop().await;
}

#[tokio::test]
async fn old_decisions_age_out_and_their_keys_are_refused_on_postgresql() {
    old_decisions_age_out_and_their_keys_are_refused(spawn_app(options()).await).await;
}

#[tokio::test]
async fn old_decisions_age_out_and_their_keys_are_refused_on_the_embedded_store() {
    old_decisions_age_out_and_their_keys_are_refused(spawn_app(sqlite_options()).await).await;
}

#[tokio::test]
async fn a_decision_the_verifier_may_still_look_at_is_kept_past_retain() {
    let app = spawn_app(options().arg("--retain", "1m")).await;
    let op = attach(&app, "v-1", Uuid::new_v4(), Uuid::new_v4())
        .await
        .unwrap();
    // Kept twice --verify-window (10m): not at 2 or 19 minutes, at 21.
    for ahead in [2, 19] {
        let c = round(&app, Duration::from_secs(ahead * 60)).await;
        assert_eq!(c.operations, 0, "at {ahead} minutes");
    }
    assert_eq!(
        round(&app, Duration::from_secs(21 * 60)).await.operations,
        1
    );
    assert!(
        app.store
            .operation_get(op.id.parse().unwrap())
            .await
            .unwrap()
            .is_none()
    );
    app.stop().await;
}

#[tokio::test]
async fn retain_zero_keeps_everything() {
    let app = spawn_app(options().arg("--retain", "0")).await;
    let op = attach(&app, "z-1", Uuid::new_v4(), Uuid::new_v4())
        .await
        .unwrap();
    assert_eq!(
        app.pruner.run_once_ahead(3650 * DAY).await.unwrap(),
        None,
        "no round at all"
    );
    assert!(
        app.store
            .operation_get(op.id.parse().unwrap())
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(get_by_key(&app, "z-1").await.unwrap().id, op.id);
    app.stop().await;
}

#[tokio::test]
async fn two_replicas_never_prune_at_once() {
    // Small batches with a pause: a round of 200 operations takes seconds.
    let small = |o: AppOptions| o.arg("--retain-batch", "10").arg("--retain-pause", "100ms");
    let a = spawn_app(small(options())).await;
    let b = spawn_app(small(AppOptions {
        db_url: Some(a.db_url.clone()),
        nova_url: Some(a.sim_handle.as_ref().unwrap().nova_url.clone()),
        replica: "test-b".into(),
        ..options()
    }))
    .await;
    let server = Uuid::new_v4();
    for i in 0..200 {
        attach(&a, &format!("r-{i}"), server, Uuid::new_v4())
            .await
            .unwrap();
    }
    let ahead = DAY + Duration::from_secs(3600);
    let first = tokio::spawn({
        let pruner = a.pruner.clone();
        async move { pruner.run_once_ahead(ahead).await }
    });
    support::eventually(Duration::from_secs(20), "a's round has begun", || {
        let store = a.store.clone();
        async move {
            let left: i64 = store
                .operation_count_by_state()
                .await
                .unwrap()
                .iter()
                .map(|c| c.count)
                .sum();
            left < 200
        }
    })
    .await;
    // While a's round runs, b's does not start.
    assert_eq!(
        b.pruner.run_once_ahead(ahead).await.unwrap(),
        None,
        "b pruned while a was pruning"
    );
    let c = first.await.unwrap().unwrap().expect("a's round ran");
    assert_eq!((c.operations, c.tombstones_written), (200, 200), "{c:?}");
    // Once a's round is over, b's may run (and finds nothing left).
    assert_eq!(
        b.pruner.run_once_ahead(ahead).await.unwrap(),
        Some(PruneCounts::default())
    );
    b.stop().await;
    a.stop().await;
}

#[tokio::test]
async fn operations_are_deleted_only_once_no_older_transaction_can_miss_their_tombstones() {
    use sqlx::Connection as _;
    let app = spawn_app(options().arg("--retain-horizon-wait", "500ms")).await;
    let (server, volume) = (Uuid::new_v4(), Uuid::new_v4());
    let op = attach(&app, "h-1", server, volume).await.unwrap();
    // A transaction whose snapshot predates the tombstones (as a replay's
    // intent statement racing the pruner would be).
    let mut older = sqlx::PgConnection::connect(&app.db_url).await.unwrap();
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut older)
        .await
        .unwrap();
    sqlx::query("SELECT count(*) FROM operations")
        .execute(&mut older)
        .await
        .unwrap();
    let ahead = DAY + Duration::from_secs(3600);
    let c = round(&app, ahead).await;
    assert_eq!(
        (c.operations, c.tombstones_written, c.deferred),
        (0, 1, 1),
        "{c:?}"
    );
    // Meanwhile the key is still honoured: its operation is still there.
    assert_eq!(attach(&app, "h-1", server, volume).await.unwrap().id, op.id);
    sqlx::query("COMMIT").execute(&mut older).await.unwrap();
    let c = round(&app, ahead).await;
    assert_eq!((c.operations, c.deferred), (1, 0), "{c:?}");
    let err = attach(&app, "h-1", server, volume).await.unwrap_err();
    assert_eq!(error_info(&err).0, "IDEMPOTENCY_KEY_EXPIRED");
    app.stop().await;
}

/// PostgreSQL: the events table has no foreign key (see the migration
/// `events_without_foreign_key`), so retention itself must leave no event
/// behind. An append in flight while its operation is pruned (the writers'
/// append: the operation held FOR KEY SHARE, its event inserted, not yet
/// committed) makes the delete wait; its event then goes with the
/// operation. (Both deletes in one statement, as before, left it behind:
/// their snapshot predated the append's commit.)
#[tokio::test]
async fn an_event_appended_while_its_operation_is_pruned_goes_with_it() {
    use sqlx::Connection as _;
    let app = spawn_app(options()).await;
    let (server, volume) = (Uuid::new_v4(), Uuid::new_v4());
    let op = attach(&app, "o-1", server, volume).await.unwrap();
    let id: Uuid = op.id.parse().unwrap();
    let mut append = sqlx::PgConnection::connect(&app.db_url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut append).await.unwrap();
    sqlx::query("SELECT 1 FROM operations WHERE id = $1 FOR KEY SHARE")
        .bind(id)
        .execute(&mut append)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO operation_events (operation_id, kind, detail, replica)
         VALUES ($1, 'verified', 'a late look', 'test')",
    )
    .bind(id)
    .execute(&mut append)
    .await
    .unwrap();
    let watch = sqlx::PgPool::connect(&app.db_url).await.unwrap();
    let commit_once_the_pruner_waits = async {
        support::eventually(
            Duration::from_secs(30),
            "the pruner's delete waits for the append's lock",
            || {
                let watch = watch.clone();
                async move {
                    let waiting: i64 = sqlx::query_scalar(
                        "SELECT count(*) FROM pg_stat_activity
                         WHERE datname = current_database() AND wait_event_type = 'Lock'
                           AND pid <> pg_backend_pid() AND query LIKE '%DELETE FROM operations%'",
                    )
                    .fetch_one(&watch)
                    .await
                    .unwrap();
                    waiting > 0
                }
            },
        )
        .await;
        sqlx::query("COMMIT").execute(&mut append).await.unwrap();
    };
    let ahead = DAY + Duration::from_secs(3600);
    let (c, ()) = tokio::join!(round(&app, ahead), commit_once_the_pruner_waits);
    assert_eq!(c.operations, 1, "{c:?}");
    let left: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM operation_events WHERE operation_id = $1)
              + (SELECT count(*) FROM operation_log WHERE operation_id = $1)",
    )
    .bind(id)
    .fetch_one(&watch)
    .await
    .unwrap();
    assert_eq!(left, 0, "no event outlives its operation");
    app.stop().await;
}
