//! Caller authentication and authorization, a layer of the server chain.
//!
//! Callers present `authorization: Bearer <token>`. The service keeps only
//! SHA-256 hashes of the tokens, each with a name and a role, and compares
//! in constant time. `orchestrator` may attach, detach, get, list, watch and
//! read events; `operator` may also reconcile and resolve. No credentials
//! when they are required → `UNAUTHENTICATED`; a role without the right →
//! `PERMISSION_DENIED`. The caller's name reaches the handlers (and so the
//! ledger and the reconcile log). Tokens are never logged.
//!
//! A caller authenticated by mutual TLS alone (no tokens configured) is
//! named by its certificate's subject common name, as Kubernetes names
//! users: its operations record it and its idempotency keys are its own.
//! It has the orchestrator's access to other callers' keys (none); methods
//! are not gated by role without tokens, as before. When tokens are
//! configured, the token is required and names the caller, whatever
//! certificate the connection presented.

use std::pin::Pin;
use std::sync::Arc;

use crate::domain::Reason;
use std::task::{Context, Poll};

use tower::{Layer, Service};

/// What a caller may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Orchestrator,
    Operator,
}

impl Role {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "orchestrator" => Some(Role::Orchestrator),
            "operator" => Some(Role::Operator),
            _ => None,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Orchestrator => "orchestrator",
            Role::Operator => "operator",
        }
    }
}

/// The authenticated caller, in the request's extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub name: String,
    pub role: Role,
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

impl TokenSet {
    /// Parses `NAME:ROLE:SHA256HEX` entries (comma or newline separated).
    pub fn parse(spec: &str) -> Result<Self, String> {
        let mut entries = Vec::new();
        for (i, raw) in spec
            .split([',', '\n'])
            .map(str::trim)
            .filter(|s| !s.is_empty() && !s.starts_with('#'))
            .enumerate()
        {
            let parts: Vec<&str> = raw.split(':').collect();
            if parts.len() != 3 {
                return Err(format!(
                    "auth token entry #{}: expected NAME:ROLE:SHA256HEX",
                    i + 1
                ));
            }
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

/// Which role a method needs; `None`: open to everybody (health checks).
pub fn required_role(path: &str) -> Option<Role> {
    let method = path.rsplit('/').next().unwrap_or("");
    if path.starts_with("/grpc.health.v1.Health/") {
        return None;
    }
    match method {
        "ReconcileOperation" | "ResolveOperation" => Some(Role::Operator),
        _ => Some(Role::Orchestrator),
    }
}

fn allows(have: Role, need: Role) -> bool {
    have == Role::Operator || need == Role::Orchestrator
}

#[derive(Clone)]
pub struct AuthLayer {
    tokens: Arc<TokenSet>,
}

impl AuthLayer {
    pub fn new(tokens: TokenSet) -> Self {
        Self {
            tokens: Arc::new(tokens),
        }
    }
}

impl<S> Layer<S> for AuthLayer {
    type Service = AuthService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        AuthService {
            inner,
            tokens: self.tokens.clone(),
        }
    }
}

#[derive(Clone)]
pub struct AuthService<S> {
    inner: S,
    tokens: Arc<TokenSet>,
}

type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send>>;

fn refuse<R: Default>(reason: Reason, message: &str, method: &str) -> http::Response<R> {
    let mut meta = std::collections::BTreeMap::new();
    meta.insert("method".to_string(), method.to_string());
    super::status::status(reason, message, meta).into_http()
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
        if self.tokens.is_empty() {
            if let Some(caller) = certificate_caller(&req) {
                req.extensions_mut().insert(caller);
            }
            return Box::pin(self.inner.call(req));
        }
        let path = req.uri().path().to_string();
        let Some(need) = required_role(&path) else {
            return Box::pin(self.inner.call(req));
        };
        let presented = req
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .map(str::trim);
        let caller = match presented {
            None => {
                return Box::pin(async move {
                    Ok(refuse(
                        Reason::Unauthenticated,
                        "credentials required: authorization: Bearer <token>",
                        &path,
                    ))
                });
            }
            Some(token) => match self.tokens.check(token) {
                Some(c) => c,
                None => {
                    return Box::pin(async move {
                        Ok(refuse(
                            Reason::Unauthenticated,
                            "the bearer token is not valid",
                            &path,
                        ))
                    });
                }
            },
        };
        if !allows(caller.role, need) {
            let msg = format!(
                "caller {:?} (role {}) may not call {path}; it needs role {}",
                caller.name,
                caller.role.as_str(),
                need.as_str()
            );
            return Box::pin(async move { Ok(refuse(Reason::PermissionDenied, &msg, &path)) });
        }
        req.extensions_mut().insert(caller);
        Box::pin(self.inner.call(req))
    }
}

/// The caller a verified client certificate names (mutual TLS): its
/// subject's common name. `None` without TLS, without a client
/// certificate, or when the certificate has no usable common name (the
/// caller is then unnamed, as without authentication).
fn certificate_caller<B>(req: &http::Request<B>) -> Option<Caller> {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    // tonic puts the connection's info in every request's extensions; the
    // TLS stream's carries the certificates rustls verified at the
    // handshake (against --tls-client-ca).
    let certs = req
        .extensions()
        .get::<TlsConnectInfo<TcpConnectInfo>>()?
        .peer_certs()?;
    let name = common_name(certs.first()?.as_ref())?;
    Some(Caller {
        name,
        role: Role::Orchestrator,
    })
}

/// One DER element: (tag, contents, what follows it).
fn der_element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        // Long form: the next (first & 0x7f) bytes are the length.
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, b| (acc << 8) | usize::from(*b));
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

const SEQUENCE: u8 = 0x30;
const SET: u8 = 0x31;
/// id-at-commonName, 2.5.4.3.
const COMMON_NAME: &[u8] = &[0x55, 0x04, 0x03];

/// The subject common name of a DER certificate: the last one when there
/// are several, as Kubernetes reads it. A certificate rustls accepted is
/// well formed; anything unexpected here reads as "no name".
pub fn common_name(cert: &[u8]) -> Option<String> {
    let (SEQUENCE, cert, _) = der_element(cert)? else {
        return None;
    };
    let (SEQUENCE, tbs, _) = der_element(cert)? else {
        return None;
    };
    // version [0] (optional), serialNumber, signature, issuer, validity,
    // then subject.
    let mut rest = tbs;
    if rest.first() == Some(&0xa0) {
        rest = der_element(rest)?.2;
    }
    for _ in 0..4 {
        rest = der_element(rest)?.2;
    }
    let (SEQUENCE, mut rdns, _) = der_element(rest)? else {
        return None;
    };
    let mut found = None;
    while !rdns.is_empty() {
        let (tag, mut set, next) = der_element(rdns)?;
        rdns = next;
        if tag != SET {
            return None;
        }
        while !set.is_empty() {
            let (_, pair, next) = der_element(set)?;
            set = next;
            let (_, oid, value) = der_element(pair)?;
            if oid == COMMON_NAME {
                found = directory_string(value)?;
            }
        }
    }
    found.filter(|n: &String| !n.trim().is_empty())
}

/// A DirectoryString's text (`Some(None)`: a kind not read here).
fn directory_string(value: &[u8]) -> Option<Option<String>> {
    let (tag, text, _) = der_element(value)?;
    Some(match tag {
        // UTF8String, PrintableString, IA5String.
        0x0c | 0x13 | 0x16 => std::str::from_utf8(text).ok().map(str::to_string),
        // BMPString: UTF-16, big-endian.
        0x1e if text.len() % 2 == 0 => String::from_utf16(
            &text
                .chunks(2)
                .map(|c| u16::from_be_bytes([c[0], c[1]]))
                .collect::<Vec<_>>(),
        )
        .ok(),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert_with(dn: &[(rcgen::DnType, rcgen::DnValue)]) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(vec!["orchestrator.example".into()]).unwrap();
        p.distinguished_name = rcgen::DistinguishedName::new();
        for (t, v) in dn {
            p.distinguished_name.push(t.clone(), v.clone());
        }
        p.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn a_certificate_names_its_caller_by_its_subject_common_name() {
        use rcgen::{DnType, DnValue};
        let named = cert_with(&[
            (DnType::OrganizationName, DnValue::Utf8String("ci".into())),
            (
                DnType::CommonName,
                DnValue::Utf8String("orchestrator-é".into()),
            ),
        ]);
        assert_eq!(common_name(&named).as_deref(), Some("orchestrator-é"));
        let printable = cert_with(&[(
            DnType::CommonName,
            DnValue::PrintableString("orchestrator-2".try_into().unwrap()),
        )]);
        assert_eq!(common_name(&printable).as_deref(), Some("orchestrator-2"));
        let bmp = cert_with(&[(
            DnType::CommonName,
            DnValue::BmpString("orchestrator-3".try_into().unwrap()),
        )]);
        assert_eq!(common_name(&bmp).as_deref(), Some("orchestrator-3"));
        let nameless = cert_with(&[(DnType::OrganizationName, DnValue::Utf8String("ci".into()))]);
        assert_eq!(common_name(&nameless), None);
        assert_eq!(common_name(b"not a certificate"), None);
        assert_eq!(common_name(&named[..named.len() / 2]), None);
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
