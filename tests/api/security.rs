//! Security and overload: only authorized callers, secrets never leak,
//! floods are shed, sizes are limited — through the real server chain.

use crate::support;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use support::{AppOptions, error_info, spawn_app, with_timeout};
use tokio::time::Instant;
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use uuid::Uuid;
use volume_reconciler::grpc::auth::sha256_hex;
use volume_reconciler::grpc::pb;
use volume_reconciler::grpc::pb::volume_reconciler_client::VolumeReconcilerClient;

const BIN: &str = env!("CARGO_BIN_EXE_volume-reconciler");

struct Pki {
    dir: std::path::PathBuf,
}

fn ca(name: &str) -> (rcgen::Certificate, rcgen::KeyPair) {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    p.distinguished_name.push(rcgen::DnType::CommonName, name);
    (p.self_signed(&key).unwrap(), key)
}

fn leaf(names: &[&str], issuer: &(rcgen::Certificate, rcgen::KeyPair)) -> (String, String) {
    let key = rcgen::KeyPair::generate().unwrap();
    let p = rcgen::CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .unwrap();
    let cert = p.signed_by(&key, &issuer.0, &issuer.1).unwrap();
    (cert.pem(), key.serialize_pem())
}

impl Pki {
    fn new() -> Self {
        let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("vr-pki-{}", Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        Self { dir }
    }
    fn write(&self, name: &str, pem: &str) -> String {
        let p = self.dir.join(name);
        std::fs::write(&p, pem).unwrap();
        p.to_string_lossy().to_string()
    }
}

async fn tls_channel(
    addr: &str,
    server_ca: &str,
    client: Option<(&str, &str)>,
) -> Result<Channel, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(server_ca))
        .domain_name("localhost");
    if let Some((cert, key)) = client {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    Endpoint::from_shared(format!("https://{addr}"))?
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
}

async fn works(channel: Channel) -> Result<(), tonic::Status> {
    let mut c = VolumeReconcilerClient::new(channel);
    c.list_operations(with_timeout(
        pb::ListOperationsRequest::default(),
        Duration::from_secs(5),
    ))
    .await
    .map(drop)
}

#[tokio::test]
async fn mutual_tls_refuses_foreign_clients_and_reloads_certificates_without_dropping_connections()
{
    let pki = Pki::new();
    let server_ca = ca("server CA");
    let client_ca = ca("client CA");
    let rogue_ca = ca("rogue CA");
    let (srv_cert, srv_key) = leaf(&["localhost"], &server_ca);
    let cert_path = pki.write("server.pem", &srv_cert);
    let key_path = pki.write("server.key", &srv_key);
    let ca_path = pki.write("clients.pem", &client_ca.0.pem());
    let app = spawn_app(
        AppOptions::default()
            .arg("--tls-cert", &cert_path)
            .arg("--tls-key", &key_path)
            .arg("--tls-client-ca", &ca_path),
    )
    .await;
    let addr = app.grpc_url.trim_start_matches("http://").to_string();
    let server_ca_pem = server_ca.0.pem();
    let (good_cert, good_key) = leaf(&["orchestrator-1"], &client_ca);
    let (bad_cert, bad_key) = leaf(&["intruder"], &rogue_ca);

    let good = tls_channel(&addr, &server_ca_pem, Some((&good_cert, &good_key)))
        .await
        .expect("a client with a certificate from the CA connects");
    works(good.clone()).await.expect("and is served");
    let no_cert = match tls_channel(&addr, &server_ca_pem, None).await {
        Ok(ch) => works(ch).await.is_err(),
        Err(_) => true,
    };
    assert!(
        no_cert,
        "a client without a certificate is refused at the handshake"
    );
    let rogue = match tls_channel(&addr, &server_ca_pem, Some((&bad_cert, &bad_key))).await {
        Ok(ch) => works(ch).await.is_err(),
        Err(_) => true,
    };
    assert!(
        rogue,
        "a client with a certificate from another CA is refused"
    );
    let plain = Endpoint::from_shared(app.grpc_url.clone())
        .unwrap()
        .connect()
        .await;
    let plain_refused = match plain {
        Ok(ch) => works(ch).await.is_err(),
        Err(_) => true,
    };
    assert!(plain_refused, "plaintext is refused on a TLS port");

    // Rotate the server certificate to one from a new CA; the files change.
    let new_ca = ca("server CA 2");
    let (new_cert, new_key) = leaf(&["localhost"], &new_ca);
    let tls = app_tls(&app);
    let before = tls.reloads();
    std::fs::write(&key_path, &new_key).unwrap();
    std::fs::write(&cert_path, &new_cert).unwrap();
    support::eventually(
        Duration::from_secs(15),
        "the certificate is reloaded",
        || {
            let tls = tls.clone();
            async move { tls.reloads() > before }
        },
    )
    .await;
    works(good)
        .await
        .expect("the connection made before the reload keeps working");
    let fresh = tls_channel(&addr, &new_ca.0.pem(), Some((&good_cert, &good_key)))
        .await
        .expect("new handshakes use the new certificate");
    works(fresh).await.unwrap();
    let stale = match tls_channel(&addr, &server_ca_pem, Some((&good_cert, &good_key))).await {
        Ok(ch) => works(ch).await.is_err(),
        Err(_) => true,
    };
    assert!(stale, "the old certificate is no longer presented");
    app.stop().await;
}

fn app_tls(app: &support::TestApp) -> std::sync::Arc<volume_reconciler::tls::Reloadable> {
    app.tls.clone().expect("TLS is on")
}

fn bearer<T>(msg: T, token: Option<&str>) -> tonic::Request<T> {
    let mut r = with_timeout(msg, Duration::from_secs(10));
    if let Some(t) = token {
        r.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    r
}

fn tokens_flag() -> String {
    format!(
        "ci:orchestrator:{},alice:operator:{}",
        sha256_hex("orch-token-1"),
        sha256_hex("oper-token-1")
    )
}

#[tokio::test]
async fn every_role_can_do_exactly_what_it_may() {
    let app = spawn_app(AppOptions::default().arg("--auth-tokens", &tokens_flag())).await;
    let mut c = app.raw();
    let id = {
        let op = c
            .attach_volume(bearer(
                pb::AttachVolumeRequest {
                    idempotency_key: "seed".into(),
                    server_id: Uuid::new_v4().to_string(),
                    volume_id: Uuid::new_v4().to_string(),
                    ..Default::default()
                },
                Some("orch-token-1"),
            ))
            .await
            .unwrap()
            .into_inner();
        op.id
    };
    let row = app
        .store
        .operation_get(id.parse().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        row.caller.as_deref(),
        Some("ci"),
        "the caller is recorded on the operation"
    );
    let recorded = app
        .store
        .operation_events(row.id)
        .await
        .unwrap()
        .into_iter()
        .find(|e| e.kind == "recorded")
        .unwrap();
    assert_eq!(
        recorded.metadata["caller"], "ci",
        "and in the reconcile log"
    );

    #[derive(Debug, Clone, Copy)]
    enum Rpc {
        Attach,
        Detach,
        Get,
        List,
        Events,
        Watch,
        Reconcile,
        Resolve,
    }
    let all = [
        Rpc::Attach,
        Rpc::Detach,
        Rpc::Get,
        Rpc::List,
        Rpc::Events,
        Rpc::Watch,
        Rpc::Reconcile,
        Rpc::Resolve,
    ];
    let mut table = Vec::new();
    for rpc in all {
        for (who, token) in [
            ("none", None),
            ("bogus", Some("not-a-token")),
            ("orchestrator", Some("orch-token-1")),
            ("operator", Some("oper-token-1")),
        ] {
            let t = token;
            let code = match rpc {
                Rpc::Attach => c
                    .attach_volume(bearer(
                        pb::AttachVolumeRequest {
                            idempotency_key: format!("a-{who}"),
                            server_id: Uuid::new_v4().to_string(),
                            volume_id: Uuid::new_v4().to_string(),
                            ..Default::default()
                        },
                        t,
                    ))
                    .await
                    .map(drop),
                Rpc::Detach => c
                    .detach_volume(bearer(
                        pb::DetachVolumeRequest {
                            labels: Default::default(),
                            idempotency_key: format!("d-{who}"),
                            server_id: Uuid::new_v4().to_string(),
                            volume_id: Uuid::new_v4().to_string(),
                        },
                        t,
                    ))
                    .await
                    .map(drop),
                Rpc::Get => c
                    .get_operation(bearer(
                        pb::GetOperationRequest {
                            operation_id: id.clone(),
                            ..Default::default()
                        },
                        t,
                    ))
                    .await
                    .map(drop),
                Rpc::List => c
                    .list_operations(bearer(pb::ListOperationsRequest::default(), t))
                    .await
                    .map(drop),
                Rpc::Events => c
                    .list_operation_events(bearer(
                        pb::ListOperationEventsRequest {
                            operation_id: id.clone(),
                        },
                        t,
                    ))
                    .await
                    .map(drop),
                Rpc::Watch => c
                    .watch_operation(bearer(
                        pb::WatchOperationRequest {
                            operation_id: id.clone(),
                        },
                        t,
                    ))
                    .await
                    .map(drop),
                Rpc::Reconcile => c
                    .reconcile_operation(bearer(
                        pb::ReconcileOperationRequest {
                            operation_id: id.clone(),
                        },
                        t,
                    ))
                    .await
                    .map(drop),
                Rpc::Resolve => c
                    .resolve_operation(bearer(
                        pb::ResolveOperationRequest {
                            operation_id: id.clone(),
                            state: pb::State::Failed as i32,
                            reason: "audit".into(),
                        },
                        t,
                    ))
                    .await
                    .map(drop),
            }
            .map(|_| Code::Ok)
            .unwrap_or_else(|s| s.code());
            table.push((rpc, who, code));
        }
    }
    for (rpc, who, code) in &table {
        let expected = match (*rpc, *who) {
            (_, "none") | (_, "bogus") => Code::Unauthenticated,
            (Rpc::Reconcile | Rpc::Resolve, "orchestrator") => Code::PermissionDenied,
            // The operator resolving an already-decided operation: allowed in, refused by the ledger.
            (Rpc::Resolve, "operator") => Code::FailedPrecondition,
            _ => Code::Ok,
        };
        assert_eq!(*code, expected, "{rpc:?} as {who}: {table:?}");
    }
    // Health stays open for probes.
    let channel = Endpoint::from_shared(app.grpc_url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let st = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await;
    assert!(st.is_ok());
    app.stop().await;
}

#[tokio::test]
async fn a_flooding_caller_is_shed_while_a_well_behaved_one_is_unharmed() {
    let app = spawn_app(
        AppOptions::default()
            .arg("--auth-tokens", &tokens_flag())
            .arg("--caller-rate-limit", "100")
            .arg("--caller-burst", "20"),
    )
    .await;
    let attach = |key: String| pb::AttachVolumeRequest {
        idempotency_key: key,
        server_id: Uuid::new_v4().to_string(),
        volume_id: Uuid::new_v4().to_string(),
        ..Default::default()
    };
    // The well-behaved caller: 20 calls per second, sequentially.
    let steady = |app_client: VolumeReconcilerClient<Channel>, label: &'static str, secs: f64| async move {
        let mut c = app_client;
        let mut lat = Vec::new();
        let mut errors = 0;
        let end = Instant::now() + Duration::from_secs_f64(secs);
        let mut i = 0;
        while Instant::now() < end {
            let t = Instant::now();
            match c
                .attach_volume(bearer(attach(format!("{label}-{i}")), Some("oper-token-1")))
                .await
            {
                Ok(_) => lat.push(t.elapsed()),
                Err(_) => errors += 1,
            }
            i += 1;
            tokio::time::sleep_until(t + Duration::from_millis(50)).await; // pacing: the caller's own rate
        }
        lat.sort();
        let p = |q: f64| lat[((lat.len() - 1) as f64 * q) as usize];
        (lat.len(), errors, p(0.5), p(0.99))
    };
    let baseline = steady(app.raw(), "calm", 1.5).await;
    // The flood: 32 loops as fast as they can, about 10× what the caller may.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut flood = Vec::new();
    for w in 0..32 {
        let (mut c, stop) = (app.raw(), stop.clone());
        flood.push(tokio::spawn(async move {
            let (mut ok, mut shed, mut retry_info) = (0u64, 0u64, 0u64);
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match c
                    .attach_volume(bearer(
                        attach(format!("flood-{w}-{i}")),
                        Some("orch-token-1"),
                    ))
                    .await
                {
                    Ok(_) => ok += 1,
                    Err(s) => {
                        assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
                        shed += 1;
                        use tonic_types::StatusExt;
                        if s.get_error_details().retry_info().is_some() {
                            retry_info += 1;
                        }
                    }
                }
                i += 1;
            }
            (ok, shed, retry_info)
        }));
    }
    let flood_started = Instant::now();
    let under_flood = steady(app.raw(), "during", 3.0).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    // How long the flood ran: the steady caller's last call may end late
    // on a loaded machine, and the rate bound below is per second.
    let flooded = flood_started.elapsed().as_secs_f64();
    let (mut ok, mut shed, mut with_retry) = (0, 0, 0);
    for f in flood {
        let (o, s, r) = f.await.unwrap();
        ok += o;
        shed += s;
        with_retry += r;
    }
    eprintln!(
        "flood figures: flooding caller {ok} ok, {shed} shed (RESOURCE_EXHAUSTED, {with_retry} with RetryInfo); \
         well-behaved caller alone: {} calls, {} errors, p50 {:?}, p99 {:?}; under the flood: {} calls, {} errors, p50 {:?}, p99 {:?}",
        baseline.0,
        baseline.1,
        baseline.2,
        baseline.3,
        under_flood.0,
        under_flood.1,
        under_flood.2,
        under_flood.3
    );
    // What the flood offers depends on the machine (32 loops share the
    // test's cores with the service and, in this binary, other tests): its
    // calls past the rate are shed, whatever their number; where it offered
    // more than twice its allowance, most of it is shed.
    let allowance = 100.0 * (flooded + 0.5) + 20.0;
    assert!(shed > 0, "the flood went past its rate and was shed");
    if (ok + shed) as f64 > 2.0 * allowance + 50.0 {
        assert!(shed > ok, "most of the flood is shed");
    }
    assert_eq!(with_retry, shed, "every shed answer suggests a delay");
    assert!(
        (ok as f64) <= allowance + 50.0,
        "the flooding caller stays near its rate: {ok} in {flooded:.1} s"
    );
    assert_eq!(under_flood.1, 0, "the well-behaved caller sees no errors");
    assert!(
        under_flood.3 < Duration::from_secs(3).max(baseline.3 * 10),
        "its latency stays in range"
    );
    app.stop().await;
}

#[tokio::test]
async fn oversized_messages_and_metadata_are_refused_without_the_service_growing() {
    let app = spawn_app(AppOptions::default()).await;
    let mut c = app.raw();
    let rss = || -> u64 {
        std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .find(|l| l.starts_with("VmRSS"))
            .unwrap()
            .split_whitespace()
            .nth(1)
            .unwrap()
            .parse()
            .unwrap()
    };
    let big = pb::AttachVolumeRequest {
        idempotency_key: "big".into(),
        server_id: Uuid::new_v4().to_string(),
        volume_id: Uuid::new_v4().to_string(),
        tag: "t".repeat(1 << 20),
        ..Default::default()
    };
    let err = c
        .attach_volume(with_timeout(big.clone(), Duration::from_secs(10)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    let (reason, meta) = error_info(&err);
    assert_eq!(
        (reason.as_str(), meta["limit_bytes"].as_str()),
        ("MESSAGE_TOO_LARGE", "65536")
    );
    let before = rss();
    for _ in 0..100 {
        c.attach_volume(with_timeout(big.clone(), Duration::from_secs(10)))
            .await
            .unwrap_err();
    }
    let grown_kib = rss().saturating_sub(before);
    assert!(
        grown_kib < 40 * 1024,
        "memory grew by {grown_kib} KiB over 100 refused 1 MiB messages"
    );
    // Metadata over the limit is refused by HTTP/2 before any handler runs.
    let mut r = with_timeout(
        pb::ListOperationsRequest::default(),
        Duration::from_secs(10),
    );
    r.metadata_mut()
        .insert("x-padding", "p".repeat(64 * 1024).parse().unwrap());
    assert!(
        c.list_operations(r).await.is_err(),
        "64 KiB of metadata is refused"
    );
    // Strings over their field limits name the limit.
    let err = c
        .attach_volume(with_timeout(
            pb::AttachVolumeRequest {
                idempotency_key: "k".repeat(300),
                server_id: Uuid::new_v4().to_string(),
                volume_id: Uuid::new_v4().to_string(),
                ..Default::default()
            },
            Duration::from_secs(5),
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("255"), "{}", err.message());
    // And the service still serves.
    let mut c = VolumeReconcilerClient::new(
        Endpoint::from_shared(app.grpc_url.clone())
            .unwrap()
            .connect()
            .await
            .unwrap(),
    );
    c.list_operations(pb::ListOperationsRequest::default())
        .await
        .unwrap();
    app.stop().await;
}

#[tokio::test]
async fn secrets_never_appear_in_logs_metrics_errors_or_config_show() {
    support::init_logs();
    let os_password = "os-pass-Zq81xK";
    let db_password = "db-pass-Wm44tR";
    let bearer_token = "bearer-Hj20pL";
    let sim = volume_reconciler::sim::start(
        "127.0.0.1:0".parse().unwrap(),
        volume_reconciler::sim::SimConfig {
            require_auth: true,
            password: os_password.into(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let db = support::pg::fresh_database().await.replacen(
        "postgres@",
        &format!("postgres:{db_password}@"),
        1,
    );
    let free = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
    };
    let (grpc, admin) = (free(), free());
    let log = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("vr-secrets-{}.log", Uuid::new_v4().simple()));
    let envs: Vec<(&str, String)> = vec![
        ("DATABASE_URL", db.clone()),
        ("OS_AUTH_URL", sim.auth_url.clone()),
        ("OS_USERNAME", "demo".into()),
        ("OS_PASSWORD", os_password.into()),
        ("OS_PROJECT_NAME", "demo".into()),
        ("OS_REGION_NAME", "RegionOne".into()),
        (
            "VOLUME_RECONCILER_AUTH_TOKENS",
            format!("ci:operator:{}", sha256_hex(bearer_token)),
        ),
        ("VOLUME_RECONCILER_LOG", "trace".into()),
        ("VOLUME_RECONCILER_LOG_FORMAT", "json".into()),
    ];
    let mut child = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            &grpc.to_string(),
            "--admin-listen",
            &admin.to_string(),
            "--replica-id",
            "secret-scan",
            "--shutdown-delay",
            "0s",
        ])
        .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::OpenOptions::new().append(true).open(&log).unwrap())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let ready = format!("http://{admin}/readyz");
    support::eventually(Duration::from_secs(30), "the service is ready", || {
        let ready = ready.clone();
        async move { matches!(reqwest::get(&ready).await, Ok(r) if r.status() == 200) }
    })
    .await;
    let mut c = VolumeReconcilerClient::new(
        Endpoint::from_shared(format!("http://{grpc}"))
            .unwrap()
            .connect()
            .await
            .unwrap(),
    );
    let mut outputs = Vec::new();
    let attach = |k: &str| pb::AttachVolumeRequest {
        idempotency_key: k.into(),
        server_id: Uuid::new_v4().to_string(),
        volume_id: Uuid::new_v4().to_string(),
        ..Default::default()
    };
    // A scripted session: Keystone auth, a success, an expired token (401,
    // renewal, replay), a 500, a bad bearer token, bad input.
    let op = c
        .attach_volume(bearer(attach("s-1"), Some(bearer_token)))
        .await
        .unwrap()
        .into_inner();
    outputs.push(format!("{op:?}"));
    sim.sim.expire_tokens();
    outputs.push(format!(
        "{:?}",
        c.attach_volume(bearer(attach("s-2"), Some(bearer_token)))
            .await
    ));
    sim.sim.add_fault(
        volume_reconciler::sim::FaultRule::new(
            volume_reconciler::sim::FaultOp::Attach,
            volume_reconciler::sim::Fault::Status {
                code: 500,
                effect: false,
            },
        )
        .always(),
    );
    outputs.push(format!(
        "{:?}",
        c.attach_volume(bearer(attach("s-3"), Some(bearer_token)))
            .await
    ));
    outputs.push(format!(
        "{:?}",
        c.attach_volume(bearer(attach("s-4"), Some("wrong-token")))
            .await
    ));
    outputs.push(format!(
        "{:?}",
        c.attach_volume(bearer(
            pb::AttachVolumeRequest::default(),
            Some(bearer_token)
        ))
        .await
    ));
    for id in [&op.id] {
        outputs.push(format!(
            "{:?}",
            c.list_operation_events(bearer(
                pb::ListOperationEventsRequest {
                    operation_id: id.clone()
                },
                Some(bearer_token)
            ))
            .await
        ));
    }
    outputs.push(
        reqwest::get(format!("http://{admin}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
    );
    let show = Command::new(BIN)
        .args(["config", "show"])
        .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap();
    outputs.push(String::from_utf8_lossy(&show.stdout).to_string());
    outputs.push(String::from_utf8_lossy(&show.stderr).to_string());
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    child.wait().unwrap();
    outputs.push(std::fs::read_to_string(&log).unwrap());
    let issued = sim.sim.issued_tokens();
    assert!(
        issued.len() >= 2,
        "Keystone issued tokens (and one was renewed): {issued:?}"
    );
    let log_lines = outputs.last().unwrap().lines().count();
    assert!(
        log_lines > 100,
        "the scan read real trace output ({log_lines} lines)"
    );
    let mut secrets: BTreeMap<String, String> = BTreeMap::new();
    secrets.insert("OS_PASSWORD".into(), os_password.into());
    secrets.insert("database password".into(), db_password.into());
    secrets.insert("bearer token".into(), bearer_token.into());
    for (i, t) in issued.iter().enumerate() {
        secrets.insert(format!("keystone token #{i}"), t.clone());
    }
    for (name, secret) in &secrets {
        for (i, out) in outputs.iter().enumerate() {
            if let Some(pos) = out.find(secret.as_str()) {
                let from = pos.saturating_sub(200);
                panic!(
                    "{name} leaked in output #{i}: ...{}...",
                    &out[from..(pos + secret.len() + 50).min(out.len())]
                );
            }
        }
    }
    sim.stop().await;
}

/// The server's accepted sockets in this process whose local port is `port`
/// and that have a peer: for each, whether TCP_NODELAY is set.
fn accepted_sockets_nodelay(port: u16) -> Vec<bool> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap() {
        let Ok(fd) = entry.unwrap().file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        // SAFETY: plain getsockname/getpeername/getsockopt on an fd of this
        // process with correctly sized out-buffers; a non-socket fails.
        unsafe {
            let mut addr: libc::sockaddr_storage = std::mem::zeroed();
            let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            if libc::getsockname(fd, &mut addr as *mut _ as *mut libc::sockaddr, &mut len) != 0
                || addr.ss_family as i32 != libc::AF_INET
            {
                continue;
            }
            let local = &*(&addr as *const _ as *const libc::sockaddr_in);
            if u16::from_be(local.sin_port) != port {
                continue;
            }
            let mut peer: libc::sockaddr_storage = std::mem::zeroed();
            let mut plen = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            if libc::getpeername(fd, &mut peer as *mut _ as *mut libc::sockaddr, &mut plen) != 0 {
                continue; // the listener itself
            }
            let mut on: libc::c_int = 0;
            let mut olen = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            assert_eq!(
                libc::getsockopt(
                    fd,
                    libc::IPPROTO_TCP,
                    libc::TCP_NODELAY,
                    &mut on as *mut _ as *mut libc::c_void,
                    &mut olen
                ),
                0
            );
            found.push(on != 0);
        }
    }
    found
}

#[tokio::test]
async fn accepted_grpc_connections_have_nagle_off_with_and_without_tls() {
    // Plaintext.
    let app = spawn_app(AppOptions::default()).await;
    let port: u16 = app.grpc_url.rsplit(':').next().unwrap().parse().unwrap();
    let channel = Endpoint::from_shared(app.grpc_url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    works(channel.clone()).await.unwrap();
    let seen = accepted_sockets_nodelay(port);
    assert!(
        !seen.is_empty(),
        "no accepted connection found on port {port}"
    );
    assert!(
        seen.iter().all(|on| *on),
        "plaintext: accepted sockets with Nagle on: {seen:?}"
    );
    drop(channel);
    app.stop().await;

    // TLS.
    let pki = Pki::new();
    let root = ca("nodelay-ca");
    let (cert, key) = leaf(&["localhost"], &root);
    let ca_pem = root.0.pem();
    let app = spawn_app(
        AppOptions::default()
            .arg("--tls-cert", &pki.write("server.pem", &cert))
            .arg("--tls-key", &pki.write("server.key", &key)),
    )
    .await;
    let addr = app.grpc_url.trim_start_matches("http://").to_string();
    let port: u16 = addr.rsplit(':').next().unwrap().parse().unwrap();
    let channel = tls_channel(&addr, &ca_pem, None).await.unwrap();
    works(channel.clone()).await.unwrap();
    let seen = accepted_sockets_nodelay(port);
    assert!(
        !seen.is_empty(),
        "no accepted TLS connection found on port {port}"
    );
    assert!(
        seen.iter().all(|on| *on),
        "TLS: accepted sockets with Nagle on: {seen:?}"
    );
    drop(channel);
    app.stop().await;
}

// ---------------------------------------------------------------------
// Roles of callers named by their client certificate.
// ---------------------------------------------------------------------

/// A client over mutual TLS presenting `client`, a certificate of the
/// test PKI's client CA.
async fn cert_client(
    app: &support::TestApp,
    pki: &support::pki::Pki,
    client: &(String, String),
) -> VolumeReconcilerClient<Channel> {
    let addr = app.grpc_url.trim_start_matches("http://");
    let server_ca = support::pki::Pki::read(&pki.server_ca);
    VolumeReconcilerClient::new(
        tls_channel(addr, &server_ca, Some((&client.0, &client.1)))
            .await
            .expect("a certificate of the client CA connects"),
    )
}

/// An operation of `caller` left recorded and undecided (nothing sent,
/// no lease): one an operator may resolve.
async fn pending_of(app: &support::TestApp, caller: &str) -> Uuid {
    let new = volume_reconciler::store::NewOperation {
        key: support::ck(Some(caller), &format!("pending-{}", Uuid::new_v4())).into(),
        ..support::pending_attach("-", "nobody", Duration::ZERO, Duration::from_secs(60))
    };
    support::record_new(app.store.as_ref(), new).await
}

fn resolve_req(id: Uuid) -> tonic::Request<pb::ResolveOperationRequest> {
    with_timeout(
        pb::ResolveOperationRequest {
            operation_id: id.to_string(),
            state: pb::State::Failed as i32,
            reason: "the hypervisor shows no such disk".into(),
        },
        Duration::from_secs(10),
    )
}

fn get_req(id: &str) -> tonic::Request<pb::GetOperationRequest> {
    with_timeout(
        pb::GetOperationRequest {
            operation_id: id.into(),
            ..Default::default()
        },
        Duration::from_secs(10),
    )
}

fn attach_req(key: &str) -> tonic::Request<pb::AttachVolumeRequest> {
    with_timeout(
        pb::AttachVolumeRequest {
            idempotency_key: key.into(),
            server_id: Uuid::new_v4().to_string(),
            volume_id: Uuid::new_v4().to_string(),
            ..Default::default()
        },
        Duration::from_secs(10),
    )
}

/// `--tls-client-roles` (here a file): a certificate's CN entry gives its
/// role, else its subject's OU (`OU`: a unit named after a role), else it
/// is an orchestrator. Operators resolve and read everyone's operations;
/// orchestrators are refused and read their own.
#[tokio::test]
async fn certificate_callers_get_their_role_from_their_common_name_then_their_unit() {
    let pki = support::pki::Pki::new();
    let roles = pki.dir.join("client-roles");
    std::fs::write(
        &roles,
        "# who may decide for the cloud\nCN=oncall=operator\nCN=demoted=orchestrator\n\n# units named after roles\nOU\n",
    )
    .unwrap();
    let app = spawn_app(
        pki.server_flags(AppOptions::default())
            .arg("--tls-client-roles", &format!("@{}", roles.display())),
    )
    .await;
    let mut owner = cert_client(&app, &pki, &pki.clients.client("orchestrator-a")).await;
    let owned = owner
        .attach_volume(attach_req("k"))
        .await
        .unwrap()
        .into_inner();
    assert!(
        owned.caller.starts_with("orchestrator-a#"),
        "named by its CN and its issuer and subject: {}",
        owned.caller
    );
    let cases = [
        (
            "oncall",
            pki.clients.client("oncall"),
            true,
            "its CN's entry",
        ),
        (
            "sre-1",
            pki.clients.client_in("sre-1", &["sre", "operator"]),
            true,
            "its unit",
        ),
        (
            "demoted",
            pki.clients.client_in("demoted", &["operator"]),
            false,
            "its CN's entry over its unit",
        ),
        (
            "dev-1",
            pki.clients.client_in("dev-1", &["developers"]),
            false,
            "no entry",
        ),
    ];
    for (name, cert, operator, why) in cases {
        let mut c = cert_client(&app, &pki, &cert).await;
        let pending = pending_of(&app, "orchestrator-a").await;
        let resolved = c.resolve_operation(resolve_req(pending)).await;
        let row = app.store.operation_get(pending).await.unwrap().unwrap();
        let seen = c.get_operation(get_req(&owned.id)).await;
        if operator {
            let op = resolved.unwrap_or_else(|e| panic!("{name} is an operator by {why}: {e:?}"));
            assert_eq!(op.into_inner().resolution, pb::Resolution::Operator as i32);
            assert_eq!(row.state, volume_reconciler::domain::State::Failed);
            let audit = app.store.operation_events(pending).await.unwrap();
            assert!(
                audit.iter().any(|e| e
                    .metadata
                    .get("caller")
                    .is_some_and(|c| c.starts_with(&format!("{name}#")))),
                "the decision names its maker: {audit:#?}"
            );
            assert_eq!(seen.unwrap().into_inner().id, owned.id, "{name} reads all");
        } else {
            let e = resolved.unwrap_err();
            assert_eq!(e.code(), Code::PermissionDenied, "{name} by {why}: {e:?}");
            assert!(e.message().contains(name), "{}", e.message());
            assert_eq!(row.state, volume_reconciler::domain::State::Pending);
            let e = seen.unwrap_err();
            assert_eq!(e.code(), Code::NotFound, "{name} reads its own only: {e:?}");
        }
    }
    app.stop().await;
}

/// Two certificates with one CN — one from a second CA of the trusted
/// bundle, one with another unit in its subject — are other callers than
/// the first: the same key is each one's own operation, and neither reads
/// the other's. (Named by the CN alone they were one caller: the second
/// was refused the key as reused with other parameters, and read the
/// first's operation.) A renewal of the first — a new key, the same
/// subject, the same CA — is still the first caller: a replay joins.
#[tokio::test]
async fn certificates_with_one_common_name_are_one_caller_only_for_one_subject_of_one_ca() {
    let pki = support::pki::Pki::new();
    let second_ca = support::pki::Ca::new("second client CA");
    let bundle = pki.dir.join("client-cas.pem");
    std::fs::write(
        &bundle,
        format!(
            "{}{}",
            support::pki::Pki::read(&pki.client_ca),
            second_ca.cert.pem()
        ),
    )
    .unwrap();
    let app = spawn_app(
        AppOptions::default()
            .arg("--tls-cert", &pki.server_cert)
            .arg("--tls-key", &pki.server_key)
            .arg("--tls-client-ca", &bundle.to_string_lossy()),
    )
    .await;
    let request = attach_req("k");
    let replay = || with_timeout(request.get_ref().clone(), Duration::from_secs(10));
    let mut first = cert_client(&app, &pki, &pki.clients.client("twin")).await;
    let own = first.attach_volume(replay()).await.unwrap().into_inner();
    assert!(own.caller.starts_with("twin#"), "{}", own.caller);
    for (why, cert) in [
        ("another CA", second_ca.client("twin")),
        ("another unit", pki.clients.client_in("twin", &["payments"])),
    ] {
        let mut other = cert_client(&app, &pki, &cert).await;
        let theirs = other
            .attach_volume(attach_req("k"))
            .await
            .unwrap_or_else(|e| panic!("{why}: the key is its own: {e:?}"))
            .into_inner();
        assert_ne!(theirs.id, own.id, "{why}");
        assert_ne!(theirs.caller, own.caller, "{why}");
        let row = app
            .store
            .operation_get(theirs.id.parse().unwrap())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row.caller.as_deref(), Some(theirs.caller.as_str()), "{why}");
        let e = other.get_operation(get_req(&own.id)).await.unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{why}: not its to read: {e:?}");
        let e = first.get_operation(get_req(&theirs.id)).await.unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{why}: {e:?}");
    }
    let mut renewed = cert_client(&app, &pki, &pki.clients.client("twin")).await;
    let joined = renewed.attach_volume(replay()).await.unwrap().into_inner();
    assert_eq!(
        (joined.id.as_str(), joined.caller.as_str()),
        (own.id.as_str(), own.caller.as_str()),
        "a renewed certificate is the same caller"
    );
    assert_eq!(
        app.sim
            .attach_requests(request.get_ref().volume_id.parse().unwrap()),
        1,
        "one attach reached Nova for the key"
    );
    app.stop().await;
}

/// Mutual TLS without a role source: every CA-signed client is an
/// orchestrator, whatever its CN or OU says. None may resolve or
/// reconcile, and each reads its own operations only; a certificate that
/// names no caller (no CN) is refused.
#[tokio::test]
async fn without_a_role_source_a_ca_signed_client_cannot_resolve_and_reads_its_own() {
    let pki = support::pki::Pki::new();
    let app = spawn_app(pki.server_flags(AppOptions::default())).await;
    let mut mine = cert_client(&app, &pki, &pki.clients.client("orchestrator-a")).await;
    let own = mine
        .attach_volume(attach_req("k"))
        .await
        .unwrap()
        .into_inner();
    for cert in [
        pki.clients.client("oncall"),
        pki.clients.client_in("sre-1", &["operator"]),
    ] {
        let mut c = cert_client(&app, &pki, &cert).await;
        let pending = pending_of(&app, "orchestrator-a").await;
        let e = c.resolve_operation(resolve_req(pending)).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        let e = c
            .reconcile_operation(with_timeout(
                pb::ReconcileOperationRequest {
                    operation_id: pending.to_string(),
                },
                Duration::from_secs(10),
            ))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        let row = app.store.operation_get(pending).await.unwrap().unwrap();
        assert_eq!(
            (row.state, row.resolution),
            (volume_reconciler::domain::State::Pending, None),
            "nothing was decided"
        );
        let e = c.get_operation(get_req(&own.id)).await.unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "another caller's: {e:?}");
        let theirs = c.attach_volume(attach_req("k")).await.unwrap().into_inner();
        assert_ne!(theirs.id, own.id);
        let e = mine.get_operation(get_req(&theirs.id)).await.unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{e:?}");
    }
    assert_eq!(
        mine.get_operation(get_req(&own.id))
            .await
            .unwrap()
            .into_inner()
            .id,
        own.id
    );
    let mut nameless = cert_client(&app, &pki, &pki.clients.client_in("", &["operator"])).await;
    let e = nameless
        .list_operations(with_timeout(
            pb::ListOperationsRequest::default(),
            Duration::from_secs(10),
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    assert!(e.message().contains("common name"), "{}", e.message());
    app.stop().await;
}

/// Runs `serve` with `args` (on a fresh embedded ledger, against a
/// simulator) and reads its JSON log until it serves, exits, or 30 s
/// pass: the lines, whether it served, and what it said when it did not.
async fn serve_start(args: &[&str]) -> (Vec<String>, bool, String) {
    use tokio::io::AsyncBufReadExt;
    support::init_logs();
    let sim = volume_reconciler::sim::start("127.0.0.1:0".parse().unwrap(), Default::default())
        .await
        .unwrap();
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("vr-start-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let db = format!("sqlite://{}", dir.join("ledger.db").display());
    let mut child = tokio::process::Command::new(BIN)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--database-url",
            &db,
            "--nova-url",
            &sim.nova_url,
            "--no-reconciler",
            "--shutdown-delay",
            "0s",
        ])
        .args(args)
        .env("VOLUME_RECONCILER_LOG", "info")
        .env("VOLUME_RECONCILER_LOG_FORMAT", "json")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the binary starts");
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    let served = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            let serving = line.contains("\"message\":\"serving\"");
            seen.push(line);
            if serving {
                return true;
            }
        }
        false
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "serve neither served nor exited in 30 s:\n{}",
            seen.join("\n")
        )
    });
    // Cleanup: it may have exited on its own already.
    drop(child.start_kill());
    drop(child.wait().await);
    sim.stop().await;
    drop(std::fs::remove_dir_all(&dir));
    let said = seen.join("\n");
    (seen, served, said)
}

/// At start: client certificates without a role source are warned about
/// (nobody is an operator then); a role source silences it; bad entries
/// of `--tls-client-roles`, and settings it cannot work with, stop the
/// start with an error naming the flag.
#[tokio::test]
async fn the_start_warns_of_certificates_without_roles_and_refuses_bad_role_settings() {
    let pki = support::pki::Pki::new();
    let mtls = [
        "--tls-cert",
        pki.server_cert.as_str(),
        "--tls-key",
        pki.server_key.as_str(),
        "--tls-client-ca",
        pki.client_ca.as_str(),
    ];
    let warning = |lines: &[String]| {
        lines
            .iter()
            .find(|l| l.contains("without a role source"))
            .cloned()
    };
    let (lines, served, said) = serve_start(&mtls).await;
    assert!(served, "{said}");
    let line = warning(&lines).unwrap_or_else(|| panic!("no warning in:\n{said}"));
    assert!(
        line.contains("\"level\":\"WARN\"")
            && line.contains("--tls-client-roles")
            && line.contains("ResolveOperation"),
        "{line}"
    );
    let mut with_roles = mtls.to_vec();
    with_roles.extend(["--tls-client-roles", "CN=oncall=operator"]);
    let (lines, served, said) = serve_start(&with_roles).await;
    assert!(served, "{said}");
    assert_eq!(warning(&lines), None, "a role source, no warning:\n{said}");

    let tokens = format!("ci:orchestrator:{}", sha256_hex("t"));
    let bad_entries = "CN=oncall=admin,O=ops=operator,oncall";
    let with = |extra: &[&'static str]| {
        let mut v: Vec<String> = mtls.iter().map(|s| s.to_string()).collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    for (args, expected) in [
        (
            with(&["--tls-client-roles", bad_entries]),
            vec![
                "--tls-client-roles: entry #1 \"CN=oncall=admin\": the role must be orchestrator or operator",
                "entry #2 \"O=ops=operator\": only CN",
                "entry #3 \"oncall\": expected CN=NAME=ROLE",
            ],
        ),
        (
            with(&["--tls-client-roles", "CN=oncall=operator", "--auth-tokens"])
                .into_iter()
                .chain([tokens.clone()])
                .collect(),
            vec!["--tls-client-roles has no effect with --auth-tokens"],
        ),
        (
            vec![
                "--tls-client-roles".to_string(),
                "CN=oncall=operator".to_string(),
            ],
            vec!["--tls-client-roles needs --tls-client-ca"],
        ),
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (_, served, said) = serve_start(&args).await;
        assert!(!served, "{args:?} must not start:\n{said}");
        // The log is JSON: its quotes are escaped.
        let said = said.replace("\\\"", "\"");
        for e in expected {
            assert!(said.contains(e), "{e:?} in:\n{said}");
        }
    }
}
