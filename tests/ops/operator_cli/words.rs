//! What the binary says is what is true: a server that requires a client
//! certificate is named as such; a TLS mismatch is the retry status (75)
//! whichever side speaks TLS.

use super::{QUICK, host_port, run};
use crate::support::{self, AppOptions, Ledger, spawn_app};

/// `https://localhost:PORT` of an app's gRPC port (its certificate names
/// localhost).
fn https_localhost(grpc_url: &str) -> String {
    let port = grpc_url.rsplit(':').next().unwrap();
    format!("https://localhost:{port}")
}

#[tokio::test]
async fn a_server_that_requires_a_client_certificate_says_so_not_give_ca() {
    let pki = support::pki::Pki::new();
    let app = spawn_app(pki.server_flags(AppOptions::default().on(Ledger::Embedded))).await;
    let server = https_localhost(&app.grpc_url);
    let ca = ["--server", server.as_str(), "--ca", pki.server_ca.as_str()];
    // Without a certificate: the server's refusal reaches the client as an
    // alert or as a closed connection, depending on timing; a few runs see
    // either.
    for attempt in 0..3 {
        for command in [
            vec!["ops", "list"],
            vec!["bench", "--duration", "3s", "--quiet"],
        ] {
            let mut args = command.clone();
            args.extend(ca);
            let r = run(&args, &[]).await;
            let what = format!("{command:?} without a client certificate (run {attempt})");
            assert!(
                r.stderr
                    .contains("asks for a client certificate: give --client-cert and --client-key"),
                "{what}: {}",
                r.stderr
            );
            assert!(!r.stderr.contains("give --ca"), "{what}: {}", r.stderr);
            assert_eq!(r.code, Some(75), "{what}: {}", r.stderr);
            assert!(r.took < QUICK, "{what}: took {:?}", r.took);
        }
    }
    // A certificate of a CA the server does not trust: refused, said so.
    let foreign = support::pki::Ca::new("a CA the server does not trust");
    let (cert, key) = foreign.client("intruder");
    let (cert_file, key_file) = (pki.dir.join("foreign.pem"), pki.dir.join("foreign.key"));
    std::fs::write(&cert_file, cert).unwrap();
    std::fs::write(&key_file, key).unwrap();
    let mut args = vec!["ops", "list"];
    args.extend(ca);
    let (cert_file, key_file) = (cert_file.to_str().unwrap(), key_file.to_str().unwrap());
    args.extend(["--client-cert", cert_file, "--client-key", key_file]);
    let r = run(&args, &[]).await;
    assert!(
        r.stderr.contains("refused the client certificate"),
        "{}",
        r.stderr
    );
    assert_eq!(r.code, Some(75), "{}", r.stderr);
    // The client CA's certificate is served.
    let mut args = vec!["ops", "list"];
    args.extend(ca);
    args.extend(["--cert", &pki.client_cert, "--key", &pki.client_key]);
    let r = run(&args, &[]).await;
    assert!(r.ok, "{}", r.stderr);
    app.stop().await;
}

#[tokio::test]
async fn tls_mismatches_exit_75_whichever_side_speaks_tls() {
    let plain = spawn_app(AppOptions::default().on(Ledger::Embedded)).await;
    let pki = support::pki::Pki::new();
    let tls = spawn_app(
        AppOptions::default()
            .on(Ledger::Embedded)
            .arg("--tls-cert", &pki.server_cert)
            .arg("--tls-key", &pki.server_key),
    )
    .await;
    let tls_in_plaintext = host_port(&tls.grpc_url);
    let plaintext_in_tls = format!("https://{}", host_port(&plain.grpc_url));
    let cases = [
        ("plaintext to a TLS server", &tls_in_plaintext, "speaks TLS"),
        (
            "TLS to a plaintext server",
            &plaintext_in_tls,
            "does not speak TLS",
        ),
    ];
    for (what, server, says) in cases {
        for command in [
            vec!["ops", "list"],
            vec!["bench", "--duration", "3s", "--quiet"],
        ] {
            let mut args = command.clone();
            args.extend(["--server", server.as_str()]);
            let r = run(&args, &[]).await;
            assert!(r.stderr.contains(says), "{command:?}, {what}: {}", r.stderr);
            assert_eq!(
                r.code,
                Some(75),
                "{command:?}, {what}: the retry status, as docs/operating.md says: {}",
                r.stderr
            );
        }
    }
    plain.stop().await;
    tls.stop().await;
}
