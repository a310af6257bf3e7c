//! Why a call that never reached the server failed, in words an operator
//! can act on: the transport error's chain as one line, and its likely
//! cause with the fix (nothing listens; TLS spoken on one side only; the
//! admin port, which speaks HTTP/1; a certificate from an unknown CA; a
//! server that requires a client certificate...), asking the port what it
//! speaks, or whether it wants a client certificate, when the transport
//! error cannot tell.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use tonic::Status;
use tonic_types::StatusExt;

use super::ConnectOptions;

/// The error chain of a status that never reached the server (tonic's
/// transport error, hyper's, the I/O or TLS error under it), one string.
/// Each link once: tonic and hyper repeat their sources in their messages.
pub(super) fn chain(s: &Status) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut add = |text: String| {
        for part in text.split(": ") {
            if !part.is_empty() && !parts.iter().any(|p| p == part) {
                parts.push(part.to_string());
            }
        }
    };
    add(s.message().to_string());
    let mut source = std::error::Error::source(s);
    while let Some(e) = source {
        add(e.to_string());
        source = e.source();
    }
    parts.join(": ")
}

/// What a port speaks, by the first bytes it answers to an HTTP/1 request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Speaks {
    Http1,
    Tls,
    Http2,
}

/// One TCP connection to `server` (`http(s)://HOST:PORT`), each step
/// (connect, read, write) bounded by a second; with the host it names.
fn dial(server: &str) -> Option<(String, std::net::TcpStream)> {
    let uri: http::Uri = server.parse().ok()?;
    let host = uri.host()?.trim_start_matches('[').trim_end_matches(']');
    let port = uri.port_u16()?;
    let addr = std::net::ToSocketAddrs::to_socket_addrs(&(host, port))
        .ok()?
        .next()?;
    let second = Duration::from_secs(1);
    let tcp = std::net::TcpStream::connect_timeout(&addr, second).ok()?;
    tcp.set_read_timeout(Some(second)).ok()?;
    tcp.set_write_timeout(Some(second)).ok()?;
    Some((host.to_string(), tcp))
}

/// Asks `server` (`http(s)://HOST:PORT`) what it speaks: one TCP
/// connection, an HTTP/1 request, the first bytes of the answer, a second
/// at most each. Only on a failed call's error path, to tell a TLS port
/// from an HTTP/1 one (the HTTP/2 client sees both as a bad frame).
fn probe(server: &str) -> Option<Speaks> {
    use std::io::{Read, Write};
    let (_, mut tcp) = dial(server)?;
    tcp.write_all(b"GET / HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut first = [0u8; 8];
    let n = tcp.read(&mut first).ok()?;
    match &first[..n] {
        [b'H', b'T', b'T', b'P', b'/', b'1', ..] => Some(Speaks::Http1),
        // A TLS alert or handshake record.
        [0x15 | 0x16, 0x03, ..] => Some(Speaks::Tls),
        // An HTTP/2 frame header of a SETTINGS frame (type 4).
        [_, _, _, 0x04, ..] => Some(Speaks::Http2),
        _ => None,
    }
}

/// Why a call to `server` that failed at the transport probably failed,
/// and what fixes it; `None` when the server answered (its own message says
/// it) or the cause is not one of these.
pub fn transport_hint(s: &Status, opts: &ConnectOptions) -> Option<String> {
    if s.get_error_details().error_info().is_some() {
        return None;
    }
    hint(&chain(s), opts)
}

/// [`transport_hint`] from an error chain's text.
pub(super) fn hint(chain: &str, opts: &ConnectOptions) -> Option<String> {
    let server = opts.server.as_str();
    let text = chain.to_ascii_lowercase();
    let has = |needle: &str| text.contains(needle);
    let url = dialled_url(opts);
    let tls = url.starts_with("https://");
    if tls && let Some(hint) = client_certificate_hint(&text, &url, opts) {
        return Some(hint);
    }
    if let Some(hint) = port_hint(&text, &url, server) {
        return Some(hint);
    }
    Some(if has("connection refused") {
        format!(
            "connection refused: nothing listens at {server}. Is the server running, and is this its gRPC port (serve --listen, 127.0.0.1:50051 by default)?"
        )
    } else if has("dns error")
        || has("failed to lookup address")
        || has("name or service not known")
    {
        format!("cannot resolve the host of {server}: check the host name in --server")
    } else if has("invalidcontenttype") || has("corrupt message") || has("wrong version number") {
        format!(
            "the server at {server} does not speak TLS: use http://HOST:PORT (or HOST:PORT without --ca, --client-cert, --client-key)"
        )
    } else if has("invalidcertificate") || has("unknownissuer") || has("invalid peer certificate") {
        format!(
            "the TLS handshake with {server} failed on the server's certificate: give --ca the CA that signed it, and use a host name the certificate names"
        )
    } else if has("timeout expired") || has("handshake did not finish") {
        format!(
            "{server} accepts connections but does not answer as a gRPC server in time (a hung process, a proxy, or a port that is not this service's)"
        )
    } else if has("timed out") || has("deadline has elapsed") {
        format!(
            "no answer from {server} in time: the address may be unreachable (a firewall, a wrong host or port)"
        )
    } else if tls {
        // TLS spoken and then not HTTP/2: a TLS endpoint that is not this
        // service.
        format!(
            "{server} accepted TLS but did not answer as a gRPC server: is this the service's gRPC port?"
        )
    } else if has("grpc-status header missing") {
        format!(
            "{server} answered HTTP without a gRPC status: not this service's gRPC port (serve --listen, :50051 by default)?"
        )
    } else if has("h2 protocol error")
        || has("connection reset")
        || has("broken pipe")
        || has("connection closed")
        || has("unexpected eof")
        || has("transport error")
    {
        format!(
            "{server} closed the connection at once: if the server has TLS on (serve --tls-cert), use https://HOST:PORT (and --ca for a private CA); otherwise, is this its gRPC port?"
        )
    } else {
        return None;
    })
}

/// The URL the client dialled: the scheme as given, or https when TLS
/// options are set (http when they do not fit the scheme given).
fn dialled_url(opts: &ConnectOptions) -> String {
    let server = opts.server.trim();
    opts.url().unwrap_or_else(|_| {
        if server.contains("://") {
            server.to_string()
        } else {
            format!("http://{server}")
        }
    })
}

/// What the port speaks, asked when the HTTP/2 client cannot tell (an
/// HTTP/1 port and a TLS one both answer it with a bad frame).
fn port_hint(text: &str, url: &str, server: &str) -> Option<String> {
    let has = |needle: &str| text.contains(needle);
    let odd_answer = has("frame with invalid size")
        || has("grpc-status header missing")
        || has("broken pipe")
        || has("connection reset")
        || has("connection closed")
        || has("h2 protocol error");
    if !odd_answer {
        return None;
    }
    match probe(url)? {
        Speaks::Http1 => Some(format!(
            "{server} is an HTTP/1 server, not gRPC (the admin port, which serves /readyz and /metrics? serve's gRPC port is --listen, :50051 by default)"
        )),
        Speaks::Tls if !url.starts_with("https://") => Some(format!(
            "{server} speaks TLS: use https://HOST:PORT (with --ca CA.pem when its certificate is from a private CA)"
        )),
        Speaks::Tls | Speaks::Http2 => None,
    }
}

/// When the TLS handshake ended without a word on the server's certificate
/// (the server closed, or sent an alert of its own): whether the server
/// requires a client certificate and refuses the one given (or none), and
/// then what to give. With TLS 1.3 the client's handshake is done before
/// the server checks the client's certificate, so the error is an alert or
/// a closed connection depending on timing; the port is asked rather than
/// the error guessed at.
fn client_certificate_hint(text: &str, url: &str, opts: &ConnectOptions) -> Option<String> {
    let has = |needle: &str| text.contains(needle);
    let server_certificate =
        has("invalid peer certificate") || has("invalidcertificate") || has("unknownissuer");
    let ended = has("alert")
        || has("connection closed")
        || has("connection reset")
        || has("broken pipe")
        || has("unexpected eof");
    if server_certificate || !ended {
        return None;
    }
    let identity = opts.tls.as_ref().and_then(|t| t.identity_pem.as_ref());
    if !refuses_client(url, identity)? {
        return None;
    }
    let server = &opts.server;
    Some(match identity {
        Some(_) => format!(
            "the server at {server} refused the client certificate: give --client-cert and --client-key of a certificate signed by a CA it trusts (its serve --tls-client-ca)"
        ),
        None => format!(
            "the server at {server} asks for a client certificate: give --client-cert and --client-key (signed by a CA in its serve --tls-client-ca)"
        ),
    })
}

/// Whether the TLS server at `url` asks for a client certificate and ends
/// the connection that presents `identity` (PEM certificate chain and key;
/// `None`: no certificate): one handshake, then one read. A server that
/// accepts it waits for the client's HTTP/2 preface or sends its own. The
/// probe checks nothing of the server's certificate and sends nothing but
/// the handshake: it only asks. A second at most per step; `None` when the
/// port cannot be asked.
fn refuses_client(url: &str, identity: Option<&(String, String)>) -> Option<bool> {
    use std::io::Read;
    // Whatever fails on the way leaves the port unasked (`None`): the
    // transport's own error then stands, without this hint.
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let key = match identity {
        Some((cert, key)) => Some(certified_key(&provider, cert, key)?),
        None => None,
    };
    let presenter = Arc::new(Presenter {
        asked: AtomicBool::new(false),
        key,
    });
    let config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .ok()?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer(provider)))
        .with_client_cert_resolver(presenter.clone());
    let (host, mut tcp) = dial(url)?;
    let name = ServerName::try_from(host).ok()?;
    let mut conn = rustls::ClientConnection::new(Arc::new(config), name).ok()?;
    let mut byte = [0u8; 1];
    let ended = match rustls::Stream::new(&mut conn, &mut tcp).read(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    };
    Some(presenter.asked.load(Ordering::Relaxed) && ended)
}

/// A PEM certificate chain and key as rustls presents them; `None` when
/// they do not parse (connecting said so already).
fn certified_key(
    provider: &rustls::crypto::CryptoProvider,
    cert: &str,
    key: &str,
) -> Option<Arc<rustls::sign::CertifiedKey>> {
    use rustls::pki_types::PrivateKeyDer;
    use rustls::pki_types::pem::PemObject;
    let chain = CertificateDer::pem_slice_iter(cert.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .ok()?;
    let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).ok()?;
    let key = provider.key_provider.load_private_key(key).ok()?;
    Some(Arc::new(rustls::sign::CertifiedKey::new(chain, key)))
}

/// The client certificate of [`refuses_client`] (or none), noting that
/// the server asked for one.
#[derive(Debug)]
struct Presenter {
    asked: AtomicBool,
    key: Option<Arc<rustls::sign::CertifiedKey>>,
}

impl rustls::client::ResolvesClientCert for Presenter {
    fn resolve(
        &self,
        _: &[&[u8]],
        _: &[rustls::SignatureScheme],
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        self.asked.store(true, Ordering::Relaxed);
        self.key.clone()
    }

    fn has_certs(&self) -> bool {
        self.key.is_some()
    }
}

/// Any server certificate, for [`refuses_client`] alone: it asks a
/// question of the handshake and sends no data to the server.
#[derive(Debug)]
struct AnyServer(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }

    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
