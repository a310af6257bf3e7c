//! Leases under stalls and shutdowns, two replicas on one PostgreSQL and
//! one simulated Nova: a request never leaves after another replica may
//! have taken its operation over, and a replica that shuts down keeps the
//! leases of the operations still running on it. Ground truth: the
//! simulator's count of the requests each volume received.

use crate::support;

use std::time::Duration;

use support::lifecycle::{attach, ids, secs, with_history};
use support::{AppOptions, TestApp, eventually, spawn_app, with_timeout};
use volume_reconciler::sim::netfault::FaultProxy;
use volume_reconciler::sim::{Fault, FaultOp, FaultRule};

/// Replica B on `db`, calling replica A's Nova, reconciler driven by hand.
async fn replica_b(db: &str, nova_url: &str, extra: &[(&str, &str)]) -> TestApp {
    let mut opts = AppOptions {
        db_url: Some(db.to_string()),
        nova_url: Some(nova_url.to_string()),
        replica: "test-b".into(),
        ..AppOptions::default()
    };
    for (f, v) in extra {
        opts = opts.arg(f, v);
    }
    spawn_app(opts).await
}

/// Runs B's reconciler until `done` holds.
async fn reconcile_until(b: &TestApp, within: Duration, what: &str, done: impl Fn() -> bool) {
    let r = b.reconciler.clone();
    eventually(within, what, || {
        let r = r.clone();
        let d = done();
        async move {
            if !d {
                // A failed round is tried again at the next poll.
                if let Err(e) = r.run_once().await {
                    tracing::debug!(error = %e, "a reconciler round failed");
                }
            }
            d
        }
    })
    .await;
}

#[tokio::test]
async fn a_request_that_waited_past_its_lease_does_not_leave_after_a_takeover() {
    let direct = support::pg::fresh_database().await;
    let (proxy, proxied) = FaultProxy::for_url(&direct).await.unwrap();
    // A: one Nova slot, its ledger behind the proxy.
    let a = spawn_app(
        AppOptions {
            db_url: Some(proxied),
            ..with_history(support::Ledger::Postgres)
        }
        .arg("--nova-max-concurrency", "1"),
    )
    .await;
    let nova_url = a.sim_handle.as_ref().unwrap().nova_url.clone();
    let b = replica_b(
        &direct,
        &nova_url,
        &[("--settle-window", "1s"), ("--confirm-with", "nova-list")],
    )
    .await;
    let ((s1, v1), (s2, v2)) = (ids(), ids());
    // The first attach holds A's only slot for 6 s.
    a.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::DelayAfterEffect { ms: 6000 }).volume(v1),
    );
    let mut raw = a.raw();
    let first = tokio::spawn(async move {
        raw.attach_volume(with_timeout(attach("k1", s1, v1), secs(20.0)))
            .await
    });
    support::eventually(secs(5.0), "the first attach reached Nova", || {
        let sim = a.sim.clone();
        async move { sim.attach_requests(v1) == 1 }
    })
    .await;
    // The second is recorded, then waits for the slot...
    let mut raw = a.raw();
    let second = tokio::spawn(async move {
        raw.attach_volume(with_timeout(attach("k2", s2, v2), secs(20.0)))
            .await
    });
    let op2 = support::lifecycle::recorded(&a, "k2").await;
    // ... while A's database goes silent: its heartbeat cannot renew.
    proxy.silence_open();
    proxy.set_new(volume_reconciler::sim::netfault::NewConns::Silent);
    // B takes the lapsed lease over and, the settle window past, attaches.
    reconcile_until(&b, secs(10.0), "B re-sent the second attach", || {
        a.sim.attach_requests(v2) >= 1
    })
    .await;
    proxy.resume();
    // A's slot frees; its request must not leave now: the lease is B's.
    // Whatever the callers heard: the truth is checked below.
    drop((first.await, second.await));
    let decided = support::lifecycle::decided(&b, op2.id, secs(15.0)).await;
    assert_eq!(
        a.sim.attach_requests(v2),
        1,
        "Nova received the second volume's attach twice (A's request left after B took over)"
    );
    assert!(a.sim.is_attached(s2, v2));
    assert_eq!(decided.state, volume_reconciler::domain::State::Succeeded);
    b.stop().await;
    a.stop().await;
}

#[tokio::test]
async fn a_replica_that_shuts_down_with_operations_running_sends_nothing_after_handing_them_over() {
    let a = spawn_app(
        with_history(support::Ledger::Postgres)
            .arg("--nova-max-concurrency", "1")
            .arg("--drain-timeout", "500ms"),
    )
    .await;
    let nova_url = a.sim_handle.as_ref().unwrap().nova_url.clone();
    let b = replica_b(
        &a.db_url,
        &nova_url,
        &[("--settle-window", "1s"), ("--confirm-with", "nova-list")],
    )
    .await;
    let ((s1, v1), (s2, v2)) = (ids(), ids());
    a.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::DelayAfterEffect { ms: 3000 }).volume(v1),
    );
    let mut raw = a.raw();
    let first = tokio::spawn(async move {
        raw.attach_volume(with_timeout(attach("k1", s1, v1), secs(20.0)))
            .await
    });
    support::eventually(secs(5.0), "the first attach reached Nova", || {
        let sim = a.sim.clone();
        async move { sim.attach_requests(v1) == 1 }
    })
    .await;
    let mut raw = a.raw();
    let second = tokio::spawn(async move {
        raw.attach_volume(with_timeout(attach("k2", s2, v2), secs(20.0)))
            .await
    });
    let op2 = support::lifecycle::recorded(&a, "k2").await;
    let (sim, store) = (a.sim.clone(), a.store.clone());
    // A shuts down with both operations still running (the drain is
    // shorter than Nova's answer); B's reconciler works all the while.
    let stopping = tokio::spawn(a.stop());
    reconcile_until(&b, secs(12.0), "the second volume is attached", || {
        sim.attach_requests(v2) >= 1 && sim.is_attached(s2, v2)
    })
    .await;
    stopping.await.expect("A stopped");
    // Whatever the callers heard (their connections were drained).
    drop((first.await, second.await));
    let decided = support::lifecycle::decided(&b, op2.id, secs(15.0)).await;
    assert_eq!(
        sim.attach_requests(v2),
        1,
        "the second volume's attach was sent twice: A's lease was handed over while its task still ran"
    );
    assert_eq!(decided.state, volume_reconciler::domain::State::Succeeded);
    drop(store);
    b.stop().await;
}

/// A renewal that meets the row held by another statement (the heartbeat's
/// own renewal, a decision being written) reads it busy, never lost: the
/// send gate once read "not renewed" as "taken over" and withheld the
/// request, failing the operation NOT_SENT for a lease that was still its
/// own. Once the other statement ends, the same renewal renews.
#[tokio::test]
async fn a_renewal_that_meets_a_locked_row_reads_it_busy_never_lost() {
    use volume_reconciler::store::{HeldLease, Renewal};
    let a = spawn_app(with_history(support::Ledger::Postgres)).await;
    let (s, v) = ids();
    // An operation this replica holds: its attach waits in Nova.
    a.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::DelayAfterEffect { ms: 5000 }).volume(v));
    let mut raw = a.raw();
    let call = tokio::spawn(async move {
        raw.attach_volume(with_timeout(attach("busy", s, v), secs(20.0)))
            .await
    });
    let op = support::lifecycle::recorded(&a, "busy").await;
    let lease = HeldLease {
        id: op.id,
        epoch: op.lease_epoch,
    };
    let mut other = support::pg::Admin::connect(&a.db_url).await;
    other
        .run(&format!(
            "BEGIN; SELECT 1 FROM operations WHERE id = '{}' FOR UPDATE",
            op.id
        ))
        .await;
    let replica = a.exec.replica().to_string();
    let found = a
        .store
        .operation_renew_leases(&replica, &[lease], secs(3.0))
        .await
        .unwrap();
    assert_eq!(
        found,
        vec![(op.id, Renewal::Busy)],
        "a lock read as a lost lease"
    );
    other.run("COMMIT").await;
    let found = a
        .store
        .operation_renew_leases(&replica, &[lease], secs(3.0))
        .await
        .unwrap();
    assert_eq!(found, vec![(op.id, Renewal::Renewed)]);
    let decided = call.await.unwrap().expect("the attach").into_inner();
    assert_eq!(
        decided.state,
        volume_reconciler::grpc::pb::State::Succeeded as i32
    );
    a.stop().await;
}

/// A shutdown hands over the leases of operations no task runs any more,
/// and keeps those whose task still runs. An intent still being written
/// (its write waits for a lock) is such an operation: it is held from
/// before its write, so the hand-over made meanwhile keeps its lease
/// (released, another replica could take it over while its task here goes
/// on to send its request).
#[tokio::test]
async fn an_intent_still_being_written_is_held_and_its_lease_kept_at_hand_over() {
    let a = spawn_app(with_history(support::Ledger::Postgres)).await;
    let (s, v) = ids();
    // Still running when the lease is handed over.
    a.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::DelayAfterEffect { ms: 3000 }).volume(v));
    let mut lock = support::pg::Admin::connect(&a.db_url).await;
    lock.run("BEGIN; LOCK TABLE operations IN EXCLUSIVE MODE")
        .await;
    let mut raw = a.raw();
    let call = tokio::spawn(async move {
        raw.attach_volume(with_timeout(attach("writing", s, v), secs(30.0)))
            .await
    });
    let url = a.db_url.clone();
    eventually(secs(15.0), "the intent write waits for the lock", || {
        let url = url.clone();
        async move {
            support::pg::Admin::connect(&url)
                .await
                .number(
                    "SELECT count(*) FROM pg_stat_activity
                     WHERE datname = current_database() AND wait_event_type = 'Lock'
                       AND query ILIKE '%INSERT INTO operations%'",
                )
                .await
                > 0
        }
    })
    .await;
    // What the hand-over keeps, read while the write waits.
    let keep = a.exec.held();
    assert_eq!(keep.len(), 1, "the intent being written is not held");
    lock.run("COMMIT").await;
    let op = support::lifecycle::recorded(&a, "writing").await;
    assert_eq!(keep, vec![op.id]);
    let replica = a.exec.replica().to_string();
    a.store
        .operation_release_leases(&replica, &keep)
        .await
        .unwrap();
    let row = a.store.operation_get(op.id).await.unwrap().unwrap();
    assert_eq!(
        row.lease_owner.as_deref(),
        Some(replica.as_str()),
        "the lease of a running operation was handed over: {row:?}"
    );
    let decided = call.await.unwrap().expect("the attach").into_inner();
    assert_eq!(
        decided.state,
        volume_reconciler::grpc::pb::State::Succeeded as i32
    );
    assert_eq!(a.sim.attach_requests(v), 1);
    a.stop().await;
}
