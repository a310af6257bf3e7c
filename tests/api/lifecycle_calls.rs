//! The ledger stays true over a volume's whole life (issue #15), items 8,
//! 9 and 11 (the others are in `lifecycle.rs`): idempotency keys per
//! caller (tokens and mutual TLS), bounded memory while an operation
//! waits, and Nova's answers taken by what they mean. Through the real
//! server chain and the simulator, checked against its ground truth.

use crate::on_both_ledgers;
use crate::support;

use support::lifecycle::*;
use support::{AppOptions, Ledger, TestApp, error_info, spawn_app, with_timeout};
use tokio::time::Instant;
use tonic::Code;
use uuid::Uuid;
use volume_reconciler::domain::{OperationEvent, Reason, Resolution, State};
use volume_reconciler::grpc::pb;
use volume_reconciler::sim::{Fault, FaultOp, FaultRule, SimConfig};

// ---------------------------------------------------------------------
// 8. Idempotency keys are per caller.
// ---------------------------------------------------------------------

fn bearer<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut r = with_timeout(msg, secs(10.0));
    r.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    r
}

fn get_by_key(key: &str, caller: &str) -> pb::GetOperationRequest {
    pb::GetOperationRequest {
        idempotency_key: key.into(),
        caller: caller.into(),
        ..Default::default()
    }
}

/// Two orchestrators (tokens) use the same key: two operations. Neither
/// joins, reads or is told of the other's; a key reused with other
/// parameters names the caller's own operation; an operator looks either
/// up by (caller, key).
async fn two_callers_with_one_key_get_two_operations_and_never_see_each_other(ledger: Ledger) {
    use volume_reconciler::grpc::auth::sha256_hex;
    let tokens = format!(
        "ci-a:orchestrator:{},ci-b:orchestrator:{},ops:operator:{}",
        sha256_hex("token-a"),
        sha256_hex("token-b"),
        sha256_hex("token-ops")
    );
    let app = spawn_app(with_history(ledger).arg("--auth-tokens", &tokens)).await;
    let mut c = app.raw();
    let (s, v) = ids();
    let a = c
        .attach_volume(bearer(attach("shared", s, v), "token-a"))
        .await
        .unwrap()
        .into_inner();
    // B, the same key and the same request: its own operation (it finds
    // the volume already there, and says so), not A's.
    let b = c
        .attach_volume(bearer(attach("shared", s, v), "token-b"))
        .await
        .unwrap()
        .into_inner();
    assert_ne!(a.id, b.id, "two callers, two operations");
    assert_eq!((a.caller.as_str(), b.caller.as_str()), ("ci-a", "ci-b"));
    assert_eq!(b.state, pb::State::Succeeded as i32);
    let b_log = log(&app, id_of(&b)).await;
    assert!(
        b_log
            .iter()
            .any(|e| e.kind == "observed" || e.kind == "response"),
        "B's operation ran (looked at the volume itself), it did not join A's: {b_log:#?}"
    );
    assert_eq!(requests_of(&app, id_of(&a)).len(), 1, "A's one request");
    assert_eq!(app.sim.attach_effects(v), 1);
    // A replays its key: its own operation.
    let again = c
        .attach_volume(bearer(attach("shared", s, v), "token-a"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.id, a.id);
    // B reuses the key with other parameters: refused, naming B's own.
    let e = c
        .attach_volume(bearer(attach("shared", s, Uuid::new_v4()), "token-b"))
        .await
        .unwrap_err();
    let (why, meta) = error_info(&e);
    assert_eq!(why, "IDEMPOTENCY_KEY_REUSED");
    assert_eq!(meta["operation_id"], b.id);
    let told = format!("{e:?}");
    assert!(
        !told.contains(&a.id),
        "A's operation is never revealed to B: {told}"
    );
    // Reads by key are the caller's own.
    let mine = c
        .get_operation(bearer(get_by_key("shared", ""), "token-b"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(mine.id, b.id);
    let e = c
        .get_operation(bearer(get_by_key("shared", "ci-a"), "token-b"))
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), error_info(&e).1["field"].as_str()),
        (Code::InvalidArgument, "caller")
    );
    assert!(!format!("{e:?}").contains(&a.id));
    // An operator names whose.
    for (caller, id) in [("ci-a", &a.id), ("ci-b", &b.id)] {
        let op = c
            .get_operation(bearer(get_by_key("shared", caller), "token-ops"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(&op.id, id);
    }
    // The ledger: two rows, each its caller's.
    for (id, caller) in [(&a.id, "ci-a"), (&b.id, "ci-b")] {
        let op = row(&app, id.parse().unwrap()).await;
        assert_eq!(
            (op.idempotency_key.as_str(), op.caller.as_deref()),
            ("shared", Some(caller))
        );
    }
    app.stop().await;
}
on_both_ledgers!(two_callers_with_one_key_get_two_operations_and_never_see_each_other);

/// A gRPC channel to `app` over mutual TLS with a client certificate.
async fn mtls_channel(
    app: &TestApp,
    pki: &support::pki::Pki,
    client: &(String, String),
) -> tonic::transport::Channel {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(support::pki::Pki::read(
            &pki.server_ca,
        )))
        .domain_name("localhost")
        .identity(Identity::from_pem(&client.0, &client.1));
    Endpoint::from_shared(app.grpc_url.replace("http://", "https://"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .expect("a client with a certificate of the client CA connects")
}

/// Callers authenticated by mutual TLS alone are named by their
/// certificate's subject CN and a hash of its issuer and subject
/// (`CN#…`): each one's operations record it, and the same key is two
/// operations for two certificates.
async fn callers_by_certificate_are_named_by_its_common_name(ledger: Ledger) {
    use pb::volume_reconciler_client::VolumeReconcilerClient;
    let pki = support::pki::Pki::new();
    let app = spawn_app(pki.server_flags(with_history(ledger))).await;
    let (cert_a, cert_b) = (
        pki.clients.client("orchestrator-a"),
        pki.clients.client("orchestrator-b"),
    );
    let mut a = VolumeReconcilerClient::new(mtls_channel(&app, &pki, &cert_a).await);
    let mut b = VolumeReconcilerClient::new(mtls_channel(&app, &pki, &cert_b).await);
    let s = Uuid::new_v4();
    let (va, vb) = ids();
    let t = secs(10.0);
    // The same key, other parameters: were keys global, B would be refused.
    let op_a = a
        .attach_volume(with_timeout(attach("k", s, va), t))
        .await
        .unwrap()
        .into_inner();
    let op_b = b
        .attach_volume(with_timeout(attach("k", s, vb), t))
        .await
        .unwrap()
        .into_inner();
    assert_ne!(op_a.id, op_b.id);
    for (op, cn) in [(&op_a, "orchestrator-a"), (&op_b, "orchestrator-b")] {
        assert!(op.caller.starts_with(&format!("{cn}#")), "{}", op.caller);
        let row = row(&app, op.id.parse().unwrap()).await;
        assert_eq!(
            row.caller.as_deref(),
            Some(op.caller.as_str()),
            "the ledger names the certificate"
        );
    }
    let again = a
        .attach_volume(with_timeout(attach("k", s, va), t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        again.id, op_a.id,
        "a replay joins its own caller's operation"
    );
    let mine = b
        .get_operation(with_timeout(get_by_key("k", ""), t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(mine.id, op_b.id);
    let e = b
        .get_operation(with_timeout(get_by_key("k", &op_a.caller), t))
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        Code::InvalidArgument,
        "not another caller's key: {e:?}"
    );
    assert!(app.sim.is_attached(s, va) && app.sim.is_attached(s, vb));
    app.stop().await;
}
on_both_ledgers!(callers_by_certificate_are_named_by_its_common_name);

/// With tokens configured, a caller over mutual TLS is named by its token,
/// not its certificate; a certificate alone is not enough.
#[tokio::test]
async fn over_mutual_tls_a_token_names_the_caller() {
    use pb::volume_reconciler_client::VolumeReconcilerClient;
    use volume_reconciler::grpc::auth::sha256_hex;
    let pki = support::pki::Pki::new();
    let tokens = format!("ci:orchestrator:{}", sha256_hex("token-ci"));
    let app = spawn_app(
        pki.server_flags(with_history(Ledger::Postgres))
            .arg("--auth-tokens", &tokens),
    )
    .await;
    let cert = pki.clients.client("orchestrator-a");
    let mut c = VolumeReconcilerClient::new(mtls_channel(&app, &pki, &cert).await);
    let (s, v) = ids();
    let op = c
        .attach_volume(bearer(attach("k", s, v), "token-ci"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(op.caller, "ci", "the token wins over the certificate");
    assert_eq!(row(&app, id_of(&op)).await.caller.as_deref(), Some("ci"));
    let e = c
        .attach_volume(with_timeout(attach("k2", s, Uuid::new_v4()), secs(10.0)))
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        Code::Unauthenticated,
        "tokens are required: {e:?}"
    );
    app.stop().await;
}

// ---------------------------------------------------------------------
// 9. Bounded memory per waiting operation.
// ---------------------------------------------------------------------

/// A detach watched for seconds (a slow, libvirt-style detach) looks a
/// dozen times; identical looks are coalesced into one line of the log
/// that counts them, not one event per look.
#[tokio::test]
async fn a_long_watched_detach_logs_one_line_per_change_not_one_per_look() {
    let app = spawn_app(AppOptions {
        sim: SimConfig {
            record_history: true,
            detach_delay_ms: 8000,
            ..SimConfig::default()
        },
        ..AppOptions::default()
    })
    .await;
    let (s, v) = ids();
    app.sim.seed_attachment(s, v);
    let lists = app.sim.list_requests();
    let op = app
        .raw()
        .detach_volume(with_timeout(detach("slow", s, v), secs(30.0)))
        .await
        .expect("the detach succeeds once the guest lets go")
        .into_inner();
    assert_eq!(op.state, pb::State::Succeeded as i32);
    let looks = app.sim.list_requests() - lists;
    assert!(looks >= 8, "watched for 8 s: {looks} looks");
    let events = log(&app, id_of(&op)).await;
    let observed: Vec<&OperationEvent> = events.iter().filter(|e| e.kind == "observed").collect();
    // One line per change of what Nova's list shows (attached, then
    // gone), plus Cinder's look before sending and its confirmation.
    assert!(observed.len() <= 5, "one line per change: {events:#?}");
    let counted: u64 = observed
        .iter()
        .filter(|e| e.metadata.get("service").map(String::as_str) != Some("cinder"))
        .map(|e| e.metadata.get("times").map_or(1, |t| t.parse().unwrap()))
        .sum();
    assert!(
        counted + 1 >= looks as u64,
        "every look is counted ({counted} of {looks})"
    );
    assert!(events.len() <= 10, "the whole log stays short: {events:#?}");
    assert!(!app.sim.is_attached(s, v));
    app.stop().await;
}

/// Looks that fail the same way are one line too: a detach watched while
/// Nova's list answers 503 a dozen times in a row counts them on one
/// line (held in memory until the decision, and written with it), not
/// one event per failed look; every failure is counted.
#[tokio::test]
async fn failed_looks_in_a_row_are_one_line_that_counts_them() {
    let app = spawn_app(AppOptions {
        sim: SimConfig {
            record_history: true,
            detach_delay_ms: 4000,
            ..SimConfig::default()
        },
        ..AppOptions::default()
    })
    .await;
    let (s, v) = ids();
    app.sim.seed_attachment(s, v);
    const FAILED: u32 = 12;
    app.sim.add_fault(
        FaultRule::new(
            FaultOp::List,
            Fault::Status {
                code: 503,
                effect: false,
            },
        )
        .server(s)
        .times(FAILED),
    );
    let op = app
        .raw()
        .detach_volume(with_timeout(detach("outage", s, v), secs(60.0)))
        .await
        .expect("the detach succeeds once Nova's list answers again")
        .into_inner();
    assert_eq!(op.state, pb::State::Succeeded as i32, "{op:?}");
    let events = log(&app, id_of(&op)).await;
    let failed: Vec<&OperationEvent> = events
        .iter()
        .filter(|e| e.kind == "observed" && e.detail.starts_with("observation failed"))
        .collect();
    assert_eq!(
        failed.len(),
        1,
        "one line for the failures in a row: {events:#?}"
    );
    let counted: u64 = failed[0]
        .metadata
        .get("times")
        .map_or(1, |t| t.parse().unwrap());
    assert_eq!(
        counted,
        u64::from(FAILED),
        "every failed look counted: {events:#?}"
    );
    assert_eq!(
        failed[0].metadata.get("reason").map(String::as_str),
        Some("NOVA_SERVER_ERROR"),
        "{events:#?}"
    );
    assert!(events.len() <= 10, "the whole log stays short: {events:#?}");
    assert!(!app.sim.is_attached(s, v));
    app.stop().await;
}

// ---------------------------------------------------------------------
// 11. Nova's answers by what they mean.
// ---------------------------------------------------------------------

/// 409 "The supplied device path is in use" is permanent: FAILED after
/// one request, not retried for the whole deadline.
#[tokio::test]
async fn a_device_path_in_use_fails_after_one_request() {
    let app = spawn_app(with_history(Ledger::Postgres)).await;
    let (s, v) = ids();
    app.sim.add_fault(
        FaultRule::new(FaultOp::Attach, Fault::DeviceInUse)
            .volume(v)
            .always(),
    );
    let mut req = attach("dev", s, v);
    req.device = "/dev/vdb".into();
    let started = Instant::now();
    let e = app
        .raw()
        .attach_volume(with_timeout(req, secs(20.0)))
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), error_info(&e).0.as_str()),
        (Code::FailedPrecondition, "NOVA_DEVICE_IN_USE")
    );
    assert!(
        started.elapsed() < secs(10.0),
        "not retried until the deadline"
    );
    let op = recorded(&app, "dev").await;
    assert_eq!(
        (op.state, op.resolution, reason(&op), op.attempts),
        (
            State::Failed,
            Some(Resolution::Response),
            Some(Reason::NovaDeviceInUse),
            1
        )
    );
    assert_eq!(app.sim.attach_requests(v), 1);
    assert!(!app.sim.is_attached(s, v));
    app.stop().await;
}

/// A volume just created by the caller (the create-then-attach race),
/// on a service that confirms with `confirm_with`.
async fn attach_a_volume_still_creating(
    confirm_with: &str,
) -> (TestApp, Uuid, Uuid, pb::Operation) {
    let app = spawn_app(
        AppOptions {
            sim: SimConfig {
                record_history: true,
                cinder_create_ms: 2000,
                ..SimConfig::default()
            },
            ..AppOptions::default()
        }
        .arg("--confirm-with", confirm_with),
    )
    .await;
    let s = Uuid::new_v4();
    let v = app
        .sim
        .create_volume(volume_reconciler::sim::VolumeSpec {
            name: Some("fresh".into()),
            description: None,
            size: 1,
            multiattach: false,
            from_image: false,
        })
        .id;
    let op = app
        .raw()
        .attach_volume(with_timeout(attach("fresh", s, v), secs(20.0)))
        .await
        .expect("attached once the volume is available")
        .into_inner();
    assert_eq!(op.state, pb::State::Succeeded as i32);
    assert_eq!(app.sim.attach_effects(v), 1);
    assert!(app.sim.is_attached(s, v));
    (app, s, v, op)
}

/// Nova's 400 "... the current status is creating" (no Cinder to ask
/// first) is the create-then-attach race: retried until the volume is
/// ready, within the deadline.
#[tokio::test]
async fn an_attach_refused_while_its_volume_is_creating_is_retried_until_it_is_ready() {
    let (app, _, v, op) = attach_a_volume_still_creating("nova-list").await;
    let events = log(&app, id_of(&op)).await;
    assert!(
        events.iter().any(|e| e.kind == "request_failed"
            && e.metadata.get("reason").map(String::as_str) == Some("NOVA_VOLUME_NOT_READY")),
        "refused while creating first: {events:#?}"
    );
    assert!(app.sim.attach_requests(v) >= 2);
    app.stop().await;
}

/// Confirming with Cinder, a volume still being created is waited for
/// before the first request (as cinder-csi does): one request, once it is
/// ready.
#[tokio::test]
async fn an_attach_to_a_volume_still_creating_waits_for_it_and_sends_once() {
    let (app, _, v, op) = attach_a_volume_still_creating("cinder").await;
    assert_eq!(
        requests_of(&app, id_of(&op)).len(),
        1,
        "sent once, when ready"
    );
    assert_eq!(app.sim.attach_requests(v), 1);
    app.stop().await;
}

/// A detach right after an attach that Nova answered while the hypervisor
/// still attaches: Nova refuses it (400 "Volume status must be 'in-use'");
/// it is retried until the volume is in use and then detached, not watched
/// until the deadline. (Without Cinder: confirming with it, the attach is
/// decided only once the volume is in use, and the race cannot happen.)
#[tokio::test]
async fn a_detach_refused_while_the_attach_finishes_is_retried_not_watched() {
    let app = spawn_app(
        AppOptions {
            sim: SimConfig {
                record_history: true,
                attach_complete_ms: 2000,
                ..SimConfig::default()
            },
            ..AppOptions::default()
        }
        .arg("--confirm-with", "nova-list"),
    )
    .await;
    let (s, v) = ids();
    let mut c = app.raw();
    let attached = c
        .attach_volume(with_timeout(attach("a", s, v), secs(20.0)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(attached.state, pb::State::Succeeded as i32);
    let started = Instant::now();
    let detached = c
        .detach_volume(with_timeout(detach("d", s, v), secs(30.0)))
        .await
        .expect("detached")
        .into_inner();
    assert_eq!(detached.state, pb::State::Succeeded as i32);
    assert!(
        started.elapsed() < secs(15.0),
        "decided soon after the attach finished, not at the 30 s deadline: {:?}",
        started.elapsed()
    );
    assert!(!app.sim.is_attached(s, v));
    assert!(
        app.sim.detach_requests(v) >= 2,
        "refused while attaching, then sent again"
    );
    app.stop().await;
}

/// Replaying a key whose operation is UNKNOWN, with time left, waits for
/// its decision (the reconciler's, here) instead of answering
/// DEADLINE_EXCEEDED at once; and nothing more is sent to Nova.
#[tokio::test]
async fn replaying_an_unknown_key_waits_for_the_decision() {
    let app = spawn_app(
        with_history(Ledger::Postgres)
            .arg("--with-reconciler", "")
            .arg("--reconcile-interval", "100ms")
            .arg("--reconcile-max-backoff", "1s"),
    )
    .await;
    let (s, v) = ids();
    app.sim
        .add_fault(FaultRule::new(FaultOp::Attach, Fault::LateEffect { ms: 8000 }).volume(v));
    let mut c = app.raw();
    // 4 s: the unknown decision is written in the reserve's last quarter
    // (200 ms here), on a loaded CI machine.
    let e = c
        .attach_volume(with_timeout(attach("k", s, v), secs(4.0)))
        .await
        .unwrap_err();
    assert_eq!(error_info(&e).0, "OUTCOME_UNKNOWN");
    let id = recorded(&app, "k").await.id;
    assert_eq!(row(&app, id).await.state, State::Unknown);
    assert!(!app.sim.is_attached(s, v), "not decided yet when replayed");
    let op = c
        .attach_volume(with_timeout(attach("k", s, v), secs(25.0)))
        .await
        .expect("the replay waits for the decision")
        .into_inner();
    assert_eq!(
        (op.id, op.state, op.resolution),
        (
            id.to_string(),
            pb::State::Succeeded as i32,
            pb::Resolution::Reconciler as i32
        )
    );
    assert_eq!(app.sim.attach_requests(v), 1, "the replay sent nothing");
    app.stop().await;
}

/// Replaying a key whose operation is decided answers the decision even
/// with a deadline too short to call Nova (a new key gets
/// BUDGET_TOO_SMALL).
#[tokio::test]
async fn replaying_a_decided_key_answers_it_whatever_the_deadline() {
    let app = spawn_app(with_history(Ledger::Postgres).arg("--min-budget", "2s")).await;
    let (s, v) = ids();
    let mut c = app.raw();
    let op = c
        .attach_volume(with_timeout(attach("k", s, v), secs(10.0)))
        .await
        .unwrap()
        .into_inner();
    // 1 s: after the answer margin and the reserve, 750 ms for Nova, under
    // the 2 s minimum (and time enough to read the ledger for a replay on
    // a loaded machine).
    let tiny = secs(1.0);
    let fresh = c
        .attach_volume(with_timeout(attach("new", s, Uuid::new_v4()), tiny))
        .await
        .unwrap_err();
    assert_eq!(error_info(&fresh).0, "BUDGET_TOO_SMALL", "{fresh:?}");
    let replay = c
        .attach_volume(with_timeout(attach("k", s, v), tiny))
        .await
        .expect("the decision, whatever the deadline")
        .into_inner();
    assert_eq!(
        (replay.id, replay.state),
        (op.id, pb::State::Succeeded as i32)
    );
    assert_eq!(app.sim.attach_requests(v), 1);
    app.stop().await;
}
