//! Cinder's errors: which clock fired or what else ended the request,
//! and whether asking again may help.

use super::{Clock, ErrorKind, Upstream, UpstreamError};

/// A Cinder request that gave no volume (see [`UpstreamError`]).
pub type CinderError = UpstreamError<CinderErrorKind>;

/// Which clock fired, or what else ended a Cinder request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CinderErrorKind {
    /// The outbound deadline (derived from the caller's) expired.
    DeadlineExceeded,
    /// Could not connect (TCP or TLS): the request was never sent.
    ConnectFailed,
    /// Sent, but no complete answer came (reset, closed, truncated body).
    ResponseLost,
    /// 404 "Volume X could not be found.": deleted, or not in this project.
    VolumeNotFound,
    /// 406: the cloud does not serve `--cinder-microversion`.
    MicroversionUnsupported,
    /// Any other error status (401 after re-authenticating, 403, 400, a 404
    /// that is not about the volume, 413/429, 5xx, a proxy's page).
    Rejected,
    /// A 2xx whose body does not fit the contract (or is about another
    /// volume).
    Undecodable,
    /// Keystone did not give us a token.
    AuthFailed,
    /// The Keystone catalog has no block-storage (or volumev3) endpoint.
    NoEndpoint,
}

impl CinderErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::ConnectFailed => "connect_failed",
            Self::ResponseLost => "response_lost",
            Self::VolumeNotFound => "volume_not_found",
            Self::MicroversionUnsupported => "microversion_unsupported",
            Self::Rejected => "rejected",
            Self::Undecodable => "undecodable",
            Self::AuthFailed => "auth_failed",
            Self::NoEndpoint => "no_endpoint",
        }
    }
}

impl ErrorKind for CinderErrorKind {
    const UPSTREAM: Upstream = Upstream::Cinder;

    fn as_str(&self) -> &'static str {
        CinderErrorKind::as_str(*self)
    }

    fn clock(&self) -> Clock {
        match self {
            Self::DeadlineExceeded => Clock::CallerDeadline,
            Self::ConnectFailed => Clock::ConnectFailed,
            Self::ResponseLost => Clock::ResponseLost,
            Self::Rejected => Clock::Rejected,
            Self::Undecodable => Clock::Undecodable,
            Self::AuthFailed => Clock::AuthFailed,
            Self::VolumeNotFound => Clock::Own("Cinder does not know the volume"),
            Self::MicroversionUnsupported => {
                Clock::Own("Cinder does not serve the requested microversion")
            }
            Self::NoEndpoint => Clock::Own("the Keystone catalog has no block-storage endpoint"),
        }
    }
}

impl CinderError {
    /// Whether asking again (with time left) may give an answer: transport
    /// failures, Keystone, throttling, 5xx. Not: the volume is gone, the
    /// configuration is wrong, or access is refused.
    pub fn transient(&self) -> bool {
        match self.kind {
            CinderErrorKind::DeadlineExceeded
            | CinderErrorKind::ConnectFailed
            | CinderErrorKind::ResponseLost
            | CinderErrorKind::Undecodable
            | CinderErrorKind::AuthFailed => true,
            CinderErrorKind::Rejected => {
                matches!(self.status, Some(409 | 413 | 429 | 500..=599))
            }
            CinderErrorKind::VolumeNotFound
            | CinderErrorKind::MicroversionUnsupported
            | CinderErrorKind::NoEndpoint => false,
        }
    }
}
