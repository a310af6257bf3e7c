//! What the lifecycle tests share (tests/api/lifecycle*.rs): requests,
//! ledger reads, the simulator's view of an operation's requests, and
//! waits that drive the reconciler.

use std::time::Duration;

use super::{AppOptions, Ledger, TestApp, eventually};
use uuid::Uuid;
use volume_reconciler::domain::{Operation, OperationEvent, Reason};
use volume_reconciler::grpc::pb;
use volume_reconciler::nova::client::RequestId;
use volume_reconciler::sim::{RequestRecord, SimConfig};

/// Runs a scenario once per ledger, as `<scenario>::on_postgres` and
/// `<scenario>::on_the_embedded_store`.
#[macro_export]
macro_rules! on_both_ledgers {
    ($scenario:ident) => {
        mod $scenario {
            #[tokio::test]
            async fn on_postgres() {
                super::$scenario(super::Ledger::Postgres).await
            }

            #[tokio::test]
            async fn on_the_embedded_store() {
                super::$scenario(super::Ledger::Embedded).await
            }
        }
    };
}

pub fn attach(key: &str, server: Uuid, volume: Uuid) -> pb::AttachVolumeRequest {
    pb::AttachVolumeRequest {
        idempotency_key: key.into(),
        server_id: server.to_string(),
        volume_id: volume.to_string(),
        ..Default::default()
    }
}

pub fn detach(key: &str, server: Uuid, volume: Uuid) -> pb::DetachVolumeRequest {
    pb::DetachVolumeRequest {
        labels: Default::default(),
        idempotency_key: key.into(),
        server_id: server.to_string(),
        volume_id: volume.to_string(),
    }
}

/// Nova's list of `server`'s attachments fails (500) until the faults are
/// cleared: a look at it decides nothing.
pub fn list_fails(server: Uuid) -> volume_reconciler::sim::FaultRule {
    use volume_reconciler::sim::{Fault, FaultOp, FaultRule};
    FaultRule::new(
        FaultOp::List,
        Fault::Status {
            code: 500,
            effect: false,
        },
    )
    .server(server)
    .always()
}

/// Nova answers every attach of `volume` 409 (the server busy in a task
/// state) until the faults are cleared.
pub fn nova_busy(volume: Uuid) -> volume_reconciler::sim::FaultRule {
    use volume_reconciler::sim::{Fault, FaultOp, FaultRule};
    FaultRule::new(FaultOp::Attach, Fault::Conflict)
        .volume(volume)
        .always()
}

pub fn ids() -> (Uuid, Uuid) {
    (Uuid::new_v4(), Uuid::new_v4())
}

/// A service on `ledger` whose simulator keeps every request and effect.
pub fn with_history(ledger: Ledger) -> AppOptions {
    AppOptions {
        sim: SimConfig {
            record_history: true,
            ..SimConfig::default()
        },
        ..AppOptions::default()
    }
    .on(ledger)
}

pub fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

pub fn id_of(op: &pb::Operation) -> Uuid {
    op.id.parse().expect("an operation id")
}

pub async fn row(app: &TestApp, id: Uuid) -> Operation {
    app.store
        .operation_get(id)
        .await
        .unwrap()
        .expect("the row exists")
}

pub async fn row_by_key(app: &TestApp, key: &str) -> Option<Operation> {
    app.store
        .operation_get_by_key(&crate::support::ck(None, key))
        .await
        .unwrap()
}

pub async fn log(app: &TestApp, id: Uuid) -> Vec<OperationEvent> {
    app.store.operation_events(id).await.unwrap()
}

pub fn count(events: &[OperationEvent], kind: &str) -> usize {
    events.iter().filter(|e| e.kind == kind).count()
}

pub fn reason(op: &Operation) -> Option<Reason> {
    op.last_error.as_ref().map(|e| e.reason)
}

/// What Nova received of operation `id`'s requests (by the global request
/// id every request of an operation carries).
pub fn requests_of(app: &TestApp, id: Uuid) -> Vec<RequestRecord> {
    let rid = RequestId::for_operation(id);
    app.sim
        .truth()
        .requests
        .into_iter()
        .filter(|r| r.global_id.as_deref() == Some(rid.as_str()))
        .collect()
}

/// The operation `key` names once it is recorded.
pub async fn recorded(app: &TestApp, key: &str) -> Operation {
    let store = app.store.clone();
    eventually(secs(15.0), "the operation is recorded", || {
        let (store, key) = (store.clone(), key.to_string());
        async move {
            store
                .operation_get_by_key(&crate::support::ck(None, &key))
                .await
                .unwrap()
                .is_some()
        }
    })
    .await;
    row_by_key(app, key).await.expect("recorded")
}

/// Runs reconciler rounds until `done` holds for operation `id` (the
/// background reconciler is off in these tests: rounds run when asked).
pub async fn reconcile_until(
    app: &TestApp,
    id: Uuid,
    within: Duration,
    what: &str,
    done: impl Fn(&Operation) -> bool + Clone,
) -> Operation {
    let (store, reconciler) = (app.store.clone(), app.reconciler.clone());
    eventually(within, what, || {
        let (store, reconciler, done) = (store.clone(), reconciler.clone(), done.clone());
        async move {
            reconciler.run_once().await.unwrap();
            done(&store.operation_get(id).await.unwrap().unwrap())
        }
    })
    .await;
    row(app, id).await
}

/// Waits (without running the reconciler) until `id` is decided.
pub async fn decided(app: &TestApp, id: Uuid, within: Duration) -> Operation {
    let store = app.store.clone();
    eventually(within, "the operation is decided", || {
        let store = store.clone();
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
    row(app, id).await
}

/// The metric samples of the service whose name starts with `name`.
pub async fn metric(app: &TestApp, name: &str) -> Vec<(String, f64)> {
    let text = reqwest::get(format!("{}/metrics", app.admin_url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}
