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
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};
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
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.code, self.message)?;
        if let Some(r) = &self.reason {
            write!(f, " [{r}]")?;
        }
        let mut keys: Vec<_> = self.metadata.iter().collect();
        keys.sort();
        for (k, v) in keys {
            write!(f, " {k}={v}")?;
        }
        Ok(())
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

#[derive(Clone)]
pub struct Client {
    inner: VolumeReconcilerClient<Channel>,
}

/// Parameters of an attach.
#[derive(Debug, Clone, Default)]
pub struct AttachOptions {
    pub device: Option<String>,
    pub tag: Option<String>,
    pub delete_on_termination: Option<bool>,
}

impl Client {
    /// Connects lazily to `url` (e.g. `http://127.0.0.1:50051`).
    pub fn connect_lazy(url: &str) -> anyhow::Result<Self> {
        let ep = Endpoint::from_shared(url.to_string())
            .map_err(|e| anyhow::anyhow!("invalid server URL {url:?}: {e}"))?
            .connect_timeout(Duration::from_secs(3))
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_while_idle(true)
            .tcp_nodelay(true);
        Ok(Self::from_channel(ep.connect_lazy()))
    }

    pub fn from_channel(channel: Channel) -> Self {
        Self {
            inner: VolumeReconcilerClient::new(channel),
        }
    }

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
            let mut r = tonic::Request::new(req.clone());
            r.set_timeout(remaining);
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
            let mut r = tonic::Request::new(req.clone());
            r.set_timeout(remaining);
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
            let mut r = tonic::Request::new(req.clone());
            r.set_timeout(remaining);
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
                    *st.by_code.entry(format!("{:?}", s.code())).or_default() += 1;
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
