//! Operating a fleet, through the real server chain: labels asked with a
//! call, kept, shown and filtered on (both ledgers); a list by creation
//! time paged while operations change and new ones come, each at most
//! once; a bulk resolve whose dry run touches nothing and whose real run
//! touches exactly what the dry run listed, audited (docs/api.md,
//! "Operating a fleet").

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use crate::support;

use support::lifecycle::*;
use support::{AppOptions, Ledger, TestApp, error_info, spawn_app, with_timeout};
use tonic::Code;
use uuid::Uuid;
use volume_reconciler::domain::{Reason, Resolution, State};
use volume_reconciler::grpc::pb;
use volume_reconciler::sim::{Fault, FaultOp, FaultRule};

fn labels(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn labelled_attach(key: &str, (s, v): (Uuid, Uuid), l: &[(&str, &str)]) -> pb::AttachVolumeRequest {
    pb::AttachVolumeRequest {
        labels: labels(l),
        ..attach(key, s, v)
    }
}

fn by(filter: pb::OperationFilter) -> pb::ListOperationsRequest {
    pb::ListOperationsRequest {
        filter: Some(filter),
        page_size: 100,
        ..Default::default()
    }
}

async fn list_ids(app: &TestApp, req: pb::ListOperationsRequest) -> Vec<String> {
    app.raw()
        .list_operations(req)
        .await
        .unwrap()
        .into_inner()
        .operations
        .into_iter()
        .map(|o| o.id)
        .collect()
}

/// Labels asked with an attach are kept with the operation (its reply,
/// GetOperation, the ledger row, the reconcile log's `recorded` event),
/// part of the request (a replay of the key with other labels is another
/// request; an Ensure call with other labels is another identity's
/// parameters), checked at the edge, and filtered on: every label given
/// must match.
async fn labels_round_trip_and_filter(ledger: Ledger) {
    let app = spawn_app(with_history(ledger)).await;
    let mut c = app.raw();
    let east = [("cluster", "east"), ("csi.k8s.io/pv", "pv-1")];
    let (first, second, third) = (ids(), ids(), ids());
    let op = c
        .attach_volume(labelled_attach("l1", first, &east))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(op.state, pb::State::Succeeded as i32);
    assert_eq!(op.labels, labels(&east), "the reply carries them");
    let id: Uuid = op.id.parse().unwrap();
    let row = row(&app, id).await;
    assert_eq!(
        row.labels.to_string(),
        "cluster=east,csi.k8s.io/pv=pv-1",
        "the ledger keeps them"
    );
    assert_eq!(app.sim.attach_requests(first.1), 1, "one request at Nova");
    let got = c
        .get_operation(pb::GetOperationRequest {
            operation_id: op.id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.labels, labels(&east));
    let recorded = log(&app, id)
        .await
        .into_iter()
        .find(|e| e.kind == "recorded")
        .expect("a recorded event");
    assert_eq!(
        recorded.metadata.get("labels").map(String::as_str),
        Some("cluster=east,csi.k8s.io/pv=pv-1"),
        "{recorded:?}"
    );
    c.attach_volume(labelled_attach("l2", second, &[("cluster", "west")]))
        .await
        .unwrap();
    c.attach_volume(attach("l3", third.0, third.1))
        .await
        .unwrap();

    // Filters: one label, two (all must match), one that matches none.
    let only = |l: &[(&str, &str)]| {
        by(pb::OperationFilter {
            labels: labels(l),
            ..Default::default()
        })
    };
    assert_eq!(
        list_ids(&app, only(&[("cluster", "east")])).await,
        std::slice::from_ref(&op.id)
    );
    assert_eq!(
        list_ids(&app, only(&east)).await,
        std::slice::from_ref(&op.id)
    );
    assert!(
        list_ids(
            &app,
            only(&[("cluster", "east"), ("csi.k8s.io/pv", "pv-2")])
        )
        .await
        .is_empty()
    );
    assert_eq!(list_ids(&app, only(&[])).await.len(), 3);

    // A replay of the key with other labels is another request.
    let reused = c
        .attach_volume(labelled_attach("l1", first, &[("cluster", "west")]))
        .await
        .unwrap_err();
    assert_eq!(reused.code(), Code::FailedPrecondition, "{reused:?}");
    assert_eq!(error_info(&reused).0, "IDEMPOTENCY_KEY_REUSED");
    // With the same labels, it joins (the same operation).
    let again = c
        .attach_volume(labelled_attach("l1", first, &east))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.id, op.id);
    assert_eq!(app.sim.attach_requests(first.1), 1, "still one request");

    // Checked at the edge, naming the field and the key.
    let bad = c
        .attach_volume(labelled_attach("l4", ids(), &[("Bad Key", "v")]))
        .await
        .unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
    let (reason, md) = error_info(&bad);
    assert_eq!(
        (reason.as_str(), md.get("field").map(String::as_str)),
        ("INVALID_FIELD", Some("labels"))
    );
    assert!(bad.message().contains("Bad Key"), "{}", bad.message());
    let nine: Vec<(String, String)> = (0..9).map(|i| (format!("k{i}"), "v".into())).collect();
    let too_many = c
        .attach_volume(pb::AttachVolumeRequest {
            labels: nine.into_iter().collect(),
            ..attach("l5", Uuid::new_v4(), Uuid::new_v4())
        })
        .await
        .unwrap_err();
    assert_eq!(too_many.code(), Code::InvalidArgument);
    // Nothing was recorded for the refused calls.
    assert_eq!(list_ids(&app, only(&[])).await.len(), 3);

    // An Ensure call left open (its request's answer lost, the volume not
    // seen attached by its deadline) with some labels: the same call with
    // others is another identity's parameters (the volume busy), with the
    // same ones it joins.
    let held = ids();
    app.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::DelayBeforeEffect { ms: 60_000 }).volume(held.1),
    );
    let ensure = |l: &[(&str, &str)]| pb::EnsureAttachedRequest {
        server_id: held.0.to_string(),
        volume_id: held.1.to_string(),
        labels: labels(l),
        ..Default::default()
    };
    let open = c
        .ensure_attached(with_timeout(ensure(&[("pv", "pv-9")]), secs(1.0)))
        .await
        .unwrap_err();
    let open_id = error_info(&open)
        .1
        .get("operation_id")
        .cloned()
        .expect("its id");
    let busy = c
        .ensure_attached(with_timeout(ensure(&[("pv", "pv-other")]), secs(1.0)))
        .await
        .unwrap_err();
    assert_eq!(
        (busy.code(), error_info(&busy).0.as_str()),
        (Code::Aborted, "VOLUME_BUSY"),
        "{busy:?}"
    );
    let joined = c
        .ensure_attached(with_timeout(ensure(&[("pv", "pv-9")]), secs(1.0)))
        .await
        .unwrap_err();
    assert_eq!(
        error_info(&joined).1.get("operation_id"),
        Some(&open_id),
        "the same labels join: {joined:?}"
    );
    assert_eq!(app.sim.attach_requests(held.1), 1, "one request at Nova");
    app.stop().await;
}

crate::on_both_ledgers!(labels_round_trip_and_filter);

/// Attaches held at Nova for a while are decided while an operator pages
/// through the ones created in a range, two at a time, and new ones keep
/// coming: each listed operation is listed at most once (the page's
/// position is the operation's sequence, never its last change), none of the
/// range is missed, and the range's ends hold.
#[tokio::test]
async fn a_time_range_list_under_concurrent_writes_returns_each_operation_at_most_once() {
    let app = spawn_app(AppOptions::default()).await;
    let mut c = app.raw();
    // Ten attaches, each decided between 0.5 and 5 s from now.
    let mut ours = Vec::new();
    let mut calls = Vec::new();
    for i in 0..10u64 {
        let target = ids();
        app.sim.add_fault(
            FaultRule::new(
                FaultOp::Attach,
                Fault::DelayAfterEffect { ms: 500 + i * 450 },
            )
            .volume(target.1),
        );
        let mut c = app.raw();
        calls.push(tokio::spawn(async move {
            c.attach_volume(with_timeout(
                attach(&format!("t{i}"), target.0, target.1),
                secs(30.0),
            ))
            .await
        }));
        ours.push(target.1);
    }
    let store = app.store.clone();
    support::eventually(secs(15.0), "the ten are recorded", || {
        let store = store.clone();
        async move {
            store
                .operation_list(&Default::default(), None, 100)
                .await
                .unwrap()
                .operations
                .len()
                == 10
        }
    })
    .await;
    let all = app
        .store
        .operation_list(&Default::default(), None, 100)
        .await
        .unwrap()
        .operations;
    let from = all.iter().map(|o| o.created_at).min().unwrap();
    let range = pb::OperationFilter {
        created_after: Some(volume_reconciler::grpc::convert::timestamp(from)),
        ..Default::default()
    };
    // More keep coming while the list is paged.
    let stop = tokio_util::sync::CancellationToken::new();
    let writer = {
        let (mut c, stop) = (app.raw(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0;
            while !stop.is_cancelled() {
                let (s, v) = ids();
                c.attach_volume(attach(&format!("more-{n}"), s, v))
                    .await
                    .unwrap();
                n += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            n
        })
    };
    let (mut seen, mut token, mut pages) = (Vec::new(), String::new(), 0);
    loop {
        let page = c
            .list_operations(pb::ListOperationsRequest {
                filter: Some(range.clone()),
                page_size: 2,
                page_token: token.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        seen.extend(page.operations.into_iter().map(|o| o.id));
        pages += 1;
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
        // The held ones are decided between pages.
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    stop.cancel();
    let more = writer.await.unwrap();
    for call in calls {
        call.await.unwrap().unwrap();
    }
    let distinct: BTreeSet<&String> = seen.iter().collect();
    assert_eq!(distinct.len(), seen.len(), "listed twice: {seen:?}");
    for op in &all {
        assert!(seen.contains(&op.id.to_string()), "{} missed", op.id);
    }
    assert!(pages >= 5 && more > 0, "{pages} pages, {more} new ones");
    // Each listed operation was created in the range.
    for id in &seen {
        let op = row(&app, id.parse().unwrap()).await;
        assert!(op.created_at >= from);
    }
    // The ten were decided while listed: the list did not hold them up.
    for v in &ours {
        assert_eq!(app.sim.attach_requests(*v), 1);
        assert!(app.sim.attach_effects(*v) == 1);
    }
    // A range's end is exclusive: nothing created at or after it.
    let before_first = pb::OperationFilter {
        created_before: Some(volume_reconciler::grpc::convert::timestamp(from)),
        ..Default::default()
    };
    assert!(list_ids(&app, by(before_first)).await.is_empty());
    // A range that ends before it begins names its field.
    let backwards = c
        .list_operations(by(pb::OperationFilter {
            created_after: Some(volume_reconciler::grpc::convert::timestamp(from)),
            created_before: Some(volume_reconciler::grpc::convert::timestamp(
                from - chrono::Duration::seconds(1),
            )),
            ..Default::default()
        }))
        .await
        .unwrap_err();
    assert_eq!(
        error_info(&backwards).1.get("field").map(String::as_str),
        Some("filter.created_before")
    );
    app.stop().await;
}

/// Operations left UNKNOWN for an operator, some labelled `batch=a`, some
/// `batch=b`: a bulk resolve of `batch=a` in state UNKNOWN, dry run first,
/// lists exactly those and touches nothing (rows and logs as they were);
/// the real run decides exactly what the dry run listed (the others left
/// alone), each with its audit event (the caller, the call's id, the
/// filter), and a pinned operation decided meanwhile by someone else is
/// reported as no longer matching, never decided twice; the same call
/// again finds nothing left to do. Nova saw nothing of it.
#[tokio::test]
async fn a_bulk_resolves_dry_run_touches_nothing_and_its_real_run_exactly_what_it_listed() {
    let app = spawn_app(AppOptions::default()).await;
    let mut a = Vec::new();
    let mut b = Vec::new();
    for i in 0..8 {
        let batch = if i % 3 == 2 { "b" } else { "a" };
        let mut new = support::pending_attach(
            &format!("stuck-{i}"),
            "gone",
            Duration::ZERO,
            Duration::from_secs(60),
        );
        new.state = State::Unknown;
        new.attempts = 1;
        new.labels =
            volume_reconciler::domain::Labels::parse("labels", [("batch", batch)]).unwrap();
        let id = support::record_new(app.store.as_ref(), new).await;
        let op = row(&app, id).await;
        if batch == "a" { a.push(op) } else { b.push(op) }
    }
    let before_a: Vec<_> = {
        let mut v = Vec::new();
        for op in &a {
            v.push((row(&app, op.id).await, log(&app, op.id).await.len()));
        }
        v
    };
    let filter = pb::OperationFilter {
        state: pb::State::Unknown as i32,
        labels: labels(&[("batch", "a")]),
        ..Default::default()
    };
    let request = |dry_run: bool| pb::ResolveOperationsRequest {
        filter: Some(filter.clone()),
        state: pb::State::Failed as i32,
        reason: "the host was rebuilt; nothing is attached".into(),
        dry_run,
        max_count: 0,
        rate_per_second: 2.0,
    };
    let mut c = app.raw();
    let dry = c
        .resolve_operations(request(true))
        .await
        .unwrap()
        .into_inner();
    assert!(dry.dry_run && !dry.more && !dry.interrupted);
    let listed: BTreeSet<String> = dry.items.iter().map(|i| i.operation_id.clone()).collect();
    let want: BTreeSet<String> = a.iter().map(|o| o.id.to_string()).collect();
    assert_eq!(listed, want, "the dry run lists batch a's, no other");
    assert!(
        dry.items
            .iter()
            .all(|i| i.outcome == pb::BulkOutcome::WouldAct as i32)
    );
    for (op, events) in &before_a {
        let now = row(&app, op.id).await;
        assert_eq!(
            (now.state, now.updated_at),
            (op.state, op.updated_at),
            "untouched"
        );
        assert_eq!(log(&app, op.id).await.len(), *events, "nothing logged");
    }

    // The real run, two a second, newest first; once it decided its
    // first, someone else decides its last one (its turn 2.5 s away).
    let real = {
        let mut c = app.raw();
        let req = request(false);
        tokio::spawn(async move { c.resolve_operations(req).await })
    };
    let (newest, oldest) = (a[a.len() - 1].id, a[0].id);
    let store = app.store.clone();
    support::eventually(secs(20.0), "the bulk call decided its first", || {
        let store = store.clone();
        async move {
            store
                .operation_get(newest)
                .await
                .unwrap()
                .unwrap()
                .state
                .is_terminal()
        }
    })
    .await;
    c.resolve_operation(pb::ResolveOperationRequest {
        operation_id: oldest.to_string(),
        state: pb::State::Succeeded as i32,
        reason: "seen on the hypervisor".into(),
    })
    .await
    .unwrap();
    let decided_elsewhere = oldest;
    let real = real.await.unwrap().unwrap().into_inner();
    let outcome_of = |id: Uuid| {
        real.items
            .iter()
            .find(|i| i.operation_id == id.to_string())
            .map(|i| i.outcome)
    };
    assert_eq!(
        outcome_of(decided_elsewhere),
        Some(pb::BulkOutcome::NoLongerMatches as i32),
        "pinned, and left alone when its turn came"
    );
    let acted: BTreeSet<String> = real
        .items
        .iter()
        .filter(|i| i.outcome == pb::BulkOutcome::Acted as i32)
        .map(|i| i.operation_id.clone())
        .collect();
    let mut expected = want.clone();
    expected.remove(&decided_elsewhere.to_string());
    assert_eq!(
        acted, expected,
        "exactly the dry run's, less the one decided meanwhile"
    );
    for op in &a {
        let now = row(&app, op.id).await;
        assert!(now.state.is_terminal(), "{:?}", now.state);
        let audit: Vec<_> = log(&app, op.id)
            .await
            .into_iter()
            .filter(|e| e.kind == "operator_resolved")
            .collect();
        assert_eq!(audit.len(), 1, "decided once: {audit:?}");
        if op.id == decided_elsewhere {
            assert_eq!(now.state, State::Succeeded, "left as decided");
            continue;
        }
        assert_eq!(
            (now.state, now.resolution),
            (State::Failed, Some(Resolution::Operator))
        );
        assert_eq!(
            now.last_error.as_ref().map(|e| e.reason),
            Some(Reason::OperatorResolved)
        );
        let md = &audit[0].metadata;
        assert_eq!(md.get("bulk_id"), Some(&real.bulk_id), "{md:?}");
        assert_eq!(
            md.get("filter").map(String::as_str),
            Some("state=unknown label=batch=a")
        );
    }
    for op in &b {
        assert_eq!(
            row(&app, op.id).await.state,
            State::Unknown,
            "batch b untouched"
        );
    }
    // Again: nothing left to do (safe to repeat).
    let again = c
        .resolve_operations(request(false))
        .await
        .unwrap()
        .into_inner();
    assert!(again.items.is_empty(), "{again:?}");
    assert_eq!(
        app.sim.truth().attach_requests.values().sum::<u32>(),
        0,
        "Nova saw nothing"
    );
    app.stop().await;
}
