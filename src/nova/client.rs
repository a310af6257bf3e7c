//! The Nova client. Each request takes its deadline as an argument; no
//! transport constant can end a request earlier. Connection setup (TCP
//! connect, TLS handshake) keeps its own short bounds because it is not
//! the server's working time. One connection pool per endpoint, shared by
//! all requests, with a cap on concurrent requests per host whose wait
//! counts against the request's deadline.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use reqwest::Method;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use uuid::Uuid;

use super::auth::{KeystoneAuth, KeystoneConfig, Secret, error_chain};
use super::error::{NovaError, NovaErrorKind, Rejection, Stage};
use super::types::{
    AttachBody, AttachSpec, AttachmentEnvelope, AttachmentList, NovaAttachment, classify,
    parse_fault,
};
use crate::domain::RequestParams;

/// Where Nova is.
#[derive(Debug, Clone)]
pub enum NovaEndpoint {
    /// `--nova-url`: no Keystone (tests, the simulator, a trusted proxy).
    Direct(String),
    /// The compute endpoint comes from the Keystone catalog.
    Keystone(KeystoneConfig),
}

#[derive(Debug, Clone)]
pub struct NovaConfig {
    pub endpoint: NovaEndpoint,
    /// `X-OpenStack-Nova-API-Version`, e.g. "2.89".
    pub microversion: String,
    pub max_concurrent_per_host: usize,
    /// Bound of a TCP connect (connection setup only).
    pub connect_timeout: Duration,
    /// Bound of a TLS handshake (connection setup only).
    pub tls_handshake_timeout: Duration,
}

impl Default for NovaConfig {
    fn default() -> Self {
        Self {
            endpoint: NovaEndpoint::Direct("http://127.0.0.1:8774/v2.1".into()),
            microversion: "2.89".into(),
            max_concurrent_per_host: 128,
            connect_timeout: Duration::from_secs(3),
            tls_handshake_timeout: Duration::from_secs(5),
        }
    }
}

/// What an attach answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttachAnswer {
    /// 200 (microversion <= 2.100): Nova created its record.
    Attached(NovaAttachment),
    /// 202 (microversion >= 2.101): accepted; only the list can tell.
    Accepted,
}

struct RawResponse {
    status: u16,
    body: Bytes,
    /// Nova's own (local) id of the request, from its answer.
    nova_request_id: Option<String>,
}

/// A global request id (`X-OpenStack-Request-ID: req-<uuid>`, honoured by
/// Nova from microversion 2.46): Nova logs it beside the local id it
/// answers with, so an operator can find both sides of a call. Every
/// request of one operation carries the operation's id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestId(String);

impl RequestId {
    pub fn for_operation(id: Uuid) -> Self {
        Self(format!("req-{id}"))
    }

    pub fn fresh() -> Self {
        Self(format!("req-{}", Uuid::new_v4()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A value Nova answered with, and the local request id it answered under.
#[derive(Debug, Clone)]
pub struct Answered<T> {
    pub value: T,
    pub nova_request_id: Option<String>,
}

/// Told how long each request waited for a connection slot.
pub type SlotWaitObserver = Arc<dyn Fn(Duration) + Send + Sync>;

pub struct NovaClient {
    slot_wait: Option<SlotWaitObserver>,
    http: reqwest::Client,
    cfg: NovaConfig,
    auth: Option<Arc<KeystoneAuth>>,
    slots: Arc<Semaphore>,
    microversion: (u32, u32),
}

/// Builds the shared HTTP client. Deliberately no `timeout`, no
/// `read_timeout`: the only bound of a request is its deadline. The connect
/// bound covers TCP (and TLS for https) and nothing after it.
pub fn build_http_client(cfg: &NovaConfig, https: bool) -> reqwest::Client {
    let connect = if https {
        cfg.connect_timeout + cfg.tls_handshake_timeout
    } else {
        cfg.connect_timeout
    };
    install_crypto_provider();
    reqwest::Client::builder()
        .connect_timeout(connect)
        .pool_max_idle_per_host(cfg.max_concurrent_per_host)
        .tcp_nodelay(true)
        .user_agent(concat!("volume-reconciler/", env!("CARGO_PKG_VERSION")))
        .build()
        // Building fails only when the TLS backend cannot initialize, which
        // is a broken installation, not a runtime condition.
        .expect("the HTTP client must build (TLS provider available)")
}

/// rustls needs one process-wide crypto provider; ring is the lean one.
pub fn install_crypto_provider() {
    // Err means one is installed already: that one serves as well.
    drop(rustls::crypto::ring::default_provider().install_default());
}

fn parse_microversion(s: &str) -> (u32, u32) {
    let mut it = s.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    (it.next().unwrap_or(2), it.next().unwrap_or(1))
}

impl NovaClient {
    pub fn new(cfg: NovaConfig) -> Self {
        let https = match &cfg.endpoint {
            NovaEndpoint::Direct(u) => u.starts_with("https"),
            NovaEndpoint::Keystone(k) => k.auth_url.starts_with("https"),
        };
        let http = build_http_client(&cfg, https);
        let auth = match &cfg.endpoint {
            NovaEndpoint::Keystone(k) => Some(KeystoneAuth::new(http.clone(), k.clone())),
            NovaEndpoint::Direct(_) => None,
        };
        Self {
            slot_wait: None,
            slots: Arc::new(Semaphore::new(cfg.max_concurrent_per_host.max(1))),
            microversion: parse_microversion(&cfg.microversion),
            http,
            auth,
            cfg,
        }
    }

    /// Reports every slot wait (the per-host cap's queue) to `observer`.
    pub fn with_slot_wait_observer(mut self, observer: SlotWaitObserver) -> Self {
        self.slot_wait = Some(observer);
        self
    }

    pub fn config(&self) -> &NovaConfig {
        &self.cfg
    }

    pub fn http_client(&self) -> &reqwest::Client {
        &self.http
    }

    pub fn auth(&self) -> Option<&Arc<KeystoneAuth>> {
        self.auth.as_ref()
    }

    /// Requests waiting for or holding a slot right now.
    pub fn slots_in_use(&self) -> usize {
        self.cfg.max_concurrent_per_host.max(1) - self.slots.available_permits()
    }

    pub fn answers_async(&self) -> bool {
        self.microversion >= (2, 101)
    }

    /// `POST /servers/{id}/os-volume_attachments` under a fresh request id.
    pub async fn attach(
        &self,
        server_id: Uuid,
        volume_id: Uuid,
        params: &RequestParams,
        deadline: Instant,
    ) -> Result<AttachAnswer, NovaError> {
        self.attach_as(&RequestId::fresh(), server_id, volume_id, params, deadline)
            .await
            .map(|a| a.value)
    }

    /// `POST /servers/{id}/os-volume_attachments` under `rid`.
    pub async fn attach_as(
        &self,
        rid: &RequestId,
        server_id: Uuid,
        volume_id: Uuid,
        params: &RequestParams,
        deadline: Instant,
    ) -> Result<Answered<AttachAnswer>, NovaError> {
        let body = AttachBody {
            volume_attachment: AttachSpec {
                volume_id: volume_id.to_string(),
                device: params.device.clone(),
                tag: if self.microversion >= (2, 49) {
                    params.tag.clone()
                } else {
                    None
                },
                delete_on_termination: if self.microversion >= (2, 79) {
                    params.delete_on_termination
                } else {
                    None
                },
            },
        };
        let path = format!("/servers/{server_id}/os-volume_attachments");
        let started = Instant::now();
        let (url, raw) = self
            .execute(rid, Method::POST, &path, Some(&body), deadline)
            .await?;
        let value = match raw.status {
            200 => serde_json::from_slice::<AttachmentEnvelope>(&raw.body)
                .map(|e| AttachAnswer::Attached(e.volume_attachment))
                .map_err(|e| self.decode_error("POST", url, &raw, started, deadline, e))?,
            202 => AttachAnswer::Accepted,
            _ => return Err(self.rejection("POST", url, &raw, started, deadline)),
        };
        Ok(raw.answered(value))
    }

    /// `GET /servers/{id}/os-volume_attachments`: one request, no `limit`
    /// (Nova's offset pagination over block-device rows is unreliable).
    pub async fn list(
        &self,
        server_id: Uuid,
        deadline: Instant,
    ) -> Result<Vec<NovaAttachment>, NovaError> {
        self.list_as(&RequestId::fresh(), server_id, deadline)
            .await
            .map(|a| a.value)
    }

    pub async fn list_as(
        &self,
        rid: &RequestId,
        server_id: Uuid,
        deadline: Instant,
    ) -> Result<Answered<Vec<NovaAttachment>>, NovaError> {
        let path = format!("/servers/{server_id}/os-volume_attachments");
        let started = Instant::now();
        let (url, raw) = self
            .execute::<()>(rid, Method::GET, &path, None, deadline)
            .await?;
        match raw.status {
            200 => serde_json::from_slice::<AttachmentList>(&raw.body)
                .map(|l| raw.answered(l.volume_attachments))
                .map_err(|e| self.decode_error("GET", url, &raw, started, deadline, e)),
            _ => Err(self.rejection("GET", url, &raw, started, deadline)),
        }
    }

    /// `GET /servers/{id}/os-volume_attachments/{volume_id}`.
    pub async fn show(
        &self,
        server_id: Uuid,
        volume_id: Uuid,
        deadline: Instant,
    ) -> Result<NovaAttachment, NovaError> {
        let path = format!("/servers/{server_id}/os-volume_attachments/{volume_id}");
        let started = Instant::now();
        let (url, raw) = self
            .execute::<()>(&RequestId::fresh(), Method::GET, &path, None, deadline)
            .await?;
        match raw.status {
            200 => serde_json::from_slice::<AttachmentEnvelope>(&raw.body)
                .map(|e| e.volume_attachment)
                .map_err(|e| self.decode_error("GET", url, &raw, started, deadline, e)),
            _ => Err(self.rejection("GET", url, &raw, started, deadline)),
        }
    }

    /// `DELETE /servers/{id}/os-volume_attachments/{volume_id}`: 202 means
    /// accepted; the list tells when it is done.
    pub async fn detach(
        &self,
        server_id: Uuid,
        volume_id: Uuid,
        deadline: Instant,
    ) -> Result<(), NovaError> {
        self.detach_as(&RequestId::fresh(), server_id, volume_id, deadline)
            .await
            .map(|a| a.value)
    }

    pub async fn detach_as(
        &self,
        rid: &RequestId,
        server_id: Uuid,
        volume_id: Uuid,
        deadline: Instant,
    ) -> Result<Answered<()>, NovaError> {
        let path = format!("/servers/{server_id}/os-volume_attachments/{volume_id}");
        let started = Instant::now();
        let (url, raw) = self
            .execute::<()>(rid, Method::DELETE, &path, None, deadline)
            .await?;
        match raw.status {
            202 | 204 | 200 => Ok(raw.answered(())),
            _ => Err(self.rejection("DELETE", url, &raw, started, deadline)),
        }
    }

    fn decode_error(
        &self,
        method: &'static str,
        url: String,
        raw: &RawResponse,
        started: Instant,
        deadline: Instant,
        e: serde_json::Error,
    ) -> NovaError {
        NovaError {
            kind: NovaErrorKind::Undecodable,
            stage: Stage::Decode,
            method,
            url,
            status: Some(raw.status),
            nova_request_id: raw.nova_request_id.clone(),
            nova_fault: None,
            nova_message: None,
            elapsed: started.elapsed(),
            budget: deadline.saturating_duration_since(started),
            may_have_reached_nova: true,
            cause: format!("the body does not match the contract: {e}"),
        }
    }

    fn rejection(
        &self,
        method: &'static str,
        url: String,
        raw: &RawResponse,
        started: Instant,
        deadline: Instant,
    ) -> NovaError {
        let status = raw.status;
        let fault = parse_fault(&raw.body);
        let rejection = classify(status, &fault);
        NovaError {
            may_have_reached_nova: !matches!(rejection, Rejection::Unauthorized),
            kind: NovaErrorKind::Rejected(rejection),
            stage: Stage::ReadBody,
            method,
            url,
            status: Some(status),
            nova_request_id: raw.nova_request_id.clone(),
            cause: format!("HTTP {status}"),
            nova_fault: fault.name,
            nova_message: fault.message,
            elapsed: started.elapsed(),
            budget: deadline.saturating_duration_since(started),
        }
    }

    async fn base_and_token(&self, deadline: Instant) -> Result<(String, Option<Secret>), String> {
        match (&self.cfg.endpoint, &self.auth) {
            (NovaEndpoint::Direct(url), _) => Ok((url.trim_end_matches('/').to_string(), None)),
            (NovaEndpoint::Keystone(_), Some(auth)) => {
                let t = auth.token(deadline).await?;
                Ok((t.compute_url.clone(), Some(t.id)))
            }
            (NovaEndpoint::Keystone(_), None) => {
                Err("Keystone endpoint without an authenticator".into())
            }
        }
    }

    /// Sends one request under `deadline`, reading the whole body under the
    /// same deadline. A 401 from the auth middleware (the request never
    /// reached Nova) re-authenticates and replays once.
    async fn execute<B: serde::Serialize>(
        &self,
        rid: &RequestId,
        method: Method,
        path: &str,
        body: Option<&B>,
        deadline: Instant,
    ) -> Result<(String, RawResponse), NovaError> {
        let call = Call {
            method: method_name(&method),
            started: Instant::now(),
            deadline,
        };
        // The wait for a slot counts against the request's deadline.
        let _permit =
            match tokio::time::timeout_at(deadline, self.slots.clone().acquire_owned()).await {
                Ok(Ok(p)) => p,
                Ok(Err(_)) => {
                    return Err(call.error(
                        NovaErrorKind::ConnectFailed,
                        Stage::AcquireSlot,
                        path,
                        false,
                        "the client is shutting down".into(),
                    ));
                }
                Err(_) => {
                    return Err(call.error(
                        NovaErrorKind::DeadlineExceeded,
                        Stage::AcquireSlot,
                        path,
                        false,
                        format!(
                            "all {} connection slots stayed busy",
                            self.cfg.max_concurrent_per_host
                        ),
                    ));
                }
            };
        if let Some(observe) = &self.slot_wait {
            observe(call.started.elapsed());
        }
        // Only the slot wait is inline: a request queued behind the cap keeps
        // a small future; the send's state is allocated once it may run.
        Box::pin(self.send_with_replay(&call, rid, method, path, body)).await
    }

    async fn send_with_replay<B: serde::Serialize>(
        &self,
        call: &Call,
        rid: &RequestId,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<(String, RawResponse), NovaError> {
        let mut replayed = false;
        loop {
            let (base, token) = match self.base_and_token(call.deadline).await {
                Ok(x) => x,
                Err(cause) => {
                    let kind = if Instant::now() >= call.deadline {
                        NovaErrorKind::DeadlineExceeded
                    } else {
                        NovaErrorKind::AuthFailed
                    };
                    return Err(call.error(kind, Stage::Authenticate, path, false, cause));
                }
            };
            let url = format!("{base}{path}");
            let mut req = self
                .http
                .request(method.clone(), &url)
                .header("X-OpenStack-Nova-API-Version", &self.cfg.microversion)
                .header(
                    "OpenStack-API-Version",
                    format!("compute {}", self.cfg.microversion),
                )
                .header("Accept", "application/json")
                .header("X-OpenStack-Request-ID", rid.as_str());
            if let Some(t) = &token {
                req = req.header("X-Auth-Token", t.expose());
            }
            if let Some(b) = body {
                req = req.json(b);
            }
            let raw = call.send(req, &url).await?;
            if raw.status == 401
                && !replayed
                && let (Some(auth), Some(t)) = (&self.auth, &token)
            {
                // keystonemiddleware refused the token: Nova never saw the
                // request, so replaying it once is safe even for a POST.
                tracing::info!(url = %url, "Nova answered 401; re-authenticating and replaying once");
                auth.invalidate(t);
                replayed = true;
                continue;
            }
            return Ok((url, raw));
        }
    }
}

fn method_name(method: &Method) -> &'static str {
    match *method {
        Method::POST => "POST",
        Method::GET => "GET",
        Method::DELETE => "DELETE",
        Method::PUT => "PUT",
        _ => "OTHER",
    }
}

impl RawResponse {
    fn answered<T>(&self, value: T) -> Answered<T> {
        Answered {
            value,
            nova_request_id: self.nova_request_id.clone(),
        }
    }
}

/// One request's clocks: every error it ends with says how long it ran of
/// the budget it had.
struct Call {
    method: &'static str,
    started: Instant,
    deadline: Instant,
}

impl Call {
    fn error(
        &self,
        kind: NovaErrorKind,
        stage: Stage,
        url: &str,
        may_have_reached_nova: bool,
        cause: String,
    ) -> NovaError {
        NovaError {
            kind,
            stage,
            method: self.method,
            url: url.to_string(),
            status: None,
            nova_request_id: None,
            nova_fault: None,
            nova_message: None,
            elapsed: self.started.elapsed(),
            budget: self.deadline.saturating_duration_since(self.started),
            may_have_reached_nova,
            cause,
        }
    }

    /// Sends and reads the whole answer, both under the deadline.
    async fn send(
        &self,
        req: reqwest::RequestBuilder,
        url: &str,
    ) -> Result<RawResponse, NovaError> {
        let resp = match tokio::time::timeout_at(self.deadline, req.send()).await {
            Err(_) => {
                return Err(self.error(
                    NovaErrorKind::DeadlineExceeded,
                    Stage::AwaitHeaders,
                    url,
                    true,
                    "no response headers before the outbound deadline".into(),
                ));
            }
            Ok(Err(e)) if e.is_connect() => {
                return Err(self.error(
                    NovaErrorKind::ConnectFailed,
                    Stage::Connect,
                    url,
                    false,
                    error_chain(&e),
                ));
            }
            Ok(Err(e)) => {
                return Err(self.error(
                    NovaErrorKind::ResponseLost,
                    Stage::AwaitHeaders,
                    url,
                    true,
                    error_chain(&e),
                ));
            }
            Ok(Ok(r)) => r,
        };
        let status = resp.status().as_u16();
        let nova_request_id = ["x-openstack-request-id", "x-compute-request-id"]
            .iter()
            .find_map(|h| resp.headers().get(*h)?.to_str().ok())
            .map(str::to_string);
        let (kind, cause) = match read_body(resp, self.deadline).await {
            Ok(body) => {
                return Ok(RawResponse {
                    status,
                    body,
                    nova_request_id,
                });
            }
            Err(BodyError::Deadline(got)) => (
                NovaErrorKind::DeadlineExceeded,
                format!("body still incomplete after {got} bytes at the outbound deadline"),
            ),
            Err(BodyError::Lost(got, cause)) => (
                NovaErrorKind::ResponseLost,
                format!("body cut off after {got} bytes: {cause}"),
            ),
        };
        let mut e = self.error(kind, Stage::ReadBody, url, true, cause);
        e.status = Some(status);
        e.nova_request_id = nova_request_id;
        Err(e)
    }
}

enum BodyError {
    Deadline(usize),
    Lost(usize, String),
}

async fn read_body(mut resp: reqwest::Response, deadline: Instant) -> Result<Bytes, BodyError> {
    let mut buf = Vec::new();
    loop {
        match tokio::time::timeout_at(deadline, resp.chunk()).await {
            Err(_) => return Err(BodyError::Deadline(buf.len())),
            Ok(Err(e)) => return Err(BodyError::Lost(buf.len(), error_chain(&e))),
            Ok(Ok(None)) => return Ok(Bytes::from(buf)),
            Ok(Ok(Some(chunk))) => buf.extend_from_slice(&chunk),
        }
    }
}
