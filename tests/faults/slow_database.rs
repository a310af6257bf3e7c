//! A database that is slow, not only down: two replicas on one
//! PostgreSQL, one of them behind a proxy that holds or loses its
//! replies. Nothing Nova never saw stays unknown (an intent whose
//! acknowledgement outlived its lease is decided as never sent), and a
//! claim whose reply was lost restarts no settle window and leaves nothing
//! orphaned. Ground truth: the simulator's count of each volume's requests.

use crate::support;

use std::time::Duration;

use support::lifecycle::*;
use support::proxy::{Lose, Proxy};
use support::{AppOptions, TestApp, spawn_app, with_timeout};
use uuid::Uuid;
use volume_reconciler::domain::{Reason, State};
use volume_reconciler::grpc::pb;
use volume_reconciler::sim::netfault::FaultProxy;
use volume_reconciler::sim::{Fault, FaultOp, FaultRule};

/// Replica `name` on database `db` (through whatever URL `db` is), against
/// `nova` and its Cinder.
async fn replica(name: &str, db: &str, sim: &TestApp, extra: &[(&str, &str)]) -> TestApp {
    let handle = sim
        .sim_handle
        .as_ref()
        .expect("the first replica's simulator");
    let mut opts = AppOptions {
        db_url: Some(db.to_string()),
        nova_url: Some(handle.nova_url.clone()),
        replica: name.into(),
        ..AppOptions::default()
    }
    .arg("--cinder-url", &handle.cinder_url);
    for (f, v) in extra {
        opts = opts.arg(f, v);
    }
    spawn_app(opts).await
}

/// PostgreSQL's replies to replica A are held for 7 s while it writes the
/// intents of four attaches: longer than its lease (5 s here: 2 × the 2 s
/// round-trip bound and the rest), so replica B takes each fresh intent
/// over before its request could leave. A's send gate then finds the lease
/// lost, and A marks each attempt as one that never left; B decides each
/// as never sent: re-sent within its deadline (SUCCEEDED, one request at
/// Nova) or, out of time, FAILED NOT_SENT (none). Never UNKNOWN for a
/// settle window (31 minutes for an attach); every volume is free for a
/// new attach after. Red without the mark: each stays UNKNOWN, its volume
/// busy.
#[tokio::test]
async fn intents_acknowledged_after_their_lease_are_decided_as_never_sent() {
    let direct = support::pg::fresh_database().await;
    let (proxy, proxied) = FaultProxy::for_url(&direct)
        .await
        .expect("the proxy starts");
    // A: behind the proxy, its reconciler off; its simulator is the Nova of both.
    let a = spawn_app(AppOptions {
        db_url: Some(proxied),
        replica: "slow-a".into(),
        ..with_history(support::Ledger::Postgres)
    })
    .await;
    let b = replica(
        "quick-b",
        &direct,
        &a,
        &[("--with-reconciler", ""), ("--reconcile-interval", "100ms")],
    )
    .await;
    let deadline = secs(30.0);
    // A's writer has its connection open and its statements prepared, so
    // the intents reach the server at once (their replies are what is held).
    let (ws, wv) = ids();
    a.raw()
        .attach_volume(with_timeout(attach("warm", ws, wv), secs(10.0)))
        .await
        .expect("a first attach");
    let volumes: Vec<(Uuid, Uuid)> = (0..4).map(|_| ids()).collect();
    proxy.hold_replies(true);
    let started = tokio::time::Instant::now();
    let calls: Vec<_> = volumes
        .iter()
        .enumerate()
        .map(|(i, (s, v))| {
            let (mut c, s, v) = (a.raw(), *s, *v);
            tokio::spawn(async move {
                c.attach_volume(with_timeout(attach(&format!("slow-{i}"), s, v), deadline))
                    .await
            })
        })
        .collect();
    // The fault: seven seconds of held replies (not a wait for anything).
    tokio::time::sleep(secs(7.0)).await;
    proxy.hold_replies(false);
    let mut heard = Vec::new();
    for call in calls {
        heard.push(call.await.expect("the call's task"));
    }
    let mut recorded = 0;
    for (i, ((s, v), answer)) in volumes.iter().zip(heard).enumerate() {
        let key = format!("slow-{i}");
        let Some(op) = row_by_key(&a, &key).await else {
            // Refused before its intent was sent, once the store knew the
            // database away: nothing recorded, nothing sent, the caller
            // told to come back.
            let e = answer.expect_err("an answer without an operation");
            assert_eq!(
                (e.code(), support::error_info(&e).0.as_str()),
                (tonic::Code::Unavailable, "DATABASE_UNAVAILABLE"),
                "{key}: {e:?}"
            );
            assert_eq!(a.sim.attach_requests(*v), 0, "{key}: nothing sent");
            continue;
        };
        recorded += 1;
        let op = decided(
            &b,
            op.id,
            (deadline + secs(10.0)).saturating_sub(started.elapsed()),
        )
        .await;
        match (op.state, reason(&op)) {
            (State::Succeeded, _) => {
                assert_eq!(
                    a.sim.attach_requests(*v),
                    1,
                    "{key}: SUCCEEDED with one request"
                );
                assert!(a.sim.is_attached(*s, *v));
            }
            (State::Failed, Some(Reason::NotSent)) => {
                assert_eq!(
                    a.sim.attach_requests(*v),
                    0,
                    "{key}: NOT_SENT and none sent"
                )
            }
            other => panic!("{key}: {other:?}: {op:?}"),
        }
        // The volume is free again: a detach of it runs.
        let freed = b
            .raw()
            .ensure_detached(with_timeout(
                pb::EnsureDetachedRequest {
                    labels: Default::default(),
                    server_id: s.to_string(),
                    volume_id: v.to_string(),
                },
                secs(10.0),
            ))
            .await
            .unwrap_or_else(|e| panic!("{key}: the volume is not free: {e:?}"))
            .into_inner();
        assert_eq!(freed.state, pb::State::Succeeded as i32, "{key}: {freed:?}");
    }
    assert!(
        recorded > 0,
        "no intent reached the database before it was held"
    );
    b.stop().await;
    a.stop().await;
}

/// A claim whose `COMMIT` committed but whose acknowledgement was lost, at
/// the end of an operation's settle window: the claim is not run blind
/// again, and what it took is released at once, so the next round decides
/// the operation. Before, a second run found the operation held by its own
/// first run and took nothing; the operation waited out the lease, then
/// was "taken over from" this very replica with its settle window started
/// again.
#[tokio::test]
async fn a_claim_whose_reply_was_lost_is_released_and_decided_by_the_next_round() {
    let a =
        spawn_app(with_history(support::Ledger::Postgres).arg("--confirm-with", "nova-list")).await;
    let (s, v) = ids();
    // An attach that takes effect and loses its answer while the list
    // fails: UNKNOWN, for the reconciler.
    a.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::CloseAfterEffect).volume(v));
    a.sim.add_fault(list_fails(s));
    let answered = a
        .raw()
        .attach_volume(with_timeout(attach("claim-lost", s, v), secs(3.0)))
        .await;
    assert!(answered.is_err(), "not known by the deadline: {answered:?}");
    let op = row_by_key(&a, "claim-lost").await.expect("recorded");
    assert_eq!(op.state, State::Unknown);
    a.sim.clear_faults();
    // B, behind a proxy that loses the acknowledgement of its claim's
    // commit; its name is the marker its claim carries.
    let name = format!("claimer-{}", Uuid::new_v4().simple());
    let (proxy, proxied) = Proxy::start(&a.db_url).await;
    let b = replica(&name, &proxied, &a, &[("--settle-window", "2s")]).await;
    support::eventually(secs(15.0), "the settle window has ended", || {
        let store = a.store.clone();
        async move {
            let op = store.operation_get(op.id).await.unwrap().unwrap();
            let now = store.now().await.unwrap();
            op.last_request_at
                .is_some_and(|t| t + chrono::Duration::seconds(3) < now)
        }
    })
    .await;
    proxy.arm(Lose::CommitResponse, &name, Duration::ZERO);
    // Its claim commits, and its acknowledgement is lost: the round's
    // answer is whatever it is; what it left behind is the point.
    let lost = b.reconciler.run_once().await;
    proxy.fired(secs(10.0)).await;
    tracing::debug!(?lost, "the round whose claim's acknowledgement was lost");
    // The very next round decides it.
    b.reconciler.run_once().await.expect("a round");
    let now = row(&a, op.id).await;
    assert_eq!(now.state, State::Succeeded, "{now:?}");
    let taken_over = log(&a, op.id)
        .await
        .into_iter()
        .filter(|e| e.kind == "claimed" && e.detail.contains(&name))
        .count();
    assert_eq!(taken_over, 0, "nothing was taken over from {name} itself");
    assert_eq!(a.sim.attach_requests(v), 1);
    b.stop().await;
    a.stop().await;
}

/// Every commit that writes takes 2.7 s (fsync-bound commits under load:
/// here a deferred trigger that sleeps once per writing transaction, at
/// its commit): within the round-trip bound (5 s, the service's default),
/// so healthy as far as the store can tell. Attaches succeed, slowly, each
/// with one request at Nova. With a 3 s lease, a send gate that wanted
/// 500 ms of it left and renewed within half a lease, every one of them
/// failed `NOT_SENT` ("its lease could not be renewed within 1500 ms"),
/// Nova untouched.
#[tokio::test]
async fn attaches_succeed_when_every_write_commits_in_2_7_s() {
    let app = spawn_app(
        with_history(support::Ledger::Postgres)
            // The service's own bounds: a 5 s round trip is healthy, the
            // lease (left out) follows from them.
            .arg("--db-statement-timeout", "5s")
            .arg("--heartbeat", "1s"),
    )
    .await;
    let mut admin = support::pg::Admin::connect(&app.db_url).await;
    admin
        .run(
            "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF current_setting('test.slept', true) IS DISTINCT FROM 'yes' THEN
                     PERFORM set_config('test.slept', 'yes', true);
                     PERFORM pg_sleep(2.7);
                 END IF;
                 RETURN NULL;
             END $$",
        )
        .await;
    admin
        .run(
            "CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT OR UPDATE ON operations
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit()",
        )
        .await;
    let started = tokio::time::Instant::now();
    let calls: Vec<_> = (0..3)
        .map(|i| {
            let (mut c, (s, v)) = (app.raw(), ids());
            tokio::spawn(async move {
                let answer = c
                    .attach_volume(with_timeout(
                        attach(&format!("steady-{i}"), s, v),
                        secs(60.0),
                    ))
                    .await;
                (s, v, answer)
            })
        })
        .collect();
    for call in calls {
        let (s, v, answer) = call.await.expect("the call's task");
        let op = answer.unwrap_or_else(|e| panic!("{v}: {e:?}")).into_inner();
        assert_eq!(op.state, pb::State::Succeeded as i32, "{op:?}");
        assert_eq!(app.sim.attach_requests(v), 1, "{v}: one request");
        assert!(app.sim.is_attached(s, v));
        assert_eq!(row(&app, id_of(&op)).await.state, State::Succeeded);
    }
    // Slowly: an intent and a decision, each a commit.
    assert!(started.elapsed() >= secs(5.4), "{:?}", started.elapsed());
    app.stop().await;
}
