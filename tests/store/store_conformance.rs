//! One conformance suite for `Store`, run against both implementations
//! (the same test bodies, two instantiations), so they cannot drift apart.

use crate::support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use support::proxy::{Lose, Proxy};
use tokio::time::Instant;
use uuid::Uuid;
use volume_reconciler::domain::{
    Action, CallerKey, NewEvent, OperationError, RequestParams, Resolution, State,
    request_fingerprint,
};
use volume_reconciler::store::{
    CreateOutcome, DbFailure, HeldLease, ListCursor, NewOperation, OperationFilter, Renewal, Store,
    StoreError, Transition,
};

async fn pg_store() -> Arc<dyn Store> {
    support::init_logs();
    let url = support::pg::fresh_database().await;
    volume_reconciler::store::open(&url, 4).await.unwrap()
}

async fn sqlite_store() -> Arc<dyn Store> {
    support::init_logs();
    let path = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("vr-conf-{}.db", Uuid::new_v4().simple()));
    volume_reconciler::store::open(&format!("sqlite://{}", path.display()), 1)
        .await
        .unwrap()
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

fn new_op(key: &str, volume: Uuid, state: State) -> NewOperation {
    let server = Uuid::from_u128(7);
    let params = RequestParams::default();
    NewOperation {
        labels: Default::default(),
        id: Uuid::now_v7(),
        key: CallerKey::parse(Some("tester"), key).unwrap().into(),
        fingerprint: request_fingerprint(
            Action::Attach,
            server,
            volume,
            &params,
            &volume_reconciler::domain::Labels::none(),
        ),
        action: Action::Attach,
        server_id: server,
        volume_id: volume,
        params,
        state,
        attempts: i32::from(state != State::Pending),
        deadline_in: Duration::from_secs(60),
        lease_owner: "owner".into(),
        // Expired at once: claimable (like a holder that died).
        lease_for: Duration::ZERO,
        trace: None,
        replica: "r0".into(),
        events: vec![
            NewEvent::new("recorded", "r"),
            NewEvent::new("request_sent", "s").with("attempt", 1),
        ],
        record_by: None,
    }
}

/// `new_op` of another caller.
fn new_op_of(caller: &str, key: &str, volume: Uuid) -> NewOperation {
    NewOperation {
        key: CallerKey::parse(Some(caller), key).unwrap().into(),
        ..new_op(key, volume, State::InProgress)
    }
}

/// `n` new in-progress operations keyed `{prefix}{i}`, each on a volume of
/// its own.
async fn create_in_progress(
    store: &dyn Store,
    prefix: &str,
    n: usize,
) -> Vec<volume_reconciler::domain::Operation> {
    let mut ops = Vec::with_capacity(n);
    for i in 0..n {
        let key = format!("{prefix}{i}");
        ops.push(create(store, new_op(&key, Uuid::new_v4(), State::InProgress)).await);
    }
    ops
}

async fn create(store: &dyn Store, new: NewOperation) -> volume_reconciler::domain::Operation {
    match store.operation_create(new, soon()).await.unwrap() {
        CreateOutcome::Created(op) => op,
        CreateOutcome::Existing(op) => panic!("expected a new row, got {op:?}"),
    }
}

fn finish(op: &volume_reconciler::domain::Operation, state: State) -> Transition {
    let mut t = Transition::new(op, state, "r0");
    t.resolution = Some(Resolution::Response);
    t.release_lease = true;
    t.events = vec![NewEvent::new("resolved", "done")];
    t
}

async fn keys_are_unique_and_replays_join(store: Arc<dyn Store>) {
    let v = Uuid::new_v4();
    let op = create(store.as_ref(), new_op("k", v, State::InProgress)).await;
    assert_eq!(
        (op.state, op.attempts, op.caller.as_deref()),
        (State::InProgress, 1, Some("tester"))
    );
    assert!(op.last_request_at.is_some());
    match store
        .operation_create(new_op("k", v, State::InProgress), soon())
        .await
        .unwrap()
    {
        CreateOutcome::Existing(e) => assert_eq!(e.id, op.id),
        other => panic!("{other:?}"),
    }
    let mut other = new_op("k", v, State::InProgress);
    other.fingerprint.push('x');
    match store.operation_create(other, soon()).await {
        Err(StoreError::KeyReused { existing, .. }) => assert_eq!(existing.id, op.id),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        store
            .operation_get_by_key(&crate::support::ck(Some("tester"), "k"))
            .await
            .unwrap()
            .unwrap()
            .id,
        op.id
    );
    let events = store.operation_events(op.id).await.unwrap();
    assert_eq!(
        events.iter().map(|e| e.kind.as_str()).collect::<Vec<_>>(),
        ["recorded", "request_sent"]
    );
    assert_eq!(events[1].metadata["attempt"], "1");
    assert_eq!(events[0].replica, "r0");
}

async fn one_open_operation_per_volume(store: Arc<dyn Store>) {
    let v = Uuid::new_v4();
    let op = create(store.as_ref(), new_op("a", v, State::InProgress)).await;
    match store
        .operation_create(new_op("b", v, State::InProgress), soon())
        .await
    {
        Err(StoreError::VolumeBusy {
            operation_id,
            volume_id,
        }) => assert_eq!((operation_id, volume_id), (op.id, v)),
        other => panic!("{other:?}"),
    }
    store
        .operation_transition(finish(&op, State::Succeeded), soon())
        .await
        .unwrap()
        .unwrap();
    let next = create(store.as_ref(), new_op("b", v, State::InProgress)).await;
    assert_ne!(next.id, op.id, "a decided operation frees the volume");
}

async fn transitions_are_fenced_and_terminal_is_final(store: Arc<dyn Store>) {
    let op = create(
        store.as_ref(),
        new_op("f", Uuid::new_v4(), State::InProgress),
    )
    .await;
    let mut stale = finish(&op, State::Failed);
    stale.lease_epoch += 1;
    assert!(
        store
            .operation_transition(stale, soon())
            .await
            .unwrap()
            .is_none(),
        "wrong epoch"
    );
    let mut retry = Transition::new(&op, State::InProgress, "r0");
    retry.add_attempt = true;
    retry.request_sent = true;
    let op2 = store
        .operation_transition(retry, soon())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(op2.attempts, 2);
    let mut t = finish(&op2, State::Succeeded);
    t.attachment = Some(volume_reconciler::domain::AttachmentInfo {
        id: "att".into(),
        device: Some("/dev/vdb".into()),
        ..Default::default()
    });
    let done = store
        .operation_transition(t, soon())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (done.state, done.resolution),
        (State::Succeeded, Some(Resolution::Response))
    );
    assert!(done.completed_at.is_some() && done.lease_owner.is_none());
    assert_eq!(
        done.attachment.as_ref().unwrap().device.as_deref(),
        Some("/dev/vdb")
    );
    assert!(
        store
            .operation_transition(finish(&done, State::Failed), soon())
            .await
            .unwrap()
            .is_none(),
        "terminal is final"
    );
    // The constraints refuse a terminal state without a resolution.
    let op3 = create(
        store.as_ref(),
        new_op("g", Uuid::new_v4(), State::InProgress),
    )
    .await;
    let bad = Transition::new(&op3, State::Succeeded, "r0");
    match store.operation_transition(bad, soon()).await {
        Err(StoreError::Database {
            kind: DbFailure::Constraint,
            cause,
            ..
        }) => assert!(
            // The one invariant, named alike on both stores.
            cause.contains("operations_decided_invariant"),
            "{cause}"
        ),
        other => panic!("a constraint refusal, not {other:?}"),
    }
}

async fn claims_lease_each_operation_to_one_replica(store: Arc<dyn Store>) {
    for i in 0..10 {
        create(
            store.as_ref(),
            new_op(&format!("c{i}"), Uuid::new_v4(), State::Unknown),
        )
        .await;
    }
    let mut held = create(
        store.as_ref(),
        new_op("held", Uuid::new_v4(), State::InProgress),
    )
    .await;
    // An expired lease is claimable (its holder died).
    held = store
        .operation_transition(Transition::new(&held, State::InProgress, "r0"), soon())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(held.state, State::InProgress);
    let a = store
        .operation_claim("ra", Duration::from_secs(60), 6, &[])
        .await
        .unwrap();
    let b = store
        .operation_claim("rb", Duration::from_secs(60), 100, &[])
        .await
        .unwrap();
    assert_eq!(a.len(), 6);
    assert_eq!(
        a.len() + b.len(),
        11,
        "the expired 'held' lease is claimable too"
    );
    let ids_a: std::collections::HashSet<_> = a.iter().map(|o| o.id).collect();
    assert!(b.iter().all(|o| !ids_a.contains(&o.id)), "disjoint");
    assert!(
        a.iter()
            .all(|o| o.lease_owner.as_deref() == Some("ra") && o.lease_epoch == 2 && o.passes == 1)
    );
    assert!(
        store
            .operation_claim("rc", Duration::from_secs(60), 100, &[])
            .await
            .unwrap()
            .is_empty(),
        "all leased"
    );
    // Backoff: a deferred operation is not claimed before its time.
    let op = &a[0];
    let mut defer = Transition::new(op, State::Unknown, "ra");
    defer.release_lease = true;
    defer.next_attempt_in = Some(Duration::from_secs(60));
    store
        .operation_transition(defer, soon())
        .await
        .unwrap()
        .unwrap();
    assert!(
        store
            .operation_claim("rc", Duration::from_secs(60), 100, &[])
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        store
            .operation_claim_one(op.id, "rc", Duration::from_secs(60))
            .await
            .unwrap()
            .is_some(),
        "on request it is"
    );
    // Released leases are claimable at once.
    assert_eq!(
        store.operation_release_leases("rb", &[]).await.unwrap(),
        b.len() as u64
    );
    assert_eq!(
        store
            .operation_claim("rd", Duration::from_secs(60), 100, &[])
            .await
            .unwrap()
            .len(),
        b.len()
    );
    let log = store.operation_events(b[0].id).await.unwrap();
    assert!(log.iter().any(|e| e.kind == "handed_over"));
    // Claiming what somebody held is a takeover, logged; claiming a released
    // operation is a routine pass, not logged (its log would grow at every
    // pass of an operation that waits).
    let taken: Vec<_> = store
        .operation_events(a[1].id)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == "claimed")
        .collect();
    assert_eq!(taken.len(), 1, "{taken:?}");
    assert_eq!(taken[0].metadata["previous_holder"], "owner");
    assert!(
        !log.iter().any(|e| e.kind == "claimed" && e.replica == "rd"),
        "a released lease's claim is not logged"
    );
}

async fn leases_are_renewed_by_their_holder_and_never_taken_while_live(store: Arc<dyn Store>) {
    let mut live = new_op("live", Uuid::new_v4(), State::InProgress);
    live.lease_owner = "r1".into();
    live.lease_for = Duration::from_secs(2);
    let op = create(store.as_ref(), live).await;
    // Neither the reconciler of another replica nor one of the holder's
    // own replica may take a live lease.
    assert!(
        store
            .operation_claim_one(op.id, "r1", Duration::from_secs(2))
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        store
            .operation_claim_one(op.id, "r2", Duration::from_secs(2))
            .await
            .unwrap()
            .is_none()
    );
    // Its holder's heartbeat keeps it past its first expiry; another
    // replica's renewal does nothing.
    let lease = HeldLease {
        id: op.id,
        epoch: op.lease_epoch,
    };
    assert_eq!(
        store
            .operation_renew_leases("r2", &[lease], Duration::from_secs(60))
            .await
            .unwrap(),
        vec![(op.id, Renewal::Lost)]
    );
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        assert_eq!(
            store
                .operation_renew_leases("r1", &[lease], Duration::from_secs(2))
                .await
                .unwrap(),
            vec![(op.id, Renewal::Renewed)]
        );
        assert!(
            store
                .operation_claim("r2", Duration::from_secs(2), 10, &[])
                .await
                .unwrap()
                .iter()
                .all(|o| o.id != op.id),
            "a renewed lease is not claimed"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The heartbeat stops (the holder died): taken over within a lease.
    support::eventually(
        Duration::from_secs(10),
        "the lapsed lease is taken over",
        || {
            let store = store.clone();
            async move {
                store
                    .operation_claim("r2", Duration::from_secs(2), 10, &[])
                    .await
                    .unwrap()
                    .iter()
                    .any(|o| o.id == op.id)
            }
        },
    )
    .await;
}

/// After a takeover by the holder's own replica (a stall of its
/// heartbeat), the old epoch is lost although the owner's name is the
/// same: its renewal says so, and its writes change nothing; a claim passes
/// over what the replica's tasks hold; a decided lease reads `Decided`.
async fn renewals_and_writes_carry_the_epoch_and_a_claim_passes_over_held_work(
    store: Arc<dyn Store>,
) {
    let mut new = new_op("epoch", Uuid::new_v4(), State::InProgress);
    new.lease_owner = "r1".into();
    let op = create(store.as_ref(), new).await;
    let first = HeldLease {
        id: op.id,
        epoch: op.lease_epoch,
    };
    // Lapsed at once; r1's run still holds it: r1's reconciler leaves it.
    let claimed = store
        .operation_claim("r1", Duration::from_secs(60), 10, &[op.id])
        .await
        .unwrap();
    assert!(
        claimed.iter().all(|o| o.id != op.id),
        "claimed its own live run"
    );
    let taken = store
        .operation_claim("r1", Duration::from_secs(60), 10, &[])
        .await
        .unwrap();
    let taken = taken
        .into_iter()
        .find(|o| o.id == op.id)
        .expect("claimed once not held");
    assert_eq!(taken.lease_owner.as_deref(), Some("r1"));
    let second = HeldLease {
        id: op.id,
        epoch: taken.lease_epoch,
    };
    assert!(second.epoch > first.epoch);
    assert_eq!(
        store
            .operation_renew_leases("r1", &[first, second], Duration::from_secs(60))
            .await
            .unwrap()
            .into_iter()
            .collect::<std::collections::HashSet<_>>(),
        [(op.id, Renewal::Lost), (op.id, Renewal::Renewed)]
            .into_iter()
            .collect(),
        "the old epoch's renewal must be lost, the new one's renewed"
    );
    let stale = store
        .operation_transition(finish(&op, State::Failed), soon())
        .await
        .unwrap();
    assert!(
        stale.is_none(),
        "a write under the old epoch changed the row"
    );
    store
        .operation_transition(finish(&taken, State::Succeeded), soon())
        .await
        .unwrap()
        .expect("the new epoch's write");
    assert_eq!(
        store
            .operation_renew_leases("r1", &[second], Duration::from_secs(60))
            .await
            .unwrap(),
        vec![(op.id, Renewal::Decided)]
    );
}

/// A request leaves after its attempt is recorded (it may wait for a
/// connection slot or a token), but never after its lease ends (the send
/// gate): a takeover of an expired lease counts the settle window from
/// that end, so a late departure is still inside it. A released lease
/// keeps its stamp. (The model's `takeover_restamps` guard.)
async fn a_takeover_counts_the_settle_window_from_the_old_leases_end(store: Arc<dyn Store>) {
    let mut held = new_op("restamp-held", Uuid::new_v4(), State::InProgress);
    held.lease_owner = "r1".into();
    held.lease_for = Duration::from_secs(2);
    let held = create(store.as_ref(), held).await;
    let (stamp, lease_end) = (
        held.last_request_at.expect("the intent stamps its request"),
        held.lease_expires_at.expect("a leased intent"),
    );
    assert!(lease_end > stamp, "{lease_end} after {stamp}");
    let released = create(
        store.as_ref(),
        new_op("restamp-released", Uuid::new_v4(), State::InProgress),
    )
    .await;
    let mut t = Transition::new(&released, State::Unknown, "owner");
    t.release_lease = true;
    t.events = vec![NewEvent::new("unresolved", "left open")];
    let released = store
        .operation_transition(t, soon())
        .await
        .unwrap()
        .expect("the holder's write");
    assert_eq!(released.lease_owner, None);

    let claimed = Arc::new(std::sync::Mutex::new(Vec::new()));
    support::eventually(
        Duration::from_secs(30),
        "r1's lease expires and r2 takes both operations over",
        || {
            let (store, claimed) = (store.clone(), claimed.clone());
            async move {
                let now = store
                    .operation_claim("r2", Duration::from_secs(60), 10, &[])
                    .await
                    .unwrap();
                let mut got = claimed.lock().unwrap();
                got.extend(now);
                got.iter().any(|o| o.id == held.id)
            }
        },
    )
    .await;
    let claimed = claimed.lock().unwrap().clone();
    let taken = claimed.iter().find(|o| o.id == held.id).unwrap();
    assert_eq!(
        taken.last_request_at,
        Some(lease_end),
        "the settle window of a takeover counts from the old lease's end"
    );
    let again = claimed
        .iter()
        .find(|o| o.id == released.id)
        .expect("the released operation claimed");
    assert_eq!(
        again.last_request_at, released.last_request_at,
        "a released lease keeps its stamp"
    );
}

async fn keys_are_per_caller(store: Arc<dyn Store>) {
    let mine = create(store.as_ref(), new_op_of("alice", "shared", Uuid::new_v4())).await;
    let theirs = create(store.as_ref(), new_op_of("bob", "shared", Uuid::new_v4())).await;
    assert_ne!(
        mine.id, theirs.id,
        "another caller's key is another operation"
    );
    let anonymous = create(
        store.as_ref(),
        NewOperation {
            key: CallerKey::parse(None, "shared").unwrap().into(),
            ..new_op("shared", Uuid::new_v4(), State::InProgress)
        },
    )
    .await;
    for (caller, id) in [
        (Some("alice"), mine.id),
        (Some("bob"), theirs.id),
        (None, anonymous.id),
    ] {
        assert_eq!(
            store
                .operation_get_by_key(&crate::support::ck(caller, "shared"))
                .await
                .unwrap()
                .unwrap()
                .id,
            id
        );
    }
    assert!(
        store
            .operation_get_by_key(&crate::support::ck(Some("carol"), "shared"))
            .await
            .unwrap()
            .is_none()
    );
    // A replay joins only its own caller's operation.
    match store
        .operation_create(
            NewOperation {
                id: Uuid::now_v7(),
                ..new_op_of("bob", "shared", theirs.volume_id)
            },
            soon(),
        )
        .await
        .unwrap()
    {
        CreateOutcome::Existing(e) => assert_eq!(e.id, theirs.id),
        other => panic!("{other:?}"),
    }
    let page = store
        .operation_list(
            &OperationFilter {
                caller: Some("alice".into()),
                ..Default::default()
            },
            None,
            10,
        )
        .await
        .unwrap();
    assert_eq!(
        page.operations.iter().map(|o| o.id).collect::<Vec<_>>(),
        vec![mine.id]
    );
}

async fn verification_is_handed_out_once_in_decision_order(store: Arc<dyn Store>) {
    let mut decided = Vec::new();
    for i in 0..5 {
        let op = create(
            store.as_ref(),
            new_op(&format!("v{i}"), Uuid::new_v4(), State::InProgress),
        )
        .await;
        let mut t = finish(&op, State::Succeeded);
        // The last one implies nothing a look could contradict.
        t.verify_expect = (i < 4).then_some(true);
        decided.push(
            store
                .operation_transition(t, soon())
                .await
                .unwrap()
                .unwrap(),
        );
    }
    // Not before its delay...
    assert!(
        store
            .verification_next(0, Duration::from_secs(60), 10)
            .await
            .unwrap()
            .is_empty()
    );
    // The backlog (for /metrics) is the oldest due decision not taken yet,
    // per stage, and taking reads nothing of it.
    assert_eq!(
        store
            .verification_backlog(0, Duration::from_secs(60))
            .await
            .unwrap(),
        None,
        "not due yet"
    );
    let oldest = decided[0].completed_at;
    assert_eq!(
        store.verification_backlog(0, Duration::ZERO).await.unwrap(),
        oldest
    );
    // ...then each once, oldest decision first, stage by stage.
    let first = store.verification_next(0, Duration::ZERO, 3).await.unwrap();
    assert_eq!(
        store.verification_backlog(0, Duration::ZERO).await.unwrap(),
        decided[3].completed_at,
        "the oldest not taken yet"
    );
    assert_eq!(
        store.verification_backlog(1, Duration::ZERO).await.unwrap(),
        oldest,
        "each stage its own"
    );
    let rest = store
        .verification_next(0, Duration::ZERO, 10)
        .await
        .unwrap();
    assert_eq!(
        store.verification_backlog(0, Duration::ZERO).await.unwrap(),
        None,
        "up to date"
    );
    assert_eq!(
        first.iter().chain(&rest).map(|o| o.id).collect::<Vec<_>>(),
        decided[..4].iter().map(|o| o.id).collect::<Vec<_>>()
    );
    assert!(
        store
            .verification_next(0, Duration::ZERO, 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        store
            .verification_next(1, Duration::ZERO, 10)
            .await
            .unwrap()
            .len(),
        4,
        "the second stage has a cursor of its own"
    );
    let op = &decided[0];
    store
        .operation_mark_drift(op.id, "r0", vec![NewEvent::new("drift_detected", "late")])
        .await
        .unwrap();
    let page = store
        .operation_list(
            &OperationFilter {
                drifted_only: true,
                ..Default::default()
            },
            None,
            10,
        )
        .await
        .unwrap();
    assert_eq!(page.operations.len(), 1);
    assert!(page.operations[0].drifted);
    // The verifier asks which volumes had a later operation.
    let later = create(
        store.as_ref(),
        new_op("v-later", op.volume_id, State::InProgress),
    )
    .await;
    let latest = store
        .volumes_latest_operation(&[op.volume_id, decided[1].volume_id, Uuid::new_v4()])
        .await
        .unwrap();
    assert_eq!(latest.len(), 2);
    let of_first = latest.iter().find(|(v, _)| *v == op.volume_id).unwrap().1;
    assert_eq!(of_first, later.created_at);
}

async fn escalated_operations_are_left_to_people(store: Arc<dyn Store>) {
    let op = create(
        store.as_ref(),
        new_op("esc", Uuid::new_v4(), State::Unknown),
    )
    .await;
    let claimed = store
        .operation_claim("r0", Duration::from_secs(60), 10, &[])
        .await
        .unwrap();
    let op = claimed.into_iter().find(|o| o.id == op.id).unwrap();
    let mut t = Transition::new(&op, State::Unknown, "r0");
    t.release_lease = true;
    t.escalation = Some("could not observe it".into());
    let escalated = store
        .operation_transition(t, soon())
        .await
        .unwrap()
        .unwrap();
    assert!(escalated.escalated_at.is_some());
    assert_eq!(
        escalated.escalation.as_deref(),
        Some("could not observe it")
    );
    assert!(
        store
            .operation_claim("r1", Duration::from_secs(60), 10, &[])
            .await
            .unwrap()
            .iter()
            .all(|o| o.id != op.id),
        "the reconciler leaves it be"
    );
    let listed = store
        .operation_list(
            &OperationFilter {
                escalated_only: true,
                ..Default::default()
            },
            None,
            10,
        )
        .await
        .unwrap();
    assert_eq!(listed.operations.len(), 1);
    assert!(
        store
            .operation_claim_one(op.id, "r1", Duration::from_secs(60))
            .await
            .unwrap()
            .is_some(),
        "an operator's reconcile still may"
    );
}

async fn event_times_are_the_databases_less_how_long_ago(store: Arc<dyn Store>) {
    let mut new = new_op("ago", Uuid::new_v4(), State::InProgress);
    let mut old = NewEvent::new("request_sent", "an hour ago");
    old.ago = Duration::from_secs(3600);
    new.events = vec![old, NewEvent::new("recorded", "now")];
    let op = create(store.as_ref(), new).await;
    let log = store.operation_events(op.id).await.unwrap();
    let gap = log[1].at - log[0].at;
    assert!(
        (gap - chrono::Duration::seconds(3600)).num_seconds().abs() <= 1,
        "{gap:?}"
    );
    let db_now = store.now().await.unwrap();
    assert!((db_now - log[1].at).num_seconds().abs() <= 5);
}

async fn an_operator_decision_fences_out_workers(store: Arc<dyn Store>) {
    let op = create(store.as_ref(), new_op("o", Uuid::new_v4(), State::Unknown)).await;
    let decided = store
        .operation_resolve_by_operator(&volume_reconciler::store::OperatorDecision::new(
            op.id,
            State::Failed,
            "checked by hand",
            "r0",
            Some("alice"),
        ))
        .await
        .unwrap();
    assert_eq!(
        (decided.state, decided.resolution),
        (State::Failed, Some(Resolution::Operator))
    );
    assert_eq!(
        decided.last_error.as_ref().unwrap().reason.as_str(),
        "OPERATOR_RESOLVED"
    );
    assert!(
        store
            .operation_transition(finish(&op, State::Succeeded), soon())
            .await
            .unwrap()
            .is_none()
    );
    assert!(matches!(
        store
            .operation_resolve_by_operator(&volume_reconciler::store::OperatorDecision::new(
                op.id,
                State::Succeeded,
                "again",
                "r0",
                None
            ))
            .await,
        Err(StoreError::AlreadyTerminal { .. })
    ));
    assert!(matches!(
        store
            .operation_resolve_by_operator(&volume_reconciler::store::OperatorDecision::new(
                Uuid::new_v4(),
                State::Succeeded,
                "x",
                "r0",
                None
            ))
            .await,
        Err(StoreError::NotFound(_))
    ));
    let audit = store
        .operation_events(op.id)
        .await
        .unwrap()
        .into_iter()
        .find(|e| e.kind == "operator_resolved")
        .unwrap();
    assert_eq!(
        (audit.detail.as_str(), audit.metadata["caller"].as_str()),
        ("checked by hand", "alice")
    );
}

async fn pages_are_newest_first_and_filtered(store: Arc<dyn Store>) {
    let mut ids = Vec::new();
    for i in 0..7 {
        ids.push(
            create(
                store.as_ref(),
                new_op(&format!("p{i}"), Uuid::new_v4(), State::Unknown),
            )
            .await
            .id,
        );
    }
    let first = store
        .operation_list(&Default::default(), None, 3)
        .await
        .unwrap();
    assert_eq!(
        first.operations.iter().map(|o| o.id).collect::<Vec<_>>(),
        vec![ids[6], ids[5], ids[4]]
    );
    let second = store
        .operation_list(&Default::default(), first.next_cursor, 3)
        .await
        .unwrap();
    assert_eq!(second.operations[0].id, ids[3]);
    let third = store
        .operation_list(&Default::default(), second.next_cursor, 3)
        .await
        .unwrap();
    assert_eq!(third.operations.len(), 1);
    assert!(third.next_cursor.is_none());
    let only = store
        .operation_list(
            &OperationFilter {
                state: Some(State::Succeeded),
                ..Default::default()
            },
            None,
            10,
        )
        .await
        .unwrap();
    assert!(only.operations.is_empty());
    let by_volume = store
        .operation_list(
            &OperationFilter {
                volume_id: Some(first.operations[0].volume_id),
                ..Default::default()
            },
            None,
            10,
        )
        .await
        .unwrap();
    assert_eq!(by_volume.operations.len(), 1);
    let counts = store.operation_count_by_state().await.unwrap();
    assert_eq!(
        counts.iter().find(|c| c.state == "unknown").unwrap().count,
        7
    );
}

async fn changes_are_notified(store: Arc<dyn Store>) {
    let mut rx = store.subscribe();
    let op = create(
        store.as_ref(),
        new_op("n", Uuid::new_v4(), State::InProgress),
    )
    .await;
    store
        .operation_transition(finish(&op, State::Succeeded), soon())
        .await
        .unwrap()
        .unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if rx.recv().await.unwrap() == op.id {
                return;
            }
        }
    })
    .await;
    assert!(got.is_ok(), "a change notification arrives");
    store.ping().await.unwrap();
}

async fn every_decision_of_a_concurrent_burst_is_notified(store: Arc<dyn Store>) {
    let ops = create_in_progress(store.as_ref(), "burst-", 40).await;
    let mut rx = store.subscribe();
    let mut tasks = Vec::new();
    for op in ops {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            store
                .operation_transition(finish(&op, State::Succeeded), soon())
                .await
                .unwrap()
                .unwrap()
                .id
        }));
    }
    let mut want = std::collections::HashSet::new();
    for t in tasks {
        want.insert(t.await.unwrap());
    }
    // Group commit notifies once per batch with every id in it.
    let all = tokio::time::timeout(Duration::from_secs(10), async {
        while !want.is_empty() {
            let id = rx.recv().await.unwrap();
            want.remove(&id);
        }
    })
    .await;
    assert!(
        all.is_ok(),
        "every operation of the burst is notified by id"
    );
}

async fn appended_events_land_in_order_even_when_batched(store: Arc<dyn Store>) {
    let ops = create_in_progress(store.as_ref(), "append-", 20).await;
    // Concurrent appends (as a verification round makes them) share the
    // group commit; each operation's events keep their order.
    let mut tasks = Vec::new();
    for op in &ops {
        let (store, id) = (store.clone(), op.id);
        tasks.push(tokio::spawn(async move {
            let events = vec![
                NewEvent::new("verified", "first").with("n", 1),
                NewEvent::new("verified", "second").with("n", 2),
            ];
            store.operation_append_events(id, "r9", events).await
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    for op in &ops {
        let events = store.operation_events(op.id).await.unwrap();
        let appended: Vec<_> = events
            .iter()
            .filter(|e| e.kind == "verified")
            .map(|e| {
                (
                    e.detail.as_str(),
                    e.replica.as_str(),
                    e.metadata.get("n").cloned(),
                )
            })
            .collect();
        assert_eq!(
            appended,
            vec![
                ("first", "r9", Some("1".to_string())),
                ("second", "r9", Some("2".to_string()))
            ],
            "operation {}",
            op.id
        );
    }
    // An append to an operation that does not exist is refused, not lost
    // silently and not taking the batch down with it.
    let missing = store
        .operation_append_events(Uuid::new_v4(), "r9", vec![NewEvent::new("verified", "x")])
        .await;
    assert!(missing.is_err(), "appending to a missing operation fails");
}

/// The same write twice, as the group commit re-runs a batch whose
/// acknowledgement was lost: applied once, answered with its row both
/// times; a different write is still fenced.
/// What a write answers with is the row as a read then finds it: the
/// writes return only what the database set and build the rest from what
/// they wrote (an intent; a transition on its base), so a column they
/// forget would differ here. Each kind of change: an intent with and
/// without an attempt, a retry that counts one and records an error, an
/// escalation, a decision with its attachment and what a later look should
/// find, one that releases the lease.
async fn what_a_write_answers_is_the_row_a_read_finds(store: Arc<dyn Store>) {
    let read = |id| {
        let store = store.clone();
        async move { store.operation_get(id).await.unwrap().expect("recorded") }
    };
    let pending = create(
        store.as_ref(),
        new_op("answers-pending", Uuid::new_v4(), State::Pending),
    )
    .await;
    assert_eq!(pending, read(pending.id).await, "a pending intent");
    let op = create(
        store.as_ref(),
        new_op("answers", Uuid::new_v4(), State::InProgress),
    )
    .await;
    assert_eq!(op, read(op.id).await, "an intent sent at once");

    let mut retry = Transition::new(&op, State::InProgress, "r0");
    retry.add_attempt = true;
    retry.request_sent = true;
    retry.last_error = Some(Some(OperationError::new(
        volume_reconciler::domain::Reason::NovaTimeout,
        "503 from Nova",
    )));
    retry.next_attempt_in = Some(Duration::from_millis(250));
    retry.events = vec![NewEvent::new("request_sent", "again").with("attempt", 2)];
    let op = store
        .operation_transition(retry, soon())
        .await
        .unwrap()
        .expect("applies");
    assert_eq!(op, read(op.id).await, "a retry with its error");

    let mut escalate = Transition::new(&op, State::Unknown, "r0");
    escalate.escalation = Some("needs a person".into());
    escalate.last_error = Some(None);
    let op = store
        .operation_transition(escalate, soon())
        .await
        .unwrap()
        .expect("applies");
    assert_eq!(op, read(op.id).await, "an escalation");

    let mut decide = finish(&op, State::Succeeded);
    decide.attachment = Some(volume_reconciler::domain::AttachmentInfo {
        id: "att-1".into(),
        device: Some("/dev/vdc".into()),
        tag: Some("data".into()),
        delete_on_termination: true,
    });
    decide.verify_expect = Some(true);
    let done = store
        .operation_transition(decide, soon())
        .await
        .unwrap()
        .expect("decided");
    assert!(done.completed_at.is_some() && done.lease_owner.is_none());
    assert_eq!(done, read(done.id).await, "a decision");
}

async fn a_write_made_twice_applies_once(store: Arc<dyn Store>) {
    let new = new_op("twice", Uuid::new_v4(), State::InProgress);
    let first = create(store.as_ref(), new.clone()).await;
    let again = create(store.as_ref(), new).await;
    assert_eq!(again.id, first.id, "the repeated intent is the same row");

    let mut retry = Transition::new(&first, State::InProgress, "r0");
    retry.add_attempt = true;
    retry.request_sent = true;
    retry.events = vec![NewEvent::new("request_sent", "again").with("attempt", 2)];
    let a = store
        .operation_transition(retry.clone(), soon())
        .await
        .unwrap()
        .expect("applies");
    let b = store
        .operation_transition(retry, soon())
        .await
        .unwrap()
        .expect("a repeated write answers with the row it left");
    assert_eq!((a.attempts, b.attempts), (2, 2), "the attempt counted once");

    let decide = finish(&b, State::Succeeded);
    let c = store
        .operation_transition(decide.clone(), soon())
        .await
        .unwrap()
        .expect("decided");
    let d = store
        .operation_transition(decide, soon())
        .await
        .unwrap()
        .expect("a repeated decision answers with the decided row");
    assert_eq!((c.state, d.state), (State::Succeeded, State::Succeeded));
    assert_eq!(c.completed_at, d.completed_at);
    assert!(
        store
            .operation_transition(finish(&b, State::Failed), soon())
            .await
            .unwrap()
            .is_none(),
        "another decision is still fenced out"
    );
    let kinds: Vec<String> = store
        .operation_events(first.id)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .collect();
    assert_eq!(
        kinds,
        ["recorded", "request_sent", "request_sent", "resolved"],
        "one set of events"
    );

    // A write repeated after the lease moved on (a reconciler claimed the
    // operation meanwhile) is fenced out, not taken for its own effect.
    let op = create(
        store.as_ref(),
        new_op("moved", Uuid::new_v4(), State::InProgress),
    )
    .await;
    let t = Transition::new(&op, State::Unknown, "r0");
    store
        .operation_transition(t.clone(), soon())
        .await
        .unwrap()
        .expect("applies");
    store
        .operation_claim_one(op.id, "reconciler", Duration::from_secs(60))
        .await
        .unwrap()
        .expect("claimed");
    assert!(
        store
            .operation_transition(t, soon())
            .await
            .unwrap()
            .is_none(),
        "fenced by the new epoch"
    );
}

/// The ledger by (state, resolution), read from its rows (every page): what
/// the kept counts must equal.
async fn counted_from_rows(store: &dyn Store) -> BTreeMap<(String, String), i64> {
    let mut out = BTreeMap::new();
    let mut cursor = None;
    loop {
        let page = store
            .operation_list(&OperationFilter::default(), cursor, 500)
            .await
            .unwrap();
        for op in &page.operations {
            let res = op.resolution.map(|r| r.as_str().to_string());
            *out.entry((op.state.as_str().to_string(), res.unwrap_or_default()))
                .or_insert(0) += 1;
        }
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => return out,
        }
    }
}

async fn kept_counts(store: &dyn Store) -> BTreeMap<(String, String), i64> {
    let counts = store.operation_count_by_state().await.unwrap();
    counts
        .into_iter()
        .map(|c| ((c.state, c.resolution.unwrap_or_default()), c.count))
        .collect()
}

async fn assert_counts_exact(store: &dyn Store, when: &str) {
    assert_eq!(
        kept_counts(store).await,
        counted_from_rows(store).await,
        "{when}"
    );
}

async fn state_counts_follow_every_change(store: Arc<dyn Store>) {
    assert!(kept_counts(store.as_ref()).await.is_empty(), "empty ledger");
    let mut ops = Vec::new();
    for (i, state) in [State::Pending, State::InProgress, State::Unknown]
        .into_iter()
        .cycle()
        .take(12)
        .enumerate()
    {
        ops.push(
            create(
                store.as_ref(),
                new_op(&format!("c{i}"), Uuid::new_v4(), state),
            )
            .await,
        );
    }
    // A replay joins the existing row: nothing more to count.
    let replay = NewOperation {
        id: Uuid::now_v7(),
        ..new_op("c0", ops[0].volume_id, State::Pending)
    };
    assert!(matches!(
        store.operation_create(replay, soon()).await.unwrap(),
        CreateOutcome::Existing(_)
    ));
    assert_counts_exact(store.as_ref(), "after the intents").await;
    // Claims change leases, not states.
    let claimed = store
        .operation_claim("rc", Duration::from_secs(60), 100, &[])
        .await
        .unwrap();
    assert!(!claimed.is_empty());
    assert_counts_exact(store.as_ref(), "after a claim").await;
    // Concurrent decisions (group-committed together on PostgreSQL), each
    // under the epoch its claim took.
    let decide = claimed.iter().take(6).enumerate().map(|(i, op)| {
        let store = store.clone();
        let state = if i % 2 == 0 {
            State::Succeeded
        } else {
            State::Failed
        };
        let t = finish(op, state);
        async move { store.operation_transition(t, soon()).await.unwrap() }
    });
    let decided = futures_util::future::join_all(decide).await;
    assert!(decided.iter().all(Option::is_some));
    assert_counts_exact(store.as_ref(), "after concurrent decisions").await;
    // Read twice in a row (the second read finds the first's fold).
    assert_counts_exact(store.as_ref(), "read again").await;
    let open = claimed.iter().skip(6).find(|o| o.state == State::Unknown);
    let open = open.expect("an UNKNOWN operation left open");
    store
        .operation_resolve_by_operator(&volume_reconciler::store::OperatorDecision::new(
            open.id,
            State::Failed,
            "checked",
            "r0",
            None,
        ))
        .await
        .unwrap();
    assert_counts_exact(store.as_ref(), "after an operator's decision").await;
    let released = store.operation_release_leases("rc", &[]).await.unwrap();
    assert!(released > 0);
    assert_counts_exact(store.as_ref(), "after releasing leases").await;
}

async fn the_oldest_unknown_operation_is_found(store: Arc<dyn Store>) {
    assert_eq!(store.oldest_unknown_since().await.unwrap(), None);
    let first = create(store.as_ref(), new_op("u1", Uuid::new_v4(), State::Unknown)).await;
    // Others, later, of every open state: the oldest UNKNOWN stays the first.
    for (i, state) in [
        State::Unknown,
        State::Pending,
        State::InProgress,
        State::Unknown,
    ]
    .into_iter()
    .enumerate()
    {
        create(
            store.as_ref(),
            new_op(&format!("u{}", i + 2), Uuid::new_v4(), state),
        )
        .await;
    }
    let since = first.last_request_at.unwrap_or(first.created_at);
    assert_eq!(store.oldest_unknown_since().await.unwrap(), Some(since));
    store
        .operation_resolve_by_operator(&volume_reconciler::store::OperatorDecision::new(
            first.id,
            State::Failed,
            "checked",
            "r0",
            None,
        ))
        .await
        .unwrap();
    let next = store.oldest_unknown_since().await.unwrap().unwrap();
    assert!(next > since, "{next} after {since}");
}

/// A burst of intents written together (one batch on PostgreSQL) where
/// some rows conflict: replays of a recorded key, a second operation on a
/// busy volume, the same new key twice. Each conflicting row is answered
/// for itself (its existing operation, or the busy volume) and every other
/// row of the burst is recorded (PostgreSQL writes a batch without `ON
/// CONFLICT` first and, on a unique violation, again with it).
async fn a_burst_of_intents_with_conflicts_records_every_other_row(store: Arc<dyn Store>) {
    let busy = Uuid::new_v4();
    let recorded = create(
        store.as_ref(),
        new_op("burst-recorded", busy, State::InProgress),
    )
    .await;
    let mut news = Vec::new();
    for i in 0..30 {
        news.push((
            format!("fresh-{i}"),
            new_op(&format!("burst-{i}"), Uuid::new_v4(), State::InProgress),
        ));
        if i % 10 == 0 {
            news.push((
                "replay".into(),
                new_op("burst-recorded", busy, State::InProgress),
            ));
            news.push((
                "busy".into(),
                new_op(&format!("burst-busy-{i}"), busy, State::InProgress),
            ));
        }
    }
    let twice = Uuid::new_v4();
    news.push((
        "twice".into(),
        new_op("burst-twice", twice, State::InProgress),
    ));
    news.push((
        "twice".into(),
        new_op("burst-twice", twice, State::InProgress),
    ));
    let writes = news.into_iter().map(|(what, new)| {
        let store = store.clone();
        async move { (what, store.operation_create(new, soon()).await) }
    });
    let mut twice_ids = Vec::new();
    for (what, outcome) in futures_util::future::join_all(writes).await {
        match (what.as_str(), outcome) {
            (w, Ok(CreateOutcome::Created(_))) if w.starts_with("fresh-") => {}
            ("replay", Ok(CreateOutcome::Existing(e))) => assert_eq!(e.id, recorded.id),
            ("busy", Err(StoreError::VolumeBusy { operation_id, .. })) => {
                assert_eq!(operation_id, recorded.id)
            }
            ("twice", Ok(CreateOutcome::Created(op) | CreateOutcome::Existing(op))) => {
                twice_ids.push(op.id)
            }
            (what, other) => panic!("{what}: {other:?}"),
        }
    }
    assert_eq!(twice_ids.len(), 2);
    assert_eq!(
        twice_ids[0], twice_ids[1],
        "a key written twice at once is one operation"
    );
    let page = store
        .operation_list(&OperationFilter::default(), None, 100)
        .await
        .unwrap();
    assert_eq!(
        page.operations.len(),
        1 + 30 + 1,
        "every row that did not conflict, once"
    );
}

/// A FAILED operation whose reason frees its key (Nova never acted on it,
/// and its code says retry) saves no result: a replay of the key starts a
/// new operation under it, the old one keeps its row (and its key's text)
/// and the key names the new one; while the volume is busy with another
/// operation the replay is VOLUME_BUSY and the key stays the old one's. A
/// decision that is the key's for good is joined as ever.
async fn a_key_that_saved_no_result_is_handed_on(store: Arc<dyn Store>) {
    use volume_reconciler::domain::{OperationError, Reason};
    let v = Uuid::new_v4();
    let old = create(store.as_ref(), new_op("freed", v, State::InProgress)).await;
    let mut refused = finish(&old, State::Failed);
    refused.last_error = Some(Some(OperationError::new(Reason::NovaConflict, "409")));
    store
        .operation_transition(refused, soon())
        .await
        .unwrap()
        .unwrap();
    // Another operation holds the volume: busy, nothing handed on.
    let other = create(store.as_ref(), new_op("other", v, State::InProgress)).await;
    match store
        .operation_create(new_op("freed", v, State::InProgress), soon())
        .await
    {
        Err(StoreError::VolumeBusy { operation_id, .. }) => assert_eq!(operation_id, other.id),
        other => panic!("{other:?}"),
    }
    let key = crate::support::ck(Some("tester"), "freed");
    assert_eq!(
        store.operation_get_by_key(&key).await.unwrap().unwrap().id,
        old.id
    );
    store
        .operation_transition(finish(&other, State::Succeeded), soon())
        .await
        .unwrap()
        .unwrap();
    let new = create(store.as_ref(), new_op("freed", v, State::InProgress)).await;
    assert_ne!(new.id, old.id);
    assert_eq!(
        store.operation_get_by_key(&key).await.unwrap().unwrap().id,
        new.id
    );
    let kept = store.operation_get(old.id).await.unwrap().unwrap();
    assert_eq!(
        (kept.state, kept.idempotency_key.as_str()),
        (State::Failed, "freed")
    );
    for id in [old.id, new.id] {
        let events = store.operation_events(id).await.unwrap();
        assert!(
            events.iter().any(|e| e.kind == "key_handed_on"),
            "{id}: {events:#?}"
        );
    }
    // A success is the key's for good: joined.
    store
        .operation_transition(finish(&new, State::Succeeded), soon())
        .await
        .unwrap()
        .unwrap();
    match store
        .operation_create(new_op("freed", v, State::InProgress), soon())
        .await
        .unwrap()
    {
        CreateOutcome::Existing(e) => assert_eq!(e.id, new.id),
        other => panic!("{other:?}"),
    }
}

/// An Ensure call's intent has no caller's key: it joins the volume's open
/// operation of its own identity (caller, server, action and parameters)
/// and no other; the key column holds its own id, read back empty.
async fn an_ensure_intent_joins_its_identity_only(store: Arc<dyn Store>) {
    use volume_reconciler::domain::{Caller, OpKey};
    let v = Uuid::new_v4();
    let ensure = |caller: &str| NewOperation {
        key: OpKey::Ensure(Caller::named(caller)),
        id: Uuid::now_v7(),
        ..new_op("unused", v, State::InProgress)
    };
    let first = create(store.as_ref(), ensure("tester")).await;
    assert!(
        first.ensure && first.idempotency_key.is_empty(),
        "{first:?}"
    );
    let read = store.operation_get(first.id).await.unwrap().unwrap();
    assert!(read.ensure && read.idempotency_key.is_empty(), "{read:?}");
    match store
        .operation_create(ensure("tester"), soon())
        .await
        .unwrap()
    {
        CreateOutcome::Existing(e) => assert_eq!(e.id, first.id, "its identity, joined"),
        other => panic!("{other:?}"),
    }
    match store.operation_create(ensure("someone-else"), soon()).await {
        Err(StoreError::VolumeBusy { operation_id, .. }) => assert_eq!(operation_id, first.id),
        other => panic!("another caller's identity must not join: {other:?}"),
    }
    let mut detach = ensure("tester");
    detach.action = Action::Detach;
    match store.operation_create(detach, soon()).await {
        Err(StoreError::VolumeBusy { .. }) => {}
        other => panic!("another state must not join: {other:?}"),
    }
}

/// Claims `id` for `replica` as soon as its lease has expired (the
/// database's clock: asked until it has).
async fn claim_once(
    store: &dyn Store,
    id: Uuid,
    replica: &str,
    lease: Duration,
) -> volume_reconciler::domain::Operation {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let claimed = store
            .operation_claim(replica, lease, 10, &[])
            .await
            .unwrap();
        if let Some(op) = claimed.into_iter().find(|o| o.id == id) {
            return op;
        }
        assert!(
            Instant::now() < until,
            "{id} was never claimed by {replica}"
        );
        tokio::task::yield_now().await;
    }
}

/// An attempt marked as never sent changes the row only while it is the
/// row's last attempt, recorded under that epoch; a claim of an expired
/// lease moves the settle window only when an attempt was recorded under
/// it and not marked unsent.
async fn an_unsent_mark_and_the_takeovers_restamp_follow_the_attempts_epoch(store: Arc<dyn Store>) {
    let op = create(
        store.as_ref(),
        NewOperation {
            lease_for: Duration::from_millis(1),
            ..new_op("unsent", Uuid::new_v4(), State::InProgress)
        },
    )
    .await;
    assert!(!op.attempt_unsent);
    let stamp = op.last_request_at.unwrap();
    let mark = |attempts| store.operation_mark_unsent(op.id, 1, attempts, "r0");
    // Not its last attempt: nothing.
    assert!(!mark(2).await.unwrap());
    assert!(mark(1).await.unwrap());
    assert!(!mark(1).await.unwrap(), "once");
    let taken = claim_once(store.as_ref(), op.id, "r1", Duration::from_millis(1)).await;
    assert!(taken.attempt_unsent && taken.nothing_sent());
    assert_eq!(
        taken.last_request_at,
        Some(stamp),
        "an unsent attempt is not restamped"
    );
    // The claim's epoch records nothing: the next takeover restamps nothing.
    let again = claim_once(store.as_ref(), op.id, "r2", Duration::from_secs(2)).await;
    assert_eq!(again.last_request_at, Some(stamp));
    // A new attempt under the new epoch: the mark is of an attempt that is
    // no longer the last.
    let mut retry = Transition::new(&again, State::InProgress, "r2");
    retry.add_attempt = true;
    retry.request_sent = true;
    let retried = store
        .operation_transition(retry, soon())
        .await
        .unwrap()
        .unwrap();
    assert!(!retried.attempt_unsent);
    let read = store.operation_get(op.id).await.unwrap().unwrap();
    assert!(!read.attempt_unsent && !read.nothing_sent(), "{read:?}");
    assert!(!mark(1).await.unwrap());
    // A takeover of an epoch that recorded an attempt restamps it: to the
    // end of that epoch's lease, the latest its request could have left.
    let expired = claim_once(store.as_ref(), op.id, "r3", Duration::from_secs(30)).await;
    assert_eq!(
        expired.last_request_at, again.lease_expires_at,
        "{expired:?}"
    );
}

macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod postgres {
            $( #[tokio::test] async fn $name() { super::$name(super::pg_store().await).await } )*
        }
        mod sqlite {
            $( #[tokio::test] async fn $name() { super::$name(super::sqlite_store().await).await } )*
        }
    };
}

conformance!(
    keys_are_unique_and_replays_join,
    one_open_operation_per_volume,
    transitions_are_fenced_and_terminal_is_final,
    claims_lease_each_operation_to_one_replica,
    leases_are_renewed_by_their_holder_and_never_taken_while_live,
    renewals_and_writes_carry_the_epoch_and_a_claim_passes_over_held_work,
    a_takeover_counts_the_settle_window_from_the_old_leases_end,
    keys_are_per_caller,
    verification_is_handed_out_once_in_decision_order,
    escalated_operations_are_left_to_people,
    event_times_are_the_databases_less_how_long_ago,
    an_operator_decision_fences_out_workers,
    pages_are_newest_first_and_filtered,
    changes_are_notified,
    every_decision_of_a_concurrent_burst_is_notified,
    appended_events_land_in_order_even_when_batched,
    a_write_made_twice_applies_once,
    what_a_write_answers_is_the_row_a_read_finds,
    state_counts_follow_every_change,
    the_oldest_unknown_operation_is_found,
    a_burst_of_intents_with_conflicts_records_every_other_row,
    a_key_that_saved_no_result_is_handed_on,
    an_ensure_intent_joins_its_identity_only,
    an_unsent_mark_and_the_takeovers_restamp_follow_the_attempts_epoch,
);

#[tokio::test]
async fn a_second_process_on_the_same_embedded_file_is_refused_clearly() {
    let path = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("vr-excl-{}.db", Uuid::new_v4().simple()));
    let url = format!("sqlite://{}", path.display());
    let first = volume_reconciler::store::open(&url, 1).await.unwrap();
    let err = match volume_reconciler::store::open(&url, 1).await {
        Ok(_) => panic!("a second opener must be refused"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("in use by another process") && err.contains("PostgreSQL"),
        "{err}"
    );
    first.close().await;
    // Free again once the first closed. Bounded retries, not one try: this
    // test binary also spawns PostgreSQL processes, and a child forked at
    // the wrong moment holds a copy of the lock's descriptor until it execs
    // (flock belongs to the open file, and every copy keeps it).
    support::eventually(
        Duration::from_secs(10),
        "the embedded store opens again once the first closed",
        || {
            let u = url.clone();
            async move {
                match volume_reconciler::store::open(&u, 1).await {
                    Ok(again) => {
                        again.close().await;
                        true
                    }
                    // Still held (by a forked child, see above): try again.
                    Err(_) => false,
                }
            }
        },
    )
    .await;
}

/// PostgreSQL only: the ledger writers keep connections of their own. When
/// the database drops them (restart, failover, a proxy's idle timeout), the
/// next writes still land, once each, and nobody sees an error.
#[tokio::test]
async fn postgres_writes_survive_their_connections_being_killed() {
    support::init_logs();
    let url = support::pg::fresh_database().await;
    let store = volume_reconciler::store::open(&url, 4).await.unwrap();
    let a = create(
        store.as_ref(),
        new_op("killed-a", Uuid::new_v4(), State::InProgress),
    )
    .await;

    let mut admin = support::pg::Admin::connect(&url).await;
    let killed = admin
        .number(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid()
               AND application_name = 'volume-reconciler') k",
        )
        .await;
    assert!(killed >= 1, "the store's connections were found and killed");

    let decided = store
        .operation_transition(finish(&a, State::Succeeded), soon())
        .await
        .expect("a decision is written despite the dead connection")
        .expect("and it applies");
    assert_eq!(decided.state, State::Succeeded);
    let b = create(
        store.as_ref(),
        new_op("killed-b", Uuid::new_v4(), State::InProgress),
    )
    .await;
    assert_eq!(b.idempotency_key, "killed-b");

    let resolved = store
        .operation_events(a.id)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == "resolved")
        .count();
    assert_eq!(resolved, 1, "the decision's events are written once");
    let rows = admin.number("SELECT count(*) FROM operations").await;
    assert_eq!(rows, 2, "each intent written once");
}

/// An intent that runs on the server past the time it had to be recorded
/// by (`record_by`: its statement held in flight until then, or the
/// server's clock ahead of the service's bound of it) inserts nothing, and
/// its writer is told why (not that the volume was busy), as a write that
/// certainly did not happen; the key is free for a new intent.
#[tokio::test]
async fn postgres_an_intent_run_past_its_record_by_time_is_not_recorded_and_says_why() {
    let store = pg_store().await;
    let now = store.now().await.unwrap();
    let late = NewOperation {
        record_by: Some(now - chrono::Duration::seconds(1)),
        ..new_op("late", Uuid::new_v4(), State::InProgress)
    };
    let refused = store
        .operation_create(late, soon())
        .await
        .expect_err("an intent past its record-by time");
    assert!(
        refused.to_string().contains("recorded by") && !refused.may_have_written(),
        "{refused}"
    );
    assert!(
        store
            .operation_get_by_key(&crate::support::ck(Some("tester"), "late"))
            .await
            .unwrap()
            .is_none()
    );
    let again = NewOperation {
        record_by: Some(now + chrono::Duration::seconds(60)),
        ..new_op("late", Uuid::new_v4(), State::InProgress)
    };
    let recorded = create(store.as_ref(), again).await;
    assert_eq!(recorded.idempotency_key, "late");
}

/// An intent absent from the ledger is given up for good only once no
/// statement of it can still insert it: the database's clock is past its
/// `record_by` by the statement bound, and no transaction begun before
/// `record_by` that wrote anything is still running (one that inserted it
/// may still be committing: a slow flush, a synchronous standby away).
#[tokio::test]
async fn postgres_an_absent_intent_is_settled_only_once_no_writer_older_than_its_record_by_runs() {
    support::init_logs();
    let url = support::pg::fresh_database().await;
    let store = volume_reconciler::store::open(&url, 4).await.unwrap();
    let mut writer = support::pg::Admin::connect(&url).await;
    // A transaction that has written (it has an id), begun before the
    // intent's record-by time.
    writer.run("BEGIN").await;
    writer.run("SELECT txid_current()").await;
    let record_by = store.now().await.unwrap() + chrono::Duration::milliseconds(10);
    let bound = chrono::Duration::from_std(store.round_trip_bound()).unwrap();
    let s = store.clone();
    support::eventually(
        Duration::from_secs(30),
        "the database's clock is past record_by and the bound",
        || {
            let s = s.clone();
            async move { s.now().await.unwrap() >= record_by + bound }
        },
    )
    .await;
    assert!(
        !store.intent_settled(record_by).await.unwrap(),
        "settled while a writer older than record_by runs"
    );
    writer.run("ROLLBACK").await;
    assert!(store.intent_settled(record_by).await.unwrap());
}

/// Another replica learns of a decision by NOTIFY only when somebody
/// watches the operation: a decision nobody watches notifies nobody (at one
/// caller a NOTIFY per decision cost ~0.1 ms), a watched one does; each
/// registration removes expired ones.
#[tokio::test]
async fn postgres_decisions_notify_other_replicas_only_for_watched_operations() {
    support::init_logs();
    let url = support::pg::fresh_database().await;
    let deciding = volume_reconciler::store::open(&url, 4).await.unwrap();
    let waiting = volume_reconciler::store::open(&url, 4).await.unwrap();
    let unwatched = create(
        deciding.as_ref(),
        new_op("unwatched", Uuid::new_v4(), State::InProgress),
    )
    .await;
    let watched = create(
        deciding.as_ref(),
        new_op("watched", Uuid::new_v4(), State::InProgress),
    )
    .await;
    let mut admin = support::pg::Admin::connect(&url).await;
    admin
        .run(&format!(
            "INSERT INTO operation_watches VALUES ('{}', now() - interval '1 minute')",
            Uuid::new_v4()
        ))
        .await;
    // A wait already over registers nothing.
    waiting.watch(Uuid::new_v4(), Duration::ZERO).await.unwrap();
    let mut rx = waiting.subscribe();
    waiting
        .watch(watched.id, Duration::from_secs(60))
        .await
        .unwrap();
    for op in [&unwatched, &watched] {
        deciding
            .operation_transition(finish(op, State::Succeeded), soon())
            .await
            .unwrap()
            .unwrap();
    }
    // Notifications arrive in commit order: the unwatched decision
    // committed first, so had it been notified it would come first.
    let seen = tokio::time::timeout(Duration::from_secs(10), async {
        let mut seen = Vec::new();
        loop {
            let id = rx.recv().await.unwrap();
            seen.push(id);
            if id == watched.id {
                return seen;
            }
        }
    })
    .await
    .expect("the watched decision is notified to the other replica");
    assert!(
        !seen.contains(&unwatched.id),
        "a decision nobody watches is not notified: {seen:?}"
    );
    let rows = admin
        .texts("SELECT operation_id::text FROM operation_watches ORDER BY 1")
        .await;
    assert_eq!(
        rows,
        vec![watched.id.to_string()],
        "the expired watch was removed by the next registration, the zero-length one never written"
    );
}

/// PostgreSQL only: the pgbench script `scripts/bench` uses as the
/// database's ceiling is the service's own statements, and they work: one
/// run records an operation, decides it, and logs its four events.
#[tokio::test]
async fn postgres_pgbench_script_is_the_services_write_pattern_and_runs() {
    support::init_logs();
    let url = support::pg::fresh_database().await;
    let store = volume_reconciler::store::open(&url, 4).await.unwrap();
    let script = volume_reconciler::store::pg::tooling::pgbench_script();
    let statements: Vec<String> = script
        .lines()
        .filter(|l| !l.starts_with('\\'))
        .map(|l| {
            l.trim_end_matches(';')
                .replace(":n ||", "42 ||")
                .replace(":hi::", "12345::")
                .replace(":lo::", "67890::")
        })
        .collect();
    assert_eq!(statements.len(), 2, "{script}");
    assert!(statements[0].contains("INSERT INTO operations"));
    assert!(statements[1].contains("UPDATE operations"));
    let mut admin = support::pg::Admin::connect(&url).await;
    for s in &statements {
        assert_eq!(admin.run(s).await, 1, "one row each: {s}");
    }
    let id = Uuid::parse_str("00000000000030390000000000010932").unwrap();
    let op = store.operation_get(id).await.unwrap().expect("recorded");
    assert_eq!(op.state, State::Succeeded);
    assert_eq!(store.operation_events(id).await.unwrap().len(), 4);
}

/// Arguments for `EXECUTE` of a statement prepared with `types`: an empty
/// array for each array parameter, NULL for each plain one (plans only).
fn null_arguments(types: &str) -> String {
    types
        .split(", ")
        .map(|t| {
            if t.ends_with("[]") {
                format!("ARRAY[]::{t}")
            } else {
                format!("NULL::{t}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// PostgreSQL only: the writers' decision statement finds its rows by
/// primary key even under a generic plan made from statistics that saw no
/// open operation, while thousands are open (a Nova outage's backlog, the
/// moment the reconciler must be fast). It once walked the partial index of
/// open operations for every row of the batch: 454 ms for 128 decisions.
#[tokio::test]
async fn postgres_decisions_find_their_rows_by_key_whatever_the_statistics() {
    support::init_logs();
    let url = support::pg::fresh_database().await;
    let store = volume_reconciler::store::open(&url, 4).await.unwrap();
    let mut admin = support::pg::Admin::connect(&url).await;
    for sql in [
        "INSERT INTO operations (id, idempotency_key, fingerprint, action, state, resolution,
            server_id, volume_id, deadline_at, completed_at)
         SELECT gen_random_uuid(), 'done-' || g, 'f', 'attach', 'succeeded', 'response',
            gen_random_uuid(), gen_random_uuid(), now(), now() FROM generate_series(1, 5000) g",
        "ANALYZE operations",
        "INSERT INTO operations (id, idempotency_key, fingerprint, action, state, server_id,
            volume_id, deadline_at, lease_owner, lease_expires_at)
         SELECT gen_random_uuid(), 'open-' || g, 'f', 'attach', 'unknown', gen_random_uuid(),
            gen_random_uuid(), now(), 'r', now() FROM generate_series(1, 3000) g",
        "SET plan_cache_mode = force_generic_plan",
    ] {
        admin.run(sql).await;
    }
    // Both forms: a batch of several rows, and of one.
    for (name, types, sql) in volume_reconciler::store::pg::tooling::writer_statements() {
        if !name.starts_with("decide") {
            continue;
        }
        admin
            .run(&format!("PREPARE {name}({types}) AS {sql}"))
            .await;
        let plan = admin
            .texts(&format!(
                "EXPLAIN EXECUTE {name}({})",
                null_arguments(&types)
            ))
            .await
            .join("\n");
        assert!(plan.contains("operations_pkey"), "{name}: {plan}");
        assert!(!plan.contains("operations_open_by_lease"), "{name}: {plan}");
    }
    store.close().await;
}

/// PostgreSQL only: on a fresh ledger the writers' plans are made while the
/// tables are empty, and stay until autovacuum first analyzes them (up to a
/// minute of full load). Under the writers' settings the intent and the
/// decision still find their rows by key, and so do the foreign-key checks
/// of the events they append: a sequential scan there walked the whole
/// growing table for every batch (16–54 ms per decision at 64 callers).
#[tokio::test]
async fn postgres_writers_find_rows_by_key_on_a_fresh_ledger() {
    support::init_logs();
    let url = support::pg::fresh_database().await;
    let store = volume_reconciler::store::open(&url, 4).await.unwrap();
    let mut admin = support::pg::Admin::connect(&url).await;
    admin.run("SET plan_cache_mode = force_generic_plan").await;
    for (name, value) in volume_reconciler::store::pg::tooling::WRITER_SETTINGS {
        admin.run(&format!("SET {name} = '{value}'")).await;
    }
    for (name, types, sql) in volume_reconciler::store::pg::tooling::writer_statements() {
        admin
            .run(&format!("PREPARE {name}({types}) AS {sql}"))
            .await;
        let plan = admin
            .texts(&format!(
                "EXPLAIN EXECUTE {name}({})",
                null_arguments(&types)
            ))
            .await
            .join("\n");
        assert!(!plan.contains("Seq Scan"), "{name}: {plan}");
    }
    // The events' foreign-key check, as PostgreSQL plans it.
    admin
        .run("PREPARE fk(uuid) AS SELECT 1 FROM ONLY operations x WHERE id = $1 FOR KEY SHARE OF x")
        .await;
    let plan = admin
        .texts("EXPLAIN EXECUTE fk('00000000-0000-0000-0000-000000000000')")
        .await
        .join("\n");
    assert!(!plan.contains("Seq Scan"), "fk: {plan}");
    store.close().await;
}

/// The decided invariant (terminal ⇔ decided time ⇔ resolution) is the
/// database's, whoever writes the row: of every state with and without a
/// decided time and a resolution (20 rows), exactly those that keep it are
/// accepted, on insert and on update, and the others are refused as a
/// CHECK violation naming it. It is the table's one CHECK, and validated:
/// the rows written before it moved into a function were checked too.
#[tokio::test]
async fn postgres_refuses_every_row_that_breaks_the_decided_invariant_whoever_writes_it() {
    support::init_logs();
    let url = support::pg::fresh_database().await;
    let store = volume_reconciler::store::open(&url, 2).await.unwrap();
    let mut admin = support::pg::Admin::connect(&url).await;
    let states = ["pending", "in_progress", "unknown", "succeeded", "failed"];
    let mut accepted = 0;
    for (i, state) in states.iter().enumerate() {
        let terminal = matches!(*state, "succeeded" | "failed");
        for decided in [false, true] {
            for resolved in [false, true] {
                let keeps = terminal == decided && decided == resolved;
                let completed_at = if decided { "now()" } else { "NULL" };
                let resolution = if resolved { "'operator'" } else { "NULL" };
                let name = format!("{state}-{decided}-{resolved}");
                let insert = format!(
                    "INSERT INTO operations (id, idempotency_key, fingerprint, action, state,
                        resolution, server_id, volume_id, deadline_at, completed_at)
                     VALUES (gen_random_uuid(), 'insert-{name}', 'f', 'attach', '{state}',
                        {resolution}, gen_random_uuid(), gen_random_uuid(), now(), {completed_at})"
                );
                // Each update starts from an open row of its own.
                admin
                    .run(&format!(
                        "INSERT INTO operations (id, idempotency_key, fingerprint, action, state,
                            server_id, volume_id, deadline_at)
                         VALUES ('00000000-0000-0000-0000-{i:06}{:06}', 'update-{name}', 'f',
                            'attach', 'in_progress', gen_random_uuid(), gen_random_uuid(), now())",
                        u8::from(decided) * 2 + u8::from(resolved)
                    ))
                    .await;
                let update = format!(
                    "UPDATE operations SET state = '{state}', resolution = {resolution},
                        completed_at = {completed_at} WHERE idempotency_key = 'update-{name}'"
                );
                for sql in [insert, update] {
                    if keeps {
                        admin.run(&sql).await;
                        accepted += 1;
                    } else {
                        assert_eq!(
                            admin.refusal(&sql).await,
                            (
                                "23514".to_string(),
                                "operations_decided_invariant".to_string()
                            ),
                            "{name}: {sql}"
                        );
                    }
                }
            }
        }
    }
    // Open states without either, decided states with both; each twice.
    assert_eq!(accepted, 2 * states.len());
    assert_eq!(
        admin
            .texts(
                "SELECT conname::text || ' ' || convalidated::text FROM pg_constraint
                 WHERE conrelid = 'operations'::regclass AND contype = 'c'"
            )
            .await,
        ["operations_decided_invariant true"],
        "one CHECK on operations, validated"
    );
    store.close().await;
}

/// The embedded store's indexes earn their place too: `operations` has
/// exactly the indexes the store names, each with a statement of the
/// store's that SQLite's plan reads through it (on a ledger of 20,000
/// decided and 50 open operations, not analyzed, as the store leaves it).
/// The one CHECK is the decided invariant, named as on PostgreSQL.
#[tokio::test]
async fn sqlite_every_index_of_operations_serves_a_query_of_the_store() {
    support::init_logs();
    let path = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("vr-plans-{}.db", Uuid::new_v4().simple()));
    let url = format!("sqlite://{}", path.display());
    let store = volume_reconciler::store::open(&url, 1).await.unwrap();
    let pool = sqlx::SqlitePool::connect(&url).await.expect("opened");
    for sql in [
        "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < 20000)
         INSERT INTO operations (id, idempotency_key, fingerprint, action, state, resolution,
            server_id, volume_id, deadline_at, created_at, updated_at, completed_at, verify_expect)
         SELECT 'done-' || n, 'done-' || n, 'f', 'attach', 'succeeded', 'response',
            'server-' || n, 'volume-' || n, 1, 1, 1, 1000 + n, 1 FROM g",
        "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < 50)
         INSERT INTO operations (id, idempotency_key, fingerprint, action, state, server_id,
            volume_id, deadline_at, created_at, updated_at, lease_owner, lease_expires_at)
         SELECT 'open-' || n, 'open-' || n, 'f', 'attach', 'unknown', 'server-o' || n,
            'volume-o' || n, 1, 1, 1, 'r', 1 FROM g",
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&pool)
            .await
            .unwrap_or_else(|e| panic!("{e}: {sql}"));
    }
    let queries = volume_reconciler::store::sqlite::index_queries();
    let mut named: Vec<&str> = queries.iter().map(|(i, _)| *i).collect();
    named.sort();
    named.dedup();
    let present: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'operations' ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        present, named,
        "the indexes of operations are exactly those the store names with their query"
    );
    for (index, sql) in &queries {
        let rows = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {sql}")))
            .fetch_all(&pool)
            .await
            .unwrap_or_else(|e| panic!("{e}: {sql}"));
        let plan = rows
            .iter()
            .map(|r| sqlx::Row::get::<String, _>(r, "detail"))
            .collect::<Vec<_>>()
            .join("\n");
        assert!(
            plan.contains(&format!("INDEX {index}")),
            "{index} serves no query: {sql}\n{plan}"
        );
    }
    let checks: Vec<String> = sqlx::query_scalar(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'operations'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        checks[0].matches("CHECK").count(),
        1,
        "one CHECK: {}",
        checks[0]
    );
    assert!(
        checks[0].contains("operations_decided_invariant"),
        "{}",
        checks[0]
    );
    pool.close().await;
    store.close().await;
}

/// Every index of `operations` earns its place: the table has exactly the
/// indexes the store names, each with a statement of the service's that a
/// generic plan reads through it (on a ledger of 20,000 decided and 50 open
/// operations, analyzed).
#[tokio::test]
async fn postgres_every_index_of_operations_serves_a_query_of_the_service() {
    support::init_logs();
    let url = support::pg::fresh_database().await;
    let store = volume_reconciler::store::open(&url, 4).await.unwrap();
    let mut admin = support::pg::Admin::connect(&url).await;
    for sql in [
        "INSERT INTO operations (id, idempotency_key, fingerprint, action, state, resolution,
            server_id, volume_id, deadline_at, completed_at, verify_expect)
         SELECT gen_random_uuid(), 'done-' || g, 'f', 'attach', 'succeeded', 'response',
            gen_random_uuid(), gen_random_uuid(), now(), now() - g * interval '1 second', true
         FROM generate_series(1, 20000) g",
        "INSERT INTO operations (id, idempotency_key, fingerprint, action, state, server_id,
            volume_id, deadline_at, lease_owner, lease_expires_at)
         SELECT gen_random_uuid(), 'open-' || g, 'f', 'attach', 'unknown', gen_random_uuid(),
            gen_random_uuid(), now(), 'r', now() FROM generate_series(1, 50) g",
        "ANALYZE operations",
        "SET plan_cache_mode = force_generic_plan",
    ] {
        admin.run(sql).await;
    }
    let queries = volume_reconciler::store::pg::tooling::index_queries();
    let mut named: Vec<&str> = queries.iter().map(|(i, _, _)| *i).collect();
    named.sort();
    let mut present = admin
        .texts("SELECT indexname::text FROM pg_indexes WHERE tablename = 'operations' ORDER BY 1")
        .await;
    present.sort();
    assert_eq!(
        present, named,
        "the indexes of operations are exactly those the store names with their query"
    );
    for (i, (index, sql, types)) in queries.iter().enumerate() {
        let decl = if types.is_empty() {
            String::new()
        } else {
            format!("({types})")
        };
        admin.run(&format!("PREPARE q{i}{decl} AS {sql}")).await;
        let args = if types.is_empty() {
            String::new()
        } else {
            null_arguments(types)
        };
        let plan = admin
            .texts(&format!(
                "EXPLAIN EXECUTE q{i}{}",
                if args.is_empty() {
                    String::new()
                } else {
                    format!("({args})")
                }
            ))
            .await
            .join("\n");
        assert!(
            plan.contains(index),
            "{index} serves no query: {sql}\n{plan}"
        );
        assert!(!plan.contains("Seq Scan"), "{index}: {plan}");
    }
    store.close().await;
}

/// Every listing `ops list` can ask for finds its page through an index
/// under the generic plans the service's connections use (written as one
/// statement with `$n IS NULL OR …` for every filter, each listing read
/// the whole table and sorted it).
#[tokio::test]
async fn postgres_listings_use_an_index_whatever_the_filter() {
    support::init_logs();
    let url = support::pg::fresh_database().await;
    let store = volume_reconciler::store::open(&url, 4).await.unwrap();
    let mut admin = support::pg::Admin::connect(&url).await;
    for sql in [
        "INSERT INTO operations (id, idempotency_key, fingerprint, action, state, resolution,
            server_id, volume_id, deadline_at, completed_at)
         SELECT gen_random_uuid(), 'done-' || g, 'f', 'attach', 'succeeded', 'response',
            gen_random_uuid(), gen_random_uuid(), now(), now() FROM generate_series(1, 20000) g",
        "INSERT INTO operations (id, idempotency_key, fingerprint, action, state, server_id,
            volume_id, deadline_at, lease_owner, lease_expires_at)
         SELECT gen_random_uuid(), 'open-' || g, 'f', 'attach', 'unknown', gen_random_uuid(),
            gen_random_uuid(), now(), 'r', now() FROM generate_series(1, 50) g",
        "ANALYZE operations",
        "SET plan_cache_mode = force_generic_plan",
    ] {
        admin.run(sql).await;
    }
    let any = Uuid::new_v4();
    let cursor = volume_reconciler::store::pg::tooling::cursor();
    let cases: [(OperationFilter, Option<ListCursor>, &str, &str); 6] = [
        (OperationFilter::default(), None, "", "operations_seq_key"),
        (
            OperationFilter::default(),
            Some(cursor),
            "bigint",
            "operations_seq_key",
        ),
        (
            OperationFilter {
                server_id: Some(any),
                ..Default::default()
            },
            None,
            "uuid",
            "operations_server",
        ),
        (
            OperationFilter {
                volume_id: Some(any),
                ..Default::default()
            },
            None,
            "uuid",
            "operations_volume",
        ),
        (
            OperationFilter {
                state: Some(State::Unknown),
                ..Default::default()
            },
            None,
            "text",
            "operations_open",
        ),
        (
            OperationFilter {
                state: Some(State::Failed),
                ..Default::default()
            },
            None,
            "text",
            "operations_seq_key",
        ),
    ];
    for (i, (filter, after, types, index)) in cases.iter().enumerate() {
        let sql = volume_reconciler::store::pg::tooling::list_statement(filter, *after, 50);
        let (decl, args) = match *types {
            "" => (String::new(), String::new()),
            "uuid" => ("(uuid)".to_string(), format!("('{any}')")),
            "text" => ("(text)".to_string(), "('unknown')".to_string()),
            t => (format!("({t})"), "(10)".to_string()),
        };
        admin.run(&format!("PREPARE list{i}{decl} AS {sql}")).await;
        let plan = admin
            .texts(&format!("EXPLAIN EXECUTE list{i}{args}"))
            .await
            .join("\n");
        assert!(plan.contains(index), "{filter:?}: {plan}");
        assert!(!plan.contains("Seq Scan"), "{filter:?}: {plan}");
    }
    store.close().await;
}

/// Taking the decisions due for verification starts at the stage's cursor,
/// whatever the number of decisions verified before it (it read them all).
#[tokio::test]
async fn postgres_verification_starts_at_its_cursor() {
    support::init_logs();
    let url = support::pg::fresh_database().await;
    let store = volume_reconciler::store::open(&url, 4).await.unwrap();
    let mut admin = support::pg::Admin::connect(&url).await;
    for sql in [
        "INSERT INTO operations (id, idempotency_key, fingerprint, action, state, resolution,
            server_id, volume_id, deadline_at, completed_at, verify_expect)
         SELECT gen_random_uuid(), 'done-' || g, 'f', 'attach', 'succeeded', 'response',
            gen_random_uuid(), gen_random_uuid(), now(), now() - interval '1 hour', true
         FROM generate_series(1, 20000) g",
        "ANALYZE operations",
        "SET plan_cache_mode = force_generic_plan",
    ] {
        admin.run(sql).await;
    }
    let sql = volume_reconciler::store::pg::tooling::verification_statement();
    admin
        .run(&format!(
            "PREPARE due(timestamptz, uuid, float8, int8) AS {sql}"
        ))
        .await;
    let plan = admin
        .texts(
            "EXPLAIN (ANALYZE, COSTS OFF) EXECUTE due(now(), '00000000-0000-0000-0000-000000000000', 0, 256)",
        )
        .await
        .join("\n");
    assert!(
        plan.contains("Index Cond: ((ROW(completed_at, id) > ROW($1, $2))"),
        "{plan}"
    );
    assert!(!plan.contains("Rows Removed"), "{plan}");
    store.close().await;
}

fn request_sent(n: usize) -> impl Fn(&volume_reconciler::domain::OperationEvent) -> bool {
    move |e| e.kind == "request_sent" && e.metadata.get("attempt") == Some(&n.to_string())
}

/// PostgreSQL only: the connection dies after the server committed a
/// decision and before its answer arrived (a lost acknowledgement). The
/// writer runs the batch again on a new connection; the write recognises
/// its own effect: one attempt more, one set of events.
#[tokio::test]
async fn postgres_a_write_whose_acknowledgement_was_lost_applies_once() {
    support::init_logs();
    let url = support::pg::fresh_database().await;
    let (proxy, proxied) = Proxy::start(&url).await;
    let store = volume_reconciler::store::open(&proxied, 4).await.unwrap();
    let op = create(
        store.as_ref(),
        new_op("lost-ack", Uuid::new_v4(), State::InProgress),
    )
    .await;

    let marker = "lost-ack-7f3a";
    proxy.arm(Lose::Response, marker, Duration::ZERO);
    let mut retry = Transition::new(&op, State::InProgress, "r0");
    retry.add_attempt = true;
    retry.request_sent = true;
    retry.last_error = Some(Some(OperationError::new(
        volume_reconciler::domain::Reason::NovaTimeout,
        marker,
    )));
    retry.events = vec![NewEvent::new("request_sent", "again").with("attempt", 2)];
    let written = store
        .operation_transition(retry, soon())
        .await
        .expect("written despite the lost acknowledgement")
        .expect("and answered with its row");
    proxy.fired(Duration::from_secs(10)).await;

    assert_eq!(written.attempts, 2, "the attempt counted once");
    let events = store.operation_events(op.id).await.unwrap();
    assert_eq!(
        events.iter().filter(|e| request_sent(2)(e)).count(),
        1,
        "the decision's events written once: {events:?}"
    );

    // The same for events appended to the log (verifications).
    let marker = "lost-append-2b9d";
    proxy.arm(Lose::Response, marker, Duration::ZERO);
    store
        .operation_append_events(op.id, "r0", vec![NewEvent::new("verified", marker)])
        .await
        .expect("appended despite the lost acknowledgement");
    proxy.fired(Duration::from_secs(10)).await;
    let events = store.operation_events(op.id).await.unwrap();
    assert_eq!(
        events.iter().filter(|e| e.detail == marker).count(),
        1,
        "the appended event written once: {events:?}"
    );
    store.close().await;
}

/// PostgreSQL only: a queued write whose connection died before the server
/// saw it is not run again once its caller's deadline passed (the caller
/// was told DEADLINE_EXCEEDED; nothing may be recorded behind its back).
#[tokio::test]
async fn postgres_a_write_is_not_rerun_after_its_deadline() {
    support::init_logs();
    let url = support::pg::fresh_database().await;
    let (proxy, proxied) = Proxy::start(&url).await;
    // Four connections: one writer task, so queued writes run in order.
    let store = volume_reconciler::store::open(&proxied, 4).await.unwrap();
    let blocker = create(
        store.as_ref(),
        new_op("blocker", Uuid::new_v4(), State::InProgress),
    )
    .await;
    let victim = create(
        store.as_ref(),
        new_op("victim", Uuid::new_v4(), State::InProgress),
    )
    .await;
    let other = create(
        store.as_ref(),
        new_op("other", Uuid::new_v4(), State::InProgress),
    )
    .await;

    // A write held up by a row lock stays in flight on the inline path, so
    // the writes after it take the queue and the writer task.
    let lock = lock_rows(&url, &[blocker.id]).await;
    let blocked = {
        let (store, t) = (
            store.clone(),
            Transition::new(&blocker, State::InProgress, "r0"),
        );
        tokio::spawn(async move { store.operation_transition(t, soon()).await })
    };
    until_waiting_on_locks(&url, 1, "the first write").await;
    // Through the queue: the writer opens a connection of its own, which
    // the next queued write reuses.
    let other = store
        .operation_transition(Transition::new(&other, State::InProgress, "r0"), soon())
        .await
        .unwrap()
        .expect("a queued write lands");

    let marker = "deadline-5c1e";
    proxy.arm(Lose::Request, marker, Duration::from_secs(6));
    let mut late = Transition::new(&victim, State::InProgress, "r0");
    late.add_attempt = true;
    late.request_sent = true;
    late.last_error = Some(Some(OperationError::new(
        volume_reconciler::domain::Reason::NovaTimeout,
        marker,
    )));
    late.events = vec![NewEvent::new("request_sent", "late").with("attempt", 2)];
    let answered = store
        .operation_transition(late, Instant::now() + Duration::from_secs(3))
        .await;
    assert!(
        matches!(answered, Err(StoreError::DeadlineExceeded { .. })),
        "{answered:?}"
    );
    proxy.fired(Duration::from_secs(20)).await;
    // Queued after the lost write: once it landed, the writer is done with
    // the lost one (one writer task, in order).
    store
        .operation_transition(Transition::new(&other, State::InProgress, "r0"), soon())
        .await
        .unwrap()
        .expect("the next queued write lands");

    let now = store.operation_get(victim.id).await.unwrap().unwrap();
    assert_eq!(
        (now.attempts, now.last_error.is_none()),
        (1, true),
        "nothing written after the deadline"
    );
    let events = store.operation_events(victim.id).await.unwrap();
    assert!(!events.iter().any(request_sent(2)), "{events:?}");

    release_and_land(lock, vec![blocked]).await;
    store.close().await;
}

/// A transaction left open holding the rows `ids` locked.
async fn lock_rows(url: &str, ids: &[Uuid]) -> support::pg::Admin {
    let mut lock = support::pg::Admin::connect(url).await;
    let ids: Vec<String> = ids.iter().map(|id| format!("'{id}'")).collect();
    lock.run(&format!(
        "BEGIN; SELECT 1 FROM operations WHERE id IN ({}) FOR UPDATE",
        ids.join(", ")
    ))
    .await;
    lock
}

/// Until `n` sessions of the database wait for a lock (`what` does, the
/// last of them).
async fn until_waiting_on_locks(url: &str, n: i64, what: &str) {
    support::eventually(
        Duration::from_secs(20),
        &format!("{what} waits on the row lock"),
        || async move {
            support::pg::Admin::connect(url)
                .await
                .waiting_on_locks()
                .await
                == n
        },
    )
    .await;
}

/// `writes` are still unanswered 2 s on: held for the batch in flight
/// (sent beside it, they would land in milliseconds).
async fn still_waiting<F: std::future::Future + Unpin>(writes: &mut F, what: &str) {
    assert!(
        tokio::time::timeout(Duration::from_secs(2), writes)
            .await
            .is_err(),
        "{what} were sent beside a batch in flight"
    );
}

type Blocked =
    tokio::task::JoinHandle<Result<Option<volume_reconciler::domain::Operation>, StoreError>>;

/// Ends the transaction that holds `blocked` writes on its row locks; each
/// then lands and applies.
async fn release_and_land(mut lock: support::pg::Admin, blocked: Vec<Blocked>) {
    lock.run("COMMIT").await;
    for write in blocked {
        write
            .await
            .unwrap()
            .expect("a blocked write lands once the lock is gone")
            .expect("applies");
    }
}

/// PostgreSQL only: while a batch of decisions is in flight, the second
/// writer of its kind sends the writes queued behind it only once they are
/// a batch worth sending (`SECOND_BATCH`, 16), or once the first is
/// answered: a few writes wait for the one in flight instead of paying a
/// statement of their own, sixteen go at once, beside it, in one
/// statement (one transaction id on every row), one whose deadline comes
/// first is answered at it, and two more go once the first is answered. Ground truth: the rows' `xmin` and the row lock that
/// holds the first batch.
#[tokio::test]
async fn postgres_a_second_batch_goes_beside_the_first_only_once_it_is_large() {
    support::init_logs();
    let url = support::pg::fresh_database().await;
    // Sixteen connections: two writers per kind.
    let store = volume_reconciler::store::open(&url, 16).await.unwrap();
    let ops = create_in_progress(store.as_ref(), "batch-", 21).await;
    let (inline, queued, hurried) = (ops[0].clone(), ops[1].clone(), ops[20].clone());
    let (rest, last) = (ops[2..18].to_vec(), ops[18..20].to_vec());
    let lock = lock_rows(&url, &[inline.id, queued.id]).await;
    // Deadlines far beyond the test's own waits: the first batch waits on
    // its lock until the test lets it go, never until its deadline.
    let decide = |op: &volume_reconciler::domain::Operation| {
        let (store, t) = (store.clone(), Transition::new(op, State::InProgress, "r0"));
        let deadline = Instant::now() + Duration::from_secs(300);
        tokio::spawn(async move { store.operation_transition(t, deadline).await })
    };
    // The first write alone runs inline; the second, queued behind it,
    // is the first writer's batch: both wait on the row lock.
    let mut blocked = Vec::new();
    for (op, what) in [
        (&inline, "the inline write"),
        (&queued, "the first writer's batch"),
    ] {
        blocked.push(decide(op));
        until_waiting_on_locks(&url, blocked.len() as i64, what).await;
    }

    // Three writes: not a batch worth sending beside the one in flight.
    let few = futures_util::future::join_all(rest[..3].iter().map(decide));
    tokio::pin!(few);
    still_waiting(&mut few, "three writes").await;
    // Thirteen more make sixteen: they go at once, as one statement,
    // while the first batch still waits on its lock.
    let more: Vec<_> = rest[3..].iter().map(decide).collect();
    let (mut landed, more) = tokio::time::timeout(
        Duration::from_secs(30),
        futures_util::future::join(few, futures_util::future::join_all(more)),
    )
    .await
    .expect("sixteen queued writes go beside the batch in flight");
    landed.extend(more);
    assert_eq!(landed.len(), 16);
    for written in landed {
        written
            .unwrap()
            .expect("a write of the second batch")
            .expect("applies");
    }
    assert!(
        blocked.iter().all(|b| !b.is_finished()),
        "the first batch still waits on its lock"
    );
    let ids: Vec<String> = rest.iter().map(|op| format!("'{}'", op.id)).collect();
    let statements = support::pg::Admin::connect(&url)
        .await
        .number(&format!(
            "SELECT count(DISTINCT xmin::text) FROM operations WHERE id IN ({})",
            ids.join(", ")
        ))
        .await;
    assert_eq!(statements, 1, "the sixteen writes are one statement");

    // A write held for the batch in flight whose deadline comes first: its
    // caller is answered at the deadline (the store bounds every write by
    // it), and nothing is written.
    let answered = tokio::time::timeout(
        Duration::from_secs(20),
        store.operation_transition(
            Transition::new(&hurried, State::InProgress, "r0"),
            Instant::now() + Duration::from_secs(2),
        ),
    )
    .await
    .expect("a held write is answered at its deadline");
    assert!(
        matches!(answered, Err(StoreError::DeadlineExceeded { .. })),
        "{answered:?}"
    );

    // Two more wait for the first batch again, and go once it is answered.
    let last = futures_util::future::join_all(last.iter().map(decide));
    tokio::pin!(last);
    still_waiting(&mut last, "two writes").await;
    release_and_land(lock, blocked).await;
    let last = tokio::time::timeout(Duration::from_secs(30), last)
        .await
        .expect("the writes held for the first batch go once it is answered");
    for written in last {
        written.unwrap().expect("a held write").expect("applies");
    }
    // The expired write went out with them, or before: not written.
    let now = store.operation_get(hurried.id).await.unwrap().unwrap();
    assert_eq!(
        now.updated_at, hurried.updated_at,
        "an expired write is not written"
    );
    store.close().await;
}

/// PostgreSQL only: operation_events has no foreign key (it cost a lookup
/// and a lock per event row); the writers keep what it guarded. An append
/// or a drift mark for an operation that is gone (pruned between a
/// verification's look and its log) is refused as not found and logs
/// nothing, even batched with one whose operation is there, which gets its
/// events.
#[tokio::test]
async fn postgres_no_event_outlives_its_operation() {
    support::init_logs();
    let url = support::pg::fresh_database().await;
    let store = volume_reconciler::store::open(&url, 4).await.unwrap();
    let kept = create(
        store.as_ref(),
        new_op("kept", Uuid::new_v4(), State::InProgress),
    )
    .await;
    let gone = create(
        store.as_ref(),
        new_op("gone", Uuid::new_v4(), State::InProgress),
    )
    .await;
    for op in [&kept, &gone] {
        store
            .operation_transition(finish(op, State::Succeeded), soon())
            .await
            .unwrap()
            .expect("decided");
    }
    let mut admin = support::pg::Admin::connect(&url).await;
    admin
        .run(&format!(
            "WITH o AS (DELETE FROM operations WHERE id = '{}' RETURNING id),
                  e AS (DELETE FROM operation_events WHERE operation_id IN (SELECT id FROM o))
             DELETE FROM operation_log WHERE operation_id IN (SELECT id FROM o)",
            gone.id
        ))
        .await;
    let append = |id: Uuid| {
        let store = store.clone();
        async move {
            store
                .operation_append_events(id, "r0", vec![NewEvent::new("verified", "late look")])
                .await
        }
    };
    // At once, so that they may share a batch.
    let (on_kept, on_gone) = tokio::join!(append(kept.id), append(gone.id));
    on_kept.expect("the append to the operation still there");
    assert!(
        matches!(on_gone, Err(StoreError::NotFound(id)) if id == gone.id),
        "{on_gone:?}"
    );
    store
        .operation_mark_drift(kept.id, "r0", vec![NewEvent::new("drift_detected", "late")])
        .await
        .expect("the drift mark on the operation still there");
    let marked = store
        .operation_mark_drift(gone.id, "r0", vec![NewEvent::new("drift_detected", "late")])
        .await;
    assert!(
        matches!(marked, Err(StoreError::NotFound(id)) if id == gone.id),
        "{marked:?}"
    );
    let orphans = admin
        .number(&format!(
            "SELECT (SELECT count(*) FROM operation_events WHERE operation_id = '{0}')
                  + (SELECT count(*) FROM operation_log WHERE operation_id = '{0}')",
            gone.id
        ))
        .await;
    assert_eq!(orphans, 0, "no event logged for an operation that is gone");
    let kinds: Vec<String> = store
        .operation_events(kept.id)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .collect();
    assert!(
        kinds.contains(&"verified".to_string()) && kinds.contains(&"drift_detected".to_string()),
        "the operation still there gets both: {kinds:?}"
    );
    store.close().await;
}

/// PostgreSQL only: the reads of open work that run on their own, again
/// and again (the reconciler's claim; the gauge of open work and the
/// oldest UNKNOWN operation, at every scrape), first run while the ledger
/// is empty (a fresh deployment), read the open operations' index once the
/// ledger has grown, before anything analyzes it. Prepared once per
/// connection, their generic plans were the empty table's sequential scan
/// and stayed: 18–24 ms each at 100,000 operations.
#[tokio::test]
async fn postgres_reads_of_open_work_first_run_on_an_empty_ledger_use_the_open_index_once_it_grew()
{
    support::init_logs();
    let url = support::pg::fresh_database().await;
    let store = volume_reconciler::store::open(&url, 4).await.unwrap();
    let mut admin = support::pg::Admin::connect(&url).await;
    let claim = || async {
        let claimed = store
            .operation_claim("ra", Duration::from_secs(60), 8, &[])
            .await
            .unwrap();
        assert!(claimed.is_empty(), "nothing is open");
    };
    let gauge = || async {
        let open = store.operation_open_by_state().await.unwrap();
        assert!(open.is_empty(), "nothing is open: {open:?}");
    };
    let oldest = || async {
        assert_eq!(store.oldest_unknown_since().await.unwrap(), None);
    };
    // Every read connection runs each read while the ledger is empty.
    for _ in 0..10 {
        claim().await;
        gauge().await;
        oldest().await;
    }
    admin
        .run(
            "INSERT INTO operations (id, idempotency_key, fingerprint, action, state, resolution,
                server_id, volume_id, deadline_at, completed_at)
             SELECT gen_random_uuid(), 'done-' || g, 'f', 'attach', 'succeeded', 'response',
                gen_random_uuid(), gen_random_uuid(), now(), now()
             FROM generate_series(1, 20000) g",
        )
        .await;
    const OPEN_SCANS: &str =
        "SELECT idx_scan FROM pg_stat_user_indexes WHERE indexrelname = 'operations_open'";
    // Only these reads use this index here (no intent is written), one at
    // a time: each phase waits until its own scans are counted (a backend
    // reports its counters within about a second of going idle), and the
    // empty ledger's reads scanned the table, so what they report late
    // adds sequential scans, never these.
    async fn index_read_by(url: &str, what: &str, before: i64) {
        support::eventually(
            Duration::from_secs(40),
            &format!("{what} on the grown ledger read operations_open"),
            || {
                let url = url.to_string();
                async move {
                    support::pg::Admin::connect(&url)
                        .await
                        .number(OPEN_SCANS)
                        .await
                        >= before + 10
                }
            },
        )
        .await;
    }
    let before = admin.number(OPEN_SCANS).await;
    for _ in 0..10 {
        claim().await;
    }
    index_read_by(&url, "the claims", before).await;
    let before = admin.number(OPEN_SCANS).await;
    for _ in 0..10 {
        gauge().await;
    }
    index_read_by(&url, "the gauges of open work", before).await;
    let before = admin.number(OPEN_SCANS).await;
    for _ in 0..10 {
        oldest().await;
    }
    index_read_by(&url, "the reads of the oldest UNKNOWN", before).await;
    store.close().await;
}

/// Thousands of intents can wait for the group commit at once (10,000
/// attaches in flight): each waiting `operation_create` of PostgreSQL's
/// store holds the intent by pointer, and no room for a row it has not
/// got yet (it held a copy of the intent and a row's room, ~940 bytes in
/// a release build, before).
#[tokio::test]
async fn a_waiting_intent_holds_little() {
    let store = pg_store().await;
    let waiting =
        store.operation_create(new_op("small", Uuid::new_v4(), State::InProgress), soon());
    let size = std::mem::size_of_val(&*waiting);
    assert!(size <= 320, "a waiting intent's future: {size} bytes");
    // Dropped unpolled: nothing was written.
    drop(waiting);
}
