//! The Rust client for orchestrators and the CLI.
//!
//! `attach`/`detach` take an idempotency key and a deadline and return the
//! ledger's answer, or a [`CallError`] carrying the server's `ErrorInfo`.
//! Transport-level failures (`UNAVAILABLE`, and `CANCELLED` that our own
//! deadline did not cause — what a connection closing under a call looks
//! like during a server's drain) are retried with the **same key** within
//! the caller's deadline. That is safe only because every mutating call
//! carries its key: the server runs a key at most once and a replay joins
//! the original operation. Errors the server decided (`ABORTED`,
//! `FAILED_PRECONDITION`, `NOT_FOUND`, `DEADLINE_EXCEEDED`, ...) are never
//! retried.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use tokio::time::Instant;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::grpc::pb;
use crate::grpc::pb::volume_reconciler_client::VolumeReconcilerClient;

/// An error the caller can act on: the code, the message, and the
/// server's `ErrorInfo` (reason and metadata such as `operation_id`).
#[derive(Debug, Clone)]
pub struct CallError {
    pub code: Code,
    pub message: String,
    pub reason: Option<String>,
    pub metadata: HashMap<String, String>,
    /// Transport failures absorbed by retries before this answer.
    pub retries: u32,
}

impl std::fmt::Display for CallError {
    /// `the message (CODE, REASON: key=value, ...)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}", self.message, code_name(self.code))?;
        if let Some(r) = &self.reason {
            write!(f, ", {r}")?;
        }
        let mut keys: Vec<_> = self.metadata.iter().collect();
        keys.sort();
        for (i, (k, v)) in keys.into_iter().enumerate() {
            write!(f, "{}{k}={v}", if i == 0 { ": " } else { ", " })?;
        }
        write!(f, ")")
    }
}

/// The canonical name of a gRPC code (`INVALID_ARGUMENT`).
pub fn code_name(code: Code) -> String {
    let mut out = String::new();
    for (i, c) in format!("{code:?}").chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

impl std::error::Error for CallError {}

impl CallError {
    pub fn from_status(s: &Status, retries: u32) -> Self {
        let details = s.get_error_details();
        let info = details.error_info();
        Self {
            code: s.code(),
            message: s.message().to_string(),
            reason: info.map(|i| i.reason.clone()),
            metadata: info.map(|i| i.metadata.clone()).unwrap_or_default(),
            retries,
        }
    }

    pub fn operation_id(&self) -> Option<&str> {
        self.metadata.get("operation_id").map(String::as_str)
    }

    /// As JSON: `{"code", "message", "reason", "metadata"}`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "code": code_name(self.code),
            "message": self.message,
            "reason": self.reason,
            "metadata": self.metadata,
        })
    }
}

/// The error chain of a status that never reached the server (tonic's
/// transport error, hyper's, the I/O or TLS error under it), one string.
/// Each link once: tonic and hyper repeat their sources in their messages.
fn chain(s: &Status) -> String {
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
fn hint(chain: &str, server: &str) -> Option<String> {
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

/// A failed call as the CLI prints it: a transport failure names its
/// likely cause and fix; the server's refusals of a token say what to give.
pub fn explain(status: &Status, server: &str, retries: u32) -> CallError {
    let mut e = CallError::from_status(status, retries);
    if let Some(hint) = transport_hint(status, server) {
        e.message = format!("cannot reach {server}: {hint} [{}]", chain(status));
        return e;
    }
    explain_refusal(e)
}

/// UNAUTHENTICATED and PERMISSION_DENIED with what to give instead; any
/// other error as it is.
pub fn explain_refusal(mut e: CallError) -> CallError {
    e.message = match e.code {
        Code::Unauthenticated => format!(
            "{}: the server wants a bearer token it knows (--token-file, VOLUME_RECONCILER_TOKEN or --token; its hash in serve --auth-tokens)",
            e.message
        ),
        Code::PermissionDenied => format!(
            "{}: this token's role may not do this (reconcile and resolve need an operator token)",
            e.message
        ),
        _ => return e,
    };
    e
}

/// `grpc.health.v1.Health/Check` of the whole server: Ok when it answers
/// SERVING within `timeout`; otherwise an error naming the likely cause
/// (see [`transport_hint`]) or the status it answered (NOT_SERVING while
/// it drains).
pub async fn health(opts: &ConnectOptions, timeout: Duration) -> anyhow::Result<()> {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let channel = opts.endpoint()?.connect_timeout(timeout).connect_lazy();
    let mut request = tonic::Request::new(HealthCheckRequest {
        service: String::new(),
    });
    request.set_timeout(timeout);
    let server = &opts.server;
    let answer = tokio::time::timeout(timeout, HealthClient::new(channel).check(request))
        .await
        .map_err(|_| {
            // TCP connect is bounded by 3 s (the endpoint's), so this is
            // a port that accepted and did not answer.
            anyhow::anyhow!(
                "cannot reach {server}: {} (nothing within {})",
                hint("handshake did not finish", server).unwrap_or_default(),
                crate::config::render_duration(timeout)
            )
        })?
        .map_err(|s| anyhow::Error::new(explain(&s, server, 0)))?;
    match answer.into_inner().status() {
        ServingStatus::Serving => Ok(()),
        other => anyhow::bail!(
            "{server} answers {} (draining or starting; see its /readyz)",
            other.as_str_name()
        ),
    }
}

/// Whether a status is a transport failure that a keyed retry may absorb.
pub fn is_transport_failure(s: &Status, deadline: Instant) -> bool {
    match s.code() {
        Code::Unavailable => {
            // The server's own UNAVAILABLE answers carry ErrorInfo; a
            // connection failure does not.
            s.get_error_details().error_info().is_none()
        }
        // tonic reports a connection closed under a call, and its own
        // timer, as CANCELLED; only the former is worth a retry.
        Code::Cancelled => Instant::now() < deadline,
        // A stream reset by a GOAWAY race surfaces as an h2 protocol error.
        Code::Internal | Code::Unknown => {
            let m = s.message();
            s.get_error_details().error_info().is_none()
                && (m.contains("h2 protocol error")
                    || m.contains("transport error")
                    || m.contains("connection"))
        }
        _ => false,
    }
}

/// Pauses between keyed retries: from 20 ms, doubling, at most 500 ms,
/// each stretched by a random 0–100 % so that callers cut off together
/// (a replica draining) do not come back together. No count limit: the
/// caller's deadline bounds them (see `with_retries`).
fn retry_backoff() -> ExponentialBuilder {
    ExponentialBuilder::new()
        .with_min_delay(Duration::from_millis(20))
        .with_max_delay(Duration::from_millis(500))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
}

/// A deadline the client itself saw pass (reason `CLIENT_DEADLINE`).
fn client_deadline(message: &str) -> Status {
    Status::with_error_details(
        Code::DeadlineExceeded,
        message,
        ErrorDetails::with_error_info(
            "CLIENT_DEADLINE",
            crate::grpc::status::DOMAIN,
            HashMap::new(),
        ),
    )
}

/// Counts of what the retries absorbed (for tests and the bench tool).
#[derive(Debug, Default, Clone)]
pub struct RetryStats {
    pub retries: u64,
    pub by_code: HashMap<String, u64>,
}

/// How to reach the service: its address, a bearer token, TLS. The same
/// options as the CLI's `--server`, `--token`, `--ca`, `--cert`, `--key`.
#[derive(Clone, Default)]
pub struct ConnectOptions {
    /// `HOST:PORT`, `http://HOST:PORT` or `https://HOST:PORT`. Without a
    /// scheme, TLS is on when `tls` is set.
    pub server: String,
    /// Sent as `authorization: Bearer <token>` on every call.
    pub token: Option<String>,
    pub tls: Option<ClientTls>,
}

impl std::fmt::Debug for ConnectOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectOptions")
            .field("server", &self.server)
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("tls", &self.tls)
            .finish()
    }
}

/// TLS towards the service.
#[derive(Clone, Default)]
pub struct ClientTls {
    /// PEM of the CA that signed the server's certificate; `None`: the
    /// system's trusted roots.
    pub ca_pem: Option<String>,
    /// PEM certificate chain and key to present (mutual TLS).
    pub identity_pem: Option<(String, String)>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key is a secret; whether there is one is enough.
        f.debug_struct("ClientTls")
            .field("ca", &self.ca_pem.as_ref().map(|_| "PEM"))
            .field("identity", &self.identity_pem.as_ref().map(|_| "PEM"))
            .finish()
    }
}

fn read_pem(what: &str, path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read the {what} {}: {e}", path.display()))
}

impl ClientTls {
    /// Reads the PEM files: the CA (optional), and the certificate and key
    /// (both or neither).
    pub fn from_files(
        ca: Option<&Path>,
        cert: Option<&Path>,
        key: Option<&Path>,
    ) -> anyhow::Result<Self> {
        let identity_pem = match (cert, key) {
            (Some(c), Some(k)) => Some((
                read_pem("client certificate", c)?,
                read_pem("client key", k)?,
            )),
            (None, None) => None,
            _ => anyhow::bail!(
                "a client certificate needs its key: give both --client-cert and --client-key"
            ),
        };
        Ok(Self {
            ca_pem: ca.map(|p| read_pem("CA certificate", p)).transpose()?,
            identity_pem,
        })
    }
}

impl ConnectOptions {
    /// Plaintext, no token.
    pub fn new(server: impl Into<String>) -> Self {
        Self {
            server: server.into(),
            ..Self::default()
        }
    }

    /// The server's URL: the scheme as given, or https when TLS options are
    /// set and http otherwise.
    pub fn url(&self) -> anyhow::Result<String> {
        let s = self.server.trim();
        match s.split_once("://") {
            None if s.is_empty() => anyhow::bail!("no server given (HOST:PORT)"),
            None if self.tls.is_some() => Ok(format!("https://{s}")),
            None => Ok(format!("http://{s}")),
            Some(("https", _)) => Ok(s.to_string()),
            Some(("http", _)) if self.tls.is_some() => anyhow::bail!(
                "server {s:?}: TLS options (--ca, --client-cert, --client-key) need https:// or no scheme"
            ),
            Some(("http", _)) => Ok(s.to_string()),
            Some((scheme, _)) => {
                anyhow::bail!("server {s:?}: unknown scheme {scheme:?} (http or https)")
            }
        }
    }

    /// The endpoint to connect to, with TLS when the URL is https.
    fn endpoint(&self) -> anyhow::Result<Endpoint> {
        let url = self.url()?;
        let ep = Endpoint::from_shared(url.clone())
            .map_err(|e| anyhow::anyhow!("invalid server {:?}: {e}", self.server))?
            .connect_timeout(Duration::from_secs(3))
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_while_idle(true)
            .tcp_nodelay(true);
        if !url.starts_with("https://") {
            return Ok(ep);
        }
        crate::tls::install_crypto_provider();
        let tls = self.tls.clone().unwrap_or_default();
        let mut cfg = ClientTlsConfig::new();
        cfg = match &tls.ca_pem {
            Some(ca) => cfg.ca_certificate(Certificate::from_pem(ca)),
            None => cfg.with_native_roots(),
        };
        if let Some((cert, key)) = &tls.identity_pem {
            cfg = cfg.identity(Identity::from_pem(cert, key));
        }
        ep.tls_config(cfg)
            .map_err(|e| anyhow::anyhow!("TLS towards {url}: {e}"))
    }

    /// The `authorization` value, marked sensitive (never printed).
    fn bearer(&self) -> anyhow::Result<Option<MetadataValue<Ascii>>> {
        let Some(token) = &self.token else {
            return Ok(None);
        };
        anyhow::ensure!(!token.trim().is_empty(), "the bearer token is empty");
        let mut v = MetadataValue::try_from(format!("Bearer {}", token.trim())).map_err(|_| {
            anyhow::anyhow!("the bearer token has characters a header cannot carry")
        })?;
        v.set_sensitive(true);
        Ok(Some(v))
    }
}

#[derive(Clone)]
pub struct Client {
    inner: VolumeReconcilerClient<Channel>,
    /// `Bearer <token>`, sent on every call.
    bearer: Option<MetadataValue<Ascii>>,
}

/// Parameters of an attach.
#[derive(Debug, Clone, Default)]
pub struct AttachOptions {
    pub device: Option<String>,
    pub tag: Option<String>,
    pub delete_on_termination: Option<bool>,
}

impl Client {
    /// Connects lazily to `url` (e.g. `http://127.0.0.1:50051`), in plaintext.
    pub fn connect_lazy(url: &str) -> anyhow::Result<Self> {
        Self::connect(&ConnectOptions::new(url))
    }

    /// Connects lazily with `opts` (a new connection per call of this).
    pub fn connect(opts: &ConnectOptions) -> anyhow::Result<Self> {
        let bearer = opts.bearer()?;
        Ok(Self {
            bearer,
            ..Self::from_channel(opts.endpoint()?.connect_lazy())
        })
    }

    /// Connects and asks `grpc.health.v1` once, within `within`: the CLI's
    /// commands fail in seconds, naming the likely cause and fix, on a port
    /// that refuses, speaks TLS or HTTP/1, or accepts and never answers
    /// (a call would wait for its deadline). The health service is open,
    /// so a bad token is still the call's own answer; a server that says
    /// NOT_SERVING (draining) is still used.
    pub async fn connect_within(opts: &ConnectOptions, within: Duration) -> anyhow::Result<Self> {
        use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
        let channel = opts.endpoint()?.connect_lazy();
        let client = Self {
            bearer: opts.bearer()?,
            ..Self::from_channel(channel.clone())
        };
        let mut request = tonic::Request::new(HealthCheckRequest {
            service: String::new(),
        });
        request.set_timeout(within);
        let server = &opts.server;
        match tokio::time::timeout(within, HealthClient::new(channel).check(request)).await {
            Ok(Ok(_)) => Ok(client),
            // A server without the health service still serves the API.
            Ok(Err(s))
                if s.code() == Code::Unimplemented && transport_hint(&s, server).is_none() =>
            {
                Ok(client)
            }
            Ok(Err(s)) => match transport_hint(&s, server) {
                Some(_) => Err(anyhow::Error::new(explain(&s, server, 0))),
                None => Ok(client),
            },
            Err(_) => anyhow::bail!(
                "cannot reach {server}: {} (nothing within {})",
                hint("handshake did not finish", server).unwrap_or_default(),
                crate::config::render_duration(within)
            ),
        }
    }

    pub fn from_channel(channel: Channel) -> Self {
        Self {
            inner: VolumeReconcilerClient::new(channel),
            bearer: None,
        }
    }

    /// A request carrying this client's credentials and, when given, a
    /// deadline (sent as `grpc-timeout`).
    pub fn request<T>(&self, msg: T, timeout: Option<Duration>) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        if let Some(t) = timeout {
            r.set_timeout(t);
        }
        if let Some(b) = &self.bearer {
            r.metadata_mut().insert("authorization", b.clone());
        }
        r
    }

    /// The generated client on this connection. Requests made for it should
    /// come from [`Client::request`] to carry the credentials.
    pub fn raw(&self) -> VolumeReconcilerClient<Channel> {
        self.inner.clone()
    }

    /// Attaches `volume_id` to `server_id` exactly once per `key`.
    pub async fn attach(
        &self,
        key: &str,
        server_id: &str,
        volume_id: &str,
        opts: AttachOptions,
        timeout: Duration,
    ) -> Result<pb::Operation, CallError> {
        let req = pb::AttachVolumeRequest {
            idempotency_key: key.to_string(),
            server_id: server_id.to_string(),
            volume_id: volume_id.to_string(),
            device: opts.device.unwrap_or_default(),
            tag: opts.tag.unwrap_or_default(),
            delete_on_termination: opts.delete_on_termination,
        };
        self.with_retries(timeout, None, |mut c, remaining| {
            let r = self.request(req.clone(), Some(remaining));
            async move { c.attach_volume(r).await.map(|r| r.into_inner()) }
        })
        .await
    }

    /// Detaches exactly once per `key`.
    pub async fn detach(
        &self,
        key: &str,
        server_id: &str,
        volume_id: &str,
        timeout: Duration,
    ) -> Result<pb::Operation, CallError> {
        let req = pb::DetachVolumeRequest {
            idempotency_key: key.to_string(),
            server_id: server_id.to_string(),
            volume_id: volume_id.to_string(),
        };
        self.with_retries(timeout, None, |mut c, remaining| {
            let r = self.request(req.clone(), Some(remaining));
            async move { c.detach_volume(r).await.map(|r| r.into_inner()) }
        })
        .await
    }

    /// Like `attach`, recording absorbed transport failures in `stats`.
    pub async fn attach_counted(
        &self,
        key: &str,
        server_id: &str,
        volume_id: &str,
        timeout: Duration,
        stats: &std::sync::Mutex<RetryStats>,
    ) -> Result<pb::Operation, CallError> {
        let req = pb::AttachVolumeRequest {
            idempotency_key: key.to_string(),
            server_id: server_id.to_string(),
            volume_id: volume_id.to_string(),
            ..Default::default()
        };
        self.with_retries(timeout, Some(stats), |mut c, remaining| {
            let r = self.request(req.clone(), Some(remaining));
            async move { c.attach_volume(r).await.map(|r| r.into_inner()) }
        })
        .await
    }

    async fn with_retries<T, F, Fut>(
        &self,
        timeout: Duration,
        stats: Option<&std::sync::Mutex<RetryStats>>,
        call: F,
    ) -> Result<T, CallError>
    where
        F: Fn(VolumeReconcilerClient<Channel>, Duration) -> Fut,
        Fut: std::future::Future<Output = Result<T, Status>>,
    {
        let deadline = Instant::now() + timeout;
        let retries = AtomicU32::new(0);
        let attempt = || async {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(client_deadline(
                    "the deadline passed before the call could be (re)sent",
                ));
            }
            // Bound the whole call (tonic's timer covers only the headers).
            tokio::time::timeout_at(deadline, call(self.inner.clone(), remaining))
                .await
                .unwrap_or_else(|_| {
                    Err(client_deadline(
                        "the caller's deadline expired (client side)",
                    ))
                })
        };
        let result = attempt
            .retry(retry_backoff())
            .sleep(tokio::time::sleep)
            .when(|s| is_transport_failure(s, deadline))
            // No pause that would end past the deadline: answer instead.
            .adjust(|_, pause| pause.filter(|p| Instant::now() + *p < deadline))
            .notify(|s, pause| {
                let n = retries.fetch_add(1, Ordering::Relaxed) + 1;
                if let Some(st) = stats {
                    let mut st = st.lock().unwrap_or_else(|p| p.into_inner());
                    st.retries += 1;
                    *st.by_code.entry(code_name(s.code())).or_default() += 1;
                }
                tracing::debug!(code = ?s.code(), message = s.message(), retries = n, pause_ms = pause.as_millis() as u64, "transport failure; retrying with the same key");
            })
            .await;
        let retries = retries.load(Ordering::Relaxed);
        result.map_err(|s| {
            let mut e = CallError::from_status(&s, retries);
            if s.code() == Code::Cancelled && Instant::now() >= deadline {
                // tonic's own timer: call it what it is.
                e.code = Code::DeadlineExceeded;
            }
            e
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_is_taken_with_or_without_a_scheme() {
        let url = |server: &str, tls: bool| {
            ConnectOptions {
                server: server.into(),
                tls: tls.then(ClientTls::default),
                ..ConnectOptions::default()
            }
            .url()
        };
        assert_eq!(url("h:1", false).unwrap(), "http://h:1");
        assert_eq!(url("h:1", true).unwrap(), "https://h:1");
        assert_eq!(url("http://h:1", false).unwrap(), "http://h:1");
        assert_eq!(url("https://h:1", false).unwrap(), "https://h:1");
        assert_eq!(url(" https://h:1 ", true).unwrap(), "https://h:1");
        assert!(
            url("http://h:1", true)
                .unwrap_err()
                .to_string()
                .contains("https://")
        );
        assert!(
            url("ftp://h:1", false)
                .unwrap_err()
                .to_string()
                .contains("ftp")
        );
        assert!(url("", false).is_err());
    }

    #[test]
    fn errors_read_as_a_sentence_with_their_code_and_details() {
        let e = CallError {
            code: Code::InvalidArgument,
            message: "invalid operation_id: is required".into(),
            reason: Some("INVALID_FIELD".into()),
            metadata: [("field".to_string(), "operation_id".to_string())].into(),
            retries: 0,
        };
        assert_eq!(
            e.to_string(),
            "invalid operation_id: is required (INVALID_ARGUMENT, INVALID_FIELD: field=operation_id)"
        );
        assert_eq!(e.to_json()["code"], "INVALID_ARGUMENT");
        assert_eq!(code_name(Code::DeadlineExceeded), "DEADLINE_EXCEEDED");
    }

    #[tokio::test]
    async fn tokens_are_sent_as_bearer_and_never_printed() {
        let opts = ConnectOptions {
            server: "h:1".into(),
            token: Some("s3cret\n".into()),
            tls: None,
        };
        assert!(!format!("{opts:?}").contains("s3cret"));
        let client = Client::connect(&opts).unwrap();
        let r = client.request((), None);
        let v = r.metadata().get("authorization").unwrap();
        assert_eq!(v.to_str().unwrap(), "Bearer s3cret");
        assert!(!format!("{:?}", r.metadata()).contains("s3cret"));
        let bad = ConnectOptions {
            token: Some("a\u{7f}b".into()),
            ..opts
        };
        assert!(Client::connect(&bad).is_err());
    }
}
