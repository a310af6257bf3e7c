//! What Nova's refusals say, through the real server against the
//! simulator: a 404 decides only when the ids it names are this
//! operation's (another volume's "could not be found", a "not attached"
//! naming other ids decide nothing); a message the service cannot read —
//! Nova's, translated for an `Accept-Language` that a proxy in front of
//! it added — is never a final refusal by itself, and the service never
//! asks for one; "too many disk devices" is its own refusal,
//! `RESOURCE_EXHAUSTED`. Every test checks the RPC's answer, the ledger
//! row, and what the simulator saw.

use crate::support;

use std::time::Duration;

use support::header_proxy::HeaderProxy;
use support::lifecycle::{attach, detach, ids};
use support::{AppOptions, TestApp, error_info, spawn_app, with_timeout};
use tonic::Code;
use uuid::Uuid;
use volume_reconciler::domain::{Operation, Reason, Resolution, State};
use volume_reconciler::grpc::pb;
use volume_reconciler::sim::{self, Fault, FaultOp, FaultRule, Sim, SimConfig};

async fn row_by_key(app: &TestApp, key: &str) -> Operation {
    app.store
        .operation_get_by_key(&crate::support::ck(None, key))
        .await
        .unwrap()
        .expect("the row exists")
}

/// The `request_failed` events of `op`, their metadata.
async fn failures(app: &TestApp, op: Uuid) -> Vec<std::collections::BTreeMap<String, String>> {
    app.store
        .operation_events(op)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == "request_failed")
        .map(|e| e.metadata)
        .collect()
}

/// A service confirming with Nova's list: what Nova answers and lists
/// decides, and nothing is decided before the request (Cinder's look
/// before a detach would decide one of a volume attached nowhere).
async fn app() -> TestApp {
    spawn_app(AppOptions::default().arg("--confirm-with", "nova-list")).await
}

/// A detach of an attached volume answered with `fault` (Nova's own 404,
/// nothing done), within 4 s.
async fn detach_answered(
    app: &TestApp,
    key: &str,
    fault: Fault,
) -> (Uuid, Uuid, Result<pb::Operation, tonic::Status>) {
    let (s, v) = ids();
    app.sim.seed_attachment(s, v);
    app.sim
        .add_fault(FaultRule::new(FaultOp::Detach, fault).volume(v));
    (s, v, detach_within_4s(app, key, s, v).await)
}

async fn detach_within_4s(
    app: &TestApp,
    key: &str,
    s: Uuid,
    v: Uuid,
) -> Result<pb::Operation, tonic::Status> {
    app.raw()
        .detach_volume(with_timeout(detach(key, s, v), Duration::from_secs(4)))
        .await
        .map(|r| r.into_inner())
}

/// Not decided: `OUTCOME_UNKNOWN` at the caller's deadline, the row
/// `UNKNOWN`, Nova still holding the attachment, the detach sent once.
async fn left_unknown(
    app: &TestApp,
    key: &str,
    (s, v, got): (Uuid, Uuid, Result<pb::Operation, tonic::Status>),
) {
    let err = got.expect_err("the 404 named something else: nothing is known");
    let (reason, meta) = error_info(&err);
    assert_eq!(
        (err.code(), reason.as_str()),
        (Code::DeadlineExceeded, "OUTCOME_UNKNOWN"),
        "{key}: {meta:?}"
    );
    let r = row_by_key(app, key).await;
    assert_eq!(r.state, State::Unknown, "{key}");
    assert!(app.sim.is_attached(s, v), "{key}: Nova still holds it");
    assert_eq!(app.sim.detach_requests(v), 1, "{key}: never sent again");
    let failed = failures(app, r.id).await;
    assert_eq!(failed.len(), 1, "{key}: {failed:?}");
    assert_eq!(failed[0]["http_status"], "404", "{key}");
    assert_eq!(failed[0]["rejection"], "other", "{key}: {failed:?}");
    assert!(
        failed[0]["cause"].contains("names"),
        "{key}: {}",
        failed[0]["cause"]
    );
}

/// Nova's 404 "Volume … could not be found." naming another volume on a
/// detach (an answer relayed for another request): no word about this
/// volume, so the detach is not SUCCEEDED — it is watched, and Nova still
/// holds the attachment. Nova's 404 naming this volume (deleted) decides.
#[tokio::test]
async fn a_detach_answered_404_naming_another_volume_is_not_succeeded() {
    let app = app().await;
    let answered = detach_answered(
        &app,
        "other-volume-404",
        Fault::VolumeNotFound {
            volume_id: Some(Uuid::new_v4()),
        },
    )
    .await;
    left_unknown(&app, "other-volume-404", answered).await;
    // The volume deleted: Nova's 404 names it, and decides.
    let (s, v) = ids();
    app.sim.seed_attachment(s, v);
    app.sim.remove_volume(v);
    let op = detach_within_4s(&app, "this-volume-404", s, v)
        .await
        .expect("Nova says the volume is gone");
    assert_eq!(
        (op.state, op.resolution),
        (pb::State::Succeeded as i32, pb::Resolution::Response as i32)
    );
    assert_eq!(
        row_by_key(&app, "this-volume-404").await.state,
        State::Succeeded
    );
    assert_eq!(app.sim.detach_requests(v), 1);
    app.stop().await;
}

/// Nova's 404 "Instance S is not attached to volume V" naming another
/// server, or another volume, on a detach: no word about this attachment,
/// so not SUCCEEDED. Naming this server and volume (attached nowhere), it
/// decides.
#[tokio::test]
async fn a_detach_answered_not_attached_naming_other_ids_is_not_succeeded() {
    let app = app().await;
    for (key, server_id, volume_id) in [
        ("not-attached-other-server", Some(Uuid::new_v4()), None),
        ("not-attached-other-volume", None, Some(Uuid::new_v4())),
    ] {
        let answered = detach_answered(
            &app,
            key,
            Fault::NotAttached {
                server_id,
                volume_id,
            },
        )
        .await;
        left_unknown(&app, key, answered).await;
    }
    let (s, v) = ids();
    let op = detach_within_4s(&app, "not-attached-ours", s, v)
        .await
        .expect("Nova says it is not attached");
    assert_eq!(
        (op.state, op.resolution),
        (
            pb::State::Succeeded as i32,
            pb::Resolution::Reobserved as i32
        )
    );
    assert_eq!(
        row_by_key(&app, "not-attached-ours").await.state,
        State::Succeeded
    );
    assert_eq!(app.sim.detach_requests(v), 1);
    app.stop().await;
}

/// A simulator whose Nova has a German translation, and the service
/// behind a proxy that adds `Accept-Language: de-DE,de;q=0.9` to each of
/// its requests to Nova (Cinder is asked directly).
async fn behind_a_german_proxy() -> (TestApp, sim::SimHandle, HeaderProxy) {
    support::init_logs();
    let nova = sim::start(
        "127.0.0.1:0".parse().unwrap(),
        SimConfig {
            record_history: true,
            locales: vec!["de".into()],
            ..SimConfig::default()
        },
    )
    .await
    .expect("simulator starts");
    let proxy = HeaderProxy::start(&nova.base_url, &[("accept-language", "de-DE,de;q=0.9")]).await;
    let app = spawn_app(
        AppOptions {
            nova_url: Some(format!("{}/v2.1", proxy.url())),
            ..AppOptions::default()
        }
        .arg("--cinder-url", &nova.cinder_url),
    )
    .await;
    (app, nova, proxy)
}

/// Behind a proxy that asks Nova for German, Nova's transient "volume not
/// ready" (Cinder's reservation refused while the volume is `creating`)
/// comes translated: the service cannot read it. Nova refused, so nothing
/// took effect; the service looks, asks again, and the attach SUCCEEDS
/// once the volume is ready — never a final `NOVA_BAD_REQUEST` on a
/// message it did not read.
#[tokio::test]
async fn behind_a_proxy_asking_for_german_a_volume_not_ready_is_asked_again_not_refused() {
    let (app, nova, _proxy) = behind_a_german_proxy().await;
    let (s, v) = ids();
    nova.sim.add_fault(
        FaultRule::new(
            FaultOp::Attach,
            Fault::VolumeNotReady {
                status: "creating".into(),
            },
        )
        .volume(v)
        .times(2),
    );
    let op = app
        .raw()
        .attach_volume(with_timeout(
            attach("german-not-ready", s, v),
            Duration::from_secs(10),
        ))
        .await
        .expect("asked again until the volume was ready")
        .into_inner();
    assert_eq!(
        (op.state, op.resolution, op.attempts),
        (
            pb::State::Succeeded as i32,
            pb::Resolution::Response as i32,
            3
        )
    );
    let r = row_by_key(&app, "german-not-ready").await;
    assert_eq!(
        (r.state, r.resolution),
        (State::Succeeded, Some(Resolution::Response))
    );
    // Both refusals were Nova's 400, translated, and not read.
    let failed = failures(&app, r.id).await;
    assert_eq!(failed.len(), 2, "{failed:?}");
    for f in &failed {
        assert_eq!(
            (f["http_status"].as_str(), f["rejection"].as_str()),
            ("400", "not_read"),
            "{f:?}"
        );
        assert!(
            f["nova_message"].contains(&v.to_string())
                && !f["nova_message"].contains("status must be available"),
            "translated, the volume's id kept: {f:?}"
        );
    }
    assert_eq!(nova.sim.attach_requests(v), 3);
    assert_eq!(nova.sim.attach_effects(v), 1);
    assert!(nova.sim.is_attached(s, v));
    let attaches = nova_requests(&nova.sim, "POST", s);
    assert_eq!(attaches.len(), 3, "{attaches:?}");
    assert!(
        attaches
            .iter()
            .all(|l| l.as_deref() == Some("de-DE,de;q=0.9")),
        "the proxy asked for German each time: {attaches:?}"
    );
    app.stop().await;
    nova.stop().await;
}

/// The `Accept-Language` of each `method` request the simulator received
/// about `server`'s attachments.
fn nova_requests(sim: &Sim, method: &str, server: Uuid) -> Vec<Option<String>> {
    let path = format!("/v2.1/servers/{server}/os-volume_attachments");
    sim.truth()
        .http
        .into_iter()
        .filter(|r| r.method == method && r.path.starts_with(&path))
        .map(|r| r.accept_language)
        .collect()
}

/// The service itself never asks Nova, Cinder or Keystone for another
/// language: whatever it sends (a token, version documents, an attach, a
/// detach, looks at Cinder and Nova's list), no `Accept-Language`.
#[tokio::test]
async fn the_service_never_asks_for_translated_messages() {
    support::init_logs();
    let cloud = sim::start(
        "127.0.0.1:0".parse().unwrap(),
        SimConfig {
            record_history: true,
            require_auth: true,
            locales: vec!["de".into(), "fr".into()],
            ..SimConfig::default()
        },
    )
    .await
    .expect("simulator starts");
    let app = spawn_app(support::keystone_mode(&cloud, AppOptions::default())).await;
    let (s, v) = ids();
    for result in [
        app.raw()
            .attach_volume(with_timeout(
                attach("lang-a", s, v),
                Duration::from_secs(10),
            ))
            .await,
        app.raw()
            .detach_volume(with_timeout(
                detach("lang-d", s, v),
                Duration::from_secs(10),
            ))
            .await,
    ] {
        let op = result.expect("decided").into_inner();
        assert_eq!(op.state, pb::State::Succeeded as i32, "{op:?}");
    }
    assert_eq!(row_by_key(&app, "lang-d").await.state, State::Succeeded);
    assert!(!cloud.sim.is_attached(s, v));
    let seen = cloud.sim.truth().http;
    for path in ["/identity/v3/auth/tokens", "/os-volume_attachments", "/v3/"] {
        assert!(
            seen.iter().any(|r| r.path.contains(path)),
            "the service asked for {path}: {seen:?}"
        );
    }
    let asked: Vec<_> = seen
        .iter()
        .filter(|r| r.accept_language.is_some())
        .collect();
    assert!(asked.is_empty(), "asked for a language: {asked:?}");
    app.stop().await;
    cloud.stop().await;
}

/// Nova's `[compute] max_disk_devices_to_attach` (the simulator's admin
/// API sets it per server): past it, Nova refuses an attach with its 403
/// TooManyDiskDevices. That is `FAILED/RESPONSE NOVA_TOO_MANY_DISKS`,
/// answered `RESOURCE_EXHAUSTED` (what a CSI driver answers for "this node
/// takes no more volumes"), at once, with nothing attached.
#[tokio::test]
async fn too_many_disk_devices_is_failed_resource_exhausted_with_nothing_attached() {
    let app = spawn_app(AppOptions::default()).await;
    let admin = format!(
        "{}/sim/servers",
        app.sim_handle.as_ref().expect("its own simulator").base_url
    );
    let (s, v1) = ids();
    let v2 = Uuid::new_v4();
    let set_max = |max: i64| {
        reqwest::Client::new()
            .post(format!("{admin}/{s}/max_disk_devices_to_attach"))
            .json(&serde_json::json!({ "max_disk_devices_to_attach": max }))
            .send()
    };
    assert_eq!(set_max(-2).await.unwrap().status(), 400, "below Nova's -1");
    assert_eq!(set_max(1).await.unwrap().status(), 204);
    let first = app
        .raw()
        .attach_volume(with_timeout(
            attach("disk-1", s, v1),
            Duration::from_secs(5),
        ))
        .await
        .expect("the first volume fits")
        .into_inner();
    assert_eq!(first.state, pb::State::Succeeded as i32);
    let err = app
        .raw()
        .attach_volume(with_timeout(
            attach("disk-2", s, v2),
            Duration::from_secs(5),
        ))
        .await
        .expect_err("the server takes no more");
    let (reason, meta) = error_info(&err);
    assert_eq!(
        (err.code(), reason.as_str()),
        (Code::ResourceExhausted, "NOVA_TOO_MANY_DISKS"),
        "{meta:?}"
    );
    assert!(
        meta["nova_message"].contains("maximum allowed number of disk devices (1)"),
        "{meta:?}"
    );
    let r = row_by_key(&app, "disk-2").await;
    assert_eq!(
        (r.state, r.resolution),
        (State::Failed, Some(Resolution::Response))
    );
    assert_eq!(
        r.last_error.expect("the refusal").reason,
        Reason::NovaTooManyDisks
    );
    assert!(!app.sim.is_attached(s, v2), "nothing attached");
    assert!(app.sim.is_attached(s, v1));
    assert_eq!(
        app.sim.attach_requests(v2),
        1,
        "refused at once, not asked again"
    );
    assert_eq!(app.sim.attach_effects(v2), 0);
    // Unlimited again (Nova's -1): the volume fits.
    assert_eq!(set_max(-1).await.unwrap().status(), 204);
    let op = app
        .raw()
        .attach_volume(with_timeout(
            attach("disk-2b", s, v2),
            Duration::from_secs(5),
        ))
        .await
        .expect("no limit")
        .into_inner();
    assert_eq!(op.state, pb::State::Succeeded as i32);
    assert!(app.sim.is_attached(s, v2));
    app.stop().await;
}
