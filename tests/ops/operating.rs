//! Day-to-day operation through the real server: what tools see through
//! reflection (v1 and v1alpha, the error types included), the bounds of a
//! request's fields, and the request ids `ops show` prints.

use crate::support;

use std::time::Duration;

use prost::Message as _;
use support::{AppOptions, error_info, spawn_app, with_timeout};
use uuid::Uuid;
use volume_reconciler::grpc::pb;

/// What one reflection exchange answered: the services listed, and the
/// files (decoded) that a symbol and a file name resolve to.
struct Reflected {
    services: Vec<String>,
    symbol_files: Result<Vec<prost_types::FileDescriptorProto>, String>,
    dependency_files: Vec<Result<Vec<prost_types::FileDescriptorProto>, String>>,
}

fn decode_files(raw: &[Vec<u8>]) -> Vec<prost_types::FileDescriptorProto> {
    raw.iter()
        .map(|b| prost_types::FileDescriptorProto::decode(b.as_slice()).expect("a descriptor"))
        .collect()
}

/// The v1 and v1alpha protocols are the same messages in two packages;
/// one macro asks the same questions of either.
macro_rules! ask {
    ($version:ident, $channel:expr, $symbol:expr) => {{
        use tonic_reflection::pb::$version::ServerReflectionRequest;
        use tonic_reflection::pb::$version::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::$version::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::$version::server_reflection_response::MessageResponse;
        let mut client = ServerReflectionClient::new($channel);
        let request = |m: MessageRequest| ServerReflectionRequest {
            host: String::new(),
            message_request: Some(m),
        };
        let mut one = async |m: MessageRequest| {
            let mut stream = client
                .server_reflection_info(tokio_stream::iter(vec![request(m)]))
                .await
                .expect("the reflection service answers")
                .into_inner();
            stream
                .message()
                .await
                .expect("a reflection answer")
                .expect("one message")
                .message_response
                .expect("a response")
        };
        let services = match one(MessageRequest::ListServices(String::new())).await {
            MessageResponse::ListServicesResponse(l) => {
                l.service.into_iter().map(|s| s.name).collect()
            }
            other => panic!("unexpected {other:?}"),
        };
        let files = |r: MessageResponse| match r {
            MessageResponse::FileDescriptorResponse(f) => {
                Ok(decode_files(&f.file_descriptor_proto))
            }
            MessageResponse::ErrorResponse(e) => {
                Err(format!("{} {}", e.error_code, e.error_message))
            }
            other => panic!("unexpected {other:?}"),
        };
        let symbol_files = files(one(MessageRequest::FileContainingSymbol($symbol.into())).await);
        let mut dependency_files = Vec::new();
        if let Ok(found) = &symbol_files {
            for dep in found.iter().flat_map(|f| f.dependency.clone()) {
                dependency_files.push(files(one(MessageRequest::FileByFilename(dep)).await));
            }
        }
        Reflected {
            services,
            symbol_files,
            dependency_files,
        }
    }};
}

#[tokio::test]
async fn reflection_v1_and_v1alpha_list_the_services_and_resolve_error_info() {
    let app = spawn_app(AppOptions::default()).await;
    let channel = tonic::transport::Endpoint::from_shared(app.grpc_url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let v1 = ask!(v1, channel.clone(), "google.rpc.ErrorInfo");
    let v1alpha = ask!(v1alpha, channel.clone(), "google.rpc.ErrorInfo");
    for (version, r) in [("v1", &v1), ("v1alpha", &v1alpha)] {
        for service in [
            "volume_reconciler.v1.VolumeReconciler",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        ] {
            assert!(
                r.services.iter().any(|s| s == service),
                "{version} lists {service}: {:?}",
                r.services
            );
        }
        let files = r
            .symbol_files
            .as_ref()
            .unwrap_or_else(|e| panic!("{version}: google.rpc.ErrorInfo unresolved: {e}"));
        let error_info = files
            .iter()
            .flat_map(|f| f.message_type.iter().map(move |m| (f, m)))
            .find(|(f, m)| f.package() == "google.rpc" && m.name() == "ErrorInfo")
            .unwrap_or_else(|| panic!("{version}: no ErrorInfo in {files:?}"));
        let fields: Vec<&str> = error_info.1.field.iter().map(|f| f.name()).collect();
        assert_eq!(fields, ["reason", "domain", "metadata"], "{version}");
        // A tool then fetches each import by name (Duration, for RetryInfo).
        assert!(!r.dependency_files.is_empty(), "{version}: imports");
        for dep in &r.dependency_files {
            let dep = dep
                .as_ref()
                .unwrap_or_else(|e| panic!("{version}: an import is missing: {e}"));
            assert!(!dep.is_empty());
        }
    }
    // The API's own types resolve too (Timestamp comes with them).
    let api = ask!(v1alpha, channel, "volume_reconciler.v1.Operation");
    let files = api.symbol_files.expect("the API resolves");
    assert!(files.iter().any(|f| f.package() == "volume_reconciler.v1"));
    assert!(api.dependency_files.iter().all(Result::is_ok));
    app.stop().await;
}

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
            .operation_get_by_key(&crate::support::ck(None, "long-device"))
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

#[tokio::test]
async fn ops_show_prints_the_global_and_novas_request_ids() {
    use volume_reconciler::sim::{Fault, FaultOp, FaultRule, SimConfig};
    let app = spawn_app(AppOptions {
        sim: SimConfig {
            record_history: true,
            ..SimConfig::default()
        },
        ..Default::default()
    })
    .await;
    let (s, v) = (Uuid::new_v4(), Uuid::new_v4());
    // A 409 first (the server is locked: certainly not done), then the
    // retry succeeds: two requests, two of Nova's ids, one global id.
    app.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::Conflict)
            .volume(v)
            .times(1),
    );
    let op = app
        .raw()
        .attach_volume(with_timeout(
            pb::AttachVolumeRequest {
                idempotency_key: "ids-1".into(),
                server_id: s.to_string(),
                volume_id: v.to_string(),
                ..Default::default()
            },
            Duration::from_secs(10),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(op.state, pb::State::Succeeded as i32);
    // What Nova saw: the ids it was sent and the ids it answered under.
    let seen: Vec<_> = app
        .sim
        .truth()
        .requests
        .into_iter()
        .filter(|r| r.volume_id == v)
        .collect();
    assert_eq!(seen.len(), 2, "{seen:?}");
    let global = format!("req-{}", op.id);
    for r in &seen {
        assert_eq!(r.global_id.as_deref(), Some(global.as_str()), "{r:?}");
    }

    let show = |json: bool| {
        let (url, id) = (app.grpc_url.clone(), op.id.clone());
        tokio::task::spawn_blocking(move || {
            let mut args = vec!["ops", "show", id.as_str(), "--server", url.as_str()];
            if json {
                args.extend(["--output", "json"]);
            }
            std::process::Command::new(env!("CARGO_BIN_EXE_volume-reconciler"))
                .args(args)
                .output()
                .unwrap()
        })
    };
    let out = show(false).await.unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let summary = text
        .lines()
        .skip_while(|l| !l.starts_with("request ids"))
        .take(3)
        .collect::<Vec<_>>()
        .join("\n");
    assert!(summary.contains(&format!("global  {global}")), "{text}");
    for r in &seen {
        assert!(
            summary.contains(&r.local_id),
            "Nova's id {} in the summary:\n{text}",
            r.local_id
        );
    }
    // Each event carries its own: the request its global id, the answers
    // (the failure, the successful response) Nova's.
    let log = text.split("reconcile log:").nth(1).expect("a log");
    assert_eq!(
        log.matches(&format!("global request id {global}")).count(),
        2,
        "both requests:\n{log}"
    );
    for r in &seen {
        assert!(
            log.contains(&format!("Nova's request id {}", r.local_id)),
            "{}:\n{log}",
            r.local_id
        );
    }
    // The same for scripts.
    let out = show(true).await.unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["request_ids"]["global"], serde_json::json!([global]));
    let nova: Vec<&str> = v["request_ids"]["nova"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap())
        .collect();
    for r in &seen {
        assert!(nova.contains(&r.local_id.as_str()), "{nova:?}");
    }
    // By the key its caller sent, with the same log; a key nobody sent is
    // NOT_FOUND, printed once.
    let by_key = |key: &'static str| {
        let url = app.grpc_url.clone();
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(env!("CARGO_BIN_EXE_volume-reconciler"))
                .args(["ops", "show", "--idempotency-key", key, "--server", &url])
                .args(["--output", "json"])
                .output()
                .unwrap()
        })
    };
    let out = by_key("ids-1").await.unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["operation"]["id"], serde_json::json!(op.id));
    assert_eq!(v["request_ids"]["global"], serde_json::json!([global]));
    let out = by_key("nobody-sent-this").await.unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("NOT_FOUND"), "{err}");
    app.stop().await;
}
