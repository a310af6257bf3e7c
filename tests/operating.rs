//! Day-to-day operation through the real server: what tools see through
//! reflection (v1 and v1alpha, the error types included), the bounds of a
//! request's fields, and the request ids `ops show` prints.

mod support;

use std::time::Duration;

use support::{AppOptions, error_info, spawn_app, with_timeout};
use uuid::Uuid;
use volume_reconciler::grpc::pb;

#[tokio::test]
async fn a_device_longer_than_novas_column_is_refused_naming_the_field() {
    let app = spawn_app(AppOptions::default()).await;
    let (s, v) = (Uuid::new_v4(), Uuid::new_v4());
    let device = format!("/dev/vd{}", "b".repeat(300));
    assert_eq!(device.len(), 307);
    let err = app
        .raw()
        .attach_volume(with_timeout(
            pb::AttachVolumeRequest {
                idempotency_key: "long-device".into(),
                server_id: s.to_string(),
                volume_id: v.to_string(),
                device: device.clone(),
                ..Default::default()
            },
            Duration::from_secs(10),
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    let (reason, meta) = error_info(&err);
    assert_eq!(reason, "INVALID_FIELD");
    assert_eq!(meta.get("field").map(String::as_str), Some("device"));
    assert!(err.message().contains("255"), "{}", err.message());
    assert!(
        !err.message().contains(&device),
        "the value is not echoed whole: {}",
        err.message()
    );
    assert_eq!(app.sim.attach_requests(v), 0, "Nova never saw it");
    assert!(
        app.store
            .operation_get_by_key("long-device")
            .await
            .unwrap()
            .is_none(),
        "nothing recorded"
    );
    // The longest path Nova keeps still goes through.
    let longest = format!("/dev/vd{}", "b".repeat(248));
    let op = app
        .raw()
        .attach_volume(with_timeout(
            pb::AttachVolumeRequest {
                idempotency_key: "longest-device".into(),
                server_id: s.to_string(),
                volume_id: v.to_string(),
                device: longest,
                ..Default::default()
            },
            Duration::from_secs(10),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(op.state, pb::State::Succeeded as i32);
    assert_eq!(app.sim.attach_effects(v), 1);
    app.stop().await;
}
