//! The Nova adapter against the simulator over real sockets: the caller's
//! deadline is the only bound, and every error says which clock fired, at
//! both stages (headers and body), with its full context.

use crate::support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use uuid::Uuid;
use volume_reconciler::domain::RequestParams;
use volume_reconciler::nova::types::{AttachBody, AttachmentEnvelope, AttachmentList};
use volume_reconciler::nova::{
    AttachAnswer, Credential, KeystoneConfig, NovaClient, NovaConfig, NovaEndpoint, NovaError,
    NovaErrorKind, Rejection, Secret, Stage,
};
use volume_reconciler::sim::{self, Fault, FaultOp, FaultRule, SimConfig, SimHandle};

async fn sim_and_client(cfg: SimConfig, microversion: &str) -> (SimHandle, NovaClient) {
    support::init_logs();
    let h = sim::start("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap();
    let client = NovaClient::new(NovaConfig {
        endpoint: NovaEndpoint::Direct(h.nova_url.clone()),
        microversion: microversion.parse().expect("a microversion"),
        ..NovaConfig::default()
    });
    (h, client)
}

fn in_secs(s: f64) -> Instant {
    Instant::now() + Duration::from_secs_f64(s)
}

fn ids() -> (Uuid, Uuid) {
    (Uuid::new_v4(), Uuid::new_v4())
}

/// An attach with default parameters and 5 s that must fail: its error.
async fn attach_fails(client: &NovaClient, s: Uuid, v: Uuid) -> NovaError {
    client
        .attach(s, v, &RequestParams::default(), in_secs(5.0))
        .await
        .unwrap_err()
}

#[test]
fn every_shared_nova_sample_parses() {
    let mut parsed = 0;
    let mut stack = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/nova")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if !name.ends_with(".json") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let ok = match name.as_str() {
                "attach-volume-to-server-req.json" => {
                    serde_json::from_str::<AttachBody>(&text).map(drop)
                }
                "attach-volume-to-server-resp.json" | "volume-attachment-detail-resp.json" => {
                    serde_json::from_str::<AttachmentEnvelope>(&text).map(drop)
                }
                "list-volume-attachments-resp.json" => {
                    serde_json::from_str::<AttachmentList>(&text).map(|l| {
                        assert!(!l.volume_attachments.is_empty());
                        for a in &l.volume_attachments {
                            assert!(!a.best_id().is_empty());
                        }
                    })
                }
                // Swap/update bodies and version documents are not part of
                // what the adapter sends or reads; they must still be JSON.
                _ => serde_json::from_str::<serde_json::Value>(&text).map(drop),
            };
            ok.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            parsed += 1;
        }
    }
    assert!(parsed >= 37, "all samples were read ({parsed})");
    // 2.89+ list items carry attachment_id/bdm_uuid instead of id.
    let l: AttachmentList = serde_json::from_str(include_str!(
        "../fixtures/nova/os-volume_attachments/v2.89/list-volume-attachments-resp.json"
    ))
    .unwrap();
    assert!(l.volume_attachments[0].id.is_none());
    assert_eq!(
        l.volume_attachments[0].best_id(),
        "979ce4f8-033a-409d-85e6-6b5c0f6a6302"
    );
    let l: AttachmentList = serde_json::from_str(include_str!(
        "../fixtures/nova/os-volume_attachments/list-volume-attachments-resp.json"
    ))
    .unwrap();
    assert_eq!(
        l.volume_attachments[0].best_id(),
        "227cc671-f30b-4488-96fd-7d0bf13648d8"
    );
}

#[test]
fn the_http_client_has_no_response_read_or_total_timeout() {
    // Behavioural proof is the next test; this one keeps anybody from
    // adding a transport constant that could cut a request short.
    let client = volume_reconciler::nova::build_http_client(&NovaConfig::default(), true);
    let debug = format!("{client:?}");
    assert!(
        !debug.contains("timeout:"),
        "a total timeout was configured: {debug}"
    );
    assert!(
        !debug.contains("read_timeout"),
        "a read timeout was configured: {debug}"
    );
    // Every file of the adapter, in its subfolders too.
    let mut dirs = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("src/nova")];
    let mut files = Vec::new();
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                files.push(path);
            }
        }
    }
    assert!(files.len() > 5, "{files:?}");
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        for forbidden in [
            ".timeout(",
            ".read_timeout(",
            "http1_header_read_timeout",
            "pool_timeout(",
        ] {
            assert!(
                !text.contains(forbidden),
                "{} calls {forbidden}: only the request's deadline may bound a request",
                path.display()
            );
        }
    }
}

#[tokio::test]
async fn a_slow_but_successful_attach_is_not_cut_short() {
    let (h, client) = sim_and_client(SimConfig::default(), "2.89").await;
    let (s, v) = ids();
    h.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::DelayAfterEffect { ms: 3000 }).volume(v));
    let started = Instant::now();
    let r = client
        .attach(s, v, &RequestParams::default(), in_secs(10.0))
        .await
        .unwrap();
    assert!(started.elapsed() >= Duration::from_millis(2900));
    match r {
        AttachAnswer::Attached(a) => assert_eq!(a.volume_id, v.to_string()),
        other => panic!("{other:?}"),
    }
    assert_eq!(h.sim.attach_effects(v), 1);
}

#[tokio::test]
async fn a_request_out_of_time_before_it_could_leave_is_not_sent() {
    // A slow durable write, or a slot or token that came at the last
    // instant, can leave no time: the request must not leave then, and the
    // failure must say so (nothing of it can take effect).
    let (h, client) = sim_and_client(SimConfig::default(), "2.89").await;
    let (s, v) = ids();
    let e = client
        .attach(s, v, &RequestParams::default(), Instant::now())
        .await
        .unwrap_err();
    assert_eq!(e.kind, NovaErrorKind::DeadlineExceeded);
    assert!(
        !e.may_have_reached && !e.outcome_unknown(),
        "provably never sent: {e:?}"
    );
    assert_eq!(h.sim.attach_requests(v), 0);
}

#[tokio::test]
async fn a_deadline_at_the_headers_is_a_deadline_and_may_have_reached_nova() {
    let (h, client) = sim_and_client(SimConfig::default(), "2.89").await;
    let (s, v) = ids();
    h.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::DelayAfterEffect { ms: 2000 }).volume(v));
    let e = client
        .attach(s, v, &RequestParams::default(), in_secs(0.3))
        .await
        .unwrap_err();
    assert_eq!(e.kind, NovaErrorKind::DeadlineExceeded);
    assert_eq!(e.stage, Stage::AwaitHeaders);
    assert!(e.may_have_reached && e.outcome_unknown());
    assert_eq!(e.method, "POST");
    assert!(
        e.url
            .ends_with(&format!("/servers/{s}/os-volume_attachments")),
        "{}",
        e.url
    );
    let text = e.to_string();
    assert!(
        text.contains("POST") && text.contains(&s.to_string()) && text.contains("deadline"),
        "{text}"
    );
    let meta = e.metadata();
    for key in [
        "method",
        "url",
        "stage",
        "elapsed_ms",
        "outbound_budget_ms",
        "cause",
    ] {
        assert!(meta.contains_key(key), "{key} missing from {meta:?}");
    }
    // Nova completed it anyway: the response was only lost.
    support::eventually(
        Duration::from_secs(5),
        "the attach takes effect",
        || async { h.sim.is_attached(s, v) },
    )
    .await;
}

#[tokio::test]
async fn a_deadline_while_reading_the_body_is_a_deadline_at_the_body_stage() {
    let (h, client) = sim_and_client(SimConfig::default(), "2.89").await;
    let (s, v) = ids();
    h.sim.add_fault(
        FaultRule::new(
            FaultOp::Attach,
            Fault::StallBody {
                ms: 5000,
                effect: true,
            },
        )
        .volume(v),
    );
    let e = client
        .attach(s, v, &RequestParams::default(), in_secs(0.5))
        .await
        .unwrap_err();
    assert_eq!(e.kind, NovaErrorKind::DeadlineExceeded, "{e}");
    assert_eq!(e.stage, Stage::ReadBody);
    assert_eq!(e.status, Some(200), "the headers had arrived");
    assert!(e.outcome_unknown());
    // A stalled list body too.
    h.sim.add_fault(
        FaultRule::new(
            FaultOp::List,
            Fault::StallBody {
                ms: 5000,
                effect: true,
            },
        )
        .server(s),
    );
    let e = client.list(s, in_secs(0.5)).await.unwrap_err();
    assert_eq!(
        (e.kind.clone(), e.stage),
        (NovaErrorKind::DeadlineExceeded, Stage::ReadBody)
    );
}

#[tokio::test]
async fn a_body_cut_off_midway_is_a_lost_response_at_the_body_stage() {
    let (h, client) = sim_and_client(SimConfig::default(), "2.89").await;
    let (s, v) = ids();
    h.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::TruncateBody { effect: true }).volume(v));
    let e = attach_fails(&client, s, v).await;
    assert_eq!(
        (e.kind.clone(), e.stage),
        (NovaErrorKind::ResponseLost, Stage::ReadBody),
        "{e}"
    );
    assert_eq!(e.status, Some(200), "the headers had arrived");
    assert!(
        e.outcome_unknown() && e.cause.contains("cut off"),
        "{}",
        e.cause
    );
    assert!(h.sim.is_attached(s, v));
}

#[tokio::test]
async fn a_success_whose_body_breaks_the_contract_is_undecodable_and_unknown() {
    let (h, client) = sim_and_client(SimConfig::default(), "2.89").await;
    let (s, v) = ids();
    h.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::GarbageBody).volume(v));
    let e = attach_fails(&client, s, v).await;
    assert_eq!(
        (e.kind.clone(), e.stage),
        (NovaErrorKind::Undecodable, Stage::Decode),
        "{e}"
    );
    assert!(
        e.outcome_unknown(),
        "a 200 we cannot read may still mean it happened"
    );
    assert!(e.metadata()["cause"].contains("contract"));
}

#[tokio::test]
async fn a_connection_closed_after_the_effect_is_a_lost_response() {
    let (h, client) = sim_and_client(SimConfig::default(), "2.89").await;
    let (s, v) = ids();
    h.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::CloseAfterEffect).volume(v));
    let e = attach_fails(&client, s, v).await;
    assert_eq!(e.kind, NovaErrorKind::ResponseLost, "{e}");
    assert_eq!(e.stage, Stage::AwaitHeaders);
    assert!(e.outcome_unknown());
    assert!(
        h.sim.is_attached(s, v),
        "Nova acted although the answer was lost"
    );
    assert!(!e.cause.is_empty());
}

#[tokio::test]
async fn a_refused_connection_was_never_sent() {
    support::init_logs();
    let (_refusing, addr) = support::refusing_port();
    let port = addr.port();
    let client = NovaClient::new(NovaConfig {
        endpoint: NovaEndpoint::Direct(format!("http://127.0.0.1:{port}/v2.1")),
        ..NovaConfig::default()
    });
    let (s, v) = ids();
    let e = attach_fails(&client, s, v).await;
    assert_eq!(e.kind, NovaErrorKind::ConnectFailed, "{e}");
    assert_eq!(e.stage, Stage::Connect);
    assert!(!e.may_have_reached && !e.outcome_unknown());
    assert!(e.cause.to_lowercase().contains("connect"), "{}", e.cause);
}

/// Answers every request on its port with `answer` (then closes), and
/// counts the connections it accepted.
async fn raw_http(answer: String) -> (u16, Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let answer = answer.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 16 * 1024];
                // The request's head and body come in one read here; what
                // the server answers does not depend on them.
                if conn.read(&mut buf).await.is_ok() {
                    // The client may already have gone: nothing to do then.
                    drop(conn.write_all(answer.as_bytes()).await);
                }
            });
        }
    });
    (port, accepted)
}

#[tokio::test]
async fn a_redirect_is_not_followed_and_its_error_says_where_it_pointed() {
    support::init_logs();
    // Where a redirect points: a peer that must never hear the request
    // (it would get the token, and a POST turned into a GET).
    let (elsewhere, reached) = raw_http("HTTP/1.1 204 No Content\r\n\r\n".into()).await;
    let (s, v) = ids();
    let target = format!("http://127.0.0.1:{elsewhere}/v2.1/servers/{s}/os-volume_attachments");
    for code in [301, 302, 303, 307, 308] {
        let (front, asked) = raw_http(format!(
            "HTTP/1.1 {code} Moved\r\nLocation: {target}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        ))
        .await;
        let client = NovaClient::new(NovaConfig {
            endpoint: NovaEndpoint::Direct(format!("http://127.0.0.1:{front}/v2.1")),
            microversion: "2.89".parse().expect("a microversion"),
            ..NovaConfig::default()
        });
        let e = attach_fails(&client, s, v).await;
        assert_eq!(
            (e.kind.clone(), e.status),
            (NovaErrorKind::Foreign, Some(code)),
            "{e}"
        );
        assert!(e.outcome_unknown(), "{e}");
        let said = e.to_string();
        assert!(
            said.contains(&target) && said.contains("not followed"),
            "{said}"
        );
        assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 1);
    }
    assert_eq!(
        reached.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "a redirect was followed"
    );
}

#[tokio::test]
async fn novas_own_errors_are_classified_by_meaning() {
    let (h, client) = sim_and_client(SimConfig::default(), "2.89").await;
    let params = RequestParams::default();
    // 400 already attached (to another server), naming that server.
    let (s1, v) = ids();
    let s2 = Uuid::new_v4();
    client.attach(s1, v, &params, in_secs(5.0)).await.unwrap();
    let e = client
        .attach(s2, v, &params, in_secs(5.0))
        .await
        .unwrap_err();
    assert_eq!(
        e.kind,
        NovaErrorKind::Rejected(Rejection::AlreadyAttached {
            servers: vec![s1.to_string()]
        })
    );
    assert_eq!(
        (e.status, e.fault.as_deref()),
        (Some(400), Some("badRequest"))
    );
    assert!(
        e.message
            .as_deref()
            .unwrap()
            .contains("already attached to instances")
    );
    // 409 locked: transient, not taken effect.
    let (s, v) = ids();
    h.sim.lock_server(s, true);
    let e = client
        .attach(s, v, &params, in_secs(5.0))
        .await
        .unwrap_err();
    assert_eq!(e.kind, NovaErrorKind::Rejected(Rejection::Conflict));
    assert!(!e.outcome_unknown());
    assert_eq!(
        e.message.as_deref(),
        Some(format!("Instance {s} is locked").as_str())
    );
    // 404 server, 404 volume.
    let (s, v) = ids();
    h.sim.remove_server(s);
    let e = client
        .attach(s, v, &params, in_secs(5.0))
        .await
        .unwrap_err();
    assert_eq!(e.kind, NovaErrorKind::Rejected(Rejection::ServerNotFound));
    let (s, v) = ids();
    h.sim.remove_volume(v);
    let e = client
        .attach(s, v, &params, in_secs(5.0))
        .await
        .unwrap_err();
    assert_eq!(e.kind, NovaErrorKind::Rejected(Rejection::VolumeNotFound));
    // 500 computeFault: outcome unknown (here it did take effect).
    let (s, v) = ids();
    h.sim.add_fault(
        FaultRule::new(
            FaultOp::Attach,
            Fault::Status {
                code: 500,
                effect: true,
            },
        )
        .volume(v),
    );
    let e = client
        .attach(s, v, &params, in_secs(5.0))
        .await
        .unwrap_err();
    assert_eq!(e.kind, NovaErrorKind::Rejected(Rejection::ServerError));
    assert_eq!(e.fault.as_deref(), Some("computeFault"));
    assert!(e.outcome_unknown());
    assert!(h.sim.is_attached(s, v));
    // A proxy's non-JSON 504: not Nova's answer, of unknown effect.
    let (s, v) = ids();
    h.sim.add_fault(
        FaultRule::new(
            FaultOp::Attach,
            Fault::ProxyError {
                code: 504,
                effect: false,
            },
        )
        .volume(v),
    );
    let e = client
        .attach(s, v, &params, in_secs(5.0))
        .await
        .unwrap_err();
    assert_eq!(e.kind, NovaErrorKind::Foreign);
    assert_eq!(
        (e.status, e.fault.clone(), e.message.as_deref()),
        (Some(504), None, None)
    );
    assert!(e.cause.contains("Gateway Timeout"), "{}", e.cause);
    assert!(e.outcome_unknown());
    // Detach: 404 not attached means done; 400 while detaching means in progress.
    let (s, v) = ids();
    let e = client.detach(s, v, in_secs(5.0)).await.unwrap_err();
    assert_eq!(e.kind, NovaErrorKind::Rejected(Rejection::NotAttached));
    let mut cfg = h.sim.config();
    cfg.detach_delay_ms = 2000;
    h.sim.set_config(cfg);
    let (s, v) = ids();
    h.sim.seed_attachment(s, v);
    client.detach(s, v, in_secs(5.0)).await.unwrap();
    let e = client.detach(s, v, in_secs(5.0)).await.unwrap_err();
    assert_eq!(e.kind, NovaErrorKind::Rejected(Rejection::Detaching));
}

#[tokio::test]
async fn microversion_2_101_answers_202_and_the_list_tells_the_outcome() {
    let (h, client) = sim_and_client(SimConfig::default(), "2.101").await;
    let (s, v) = ids();
    let r = client
        .attach(s, v, &RequestParams::default(), in_secs(5.0))
        .await
        .unwrap();
    assert_eq!(r, AttachAnswer::Accepted);
    support::eventually(Duration::from_secs(5), "the attachment appears", || async {
        client
            .list(s, in_secs(2.0))
            .await
            .unwrap()
            .iter()
            .any(|a| a.volume_id == v.to_string())
    })
    .await;
    let shown = client.show(s, v, in_secs(2.0)).await.unwrap();
    assert!(shown.attachment_id.is_some() && shown.bdm_uuid.is_some() && shown.id.is_none());
    // At 2.1, items carry `id`.
    let old = NovaClient::new(NovaConfig {
        endpoint: NovaEndpoint::Direct(h.nova_url.clone()),
        microversion: "2.1".parse().expect("a microversion"),
        ..NovaConfig::default()
    });
    let items = old.list(s, in_secs(2.0)).await.unwrap();
    assert_eq!(items[0].id.as_deref(), Some(v.to_string().as_str()));
}

#[tokio::test]
async fn waiting_for_a_connection_slot_counts_against_the_deadline() {
    support::init_logs();
    let h = sim::start("127.0.0.1:0".parse().unwrap(), SimConfig::default())
        .await
        .unwrap();
    let client = Arc::new(NovaClient::new(NovaConfig {
        endpoint: NovaEndpoint::Direct(h.nova_url.clone()),
        max_concurrent_per_host: 1,
        ..NovaConfig::default()
    }));
    let (s, v) = ids();
    h.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::DelayAfterEffect { ms: 1500 }).volume(v));
    let c2 = client.clone();
    let slow = tokio::spawn(async move {
        c2.attach(s, v, &RequestParams::default(), in_secs(10.0))
            .await
    });
    support::eventually(
        Duration::from_secs(5),
        "the slow request holds the slot",
        || async { client.slots_in_use() == 1 },
    )
    .await;
    let e = client.list(s, in_secs(0.3)).await.unwrap_err();
    assert_eq!(
        (e.kind.clone(), e.stage),
        (NovaErrorKind::DeadlineExceeded, Stage::AcquireSlot)
    );
    assert!(!e.may_have_reached, "it never left the process");
    slow.await.unwrap().unwrap();
}

fn keystone(h: &SimHandle) -> KeystoneConfig {
    KeystoneConfig {
        auth_url: h.auth_url.clone(),
        credential: Credential::Password {
            username: "demo".into(),
            user_domain_name: "Default".into(),
            password: Secret::new("secret"),
            project_name: "demo".into(),
            project_domain_name: "Default".into(),
        },
        region: Some("RegionOne".into()),
        interface: "public".into(),
        renewal_timeout: Duration::from_secs(10),
        renew_before: Duration::from_secs(120),
    }
}

#[tokio::test]
async fn keystone_tokens_are_shared_renewed_once_and_replayed_once_on_401() {
    let cfg = SimConfig {
        require_auth: true,
        ..SimConfig::default()
    };
    let (h, _) = sim_and_client(cfg, "2.89").await;
    let client = Arc::new(NovaClient::new(NovaConfig {
        endpoint: NovaEndpoint::Keystone(keystone(&h)),
        ..NovaConfig::default()
    }));
    // Twenty concurrent callers trigger one renewal.
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let c = client.clone();
        tasks.push(tokio::spawn(async move {
            c.list(Uuid::new_v4(), in_secs(5.0)).await
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let auth = client.auth().unwrap().clone();
    assert_eq!(auth.renewals(), 1);
    // An expired token: 401 from the middleware, one renewal, one replay.
    h.sim.expire_tokens();
    let (s, v) = ids();
    client
        .attach(s, v, &RequestParams::default(), in_secs(5.0))
        .await
        .unwrap();
    assert_eq!(auth.renewals(), 2);
    assert_eq!(h.sim.attach_effects(v), 1);
    assert_eq!(
        h.sim.attach_requests(v),
        1,
        "the 401 never reached Nova's handler"
    );
    // 401 after the replay too: reported, not looped.
    h.sim
        .add_fault(FaultRule::new(FaultOp::List, Fault::Unauthorized).times(2));
    let e = client.list(s, in_secs(5.0)).await.unwrap_err();
    assert_eq!(e.kind, NovaErrorKind::Rejected(Rejection::Unauthorized));
    assert!(!e.may_have_reached);
}

#[tokio::test]
async fn a_callers_short_deadline_does_not_kill_a_renewal_others_wait_on() {
    let cfg = SimConfig {
        require_auth: true,
        ..SimConfig::default()
    };
    let (h, _) = sim_and_client(cfg, "2.89").await;
    let client = Arc::new(NovaClient::new(NovaConfig {
        endpoint: NovaEndpoint::Keystone(keystone(&h)),
        ..NovaConfig::default()
    }));
    // Keystone is slow; the first caller gives up long before it answers,
    // and the renewal it started goes on for the next caller.
    h.sim.add_fault(FaultRule::new(
        FaultOp::Auth,
        Fault::DelayBeforeEffect { ms: 1500 },
    ));
    let e = client.list(Uuid::new_v4(), in_secs(0.2)).await.unwrap_err();
    assert_eq!(e.stage, Stage::Authenticate);
    assert_eq!(e.kind, NovaErrorKind::DeadlineExceeded);
    client.list(Uuid::new_v4(), in_secs(5.0)).await.unwrap();
    assert_eq!(
        client.auth().unwrap().renewals(),
        1,
        "the second caller used the renewal the first one started"
    );
}

#[tokio::test]
async fn wrong_credentials_fail_authentication_with_keystones_reason() {
    let cfg = SimConfig {
        require_auth: true,
        ..SimConfig::default()
    };
    let (h, _) = sim_and_client(cfg, "2.89").await;
    let mut k = keystone(&h);
    if let Credential::Password { password, .. } = &mut k.credential {
        *password = Secret::new("wrong");
    }
    let client = NovaClient::new(NovaConfig {
        endpoint: NovaEndpoint::Keystone(k),
        ..NovaConfig::default()
    });
    let e = client.list(Uuid::new_v4(), in_secs(5.0)).await.unwrap_err();
    assert_eq!(
        (e.kind.clone(), e.stage),
        (NovaErrorKind::AuthFailed, Stage::Authenticate)
    );
    assert!(e.cause.contains("401"), "{}", e.cause);
    assert!(
        !e.cause.contains("wrong"),
        "the password never appears in errors"
    );
}

const NGINX_404: &str = "<html>\r\n<head><title>404 Not Found</title></head>\r\n<body>\r\n<center><h1>404 Not Found</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n";

/// What something in front of Nova answers instead of Nova.
fn page(code: u16, content_type: &str, body: &str, effect: bool) -> Fault {
    Fault::Page {
        code,
        content_type: content_type.into(),
        body: body.into(),
        effect,
    }
}

#[tokio::test]
async fn answers_that_are_not_novas_decide_nothing() {
    let (h, client) = sim_and_client(SimConfig::default(), "2.89").await;
    let params = RequestParams::default();
    // A detach of an attached volume answered by an ingress's 404 page:
    // not "the server is gone".
    let (s, v) = ids();
    h.sim.seed_attachment(s, v);
    h.sim.add_fault(
        FaultRule::new(FaultOp::Detach, page(404, "text/html", NGINX_404, false)).volume(v),
    );
    let e = client.detach(s, v, in_secs(5.0)).await.unwrap_err();
    assert_eq!(
        (e.kind.clone(), e.stage, e.status),
        (NovaErrorKind::Foreign, Stage::Decode, Some(404)),
        "{e}"
    );
    assert!(e.outcome_unknown() && e.rejection().is_none(), "{e}");
    assert!(e.fault.is_none() && e.message.is_none());
    assert!(
        e.cause.contains("text/html") && e.cause.contains("404 Not Found"),
        "the page is quoted: {}",
        e.cause
    );
    assert_eq!(e.metadata()["error_class"], "foreign_answer");
    assert!(h.sim.is_attached(s, v), "the volume never left");
    // Nor is the list's 404 page: the look fails, it sees no "gone".
    h.sim.add_fault(
        FaultRule::new(FaultOp::List, page(404, "text/html", NGINX_404, false)).server(s),
    );
    let e = client.list(s, in_secs(5.0)).await.unwrap_err();
    assert_eq!(e.kind, NovaErrorKind::Foreign, "{e}");
    // Nova's own 404 for a path it has no route for is about no server.
    h.sim.add_fault(
        FaultRule::new(
            FaultOp::Detach,
            page(
                404,
                "application/json; charset=UTF-8",
                r#"{"itemNotFound": {"code": 404, "message": "The resource could not be found."}}"#,
                false,
            ),
        )
        .volume(v),
    );
    let e = client.detach(s, v, in_secs(5.0)).await.unwrap_err();
    assert_eq!(e.kind, NovaErrorKind::Rejected(Rejection::Other), "{e}");
    assert!(e.outcome_unknown());
    // An attach answered by a captive proxy's 200 page at 2.89, and by a
    // load balancer's 502 page: neither says it attached or did not.
    for (code, body) in [
        (
            200,
            "<html><body>Welcome! Please accept the terms of use.</body></html>",
        ),
        (502, "<html><body><h1>502 Bad Gateway</h1></body></html>"),
    ] {
        let (s, v) = ids();
        h.sim.add_fault(
            FaultRule::new(FaultOp::Attach, page(code, "text/html", body, false)).volume(v),
        );
        let e = client
            .attach(s, v, &params, in_secs(5.0))
            .await
            .unwrap_err();
        let kind = if code == 200 {
            NovaErrorKind::Undecodable
        } else {
            NovaErrorKind::Foreign
        };
        assert_eq!((e.kind.clone(), e.status), (kind, Some(code)), "{e}");
        assert!(e.outcome_unknown(), "{e}");
        assert!(!h.sim.is_attached(s, v));
    }
    // A JSON fault cut short by a proxy, with its framing intact.
    let (s, v) = ids();
    h.sim.add_fault(
        FaultRule::new(
            FaultOp::Attach,
            page(
                409,
                "application/json",
                r#"{"conflictingRequest": {"code": 409, "message": "Instance is lo"#,
                false,
            ),
        )
        .volume(v),
    );
    let e = client
        .attach(s, v, &params, in_secs(5.0))
        .await
        .unwrap_err();
    assert_eq!(e.kind, NovaErrorKind::Foreign, "{e}");
}

#[tokio::test]
async fn a_proxys_own_401_is_not_replayed_as_keystonemiddlewares() {
    let cfg = SimConfig {
        require_auth: true,
        ..SimConfig::default()
    };
    let (h, _) = sim_and_client(cfg, "2.89").await;
    let client = NovaClient::new(NovaConfig {
        endpoint: NovaEndpoint::Keystone(keystone(&h)),
        ..NovaConfig::default()
    });
    client.list(Uuid::new_v4(), in_secs(5.0)).await.unwrap();
    let auth = client.auth().unwrap().clone();
    assert_eq!(auth.renewals(), 1);
    // The attach went through to Nova, then a proxy answered its own 401:
    // where it came from is unknown, so nothing is sent again.
    let (s, v) = ids();
    h.sim.add_fault(
        FaultRule::new(
            FaultOp::Attach,
            page(
                401,
                "text/html",
                "<html><head><title>401 Authorization Required</title></head></html>",
                true,
            ),
        )
        .volume(v),
    );
    let e = attach_fails(&client, s, v).await;
    assert_eq!(
        (e.kind.clone(), e.status),
        (NovaErrorKind::Foreign, Some(401)),
        "{e}"
    );
    assert!(e.outcome_unknown());
    assert_eq!(h.sim.attach_requests(v), 1, "not replayed");
    assert_eq!(h.sim.attach_effects(v), 1);
    assert_eq!(auth.renewals(), 1, "the token was not thrown away");
}

#[tokio::test]
async fn a_look_at_the_server_says_gone_only_with_novas_own_404() {
    let (h, client) = sim_and_client(SimConfig::default(), "2.89").await;
    let rid = volume_reconciler::nova::RequestId::fresh();
    let s = Uuid::new_v4();
    assert!(
        client
            .server_exists_as(&rid, s, in_secs(5.0))
            .await
            .unwrap()
            .value
    );
    // Something in front answers the look: it proves nothing.
    h.sim.add_fault(
        FaultRule::new(FaultOp::Server, page(404, "text/html", NGINX_404, false)).server(s),
    );
    let e = client
        .server_exists_as(&rid, s, in_secs(5.0))
        .await
        .unwrap_err();
    assert_eq!(e.kind, NovaErrorKind::Foreign, "{e}");
    h.sim.add_fault(
        FaultRule::new(
            FaultOp::Server,
            Fault::Status {
                code: 503,
                effect: false,
            },
        )
        .server(s),
    );
    let e = client
        .server_exists_as(&rid, s, in_secs(5.0))
        .await
        .unwrap_err();
    assert_eq!(
        e.kind,
        NovaErrorKind::Rejected(Rejection::ServerError),
        "{e}"
    );
    h.sim.remove_server(s);
    assert!(
        !client
            .server_exists_as(&rid, s, in_secs(5.0))
            .await
            .unwrap()
            .value
    );
}

#[tokio::test]
async fn a_body_over_the_cap_is_refused_naming_the_url_and_the_cap() {
    let (h, client) = sim_and_client(SimConfig::default(), "2.89").await;
    let (s, v) = ids();
    // Announced (Content-Length) or streamed without end: refused either way.
    for announced in [true, false] {
        h.sim.add_fault(
            FaultRule::new(
                FaultOp::List,
                Fault::HugeBody {
                    bytes: 3 << 20,
                    announced,
                },
            )
            .server(s),
        );
        let e = client.list(s, in_secs(10.0)).await.unwrap_err();
        assert_eq!(
            (e.kind.clone(), e.stage, e.status),
            (NovaErrorKind::TooLarge, Stage::ReadBody, Some(200)),
            "announced {announced}: {e}"
        );
        let text = e.to_string();
        assert!(
            text.contains(&format!("/servers/{s}/os-volume_attachments"))
                && text.contains("2 MiB cap"),
            "names the URL and the cap: {text}"
        );
        assert_eq!(e.metadata()["error_class"], "body_too_large");
    }
    // Below the cap a body is read whole (and then judged: no list).
    h.sim.add_fault(
        FaultRule::new(
            FaultOp::List,
            Fault::HugeBody {
                bytes: 1 << 20,
                announced: false,
            },
        )
        .server(s),
    );
    let e = client.list(s, in_secs(10.0)).await.unwrap_err();
    assert_eq!(e.kind, NovaErrorKind::Undecodable, "{e}");
    // A mutation whose answer is too large is of unknown effect (this one
    // took effect).
    h.sim.add_fault(
        FaultRule::new(
            FaultOp::Attach,
            Fault::HugeBody {
                bytes: 3 << 20,
                announced: false,
            },
        )
        .volume(v),
    );
    let e = client
        .attach(s, v, &RequestParams::default(), in_secs(10.0))
        .await
        .unwrap_err();
    assert_eq!(e.kind, NovaErrorKind::TooLarge, "{e}");
    assert!(e.outcome_unknown());
    assert!(h.sim.is_attached(s, v));
}

/// Keystone token requests the simulator received (refused ones too).
fn token_posts(h: &SimHandle) -> usize {
    h.sim
        .truth()
        .http
        .iter()
        .filter(|r| r.method == "POST" && r.path.ends_with("/auth/tokens"))
        .count()
}

#[tokio::test]
async fn a_failing_renewal_backs_off_and_the_valid_token_keeps_serving() {
    let cfg = SimConfig {
        require_auth: true,
        record_history: true,
        ..SimConfig::default()
    };
    let (h, _) = sim_and_client(cfg, "2.89").await;
    let mut k = keystone(&h);
    // Tokens live an hour; this one is due for renewal a second after it
    // was issued, and stays valid for the hour.
    k.renew_before = Duration::from_secs(3600 - 1);
    let client = NovaClient::new(NovaConfig {
        endpoint: NovaEndpoint::Keystone(k),
        ..NovaConfig::default()
    });
    client.list(Uuid::new_v4(), in_secs(5.0)).await.unwrap();
    assert_eq!(h.sim.issued_tokens().len(), 1);
    h.sim.add_fault(
        FaultRule::new(
            FaultOp::Auth,
            Fault::Status {
                code: 503,
                effect: false,
            },
        )
        .always(),
    );
    // Once the token is due, renewals fail; callers are served all along.
    support::eventually(
        Duration::from_secs(15),
        "a renewal was tried and refused",
        || async {
            client
                .list(Uuid::new_v4(), in_secs(5.0))
                .await
                .expect("the token held serves while a renewal fails");
            token_posts(&h) >= 2
        },
    )
    .await;
    // Two seconds of calls back to back: every one served with the token
    // held, and Keystone asked a few times (1 s doubling, jittered), not
    // once per call.
    let before = token_posts(&h);
    let end = Instant::now() + Duration::from_secs(2);
    let mut calls = 0;
    while Instant::now() < end {
        client
            .list(Uuid::new_v4(), in_secs(5.0))
            .await
            .expect("the token held serves while renewals fail");
        calls += 1;
    }
    let asked = token_posts(&h) - before;
    assert!(calls >= 20, "only {calls} calls in 2 s");
    assert!(
        asked <= 4,
        "Keystone asked {asked} times in 2 s ({calls} calls)"
    );
    // Keystone back: a renewal within the bounded backoff replaces it.
    h.sim.clear_faults();
    support::eventually(
        Duration::from_secs(30),
        "a renewal succeeds after the backoff",
        || async {
            client.list(Uuid::new_v4(), in_secs(5.0)).await.unwrap();
            h.sim.issued_tokens().len() == 2
        },
    )
    .await;
}

#[tokio::test]
async fn a_caller_without_a_valid_token_hears_why_and_keystone_is_not_asked_again_at_once() {
    let cfg = SimConfig {
        require_auth: true,
        record_history: true,
        ..SimConfig::default()
    };
    let (h, _) = sim_and_client(cfg, "2.89").await;
    let client = NovaClient::new(NovaConfig {
        endpoint: NovaEndpoint::Keystone(keystone(&h)),
        ..NovaConfig::default()
    });
    client.list(Uuid::new_v4(), in_secs(5.0)).await.unwrap();
    h.sim.add_fault(
        FaultRule::new(
            FaultOp::Auth,
            Fault::Status {
                code: 503,
                effect: false,
            },
        )
        .always(),
    );
    // The token is refused (401), the renewal fails: Keystone's reason.
    h.sim.expire_tokens();
    let e = client.list(Uuid::new_v4(), in_secs(5.0)).await.unwrap_err();
    assert_eq!(
        (e.kind.clone(), e.stage),
        (NovaErrorKind::AuthFailed, Stage::Authenticate),
        "{e}"
    );
    assert!(e.cause.contains("503"), "{}", e.cause);
    let asked = token_posts(&h);
    // The next caller, inside the backoff (at least half a second) and
    // with less time than it: answered at once with Keystone's reason (not
    // a deadline), and Keystone is not asked.
    let e = client.list(Uuid::new_v4(), in_secs(0.3)).await.unwrap_err();
    assert_eq!(
        (e.kind.clone(), e.stage),
        (NovaErrorKind::AuthFailed, Stage::Authenticate),
        "{e}"
    );
    assert!(
        e.cause.contains("503") && e.cause.contains("the last renewal failed"),
        "{}",
        e.cause
    );
    assert_eq!(
        token_posts(&h),
        asked,
        "Keystone was not asked inside the backoff"
    );
    // A caller with time to wait for the next renewal waits for it, and
    // hears how it went.
    let e = client
        .list(Uuid::new_v4(), in_secs(10.0))
        .await
        .unwrap_err();
    assert_eq!(e.kind, NovaErrorKind::AuthFailed, "{e}");
    assert_eq!(token_posts(&h), asked + 1, "one renewal, after the backoff");
}
