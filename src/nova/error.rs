//! The adapter's error: which stage failed, which clock fired, whether the
//! request may have reached Nova, and all the context to explain it.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use super::types::{Fault, clean_text};
use crate::domain::Reason;

/// Where in a request's life the failure happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Waiting for a slot under the per-host concurrency cap, or found out
    /// of time once it had one: nothing was sent.
    AcquireSlot,
    /// Getting a Keystone token.
    Authenticate,
    /// TCP connect or TLS handshake: nothing was sent.
    Connect,
    /// Sending the request or waiting for the response headers.
    AwaitHeaders,
    /// Reading the response body.
    ReadBody,
    /// The body arrived whole but is not what the contract says.
    Decode,
}

impl Stage {
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::AcquireSlot => "acquire_slot",
            Stage::Authenticate => "authenticate",
            Stage::Connect => "connect",
            Stage::AwaitHeaders => "await_headers",
            Stage::ReadBody => "read_body",
            Stage::Decode => "decode",
        }
    }
}

/// What Nova's own answer meant, classified by meaning, not status alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// 400 "volume X is already attached to instances: Y" (or "already
    /// attached" for multiattach): the attach may be ours. Re-observe.
    AlreadyAttached { servers: Vec<String> },
    /// 400 on detach: the volume is not in use — a detach is in progress,
    /// or an attach has not finished yet.
    Detaching,
    /// 400 "status must be available ... but the current status is X": the
    /// volume is being created, downloaded or reserved — transient.
    VolumeNotReady { status: String },
    /// 409 "The supplied device path (...) is in use": permanent.
    DeviceInUse,
    /// 404 "Instance X is not attached to volume Y": a detach is done.
    NotAttached,
    /// 404 "Instance X could not be found." On a detach it decides only
    /// once a look at the server agrees (`classify.rs`).
    ServerNotFound,
    /// 404 "Volume X could not be found."
    VolumeNotFound,
    /// 403: policy or "maximum allowed number of disk devices".
    Forbidden,
    /// 409: locked, or in a task_state: transient, did not take effect.
    Conflict,
    /// 413/429 overLimit: throttled, did not take effect.
    Throttled,
    /// Any other 400: a definitive refusal.
    BadRequest,
    /// 401 even after re-authenticating once.
    Unauthorized,
    /// Nova's own 5xx (`computeFault`, `serviceUnavailable`): the outcome
    /// is unknown. (A proxy's 502/504 page is `NovaErrorKind::Foreign`.)
    ServerError,
    /// Any other status Nova answered with its fault, or a 404 that is
    /// about none of the server, the volume, the attachment: unknown.
    Other,
}

impl Rejection {
    pub fn as_str(&self) -> &'static str {
        match self {
            Rejection::AlreadyAttached { .. } => "already_attached",
            Rejection::Detaching => "detaching",
            Rejection::VolumeNotReady { .. } => "volume_not_ready",
            Rejection::DeviceInUse => "device_in_use",
            Rejection::NotAttached => "not_attached",
            Rejection::ServerNotFound => "server_not_found",
            Rejection::VolumeNotFound => "volume_not_found",
            Rejection::Forbidden => "forbidden",
            Rejection::Conflict => "conflict",
            Rejection::Throttled => "throttled",
            Rejection::BadRequest => "bad_request",
            Rejection::Unauthorized => "unauthorized",
            Rejection::ServerError => "server_error",
            Rejection::Other => "other",
        }
    }
}

/// Which clock fired, or what else ended the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NovaErrorKind {
    /// The outbound deadline (derived from the caller's) expired.
    DeadlineExceeded,
    /// Could not connect (TCP or TLS): the request was never sent.
    ConnectFailed,
    /// Sent, but no complete answer came (reset, closed, truncated body).
    ResponseLost,
    /// Nova answered with an error.
    Rejected(Rejection),
    /// Nova answered 2xx with a body that does not fit the contract, or a
    /// success Nova does not give for this call at this microversion (a
    /// 202 attach below 2.101, a 200 from 2.101, a detach's 202 with a
    /// body): not Nova's word that it acted.
    Undecodable,
    /// An error status whose body is not Nova's fault (nor, for a 401,
    /// keystonemiddleware's): a proxy's or an ingress's page, a JSON body
    /// cut short, another service answering. It says nothing about what
    /// Nova did: of unknown effect, like a lost response.
    Foreign,
    /// The body ran past the size cap (`http::MAX_BODY_BYTES`): not read
    /// whole, so nothing is known from it.
    TooLarge,
    /// Keystone did not give us a token.
    AuthFailed,
    /// Kept from leaving by its gate (the operation's lease could not be
    /// confirmed): never sent.
    Withheld,
}

impl NovaErrorKind {
    pub fn as_str(&self) -> &'static str {
        match self {
            NovaErrorKind::DeadlineExceeded => "deadline_exceeded",
            NovaErrorKind::ConnectFailed => "connect_failed",
            NovaErrorKind::ResponseLost => "response_lost",
            NovaErrorKind::Rejected(_) => "rejected",
            NovaErrorKind::Undecodable => "undecodable",
            NovaErrorKind::Foreign => "foreign_answer",
            NovaErrorKind::TooLarge => "body_too_large",
            NovaErrorKind::AuthFailed => "auth_failed",
            NovaErrorKind::Withheld => "withheld",
        }
    }
}

#[derive(Debug, Clone)]
pub struct NovaError {
    pub kind: NovaErrorKind,
    pub stage: Stage,
    pub method: &'static str,
    pub url: String,
    pub status: Option<u16>,
    /// Nova's own id of the request, when an answer (even an error) came.
    pub nova_request_id: Option<String>,
    pub nova_fault: Option<String>,
    pub nova_message: Option<String>,
    pub elapsed: Duration,
    /// The time the request was given (its deadline minus its start).
    pub budget: Duration,
    /// False only when the request provably never left this process.
    pub may_have_reached_nova: bool,
    pub cause: String,
}

impl NovaError {
    /// True when Nova may have acted and only an observation can tell.
    pub fn outcome_unknown(&self) -> bool {
        match &self.kind {
            NovaErrorKind::DeadlineExceeded
            | NovaErrorKind::ResponseLost
            | NovaErrorKind::Undecodable
            | NovaErrorKind::Foreign
            | NovaErrorKind::TooLarge => self.may_have_reached_nova,
            NovaErrorKind::Rejected(Rejection::ServerError | Rejection::Other) => true,
            _ => false,
        }
    }

    pub fn rejection(&self) -> Option<&Rejection> {
        match &self.kind {
            NovaErrorKind::Rejected(r) => Some(r),
            _ => None,
        }
    }

    /// The reason code for ledgers and `ErrorInfo`.
    pub fn reason(&self) -> Reason {
        match &self.kind {
            NovaErrorKind::DeadlineExceeded => Reason::NovaTimeout,
            NovaErrorKind::ConnectFailed => Reason::NovaUnreachable,
            NovaErrorKind::ResponseLost => Reason::NovaResponseLost,
            // Not Nova's answer, or not one read whole: Nova's reasons
            // are for what Nova said.
            NovaErrorKind::Undecodable | NovaErrorKind::Foreign | NovaErrorKind::TooLarge => {
                Reason::NovaBadResponse
            }
            NovaErrorKind::AuthFailed => Reason::KeystoneAuthFailed,
            NovaErrorKind::Withheld => Reason::NotSent,
            NovaErrorKind::Rejected(r) => match r {
                Rejection::AlreadyAttached { .. } => Reason::NovaAlreadyAttached,
                Rejection::Detaching => Reason::NovaDetaching,
                Rejection::VolumeNotReady { .. } => Reason::NovaVolumeNotReady,
                Rejection::DeviceInUse => Reason::NovaDeviceInUse,
                Rejection::NotAttached => Reason::NovaNotAttached,
                Rejection::ServerNotFound => Reason::NovaServerNotFound,
                Rejection::VolumeNotFound => Reason::NovaVolumeNotFound,
                Rejection::Forbidden => Reason::NovaForbidden,
                Rejection::Conflict => Reason::NovaConflict,
                Rejection::Throttled => Reason::NovaThrottled,
                Rejection::BadRequest => Reason::NovaBadRequest,
                Rejection::Unauthorized => Reason::NovaUnauthorized,
                Rejection::ServerError => Reason::NovaServerError,
                Rejection::Other => Reason::NovaUnexpectedStatus,
            },
        }
    }

    /// Every piece of context, as `ErrorInfo`/event metadata (free of NUL,
    /// which a ledger row cannot hold: see `types::clean_text`).
    pub fn metadata(&self) -> BTreeMap<String, String> {
        let mut m = self.raw_metadata();
        for v in m.values_mut() {
            if v.contains('\0') {
                *v = clean_text(v);
            }
        }
        m
    }

    fn raw_metadata(&self) -> BTreeMap<String, String> {
        let mut m = BTreeMap::new();
        m.insert("method".into(), self.method.to_string());
        m.insert("url".into(), self.url.clone());
        m.insert("stage".into(), self.stage.as_str().into());
        m.insert("error_class".into(), self.kind.as_str().into());
        if let Some(r) = self.rejection() {
            m.insert("rejection".into(), r.as_str().into());
        }
        if let Some(s) = self.status {
            m.insert("http_status".into(), s.to_string());
        }
        if let Some(id) = &self.nova_request_id {
            m.insert("nova_request_id".into(), id.clone());
        }
        if let Some(f) = &self.nova_fault {
            m.insert("nova_fault".into(), f.clone());
        }
        if let Some(msg) = &self.nova_message {
            m.insert("nova_message".into(), msg.clone());
        }
        m.insert("elapsed_ms".into(), self.elapsed.as_millis().to_string());
        m.insert(
            "outbound_budget_ms".into(),
            self.budget.as_millis().to_string(),
        );
        m.insert(
            "may_have_reached_nova".into(),
            self.may_have_reached_nova.to_string(),
        );
        m.insert("cause".into(), self.cause.clone());
        m
    }

    /// Which clock fired, in words, for people.
    pub fn clock(&self) -> &'static str {
        match (&self.kind, self.stage) {
            (NovaErrorKind::DeadlineExceeded, Stage::AcquireSlot) => {
                "the caller's deadline expired before the request could be sent (waiting for a connection slot, or after it)"
            }
            (NovaErrorKind::DeadlineExceeded, Stage::ReadBody) => {
                "the caller's deadline expired while reading the response body"
            }
            (NovaErrorKind::DeadlineExceeded, Stage::Authenticate) => {
                "the caller's deadline expired waiting for a Keystone token"
            }
            (NovaErrorKind::DeadlineExceeded, _) => {
                "the caller's deadline expired waiting for the response headers"
            }
            (NovaErrorKind::ConnectFailed, _) => "could not connect (the request was never sent)",
            (NovaErrorKind::ResponseLost, Stage::ReadBody) => "the response body was cut off",
            (NovaErrorKind::ResponseLost, _) => "the request was sent but no response came",
            (NovaErrorKind::Rejected(_), _) => "Nova answered with an error",
            (NovaErrorKind::Undecodable, _) => "Nova's answer did not fit the contract",
            (NovaErrorKind::Foreign, _) => {
                "the answer was not Nova's (a proxy's or a load balancer's page?): its effect is unknown"
            }
            (NovaErrorKind::TooLarge, _) => {
                "the response body exceeded the size cap and was not read"
            }
            (NovaErrorKind::AuthFailed, _) => "Keystone refused or failed to issue a token",
            (NovaErrorKind::Withheld, _) => {
                "not sent: this replica could not confirm it still holds the operation's lease"
            }
        }
    }
}

impl fmt::Display for NovaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}: {} (stage {}, after {} ms of a {} ms budget",
            self.method,
            self.url,
            self.clock(),
            self.stage.as_str(),
            self.elapsed.as_millis(),
            self.budget.as_millis()
        )?;
        if let Some(s) = self.status {
            write!(f, ", HTTP {s}")?;
        }
        if let Some(fault) = &self.nova_fault {
            write!(f, ", {fault}")?;
        }
        if let Some(m) = &self.nova_message {
            write!(f, ": {m:?}")?;
        }
        write!(f, "): {}", self.cause)
    }
}

impl std::error::Error for NovaError {}

/// The whole chain of an error's causes, `a: b: c` (NUL-free: it goes into
/// ledger rows).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let next = c.to_string();
        if !s.contains(&next) {
            s.push_str(": ");
            s.push_str(&next);
        }
        cur = c.source();
    }
    clean_text(&s)
}

/// Classifies a non-2xx answer by what it means.
pub fn classify(status: u16, fault: &Fault) -> Rejection {
    let msg = fault.message.as_deref().unwrap_or("");
    match status {
        400 => {
            if let Some(pos) = msg.find("already attached to instances:") {
                let rest = &msg[pos + "already attached to instances:".len()..];
                let servers = rest
                    .split(|c: char| c.is_whitespace() || c == ',' || c == '.')
                    .filter(|s| s.len() == 36)
                    .map(str::to_string)
                    .collect();
                Rejection::AlreadyAttached { servers }
            } else if msg.contains("already attached") {
                Rejection::AlreadyAttached {
                    servers: Vec::new(),
                }
            } else if msg.contains("Unable to detach volume") || msg.contains("detaching") {
                Rejection::Detaching
            } else if let Some(pos) = msg.find("status must be available") {
                // Cinder's reserve: the volume is creating, downloading or
                // reserved — the create-then-attach race, transient.
                let status = msg[pos..]
                    .split("status is ")
                    .nth(1)
                    .map(|s| s.split(['.', ' ', ')']).next().unwrap_or("").to_string())
                    .unwrap_or_default();
                Rejection::VolumeNotReady { status }
            } else {
                Rejection::BadRequest
            }
        }
        401 => Rejection::Unauthorized,
        403 => Rejection::Forbidden,
        // Only the three 404s Nova's attachment calls give mean something;
        // any other ("The resource could not be found.", Nova's router's
        // answer to a path it has no route for) is not about the server.
        404 => {
            if msg.contains("is not attached to volume") {
                Rejection::NotAttached
            } else if msg.starts_with("Volume ") && msg.contains("could not be found") {
                Rejection::VolumeNotFound
            } else if msg.starts_with("Instance ") && msg.contains("could not be found") {
                Rejection::ServerNotFound
            } else {
                Rejection::Other
            }
        }
        409 if msg.contains("device path") && msg.contains("in use") => Rejection::DeviceInUse,
        409 => Rejection::Conflict,
        413 | 429 => Rejection::Throttled,
        500..=599 => Rejection::ServerError,
        _ => Rejection::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nova::types::parse_fault;

    fn fault(body: &str) -> Fault {
        parse_fault(body.as_bytes())
    }

    #[test]
    fn classifies_the_contracts_real_messages() {
        let f = fault(
            r#"{"badRequest": {"code": 400, "message": "Invalid volume: volume a07f71dc-8151-4e7d-a0cc-cd24a3f11113 is already attached to instances: 7ebed2ce-85b3-40b5-84ae-8cc725c37ed2"}}"#,
        );
        assert_eq!(f.name.as_deref(), Some("badRequest"));
        assert_eq!(
            classify(400, &f),
            Rejection::AlreadyAttached {
                servers: vec!["7ebed2ce-85b3-40b5-84ae-8cc725c37ed2".into()]
            }
        );
        let f = fault(
            r#"{"conflictingRequest": {"message": "Cannot 'attach_volume' instance b2f72dcc while it is in task_state resize_finish", "code": 409}}"#,
        );
        assert_eq!(classify(409, &f), Rejection::Conflict);
        let f = fault(
            r#"{"itemNotFound": {"code": 404, "message": "Instance 7ebed2ce-85b3-40b5-84ae-8cc725c37ed2 could not be found."}}"#,
        );
        assert_eq!(classify(404, &f), Rejection::ServerNotFound);
        let f = fault(
            r#"{"itemNotFound": {"code": 404, "message": "Volume a07f71dc could not be found."}}"#,
        );
        assert_eq!(classify(404, &f), Rejection::VolumeNotFound);
        let f = fault(
            r#"{"itemNotFound": {"code": 404, "message": "Instance x is not attached to volume y"}}"#,
        );
        assert_eq!(classify(404, &f), Rejection::NotAttached);
        let f = fault(
            r#"{"forbidden": {"code": 403, "message": "The maximum allowed number of disk devices (26) to attach to a single instance has been exceeded."}}"#,
        );
        assert_eq!(classify(403, &f), Rejection::Forbidden);
        let f = fault(
            r#"{"badRequest": {"code": 400, "message": "Invalid volume: Invalid input received: Invalid volume: Unable to detach volume. Volume status must be 'in-use' and attach_status must be 'attached' to detach. (HTTP 400)"}}"#,
        );
        assert_eq!(classify(400, &f), Rejection::Detaching);
        let f = fault(
            r#"{"badRequest": {"message": "Invalid input received: Invalid volume: Volume status must be available to reserve, but the status is creating. (HTTP 400) (Request-ID: req-1)", "code": 400}}"#,
        );
        assert_eq!(
            classify(400, &f),
            Rejection::VolumeNotReady {
                status: "creating".into()
            }
        );
        let f = fault(
            r#"{"badRequest": {"message": "Invalid input received: Invalid volume: Volume a07f status must be available or downloading to reserve, but the current status is reserved. (HTTP 400) (Request-ID: req-2)", "code": 400}}"#,
        );
        assert_eq!(
            classify(400, &f),
            Rejection::VolumeNotReady {
                status: "reserved".into()
            }
        );
        let f = fault(
            r#"{"conflictingRequest": {"code": 409, "message": "The supplied device path (/dev/vdb) is in use."}}"#,
        );
        assert_eq!(classify(409, &f), Rejection::DeviceInUse);
        let f = fault(
            r#"{"error": {"code": 401, "title": "Unauthorized", "message": "The request you have made requires authentication."}}"#,
        );
        assert_eq!(f.name.as_deref(), Some("error"));
        assert_eq!(classify(401, &f), Rejection::Unauthorized);
        let f = fault("Gateway Timeout");
        assert_eq!(f.name, None);
        assert_eq!(f.message.as_deref(), Some("Gateway Timeout"));
        assert_eq!(classify(504, &f), Rejection::ServerError);
        let f = fault(r#"{"computeFault": {"code": 500, "message": "Unexpected API Error."}}"#);
        assert_eq!(classify(500, &f), Rejection::ServerError);
        // Nova's router's 404 for a path it does not serve is about no
        // server: not "server not found".
        let f = fault(
            r#"{"itemNotFound": {"code": 404, "message": "The resource could not be found."}}"#,
        );
        assert_eq!(classify(404, &f), Rejection::Other);
    }
}
