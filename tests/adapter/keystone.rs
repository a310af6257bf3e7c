//! Keystone mode through the real server and the simulator's Keystone:
//! application credentials (by id, by name), a Keystone behind real TLS
//! trusted through a CA bundle (or, loudly, not verified at all), and
//! through the real binary: clouds.yaml with secure.yaml over it, and
//! `config show` telling what `OS_CLOUD` resolved to.

use crate::support;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use support::pki::Pki;
use support::with_timeout;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;
use volume_reconciler::config::ServeArgs;
use volume_reconciler::grpc::pb;
use volume_reconciler::sim::{self, SimConfig, SimHandle};
use volume_reconciler::startup::Application;

const BIN: &str = env!("CARGO_BIN_EXE_volume-reconciler");

/// The simulator's Keystone, requiring tokens on Nova, with an
/// application credential of its user `demo`.
async fn keystone_sim() -> SimHandle {
    support::init_logs();
    sim::start(
        "127.0.0.1:0".parse().unwrap(),
        SimConfig {
            require_auth: true,
            password: "pw-Zx81q".into(),
            application_credential: Some((
                "0c9a7f3e5b6d4e8f9a1b2c3d4e5f6a7b".into(),
                "reconciler".into(),
                "app-secret-Qm71".into(),
            )),
            ..SimConfig::default()
        },
    )
    .await
    .unwrap()
}

/// A server in Keystone mode, built as `main` builds it (no `--nova-url`),
/// with `openstack` flags; a fresh database.
struct KeystoneApp {
    client: volume_reconciler::client::Client,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

async fn build(openstack: &[&str]) -> anyhow::Result<KeystoneApp> {
    let db = support::pg::fresh_database().await;
    let mut args = vec![
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--database-url",
        &db,
        "--shutdown-delay",
        "0s",
        "--no-reconciler",
        "--nova-discovery-timeout",
        "5s",
    ];
    args.extend_from_slice(openstack);
    let app = Application::build(ServeArgs::from_args(args)?).await?;
    let client =
        volume_reconciler::client::Client::connect_lazy(&format!("http://{}", app.grpc_addr()))?;
    let stop = CancellationToken::new();
    let s = stop.clone();
    let task = tokio::spawn(app.run_until(async move { s.cancelled().await }));
    Ok(KeystoneApp { client, stop, task })
}

impl KeystoneApp {
    async fn attach(&self, key: &str, volume: Uuid) -> Result<pb::Operation, tonic::Status> {
        self.client
            .raw()
            .attach_volume(with_timeout(
                pb::AttachVolumeRequest {
                    idempotency_key: key.into(),
                    server_id: Uuid::new_v4().to_string(),
                    volume_id: volume.to_string(),
                    ..Default::default()
                },
                Duration::from_secs(10),
            ))
            .await
            .map(|r| r.into_inner())
    }

    async fn stop(self) {
        self.stop.cancel();
        match tokio::time::timeout(Duration::from_secs(30), self.task).await {
            Ok(Ok(Ok(()))) => {}
            other => panic!("server did not stop cleanly: {other:?}"),
        }
    }
}

#[tokio::test]
async fn application_credentials_by_id_and_by_name_attach_through_the_server() {
    let sim = keystone_sim().await;
    let by_id = [
        "--os-auth-url",
        &sim.auth_url,
        "--os-auth-type",
        "v3applicationcredential",
        "--os-application-credential-id",
        "0c9a7f3e5b6d4e8f9a1b2c3d4e5f6a7b",
        "--os-application-credential-secret",
        "app-secret-Qm71",
        "--os-region-name",
        "RegionOne",
    ];
    let by_name = [
        "--os-auth-url",
        &sim.auth_url,
        "--os-auth-type",
        "v3applicationcredential",
        "--os-application-credential-name",
        "reconciler",
        "--os-username",
        "demo",
        "--os-user-domain-name",
        "Default",
        "--os-application-credential-secret",
        "app-secret-Qm71",
    ];
    for (how, flags) in [("id", &by_id[..]), ("name", &by_name[..])] {
        let tokens_before = sim.sim.issued_tokens().len();
        let app = build(flags).await.expect("builds");
        let v = Uuid::new_v4();
        let op = app
            .attach(&format!("app-cred-{how}"), v)
            .await
            .unwrap_or_else(|e| panic!("by {how}: {e:?}"));
        assert_eq!(op.state, pb::State::Succeeded as i32, "by {how}");
        assert_eq!(sim.sim.attach_effects(v), 1, "by {how}");
        assert!(
            sim.sim.issued_tokens().len() > tokens_before,
            "by {how}: Keystone issued the token the attach used"
        );
        app.stop().await;
    }
    // A wrong secret is Keystone's refusal, said as such; Nova never sees
    // the request.
    let mut wrong = by_id.to_vec();
    wrong[7] = "not-the-secret";
    let app = build(&wrong).await.expect("a refused token is not a crash");
    let v = Uuid::new_v4();
    let err = app.attach("app-cred-wrong", v).await.unwrap_err();
    let (reason, _) = support::error_info(&err);
    assert_eq!(
        (err.code(), reason.as_str()),
        (tonic::Code::Unavailable, "KEYSTONE_AUTH_FAILED"),
        "{err:?}"
    );
    assert!(err.message().contains("401"), "{}", err.message());
    assert_eq!(sim.sim.attach_requests(v), 0);
    app.stop().await;
    sim.stop().await;
}

/// A TLS front for the simulator's Keystone: a real handshake with a
/// certificate from `pki`'s server CA, then the bytes both ways.
async fn tls_front(pki: &Pki, upstream: SocketAddr) -> SocketAddr {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&pki.server_cert)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(&pki.server_key).unwrap();
    let mut config = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    // The simulator speaks HTTP/1.1.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                // A client that refuses our certificate ends here: its point.
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                if let Ok(mut plain) = tokio::net::TcpStream::connect(upstream).await {
                    // Either side closing ends the relay.
                    drop(tokio::io::copy_bidirectional(&mut tls, &mut plain).await);
                }
            });
        }
    });
    addr
}

#[tokio::test]
async fn a_keystone_behind_tls_is_trusted_through_the_given_ca_only() {
    let sim = keystone_sim().await;
    let pki = Pki::new();
    let front = tls_front(&pki, sim.addr).await;
    let auth_url = format!("https://127.0.0.1:{}/identity/v3", front.port());
    let password = [
        "--os-auth-url",
        &auth_url,
        "--os-username",
        "demo",
        "--os-password",
        "pw-Zx81q",
        "--os-project-name",
        "demo",
    ];
    let with = |extra: &[&'static str]| {
        let mut v: Vec<String> = password.iter().map(|s| s.to_string()).collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let ca = pki.server_ca.clone();
    // The CA that signed Keystone's certificate: trusted.
    let flags = with(&[]);
    let mut flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    flags.extend(["--os-cacert", &ca]);
    let app = build(&flags).await.unwrap();
    let v = Uuid::new_v4();
    let op = app.attach("tls-trusted", v).await.expect("through TLS");
    assert_eq!(op.state, pb::State::Succeeded as i32);
    assert_eq!(sim.sim.attach_effects(v), 1);
    app.stop().await;

    // The system's roots do not know this CA: no token, and the cause says why.
    let flags = with(&[]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let app = build(&flags)
        .await
        .expect("an unverifiable Keystone is not a crash");
    let v = Uuid::new_v4();
    let err = app.attach("tls-untrusted", v).await.unwrap_err();
    let (reason, meta) = support::error_info(&err);
    assert_eq!(reason, "KEYSTONE_AUTH_FAILED", "{err:?}");
    let cause = format!("{} {:?}", err.message(), meta).to_lowercase();
    assert!(cause.contains("certificate"), "{cause}");
    assert_eq!(sim.sim.attach_requests(v), 0);
    app.stop().await;

    // Verification off: works, and is warned about at start.
    let flags = with(&["--os-insecure"]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let app = build(&flags).await.unwrap();
    let v = Uuid::new_v4();
    let op = app.attach("tls-insecure", v).await.expect("unverified TLS");
    assert_eq!(op.state, pb::State::Succeeded as i32);
    app.stop().await;

    // A CA file that is no CA bundle: refused at start, naming the setting.
    let not_pem = pki.dir.join("not-a-ca.pem");
    std::fs::write(&not_pem, "hello").unwrap();
    let flags = with(&[]);
    let mut flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let not_pem = not_pem.display().to_string();
    flags.extend(["--os-cacert", &not_pem]);
    let err = match build(&flags).await {
        Ok(_) => panic!("a CA file without a certificate must stop the start"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        err.contains("OS_CACERT") && err.contains("not-a-ca.pem"),
        "{err}"
    );
    sim.stop().await;
}

/// The binary with this environment (and none of the caller's OS_*).
fn binary(args: &[&str], env: &[(&str, String)]) -> Command {
    let mut c = Command::new(BIN);
    c.args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("OS_") || k.starts_with("VOLUME_RECONCILER_") || k == "DATABASE_URL" {
            c.env_remove(k);
        }
    }
    c.envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .env("VOLUME_RECONCILER_LOG_FORMAT", "human")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null());
    c
}

/// One line of `config show`'s resolved cloud: (value, source).
fn resolved(out: &str, key: &str) -> (String, String) {
    let section = out
        .split("OpenStack (Keystone mode)")
        .nth(1)
        .unwrap_or_else(|| panic!("no resolved cloud in:\n{out}"));
    let line = section
        .lines()
        .find(|l| l.split_whitespace().next() == Some(key))
        .unwrap_or_else(|| panic!("{key} missing:\n{out}"));
    let mut parts = line.split_whitespace().skip(1);
    let value = parts.next().unwrap_or_default().to_string();
    (value, parts.collect::<Vec<_>>().join(" "))
}

#[tokio::test]
async fn os_cloud_with_secure_yaml_resolves_shows_and_serves() {
    let sim = keystone_sim().await;
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("vr-os-cloud-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let clouds = dir.join("clouds.yaml");
    let secure = dir.join("secure.yaml");
    std::fs::write(
        &clouds,
        format!(
            "clouds:\n  sim:\n    auth:\n      auth_url: {}\n      username: demo\n      password: stale-password-in-clouds\n      project_name: demo\n    region_name: RegionOne\n    interface: internal\n    identity_api_version: 3\n",
            sim.auth_url
        ),
    )
    .unwrap();
    std::fs::write(
        &secure,
        "clouds:\n  sim:\n    auth:\n      password: pw-Zx81q\n",
    )
    .unwrap();
    let env = vec![
        ("OS_CLOUD", "sim".to_string()),
        ("OS_CLIENT_CONFIG_FILE", clouds.display().to_string()),
        ("OS_CLIENT_SECURE_FILE", secure.display().to_string()),
    ];
    // What OS_CLOUD resolved to, with each value's source; secrets masked.
    let out = binary(&["config", "show"], &env).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("OS_CLOUD=sim from") && text.contains("secure.yaml"),
        "{text}"
    );
    assert_eq!(resolved(&text, "password").0, "***");
    assert!(
        resolved(&text, "password").1.contains("secure.yaml"),
        "{text}"
    );
    assert!(
        resolved(&text, "username").1.contains("clouds.yaml"),
        "{text}"
    );
    assert_eq!(resolved(&text, "interface").0, "internal");
    assert_eq!(
        resolved(&text, "auth_type"),
        ("password".into(), "default".into())
    );
    assert_eq!(
        resolved(&text, "user_domain_name"),
        ("Default".into(), "default".into())
    );
    assert!(
        !text.contains("pw-Zx81q") && !text.contains("stale-password"),
        "no password in the output:\n{text}"
    );
    assert!(!text.contains("problem:"), "{text}");
    // An explicit OS_INTERFACE wins over the file, even when it says the default.
    let mut explicit = env.clone();
    explicit.push(("OS_INTERFACE", "public".into()));
    let out = binary(&["config", "show"], &explicit).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        resolved(&text, "interface"),
        ("public".into(), "explicit".into()),
        "{text}"
    );
    // A cloud that is not there is named, with those that are.
    let mut missing = env.clone();
    missing[0].1 = "nope".into();
    let out = binary(&["config", "show"], &missing).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("\"nope\"") && text.contains("sim"), "{text}");

    // The service itself authenticates with secure.yaml's password.
    let db = support::pg::fresh_database().await;
    let free = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
    };
    let (grpc, admin) = (free(), free());
    let mut child = binary(
        &[
            "serve",
            "--listen",
            &grpc.to_string(),
            "--admin-listen",
            &admin.to_string(),
            "--database-url",
            &db,
            "--shutdown-delay",
            "0s",
        ],
        &env,
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    support::eventually(Duration::from_secs(30), "the service is ready", || async {
        matches!(reqwest::get(format!("http://{admin}/readyz")).await, Ok(r) if r.status() == 200)
    })
    .await;
    let client =
        volume_reconciler::client::Client::connect_lazy(&format!("http://{grpc}")).unwrap();
    let v = Uuid::new_v4();
    let op = client
        .attach(
            "os-cloud-1",
            &Uuid::new_v4().to_string(),
            &v.to_string(),
            volume_reconciler::client::AttachOptions::default(),
            Duration::from_secs(10),
        )
        .await
        .expect("an attach with secure.yaml's password");
    assert_eq!(op.state, pb::State::Succeeded as i32);
    assert_eq!(sim.sim.attach_effects(v), 1);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    // Waited for off the runtime, which keeps serving the client's
    // connection: it must see the GOAWAY for the drain to end.
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert!(status.success());
    sim.stop().await;
}
