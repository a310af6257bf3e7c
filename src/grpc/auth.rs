//! Caller authentication and authorization, a layer of the server chain.
//!
//! Who a caller is, and so what it may do and whose operations it reads:
//!
//! - **Tokens** (`--auth-tokens`): callers present `authorization: Bearer
//!   <token>`. The service keeps only SHA-256 hashes of the tokens, each
//!   with a name and a role, and compares in constant time. When tokens
//!   are configured, the token is required and names the caller and its
//!   role, whatever certificate the connection presented (the certificate
//!   then only admits the connection). Tokens are never logged.
//! - **Client certificates** (mutual TLS, `--tls-client-ca`, no tokens):
//!   the caller is named by its certificate's subject common name (the last
//!   CN) and a hash of its whole issuer and subject names
//!   ([`certificate_caller_name`]): `CN#` and 32 hex digits; a certificate
//!   without a usable CN is refused. Its role comes from `--tls-client-roles` ([`CertRoles`]): an
//!   entry for its CN first, else an entry for one of its subject's OUs,
//!   else `orchestrator`. Without that flag every certificate caller is an
//!   orchestrator (warned at start), never an operator.
//! - **Nobody** (no tokens, no client certificates): one anonymous caller,
//!   with no name and every right, as before authentication existed.
//!
//! `orchestrator` may attach, detach, get, list, watch and read events of
//! its own operations; `operator` may also reconcile and resolve, and reads
//! every caller's. No credentials when they are required →
//! `UNAUTHENTICATED`; a role without the right → `PERMISSION_DENIED`. The
//! caller ([`Caller`]) reaches the handlers in the request's extensions
//! (and so the ledger and the reconcile log); its absence means the
//! anonymous caller.
//!
//! Why it is one file: past its tests (a sixth of it), it is one policy —
//! who the caller is, by token or certificate, and what its role may do —
//! and the layer that applies it; reading the certificate itself is in
//! `tls::certificate`.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::domain::Reason;
use crate::tls::certificate::{issuer_and_subject_of, subject_of};
use std::task::{Context, Poll};

use tower::{Layer, Service};

/// What a caller may do (the methods' table names each one's).
pub use super::methods::Role;

/// The authenticated caller, in the request's extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub name: String,
    pub role: Role,
}

/// The longest caller name, in bytes (a token's name, a certificate's CN,
/// a `caller` filter).
pub const MAX_NAME_LEN: usize = 255;

/// Whether `name` may name a caller: 1..=255 bytes, no control character
/// (the ledger keeps it in text columns and JSON, where a NUL cannot go,
/// and logs print it). `Err` says why.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.trim().is_empty() {
        return Err(if name.is_empty() {
            "is empty"
        } else {
            "is blank"
        }
        .into());
    }
    if name.len() > MAX_NAME_LEN {
        return Err(format!(
            "is {} bytes long; the limit is {MAX_NAME_LEN}",
            name.len()
        ));
    }
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return Err(format!("contains the control character {c:?}"));
    }
    Ok(())
}

#[derive(Clone)]
struct Entry {
    name: String,
    role: Role,
    hash: [u8; 32],
}

/// The configured tokens: `NAME:ROLE:SHA256HEX` each.
#[derive(Clone, Default)]
pub struct TokenSet {
    entries: Vec<Entry>,
}

impl std::fmt::Debug for TokenSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Names and roles only; hashes are not for logs either.
        f.debug_list()
            .entries(
                self.entries
                    .iter()
                    .map(|e| format!("{}:{}", e.name, e.role.as_str())),
            )
            .finish()
    }
}

/// SHA-256 of a token (ring's, which rustls builds anyway).
fn sha256(token: &str) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
    d.as_ref().try_into().expect("a SHA-256 digest is 32 bytes")
}

pub fn sha256_hex(token: &str) -> String {
    sha256(token).iter().map(|b| format!("{b:02x}")).collect()
}

fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let mut diff = 0u8;
    for (x, y) in a.iter().zip(b.iter()) {
        diff |= x ^ y;
    }
    // black_box keeps the compiler from turning the fold into an early exit.
    std::hint::black_box(diff) == 0
}

/// The entries of a list setting: separated by commas or newlines, blank
/// ones and `#` comments skipped.
fn list_entries(spec: &str) -> impl Iterator<Item = &str> {
    spec.split([',', '\n'])
        .map(str::trim)
        .filter(|s| !s.is_empty() && !s.starts_with('#'))
}

impl TokenSet {
    /// Parses `NAME:ROLE:SHA256HEX` entries (comma or newline separated).
    pub fn parse(spec: &str) -> Result<Self, String> {
        let mut entries = Vec::new();
        for (i, raw) in list_entries(spec).enumerate() {
            let parts: Vec<&str> = raw.split(':').collect();
            if parts.len() != 3 {
                return Err(format!(
                    "auth token entry #{}: expected NAME:ROLE:SHA256HEX",
                    i + 1
                ));
            }
            check_name(parts[0])
                .map_err(|why| format!("auth token entry #{}: the name {why}", i + 1))?;
            let role = Role::parse(parts[1]).ok_or_else(|| {
                format!(
                    "auth token {:?}: role must be orchestrator or operator",
                    parts[0]
                )
            })?;
            let hex = parts[2];
            if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(format!(
                    "auth token {:?}: the hash must be 64 hex digits (sha256 of the token)",
                    parts[0]
                ));
            }
            let mut hash = [0u8; 32];
            for (j, byte) in hash.iter_mut().enumerate() {
                *byte =
                    u8::from_str_radix(&hex[2 * j..2 * j + 2], 16).map_err(|e| e.to_string())?;
            }
            entries.push(Entry {
                name: parts[0].to_string(),
                role,
                hash,
            });
        }
        Ok(Self { entries })
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The caller a presented token belongs to. Every entry is compared,
    /// so the time taken does not tell which one matched.
    pub fn check(&self, token: &str) -> Option<Caller> {
        let digest = sha256(token);
        let mut found = None;
        for e in &self.entries {
            if constant_time_eq(&digest, &e.hash) {
                found = Some(Caller {
                    name: e.name.clone(),
                    role: e.role,
                });
            }
        }
        found
    }
}

/// The flag of [`CertRoles`], for its errors and warnings.
pub const CLIENT_ROLES_FLAG: &str = "--tls-client-roles";

/// Roles of certificate callers (`--tls-client-roles`): entries
/// `CN=NAME=ROLE` (the certificate whose subject common name is NAME) and
/// `OU=UNIT=ROLE` (a certificate with UNIT among its subject's
/// organizational units), and `OU` alone for `OU=orchestrator=orchestrator,
/// OU=operator=operator` (the OU names the role). Values match exactly
/// (case and all). A certificate's role is its CN's entry if there is one
/// (so a CN entry can also take back what an OU would give), else the
/// highest of its OUs' entries (units are groups: their rights add up),
/// else `orchestrator`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CertRoles {
    by_cn: BTreeMap<String, Role>,
    by_ou: BTreeMap<String, Role>,
}

impl CertRoles {
    /// The flag's value: the entries themselves, or `@FILE` for a file of
    /// them (the same grammar; one a line reads best). Errors name the flag
    /// (and the file), with every bad entry at once.
    pub fn load(value: &str) -> Result<Self, String> {
        let (text, origin) = match value.strip_prefix('@') {
            Some(path) => (
                std::fs::read_to_string(path)
                    .map_err(|e| format!("{CLIENT_ROLES_FLAG}: cannot read {path}: {e}"))?,
                format!(" ({path})"),
            ),
            None => (value.to_string(), String::new()),
        };
        Self::parse(&text)
            .map_err(|problems| format!("{CLIENT_ROLES_FLAG}{origin}: {}", problems.join("; ")))
    }

    /// Parses entries separated by commas or newlines (`#` starts a
    /// comment line); `Err` lists every problem.
    pub fn parse(spec: &str) -> Result<Self, Vec<String>> {
        let mut roles = Self::default();
        let mut problems = Vec::new();
        let mut count = 0;
        for (i, raw) in list_entries(spec).enumerate() {
            count += 1;
            let parsed = if raw.eq_ignore_ascii_case("OU") {
                Ok(vec![
                    (true, Role::Orchestrator.as_str(), Role::Orchestrator),
                    (true, Role::Operator.as_str(), Role::Operator),
                ])
            } else {
                parse_role_entry(raw).map(|one| vec![one])
            };
            match parsed {
                Err(why) => problems.push(format!("entry #{} {raw:?}: {why}", i + 1)),
                Ok(found) => {
                    for (is_ou, value, role) in found {
                        let (map, attr) = if is_ou {
                            (&mut roles.by_ou, "OU")
                        } else {
                            (&mut roles.by_cn, "CN")
                        };
                        match map.insert(value.to_string(), role) {
                            Some(before) if before != role => problems.push(format!(
                                "entry #{} {raw:?}: {attr}={value} is given twice, as {} and as {}",
                                i + 1,
                                before.as_str(),
                                role.as_str()
                            )),
                            _ => {}
                        }
                    }
                }
            }
        }
        if count == 0 {
            problems.push("names no entry (CN=NAME=ROLE, OU=UNIT=ROLE or OU)".into());
        }
        if problems.is_empty() {
            Ok(roles)
        } else {
            Err(problems)
        }
    }

    /// The role of a certificate whose subject has `common_name` and
    /// `units`.
    pub fn role_of(&self, common_name: &str, units: &[String]) -> Role {
        if let Some(role) = self.by_cn.get(common_name) {
            return *role;
        }
        units
            .iter()
            .filter_map(|u| self.by_ou.get(u))
            .max()
            .copied()
            .unwrap_or(Role::Orchestrator)
    }
}

/// One `CN=NAME=ROLE` or `OU=UNIT=ROLE`: (is it an OU, the value, the role).
fn parse_role_entry(raw: &str) -> Result<(bool, &str, Role), String> {
    const SHAPE: &str = "expected CN=NAME=ROLE, OU=UNIT=ROLE or OU";
    let (attr, rest) = raw.split_once('=').ok_or(SHAPE)?;
    let (value, role) = rest.rsplit_once('=').ok_or(SHAPE)?;
    let attr = attr.trim();
    let is_ou = if attr.eq_ignore_ascii_case("CN") {
        false
    } else if attr.eq_ignore_ascii_case("OU") {
        true
    } else {
        return Err(format!(
            "only CN (the subject's common name) and OU (its organizational units) are matched, not {attr:?}"
        ));
    };
    let value = value.trim();
    check_name(value).map_err(|why| format!("the {} {why}", attr.to_ascii_uppercase()))?;
    let role = Role::parse(role.trim()).ok_or_else(|| {
        format!(
            "the role must be orchestrator or operator, not {:?}",
            role.trim()
        )
    })?;
    Ok((is_ou, value, role))
}

/// Who callers are (see the module's documentation): the tokens, and the
/// roles of certificate callers.
#[derive(Debug, Clone, Default)]
pub struct AuthPolicy {
    tokens: TokenSet,
    cert_roles: CertRoles,
}

impl AuthPolicy {
    /// From `--auth-tokens`, whether `--tls-client-ca` is set, and
    /// `--tls-client-roles`; errors name the flag. Warns of what leaves
    /// the service open: no authentication at all, or client certificates
    /// without a role source (then nobody is an operator).
    pub fn from_settings(
        auth_tokens: Option<&str>,
        client_ca: bool,
        client_roles: Option<&str>,
    ) -> anyhow::Result<Self> {
        let tokens = TokenSet::parse(auth_tokens.unwrap_or(""))
            .map_err(|e| anyhow::anyhow!("--auth-tokens: {e}"))?;
        let cert_roles = match client_roles {
            None => None,
            Some(_) if !client_ca => anyhow::bail!(
                "{CLIENT_ROLES_FLAG} needs --tls-client-ca: without client certificates nobody is named by one"
            ),
            Some(_) if !tokens.is_empty() => anyhow::bail!(
                "{CLIENT_ROLES_FLAG} has no effect with --auth-tokens: the token names every caller and its role, and a certificate only admits the connection; drop one of the two"
            ),
            Some(v) => Some(CertRoles::load(v).map_err(|e| anyhow::anyhow!(e))?),
        };
        if tokens.is_empty() && !client_ca {
            tracing::warn!(
                "no caller authentication configured (--auth-tokens, --tls-client-ca): anyone who reaches the gRPC port can attach volumes"
            );
        }
        if tokens.is_empty() && client_ca && cert_roles.is_none() {
            tracing::warn!(
                "client certificates are accepted (--tls-client-ca) without a role source ({CLIENT_ROLES_FLAG}): every certificate caller is an orchestrator, and nobody may call ReconcileOperation or ResolveOperation; name operators with {CLIENT_ROLES_FLAG} 'CN=NAME=operator' (or by OU)"
            );
        }
        Ok(Self {
            tokens,
            cert_roles: cert_roles.unwrap_or_default(),
        })
    }

    /// The caller a verified client certificate (DER) names, or why it
    /// names none: see [`certificate_caller_name`].
    pub fn certificate_caller(&self, cert: &[u8]) -> Result<Caller, String> {
        let subject = subject_of(cert).ok_or("the client certificate's subject cannot be read")?;
        let common_name = subject.common_name.ok_or(
            "the client certificate has no readable subject common name (CN): it names no caller",
        )?;
        let (issuer, whole_subject) = issuer_and_subject_of(cert)
            .ok_or("the client certificate's issuer and subject cannot be read")?;
        let name = certificate_caller_name(&common_name, issuer, whole_subject);
        check_name(&name).map_err(|why| format!("the client certificate's common name {why}"))?;
        let role = self.cert_roles.role_of(&common_name, &subject.units);
        Ok(Caller { name, role })
    }
}

/// How many hex digits of the SHA-256 of a certificate's issuer and
/// subject a caller's name carries: 128 bits, so no CA in the trusted
/// bundle can make a subject whose name matches another caller's.
const IDENTITY_HEX: usize = 32;

/// A certificate caller's name: `CN#` and the first 128 bits (hex) of the
/// SHA-256 of the certificate's whole issuer and subject names (DER).
/// The CN alone named callers once: two certificates with one CN — from
/// two CAs of the trusted bundle, or with other units or organizations in
/// their subjects — were one caller, sharing keys and reads. The subject
/// with its issuer is whom a CA vouched for: it stays the caller's across
/// renewals and key rotations (a retry across a renewal joins its
/// operation), and differs for any other subject or CA. The CN stays in
/// front for people (`ops list --caller`, logs); the CN of a name made
/// before stays nobody's, as no certificate is named by a CN alone now.
pub fn certificate_caller_name(common_name: &str, issuer: &[u8], subject: &[u8]) -> String {
    let mut named = ring::digest::Context::new(&ring::digest::SHA256);
    named.update(issuer);
    named.update(subject);
    let digest = named.finish();
    let hex: String = digest.as_ref()[..IDENTITY_HEX / 2]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("{common_name}#{hex}")
}

/// Which role a method needs (the service's from its table,
/// `methods::METHODS`); `None`: open to everybody (health checks). Any
/// other path (reflection, a path no service has) needs a caller the
/// service knows, as an orchestrator.
pub fn required_role(path: &str) -> Option<Role> {
    if path.starts_with("/grpc.health.v1.Health/") {
        return None;
    }
    Some(super::methods::of(path).map_or(Role::Orchestrator, |m| m.role))
}

fn allows(have: Role, need: Role) -> bool {
    have == Role::Operator || need == Role::Orchestrator
}

#[derive(Clone)]
pub struct AuthLayer {
    policy: Arc<AuthPolicy>,
}

impl AuthLayer {
    pub fn new(policy: AuthPolicy) -> Self {
        Self {
            policy: Arc::new(policy),
        }
    }
}

impl<S> Layer<S> for AuthLayer {
    type Service = AuthService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        AuthService {
            inner,
            policy: self.policy.clone(),
        }
    }
}

#[derive(Clone)]
pub struct AuthService<S> {
    inner: S,
    policy: Arc<AuthPolicy>,
}

use crate::domain::BoxFuture;

fn refuse<R: Default>(reason: Reason, message: &str, method: &str) -> http::Response<R> {
    let mut meta = BTreeMap::new();
    meta.insert("method".to_string(), method.to_string());
    super::status::status(reason, message, meta).into_http()
}

/// The caller a request's bearer token names, or why it names none.
fn token_caller<B>(req: &http::Request<B>, tokens: &TokenSet) -> Result<Caller, &'static str> {
    let presented = req
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim)
        .ok_or("credentials required: authorization: Bearer <token>")?;
    tokens
        .check(presented)
        .ok_or("the bearer token is not valid")
}

/// The client certificate the connection was verified with (mutual TLS):
/// tonic puts the connection's info in every request's extensions, and the
/// TLS stream's carries the certificates rustls verified at the handshake
/// (against --tls-client-ca). `None` without TLS or without a client
/// certificate.
fn peer_certificates<B>(
    req: &http::Request<B>,
) -> Option<Arc<Vec<tonic::transport::CertificateDer<'static>>>> {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    req.extensions()
        .get::<TlsConnectInfo<TcpConnectInfo>>()?
        .peer_certs()
}

impl<S, B, R> Service<http::Request<B>> for AuthService<S>
where
    S: Service<http::Request<B>, Response = http::Response<R>> + Send + 'static,
    S::Future: Send + 'static,
    R: Default + Send + 'static,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let Some(need) = required_role(req.uri().path()) else {
            return Box::pin(self.inner.call(req));
        };
        let refused = |req: &http::Request<B>, reason: Reason, message: &str| -> Self::Future {
            let response = refuse(reason, message, req.uri().path());
            Box::pin(async move { Ok(response) })
        };
        let found = if !self.policy.tokens.is_empty() {
            token_caller(&req, &self.policy.tokens).map_err(str::to_string)
        } else if let Some(certs) = peer_certificates(&req)
            && let Some(leaf) = certs.first()
        {
            self.policy.certificate_caller(leaf.as_ref())
        } else {
            // Nobody is authenticated: the one anonymous caller.
            return Box::pin(self.inner.call(req));
        };
        let caller = match found {
            Ok(c) => c,
            Err(why) => return refused(&req, Reason::Unauthenticated, &why),
        };
        if !allows(caller.role, need) {
            let msg = format!(
                "caller {:?} (role {}) may not call {}; it needs role {}",
                caller.name,
                caller.role.as_str(),
                req.uri().path(),
                need.as_str()
            );
            return refused(&req, Reason::PermissionDenied, &msg);
        }
        if let Some(slot) = req.extensions().get::<super::metrics::CallerSlot>() {
            slot.set(&caller.name);
        }
        req.extensions_mut().insert(caller);
        Box::pin(self.inner.call(req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CA (its certificate and key) named `name`.
    fn ca(name: &str) -> (rcgen::Certificate, rcgen::KeyPair) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.distinguished_name.push(rcgen::DnType::CommonName, name);
        (p.self_signed(&key).unwrap(), key)
    }

    /// A client certificate `CN=cn` (and `OU=unit`), with a key of its own,
    /// signed by `ca`: DER.
    fn client(ca: &(rcgen::Certificate, rcgen::KeyPair), cn: &str, unit: Option<&str>) -> Vec<u8> {
        let mut p = rcgen::CertificateParams::new(vec!["client.example".to_string()]).unwrap();
        p.distinguished_name = rcgen::DistinguishedName::new();
        if let Some(unit) = unit {
            p.distinguished_name
                .push(rcgen::DnType::OrganizationalUnitName, unit);
        }
        p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        let key = rcgen::KeyPair::generate().unwrap();
        p.signed_by(&key, &ca.0, &ca.1).unwrap().der().to_vec()
    }

    #[test]
    fn certificates_of_one_cn_are_one_caller_only_for_one_subject_of_one_ca() {
        let policy = AuthPolicy::default();
        let name = |der: &[u8]| policy.certificate_caller(der).unwrap().name;
        let (first, second) = (ca("client CA"), ca("another client CA"));
        let twin = name(&client(&first, "twin", None));
        assert!(
            twin.starts_with("twin#") && twin.len() == "twin#".len() + 32,
            "{twin}"
        );
        // A renewal (a new certificate, a new key) of the same subject by
        // the same CA is the same caller: its keys stay its own.
        assert_eq!(name(&client(&first, "twin", None)), twin);
        // The same CN from another CA, or with another unit, is not.
        for other in [
            client(&second, "twin", None),
            client(&first, "twin", Some("payments")),
        ] {
            assert_ne!(name(&other), twin);
        }
        check_name(&twin).unwrap();
    }

    #[test]
    fn certificate_roles_come_from_the_common_name_first_then_the_units() {
        let roles = CertRoles::parse(
            "CN=oncall=operator, OU=sre=operator\n# a comment line\nCN=demoted=orchestrator,OU",
        )
        .unwrap();
        let units = |u: &[&str]| u.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(roles.role_of("oncall", &[]), Role::Operator);
        assert_eq!(roles.role_of("ci", &units(&["sre"])), Role::Operator);
        assert_eq!(roles.role_of("ci", &units(&["operator"])), Role::Operator);
        assert_eq!(
            roles.role_of("ci", &units(&["orchestrator", "operator"])),
            Role::Operator,
            "units add up"
        );
        assert_eq!(
            roles.role_of("demoted", &units(&["operator"])),
            Role::Orchestrator,
            "a CN entry wins over the units"
        );
        assert_eq!(roles.role_of("ci", &units(&["dev"])), Role::Orchestrator);
        assert_eq!(
            roles.role_of("Oncall", &[]),
            Role::Orchestrator,
            "exact match"
        );
        assert_eq!(
            CertRoles::default().role_of("oncall", &units(&["operator"])),
            Role::Orchestrator,
            "no role source: never an operator"
        );
    }

    #[test]
    fn bad_certificate_role_entries_are_all_reported_with_the_flag() {
        let problems = CertRoles::parse(
            "CN=a=admin,O=x=operator,CN==operator,oncall,CN=b=operator,CN=b=orchestrator,CN=c\u{0}=operator",
        )
        .unwrap_err();
        let all = problems.join("\n");
        for expected in [
            "entry #1 \"CN=a=admin\": the role must be orchestrator or operator",
            "entry #2 \"O=x=operator\": only CN",
            "entry #3 \"CN==operator\": the CN is empty",
            "entry #4 \"oncall\": expected CN=NAME=ROLE",
            "entry #6 \"CN=b=orchestrator\": CN=b is given twice, as operator and as orchestrator",
            "the CN contains the control character '\\0'",
        ] {
            assert!(all.contains(expected), "{expected:?} in:\n{all}");
        }
        assert_eq!(problems.len(), 6, "{all}");
        let e = CertRoles::load(" ,# nothing").unwrap_err();
        assert!(e.starts_with("--tls-client-roles: names no entry"), "{e}");
        let e = CertRoles::load("@/nonexistent/roles").unwrap_err();
        assert!(
            e.starts_with("--tls-client-roles: cannot read /nonexistent/roles"),
            "{e}"
        );
    }

    #[test]
    fn caller_names_are_printable_and_bounded() {
        assert!(check_name("ci-a").is_ok());
        assert!(check_name("orchestrator é").is_ok());
        for bad in ["", "  ", "a\0b", "a\nb", "a\u{7f}"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_name(&"x".repeat(MAX_NAME_LEN)).is_ok());
        assert!(check_name(&"x".repeat(MAX_NAME_LEN + 1)).is_err());
        let e = TokenSet::parse(&format!("a\u{1}b:operator:{}", sha256_hex("t"))).unwrap_err();
        assert!(e.contains("control character"), "{e}");
    }

    #[test]
    fn tokens_are_matched_by_hash_and_roles_gate_methods() {
        let spec = format!(
            "ci:orchestrator:{},alice:operator:{}",
            sha256_hex("t-ci"),
            sha256_hex("t-alice")
        );
        let set = TokenSet::parse(&spec).unwrap();
        assert_eq!(set.check("t-ci").unwrap().role, Role::Orchestrator);
        assert_eq!(set.check("t-alice").unwrap().name, "alice");
        assert!(set.check("t-nobody").is_none());
        assert!(!format!("{set:?}").contains(&sha256_hex("t-ci")));
        let need =
            required_role("/volume_reconciler.v1.VolumeReconciler/ResolveOperation").unwrap();
        assert!(!allows(Role::Orchestrator, need) && allows(Role::Operator, need));
        assert!(required_role("/grpc.health.v1.Health/Check").is_none());
        assert!(TokenSet::parse("x:admin:00").is_err());
        assert!(TokenSet::parse("x:operator:zz").is_err());
    }
}
