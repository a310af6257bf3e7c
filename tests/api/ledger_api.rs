//! The ledger and the gRPC API through the real server: idempotency-key
//! semantics, volume busy, concurrent replays, pagination, validation.

use crate::on_both_ledgers;
use crate::support;

use std::collections::HashSet;
use std::time::Duration;

use support::{AppOptions, Ledger, error_info, spawn_app, uuid, with_timeout};
use tonic::Code;
use volume_reconciler::grpc::pb;
use volume_reconciler::sim::{Fault, FaultOp, FaultRule};

fn attach_req(key: &str, server: &str, volume: &str) -> pb::AttachVolumeRequest {
    pb::AttachVolumeRequest {
        idempotency_key: key.into(),
        server_id: server.into(),
        volume_id: volume.into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn a_replayed_key_returns_the_same_operation_without_calling_nova_again() {
    let app = spawn_app(AppOptions::default()).await;
    let (server, volume) = (uuid(), uuid());
    let mut c = app.raw();
    let first = c
        .attach_volume(with_timeout(
            attach_req("k-1", &server, &volume),
            Duration::from_secs(10),
        ))
        .await
        .unwrap()
        .into_inner();
    let second = c
        .attach_volume(with_timeout(
            attach_req("k-1", &server, &volume),
            Duration::from_secs(10),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.id, second.id);
    assert_eq!(second.state, pb::State::Succeeded as i32);
    let v = volume.parse().unwrap();
    assert_eq!(
        app.sim.attach_requests(v),
        1,
        "the replay must not reach Nova"
    );
    assert!(app.sim.is_attached(server.parse().unwrap(), v));
    let by_key = c
        .get_operation(pb::GetOperationRequest {
            operation_id: String::new(),
            idempotency_key: "k-1".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(by_key.id, first.id);
    app.stop().await;
}

#[tokio::test]
async fn a_key_reused_with_other_parameters_is_refused() {
    let app = spawn_app(AppOptions::default()).await;
    let (server, volume) = (uuid(), uuid());
    let mut c = app.raw();
    let first = c
        .attach_volume(with_timeout(
            attach_req("k-2", &server, &volume),
            Duration::from_secs(10),
        ))
        .await
        .unwrap()
        .into_inner();
    let mut other = attach_req("k-2", &server, &volume);
    other.device = "/dev/vdc".into();
    let err = c
        .attach_volume(with_timeout(other, Duration::from_secs(10)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let (reason, meta) = error_info(&err);
    assert_eq!(reason, "IDEMPOTENCY_KEY_REUSED");
    assert_eq!(meta["operation_id"], first.id);
    // A detach under the same key is a reuse too.
    let err = c
        .detach_volume(with_timeout(
            pb::DetachVolumeRequest {
                labels: Default::default(),
                idempotency_key: "k-2".into(),
                server_id: server.clone(),
                volume_id: volume.clone(),
            },
            Duration::from_secs(10),
        ))
        .await
        .unwrap_err();
    assert_eq!(error_info(&err).0, "IDEMPOTENCY_KEY_REUSED");
    assert_eq!(app.sim.attach_requests(volume.parse().unwrap()), 1);
    app.stop().await;
}

#[tokio::test]
async fn a_second_key_for_a_busy_volume_is_aborted_naming_the_operation_in_flight() {
    let app = spawn_app(AppOptions::default()).await;
    let (server, volume) = (uuid(), uuid());
    app.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::DelayBeforeEffect { ms: 5000 })
            .volume(volume.parse().unwrap()),
    );
    let mut c1 = app.raw();
    let (s1, v1) = (server.clone(), volume.clone());
    let first = tokio::spawn(async move {
        c1.attach_volume(with_timeout(
            attach_req("busy-1", &s1, &v1),
            Duration::from_secs(20),
        ))
        .await
    });
    let store = app.store.clone();
    let vid = volume.parse().unwrap();
    support::eventually(
        Duration::from_secs(10),
        "the first attach is recorded",
        || {
            let store = store.clone();
            async move {
                let page = store
                    .operation_list(
                        &volume_reconciler::store::OperationFilter {
                            volume_id: Some(vid),
                            ..Default::default()
                        },
                        None,
                        10,
                    )
                    .await
                    .unwrap();
                !page.operations.is_empty()
            }
        },
    )
    .await;
    let err = app
        .raw()
        .attach_volume(with_timeout(
            attach_req("busy-2", &server, &volume),
            Duration::from_secs(10),
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Aborted, "{err:?}");
    let (reason, meta) = error_info(&err);
    assert_eq!(reason, "VOLUME_BUSY");
    let first = first.await.unwrap().unwrap().into_inner();
    assert_eq!(meta["operation_id"], first.id);
    assert_eq!(first.state, pb::State::Succeeded as i32);
    assert_eq!(app.sim.attach_effects(vid), 1);
    app.stop().await;
}

#[tokio::test]
async fn fifty_concurrent_attaches_with_one_key_create_exactly_one_operation() {
    let app = spawn_app(AppOptions::default()).await;
    let (server, volume) = (uuid(), uuid());
    // Slow enough that the calls overlap.
    app.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::DelayBeforeEffect { ms: 300 })
            .volume(volume.parse().unwrap()),
    );
    let mut handles = Vec::new();
    for _ in 0..50 {
        let mut c = app.raw();
        let (s, v) = (server.clone(), volume.clone());
        handles.push(tokio::spawn(async move {
            c.attach_volume(with_timeout(
                attach_req("same-key", &s, &v),
                Duration::from_secs(30),
            ))
            .await
        }));
    }
    let mut ids = HashSet::new();
    for h in handles {
        let op = h
            .await
            .unwrap()
            .expect("every caller gets the operation")
            .into_inner();
        assert_eq!(op.state, pb::State::Succeeded as i32);
        ids.insert(op.id);
    }
    assert_eq!(ids.len(), 1, "one key, one operation");
    let vid = volume.parse().unwrap();
    let page = app
        .store
        .operation_list(
            &volume_reconciler::store::OperationFilter {
                volume_id: Some(vid),
                ..Default::default()
            },
            None,
            100,
        )
        .await
        .unwrap();
    assert_eq!(page.operations.len(), 1, "exactly one row in the ledger");
    assert_eq!(app.sim.attach_requests(vid), 1, "Nova was called once");
    assert_eq!(app.sim.attach_effects(vid), 1);
    app.stop().await;
}

#[tokio::test]
async fn pages_are_stable_while_rows_are_inserted() {
    let app = spawn_app(AppOptions::default()).await;
    let server = uuid();
    let mut c = app.raw();
    let mut created = HashSet::new();
    for i in 0..23 {
        let op = c
            .attach_volume(with_timeout(
                attach_req(&format!("page-{i}"), &server, &uuid()),
                Duration::from_secs(10),
            ))
            .await
            .unwrap()
            .into_inner();
        created.insert(op.id);
    }
    let mut seen = Vec::new();
    let mut token = String::new();
    let mut inserted = 0;
    loop {
        let page = c
            .list_operations(pb::ListOperationsRequest {
                server_id: server.clone(),
                page_size: 5,
                page_token: token.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        // Newest first within a page.
        let times: Vec<_> = page
            .operations
            .iter()
            .map(|o| o.created_at.unwrap().seconds)
            .collect();
        assert!(
            times.windows(2).all(|w| w[0] >= w[1]),
            "newest first: {times:?}"
        );
        seen.extend(page.operations.into_iter().map(|o| o.id));
        // Concurrent inserts between pages must not shift what follows.
        c.attach_volume(with_timeout(
            attach_req(&format!("late-{inserted}"), &server, &uuid()),
            Duration::from_secs(10),
        ))
        .await
        .unwrap();
        inserted += 1;
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    let unique: HashSet<_> = seen.iter().cloned().collect();
    assert_eq!(unique.len(), seen.len(), "no operation appears twice");
    assert!(
        created.is_subset(&unique),
        "every operation that existed at the start is listed exactly once"
    );
    assert_eq!(
        unique.len(),
        created.len(),
        "rows inserted after the first page do not appear behind the cursor"
    );
    app.stop().await;
}

#[tokio::test]
async fn every_invalid_field_is_named_with_invalid_argument() {
    let app = spawn_app(AppOptions::default()).await;
    let mut c = app.raw();
    let (s, v) = (uuid(), uuid());
    let long_key = "k".repeat(256);
    let cases: Vec<(pb::AttachVolumeRequest, &str)> = vec![
        (attach_req("", &s, &v), "idempotency_key"),
        (attach_req(&long_key, &s, &v), "idempotency_key"),
        (attach_req("bad\u{7}key", &s, &v), "idempotency_key"),
        (attach_req("k", "", &v), "server_id"),
        (attach_req("k", "not-a-uuid", &v), "server_id"),
        (attach_req("k", &s, ""), "volume_id"),
        (
            attach_req("k", &s, "7ebed2ce85b340b584ae8cc725c37ed2"),
            "volume_id",
        ),
        (
            pb::AttachVolumeRequest {
                device: "vdb".into(),
                ..attach_req("k", &s, &v)
            },
            "device",
        ),
        (
            pb::AttachVolumeRequest {
                device: "/dev/VDB".into(),
                ..attach_req("k", &s, &v)
            },
            "device",
        ),
        (
            pb::AttachVolumeRequest {
                tag: "a/b".into(),
                ..attach_req("k", &s, &v)
            },
            "tag",
        ),
        (
            pb::AttachVolumeRequest {
                tag: "t".repeat(61),
                ..attach_req("k", &s, &v)
            },
            "tag",
        ),
    ];
    for (req, field) in cases {
        let err = c
            .attach_volume(with_timeout(req.clone(), Duration::from_secs(5)))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{req:?}: {err:?}");
        let (reason, meta) = error_info(&err);
        assert_eq!(reason, "INVALID_FIELD");
        assert_eq!(meta["field"], field, "{req:?}");
        assert!(
            err.message().contains(field),
            "the message names the field: {}",
            err.message()
        );
    }
    let err = c
        .detach_volume(pb::DetachVolumeRequest {
            labels: Default::default(),
            idempotency_key: "d".into(),
            server_id: s.clone(),
            volume_id: "x".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(error_info(&err).1["field"], "volume_id");
    for (id, key) in [("", ""), ("x", "y")] {
        let err = c
            .get_operation(pb::GetOperationRequest {
                operation_id: id.into(),
                idempotency_key: key.into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(
            err.code(),
            Code::InvalidArgument,
            "exactly one of id and key"
        );
    }
    let err = c
        .get_operation(pb::GetOperationRequest {
            operation_id: "nope".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(error_info(&err).1["field"], "operation_id");
    let err = c
        .get_operation(pb::GetOperationRequest {
            operation_id: uuid(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    for (req, field) in [
        (
            pb::ListOperationsRequest {
                page_size: -1,
                ..Default::default()
            },
            "page_size",
        ),
        (
            pb::ListOperationsRequest {
                page_size: 100_000,
                ..Default::default()
            },
            "page_size",
        ),
        (
            pb::ListOperationsRequest {
                page_token: "garbage".into(),
                ..Default::default()
            },
            "page_token",
        ),
        (
            pb::ListOperationsRequest {
                server_id: "x".into(),
                ..Default::default()
            },
            "server_id",
        ),
        (
            pb::ListOperationsRequest {
                state: 42,
                ..Default::default()
            },
            "state",
        ),
    ] {
        let err = c.list_operations(req).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert_eq!(error_info(&err).1["field"], field);
    }
    for (req, field) in [(
        pb::ListOperationEventsRequest {
            operation_id: "x".into(),
        },
        "operation_id",
    )] {
        let err = c.list_operation_events(req).await.unwrap_err();
        assert_eq!(error_info(&err).1["field"], field);
    }
    // Nothing reached Nova and nothing was recorded.
    let page = app
        .store
        .operation_list(&Default::default(), None, 10)
        .await
        .unwrap();
    assert!(page.operations.is_empty());
    app.stop().await;
}

#[tokio::test]
async fn reflection_lets_a_grpcurl_style_client_discover_the_service() {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let app = spawn_app(AppOptions::default()).await;
    let channel = tonic::transport::Endpoint::from_shared(app.grpc_url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = ServerReflectionClient::new(channel);
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = c
        .server_reflection_info(tokio_stream::iter(vec![req]))
        .await
        .unwrap()
        .into_inner();
    let resp = stream.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = resp.message_response else {
        panic!("unexpected {resp:?}")
    };
    let names: Vec<_> = list.service.iter().map(|s| s.name.as_str()).collect();
    assert!(
        names.contains(&"volume_reconciler.v1.VolumeReconciler"),
        "{names:?}"
    );
    assert!(names.contains(&"grpc.health.v1.Health"), "{names:?}");
    app.stop().await;
}

// ---------------------------------------------------------------------
// Reads are scoped per caller.
// ---------------------------------------------------------------------

/// Two orchestrators and an operator, by token.
fn scoped_tokens() -> String {
    use volume_reconciler::grpc::auth::sha256_hex;
    format!(
        "ci-a:orchestrator:{},ci-b:orchestrator:{},oncall:operator:{}",
        sha256_hex("token-a"),
        sha256_hex("token-b"),
        sha256_hex("token-ops")
    )
}

fn bearer<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut r = with_timeout(msg, Duration::from_secs(10));
    r.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    r
}

/// What a refusal tells, with `id` (the one asked about) blanked out: the
/// code, the reason, the message and the metadata. Another caller's
/// operation and an id nobody has must look alike here.
fn refusal_shape(s: &tonic::Status, id: &str) -> (Code, String, String, Vec<(String, String)>) {
    let (reason, meta) = error_info(s);
    let blank = |v: &str| v.replace(id, "<id>");
    let mut meta: Vec<_> = meta.iter().map(|(k, v)| (k.clone(), blank(v))).collect();
    meta.sort();
    (s.code(), reason, blank(s.message()), meta)
}

/// Every page of `ListOperations` for `token` with `caller`, two at a
/// time: the ids, and the size of each page.
async fn list_all(
    c: &mut pb::volume_reconciler_client::VolumeReconcilerClient<tonic::transport::Channel>,
    token: &str,
    server: &str,
    caller: &str,
) -> Result<(Vec<String>, Vec<usize>), tonic::Status> {
    let (mut ids, mut sizes, mut page_token) = (Vec::new(), Vec::new(), String::new());
    loop {
        let page = c
            .list_operations(bearer(
                pb::ListOperationsRequest {
                    server_id: server.into(),
                    caller: caller.into(),
                    page_size: 2,
                    page_token: page_token.clone(),
                    ..Default::default()
                },
                token,
            ))
            .await?
            .into_inner();
        sizes.push(page.operations.len());
        ids.extend(page.operations.into_iter().map(|o| o.id));
        if page.next_page_token.is_empty() {
            return Ok((ids, sizes));
        }
        page_token = page.next_page_token;
    }
}

/// An orchestrator reads, lists, watches and follows the log of its own
/// operations only: another caller's id is NOT_FOUND exactly as an id
/// nobody has, its list is its own (full pages: filtered in the store's
/// query) whatever `caller` it names, and ReconcileOperation is refused
/// alike for every id. An operator reads everything.
async fn an_orchestrator_reads_only_its_own_operations_and_an_operator_reads_all(ledger: Ledger) {
    let app = spawn_app(
        AppOptions::default()
            .on(ledger)
            .arg("--auth-tokens", &scoped_tokens()),
    )
    .await;
    let mut c = app.raw();
    let server = uuid();
    // Interleaved, so that a page of the whole ledger holds both callers'.
    let (mut of_a, mut of_b) = (Vec::new(), Vec::new());
    for i in 0..3 {
        for (token, ops) in [("token-a", &mut of_a), ("token-b", &mut of_b)] {
            let op = c
                .attach_volume(bearer(
                    attach_req(&format!("k-{i}"), &server, &uuid()),
                    token,
                ))
                .await
                .unwrap()
                .into_inner();
            ops.push(op.id);
        }
    }
    let newest_first = |ids: &[String]| ids.iter().rev().cloned().collect::<Vec<_>>();
    let a0 = of_a[0].clone();
    let missing = uuid();
    let mut told_b = Vec::new();

    // By id: A's operation is, to B, an operation that does not exist.
    let get = |id: &str| pb::GetOperationRequest {
        operation_id: id.into(),
        ..Default::default()
    };
    let foreign = c
        .get_operation(bearer(get(&a0), "token-b"))
        .await
        .unwrap_err();
    let absent = c
        .get_operation(bearer(get(&missing), "token-b"))
        .await
        .unwrap_err();
    assert_eq!(foreign.code(), Code::NotFound, "{foreign:?}");
    assert_eq!(
        refusal_shape(&foreign, &a0),
        refusal_shape(&absent, &missing)
    );
    told_b.push(format!("{foreign:?}"));

    let events = |id: &str| pb::ListOperationEventsRequest {
        operation_id: id.into(),
    };
    let foreign = c
        .list_operation_events(bearer(events(&a0), "token-b"))
        .await
        .unwrap_err();
    let absent = c
        .list_operation_events(bearer(events(&missing), "token-b"))
        .await
        .unwrap_err();
    assert_eq!(foreign.code(), Code::NotFound, "{foreign:?}");
    assert_eq!(
        refusal_shape(&foreign, &a0),
        refusal_shape(&absent, &missing)
    );
    told_b.push(format!("{foreign:?}"));

    let watch = |id: &str| pb::WatchOperationRequest {
        operation_id: id.into(),
    };
    let foreign = c
        .watch_operation(bearer(watch(&a0), "token-b"))
        .await
        .map(drop)
        .unwrap_err();
    let absent = c
        .watch_operation(bearer(watch(&missing), "token-b"))
        .await
        .map(drop)
        .unwrap_err();
    assert_eq!(foreign.code(), Code::NotFound, "{foreign:?}");
    assert_eq!(
        refusal_shape(&foreign, &a0),
        refusal_shape(&absent, &missing)
    );
    told_b.push(format!("{foreign:?}"));

    // ReconcileOperation is an operator's: refused alike, whoever's the id.
    let reconcile = |id: &str| pb::ReconcileOperationRequest {
        operation_id: id.into(),
    };
    let mut refusals = Vec::new();
    for id in [&a0, &of_b[0], &missing] {
        let e = c
            .reconcile_operation(bearer(reconcile(id), "token-b"))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        told_b.push(format!("{e:?}"));
        refusals.push(refusal_shape(&e, id));
    }
    assert!(refusals.windows(2).all(|w| w[0] == w[1]), "{refusals:?}");

    // Lists: B's own, in full pages, with or without naming itself.
    for caller in ["", "ci-b"] {
        let (ids, sizes) = list_all(&mut c, "token-b", &server, caller).await.unwrap();
        assert_eq!(ids, newest_first(&of_b), "caller={caller:?}");
        assert_eq!(sizes, [2, 1], "full pages: the store's query is scoped");
    }
    for caller in ["ci-a", "nobody"] {
        let e = list_all(&mut c, "token-b", &server, caller)
            .await
            .unwrap_err();
        assert_eq!(
            (e.code(), error_info(&e).1["field"].as_str()),
            (Code::InvalidArgument, "caller"),
            "another caller= is an operator's filter, whether that caller exists or not"
        );
        told_b.push(format!("{e:?}"));
    }
    // The id B asked about is echoed, as for any id (compared above); no
    // other of A's ever reaches B.
    for told in &told_b {
        for id in &of_a[1..] {
            assert!(
                !told.contains(id.as_str()),
                "B was told of A's {id}: {told}"
            );
        }
    }

    // A sees its own.
    let own = c.get_operation(bearer(get(&a0), "token-a")).await.unwrap();
    assert_eq!(own.into_inner().id, a0);
    let log = c
        .list_operation_events(bearer(events(&a0), "token-a"))
        .await
        .unwrap()
        .into_inner();
    assert!(log.events.iter().any(|e| e.kind == "recorded"), "{log:?}");
    let mut stream = c
        .watch_operation(bearer(watch(&a0), "token-a"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stream.message().await.unwrap().unwrap().id, a0);
    let (ids, _) = list_all(&mut c, "token-a", &server, "").await.unwrap();
    assert_eq!(ids, newest_first(&of_a));

    // The operator sees everything, and filters by caller.
    for id in [&a0, &of_b[0]] {
        let op = c.get_operation(bearer(get(id), "token-ops")).await.unwrap();
        assert_eq!(&op.into_inner().id, id);
        let log = c
            .list_operation_events(bearer(events(id), "token-ops"))
            .await
            .unwrap()
            .into_inner();
        assert!(!log.events.is_empty());
        let mut stream = c
            .watch_operation(bearer(watch(id), "token-ops"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(&stream.message().await.unwrap().unwrap().id, id);
        let op = c
            .reconcile_operation(bearer(reconcile(id), "token-ops"))
            .await
            .unwrap();
        assert_eq!(&op.into_inner().id, id);
    }
    let (ids, _) = list_all(&mut c, "token-ops", &server, "").await.unwrap();
    let mut both: Vec<String> = of_a.iter().chain(&of_b).cloned().collect();
    let mut listed = ids.clone();
    both.sort();
    listed.sort();
    assert_eq!(listed, both);
    let (ids, sizes) = list_all(&mut c, "token-ops", &server, "ci-a")
        .await
        .unwrap();
    assert_eq!((ids, sizes), (newest_first(&of_a), vec![2, 1]));
    app.stop().await;
}
on_both_ledgers!(an_orchestrator_reads_only_its_own_operations_and_an_operator_reads_all);

/// VOLUME_BUSY names the operation holding the volume to its own caller
/// and to an operator; to another orchestrator the volume is busy, and
/// nothing says whose.
#[tokio::test]
async fn volume_busy_names_the_operation_in_flight_only_to_its_caller_or_an_operator() {
    let app = spawn_app(AppOptions::default().arg("--auth-tokens", &scoped_tokens())).await;
    let (server, volume) = (uuid(), uuid());
    let vid: uuid::Uuid = volume.parse().unwrap();
    app.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::DelayBeforeEffect { ms: 8000 }).volume(vid),
    );
    let mut c1 = app.raw();
    let (s1, v1) = (server.clone(), volume.clone());
    let first = tokio::spawn(async move {
        let mut r = bearer(attach_req("held", &s1, &v1), "token-a");
        r.set_timeout(Duration::from_secs(30));
        c1.attach_volume(r).await
    });
    let store = app.store.clone();
    let filter = volume_reconciler::store::OperationFilter {
        volume_id: Some(vid),
        ..Default::default()
    };
    support::eventually(
        Duration::from_secs(10),
        "the first attach is recorded",
        || {
            let (store, filter) = (store.clone(), filter.clone());
            async move {
                !store
                    .operation_list(&filter, None, 10)
                    .await
                    .unwrap()
                    .operations
                    .is_empty()
            }
        },
    )
    .await;
    let held = app
        .store
        .operation_list(&filter, None, 10)
        .await
        .unwrap()
        .operations[0]
        .id
        .to_string();
    let mut c = app.raw();
    let busy = |key: &str, token: &str| bearer(attach_req(key, &server, &volume), token);
    let to_b = c.attach_volume(busy("b-1", "token-b")).await.unwrap_err();
    let (reason, meta) = error_info(&to_b);
    assert_eq!(
        (to_b.code(), reason.as_str()),
        (Code::Aborted, "VOLUME_BUSY")
    );
    assert_eq!(meta.get("volume_id"), Some(&volume));
    assert_eq!(meta.get("operation_id"), None, "{to_b:?}");
    assert!(!format!("{to_b:?}").contains(&held), "{to_b:?}");
    for (key, token) in [("a-2", "token-a"), ("ops-1", "token-ops")] {
        let e = c.attach_volume(busy(key, token)).await.unwrap_err();
        let (reason, meta) = error_info(&e);
        assert_eq!(reason, "VOLUME_BUSY");
        assert_eq!(meta["operation_id"], held, "{token}: {e:?}");
        assert!(e.message().contains(&held), "{}", e.message());
    }
    let first = first.await.unwrap().unwrap().into_inner();
    assert_eq!(
        (first.id.as_str(), first.state),
        (held.as_str(), pb::State::Succeeded as i32)
    );
    assert_eq!(app.sim.attach_effects(vid), 1);
    app.stop().await;
}

// ---------------------------------------------------------------------
// Free text is checked at the edge.
// ---------------------------------------------------------------------

/// A NUL (or another control character) in a resolve reason, a caller
/// filter or a key is INVALID_ARGUMENT naming the field, never a database
/// error (UNAVAILABLE) or a row that cannot be written; tabs and line
/// breaks in a reason are fine.
#[tokio::test]
async fn control_characters_in_free_text_are_refused_naming_the_field() {
    let app = spawn_app(AppOptions::default()).await;
    let mut c = app.raw();
    // An operation a resolve would write to: recorded, nothing sent.
    let new = support::pending_attach("pending", "nobody", Duration::ZERO, Duration::from_secs(60));
    let volume = new.volume_id;
    let pending_id = support::record_new(app.store.as_ref(), new).await;
    let resolve = |reason: &str| pb::ResolveOperationRequest {
        operation_id: pending_id.to_string(),
        state: pb::State::Failed as i32,
        reason: reason.into(),
    };
    let long_caller = "c".repeat(256);
    let mut refusals = Vec::new();
    for reason in ["seen\0 by hand", "\u{1b}[2Jcleared", "a\rb"] {
        refusals.push((
            "reason",
            c.resolve_operation(with_timeout(resolve(reason), Duration::from_secs(5)))
                .await
                .map(drop),
        ));
    }
    for caller in ["ci\0a", long_caller.as_str()] {
        refusals.push((
            "caller",
            c.list_operations(with_timeout(
                pb::ListOperationsRequest {
                    caller: caller.into(),
                    ..Default::default()
                },
                Duration::from_secs(5),
            ))
            .await
            .map(drop),
        ));
        refusals.push((
            "caller",
            c.get_operation(with_timeout(
                pb::GetOperationRequest {
                    idempotency_key: "pending".into(),
                    caller: caller.into(),
                    ..Default::default()
                },
                Duration::from_secs(5),
            ))
            .await
            .map(drop),
        ));
    }
    refusals.push((
        "idempotency_key",
        c.get_operation(with_timeout(
            pb::GetOperationRequest {
                idempotency_key: "k\0".into(),
                ..Default::default()
            },
            Duration::from_secs(5),
        ))
        .await
        .map(drop),
    ));
    let (s, v) = (uuid(), uuid());
    refusals.push((
        "idempotency_key",
        c.attach_volume(with_timeout(
            attach_req("k\0", &s, &v),
            Duration::from_secs(5),
        ))
        .await
        .map(drop),
    ));
    refusals.push((
        "idempotency_key",
        c.detach_volume(with_timeout(
            pb::DetachVolumeRequest {
                labels: Default::default(),
                idempotency_key: "k\0".into(),
                server_id: s.clone(),
                volume_id: v.clone(),
            },
            Duration::from_secs(5),
        ))
        .await
        .map(drop),
    ));
    for (field, answer) in refusals {
        let e = answer.expect_err(field);
        assert_eq!(e.code(), Code::InvalidArgument, "{field}: {e:?}");
        let (reason, meta) = error_info(&e);
        assert_eq!(
            (reason.as_str(), meta["field"].as_str()),
            ("INVALID_FIELD", field),
            "{e:?}"
        );
    }
    let row = app.store.operation_get(pending_id).await.unwrap().unwrap();
    assert_eq!(
        row.state,
        volume_reconciler::domain::State::Pending,
        "nothing was written"
    );
    // A reason over lines, with a tab, is text like any other.
    let op = c
        .resolve_operation(with_timeout(
            resolve("seen on the hypervisor:\n\tvdb is not there"),
            Duration::from_secs(5),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (op.state, op.resolution),
        (pb::State::Failed as i32, pb::Resolution::Operator as i32)
    );
    assert!(
        app.sim.attach_requests(volume) == 0 && app.sim.attach_requests(v.parse().unwrap()) == 0
    );
    app.stop().await;
}
