//! Caller authentication and authorization, a layer of the server chain.
//!
//! Callers present `authorization: Bearer <token>`. The service keeps only
//! SHA-256 hashes of the tokens, each with a name and a role, and compares
//! in constant time. `orchestrator` may attach, detach, get, list, watch and
//! read events; `operator` may also reconcile and resolve. No credentials
//! when they are required → `UNAUTHENTICATED`; a role without the right →
//! `PERMISSION_DENIED`. The caller's name reaches the handlers (and so the
//! ledger and the reconcile log). Tokens are never logged.

use std::pin::Pin;
use std::sync::Arc;

use crate::domain::Reason;
use std::task::{Context, Poll};

use sha2::{Digest, Sha256};
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

pub fn sha256_hex(token: &str) -> String {
    Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
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
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
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

#[cfg(test)]
mod tests {
    use super::*;

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
