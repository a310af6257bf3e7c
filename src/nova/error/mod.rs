//! The adapters' errors: one core that Nova's and Cinder's errors share,
//! and what is each one's own.
//!
//! - this file, the core: [`UpstreamError`] says what failed (method, URL,
//!   status, the service's request id, its fault and message, the cause),
//!   in which [`Stage`], after how long of which budget, whether the
//!   request may have reached the service, and — through its kind's
//!   [`Clock`] — which clock fired or what else ended the request, in the
//!   service's words; [`UpstreamError::metadata`] is what a gRPC caller and
//!   the ledger are given. [`Exchange`] is an answer that came whole, the
//!   context of every error made of one.
//! - `nova.rs`: [`NovaErrorKind`] and [`Rejection`] (what Nova's refusal
//!   means), and what Nova's errors decide (`outcome_unknown`, `reason`).
//! - `cinder.rs`: [`CinderErrorKind`], and whether asking Cinder again may
//!   help (`transient`).
//! - `fault.rs`: reading an answer's body when it is not the value asked
//!   for (Nova's fault shape, the auth middleware's 401), and what Nova's
//!   refusal messages mean (`classify_refusal`).

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

mod cinder;
pub(crate) mod fault;
mod nova;

pub use cinder::{CinderError, CinderErrorKind};
pub use nova::{NovaError, NovaErrorKind, Rejection};

use fault::clean_text;

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

/// Which clock fired, or what else ended a request: the ends every
/// adapter's errors share (each said in the service's words, at the stage
/// it came), and a service's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clock {
    /// The outbound deadline (derived from the caller's) expired: before
    /// the request was sent, waiting for a token, for the headers, or
    /// while reading the body.
    CallerDeadline,
    /// Could not connect (TCP or TLS), or the client was shutting down:
    /// the request was never sent.
    ConnectFailed,
    /// Sent, but no complete answer came: nothing by the headers, or a
    /// body cut off.
    ResponseLost,
    /// The service answered with an error of its own.
    Rejected,
    /// The service answered, but not in the shape its contract gives.
    Undecodable,
    /// Keystone did not give us a token.
    AuthFailed,
    /// An end only this service's errors have, in its own words.
    Own(&'static str),
}

/// The OpenStack service a request went to: the words its errors say and
/// the keys its context goes under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upstream {
    Nova,
    Cinder,
}

/// How one service's errors say the shared clocks, and name their context.
/// (Each service's sentences are as they have always been written; only
/// the choice among them is shared.)
struct Words {
    /// `service`'s value in the metadata, when the errors name one.
    service: Option<&'static str>,
    request_id_key: &'static str,
    fault_key: &'static str,
    message_key: &'static str,
    /// The key `may_have_reached` goes under, when it is reported.
    reached_key: Option<&'static str>,
    /// Whether the message (`Display`) quotes the service's request id.
    says_request_id: bool,
    deadline_before_sending: &'static str,
    deadline_awaiting_headers: &'static str,
    deadline_reading_body: &'static str,
    connect_failed: &'static str,
    no_response: &'static str,
    body_cut_off: &'static str,
    rejected: &'static str,
    undecodable: &'static str,
}

const NOVA: Words = Words {
    service: None,
    request_id_key: "nova_request_id",
    fault_key: "nova_fault",
    message_key: "nova_message",
    reached_key: Some("may_have_reached_nova"),
    says_request_id: false,
    deadline_before_sending: "the caller's deadline expired before the request could be sent (waiting for a connection slot, or after it)",
    deadline_awaiting_headers: "the caller's deadline expired waiting for the response headers",
    deadline_reading_body: "the caller's deadline expired while reading the response body",
    connect_failed: "could not connect (the request was never sent)",
    no_response: "the request was sent but no response came",
    body_cut_off: "the response body was cut off",
    rejected: "Nova answered with an error",
    undecodable: "Nova's answer did not fit the contract",
};

const CINDER: Words = Words {
    service: Some("cinder"),
    request_id_key: "cinder_request_id",
    fault_key: "cinder_fault",
    message_key: "cinder_message",
    reached_key: None,
    says_request_id: true,
    deadline_before_sending: "the caller's deadline expired waiting for a connection slot to Cinder",
    deadline_awaiting_headers: "the caller's deadline expired waiting for Cinder's response headers",
    deadline_reading_body: "the caller's deadline expired while reading Cinder's response body",
    connect_failed: "could not connect to Cinder (the request was never sent)",
    no_response: "the request was sent but Cinder did not answer",
    body_cut_off: "Cinder's response body was cut off",
    rejected: "Cinder answered with an error",
    undecodable: "Cinder's answer did not fit the contract",
};

impl Upstream {
    fn words(self) -> &'static Words {
        match self {
            Upstream::Nova => &NOVA,
            Upstream::Cinder => &CINDER,
        }
    }

    /// `clock` at `stage`, in this service's words, for people.
    fn say(self, clock: Clock, stage: Stage) -> &'static str {
        let w = self.words();
        match (clock, stage) {
            (Clock::CallerDeadline, Stage::AcquireSlot) => w.deadline_before_sending,
            (Clock::CallerDeadline, Stage::ReadBody) => w.deadline_reading_body,
            (Clock::CallerDeadline, Stage::Authenticate) => {
                "the caller's deadline expired waiting for a Keystone token"
            }
            (Clock::CallerDeadline, _) => w.deadline_awaiting_headers,
            (Clock::ConnectFailed, _) => w.connect_failed,
            (Clock::ResponseLost, Stage::ReadBody) => w.body_cut_off,
            (Clock::ResponseLost, _) => w.no_response,
            (Clock::Rejected, _) => w.rejected,
            (Clock::Undecodable, _) => w.undecodable,
            (Clock::AuthFailed, _) => "Keystone refused or failed to issue a token",
            (Clock::Own(words), _) => words,
        }
    }
}

/// What one service's errors are, beyond the core they share.
pub trait ErrorKind: fmt::Debug + Clone {
    /// The service whose errors these are.
    const UPSTREAM: Upstream;
    /// The `error_class` a gRPC caller and the ledger are given.
    fn as_str(&self) -> &'static str;
    /// Which clock fired, or what else ended the request.
    fn clock(&self) -> Clock;
    /// What the service's refusal meant, when the kind says
    /// (`rejection` in the metadata).
    fn rejection_name(&self) -> Option<&'static str> {
        None
    }
}

/// A request to an OpenStack service that gave no value, with all the
/// context to explain it: the core of [`NovaError`] and [`CinderError`],
/// and (with `http::FailureKind`) of a request that ended without an
/// answer.
#[derive(Debug, Clone)]
pub struct UpstreamError<K> {
    pub kind: K,
    pub stage: Stage,
    pub method: &'static str,
    pub url: String,
    /// Set when the headers had arrived.
    pub status: Option<u16>,
    /// The service's own id of the request, when an answer (even an
    /// error) came.
    pub request_id: Option<String>,
    /// The name of the service's fault, and its message, when it gave one.
    pub fault: Option<String>,
    pub message: Option<String>,
    pub elapsed: Duration,
    /// The time the request was given (its deadline minus its start).
    pub budget: Duration,
    /// False only when the request provably never left this process.
    pub may_have_reached: bool,
    pub cause: String,
}

impl<K> UpstreamError<K> {
    /// The same error, of another service's kind (`http::Failure` made
    /// Nova's or Cinder's).
    pub(crate) fn map_kind<L>(self, f: impl FnOnce(K) -> L) -> UpstreamError<L> {
        UpstreamError {
            kind: f(self.kind),
            stage: self.stage,
            method: self.method,
            url: self.url,
            status: self.status,
            request_id: self.request_id,
            fault: self.fault,
            message: self.message,
            elapsed: self.elapsed,
            budget: self.budget,
            may_have_reached: self.may_have_reached,
            cause: self.cause,
        }
    }
}

impl<K: ErrorKind> UpstreamError<K> {
    /// Which clock fired, in words, for people.
    pub fn clock(&self) -> &'static str {
        K::UPSTREAM.say(self.kind.clock(), self.stage)
    }

    /// Every piece of context, as `ErrorInfo`/event metadata (free of NUL,
    /// which a ledger row cannot hold: see `fault::clean_text`).
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
        let w = K::UPSTREAM.words();
        let mut m = BTreeMap::new();
        if let Some(service) = w.service {
            m.insert("service".into(), service.into());
        }
        m.insert("method".into(), self.method.to_string());
        m.insert("url".into(), self.url.clone());
        m.insert("stage".into(), self.stage.as_str().into());
        m.insert("error_class".into(), self.kind.as_str().into());
        if let Some(r) = self.kind.rejection_name() {
            m.insert("rejection".into(), r.into());
        }
        if let Some(s) = self.status {
            m.insert("http_status".into(), s.to_string());
        }
        for (key, value) in [
            (w.request_id_key, &self.request_id),
            (w.fault_key, &self.fault),
            (w.message_key, &self.message),
        ] {
            if let Some(v) = value {
                m.insert(key.into(), v.clone());
            }
        }
        m.insert("elapsed_ms".into(), self.elapsed.as_millis().to_string());
        m.insert(
            "outbound_budget_ms".into(),
            self.budget.as_millis().to_string(),
        );
        if let Some(key) = w.reached_key {
            m.insert(key.into(), self.may_have_reached.to_string());
        }
        m.insert("cause".into(), self.cause.clone());
        m
    }
}

impl<K: ErrorKind> fmt::Display for UpstreamError<K> {
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
        if let Some(fault) = &self.fault {
            write!(f, ", {fault}")?;
        }
        if let Some(m) = &self.message {
            write!(f, ": {m:?}")?;
        }
        if K::UPSTREAM.words().says_request_id
            && let Some(id) = &self.request_id
        {
            write!(f, ", request {id}")?;
        }
        write!(f, "): {}", self.cause)
    }
}

impl<K: ErrorKind> std::error::Error for UpstreamError<K> {}

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

#[cfg(test)]
mod tests {
    use super::*;

    fn error<K>(kind: K, stage: Stage) -> UpstreamError<K> {
        UpstreamError {
            kind,
            stage,
            method: "GET",
            url: "http://x/v".into(),
            status: Some(503),
            request_id: Some("req-1".into()),
            fault: Some("serviceUnavailable".into()),
            message: Some("down".into()),
            elapsed: Duration::from_millis(7),
            budget: Duration::from_millis(900),
            may_have_reached: true,
            cause: "HTTP 503".into(),
        }
    }

    #[test]
    fn each_service_says_the_shared_clocks_in_its_own_words() {
        use CinderErrorKind as C;
        use NovaErrorKind as N;
        for (said, want) in [
            (
                error(N::DeadlineExceeded, Stage::AcquireSlot).clock(),
                "the caller's deadline expired before the request could be sent (waiting for a connection slot, or after it)",
            ),
            (
                error(C::DeadlineExceeded, Stage::AcquireSlot).clock(),
                "the caller's deadline expired waiting for a connection slot to Cinder",
            ),
            (
                error(N::DeadlineExceeded, Stage::Connect).clock(),
                "the caller's deadline expired waiting for the response headers",
            ),
            (
                error(C::DeadlineExceeded, Stage::ReadBody).clock(),
                "the caller's deadline expired while reading Cinder's response body",
            ),
            (
                error(C::DeadlineExceeded, Stage::Authenticate).clock(),
                "the caller's deadline expired waiting for a Keystone token",
            ),
            (
                error(N::ResponseLost, Stage::ReadBody).clock(),
                "the response body was cut off",
            ),
            (
                error(C::ResponseLost, Stage::AwaitHeaders).clock(),
                "the request was sent but Cinder did not answer",
            ),
            (
                error(N::ConnectFailed, Stage::Connect).clock(),
                "could not connect (the request was never sent)",
            ),
            (
                error(C::Rejected, Stage::ReadBody).clock(),
                "Cinder answered with an error",
            ),
            (
                error(N::Foreign, Stage::Decode).clock(),
                "the answer was not Nova's (a proxy's or a load balancer's page?): its effect is unknown",
            ),
            (
                error(C::NoEndpoint, Stage::Authenticate).clock(),
                "the Keystone catalog has no block-storage endpoint",
            ),
        ] {
            assert_eq!(said, want);
        }
        // Cinder's message quotes its request id; Nova's does not.
        let nova = error(N::Rejected(Rejection::ServerError), Stage::ReadBody);
        assert_eq!(
            nova.to_string(),
            "GET http://x/v: Nova answered with an error (stage read_body, after 7 ms of a 900 ms budget, HTTP 503, serviceUnavailable: \"down\"): HTTP 503"
        );
        let cinder = error(C::Rejected, Stage::ReadBody);
        assert_eq!(
            cinder.to_string(),
            "GET http://x/v: Cinder answered with an error (stage read_body, after 7 ms of a 900 ms budget, HTTP 503, serviceUnavailable: \"down\", request req-1): HTTP 503"
        );
    }

    #[test]
    fn each_service_names_its_context_under_its_own_keys() {
        let keys = |m: BTreeMap<String, String>| m.into_keys().collect::<Vec<_>>();
        assert_eq!(
            keys(
                error(
                    NovaErrorKind::Rejected(Rejection::ServerError),
                    Stage::ReadBody
                )
                .metadata()
            ),
            [
                "cause",
                "elapsed_ms",
                "error_class",
                "http_status",
                "may_have_reached_nova",
                "method",
                "nova_fault",
                "nova_message",
                "nova_request_id",
                "outbound_budget_ms",
                "rejection",
                "stage",
                "url"
            ]
        );
        assert_eq!(
            keys(error(CinderErrorKind::Rejected, Stage::ReadBody).metadata()),
            [
                "cause",
                "cinder_fault",
                "cinder_message",
                "cinder_request_id",
                "elapsed_ms",
                "error_class",
                "http_status",
                "method",
                "outbound_budget_ms",
                "service",
                "stage",
                "url"
            ]
        );
    }
}
