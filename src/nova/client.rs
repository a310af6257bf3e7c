//! The Nova client, and the OpenStack adapter's front: it owns the Cinder
//! client too (they share Keystone and the connection pool), and says how
//! an attach or detach is confirmed ([`NovaClient::confirmation`]).
//!
//! Each request takes its deadline as an argument; no transport constant
//! can end a request earlier. Connection setup (TCP connect, TLS handshake)
//! keeps its own short bounds because it is not the server's working time.
//! One connection pool per endpoint, shared by all requests, with a cap on
//! concurrent requests per host whose wait counts against the request's
//! deadline (`http.rs` holds this machinery for both services).
//!
//! Why it is long: it is the whole of Nova's API the service uses (attach,
//! detach, list, version discovery, confirmation choice); the HTTP machinery,
//! Cinder and Keystone are in files of their own.

// As in `answer.rs`: `NovaError` is what every call of the client returns
// as it is; the judging closures and `Sent::judge` are those results one step
// earlier, made once per answer. Boxing them here alone would only add an
// allocation and a conversion.
#![allow(clippy::result_large_err)]

use std::sync::Arc;
use std::time::Duration;

use reqwest::Method;
use tokio::time::Instant;
use uuid::Uuid;

use super::answer::{AttachAnswer, AttachShape, Exchange, gone_if_shown_gone};
use super::auth::{KeystoneAuth, KeystoneConfig};
use super::cinder::CinderClient;
use super::error::{CinderError, NovaError, NovaErrorKind, Rejection};
pub use super::gate::{Open, SendGate};
use super::http::{Base, CatalogService, Failure, FailureKind, RawResponse, Service};
use super::types::{AttachBody, AttachSpec, NovaAttachment};
use super::version::{parse_versions, version_root};
use crate::domain::RequestParams;

pub use super::http::{CaBundle, RequestId, SlotWaitObserver, TlsTrust};
pub use super::version::{Microversion, VersionRange};

/// Where Nova is.
#[derive(Debug, Clone)]
pub enum NovaEndpoint {
    /// `--nova-url`: no Keystone (tests, the simulator, a trusted proxy).
    Direct(String),
    /// The compute endpoint comes from the Keystone catalog.
    Keystone(KeystoneConfig),
}

/// How the executor confirms that an attach or detach took effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfirmWith {
    /// Cinder's view of the volume, as cinder-csi does: attached means
    /// listed in the volume's attachments (attach_status `attached`);
    /// detached means no longer listed.
    Cinder,
    /// Nova's attachment list: a block-device mapping exists from the
    /// reservation on (below 2.101, before the 200), so it shows an attach
    /// that may still fail in the hypervisor and be rolled back.
    NovaList,
}

impl ConfirmWith {
    pub fn as_str(self) -> &'static str {
        match self {
            ConfirmWith::Cinder => "cinder",
            ConfirmWith::NovaList => "nova-list",
        }
    }
}

#[derive(Debug, Clone)]
pub struct NovaConfig {
    pub endpoint: NovaEndpoint,
    /// `X-OpenStack-Nova-API-Version` asked for (`latest` is resolved at
    /// start; see `NovaClient::adopt`).
    pub microversion: Microversion,
    /// Trust for TLS connections to Keystone, Nova and Cinder.
    pub tls: TlsTrust,
    pub max_concurrent_per_host: usize,
    /// Bound of a TCP connect (connection setup only).
    pub connect_timeout: Duration,
    /// Bound of a TLS handshake (connection setup only).
    pub tls_handshake_timeout: Duration,
    /// `--cinder-url`: Cinder's v3 endpoint with the project id (e.g.
    /// `http://host:8776/v3/<project_id>`), instead of the catalog's.
    pub cinder_url: Option<String>,
    /// `OpenStack-API-Version: volume <this>` on every Cinder request.
    pub cinder_microversion: String,
    /// `--confirm-with`; `None`: Cinder when it can be found (`--cinder-url`
    /// or a block-storage endpoint in the catalog), else Nova's list.
    pub confirm_with: Option<ConfirmWith>,
}

impl NovaConfig {
    /// Cinder's microversion by default: 3.27, the version of the
    /// attachments API (the attach flow Nova has used since Queens, in
    /// which a volume is `reserved`, then `attaching`, then `in-use`). The
    /// fields read (`status`, `attachments`, `multiattach`) are the same in
    /// every 3.x; pinning the lowest version with that flow works on every
    /// cloud that has it and keeps the answer's shape fixed across cloud
    /// upgrades. A cloud too old for it answers 406, which names the range
    /// it serves.
    pub const DEFAULT_CINDER_MICROVERSION: &'static str = "3.27";
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
            cinder_url: None,
            cinder_microversion: Self::DEFAULT_CINDER_MICROVERSION.into(),
            confirm_with: None,
        }
    }
}

/// Builds the shared HTTP client. Deliberately no `timeout`, no
/// `read_timeout`: the only bound of a request is its deadline. The connect
/// bound covers TCP (and TLS for https) and nothing after it.
///
/// Redirects are not followed. Nova, Cinder and Keystone answer their APIs
/// without them; a redirect comes from something in front (a proxy, an
/// `http` URL rewritten to `https`), and following it would send the
/// token (`X-Auth-Token`, which reqwest does not strip across hosts) or
/// Keystone's credentials wherever it points, and turn a POST into a GET
/// on 301, 302 and 303. A 3xx is an answer that is not the service's:
/// its error names where it pointed.
pub fn build_http_client(cfg: &NovaConfig, https: bool) -> reqwest::Client {
    let connect = if https {
        cfg.connect_timeout + cfg.tls_handshake_timeout
    } else {
        cfg.connect_timeout
    };
    crate::tls::install_crypto_provider();
    let mut builder = reqwest::Client::builder()
        .connect_timeout(connect)
        .pool_max_idle_per_host(cfg.max_concurrent_per_host)
        .tcp_nodelay(true)
        .redirect(reqwest::redirect::Policy::none())
        // A request's gate is asked again once a connection made for it
        // is ready, just before the request is written.
        .connector_layer(super::gate::GateLayer)
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

const NO_CINDER_DIRECT: &str = "no Cinder endpoint (--cinder-url in direct mode): attaches and detaches are confirmed with Nova's attachment list, which shows a reservation, not a usable attachment";
const NO_CINDER_CATALOG: &str = "the Keystone catalog has no block-storage (or volumev3) endpoint: attaches and detaches are confirmed with Nova's attachment list, which shows a reservation, not a usable attachment";

/// How to confirm an attach or detach now, and with which client.
pub enum Confirmation<'a> {
    Cinder(&'a CinderClient),
    NovaList,
}

impl std::fmt::Debug for Confirmation<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.with().as_str())
    }
}

impl Confirmation<'_> {
    pub fn with(&self) -> ConfirmWith {
        match self {
            Confirmation::Cinder(_) => ConfirmWith::Cinder,
            Confirmation::NovaList => ConfirmWith::NovaList,
        }
    }
}

/// A value Nova answered with, and the local request id it answered under.
#[derive(Debug, Clone)]
pub struct Answered<T> {
    pub value: T,
    pub nova_request_id: Option<String>,
}

/// What one request says of Nova's reachability.
pub enum Reached<'a> {
    /// Nova itself answered: any HTTP answer but a gateway's page (a 502,
    /// 503 or 504 without Nova's request id, `X-OpenStack-Request-ID`,
    /// which every answer of Nova's API carries).
    Answered,
    /// No answer from Nova: the connection failed, or a gateway in front
    /// of it answered in its place.
    Unreachable(&'a dyn std::fmt::Display),
    /// Sent, then lost or timed out: says nothing sure either way.
    Failed,
}

/// Told, after each request, what it says of Nova's reachability.
pub type ReachabilityObserver = Arc<dyn Fn(Reached<'_>) + Send + Sync>;

/// A gateway's page in Nova's place: a 502, 503 or 504 without Nova's
/// request id.
fn from_a_gateway(raw: &RawResponse) -> bool {
    matches!(raw.status, 502..=504) && raw.request_id.is_none()
}

pub struct NovaClient {
    http: reqwest::Client,
    cfg: NovaConfig,
    service: Service,
    cinder: Option<CinderClient>,
    reachability: Option<ReachabilityObserver>,
    /// The microversion spoken: the configured one, or the cloud's maximum
    /// once `latest` is resolved (until then, the newest behaviour is
    /// assumed and `latest` is sent).
    microversion: (u32, u32),
    /// The header value: `2.N`, or `latest` while unresolved.
    microversion_header: String,
}

/// The headers that ask Nova for `version`.
fn microversion_headers(version: &str) -> Vec<(&'static str, String)> {
    vec![
        ("X-OpenStack-Nova-API-Version", version.to_string()),
        ("OpenStack-API-Version", format!("compute {version}")),
    ]
}

impl NovaClient {
    pub fn new(cfg: NovaConfig) -> Self {
        let https = match &cfg.endpoint {
            NovaEndpoint::Direct(u) => u.starts_with("https"),
            NovaEndpoint::Keystone(k) => k.auth_url.starts_with("https"),
        } || cfg
            .cinder_url
            .as_deref()
            .is_some_and(|u| u.starts_with("https"));
        let http = build_http_client(&cfg, https);
        let (auth, base) = match &cfg.endpoint {
            NovaEndpoint::Keystone(k) => (
                Some(KeystoneAuth::new(http.clone(), k.clone())),
                Base::Catalog(CatalogService::Compute),
            ),
            NovaEndpoint::Direct(url) => (None, Base::Direct(url.clone())),
        };
        let (microversion, microversion_header) = match cfg.microversion {
            Microversion::Exact(major, minor) => ((major, minor), format!("{major}.{minor}")),
            Microversion::Latest => ((2, u32::MAX), "latest".to_string()),
        };
        let service = Service::new(
            http.clone(),
            auth.clone(),
            base,
            microversion_headers(&microversion_header),
            cfg.max_concurrent_per_host,
        );
        // Cinder is reachable when given directly, or in Keystone mode
        // (whether the catalog has it is known once a token is); never when
        // confirmation by Nova's list was chosen.
        let cinder_base = match (&cfg.cinder_url, &auth) {
            _ if cfg.confirm_with == Some(ConfirmWith::NovaList) => None,
            (Some(url), _) => Some(Base::Direct(url.clone())),
            (None, Some(_)) => Some(Base::Catalog(CatalogService::BlockStorage)),
            (None, None) => None,
        };
        let cinder = cinder_base.map(|base| {
            CinderClient::new(Service::new(
                http.clone(),
                auth.clone(),
                base,
                vec![(
                    "OpenStack-API-Version",
                    format!("volume {}", cfg.cinder_microversion),
                )],
                cfg.max_concurrent_per_host,
            ))
        });
        Self {
            microversion,
            microversion_header,
            reachability: None,
            http,
            service,
            cinder,
            cfg,
        }
    }

    /// Reports whether each Nova request reached Nova to `observer`.
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
        self.service
            .set_headers(microversion_headers(&self.microversion_header));
        Ok(())
    }

    /// Nova's version document (`GET /` of the compute endpoint's root; in
    /// Keystone mode the catalog names the endpoint, so this authenticates
    /// first): the microversions it supports. One request, under
    /// `deadline`.
    pub async fn discover(&self, deadline: Instant) -> Result<(String, VersionRange), NovaError> {
        let started = Instant::now();
        let sent = self
            .service
            .get_at(RequestId::fresh().as_str(), version_root, deadline)
            .await
            .map_err(NovaError::from);
        self.observe_reachability(&sent);
        let (url, raw) = sent?;
        let answer = exchange("GET", url, &raw, started, deadline);
        if !(200..300).contains(&raw.status) && raw.status != 300 {
            return Err(answer.refusal());
        }
        match parse_versions(&raw.body) {
            Ok(range) => Ok((answer.url, range)),
            Err(cause) => Err(answer.undecodable(cause)),
        }
    }

    fn observe_reachability(&self, result: &Result<(String, RawResponse), NovaError>) {
        let Some(observe) = &self.reachability else {
            return;
        };
        match result {
            Ok((url, raw)) if from_a_gateway(raw) => observe(Reached::Unreachable(&format_args!(
                "{url} answered {} without Nova's request id (a gateway's page)",
                raw.status
            ))),
            Ok(_) => observe(Reached::Answered),
            Err(e) if e.kind == NovaErrorKind::ConnectFailed => observe(Reached::Unreachable(e)),
            // Keystone's failure says nothing of Nova.
            Err(e) if e.kind == NovaErrorKind::AuthFailed => {}
            Err(_) => observe(Reached::Failed),
        }
    }

    /// Nova's version document, fetched to learn whether Nova answers
    /// (the reachability probe): `Ok(true)` for any answer of Nova's own;
    /// `Ok(false)` when it could not be asked (no Keystone token: that
    /// says nothing of Nova); else what stood in the way (a timeout
    /// included: the probe is ours, and a GET of the version document has
    /// no effect to be unsure of).
    pub async fn probe(&self, deadline: Instant) -> Result<bool, String> {
        let sent = self
            .service
            .get_at(RequestId::fresh().as_str(), version_root, deadline)
            .await
            .map_err(NovaError::from);
        match &sent {
            Ok((url, raw)) if from_a_gateway(raw) => Err(format!(
                "{url} answered {} without Nova's request id (a gateway's page)",
                raw.status
            )),
            Ok(_) => Ok(true),
            Err(e) if e.kind == NovaErrorKind::AuthFailed => {
                tracing::debug!(error = %e, "Nova's probe: no Keystone token to ask with");
                Ok(false)
            }
            Err(e) => Err(e.to_string()),
        }
    }

    /// Reports every slot wait (the per-host cap's queue) of Nova requests
    /// to `observer`.
    pub fn with_slot_wait_observer(mut self, observer: SlotWaitObserver) -> Self {
        self.service.set_slot_wait_observer(observer);
        self
    }

    /// The Cinder client: `None` when Cinder cannot be reached (direct mode
    /// without `--cinder-url`) or is not wanted (`--confirm-with
    /// nova-list`). Whether a catalog has Cinder is for
    /// [`Self::confirmation`] to find out.
    pub fn cinder(&self) -> Option<&CinderClient> {
        self.cinder.as_ref()
    }

    /// How to confirm an attach or detach now. Fixed by the configuration,
    /// except in Keystone mode without `--cinder-url` or `--confirm-with`:
    /// then Cinder when the token's catalog has a block-storage endpoint,
    /// else Nova's list. That needs a token (normally the cached one,
    /// waiting at most until `deadline` for a renewal); when none can be
    /// had, the error says why and nothing is guessed.
    pub async fn confirmation(&self, deadline: Instant) -> Result<Confirmation<'_>, CinderError> {
        let Some(cinder) = &self.cinder else {
            return Ok(Confirmation::NovaList);
        };
        if self.cfg.confirm_with.is_some() || self.cfg.cinder_url.is_some() {
            return Ok(Confirmation::Cinder(cinder));
        }
        match cinder.endpoint(deadline).await? {
            Some(_) => Ok(Confirmation::Cinder(cinder)),
            None => Ok(Confirmation::NovaList),
        }
    }

    /// Logs how attaches and detaches will be confirmed, once at startup: a
    /// warning when it is Nova's list because no Cinder can be found. In
    /// Keystone mode without a fixed choice the catalog decides, so a task
    /// fetches a token (on Keystone's own renewal clock) and reports then;
    /// a Keystone that is down delays the report, never the start.
    pub fn announce_confirmation(self: &Arc<Self>) {
        let fixed = self.cfg.confirm_with.is_some() || self.cfg.cinder_url.is_some();
        match (&self.cinder, self.cfg.confirm_with) {
            (None, Some(ConfirmWith::NovaList)) => tracing::info!(
                confirm_with = ConfirmWith::NovaList.as_str(),
                "attaches and detaches are confirmed with Nova's attachment list, as configured"
            ),
            (None, _) => tracing::warn!("{NO_CINDER_DIRECT}"),
            (Some(_), _) if fixed => tracing::info!(
                confirm_with = ConfirmWith::Cinder.as_str(),
                cinder_url = self.cfg.cinder_url.as_deref().unwrap_or("(catalog)"),
                "attaches and detaches are confirmed with Cinder, as configured"
            ),
            (Some(_), _) => {
                let me = self.clone();
                tokio::spawn(async move { me.announce_from_catalog().await });
            }
        }
    }

    async fn announce_from_catalog(&self) {
        let Some(cinder) = &self.cinder else { return };
        // A renewal always ends (its own clock bounds it); this waits for
        // one renewal's worth and a second more.
        let renewal = match &self.cfg.endpoint {
            NovaEndpoint::Keystone(k) => k.renewal_timeout,
            NovaEndpoint::Direct(_) => Duration::ZERO,
        };
        let deadline = Instant::now() + renewal + Duration::from_secs(1);
        match cinder.endpoint(deadline).await {
            Ok(Some(url)) => tracing::info!(
                cinder_url = %url,
                "attaches and detaches are confirmed with Cinder (block-storage endpoint from the catalog)"
            ),
            Ok(None) => tracing::warn!("{NO_CINDER_CATALOG}"),
            Err(e) => tracing::warn!(
                error = %e,
                "could not read the Keystone catalog yet; each operation will find out whether Cinder confirms it"
            ),
        }
    }

    pub fn config(&self) -> &NovaConfig {
        &self.cfg
    }

    pub fn http_client(&self) -> &reqwest::Client {
        &self.http
    }

    pub fn auth(&self) -> Option<&Arc<KeystoneAuth>> {
        self.service.auth()
    }

    /// Nova requests waiting for or holding a slot right now.
    pub fn slots_in_use(&self) -> usize {
        self.service.slots_in_use()
    }

    /// Each caller row's weight in Nova's request slots when contended
    /// (the caller table's `nova-share`, by row).
    pub fn set_shares(&self, weights: Vec<u32>) {
        self.service.set_shares(weights);
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
        self.attach_gated(rid, server_id, volume_id, params, deadline, &Open)
            .await
    }

    /// `attach_as`, leaving only when `gate` allows it (see [`SendGate`]).
    pub async fn attach_gated(
        &self,
        rid: &RequestId,
        server_id: Uuid,
        volume_id: Uuid,
        params: &RequestParams,
        deadline: Instant,
        gate: &dyn SendGate,
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
        self.send(rid, Verb::Post, &path, Some(&body), deadline, gate)
            .await?
            .judge(|answer| answer.attach(self.attach_shape(answer.raw), server_id, volume_id))
    }

    /// How Nova answers an attach it took: by the microversion spoken, or
    /// (`latest` not resolved yet) the one Nova says it answered with.
    fn attach_shape(&self, raw: &RawResponse) -> AttachShape {
        if self.microversion_header == "latest" {
            AttachShape::from_header(raw.api_version.as_deref())
        } else {
            AttachShape::at(self.microversion)
        }
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
        let listed = self
            .send::<()>(rid, Verb::Get, &path, None, deadline, &Open)
            .await?
            .judge(|answer| answer.list(server_id));
        match listed {
            // "The server is gone" decides operations (a detach done, an
            // attach failed): only when a look at the server agrees. The
            // look is boxed: it is the cold path, and every list waiting
            // behind the per-host cap would otherwise hold room for it.
            Err(e) if e.rejection() == Some(&Rejection::ServerNotFound) => {
                let look = Box::pin(self.server_exists_as(rid, server_id, deadline)).await;
                Err(gone_if_shown_gone(e, look.map(|a| a.value)))
            }
            listed => listed,
        }
    }

    /// `GET /servers/{id}`: whether the server exists (`false` only for
    /// Nova's own 404 naming it; anything else that is not the server is an
    /// error). The look that must agree before a detach's 404 "server not
    /// found" decides anything.
    pub async fn server_exists_as(
        &self,
        rid: &RequestId,
        server_id: Uuid,
        deadline: Instant,
    ) -> Result<Answered<bool>, NovaError> {
        let path = format!("/servers/{server_id}");
        self.send::<()>(rid, Verb::Get, &path, None, deadline, &Open)
            .await?
            .judge(|answer| answer.server(server_id))
    }

    /// `GET /servers/{id}/os-volume_attachments/{volume_id}`.
    pub async fn show(
        &self,
        server_id: Uuid,
        volume_id: Uuid,
        deadline: Instant,
    ) -> Result<NovaAttachment, NovaError> {
        let path = format!("/servers/{server_id}/os-volume_attachments/{volume_id}");
        self.send::<()>(&RequestId::fresh(), Verb::Get, &path, None, deadline, &Open)
            .await?
            .judge(|answer| answer.show(server_id, volume_id))
            .map(|a| a.value)
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
        self.detach_gated(rid, server_id, volume_id, deadline, &Open)
            .await
    }

    /// `detach_as`, leaving only when `gate` allows it (see [`SendGate`]).
    pub async fn detach_gated(
        &self,
        rid: &RequestId,
        server_id: Uuid,
        volume_id: Uuid,
        deadline: Instant,
        gate: &dyn SendGate,
    ) -> Result<Answered<()>, NovaError> {
        let path = format!("/servers/{server_id}/os-volume_attachments/{volume_id}");
        self.send::<()>(rid, Verb::Delete, &path, None, deadline, gate)
            .await?
            .judge(|answer| answer.detach(server_id, volume_id))
    }

    /// Sends one request under `deadline` (see `http::Service::execute`),
    /// telling the reachability observer whether Nova answered; what the
    /// answer means is for `Sent::judge`.
    async fn send<B: serde::Serialize>(
        &self,
        rid: &RequestId,
        verb: Verb,
        path: &str,
        body: Option<&B>,
        deadline: Instant,
        gate: &dyn SendGate,
    ) -> Result<Sent, NovaError> {
        let started = Instant::now();
        let sent = self
            .service
            .execute(rid.as_str(), verb.method(), path, body, deadline, gate)
            .await
            .map_err(NovaError::from);
        self.observe_reachability(&sent);
        let (url, raw) = sent?;
        Ok(Sent {
            method: verb.name(),
            url,
            raw,
            started,
            deadline,
        })
    }
}

/// The methods of Nova's API the client calls: one byte held by every
/// request waiting for a slot, where a `Method` and its name were more
/// (see `executor::size_probe`).
#[derive(Debug, Clone, Copy)]
enum Verb {
    Get,
    Post,
    Delete,
}

impl Verb {
    fn method(self) -> Method {
        match self {
            Verb::Get => Method::GET,
            Verb::Post => Method::POST,
            Verb::Delete => Method::DELETE,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Verb::Get => "GET",
            Verb::Post => "POST",
            Verb::Delete => "DELETE",
        }
    }
}

/// A whole answer to one request, to be judged.
struct Sent {
    method: &'static str,
    url: String,
    raw: RawResponse,
    started: Instant,
    deadline: Instant,
}

impl Sent {
    /// What the answer means, by `judge` (see `answer.rs`): the value,
    /// with the request id Nova answered under.
    fn judge<T>(
        self,
        judge: impl FnOnce(&Exchange<'_>) -> Result<T, NovaError>,
    ) -> Result<Answered<T>, NovaError> {
        let value = judge(&exchange(
            self.method,
            self.url,
            &self.raw,
            self.started,
            self.deadline,
        ))?;
        Ok(answered(&self.raw, value))
    }
}

/// An answer to judge (see `answer.rs`).
fn exchange<'a>(
    method: &'static str,
    url: String,
    raw: &'a RawResponse,
    started: Instant,
    deadline: Instant,
) -> Exchange<'a> {
    Exchange {
        method,
        url,
        raw,
        started,
        deadline,
    }
}

/// `value`, answered under `raw`'s request id.
fn answered<T>(raw: &RawResponse, value: T) -> Answered<T> {
    Answered {
        value,
        nova_request_id: raw.request_id.clone(),
    }
}

impl From<Failure> for NovaError {
    fn from(f: Failure) -> Self {
        f.map_kind(|kind| match kind {
            FailureKind::DeadlineExceeded => NovaErrorKind::DeadlineExceeded,
            FailureKind::ConnectFailed => NovaErrorKind::ConnectFailed,
            FailureKind::ResponseLost => NovaErrorKind::ResponseLost,
            // Nova's endpoint is required when the token is issued, so
            // a missing one is a failed authentication.
            FailureKind::AuthFailed | FailureKind::NoEndpoint => NovaErrorKind::AuthFailed,
            FailureKind::Withheld => NovaErrorKind::Withheld,
            FailureKind::TooLarge => NovaErrorKind::TooLarge,
        })
    }
}
