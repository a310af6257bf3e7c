//! The Cinder adapter against the simulator over real sockets: what Cinder
//! reports as attaches and detaches run (the state machine over time),
//! where its endpoint comes from (`--cinder-url` or the Keystone catalog)
//! and how that decides the confirmation, and every error class at both
//! stages (headers and body) with its full context. Also the documents
//! real clients read to discover the simulator's services.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use uuid::Uuid;
use volume_reconciler::domain::RequestParams;
use volume_reconciler::nova::{
    AttachAnswer, AttachProgress, CinderErrorKind, ConfirmWith, Credential, DetachProgress,
    KeystoneConfig, Microversion, NovaClient, NovaConfig, NovaEndpoint, NovaErrorKind, Rejection,
    RequestId, Secret, Stage, VolumeStatus, VolumeView,
};
use volume_reconciler::sim::{self, Fault, FaultOp, FaultRule, SimConfig, SimHandle};

fn in_secs(s: f64) -> Instant {
    Instant::now() + Duration::from_secs_f64(s)
}

fn ids() -> (Uuid, Uuid) {
    (Uuid::new_v4(), Uuid::new_v4())
}

async fn start(cfg: SimConfig) -> SimHandle {
    support::init_logs();
    sim::start("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap()
}

/// Nova and Cinder in direct mode (`--nova-url`, `--cinder-url`), Nova at
/// 2.89, with `tune` applied.
fn direct(h: &SimHandle, tune: impl FnOnce(&mut NovaConfig)) -> NovaClient {
    let mut cfg = NovaConfig {
        endpoint: NovaEndpoint::Direct(h.nova_url.clone()),
        cinder_url: Some(h.cinder_url.clone()),
        ..NovaConfig::default()
    };
    tune(&mut cfg);
    NovaClient::new(cfg)
}

fn password(password: &str) -> Credential {
    Credential::Password {
        username: "demo".into(),
        user_domain_name: "Default".into(),
        password: Secret::new(password),
        project_name: "demo".into(),
        project_domain_name: "Default".into(),
    }
}

fn keystone(h: &SimHandle) -> KeystoneConfig {
    KeystoneConfig {
        auth_url: h.auth_url.clone(),
        credential: password("secret"),
        region: Some("RegionOne".into()),
        interface: "public".into(),
        renewal_timeout: Duration::from_secs(10),
        renew_before: Duration::from_secs(120),
    }
}

/// Nova from the catalog, Cinder as the catalog (or `tune`) says.
fn via_keystone(h: &SimHandle, tune: impl FnOnce(&mut NovaConfig)) -> NovaClient {
    let mut cfg = NovaConfig {
        endpoint: NovaEndpoint::Keystone(keystone(h)),
        ..NovaConfig::default()
    };
    tune(&mut cfg);
    NovaClient::new(cfg)
}

async fn look(c: &NovaClient, volume: Uuid) -> VolumeView {
    c.cinder()
        .expect("a Cinder client")
        .volume(volume, in_secs(5.0))
        .await
        .unwrap()
}

/// Waits until Cinder shows `volume` in `status`, returning that view.
async fn until_status(c: &NovaClient, volume: Uuid, status: &str) -> VolumeView {
    let found = std::sync::Mutex::new(None);
    support::eventually(
        Duration::from_secs(10),
        &format!("Cinder shows the volume {status}"),
        || async {
            let v = look(c, volume).await;
            let hit = v.status.as_str() == status;
            *found.lock().unwrap() = Some(v);
            hit
        },
    )
    .await;
    found.into_inner().unwrap().unwrap()
}

async fn attach(c: &NovaClient, server: Uuid, volume: Uuid) -> AttachAnswer {
    c.attach(server, volume, &RequestParams::default(), in_secs(5.0))
        .await
        .unwrap()
}

// --- what Cinder reports over time ---------------------------------------

#[tokio::test]
async fn a_volume_nobody_holds_is_available_and_each_read_carries_the_version_and_request_id() {
    let h = start(SimConfig {
        record_history: true,
        ..SimConfig::default()
    })
    .await;
    let c = direct(&h, |_| {});
    let (server, volume) = ids();
    let op = Uuid::new_v4();
    let v = c
        .cinder()
        .unwrap()
        .volume_as(&RequestId::for_operation(op), volume, in_secs(5.0))
        .await
        .unwrap();
    assert_eq!(
        (v.id, v.status.clone(), v.multiattach),
        (volume, VolumeStatus::Available, false)
    );
    assert!(v.attachments.is_empty());
    assert_eq!(v.attach_progress(server), AttachProgress::NotAttached);
    assert_eq!(v.detach_progress(server), DetachProgress::Detached);
    assert!(
        v.cinder_request_id
            .as_deref()
            .is_some_and(|id| id.starts_with("req-")),
        "{v:?}"
    );
    let reads = h.sim.cinder_reads();
    assert_eq!(reads.len(), 1);
    assert_eq!(reads[0].volume_id, volume);
    assert_eq!(reads[0].microversion, "3.27", "the pinned microversion");
    assert_eq!(reads[0].global_id, Some(format!("req-{op}")));
    h.stop().await;
}

#[tokio::test]
async fn an_attach_is_attaching_until_the_hypervisor_is_done_then_in_use_with_novas_attachment() {
    let h = start(SimConfig {
        attach_complete_ms: 800,
        ..SimConfig::default()
    })
    .await;
    let c = direct(&h, |_| {});
    let (server, volume) = ids();
    // Below 2.101 the 200 comes once the device is reserved: Cinder does
    // not list the attachment yet.
    let AttachAnswer::Attached(answer) = attach(&c, server, volume).await else {
        panic!("2.89 answers 200");
    };
    let v = look(&c, volume).await;
    assert_eq!(v.status, VolumeStatus::Attaching);
    assert!(v.attachments.is_empty(), "{v:?}");
    assert_eq!(v.attach_progress(server), AttachProgress::Attaching);
    let v = until_status(&c, volume, "in-use").await;
    assert_eq!(v.attach_progress(server), AttachProgress::Attached);
    let mine = v.attached_to(server).unwrap();
    let listed = c.list(server, in_secs(5.0)).await.unwrap();
    assert_eq!(
        Some(mine.attachment_id.as_str()),
        listed[0].attachment_id.as_deref(),
        "Cinder's attachment is the one Nova lists (2.89)"
    );
    assert_eq!(mine.device, answer.device);
    h.stop().await;
}

#[tokio::test]
async fn a_detach_is_detaching_and_still_listed_until_done_then_available() {
    let h = start(SimConfig {
        detach_delay_ms: 800,
        ..SimConfig::default()
    })
    .await;
    let c = direct(&h, |_| {});
    let (server, volume) = ids();
    h.sim.seed_attachment(server, volume);
    assert_eq!(look(&c, volume).await.status, VolumeStatus::InUse);
    c.detach(server, volume, in_secs(5.0)).await.unwrap();
    let v = look(&c, volume).await;
    assert_eq!(v.status, VolumeStatus::Detaching);
    assert!(v.attached_to(server).is_some(), "still attached meanwhile");
    assert_eq!(v.detach_progress(server), DetachProgress::Detaching);
    let v = until_status(&c, volume, "available").await;
    assert!(v.attachments.is_empty());
    assert_eq!(v.detach_progress(server), DetachProgress::Detached);
    h.stop().await;
}

#[tokio::test]
async fn a_detach_the_guest_refuses_goes_back_to_in_use_and_stays_attached() {
    let h = start(SimConfig {
        detach_delay_ms: 500,
        ..SimConfig::default()
    })
    .await;
    let c = direct(&h, |_| {});
    let (server, volume) = ids();
    h.sim.seed_attachment(server, volume);
    h.sim
        .add_fault(FaultRule::new(FaultOp::Detach, Fault::DetachRefused).volume(volume));
    c.detach(server, volume, in_secs(5.0)).await.unwrap();
    assert_eq!(look(&c, volume).await.status, VolumeStatus::Detaching);
    let v = until_status(&c, volume, "in-use").await;
    assert_eq!(v.detach_progress(server), DetachProgress::Attached);
    h.stop().await;
}

#[tokio::test]
async fn a_rolled_back_attach_leaves_the_volume_available_or_in_error_attaching() {
    // rollback_share just below 1: every attach fails in the hypervisor.
    let cfg = SimConfig {
        rollback_share: 0.999_999,
        rollback_delay_ms: 500,
        ..SimConfig::default()
    };
    let h = start(cfg.clone()).await;
    let c = direct(&h, |_| {});
    let (server, volume) = ids();
    attach(&c, server, volume).await;
    assert_eq!(look(&c, volume).await.status, VolumeStatus::Attaching);
    let v = until_status(&c, volume, "available").await;
    assert_eq!(v.attach_progress(server), AttachProgress::NotAttached);
    assert!(c.list(server, in_secs(5.0)).await.unwrap().is_empty());
    // A Cinder whose attach failed on its side shows error_attaching, and
    // refuses the next reservation until the status is reset.
    h.sim.set_config(SimConfig {
        rollback_status: "error_attaching".into(),
        ..cfg
    });
    let volume = Uuid::new_v4();
    attach(&c, server, volume).await;
    let v = until_status(&c, volume, "error_attaching").await;
    assert!(v.status.is_error());
    assert_eq!(v.attach_progress(server), AttachProgress::NotAttached);
    let e = c
        .attach(server, volume, &RequestParams::default(), in_secs(5.0))
        .await
        .unwrap_err();
    assert_eq!(
        e.kind,
        NovaErrorKind::Rejected(Rejection::VolumeNotReady {
            status: "error_attaching".into()
        }),
        "{e}"
    );
    assert!(
        e.message.as_deref().unwrap().contains(
            "must be available or downloading to reserve, but the current status is error_attaching"
        ),
        "{e}"
    );
    // `cinder reset-state --state available`, over the simulator's admin
    // API; the next attach then goes through and its transitions show.
    let reset = reqwest::Client::new()
        .post(format!("{}/sim/cinder/volumes/{volume}/status", h.base_url))
        .json(&serde_json::json!({"status": "available"}))
        .send()
        .await
        .unwrap();
    assert_eq!(reset.status(), 204);
    assert_eq!(look(&c, volume).await.status, VolumeStatus::Available);
    let mut cfg = h.sim.config();
    cfg.rollback_share = 0.0;
    h.sim.set_config(cfg);
    attach(&c, server, volume).await;
    let v = until_status(&c, volume, "in-use").await;
    assert_eq!(v.attach_progress(server), AttachProgress::Attached);
    h.stop().await;
}

#[tokio::test]
async fn at_2_101_the_volume_stays_available_until_conductor_reserves_it() {
    let h = start(SimConfig {
        async_attach_delay_ms: 600,
        attach_complete_ms: 600,
        ..SimConfig::default()
    })
    .await;
    let c = direct(&h, |cfg| cfg.microversion = Microversion::Exact(2, 101));
    let (server, volume) = ids();
    assert_eq!(attach(&c, server, volume).await, AttachAnswer::Accepted);
    let v = look(&c, volume).await;
    assert_eq!(v.status, VolumeStatus::Available, "not reserved yet");
    assert_eq!(v.attach_progress(server), AttachProgress::NotAttached);
    until_status(&c, volume, "attaching").await;
    let v = until_status(&c, volume, "in-use").await;
    assert_eq!(v.attach_progress(server), AttachProgress::Attached);
    h.stop().await;
}

/// Creates a volume through Cinder's API: (id, status answered).
async fn create_volume(h: &SimHandle, body: serde_json::Value) -> (Uuid, String) {
    let resp = reqwest::Client::new()
        .post(format!("{}/volumes", h.cinder_url))
        .header("OpenStack-API-Version", "volume 3.27")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 202, "Cinder accepts a create with 202");
    let v: serde_json::Value = resp.json().await.unwrap();
    (
        v["volume"]["id"].as_str().unwrap().parse().unwrap(),
        v["volume"]["status"].as_str().unwrap().to_string(),
    )
}

#[tokio::test]
async fn a_volume_still_being_created_cannot_be_reserved_and_one_downloading_can() {
    let h = start(SimConfig {
        cinder_create_ms: 800,
        cinder_download_ms: 60_000,
        ..SimConfig::default()
    })
    .await;
    let c = direct(&h, |_| {});
    let c101 = direct(&h, |cfg| cfg.microversion = Microversion::Exact(2, 101));
    // The upstream sample request body is what the API accepts.
    let sample: serde_json::Value = serde_json::from_str(include_str!(
        "../fixtures/cinder/volumes/volume-create-request.json"
    ))
    .unwrap();
    let (volume, status) = create_volume(&h, sample).await;
    assert_eq!(status, "creating");
    let server = Uuid::new_v4();
    // The create-then-attach race: below 2.101 Nova relays Cinder's refusal.
    let e = c
        .attach(server, volume, &RequestParams::default(), in_secs(5.0))
        .await
        .unwrap_err();
    assert_eq!(
        e.kind,
        NovaErrorKind::Rejected(Rejection::VolumeNotReady {
            status: "creating".into()
        }),
        "{e}"
    );
    assert!(
        e.message
            .as_deref()
            .unwrap()
            .contains("but the current status is creating"),
        "{e}"
    );
    // At 2.101 the refusal happens after the 202 and is told to nobody.
    assert_eq!(attach(&c101, server, volume).await, AttachAnswer::Accepted);
    until_status(&c, volume, "available").await;
    assert_eq!(
        h.sim.attach_effects(volume),
        0,
        "neither attach took effect"
    );
    assert!(c.list(server, in_secs(5.0)).await.unwrap().is_empty());
    attach(&c, server, volume).await;
    until_status(&c, volume, "in-use").await;
    // From an image: creating, then downloading, which Nova may reserve.
    let mut cfg = h.sim.config();
    cfg.cinder_create_ms = 0;
    h.sim.set_config(cfg);
    let (volume, _) = create_volume(
        &h,
        serde_json::json!({"volume": {"size": 1, "imageRef": Uuid::new_v4()}}),
    )
    .await;
    assert_eq!(look(&c, volume).await.status, VolumeStatus::Downloading);
    attach(&c, server, volume).await;
    until_status(&c, volume, "in-use").await;
    h.stop().await;
}

#[tokio::test]
async fn a_multiattach_volume_lists_every_server_and_its_status_follows_the_latest_change() {
    let h = start(SimConfig {
        detach_delay_ms: 600,
        ..SimConfig::default()
    })
    .await;
    let c = direct(&h, |_| {});
    let (one, volume) = ids();
    let two = Uuid::new_v4();
    h.sim.set_multiattach(volume);
    attach(&c, one, volume).await;
    attach(&c, two, volume).await;
    let v = look(&c, volume).await;
    assert_eq!(
        (v.status.clone(), v.multiattach),
        (VolumeStatus::InUse, true)
    );
    assert_eq!(v.attachments.len(), 2);
    c.detach(one, volume, in_secs(5.0)).await.unwrap();
    let v = look(&c, volume).await;
    assert_eq!(v.status, VolumeStatus::Detaching);
    assert_eq!(v.detach_progress(one), DetachProgress::Detaching);
    assert_eq!(v.attach_progress(two), AttachProgress::Attached);
    let v = until_status(&c, volume, "in-use").await;
    assert_eq!(v.detach_progress(one), DetachProgress::Detached);
    assert_eq!(v.attach_progress(two), AttachProgress::Attached);
    h.stop().await;
}

#[tokio::test]
async fn a_deleted_volume_is_not_found_and_an_attached_one_cannot_be_deleted() {
    let h = start(SimConfig {
        cinder_delete_ms: 500,
        ..SimConfig::default()
    })
    .await;
    let c = direct(&h, |_| {});
    let (server, volume) = ids();
    h.sim.seed_attachment(server, volume);
    let http = reqwest::Client::new();
    let delete = || {
        http.delete(format!("{}/volumes/{volume}", h.cinder_url))
            .send()
    };
    let refused = delete().await.unwrap();
    assert_eq!(refused.status(), 400);
    let body: serde_json::Value = refused.json().await.unwrap();
    assert!(
        body["badRequest"]["message"]
            .as_str()
            .unwrap()
            .contains("must not be migrating, attached"),
        "{body}"
    );
    c.detach(server, volume, in_secs(5.0)).await.unwrap();
    assert_eq!(delete().await.unwrap().status(), 202);
    assert_eq!(look(&c, volume).await.status, VolumeStatus::Deleting);
    let cinder = c.cinder().unwrap();
    support::eventually(Duration::from_secs(10), "the volume is gone", || async {
        cinder.volume(volume, in_secs(5.0)).await.is_err()
    })
    .await;
    let e = cinder.volume(volume, in_secs(5.0)).await.unwrap_err();
    assert_eq!(
        (e.kind, e.stage),
        (CinderErrorKind::VolumeNotFound, Stage::ReadBody)
    );
    assert_eq!(e.status, Some(404));
    assert_eq!(e.fault.as_deref(), Some("itemNotFound"));
    assert_eq!(
        e.message,
        Some(format!("Volume {volume} could not be found."))
    );
    assert!(e.request_id.is_some() && !e.transient());
    // Nova knows it is gone too.
    let e = c
        .attach(server, volume, &RequestParams::default(), in_secs(5.0))
        .await
        .unwrap_err();
    assert_eq!(e.kind, NovaErrorKind::Rejected(Rejection::VolumeNotFound));
    // A volume removed behind everyone's back as well.
    let other = Uuid::new_v4();
    h.sim.remove_volume(other);
    let e = cinder.volume(other, in_secs(5.0)).await.unwrap_err();
    assert_eq!(e.kind, CinderErrorKind::VolumeNotFound);
    h.stop().await;
}

// --- every error class, at headers and body ------------------------------

#[tokio::test]
async fn a_deadline_at_the_headers_is_a_deadline_that_names_its_clock_and_context() {
    let h = start(SimConfig::default()).await;
    let c = direct(&h, |_| {});
    let volume = Uuid::new_v4();
    h.sim.add_fault(
        FaultRule::new(FaultOp::Cinder, Fault::DelayBeforeEffect { ms: 3000 }).volume(volume),
    );
    let started = Instant::now();
    let e = c
        .cinder()
        .unwrap()
        .volume(volume, in_secs(0.3))
        .await
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the deadline bounds it"
    );
    assert_eq!(
        (e.kind, e.stage),
        (CinderErrorKind::DeadlineExceeded, Stage::AwaitHeaders)
    );
    assert_eq!((e.method, e.status), ("GET", None));
    assert_eq!(e.url, format!("{}/volumes/{volume}", h.cinder_url));
    assert!(e.transient());
    let text = e.to_string();
    assert!(
        text.contains("GET")
            && text.contains(&volume.to_string())
            && text.contains("Cinder's response headers"),
        "{text}"
    );
    let meta = e.metadata();
    for key in [
        "service",
        "method",
        "url",
        "stage",
        "error_class",
        "elapsed_ms",
        "outbound_budget_ms",
        "cause",
    ] {
        assert!(meta.contains_key(key), "{key} missing from {meta:?}");
    }
    assert_eq!(meta["error_class"], "deadline_exceeded");
    h.stop().await;
}

#[tokio::test]
async fn a_slow_but_complete_answer_is_not_cut_short() {
    let h = start(SimConfig::default()).await;
    let c = direct(&h, |_| {});
    let volume = Uuid::new_v4();
    h.sim.add_fault(
        FaultRule::new(FaultOp::Cinder, Fault::DelayAfterEffect { ms: 2000 }).volume(volume),
    );
    let started = Instant::now();
    let v = look(&c, volume).await;
    assert!(started.elapsed() >= Duration::from_millis(1900));
    assert_eq!(v.status, VolumeStatus::Available);
    h.stop().await;
}

#[tokio::test]
async fn a_stalled_or_cut_body_fails_at_the_body_stage_with_the_answers_status_and_id() {
    let h = start(SimConfig::default()).await;
    let c = direct(&h, |_| {});
    let cinder = c.cinder().unwrap();
    let volume = Uuid::new_v4();
    h.sim.add_fault(
        FaultRule::new(
            FaultOp::Cinder,
            Fault::StallBody {
                ms: 5000,
                effect: true,
            },
        )
        .volume(volume),
    );
    let e = cinder.volume(volume, in_secs(0.5)).await.unwrap_err();
    assert_eq!(
        (e.kind, e.stage),
        (CinderErrorKind::DeadlineExceeded, Stage::ReadBody),
        "{e}"
    );
    assert_eq!(e.status, Some(200), "the headers had arrived");
    assert!(e.request_id.is_some(), "{e}");
    assert!(
        e.to_string()
            .contains("while reading Cinder's response body"),
        "{e}"
    );
    h.sim.add_fault(
        FaultRule::new(FaultOp::Cinder, Fault::TruncateBody { effect: true }).volume(volume),
    );
    let e = cinder.volume(volume, in_secs(5.0)).await.unwrap_err();
    assert_eq!(
        (e.kind, e.stage),
        (CinderErrorKind::ResponseLost, Stage::ReadBody),
        "{e}"
    );
    assert!(e.cause.contains("cut off"), "{}", e.cause);
    h.stop().await;
}

#[tokio::test]
async fn a_closed_connection_a_refused_one_and_garbage_each_have_their_class() {
    let h = start(SimConfig::default()).await;
    let c = direct(&h, |_| {});
    let cinder = c.cinder().unwrap();
    let volume = Uuid::new_v4();
    h.sim
        .add_fault(FaultRule::new(FaultOp::Cinder, Fault::CloseBeforeEffect).volume(volume));
    let e = cinder.volume(volume, in_secs(5.0)).await.unwrap_err();
    assert_eq!(
        (e.kind, e.stage),
        (CinderErrorKind::ResponseLost, Stage::AwaitHeaders),
        "{e}"
    );
    h.sim
        .add_fault(FaultRule::new(FaultOp::Cinder, Fault::GarbageBody).volume(volume));
    let e = cinder.volume(volume, in_secs(5.0)).await.unwrap_err();
    assert_eq!(
        (e.kind, e.stage),
        (CinderErrorKind::Undecodable, Stage::Decode),
        "{e}"
    );
    assert!(e.cause.contains("contract"), "{}", e.cause);
    // Nothing listens: never sent.
    let (_refusing, addr) = support::refusing_port();
    let port = addr.port();
    let nowhere = direct(&h, |cfg| {
        cfg.cinder_url = Some(format!("http://127.0.0.1:{port}/v3/p"));
    });
    let e = nowhere
        .cinder()
        .unwrap()
        .volume(volume, in_secs(5.0))
        .await
        .unwrap_err();
    assert_eq!(
        (e.kind, e.stage),
        (CinderErrorKind::ConnectFailed, Stage::Connect),
        "{e}"
    );
    assert!(e.cause.to_lowercase().contains("connect"), "{}", e.cause);
    h.stop().await;
}

#[tokio::test]
async fn cinders_own_errors_and_a_proxys_pages_are_rejections_with_their_context() {
    let h = start(SimConfig::default()).await;
    let c = direct(&h, |_| {});
    let cinder = c.cinder().unwrap();
    let volume = Uuid::new_v4();
    h.sim.add_fault(
        FaultRule::new(
            FaultOp::Cinder,
            Fault::Status {
                code: 500,
                effect: false,
            },
        )
        .volume(volume),
    );
    let e = cinder.volume(volume, in_secs(5.0)).await.unwrap_err();
    assert_eq!(
        (e.kind, e.status),
        (CinderErrorKind::Rejected, Some(500)),
        "{e}"
    );
    assert_eq!(e.fault.as_deref(), Some("computeFault"));
    assert!(e.request_id.is_some() && e.transient());
    h.sim.add_fault(
        FaultRule::new(
            FaultOp::Cinder,
            Fault::ProxyError {
                code: 502,
                effect: false,
            },
        )
        .volume(volume),
    );
    let e = cinder.volume(volume, in_secs(5.0)).await.unwrap_err();
    assert_eq!(
        (e.kind, e.status),
        (CinderErrorKind::Rejected, Some(502)),
        "{e}"
    );
    assert_eq!(
        (e.fault.as_deref(), e.message.as_deref()),
        (None, Some("Bad Gateway"))
    );
    assert!(e.request_id.is_none(), "a proxy answered, not Cinder");
    assert!(e.metadata()["cause"].contains("502"));
    h.stop().await;
}

#[tokio::test]
async fn an_unserved_microversion_and_a_wrong_endpoint_are_not_a_missing_volume() {
    let h = start(SimConfig::default()).await;
    let volume = Uuid::new_v4();
    let too_new = direct(&h, |cfg| cfg.cinder_microversion = "3.99".into());
    let e = too_new
        .cinder()
        .unwrap()
        .volume(volume, in_secs(5.0))
        .await
        .unwrap_err();
    assert_eq!(
        (e.kind, e.status),
        (CinderErrorKind::MicroversionUnsupported, Some(406)),
        "{e}"
    );
    assert!(
        e.message
            .as_deref()
            .unwrap()
            .contains("Minimum is 3.0 and maximum is 3.71"),
        "{e}"
    );
    assert!(!e.transient());
    // The endpoint without the project id: Cinder routes it only from
    // 3.67 on; below, a 404 that is not about the volume.
    let bare = format!("{}/v3", h.base_url);
    let old = direct(&h, |cfg| cfg.cinder_url = Some(bare.clone()));
    let e = old
        .cinder()
        .unwrap()
        .volume(volume, in_secs(5.0))
        .await
        .unwrap_err();
    assert_eq!(
        (e.kind, e.status),
        (CinderErrorKind::Rejected, Some(404)),
        "{e}"
    );
    let new = direct(&h, |cfg| {
        cfg.cinder_url = Some(bare.clone());
        cfg.cinder_microversion = "3.67".into();
    });
    assert_eq!(look(&new, volume).await.status, VolumeStatus::Available);
    h.stop().await;
}

#[tokio::test]
async fn waiting_for_a_cinder_slot_counts_against_the_deadline() {
    let h = start(SimConfig::default()).await;
    let c = Arc::new(direct(&h, |cfg| cfg.max_concurrent_per_host = 1));
    let volume = Uuid::new_v4();
    h.sim.add_fault(
        FaultRule::new(FaultOp::Cinder, Fault::DelayBeforeEffect { ms: 1500 }).volume(volume),
    );
    let c2 = c.clone();
    let slow =
        tokio::spawn(async move { c2.cinder().unwrap().volume(volume, in_secs(10.0)).await });
    support::eventually(
        Duration::from_secs(5),
        "the slow request holds the slot",
        || async { c.cinder().unwrap().slots_in_use() == 1 },
    )
    .await;
    let e = c
        .cinder()
        .unwrap()
        .volume(Uuid::new_v4(), in_secs(0.3))
        .await
        .unwrap_err();
    assert_eq!(
        (e.kind, e.stage),
        (CinderErrorKind::DeadlineExceeded, Stage::AcquireSlot)
    );
    assert!(e.to_string().contains("connection slot"), "{e}");
    // Nova's requests have their own slots.
    assert_eq!(c.slots_in_use(), 0);
    c.list(Uuid::new_v4(), in_secs(5.0)).await.unwrap();
    slow.await.unwrap().unwrap();
    h.stop().await;
}

// --- where Cinder is, and what confirms ------------------------------------

#[tokio::test]
async fn direct_mode_confirms_with_cinder_only_when_given_its_url() {
    let h = start(SimConfig::default()).await;
    let with = |tune: fn(&mut NovaConfig)| direct(&h, tune);
    let deadline = in_secs(5.0);
    let c = with(|_| {});
    assert_eq!(
        c.confirmation(deadline).await.unwrap().with(),
        ConfirmWith::Cinder
    );
    let c = with(|cfg| cfg.cinder_url = None);
    assert!(c.cinder().is_none());
    assert_eq!(
        c.confirmation(deadline).await.unwrap().with(),
        ConfirmWith::NovaList
    );
    let c = with(|cfg| cfg.confirm_with = Some(ConfirmWith::NovaList));
    assert!(c.cinder().is_none(), "not wanted, not built");
    assert_eq!(
        c.confirmation(deadline).await.unwrap().with(),
        ConfirmWith::NovaList
    );
    h.stop().await;
}

#[tokio::test]
async fn keystone_mode_finds_cinder_in_the_catalog_under_either_type_and_sends_the_token() {
    for kind in ["block-storage", "volumev3"] {
        let h = start(SimConfig {
            require_auth: true,
            catalog_block_storage: kind.into(),
            ..SimConfig::default()
        })
        .await;
        let c = via_keystone(&h, |_| {});
        let cinder = c.cinder().expect("Keystone mode can find Cinder");
        assert_eq!(
            cinder.endpoint(in_secs(5.0)).await.unwrap().as_deref(),
            Some(h.cinder_url.as_str()),
            "{kind}"
        );
        assert_eq!(
            c.confirmation(in_secs(5.0)).await.unwrap().with(),
            ConfirmWith::Cinder
        );
        // The simulator requires the token, so this read carried it.
        let (server, volume) = ids();
        h.sim.seed_attachment(server, volume);
        let v = look(&c, volume).await;
        assert_eq!(v.attach_progress(server), AttachProgress::Attached);
        assert_eq!(
            c.auth().unwrap().renewals(),
            1,
            "one token for both services"
        );
        h.stop().await;
    }
}

#[tokio::test]
async fn a_catalog_without_cinder_falls_back_to_novas_list_unless_cinder_was_required() {
    let h = start(SimConfig {
        require_auth: true,
        catalog_block_storage: "none".into(),
        ..SimConfig::default()
    })
    .await;
    let c = via_keystone(&h, |_| {});
    assert_eq!(
        c.cinder().unwrap().endpoint(in_secs(5.0)).await.unwrap(),
        None
    );
    assert_eq!(
        c.confirmation(in_secs(5.0)).await.unwrap().with(),
        ConfirmWith::NovaList
    );
    // Required anyway: the read says why it cannot be made.
    let required = via_keystone(&h, |cfg| cfg.confirm_with = Some(ConfirmWith::Cinder));
    assert_eq!(
        required.confirmation(in_secs(5.0)).await.unwrap().with(),
        ConfirmWith::Cinder
    );
    let e = required
        .cinder()
        .unwrap()
        .volume(Uuid::new_v4(), in_secs(5.0))
        .await
        .unwrap_err();
    assert_eq!(
        (e.kind, e.stage),
        (CinderErrorKind::NoEndpoint, Stage::Authenticate),
        "{e}"
    );
    assert!(e.cause.contains("block-storage"), "{}", e.cause);
    assert!(!e.transient());
    // --cinder-url overrides the catalog, with Keystone's token.
    let given = via_keystone(&h, |cfg| cfg.cinder_url = Some(h.cinder_url.clone()));
    assert_eq!(
        given.confirmation(in_secs(5.0)).await.unwrap().with(),
        ConfirmWith::Cinder
    );
    assert_eq!(
        look(&given, Uuid::new_v4()).await.status,
        VolumeStatus::Available
    );
    h.stop().await;
}

#[tokio::test]
async fn keystone_failures_are_reported_not_guessed_and_a_401_is_replayed_once() {
    let h = start(SimConfig {
        require_auth: true,
        ..SimConfig::default()
    })
    .await;
    let mut k = keystone(&h);
    k.credential = password("wrong");
    let c = NovaClient::new(NovaConfig {
        endpoint: NovaEndpoint::Keystone(k),
        ..NovaConfig::default()
    });
    let e = c
        .confirmation(in_secs(5.0))
        .await
        .expect_err("no token, no answer");
    assert_eq!(
        (e.kind, e.stage),
        (CinderErrorKind::AuthFailed, Stage::Authenticate),
        "{e}"
    );
    assert!(
        e.cause.contains("401") && !e.cause.contains("wrong"),
        "{}",
        e.cause
    );
    // An expired token: one renewal and one replay, as for Nova.
    let c = via_keystone(&h, |_| {});
    let volume = Uuid::new_v4();
    look(&c, volume).await;
    h.sim.expire_tokens();
    look(&c, volume).await;
    assert_eq!(c.auth().unwrap().renewals(), 2);
    // 401 after the replay too: reported, not looped.
    h.sim
        .add_fault(FaultRule::new(FaultOp::Cinder, Fault::Unauthorized).times(2));
    let e = c
        .cinder()
        .unwrap()
        .volume(volume, in_secs(5.0))
        .await
        .unwrap_err();
    assert_eq!(
        (e.kind, e.status),
        (CinderErrorKind::Rejected, Some(401)),
        "{e}"
    );
    assert_eq!(
        h.sim.cinder_read_count(volume),
        4,
        "two reads, then 401, replay, 401"
    );
    h.stop().await;
}

// --- the documents clients discover the simulator with --------------------

async fn get_json(url: String, headers: &[(&str, &str)]) -> (u16, serde_json::Value) {
    let mut req = reqwest::Client::new().get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.unwrap();
    (resp.status().as_u16(), resp.json().await.unwrap())
}

/// A fixture with the sample's host replaced by the simulator's.
fn fixture(text: &str, sample_host: &str, h: &SimHandle) -> serde_json::Value {
    serde_json::from_str(&text.replace(sample_host, &h.base_url)).unwrap()
}

#[tokio::test]
async fn the_version_documents_are_novas_and_cinders_own_samples() {
    let h = start(SimConfig::default()).await;
    let nova_host = "http://openstack.example.com";
    assert_eq!(
        get_json(format!("{}/", h.base_url), &[]).await,
        (
            200,
            fixture(
                include_str!("../fixtures/nova/versions/versions-get-resp.json"),
                nova_host,
                &h
            )
        )
    );
    let v21 = fixture(
        include_str!("../fixtures/nova/versions/v21-version-get-resp.json"),
        nova_host,
        &h,
    );
    for path in ["/v2.1", "/v2.1/"] {
        assert_eq!(
            get_json(format!("{}{path}", h.base_url), &[]).await,
            (200, v21.clone()),
            "{path}"
        );
    }
    let cinder = fixture(
        include_str!("../fixtures/cinder/versions/version-show-response.json"),
        "http://127.0.0.1:44895",
        &h,
    );
    for path in ["/v3", "/v3/"] {
        assert_eq!(
            get_json(format!("{}{path}", h.base_url), &[]).await,
            (200, cinder.clone()),
            "{path}"
        );
    }
    // Keystone's, at the auth URL keystoneauth discovers before it
    // authenticates.
    let (status, doc) = get_json(h.auth_url.clone(), &[]).await;
    assert_eq!(status, 200);
    assert_eq!(doc["version"]["status"], "stable");
    assert_eq!(
        doc["version"]["links"][0]["href"],
        format!("{}/", h.auth_url)
    );
    h.stop().await;
}

#[tokio::test]
async fn the_simulators_volume_has_the_keys_of_cinders_samples_at_each_microversion() {
    let h = start(SimConfig::default()).await;
    // Keys only an admin sees; the service is a project member.
    let admin_only = [
        "migration_status",
        "os-vol-host-attr:host",
        "os-vol-mig-status-attr:migstat",
        "os-vol-mig-status-attr:name_id",
        "provider_id",
        "cluster_name",
    ];
    let keys = |v: &serde_json::Value| {
        let mut k: Vec<String> = v["volume"]
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| !admin_only.contains(&k.as_str()))
            .cloned()
            .collect();
        k.sort();
        k
    };
    let volume = Uuid::new_v4();
    for (version, sample) in [
        (
            "3.0",
            include_str!("../fixtures/cinder/volumes/volume-show-response.json"),
        ),
        (
            "3.69",
            include_str!("../fixtures/cinder/volumes/v3.69/volume-show-response.json"),
        ),
    ] {
        let header = format!("volume {version}");
        let (status, ours) = get_json(
            format!("{}/volumes/{volume}", h.cinder_url),
            &[("OpenStack-API-Version", header.as_str())],
        )
        .await;
        assert_eq!(status, 200);
        let theirs: serde_json::Value = serde_json::from_str(sample).unwrap();
        assert_eq!(keys(&ours), keys(&theirs), "at {version}");
    }
    h.stop().await;
}

// --- what `serve` says at startup ------------------------------------------

/// Starts `serve` on the embedded ledger with `args`, and returns the first
/// line of its log that contains `wanted` (failing after 30 s), then stops
/// it.
async fn serve_logs(args: &[&str], wanted: &str) -> String {
    use tokio::io::AsyncBufReadExt;
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("vr-cinder-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let db = format!("sqlite://{}", dir.join("ledger.db").display());
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_volume-reconciler"));
    for (k, _) in std::env::vars() {
        if k.starts_with("OS_") || k.starts_with("VOLUME_RECONCILER_") || k == "DATABASE_URL" {
            cmd.env_remove(k);
        }
    }
    let mut child = cmd
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--database-url",
            &db,
            "--no-reconciler",
        ])
        .args(args)
        .env("VOLUME_RECONCILER_LOG", "info")
        .env("VOLUME_RECONCILER_LOG_FORMAT", "json")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the binary starts");
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    let found = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains(wanted) {
                return Some(line);
            }
            seen.push(line);
        }
        None
    })
    .await;
    // Cleanup: the process may have exited on its own already.
    drop(child.start_kill());
    drop(child.wait().await);
    drop(std::fs::remove_dir_all(&dir));
    match found {
        Ok(Some(line)) => line,
        other => panic!(
            "no log line with {wanted:?} ({other:?}); the log was:\n{}",
            seen.join("\n")
        ),
    }
}

#[tokio::test]
async fn serve_says_at_startup_how_attaches_are_confirmed_and_warns_without_cinder() {
    let h = start(SimConfig::default()).await;
    let line = serve_logs(
        &["--nova-url", &h.nova_url],
        "confirmed with Nova's attachment list",
    )
    .await;
    assert!(line.contains("WARN"), "{line}");
    let line = serve_logs(
        &["--nova-url", &h.nova_url, "--confirm-with", "nova-list"],
        "attachment list, as configured",
    )
    .await;
    assert!(line.contains("INFO"), "chosen, so no warning: {line}");
    let line = serve_logs(
        &["--nova-url", &h.nova_url, "--cinder-url", &h.cinder_url],
        "confirmed with Cinder, as configured",
    )
    .await;
    assert!(
        line.contains("\"confirm_with\":\"cinder\"") && line.contains(&h.cinder_url),
        "{line}"
    );
    let keystone = |h: &SimHandle| {
        vec![
            "--os-auth-url".to_string(),
            h.auth_url.clone(),
            "--os-username".into(),
            "demo".into(),
            "--os-password".into(),
            "secret".into(),
            "--os-project-name".into(),
            "demo".into(),
            "--os-region-name".into(),
            "RegionOne".into(),
        ]
    };
    let args = keystone(&h);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let line = serve_logs(&args, "block-storage endpoint from the catalog").await;
    assert!(line.contains(&h.cinder_url), "{line}");
    h.stop().await;
    let h = start(SimConfig {
        catalog_block_storage: "none".into(),
        ..SimConfig::default()
    })
    .await;
    let args = keystone(&h);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let line = serve_logs(&args, "catalog has no block-storage").await;
    assert!(line.contains("WARN"), "{line}");
    h.stop().await;
}
