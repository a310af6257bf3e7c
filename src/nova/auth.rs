//! Keystone v3 authentication: a password with project scope, or an
//! application credential (what OpenStack recommends for services; its
//! token is scoped by the credential itself, so the request names no
//! scope). The token is cached and shared; it is renewed before it
//! expires and once on a 401.
//! A renewal runs in its own task on its own bounded timeout, detached from
//! any caller: one caller's short deadline or cancellation never kills the
//! renewal others wait on, and concurrent callers start one renewal.
//! A token due for renewal but still valid keeps serving while a renewal
//! runs, and after one failed: nobody waits on Keystone while they hold a
//! token Nova accepts. A failed renewal backs off (1 s doubling to 30 s,
//! each pause jittered to between half and all of it) before the next one
//! goes to Keystone, so a Keystone in trouble is not asked once per call;
//! a caller without a token whose deadline comes before the next renewal
//! is answered at once with the last one's failure.
//!
//! Why it is one file: past its tests (a quarter of it), it is one state
//! machine (the cached token, the renewal in flight, the backoff) whose
//! transitions must be read together to see that no caller waits on
//! Keystone while a token Nova accepts is held.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::error::error_chain;
use chrono::{DateTime, Utc};
use serde::Deserialize;
use tokio::sync::watch;
use tokio::time::Instant;

/// A value that never prints itself.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"***\"")
    }
}

/// How to ask Keystone for a token.
#[derive(Debug, Clone)]
pub enum Credential {
    /// `OS_AUTH_TYPE=password`: a user's password, scoped to a project.
    Password {
        username: String,
        user_domain_name: String,
        password: Secret,
        project_name: String,
        project_domain_name: String,
    },
    /// `OS_AUTH_TYPE=v3applicationcredential` with
    /// `OS_APPLICATION_CREDENTIAL_ID`.
    ApplicationCredentialId { id: String, secret: Secret },
    /// The same with `OS_APPLICATION_CREDENTIAL_NAME`, which is unique
    /// only per user: the user is named too.
    ApplicationCredentialName {
        name: String,
        username: String,
        user_domain_name: String,
        secret: Secret,
    },
}

impl Credential {
    /// `POST /v3/auth/tokens`'s body. An application credential's token
    /// is scoped by the credential: Keystone refuses a scope beside it.
    pub fn request_body(&self) -> serde_json::Value {
        let identity = match self {
            Credential::Password {
                username,
                user_domain_name,
                password,
                ..
            } => serde_json::json!({
                "methods": ["password"],
                "password": {"user": {
                    "name": username,
                    "domain": {"name": user_domain_name},
                    "password": password.expose(),
                }}
            }),
            Credential::ApplicationCredentialId { id, secret } => serde_json::json!({
                "methods": ["application_credential"],
                "application_credential": {"id": id, "secret": secret.expose()}
            }),
            Credential::ApplicationCredentialName {
                name,
                username,
                user_domain_name,
                secret,
            } => serde_json::json!({
                "methods": ["application_credential"],
                "application_credential": {
                    "name": name,
                    "user": {"name": username, "domain": {"name": user_domain_name}},
                    "secret": secret.expose(),
                }
            }),
        };
        match self {
            Credential::Password {
                project_name,
                project_domain_name,
                ..
            } => serde_json::json!({"auth": {
                "identity": identity,
                "scope": {"project": {
                    "name": project_name,
                    "domain": {"name": project_domain_name},
                }}
            }}),
            _ => serde_json::json!({"auth": {"identity": identity}}),
        }
    }

    /// How this credential is named in logs (never the secret).
    pub fn describe(&self) -> String {
        match self {
            Credential::Password {
                username,
                project_name,
                ..
            } => format!("password of user {username} for project {project_name}"),
            Credential::ApplicationCredentialId { id, .. } => {
                format!("application credential {id}")
            }
            Credential::ApplicationCredentialName { name, username, .. } => {
                format!("application credential {name} of user {username}")
            }
        }
    }
}

/// Keystone mode's settings (the standard `OS_*` ones, resolved).
#[derive(Debug, Clone)]
pub struct KeystoneConfig {
    pub auth_url: String,
    pub credential: Credential,
    pub region: Option<String>,
    pub interface: String,
    /// How long one renewal may take (its own clock, not a caller's).
    pub renewal_timeout: Duration,
    /// Renew this long before `expires_at` (keystoneauth uses 120 s).
    pub renew_before: Duration,
}

#[derive(Clone)]
pub struct Token {
    pub id: Secret,
    pub expires_at: Option<DateTime<Utc>>,
    pub compute_url: String,
    /// Cinder's v3 endpoint (`block-storage`, else `volumev3`), when the
    /// catalog has one for the interface and region.
    pub block_storage_url: Option<String>,
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Token")
            .field("id", &self.id)
            .field("expires_at", &self.expires_at)
            .field("compute_url", &self.compute_url)
            .field("block_storage_url", &self.block_storage_url)
            .finish()
    }
}

type Renewal = watch::Receiver<Option<Result<Token, String>>>;

/// The pause after the first failed renewal; it doubles per failure in a
/// row, up to [`RENEWAL_BACKOFF_MAX`].
const RENEWAL_BACKOFF_MIN: Duration = Duration::from_secs(1);
/// The longest pause between failed renewals: a Keystone back up is used
/// within this (and a token's renewal window, 120 s by default, holds
/// several tries).
const RENEWAL_BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A token this close to `expires_at` is not sent any more: it could expire
/// on its way, and its 401 cost a replay.
const USABLE_MARGIN: Duration = Duration::from_secs(5);

/// The pause before the next renewal after `failures` in a row (≥ 1):
/// `RENEWAL_BACKOFF_MIN × 2^(failures−1)`, at most `RENEWAL_BACKOFF_MAX`,
/// jittered to between half and all of it (replicas that lost Keystone
/// together do not come back together).
fn renewal_backoff(failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(16);
    let full = RENEWAL_BACKOFF_MIN
        .saturating_mul(1u32 << exp)
        .min(RENEWAL_BACKOFF_MAX);
    full.mul_f64(0.5 + rand::random::<f64>() * 0.5)
}

#[derive(Default)]
struct State {
    token: Option<Token>,
    renewing: Option<Renewal>,
    /// Renewals that failed in a row (0 after a success).
    failures: u32,
    /// No renewal goes to Keystone before this (the backoff after a
    /// failure).
    retry_at: Option<Instant>,
    /// Why the last renewal failed, for callers left without a token.
    last_error: Option<String>,
}

impl Token {
    /// Not due for renewal: `renew_before` or more before `expires_at`.
    fn fresh(&self, renew_before: Duration, now: DateTime<Utc>) -> bool {
        self.expires_at.is_none_or(|exp| {
            exp - chrono::Duration::from_std(renew_before).unwrap_or_default() > now
        })
    }

    /// Still accepted by Nova for a while: a token due for renewal serves
    /// until [`USABLE_MARGIN`] before it expires.
    fn usable(&self, now: DateTime<Utc>) -> bool {
        self.fresh(USABLE_MARGIN, now)
    }
}

pub struct KeystoneAuth {
    http: reqwest::Client,
    cfg: KeystoneConfig,
    state: Mutex<State>,
    renewals: std::sync::atomic::AtomicU64,
    /// Renewals that failed, since start (a metric).
    failures: std::sync::atomic::AtomicU64,
}

#[derive(Debug, Deserialize)]
struct TokenBody {
    token: TokenInner,
}

#[derive(Debug, Deserialize)]
struct TokenInner {
    expires_at: Option<DateTime<Utc>>,
    #[serde(default)]
    catalog: Vec<CatalogEntry>,
}

#[derive(Debug, Deserialize)]
pub struct CatalogEntry {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub endpoints: Vec<CatalogEndpoint>,
}

#[derive(Debug, Deserialize)]
pub struct CatalogEndpoint {
    pub interface: String,
    #[serde(default)]
    pub region: Option<String>,
    #[serde(default)]
    pub region_id: Option<String>,
    pub url: String,
}

/// The catalog types of Cinder's v3 API, in order of preference: the
/// official `block-storage`, then the older `volumev3`. Never `volume` or
/// `volumev2`: those name the v1/v2 APIs, whose answers differ.
pub const BLOCK_STORAGE_TYPES: &[&str] = &["block-storage", "volumev3"];

/// The URL of the first endpoint of a service of one of `kinds` (in that
/// order of preference) with `interface` and, when given, `region`.
pub fn catalog_endpoint(
    catalog: &[CatalogEntry],
    kinds: &[&str],
    interface: &str,
    region: Option<&str>,
) -> Option<String> {
    kinds.iter().find_map(|kind| {
        catalog
            .iter()
            .filter(|e| e.kind == *kind)
            .flat_map(|e| e.endpoints.iter())
            .find(|ep| {
                ep.interface == interface
                    && region.is_none_or(|r| {
                        ep.region.as_deref() == Some(r) || ep.region_id.as_deref() == Some(r)
                    })
            })
            .map(|ep| ep.url.trim_end_matches('/').to_string())
    })
}

/// Picks the compute endpoint by interface and (when given) region.
pub fn compute_endpoint(
    catalog: &[CatalogEntry],
    interface: &str,
    region: Option<&str>,
) -> Option<String> {
    catalog_endpoint(catalog, &["compute"], interface, region)
}

/// Picks Cinder's v3 endpoint by interface and (when given) region, by the
/// same rules as compute's.
pub fn block_storage_endpoint(
    catalog: &[CatalogEntry],
    interface: &str,
    region: Option<&str>,
) -> Option<String> {
    catalog_endpoint(catalog, BLOCK_STORAGE_TYPES, interface, region)
}

impl KeystoneAuth {
    pub fn new(http: reqwest::Client, cfg: KeystoneConfig) -> Arc<Self> {
        Arc::new(Self {
            http,
            cfg,
            state: Mutex::new(State::default()),
            renewals: std::sync::atomic::AtomicU64::new(0),
            failures: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// How many renewals were started (for tests and metrics).
    pub fn renewals(&self) -> u64 {
        self.renewals.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many renewals failed since start (`volume_reconciler_keystone_renewal_failures_total`).
    pub fn renewal_failures(&self) -> u64 {
        self.failures.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// When the token held expires: `None` without one (none yet, or
    /// forgotten after a 401), `Some(None)` for a token Keystone gave no
    /// expiry.
    pub fn token_expires_at(&self) -> Option<Option<DateTime<Utc>>> {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.token.as_ref().map(|t| t.expires_at)
    }

    /// A valid token, waiting at most until `deadline` for a renewal. A
    /// token due for renewal starts one (after the backoff, if the last
    /// failed) and serves meanwhile while it is still usable; only a caller
    /// without a usable token waits — or, when the backoff outlasts its
    /// deadline, is answered at once with the last renewal's error.
    pub async fn token(self: &Arc<Self>, deadline: Instant) -> Result<Token, String> {
        let (mut rx, last_error) = {
            // A poisoned lock means a panic elsewhere already; keep serving.
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let now = Utc::now();
            if let Some(t) = &st.token
                && t.fresh(self.cfg.renew_before, now)
            {
                return Ok(t.clone());
            }
            let usable = st.token.as_ref().filter(|t| t.usable(now)).cloned();
            let backing_off = st.retry_at.filter(|at| *at > Instant::now());
            // No token to serve, and the next renewal may not go to Keystone
            // before this caller's deadline: its answer is the last one's.
            if usable.is_none()
                && let Some(at) = backing_off
                && at >= deadline
            {
                let last = st.last_error.as_deref().unwrap_or("unknown");
                return Err(format!(
                    "{last} (the last renewal failed; the next goes to Keystone in {} ms, after this request's deadline)",
                    at.saturating_duration_since(Instant::now()).as_millis()
                ));
            }
            let rx = match &st.renewing {
                Some(rx) => rx.clone(),
                None => {
                    let rx = self.clone().start_renewal(backing_off);
                    st.renewing = Some(rx.clone());
                    rx
                }
            };
            if let Some(t) = usable {
                return Ok(t);
            }
            (rx, st.last_error.clone())
        };
        let wait = async {
            loop {
                if let Some(result) = rx.borrow_and_update().clone() {
                    return result;
                }
                if rx.changed().await.is_err() {
                    return Err("token renewal task ended without a result".to_string());
                }
            }
        };
        match tokio::time::timeout_at(deadline, wait).await {
            Ok(r) => r,
            Err(_) => Err(match last_error {
                None => "the caller's deadline expired waiting for a Keystone token (the renewal goes on)".into(),
                Some(e) => format!(
                    "the caller's deadline expired waiting for a Keystone token (the renewal goes on, after a backoff: the last one failed: {e})"
                ),
            }),
        }
    }

    /// Forgets `bad` (after a 401) so the next caller renews; a token that
    /// was already replaced is left alone.
    pub fn invalidate(&self, bad: &Secret) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.token.as_ref().is_some_and(|t| &t.id == bad) {
            st.token = None;
        }
    }

    /// Starts the renewal every caller waits on; it asks Keystone at
    /// `not_before` (the backoff after a failure), or now.
    fn start_renewal(self: Arc<Self>, not_before: Option<Instant>) -> Renewal {
        let (tx, rx) = watch::channel(None);
        self.renewals
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // The renewal serves every caller, but one operation's request
        // started it: its trace goes with the token request.
        let trace = crate::telemetry::context::current();
        tokio::spawn(crate::telemetry::context::within_opt(trace, async move {
            if let Some(at) = not_before {
                tokio::time::sleep_until(at).await;
            }
            let result =
                match tokio::time::timeout(self.cfg.renewal_timeout, self.authenticate()).await {
                    Ok(r) => r,
                    Err(_) => Err(format!(
                        "Keystone did not answer within the renewal timeout of {:?}",
                        self.cfg.renewal_timeout
                    )),
                };
            let backoff = {
                let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
                st.renewing = None;
                match &result {
                    // A failure keeps the token held: it serves while usable.
                    Ok(t) => {
                        st.token = Some(t.clone());
                        st.failures = 0;
                        st.retry_at = None;
                        st.last_error = None;
                        None
                    }
                    Err(e) => {
                        self.failures
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        st.failures = st.failures.saturating_add(1);
                        let pause = renewal_backoff(st.failures);
                        st.retry_at = Some(Instant::now() + pause);
                        st.last_error = Some(e.clone());
                        Some((pause, st.failures))
                    }
                }
            };
            if let (Err(e), Some((pause, failures))) = (&result, backoff) {
                tracing::warn!(
                    auth_url = %self.cfg.auth_url,
                    error = %e,
                    failures,
                    next_in_ms = pause.as_millis() as u64,
                    "Keystone token renewal failed; the token held serves while it is valid"
                );
            }
            // No receiver left is fine: every waiter gave up.
            drop(tx.send(Some(result)));
        }));
        rx
    }

    async fn authenticate(&self) -> Result<Token, String> {
        let url = format!("{}/auth/tokens", self.cfg.auth_url.trim_end_matches('/'));
        let url = if self.cfg.auth_url.trim_end_matches('/').ends_with("/v3") {
            url
        } else {
            format!("{}/v3/auth/tokens", self.cfg.auth_url.trim_end_matches('/'))
        };
        let body = self.cfg.credential.request_body();
        let resp = super::trace::with_trace(self.http.post(&url))
            .json(&body)
            .send()
            .await
            .map_err(|e| format!("POST {url}: {}", error_chain(&e)))?;
        let status = resp.status();
        let subject = resp
            .headers()
            .get("x-subject-token")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        // The renewal's own timeout bounds the read; the cap bounds memory.
        let bytes = super::body::read_body(
            resp,
            Instant::now() + self.cfg.renewal_timeout,
            KEYSTONE_BODY_CAP,
        )
        .await
        .map_err(|e| format!("POST {url}: reading the body: {e}"))?;
        if !status.is_success() {
            let fault = super::error::fault::parse_fault(&bytes);
            return Err(format!(
                "POST {url}: HTTP {}: {}",
                status.as_u16(),
                fault.message.unwrap_or_default()
            ));
        }
        let id = subject
            .ok_or_else(|| format!("POST {url}: no X-Subject-Token header in the answer"))?;
        let parsed: TokenBody =
            serde_json::from_slice(&bytes).map_err(|e| format!("POST {url}: token body: {e}"))?;
        let compute_url = compute_endpoint(
            &parsed.token.catalog,
            &self.cfg.interface,
            self.cfg.region.as_deref(),
        )
        .ok_or_else(|| {
            format!(
                "no compute endpoint with interface {:?} and region {:?} in the catalog",
                self.cfg.interface, self.cfg.region
            )
        })?;
        let block_storage_url = block_storage_endpoint(
            &parsed.token.catalog,
            &self.cfg.interface,
            self.cfg.region.as_deref(),
        );
        Ok(Token {
            id: Secret::new(id),
            expires_at: parsed.token.expires_at,
            compute_url,
            block_storage_url,
        })
    }
}

/// The largest token body read: 4 MiB. A token carries the whole service
/// catalog, which a large public cloud makes hundreds of KiB.
const KEYSTONE_BODY_CAP: usize = 4 * 1024 * 1024;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_compute_from_the_shared_keystone_sample() {
        let raw = include_str!(
            "../../tests/fixtures/keystone/admin/auth-password-project-scoped-response.json"
        );
        let parsed: TokenBody = serde_json::from_str(raw).unwrap();
        let url = compute_endpoint(&parsed.token.catalog, "public", Some("RegionOne")).unwrap();
        assert!(url.starts_with("http://23.253.248.171:8774/v2.1/"), "{url}");
        assert!(compute_endpoint(&parsed.token.catalog, "public", Some("Elsewhere")).is_none());
        // The sample's Cinder is `volume`/`volumev2` only: a v1/v2 API is
        // never taken for the v3 one.
        assert!(
            block_storage_endpoint(&parsed.token.catalog, "public", Some("RegionOne")).is_none()
        );
    }

    fn entry(kind: &str, endpoints: &[(&str, &str, &str)]) -> CatalogEntry {
        CatalogEntry {
            kind: kind.into(),
            endpoints: endpoints
                .iter()
                .map(|(interface, region, url)| CatalogEndpoint {
                    interface: (*interface).into(),
                    region: Some((*region).into()),
                    region_id: Some((*region).into()),
                    url: (*url).into(),
                })
                .collect(),
        }
    }

    #[test]
    fn block_storage_prefers_its_official_type_and_follows_interface_and_region() {
        let catalog = vec![
            entry("volumev2", &[("public", "RegionOne", "http://c:8776/v2/p")]),
            entry(
                "volumev3",
                &[
                    ("public", "RegionOne", "http://old:8776/v3/p"),
                    ("internal", "RegionOne", "http://old-internal:8776/v3/p"),
                ],
            ),
            entry(
                "block-storage",
                &[
                    ("public", "RegionTwo", "http://two:8776/v3/p/"),
                    ("public", "RegionOne", "http://one:8776/v3/p"),
                ],
            ),
        ];
        let pick = |i, r| block_storage_endpoint(&catalog, i, r);
        assert_eq!(
            pick("public", Some("RegionOne")).as_deref(),
            Some("http://one:8776/v3/p")
        );
        assert_eq!(
            pick("public", Some("RegionTwo")).as_deref(),
            Some("http://two:8776/v3/p")
        );
        // Only volumev3 has an internal endpoint.
        assert_eq!(
            pick("internal", Some("RegionOne")).as_deref(),
            Some("http://old-internal:8776/v3/p")
        );
        assert_eq!(pick("admin", None), None);
        assert_eq!(pick("public", Some("RegionThree")), None);
    }

    #[test]
    fn an_application_credential_asks_for_no_scope() {
        let by_id = Credential::ApplicationCredentialId {
            id: "423f19a4ac1e4f48bbb4180756e6eb6c".into(),
            secret: Secret::new("rEaqvJka48mpv"),
        };
        assert_eq!(
            by_id.request_body(),
            serde_json::json!({"auth": {"identity": {
                "methods": ["application_credential"],
                "application_credential": {"id": "423f19a4ac1e4f48bbb4180756e6eb6c", "secret": "rEaqvJka48mpv"}
            }}})
        );
        let by_name = Credential::ApplicationCredentialName {
            name: "monitoring".into(),
            username: "svc".into(),
            user_domain_name: "Default".into(),
            secret: Secret::new("s"),
        };
        let body = by_name.request_body();
        assert!(body["auth"].get("scope").is_none(), "{body}");
        assert_eq!(
            body["auth"]["identity"]["application_credential"]["user"],
            serde_json::json!({"name": "svc", "domain": {"name": "Default"}})
        );
        assert!(
            !format!("{by_name:?}").contains("\"s\""),
            "secrets stay hidden"
        );
    }

    #[test]
    fn a_password_asks_for_the_project_scope() {
        let body = Credential::Password {
            username: "svc".into(),
            user_domain_name: "Corp".into(),
            password: Secret::new("pw"),
            project_name: "storage".into(),
            project_domain_name: "Corp".into(),
        }
        .request_body();
        let sample: serde_json::Value = serde_json::from_str(include_str!(
            "../../tests/fixtures/keystone/auth/requests/project-name-password.json"
        ))
        .unwrap();
        // The same shape as Keystone's own sample request.
        assert_eq!(
            body["auth"]["identity"]["methods"],
            sample["auth"]["identity"]["methods"]
        );
        assert_eq!(body["auth"]["scope"]["project"]["name"], "storage");
        assert_eq!(body["auth"]["scope"]["project"]["domain"]["name"], "Corp");
        assert_eq!(
            body["auth"]["identity"]["password"]["user"]["password"],
            "pw"
        );
    }

    #[test]
    fn a_failed_renewal_backs_off_doubling_jittered_and_bounded() {
        for failures in 1..40 {
            let full = RENEWAL_BACKOFF_MIN
                .saturating_mul(1 << (failures - 1).min(16))
                .min(RENEWAL_BACKOFF_MAX);
            for _ in 0..20 {
                let pause = renewal_backoff(failures);
                assert!(
                    pause >= full / 2 && pause <= full,
                    "{failures} failures: {pause:?} outside {:?}..={full:?}",
                    full / 2
                );
            }
        }
        assert!(renewal_backoff(u32::MAX) <= RENEWAL_BACKOFF_MAX);
        // Jittered: not one value for everybody.
        let pauses: std::collections::BTreeSet<_> = (0..20).map(|_| renewal_backoff(3)).collect();
        assert!(pauses.len() > 1, "{pauses:?}");
    }

    #[test]
    fn a_token_due_for_renewal_serves_until_just_before_it_expires() {
        let now = Utc::now();
        let token = |in_secs: i64| Token {
            id: Secret::new("t"),
            expires_at: Some(now + chrono::Duration::seconds(in_secs)),
            compute_url: "http://nova".into(),
            block_storage_url: None,
        };
        let renew_before = Duration::from_secs(120);
        assert!(token(600).fresh(renew_before, now));
        // Due (inside the renewal window), still usable.
        assert!(!token(60).fresh(renew_before, now));
        assert!(token(60).usable(now));
        // Too close to expiring to send, and expired.
        assert!(!token(2).usable(now));
        assert!(!token(-1).usable(now));
        let forever = Token {
            expires_at: None,
            ..token(0)
        };
        assert!(forever.fresh(renew_before, now) && forever.usable(now));
    }

    #[test]
    fn secrets_do_not_print() {
        let s = Secret::new("hunter2");
        assert_eq!(format!("{s:?}"), "\"***\"");
    }
}
