//! Nova's errors: which clock fired or what else ended the request, and
//! what Nova's own refusal meant, classified by meaning, not status alone.

use super::{Clock, ErrorKind, Upstream, UpstreamError};
use crate::domain::Reason;

/// A Nova request that gave no value (see [`UpstreamError`]).
pub type NovaError = UpstreamError<NovaErrorKind>;

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
    /// 404 "Instance X is not attached to volume Y", naming this
    /// server and this volume (`answer.rs` reads the ids): a detach is
    /// done.
    NotAttached,
    /// 404 "Instance X could not be found.", naming this server. On a
    /// detach it decides only once a look at the server agrees
    /// (`classify.rs`).
    ServerNotFound,
    /// 404 "Volume X could not be found.", naming this volume.
    VolumeNotFound,
    /// 403 "Policy doesn't allow ... to be performed.".
    Forbidden,
    /// 403 "The maximum allowed number of disk devices (N) to attach to a
    /// single instance has been exceeded.": the server takes no more
    /// volumes (Nova's `[compute] max_disk_devices_to_attach`).
    TooManyDisks,
    /// 409: locked, or in a task_state: transient, did not take effect.
    Conflict,
    /// 413/429 overLimit: throttled, did not take effect.
    Throttled,
    /// A 400 whose message says it is final whatever the moment: a body
    /// the schema refuses, a device path, a microversion, a server's
    /// availability zone or state that the request cannot have.
    BadRequest,
    /// Nova's refusal (its fault for a 400 or a 403) whose message the
    /// service does not read: translated (Nova translates its messages
    /// into the request's `Accept-Language`, which something in front of
    /// it may add), a text it does not know, or one about another volume.
    /// Nothing took effect; why is not known, so it decides nothing final
    /// by itself (`classify.rs`).
    Unread { status: u16 },
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
            Rejection::TooManyDisks => "too_many_disks",
            Rejection::Conflict => "conflict",
            Rejection::Throttled => "throttled",
            Rejection::BadRequest => "bad_request",
            Rejection::Unread { .. } => "not_read",
            Rejection::Unauthorized => "unauthorized",
            Rejection::ServerError => "server_error",
            Rejection::Other => "other",
        }
    }
}

/// Which clock fired, or what else ended a Nova request.
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

impl ErrorKind for NovaErrorKind {
    const UPSTREAM: Upstream = Upstream::Nova;

    fn as_str(&self) -> &'static str {
        NovaErrorKind::as_str(self)
    }

    fn clock(&self) -> Clock {
        match self {
            NovaErrorKind::DeadlineExceeded => Clock::CallerDeadline,
            NovaErrorKind::ConnectFailed => Clock::ConnectFailed,
            NovaErrorKind::ResponseLost => Clock::ResponseLost,
            NovaErrorKind::Rejected(_) => Clock::Rejected,
            NovaErrorKind::Undecodable => Clock::Undecodable,
            NovaErrorKind::AuthFailed => Clock::AuthFailed,
            NovaErrorKind::Foreign => Clock::Own(
                "the answer was not Nova's (a proxy's or a load balancer's page?): its effect is unknown",
            ),
            NovaErrorKind::TooLarge => {
                Clock::Own("the response body exceeded the size cap and was not read")
            }
            NovaErrorKind::Withheld => Clock::Own(
                "not sent: this replica could not confirm it still holds the operation's lease",
            ),
        }
    }

    fn rejection_name(&self) -> Option<&'static str> {
        match self {
            NovaErrorKind::Rejected(r) => Some(r.as_str()),
            _ => None,
        }
    }
}

impl NovaError {
    /// True when Nova may have acted and only an observation can tell.
    pub fn outcome_unknown(&self) -> bool {
        match &self.kind {
            NovaErrorKind::DeadlineExceeded
            | NovaErrorKind::ResponseLost
            | NovaErrorKind::Undecodable
            | NovaErrorKind::Foreign
            | NovaErrorKind::TooLarge => self.may_have_reached,
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
                Rejection::TooManyDisks => Reason::NovaTooManyDisks,
                Rejection::Conflict => Reason::NovaConflict,
                Rejection::Throttled => Reason::NovaThrottled,
                Rejection::BadRequest | Rejection::Unread { status: 400 } => Reason::NovaBadRequest,
                Rejection::Unread { status: 403 } => Reason::NovaForbidden,
                Rejection::Unread { .. } => Reason::NovaUnexpectedStatus,
                Rejection::Unauthorized => Reason::NovaUnauthorized,
                Rejection::ServerError => Reason::NovaServerError,
                Rejection::Other => Reason::NovaUnexpectedStatus,
            },
        }
    }
}
