//! Why a call that never reached the server failed, in words an operator
//! can act on: the transport error's chain as one line, and its likely
//! cause with the fix (nothing listens; TLS spoken on one side only; the
//! admin port, which speaks HTTP/1; a certificate from an unknown CA...),
//! asking the port what it speaks when the HTTP/2 client cannot tell.

use std::time::Duration;

use tonic::Status;
use tonic_types::StatusExt;

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

/// Asks `server` (`http(s)://HOST:PORT`) what it speaks: one TCP
/// connection, an HTTP/1 request, the first bytes of the answer, a second
/// at most each. Only on a failed call's error path, to tell a TLS port
/// from an HTTP/1 one (the HTTP/2 client sees both as a bad frame).
fn probe(server: &str) -> Option<Speaks> {
    use std::io::{Read, Write};
    let uri: http::Uri = server.parse().ok()?;
    let host = uri.host()?.trim_start_matches('[').trim_end_matches(']');
    let port = uri.port_u16()?;
    let addr = std::net::ToSocketAddrs::to_socket_addrs(&(host, port))
        .ok()?
        .next()?;
    let second = Duration::from_secs(1);
    let mut tcp = std::net::TcpStream::connect_timeout(&addr, second).ok()?;
    tcp.set_read_timeout(Some(second)).ok()?;
    tcp.set_write_timeout(Some(second)).ok()?;
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
pub fn transport_hint(s: &Status, server: &str) -> Option<String> {
    if s.get_error_details().error_info().is_some() {
        return None;
    }
    hint(&chain(s), server)
}

/// [`transport_hint`] from an error chain's text.
pub(super) fn hint(chain: &str, server: &str) -> Option<String> {
    let text = chain.to_ascii_lowercase();
    let has = |needle: &str| text.contains(needle);
    let tls = server.trim().starts_with("https://");
    let url = if server.contains("://") {
        server.trim().to_string()
    } else {
        format!("http://{}", server.trim())
    };
    // The HTTP/2 client cannot tell these apart: ask the port.
    let odd_answer = has("frame with invalid size")
        || has("grpc-status header missing")
        || has("broken pipe")
        || has("connection reset")
        || has("connection closed")
        || has("h2 protocol error");
    if odd_answer {
        match probe(&url) {
            Some(Speaks::Http1) => {
                return Some(format!(
                    "{server} is an HTTP/1 server, not gRPC (the admin port, which serves /readyz and /metrics? serve's gRPC port is --listen, :50051 by default)"
                ));
            }
            Some(Speaks::Tls) if !tls => {
                return Some(format!(
                    "{server} speaks TLS: use https://HOST:PORT (with --ca CA.pem when its certificate is from a private CA)"
                ));
            }
            _ => {}
        }
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
    } else if has("invalidcertificate") || has("unknownissuer") || has("certificate") {
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
