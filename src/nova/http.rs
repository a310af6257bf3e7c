//! The HTTP machinery every OpenStack adapter shares (Nova's and
//! Cinder's): one request under one deadline, from the wait for a
//! connection slot to the last byte of the body, with the token and the
//! endpoint from Keystone (or a direct URL) and one replay after a 401 from
//! the auth middleware. Every way a request can end that is not an answer
//! becomes a [`Failure`]: which stage, which clock, whether the request may
//! have reached the service, and how long it ran of the budget it had. The
//! adapters turn answers into their own values and errors.
//!
//! No transport constant bounds a request: the client has no total, read or
//! response-header timeout; only connection setup (TCP connect, TLS
//! handshake) keeps its own short bound, because it is not the service's
//! working time. A body is read chunk by chunk under the request's
//! deadline and refused past [`MAX_BODY_BYTES`] (a size, not a clock).
//!
//! Why it is one file: past its tests (a sixteenth of it), it is one
//! request's life under one deadline, stage by stage; split, the stages
//! would each need the budget and the failure's vocabulary passed around.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use reqwest::Method;
use tokio::time::Instant;
use uuid::Uuid;

use super::auth::{KeystoneAuth, Secret, Token};
use super::body::{BodyError, read_body};
use super::error::error_chain;
use super::error::fault::{clean_text, keystone_refusal};
use super::error::{Stage, UpstreamError};
use super::gate::SendGate;
use super::trace::with_trace;

/// The largest response body read from Nova or Cinder: 2 MiB. The largest
/// answer the adapters read is an attachment list, at most 1,000
/// block-device rows of ~300 bytes (Nova's `max_limit`); anything past 2
/// MiB is not an answer of theirs, and 128 requests in flight per host
/// hold at most 256 MiB. A bigger body (a proxy streaming a page without
/// end) is refused once the cap is passed, not buffered.
pub const MAX_BODY_BYTES: usize = 2 * 1024 * 1024;

/// Told how long each request waited for a connection slot.
pub type SlotWaitObserver = Arc<dyn Fn(Duration) + Send + Sync>;

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
    pub(super) certs: Vec<reqwest::Certificate>,
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

/// How a request ended without an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FailureKind {
    /// The outbound deadline expired.
    DeadlineExceeded,
    /// TCP or TLS failed: nothing was sent.
    ConnectFailed,
    /// Sent, but no complete answer came (reset, closed, cut body).
    ResponseLost,
    /// Keystone gave no token.
    AuthFailed,
    /// The token's catalog has no endpoint for the service.
    NoEndpoint,
    /// The body ran past [`MAX_BODY_BYTES`]: refused unread.
    TooLarge,
    /// Its gate kept the request from leaving (see [`SendGate`]): nothing
    /// was sent.
    Withheld,
}

/// A request that ended without an answer, with all its context (the
/// adapters' error core; each client makes it its own kind). It has no
/// fault or message: nothing whole came back.
pub(crate) type Failure = UpstreamError<FailureKind>;

/// A whole answer: status, body, and the service's own request id.
pub(crate) struct RawResponse {
    pub status: u16,
    pub body: Bytes,
    pub request_id: Option<String>,
    /// `Content-Type`, for errors that quote an answer that is not the
    /// service's.
    pub content_type: Option<String>,
    /// The microversion the service says it answered with
    /// (`OpenStack-API-Version`, e.g. `compute 2.89`).
    pub api_version: Option<String>,
    /// `Location` of a redirect (not followed), for its error.
    pub location: Option<String>,
}

/// Where the service is: a URL given directly, or the token's catalog.
#[derive(Debug, Clone)]
pub(crate) enum Base {
    Direct(String),
    Catalog(CatalogService),
}

/// The services whose endpoint the catalog gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CatalogService {
    Compute,
    BlockStorage,
}

impl CatalogService {
    fn pick(self, token: &Token) -> Option<&str> {
        match self {
            CatalogService::Compute => Some(token.compute_url.as_str()),
            CatalogService::BlockStorage => token.block_storage_url.as_deref(),
        }
    }

    fn describe(self) -> &'static str {
        match self {
            CatalogService::Compute => "compute",
            CatalogService::BlockStorage => "block-storage (or volumev3)",
        }
    }
}

/// `base` (`base_text`, parsed) followed by `path`
/// (`/servers/...`, perhaps a `?query`), as `Url::parse` would make their
/// concatenation; `None` for what does not fit that shape (a base with a
/// query or fragment, or no host; a path not starting with `/`).
fn under(base_text: &str, base: &reqwest::Url, path: &str) -> Option<reqwest::Url> {
    if !path.starts_with('/')
        || path.contains('#')
        || base.query().is_some()
        || base.fragment().is_some()
        || base.cannot_be_a_base()
        || !base.has_host()
    {
        return None;
    }
    let (path, query) = match path.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (path, None),
    };
    // A base without a path parses with the path `/`, which the
    // concatenation does not have.
    let prefix = match base.path() {
        "/" if !base_text.ends_with('/') => "",
        p => p,
    };
    let mut url = base.clone();
    url.set_path(&format!("{prefix}{path}"));
    url.set_query(query);
    Some(url)
}

/// One OpenStack service as a client sees it: the shared HTTP client and
/// Keystone, its own endpoint, its own cap on concurrent requests, and the
/// headers every request to it carries (its microversion).
pub(crate) struct Service {
    http: reqwest::Client,
    auth: Option<Arc<KeystoneAuth>>,
    base: Base,
    headers: Vec<(&'static str, String)>,
    slots: Arc<super::fair::FairSlots>,
    max_concurrent: usize,
    slot_wait: Option<SlotWaitObserver>,
    /// The base URL as last parsed: a request's URL is made from it
    /// without parsing its host again (`url_of`).
    parsed_base: std::sync::Mutex<Option<(String, reqwest::Url)>>,
}

impl Service {
    pub fn new(
        http: reqwest::Client,
        auth: Option<Arc<KeystoneAuth>>,
        base: Base,
        headers: Vec<(&'static str, String)>,
        max_concurrent: usize,
    ) -> Self {
        let max_concurrent = max_concurrent.max(1);
        Self {
            http,
            auth,
            base,
            headers,
            slots: super::fair::FairSlots::new(max_concurrent),
            max_concurrent,
            slot_wait: None,
            parsed_base: std::sync::Mutex::new(None),
        }
    }

    /// Replaces the headers every request carries (a microversion resolved
    /// at start).
    pub fn set_headers(&mut self, headers: Vec<(&'static str, String)>) {
        self.headers = headers;
    }

    /// `base` followed by `path`, parsed. Parsing the whole string runs
    /// the host through IDNA, a third of what the URL costs a call; the
    /// base is parsed once, and the path and query set on a copy: the same
    /// URL (`tests::a_url_made_from_the_parsed_base_is_the_whole_url_parsed`).
    /// `None` when the base does not parse or the path does not fit that
    /// shape: the caller then hands reqwest the whole string, as before.
    fn url_of(&self, base: &str, path: &str) -> Option<reqwest::Url> {
        // A poisoned lock only means another call panicked while it held
        // it: the base it guards is still a parsed URL or nothing.
        let mut cached = self
            .parsed_base
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if cached.as_ref().is_none_or(|(b, _)| b != base) {
            *cached = reqwest::Url::parse(base)
                .ok()
                .map(|parsed| (base.to_string(), parsed));
        }
        cached
            .as_ref()
            .and_then(|(text, parsed)| under(text, parsed, path))
    }

    /// `GET url_of(base)`: a document beside the service's API rather than
    /// under it (Nova's version document at its root), with the token, no
    /// slot (it is not the service's work) and no replay.
    pub async fn get_at(
        &self,
        request_id: &str,
        url_of: fn(&str) -> String,
        deadline: Instant,
    ) -> Result<(String, RawResponse), Failure> {
        let call = Call {
            method: "GET",
            started: Instant::now(),
            deadline,
        };
        let (base, token) = self
            .base_and_token(deadline)
            .await
            .map_err(|(kind, cause)| {
                let kind = if Instant::now() >= deadline {
                    FailureKind::DeadlineExceeded
                } else {
                    kind
                };
                call.failure(kind, Stage::Authenticate, "/", false, cause)
            })?;
        let url = url_of(&base);
        let mut req = with_trace(
            self.http
                .get(&url)
                .header("Accept", "application/json")
                .header("X-OpenStack-Request-ID", request_id),
        );
        if let Some(t) = &token {
            req = req.header("X-Auth-Token", t.expose());
        }
        let raw = call.send(req, &url).await?;
        Ok((url, raw))
    }

    pub fn set_slot_wait_observer(&mut self, observer: SlotWaitObserver) {
        self.slot_wait = Some(observer);
    }

    pub fn auth(&self) -> Option<&Arc<KeystoneAuth>> {
        self.auth.as_ref()
    }

    /// Requests holding a slot right now.
    pub fn slots_in_use(&self) -> usize {
        self.slots.in_use()
    }

    /// Each caller row's weight in the slots when they are contended
    /// (`fair`); the last row's is that of requests of no caller's.
    pub fn set_shares(&self, weights: Vec<u32>) {
        self.slots.set_weights(weights);
    }

    /// The base URL and token a request uses now: a direct URL (with a
    /// token when Keystone is configured too), or the catalog's.
    async fn base_and_token(
        &self,
        deadline: Instant,
    ) -> Result<(String, Option<Secret>), (FailureKind, String)> {
        let token = match &self.auth {
            Some(auth) => Some(
                auth.token(deadline)
                    .await
                    .map_err(|e| (FailureKind::AuthFailed, e))?,
            ),
            None => None,
        };
        let url = match (&self.base, &token) {
            (Base::Direct(url), _) => url.clone(),
            (Base::Catalog(which), Some(t)) => which
                .pick(t)
                .ok_or_else(|| {
                    (
                        FailureKind::NoEndpoint,
                        format!("the Keystone catalog has no {} endpoint", which.describe()),
                    )
                })?
                .to_string(),
            (Base::Catalog(which), None) => {
                return Err((
                    FailureKind::AuthFailed,
                    format!(
                        "the {} endpoint comes from Keystone, but no Keystone is configured",
                        which.describe()
                    ),
                ));
            }
        };
        Ok((
            url.trim_end_matches('/').to_string(),
            token.map(|t| t.id.clone()),
        ))
    }

    /// The base URL requests go to now: `None` when the token's catalog has
    /// no endpoint for the service. Needs a token in catalog mode (the
    /// cached one, or a renewal waited for until `deadline`).
    pub async fn endpoint(&self, deadline: Instant) -> Result<Option<String>, Failure> {
        if let Base::Direct(url) = &self.base {
            return Ok(Some(url.trim_end_matches('/').to_string()));
        }
        let call = Call {
            method: "GET",
            started: Instant::now(),
            deadline,
        };
        match self.base_and_token(deadline).await {
            Ok((url, _)) => Ok(Some(url)),
            Err((FailureKind::NoEndpoint, _)) => Ok(None),
            Err((kind, cause)) => {
                let kind = if Instant::now() >= deadline {
                    FailureKind::DeadlineExceeded
                } else {
                    kind
                };
                Err(call.failure(kind, Stage::Authenticate, "(catalog)", false, cause))
            }
        }
    }

    /// Sends one request under `deadline`, reading the whole body under the
    /// same deadline: `(url, answer)`. A 401 from the auth middleware (the
    /// request never reached the service) re-authenticates and replays once.
    pub async fn execute<B: serde::Serialize>(
        &self,
        request_id: &str,
        method: Method,
        path: &str,
        body: Option<&B>,
        deadline: Instant,
        gate: &dyn SendGate,
    ) -> Result<(String, RawResponse), Failure> {
        let call = Call {
            method: method_name(&method),
            started: Instant::now(),
            deadline,
        };
        // The wait for a slot counts against the request's deadline; a
        // contended slot goes to the caller row with the least of its
        // share (`fair`).
        let _permit =
            match tokio::time::timeout_at(deadline, self.slots.acquire(gate.share())).await {
                Ok(p) => p,
                Err(_) => {
                    return Err(call.failure(
                        FailureKind::DeadlineExceeded,
                        Stage::AcquireSlot,
                        path,
                        false,
                        format!("all {} connection slots stayed busy", self.max_concurrent),
                    ));
                }
            };
        if let Some(observe) = &self.slot_wait {
            observe(call.started.elapsed());
        }
        // Only the slot wait is inline: a request queued behind the cap keeps
        // a small future; the send's state is allocated once it may run.
        Box::pin(self.send_with_replay(&call, request_id, method, path, body, gate)).await
    }

    /// The request to `base` + `path`, with its headers (the request id,
    /// the trace, the token when there is one) and its JSON body; and its
    /// URL, as failures name it.
    fn request<B: serde::Serialize>(
        &self,
        base: &str,
        token: Option<&Secret>,
        method: Method,
        path: &str,
        request_id: &str,
        body: Option<&B>,
    ) -> (String, reqwest::RequestBuilder) {
        let url = format!("{base}{path}");
        let request = match self.url_of(base, path) {
            Some(parsed) => self.http.request(method, parsed),
            None => self.http.request(method, &url),
        };
        let mut req = with_trace(
            request
                .header("Accept", "application/json")
                .header("X-OpenStack-Request-ID", request_id),
        );
        for (name, value) in &self.headers {
            req = req.header(*name, value);
        }
        if let Some(t) = token {
            req = req.header("X-Auth-Token", t.expose());
        }
        if let Some(b) = body {
            req = req.json(b);
        }
        (url, req)
    }

    async fn send_with_replay<B: serde::Serialize>(
        &self,
        call: &Call,
        request_id: &str,
        method: Method,
        path: &str,
        body: Option<&B>,
        gate: &dyn SendGate,
    ) -> Result<(String, RawResponse), Failure> {
        let mut replayed = false;
        loop {
            let (base, token) = match self.base_and_token(call.deadline).await {
                Ok(x) => x,
                Err((kind, cause)) => {
                    let kind = if kind == FailureKind::AuthFailed && Instant::now() >= call.deadline
                    {
                        FailureKind::DeadlineExceeded
                    } else {
                        kind
                    };
                    return Err(call.failure(kind, Stage::Authenticate, path, false, cause));
                }
            };
            let (url, req) = self.request(
                &base,
                token.as_ref(),
                method.clone(),
                path,
                request_id,
                body,
            );
            // A slot or a token that came at the last instant can leave no
            // time: then the request must not leave, and the failure must
            // say it never did (sent with no time, it would count as one
            // that may have reached Nova, and be watched for nothing).
            if Instant::now() >= call.deadline {
                return Err(call.failure(
                    FailureKind::DeadlineExceeded,
                    Stage::AcquireSlot,
                    &url,
                    false,
                    "no time left to send the request; not sent".into(),
                ));
            }
            if let Err(why) = gate.may_send().await {
                return Err(call.failure(
                    FailureKind::Withheld,
                    Stage::AcquireSlot,
                    &url,
                    false,
                    format!("not sent: {why}"),
                ));
            }
            let raw = match gate.owned() {
                Some(late) => super::gate::scoped(late, call.send(req, &url)).await?,
                None => call.send(req, &url).await?,
            };
            if raw.status == 401
                && !replayed
                && keystone_refusal(&raw.body)
                && let (Some(auth), Some(t)) = (&self.auth, &token)
            {
                // keystonemiddleware refused the token: the service never saw
                // the request, so replaying it once is safe even for a POST.
                // A 401 of another shape (a proxy's) is not replayed: where
                // it came from, and whether the request went on, is unknown.
                tracing::info!(url = %url, "answered 401; re-authenticating and replaying once");
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

/// One request's clocks: every failure it ends with says how long it ran
/// of the budget it had.
struct Call {
    method: &'static str,
    started: Instant,
    deadline: Instant,
}

impl Call {
    fn failure(
        &self,
        kind: FailureKind,
        stage: Stage,
        url: &str,
        may_have_reached: bool,
        cause: String,
    ) -> Failure {
        Failure {
            kind,
            stage,
            method: self.method,
            url: url.to_string(),
            status: None,
            request_id: None,
            fault: None,
            message: None,
            elapsed: self.started.elapsed(),
            budget: self.deadline.saturating_duration_since(self.started),
            may_have_reached,
            // Causes quote transport errors, which may quote what came back.
            cause: clean_text(&cause),
        }
    }

    /// Sends and reads the whole answer, both under the deadline.
    async fn send(&self, req: reqwest::RequestBuilder, url: &str) -> Result<RawResponse, Failure> {
        let resp = match tokio::time::timeout_at(self.deadline, req.send()).await {
            Err(_) => {
                return Err(self.failure(
                    FailureKind::DeadlineExceeded,
                    Stage::AwaitHeaders,
                    url,
                    true,
                    "no response headers before the outbound deadline".into(),
                ));
            }
            Ok(Err(e)) if e.is_connect() => {
                if let Some(why) = super::gate::withheld(&e) {
                    return Err(self.failure(
                        FailureKind::Withheld,
                        Stage::Connect,
                        url,
                        false,
                        format!("not sent: {why}"),
                    ));
                }
                return Err(self.failure(
                    FailureKind::ConnectFailed,
                    Stage::Connect,
                    url,
                    false,
                    error_chain(&e),
                ));
            }
            Ok(Err(e)) => {
                return Err(self.failure(
                    FailureKind::ResponseLost,
                    Stage::AwaitHeaders,
                    url,
                    true,
                    error_chain(&e),
                ));
            }
            Ok(Ok(r)) => r,
        };
        let status = resp.status().as_u16();
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let request_id =
            header("x-openstack-request-id").or_else(|| header("x-compute-request-id"));
        let content_type = header("content-type");
        let api_version = header("openstack-api-version");
        let location = header("location");
        let (kind, cause) = match read_body(resp, self.deadline, MAX_BODY_BYTES).await {
            Ok(body) => {
                return Ok(RawResponse {
                    status,
                    body,
                    request_id,
                    content_type,
                    api_version,
                    location,
                });
            }
            Err(BodyError::Deadline(got)) => (
                FailureKind::DeadlineExceeded,
                format!("body still incomplete after {got} bytes at the outbound deadline"),
            ),
            Err(BodyError::Lost(got, cause)) => (
                FailureKind::ResponseLost,
                format!("body cut off after {got} bytes: {cause}"),
            ),
            Err(e @ BodyError::TooLarge { .. }) => (FailureKind::TooLarge, e.to_string()),
        };
        let mut f = self.failure(kind, Stage::ReadBody, url, true, cause);
        f.status = Some(status);
        f.request_id = request_id;
        Err(f)
    }
}

/// One answer that came whole, and the context every error made of it
/// carries. What an answer means is each client's to say (`answer.rs` for
/// Nova's, `cinder.rs` for Cinder's).
pub(crate) struct Exchange<'a> {
    pub method: &'static str,
    pub url: String,
    pub raw: &'a RawResponse,
    pub started: Instant,
    pub deadline: Instant,
}

impl Exchange<'_> {
    /// An error of `kind` made of this answer: the service answered, so
    /// the request reached it (a refusal that proves otherwise says so).
    pub fn error<K>(&self, kind: K, stage: Stage, cause: String) -> UpstreamError<K> {
        UpstreamError {
            kind,
            stage,
            method: self.method,
            url: self.url.clone(),
            status: Some(self.raw.status),
            request_id: self.raw.request_id.clone(),
            fault: None,
            message: None,
            elapsed: self.started.elapsed(),
            budget: self.deadline.saturating_duration_since(self.started),
            may_have_reached: true,
            // A cause may quote the body.
            cause: super::error::fault::clean_text(&cause),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_made_from_the_parsed_base_is_the_whole_url_parsed() {
        let bases = [
            "http://127.0.0.1:8774/v2.1",
            "http://127.0.0.1:8774",
            "http://127.0.0.1:8774/",
            "https://nova.example.com/compute/v2.1/",
            "https://user:pw@[::1]:8774/v2.1",
            "http://NOVA.Example.com:80/v2.1",
            "http://bücher.example/v2.1",
            "http://h/a%20b/v2.1",
            "http://h/v2.1/../v2",
        ];
        let paths = [
            "/servers/4b3c1a2e-1111-4222-8333-944455556666/os-volume_attachments",
            "/servers/x/os-volume_attachments/0f0e0d0c-0b0a-4908-8706-050403020100",
            "/servers/x/os-volume_attachments?limit=1000&marker=a%2Fb",
            "/os-volumes/a b/é?q=ü ü",
            "/servers/../flavors",
            "/",
            "?q",
            "/servers#frag",
            "",
        ];
        let mut made = 0;
        for base in bases {
            let parsed = reqwest::Url::parse(base).expect("a test base parses");
            for path in paths {
                let whole = reqwest::Url::parse(&format!("{base}{path}")).expect("parses");
                if let Some(u) = under(base, &parsed, path) {
                    made += 1;
                    assert_eq!(u.as_str(), whole.as_str(), "{base} + {path}");
                }
            }
        }
        // Not vacuous: every path that starts with `/` and has no fragment
        // is made from the base, for every base.
        assert_eq!(made, bases.len() * 6);
        for base in ["http://h/v2.1?x=1", "mailto:nova@example.com"] {
            let parsed = reqwest::Url::parse(base).expect("parses");
            assert!(under(base, &parsed, "/servers").is_none(), "{base}");
        }
    }
}
