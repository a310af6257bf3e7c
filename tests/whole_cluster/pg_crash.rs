//! PostgreSQL crashes (an immediate shutdown, recovered from its WAL at
//! the next start) at the two instants the ledger's guarantees are about:
//! right after a request reached Nova, its operation's intent is in the
//! ledger; right after a caller was answered, the decision it heard is.
//! Synchronous commit on, as in production (the tests' cluster runs
//! without it elsewhere). The cluster is crashed: the test holds it alone
//! (`crate::ALONE`).

use crate::support;

use support::lifecycle::{attach, ids, secs, with_history};
use support::{AppOptions, spawn_app, with_timeout};
use uuid::Uuid;
use volume_reconciler::domain::State;
use volume_reconciler::nova::RequestId;
use volume_reconciler::sim::{Fault, FaultOp, FaultRule};

/// A fresh database whose sessions commit synchronously.
async fn durable_database() -> String {
    let url = support::pg::fresh_database().await;
    let name = url.rsplit('/').next().unwrap().to_string();
    let mut admin = support::pg::Admin::connect(&support::pg::admin_url()).await;
    admin
        .run(&format!(
            "ALTER DATABASE {name} SET synchronous_commit = on"
        ))
        .await;
    url
}

/// The operation a global request id names, read from the ledger by a
/// session of its own (after the crash, nothing cached).
async fn row_of(db: &str, op: Uuid) -> Option<(String, String)> {
    let mut admin = support::pg::Admin::connect(db).await;
    admin
        .texts(&format!(
            "SELECT state || '|' || COALESCE(resolution, '') FROM operations WHERE id = '{op}'"
        ))
        .await
        .pop()
        .map(|t| {
            let (s, r) = t.split_once('|').unwrap();
            (s.to_string(), r.to_string())
        })
}

#[tokio::test]
async fn a_crash_right_after_a_request_reached_nova_and_right_after_an_answer_loses_neither() {
    let _alone = crate::ALONE.lock().await;
    let db = durable_database().await;
    let app = spawn_app(AppOptions {
        db_url: Some(db.clone()),
        ..with_history(support::Ledger::Postgres)
    })
    .await;
    // An attach answered: the decision the caller hears...
    let (s1, v1) = ids();
    let answered = app
        .raw()
        .attach_volume(with_timeout(attach("answered", s1, v1), secs(10.0)))
        .await
        .expect("answered")
        .into_inner();
    let answered_id: Uuid = answered.id.parse().unwrap();
    // ... and an attach whose request Nova holds (it answers in 3 s).
    let (s2, v2) = ids();
    app.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::DelayBeforeEffect { ms: 3000 }).volume(v2),
    );
    let mut raw = app.raw();
    let held = tokio::spawn(async move {
        raw.attach_volume(with_timeout(attach("held", s2, v2), secs(30.0)))
            .await
    });
    let sim = app.sim.clone();
    support::eventually(secs(10.0), "the held request reached Nova", || {
        let sim = sim.clone();
        async move { sim.attach_requests(v2) == 1 }
    })
    .await;
    // The crash, at once; then PostgreSQL is back.
    support::pg::crash_and_restart();
    let held_id: Uuid = app
        .sim
        .truth()
        .requests
        .iter()
        .find(|r| r.volume_id == v2)
        .and_then(|r| r.global_id.as_deref()?.strip_prefix("req-")?.parse().ok())
        .expect("the service names its request");
    assert_eq!(
        RequestId::for_operation(held_id).as_str(),
        format!("req-{held_id}")
    );
    let db2 = db.clone();
    support::eventually(secs(30.0), "PostgreSQL accepts connections again", || {
        let db = db2.clone();
        async move {
            <sqlx::PgConnection as sqlx::Connection>::connect(&db)
                .await
                .is_ok()
        }
    })
    .await;
    // Both survived the crash: the decision as the caller heard it, and
    // the intent of the request Nova received.
    assert_eq!(
        row_of(&db, answered_id).await,
        Some(("succeeded".into(), "response".into())),
        "the decision a caller was told is in the ledger after the crash"
    );
    assert!(
        row_of(&db, held_id).await.is_some(),
        "the intent of a request that reached Nova is in the ledger after the crash"
    );
    // And the service recovers: the held operation ends as Nova did.
    drop(held.await.expect("the held call"));
    let op = support::lifecycle::reconcile_until(&app, held_id, secs(60.0), "decided", |op| {
        op.state.is_terminal()
    })
    .await;
    assert_eq!(op.state, State::Succeeded);
    assert!(app.sim.is_attached(s2, v2));
    assert_eq!(app.sim.attach_requests(v2), 1, "sent once");
    app.stop().await;
}
