//! Operating a fleet, in the ledger: labels kept and filtered on, lists by
//! creation time paged once each, the cancel's one compare-and-set and a
//! detach superseding an unsent attach, on both stores; and the plans that
//! keep a label's or a time range's page a page's work (PostgreSQL).

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use uuid::Uuid;
use volume_reconciler::domain::{
    Action, Caller, CallerKey, Labels, NewEvent, OpKey, Operation, RequestParams, Resolution,
    State, request_fingerprint,
};
use volume_reconciler::store::{
    Cancel, Cancelled, CreateOutcome, NewOperation, OperationFilter, Store, StoreError, TimeRange,
    Transition,
};

async fn pg_store() -> Arc<dyn Store> {
    support::init_logs();
    let url = support::pg::fresh_database().await;
    volume_reconciler::store::open(&url, 4).await.unwrap()
}

async fn sqlite_store() -> Arc<dyn Store> {
    support::init_logs();
    let path = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("vr-fleet-{}.db", Uuid::new_v4().simple()));
    volume_reconciler::store::open(&format!("sqlite://{}", path.display()), 1)
        .await
        .unwrap()
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    Labels::parse("labels", pairs.iter().map(|(k, v)| (*k, *v))).unwrap()
}

/// An intent of `caller` (`key`: a keyed call's, else an Ensure call's)
/// for `action` of `volume` on `server`, in `state`, carrying `labelled`.
fn intent(
    caller: &str,
    key: Option<&str>,
    action: Action,
    (server, volume): (Uuid, Uuid),
    state: State,
    labelled: Labels,
) -> NewOperation {
    let params = RequestParams::default();
    let who = Caller::named(caller);
    NewOperation {
        id: Uuid::now_v7(),
        key: match key {
            Some(k) => CallerKey::parse(Some(caller), k).unwrap().into(),
            None => OpKey::Ensure(who),
        },
        fingerprint: request_fingerprint(action, server, volume, &params, &labelled),
        action,
        server_id: server,
        volume_id: volume,
        params,
        labels: labelled,
        state,
        attempts: i32::from(state != State::Pending),
        deadline_in: Duration::from_secs(60),
        lease_owner: "r0".into(),
        lease_for: Duration::from_secs(60),
        trace: None,
        replica: "r0".into(),
        events: vec![NewEvent::new("recorded", "r")],
        record_by: None,
    }
}

async fn create(store: &dyn Store, new: NewOperation) -> Operation {
    match store.operation_create(new, soon()).await.unwrap() {
        CreateOutcome::Created(op) => op,
        other => panic!("not created: {other:?}"),
    }
}

fn ids(ops: &[Operation]) -> Vec<Uuid> {
    ops.iter().map(|o| o.id).collect()
}

async fn listed(store: &dyn Store, filter: &OperationFilter) -> Vec<Uuid> {
    ids(&store
        .operation_list(filter, None, 100)
        .await
        .unwrap()
        .operations)
}

async fn labels_are_kept_and_lists_filter_on_all_of_them(store: Arc<dyn Store>) {
    let pv = |i: u32| format!("pv-{i}");
    let mut made = Vec::new();
    for i in 0..6u32 {
        let cluster = if i % 2 == 0 { "east" } else { "west" };
        let l = Labels::parse(
            "labels",
            [("csi.k8s.io/cluster", cluster.to_string()), ("pv", pv(i))],
        )
        .unwrap();
        let new = intent(
            "ci",
            Some(&format!("k{i}")),
            Action::Attach,
            (Uuid::new_v4(), Uuid::new_v4()),
            State::InProgress,
            l.clone(),
        );
        let op = create(store.as_ref(), new).await;
        assert_eq!(op.labels, l, "the intent answers with its labels");
        made.push(op);
    }
    // An operation without labels is in no labelled list.
    let bare = create(
        store.as_ref(),
        intent(
            "ci",
            Some("bare"),
            Action::Attach,
            (Uuid::new_v4(), Uuid::new_v4()),
            State::InProgress,
            Labels::none(),
        ),
    )
    .await;
    let read = store.operation_get(made[3].id).await.unwrap().unwrap();
    assert_eq!(read.labels, made[3].labels, "kept as they were asked");
    assert!(
        store
            .operation_get(bare.id)
            .await
            .unwrap()
            .unwrap()
            .labels
            .is_empty()
    );

    let east = OperationFilter {
        labels: labels(&[("csi.k8s.io/cluster", "east")]),
        ..Default::default()
    };
    let want: Vec<Uuid> = [4, 2, 0].iter().map(|&i| made[i].id).collect();
    assert_eq!(listed(store.as_ref(), &east).await, want, "newest first");
    let both = OperationFilter {
        labels: labels(&[("csi.k8s.io/cluster", "east"), ("pv", "pv-2")]),
        ..Default::default()
    };
    assert_eq!(
        listed(store.as_ref(), &both).await,
        [made[2].id],
        "all must match"
    );
    let none = OperationFilter {
        labels: labels(&[("csi.k8s.io/cluster", "east"), ("pv", "pv-1")]),
        ..Default::default()
    };
    assert!(listed(store.as_ref(), &none).await.is_empty());

    // Paged one at a time, each once, in order.
    let mut seen = Vec::new();
    let mut after = None;
    loop {
        let page = store.operation_list(&east, after, 1).await.unwrap();
        seen.extend(ids(&page.operations));
        match page.next_cursor {
            Some(c) => after = Some(c),
            None => break,
        }
    }
    assert_eq!(seen, want);
}

async fn a_creation_range_lists_newest_first_and_pages_each_once(store: Arc<dyn Store>) {
    let mut made = Vec::new();
    for i in 0..5 {
        made.push(
            create(
                store.as_ref(),
                intent(
                    "ci",
                    Some(&format!("t{i}")),
                    Action::Attach,
                    (Uuid::new_v4(), Uuid::new_v4()),
                    State::InProgress,
                    Labels::none(),
                ),
            )
            .await,
        );
        // Creation times apart, on any clock resolution.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let range = |from: &Operation, to: Option<&Operation>| OperationFilter {
        created: TimeRange {
            from: Some(from.created_at),
            before: to.map(|o| o.created_at),
        },
        ..Default::default()
    };
    assert_eq!(
        listed(store.as_ref(), &range(&made[1], Some(&made[4]))).await,
        [made[3].id, made[2].id, made[1].id],
        "from inclusive, before exclusive, newest first"
    );
    // Paged while each listed operation changes (its updated_at moves on)
    // and new ones come: each at most once, none missed.
    let filter = range(&made[0], None);
    let (mut seen, mut after) = (Vec::new(), None);
    loop {
        let page = store.operation_list(&filter, after, 2).await.unwrap();
        for op in &page.operations {
            let mut t = Transition::new(op, State::InProgress, "r0");
            t.events = vec![NewEvent::new("observed", "changed while listed")];
            store.operation_transition(t, soon()).await.unwrap();
        }
        create(
            store.as_ref(),
            intent(
                "ci",
                Some(&format!("later-{}", seen.len())),
                Action::Attach,
                (Uuid::new_v4(), Uuid::new_v4()),
                State::InProgress,
                Labels::none(),
            ),
        )
        .await;
        seen.extend(ids(&page.operations));
        match page.next_cursor {
            Some(c) => after = Some(c),
            None => break,
        }
    }
    let mut once = seen.clone();
    once.sort();
    once.dedup();
    assert_eq!(once.len(), seen.len(), "each at most once: {seen:?}");
    for op in &made {
        assert!(seen.contains(&op.id), "{} missed", op.id);
    }
    // By last change: what changed after a moment.
    let moment = store.now().await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let mut t = Transition::new(&made[1], State::InProgress, "r0");
    t.events = vec![NewEvent::new("observed", "changed")];
    let changed = store.operation_transition(t, soon()).await.unwrap();
    assert!(changed.is_some() || made[1].lease_epoch > 0);
    let updated = OperationFilter {
        updated: TimeRange {
            from: Some(moment),
            before: None,
        },
        ..Default::default()
    };
    assert!(listed(store.as_ref(), &updated).await.contains(&made[1].id));
    assert!(!listed(store.as_ref(), &updated).await.contains(&made[0].id));
}

fn cancel_of(op: &Operation) -> Cancel {
    let (error, event) =
        volume_reconciler::domain::cancelled(op.id, &Caller::named("ci"), "asked by ci");
    Cancel {
        id: op.id,
        replica: "r1".into(),
        error,
        event,
        only_attach_of: None,
    }
}

async fn a_cancel_is_one_compare_and_set_on_what_sent_nothing(store: Arc<dyn Store>) {
    let ids2 = || (Uuid::new_v4(), Uuid::new_v4());
    // PENDING: nothing sent. Cancelled, the epoch moved on, and the run's
    // next attempt cannot be recorded any more.
    let pending = create(
        store.as_ref(),
        intent(
            "ci",
            Some("p"),
            Action::Attach,
            ids2(),
            State::Pending,
            Labels::none(),
        ),
    )
    .await;
    let Cancelled::Done(done) = store.operation_cancel(&cancel_of(&pending)).await.unwrap() else {
        panic!("a pending operation is cancellable")
    };
    assert_eq!(
        (done.state, done.resolution),
        (State::Failed, Some(Resolution::Cancelled))
    );
    assert_eq!(done.lease_epoch, pending.lease_epoch + 1);
    assert_eq!(done.lease_owner, None);
    let reason = done.last_error.as_ref().map(|e| e.reason);
    assert_eq!(reason, Some(volume_reconciler::domain::Reason::Cancelled));
    let mut attempt = Transition::new(&pending, State::InProgress, "r0");
    attempt.add_attempt = true;
    attempt.request_sent = true;
    assert!(
        store
            .operation_transition(attempt, soon())
            .await
            .unwrap()
            .is_none(),
        "the run's next attempt is fenced"
    );
    let log = store.operation_events(pending.id).await.unwrap();
    assert!(log.iter().any(|e| e.kind == "cancelled"), "{log:?}");
    // Again: decided already.
    match store.operation_cancel(&cancel_of(&pending)).await.unwrap() {
        Cancelled::Not(op) => assert!(op.state.is_terminal()),
        other => panic!("{other:?}"),
    }

    // IN_PROGRESS with its first attempt counted: it may be leaving.
    let sending = create(
        store.as_ref(),
        intent(
            "ci",
            Some("s"),
            Action::Attach,
            ids2(),
            State::InProgress,
            Labels::none(),
        ),
    )
    .await;
    match store.operation_cancel(&cancel_of(&sending)).await.unwrap() {
        Cancelled::Not(op) => assert_eq!(op.state, State::InProgress),
        other => panic!("may be leaving, yet {other:?}"),
    }
    // Paused after a refusal: its attempt marked, now cancellable; the
    // mark is cleared by the next attempt's record.
    let mut pause = Transition::new(&sending, State::InProgress, "r0");
    pause.mark_unsent = true;
    let paused = store
        .operation_transition(pause, soon())
        .await
        .unwrap()
        .unwrap();
    assert!(paused.attempt_unsent);
    let read = store.operation_get(sending.id).await.unwrap().unwrap();
    assert!(read.attempt_unsent, "the mark is the row's");
    let mut again = Transition::new(&paused, State::InProgress, "r0");
    again.add_attempt = true;
    again.request_sent = true;
    let sent_again = store
        .operation_transition(again, soon())
        .await
        .unwrap()
        .unwrap();
    let read = store.operation_get(sending.id).await.unwrap().unwrap();
    assert!(
        !read.attempt_unsent && !sent_again.attempt_unsent,
        "cleared"
    );
    assert!(matches!(
        store.operation_cancel(&cancel_of(&read)).await.unwrap(),
        Cancelled::Not(_)
    ));
    let mut pause = Transition::new(&sent_again, State::InProgress, "r0");
    pause.mark_unsent = true;
    store
        .operation_transition(pause, soon())
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(
        store.operation_cancel(&cancel_of(&read)).await.unwrap(),
        Cancelled::Done(_)
    ));
    assert!(matches!(
        store
            .operation_cancel(&cancel_of(&Operation {
                id: Uuid::new_v4(),
                ..read
            }))
            .await
            .unwrap(),
        Cancelled::NotFound
    ));
}

async fn a_detach_supersedes_its_callers_unsent_attach(store: Arc<dyn Store>) {
    let target = (Uuid::new_v4(), Uuid::new_v4());
    let attach = create(
        store.as_ref(),
        intent(
            "ci",
            Some("a"),
            Action::Attach,
            target,
            State::Pending,
            Labels::none(),
        ),
    )
    .await;
    // Another caller's detach does not touch it.
    match store
        .operation_create(
            intent(
                "other",
                Some("d"),
                Action::Detach,
                target,
                State::InProgress,
                Labels::none(),
            ),
            soon(),
        )
        .await
    {
        Err(StoreError::VolumeBusy { operation_id, .. }) => assert_eq!(operation_id, attach.id),
        other => panic!("{other:?}"),
    }
    // Its caller's (an Ensure call's) cancels it and takes its place.
    let detach = create(
        store.as_ref(),
        intent(
            "ci",
            None,
            Action::Detach,
            target,
            State::InProgress,
            Labels::none(),
        ),
    )
    .await;
    assert_eq!(detach.action, Action::Detach);
    let old = store.operation_get(attach.id).await.unwrap().unwrap();
    assert_eq!(
        (old.state, old.resolution),
        (State::Failed, Some(Resolution::Cancelled))
    );
    let err = old.last_error.unwrap();
    assert_eq!(
        err.metadata.get("superseded_by").map(String::as_str),
        Some(detach.id.to_string().as_str())
    );

    // An attach whose request may be leaving is not superseded.
    let target = (Uuid::new_v4(), Uuid::new_v4());
    let leaving = create(
        store.as_ref(),
        intent(
            "ci",
            Some("b"),
            Action::Attach,
            target,
            State::InProgress,
            Labels::none(),
        ),
    )
    .await;
    match store
        .operation_create(
            intent(
                "ci",
                Some("d2"),
                Action::Detach,
                target,
                State::InProgress,
                Labels::none(),
            ),
            soon(),
        )
        .await
    {
        Err(StoreError::VolumeBusy { operation_id, .. }) => assert_eq!(operation_id, leaving.id),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        store
            .operation_get(leaving.id)
            .await
            .unwrap()
            .unwrap()
            .state,
        State::InProgress
    );
}

macro_rules! both_stores {
    ($($name:ident),* $(,)?) => {
        mod postgres {
            $( #[tokio::test] async fn $name() { super::$name(super::pg_store().await).await } )*
        }
        mod sqlite {
            $( #[tokio::test] async fn $name() { super::$name(super::sqlite_store().await).await } )*
        }
    };
}

both_stores!(
    labels_are_kept_and_lists_filter_on_all_of_them,
    a_creation_range_lists_newest_first_and_pages_each_once,
    a_cancel_is_one_compare_and_set_on_what_sent_nothing,
    a_detach_supersedes_its_callers_unsent_attach,
);

/// PostgreSQL, under the generic plans of the service's connections, on a
/// ledger of 40,000 operations (half labelled `cluster=east`, every one
/// with a `pv` of its own) created over ten hours: a page of a common
/// label, of a rare one, and of the last hour each reads about a page of
/// rows, newest first, never sorting what matched (EXPLAIN ANALYZE); an
/// hour long ago is read through the same index, newest first, unsorted
/// (its page passes over what was created since: no index of creation
/// time, which would cost every write two more index entries).
#[tokio::test]
async fn postgres_a_label_or_a_recent_time_range_page_reads_a_page_not_the_ledger() {
    support::init_logs();
    let url = support::pg::fresh_database().await;
    let store = volume_reconciler::store::open(&url, 4).await.unwrap();
    let mut admin = support::pg::Admin::connect(&url).await;
    for sql in [
        "INSERT INTO operations (id, idempotency_key, fingerprint, action, state, resolution,
            server_id, volume_id, deadline_at, created_at, completed_at, labels)
         SELECT gen_random_uuid(), 'done-' || g, 'f', 'attach', 'succeeded', 'response',
            gen_random_uuid(), gen_random_uuid(), now(),
            now() - (40000 - g) * interval '900 milliseconds', now(),
            jsonb_build_object('cluster', CASE WHEN g % 2 = 0 THEN 'east' ELSE 'west' END,
                               'pv', 'pv-' || g)
         FROM generate_series(1, 40000) g",
        "ANALYZE operations",
        "ANALYZE operation_labels",
        "SET plan_cache_mode = force_generic_plan",
    ] {
        admin.run(sql).await;
    }
    let tooling = volume_reconciler::store::pg::tooling::list_statement;
    let with = |l: &[(&str, &str)]| OperationFilter {
        labels: labels(l),
        ..Default::default()
    };
    let range = |from: i64, to: Option<i64>| OperationFilter {
        created: TimeRange {
            from: Some(chrono::Utc::now() - chrono::Duration::hours(from)),
            before: to.map(|h| chrono::Utc::now() - chrono::Duration::hours(h)),
        },
        ..Default::default()
    };
    let cases = [
        (
            "common",
            tooling(&with(&[("cluster", "east")]), None, 50),
            "(text, text)",
            "('cluster', 'east')".to_string(),
            "operation_labels_pkey",
            true,
        ),
        (
            "rare",
            tooling(&with(&[("pv", "pv-123")]), None, 50),
            "(text, text)",
            "('pv', 'pv-123')".to_string(),
            "operation_labels_pkey",
            true,
        ),
        (
            "the last hour",
            tooling(&range(1, None), None, 50),
            "(timestamptz)",
            "(now() - interval '1 hour')".to_string(),
            "operations_seq_key",
            true,
        ),
        (
            "an hour long ago",
            tooling(&range(6, Some(5)), None, 50),
            "(timestamptz, timestamptz)",
            "(now() - interval '6 hours', now() - interval '5 hours')".to_string(),
            "operations_seq_key",
            false,
        ),
    ];
    for (i, (what, sql, types, args, index, a_page)) in cases.iter().enumerate() {
        admin.run(&format!("PREPARE page{i}{types} AS {sql}")).await;
        let plan = admin
            .texts(&format!(
                "EXPLAIN (ANALYZE, COSTS OFF) EXECUTE page{i}{args}"
            ))
            .await
            .join("\n");
        assert!(plan.contains(index), "{what}: {plan}");
        assert!(
            plan.contains("Backward"),
            "{what}: newest first by the index: {plan}"
        );
        assert!(!plan.contains("Sort"), "{what}: nothing sorted: {plan}");
        assert!(!plan.contains("Seq Scan"), "{what}: {plan}");
        if !a_page {
            continue;
        }
        // Rows read: about a page (the limit's 51), whatever matched.
        for line in plan.lines().filter(|l| l.contains("actual")) {
            let rows: u64 = line
                .split("rows=")
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
                .and_then(|r| r.parse().ok())
                .unwrap_or(0);
            assert!(rows <= 51, "{what}: a node read {rows} rows: {plan}");
        }
    }
    store.close().await;
}
