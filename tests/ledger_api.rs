//! The ledger and the gRPC API through the real server: idempotency-key
//! semantics, volume busy, concurrent replays, pagination, validation.

mod support;

use std::collections::HashSet;
use std::time::Duration;

use support::{AppOptions, error_info, spawn_app, uuid, with_timeout};
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
