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
//!
//! - `connect`: how to reach the service: address, token, TLS.
//! - `diagnose`: why a call that never reached the server failed, and the
//!   likely fix.

mod connect;
mod diagnose;

/// The canonical name of a gRPC code (`INVALID_ARGUMENT`): one table,
/// shared with the metrics' labels.
pub use crate::grpc::metrics::code_name;
pub use connect::{ClientTls, ConnectOptions};
pub use diagnose::transport_hint;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use tokio::time::Instant;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::Channel;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::grpc::pb;
use crate::grpc::pb::volume_reconciler_client::VolumeReconcilerClient;
use diagnose::{chain, hint};

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

/// A failed call as the CLI prints it: a transport failure names its
/// likely cause and fix, and is `UNAVAILABLE` whatever the transport's
/// status said (a TLS or protocol mismatch surfaces as `INTERNAL`,
/// `UNKNOWN` or `CANCELLED` depending on which side noticed first: one
/// exit status for all of them); the server's refusals of a token say what
/// to give.
pub fn explain(status: &Status, opts: &ConnectOptions, retries: u32) -> CallError {
    let mut e = CallError::from_status(status, retries);
    if let Some(hint) = transport_hint(status, opts) {
        e.message = format!("cannot reach {}: {hint} [{}]", opts.server, chain(status));
        // The server's own answers carry no source; the transport's do.
        if std::error::Error::source(status).is_some() {
            e.code = Code::Unavailable;
        }
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
    let answer = tokio::time::timeout(timeout, HealthClient::new(channel).check(request))
        .await
        .map_err(|_| no_answer(opts, timeout))?
        .map_err(|s| anyhow::Error::new(explain(&s, opts, 0)))?;
    match answer.into_inner().status() {
        ServingStatus::Serving => Ok(()),
        other => anyhow::bail!(
            "{} answers {} (draining or starting; see its /readyz)",
            opts.server,
            other.as_str_name()
        ),
    }
}

/// A health check that got no answer `within`: TCP connect is bounded by
/// the endpoint's 3 s, so the port accepted and did not answer.
/// UNAVAILABLE, as a refused connection is: the caller may try again (the
/// CLI's retry status).
fn no_answer(opts: &ConnectOptions, within: Duration) -> anyhow::Error {
    anyhow::Error::new(CallError {
        code: Code::Unavailable,
        message: format!(
            "cannot reach {}: {} (nothing within {})",
            opts.server,
            hint("handshake did not finish", opts).unwrap_or_default(),
            crate::domain::parse::render_duration(within)
        ),
        reason: None,
        metadata: HashMap::new(),
        retries: 0,
    })
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
    pub by_code: HashMap<&'static str, u64>,
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
    /// The operation's labels (docs/api.md: at most 8, part of the
    /// request, not for secrets).
    pub labels: std::collections::BTreeMap<String, String>,
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
        match tokio::time::timeout(within, HealthClient::new(channel).check(request)).await {
            Ok(Ok(_)) => Ok(client),
            // A server without the health service still serves the API.
            Ok(Err(s)) if s.code() == Code::Unimplemented && transport_hint(&s, opts).is_none() => {
                Ok(client)
            }
            Ok(Err(s)) => match transport_hint(&s, opts) {
                Some(_) => Err(anyhow::Error::new(explain(&s, opts, 0))),
                None => Ok(client),
            },
            Err(_) => Err(no_answer(opts, within)),
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
            labels: opts.labels.into_iter().collect(),
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
        self.detach_labelled(key, server_id, volume_id, Default::default(), timeout)
            .await
    }

    /// `detach`, the operation carrying `labels`.
    pub async fn detach_labelled(
        &self,
        key: &str,
        server_id: &str,
        volume_id: &str,
        labels: std::collections::BTreeMap<String, String>,
        timeout: Duration,
    ) -> Result<pb::Operation, CallError> {
        let req = pb::DetachVolumeRequest {
            idempotency_key: key.to_string(),
            server_id: server_id.to_string(),
            volume_id: volume_id.to_string(),
            labels: labels.into_iter().collect(),
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
