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

/// The microversion the service asks for: an exact `2.N`, or `latest`,
/// which start-up resolves to the cloud's maximum (Nova's own `latest`
/// would change under the service at the cloud's next upgrade).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Microversion {
    Latest,
    Exact(u32, u32),
}

impl Microversion {
    /// What the service speaks unless told otherwise: 2.89 lists the
    /// Cinder attachment and BDM ids and still answers an attach with 200.
    pub const DEFAULT: Self = Self::Exact(2, 89);
}

impl std::str::FromStr for Microversion {
    type Err = String;

    /// `latest` or `2.N` (Nova's compute API microversions, N from 1).
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "latest" {
            return Ok(Self::Latest);
        }
        let number = |p: &str| {
            (!p.is_empty() && p.len() <= 4 && p.bytes().all(|b| b.is_ascii_digit()))
                .then(|| p.parse::<u32>().ok())
                .flatten()
        };
        match s.split_once('.').map(|(a, b)| (number(a), number(b))) {
            Some((Some(2), Some(minor))) if minor >= 1 => Ok(Self::Exact(2, minor)),
            _ => Err(format!(
                "{s:?} is not a Nova microversion: write 2.N (like 2.89) or latest"
            )),
        }
    }
}

impl std::fmt::Display for Microversion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Latest => f.write_str("latest"),
            Self::Exact(major, minor) => write!(f, "{major}.{minor}"),
        }
    }
}

/// The microversions a Nova supports, from its version document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VersionRange {
    pub min: (u32, u32),
    pub max: (u32, u32),
}

impl VersionRange {
    /// The version to speak when `wanted` is asked for: `latest` is the
    /// maximum; an exact version must lie in the range.
    pub fn choose(&self, wanted: Microversion) -> Result<(u32, u32), String> {
        match wanted {
            Microversion::Latest => Ok(self.max),
            Microversion::Exact(major, minor)
                if (major, minor) < self.min || (major, minor) > self.max =>
            {
                Err(format!(
                    "microversion {wanted} is outside what this Nova supports ({} to {})",
                    show(self.min),
                    show(self.max)
                ))
            }
            Microversion::Exact(major, minor) => Ok((major, minor)),
        }
    }
}

impl std::fmt::Display for VersionRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} to {}", show(self.min), show(self.max))
    }
}

fn show((major, minor): (u32, u32)) -> String {
    format!("{major}.{minor}")
}

/// How the HTTP client trusts TLS servers (Keystone's and Nova's).
#[derive(Debug, Clone, Default)]
pub struct TlsTrust {
    /// Trust only these CAs (`cacert`, `OS_CACERT`), as openstacksdk
    /// does; none: the system's roots.
    pub ca: Option<CaBundle>,
    /// `verify: false` / `OS_INSECURE`: accept any certificate.
    pub insecure: bool,
}

/// CA certificates read from a PEM file, each checked to be a certificate
/// a TLS client can trust: made only by `from_file`, so building the HTTP
/// client with it cannot fail.
#[derive(Debug, Clone)]
pub struct CaBundle {
    pub path: std::path::PathBuf,
    certs: Vec<reqwest::Certificate>,
}

impl CaBundle {
    pub fn from_file(path: &std::path::Path) -> Result<Self, String> {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject as _;
        let pem =
            std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let mut roots = rustls::RootCertStore::empty();
        let mut certs = Vec::new();
        for der in CertificateDer::pem_slice_iter(&pem) {
            let der = der.map_err(|e| format!("{}: not PEM: {e}", path.display()))?;
            roots.add(der.clone()).map_err(|e| {
                format!(
                    "{}: a certificate is not usable as a CA: {e}",
                    path.display()
                )
            })?;
            certs.push(
                reqwest::Certificate::from_der(&der)
                    .map_err(|e| format!("{}: {e}", path.display()))?,
            );
        }
        if certs.is_empty() {
            return Err(format!("{} holds no PEM certificate", path.display()));
        }
        Ok(Self {
            path: path.to_path_buf(),
            certs,
        })
    }
}

#[derive(Debug, Clone)]
pub struct NovaConfig {
    pub endpoint: NovaEndpoint,
    /// `X-OpenStack-Nova-API-Version` asked for (`latest` is resolved at
    /// start; see `NovaClient::adopt`).
    pub microversion: Microversion,
    /// Trust for TLS connections to Keystone and Nova.
    pub tls: TlsTrust,
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
            microversion: Microversion::DEFAULT,
            tls: TlsTrust::default(),
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

/// Told, after each request, whether Nova answered (`true`: any HTTP
/// answer) or could not be connected to (`false`).
pub type ReachabilityObserver = Arc<dyn Fn(bool) + Send + Sync>;

pub struct NovaClient {
    slot_wait: Option<SlotWaitObserver>,
    reachability: Option<ReachabilityObserver>,
    http: reqwest::Client,
    cfg: NovaConfig,
    auth: Option<Arc<KeystoneAuth>>,
    slots: Arc<Semaphore>,
    /// The microversion spoken: the configured one, or the cloud's maximum
    /// once `latest` is resolved (until then, the newest behaviour is
    /// assumed and `latest` is sent).
    microversion: (u32, u32),
    /// The header value: `2.N`, or `latest` while unresolved.
    microversion_header: String,
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
    let mut builder = reqwest::Client::builder()
        .connect_timeout(connect)
        .pool_max_idle_per_host(cfg.max_concurrent_per_host)
        .tcp_nodelay(true)
        .user_agent(concat!("volume-reconciler/", env!("CARGO_PKG_VERSION")));
    if let Some(ca) = &cfg.tls.ca {
        builder = builder.tls_certs_only(ca.certs.iter().cloned());
    }
    if cfg.tls.insecure {
        builder = builder.danger_accept_invalid_certs(true);
    }
    builder
        .build()
        // Building fails only when the TLS backend cannot initialize (a
        // broken installation, not a runtime condition) or a CA is unusable,
        // which `CaBundle::from_file` rules out.
        .expect("the HTTP client must build (TLS provider available)")
}

/// rustls needs one process-wide crypto provider; ring is the lean one.
pub fn install_crypto_provider() {
    // Err means one is installed already: that one serves as well.
    drop(rustls::crypto::ring::default_provider().install_default());
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
        let (microversion, microversion_header) = match cfg.microversion {
            Microversion::Exact(major, minor) => ((major, minor), format!("{major}.{minor}")),
            Microversion::Latest => ((2, u32::MAX), "latest".to_string()),
        };
        Self {
            slot_wait: None,
            reachability: None,
            slots: Arc::new(Semaphore::new(cfg.max_concurrent_per_host.max(1))),
            microversion,
            microversion_header,
            http,
            auth,
            cfg,
        }
    }

    /// Reports whether each request reached Nova to `observer`.
    pub fn with_reachability_observer(mut self, observer: ReachabilityObserver) -> Self {
        self.reachability = Some(observer);
        self
    }

    /// The microversion spoken (`latest` until `adopt` resolved it).
    pub fn microversion(&self) -> String {
        self.microversion_header.clone()
    }

    /// Speaks what `range` allows of the configured microversion: `latest`
    /// becomes the cloud's maximum; an exact version outside the range is
    /// an error (Nova would answer every request 406).
    pub fn adopt(&mut self, range: VersionRange) -> Result<(), String> {
        let (major, minor) = range.choose(self.cfg.microversion)?;
        self.microversion = (major, minor);
        self.microversion_header = format!("{major}.{minor}");
        Ok(())
    }

    /// Nova's version document (`GET /` of the compute endpoint's root; in
    /// Keystone mode the catalog names the endpoint, so this authenticates
    /// first): the microversions it supports. One request, under
    /// `deadline`.
    pub async fn discover(&self, deadline: Instant) -> Result<(String, VersionRange), NovaError> {
        let call = Call {
            method: "GET",
            started: Instant::now(),
            deadline,
        };
        let (base, _) = self.base_and_token(deadline).await.map_err(|cause| {
            let kind = if Instant::now() >= deadline {
                NovaErrorKind::DeadlineExceeded
            } else {
                NovaErrorKind::AuthFailed
            };
            call.error(kind, Stage::Authenticate, "/", false, cause)
        })?;
        let url = version_root(&base);
        let req = self
            .http
            .get(&url)
            .header("Accept", "application/json")
            .header("X-OpenStack-Request-ID", RequestId::fresh().as_str());
        let raw = call.send(req, &url).await;
        self.observe_reachability(&raw);
        let raw = raw?;
        if !(200..300).contains(&raw.status) && raw.status != 300 {
            return Err(self.rejection("GET", url, &raw, call.started, deadline));
        }
        parse_versions(&raw.body)
            .map(|range| (url.clone(), range))
            .map_err(|cause| {
                let mut e =
                    call.error(NovaErrorKind::Undecodable, Stage::Decode, &url, true, cause);
                e.status = Some(raw.status);
                e
            })
    }

    fn observe_reachability<T>(&self, result: &Result<T, NovaError>) {
        let Some(observe) = &self.reachability else {
            return;
        };
        match result {
            Ok(_) => observe(true),
            Err(e) if e.kind == NovaErrorKind::ConnectFailed => observe(false),
            // Sent and then lost or timed out: says nothing sure either way.
            Err(_) => {}
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
                .header("X-OpenStack-Nova-API-Version", &self.microversion_header)
                .header(
                    "OpenStack-API-Version",
                    format!("compute {}", self.microversion_header),
                )
                .header("Accept", "application/json")
                .header("X-OpenStack-Request-ID", rid.as_str());
            if let Some(t) = &token {
                req = req.header("X-Auth-Token", t.expose());
            }
            if let Some(b) = body {
                req = req.json(b);
            }
            let raw = call.send(req, &url).await;
            self.observe_reachability(&raw);
            let raw = raw?;
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

/// Where Nova's version document is: the compute endpoint's root, the
/// URL up to its version segment (`http://h:8774/v2.1/<project>` →
/// `http://h:8774/`, `https://cloud/compute/v2.1` → `https://cloud/compute/`).
fn version_root(compute: &str) -> String {
    // Not a URL: the request to it fails and says so, naming it.
    let Ok(mut url) = reqwest::Url::parse(compute) else {
        return compute.to_string();
    };
    let is_version = |seg: &str| {
        seg.strip_prefix('v').is_some_and(|v| {
            !v.is_empty()
                && v.split('.')
                    .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        })
    };
    // No segments only for URLs that cannot be a base (not http).
    let segments: Vec<String> = url
        .path_segments()
        .map(|s| s.map(str::to_string).collect())
        .unwrap_or_default();
    let keep = segments
        .iter()
        .position(|s| is_version(s))
        .unwrap_or(segments.len());
    let mut path = segments[..keep]
        .iter()
        .filter(|s| !s.is_empty())
        .map(|s| format!("/{s}"))
        .collect::<String>();
    path.push('/');
    url.set_path(&path);
    url.set_query(None);
    url.to_string()
}

#[derive(serde::Deserialize)]
struct VersionsDoc {
    #[serde(default)]
    versions: Vec<VersionEntry>,
    version: Option<VersionEntry>,
}

#[derive(serde::Deserialize)]
struct VersionEntry {
    id: String,
    #[serde(default)]
    version: String,
    #[serde(default)]
    min_version: String,
}

/// The v2.1 API's range from a version document: the root's list
/// (`{"versions": [...]}`) or one version (`{"version": {...}}`). An API
/// without microversions (empty `version`) supports only 2.1.
fn parse_versions(body: &[u8]) -> Result<VersionRange, String> {
    let doc: VersionsDoc = serde_json::from_slice(body)
        .map_err(|e| format!("the version document is not what Nova answers: {e}"))?;
    let entry = doc
        .versions
        .iter()
        .chain(doc.version.as_ref())
        .find(|v| v.id == "v2.1")
        .ok_or("the version document has no v2.1 API")?;
    let parse = |s: &str, what: &str| match s.parse::<Microversion>() {
        Ok(Microversion::Exact(major, minor)) => Ok((major, minor)),
        _ => Err(format!(
            "the version document's {what} {s:?} is not a microversion"
        )),
    };
    if entry.version.is_empty() {
        return Ok(VersionRange {
            min: (2, 1),
            max: (2, 1),
        });
    }
    let max = parse(&entry.version, "version")?;
    let min = if entry.min_version.is_empty() {
        (2, 1)
    } else {
        parse(&entry.min_version, "min_version")?
    };
    Ok(VersionRange { min, max })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn microversions_are_2_n_or_latest() {
        assert_eq!("2.89".parse(), Ok(Microversion::Exact(2, 89)));
        assert_eq!("2.1".parse(), Ok(Microversion::Exact(2, 1)));
        assert_eq!("latest".parse(), Ok(Microversion::Latest));
        for bad in [
            "banana", "", "2", "2.", ".5", "2.0", "3.1", "2.x", "+2.5", "2.5.1", " 2.5", "Latest",
        ] {
            let e = bad.parse::<Microversion>().unwrap_err();
            assert!(e.contains("2.N"), "{bad}: {e}");
        }
        assert_eq!(Microversion::DEFAULT.to_string(), "2.89");
        assert_eq!(Microversion::Latest.to_string(), "latest");
    }

    #[test]
    fn the_version_document_is_read_from_the_contract_samples() {
        let root = include_bytes!("../../tests/fixtures/nova/versions/versions-get-resp.json");
        let range = parse_versions(root).unwrap();
        assert_eq!(
            range,
            VersionRange {
                min: (2, 1),
                max: (2, 104)
            }
        );
        let one = include_bytes!("../../tests/fixtures/nova/versions/v21-version-get-resp.json");
        assert_eq!(parse_versions(one).unwrap(), range);
        assert_eq!(range.choose(Microversion::Latest), Ok((2, 104)));
        assert_eq!(range.choose(Microversion::Exact(2, 89)), Ok((2, 89)));
        let e = range.choose(Microversion::Exact(2, 105)).unwrap_err();
        assert!(e.contains("2.1 to 2.104"), "{e}");
        assert!(parse_versions(b"{\"versions\": []}").is_err());
        assert!(parse_versions(b"<html>").is_err());
    }

    #[test]
    fn the_version_root_is_the_endpoint_up_to_its_version() {
        for (endpoint, root) in [
            ("http://127.0.0.1:8774/v2.1", "http://127.0.0.1:8774/"),
            (
                "http://h:8774/v2.1/a6944d763bf64ee6a275f1263fae0352",
                "http://h:8774/",
            ),
            (
                "https://cloud.example/compute/v2.1",
                "https://cloud.example/compute/",
            ),
            (
                "https://cloud.example/compute/v2/abc",
                "https://cloud.example/compute/",
            ),
            ("http://h:8774", "http://h:8774/"),
        ] {
            assert_eq!(version_root(endpoint), root, "{endpoint}");
        }
    }
}
