//! Why something failed, or why its outcome is not known: one enum used by
//! the executor, the reconciler, the Nova adapter, the store and the gRPC
//! layer, each reason with the canonical error code it is answered with.
//! The text form (`NOVA_SERVER_NOT_FOUND`) is what `ErrorInfo.reason` and
//! the ledger's `last_error.reason` carry; it never changes for a reason
//! once released, since callers match on it.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The canonical error codes (`google.rpc.Code`, which gRPC uses): the
/// domain names them without knowing any RPC library; `grpc/status.rs`
/// turns them into `tonic::Code`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    Cancelled,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    Internal,
    Unavailable,
    Unauthenticated,
}

macro_rules! reasons {
    ($( $(#[$doc:meta])* $variant:ident = $text:literal => $code:ident, )*) => {
        /// A failure reason and, through [`Reason::code`], how it is answered.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Reason {
            $( $(#[$doc])* $variant, )*
        }

        impl Reason {
            /// Every reason, for tests and documentation.
            pub const ALL: &'static [Reason] = &[$(Reason::$variant,)*];

            /// The stable text form.
            pub fn as_str(self) -> &'static str {
                match self { $(Reason::$variant => $text,)* }
            }

            /// The code a caller is answered with.
            pub fn code(self) -> ErrorCode {
                match self { $(Reason::$variant => ErrorCode::$code,)* }
            }

            /// The reason a text form names; `None` for an unknown text.
            pub fn parse(text: &str) -> Option<Reason> {
                match text { $($text => Some(Reason::$variant),)* _ => None }
            }
        }
    };
}

reasons! {
    // --- what Nova said or did not say (an attempt's failure) ---
    /// The outbound deadline (derived from the caller's) expired.
    NovaTimeout = "NOVA_TIMEOUT" => DeadlineExceeded,
    /// Connecting to Nova failed for the whole budget: provably never sent.
    NovaUnreachable = "NOVA_UNREACHABLE" => Unavailable,
    /// Sent, but no complete answer came.
    NovaResponseLost = "NOVA_RESPONSE_LOST" => FailedPrecondition,
    /// A 2xx whose body does not fit the contract.
    NovaBadResponse = "NOVA_BAD_RESPONSE" => FailedPrecondition,
    /// Keystone did not issue a token.
    KeystoneAuthFailed = "KEYSTONE_AUTH_FAILED" => Unavailable,
    NovaAlreadyAttached = "NOVA_ALREADY_ATTACHED" => FailedPrecondition,
    /// The volume is not in use (detaching, or still attaching).
    NovaDetaching = "NOVA_DETACHING" => FailedPrecondition,
    /// The volume is creating, downloading or reserved, and stayed so.
    NovaVolumeNotReady = "NOVA_VOLUME_NOT_READY" => FailedPrecondition,
    /// The device path asked for is taken on the server.
    NovaDeviceInUse = "NOVA_DEVICE_IN_USE" => FailedPrecondition,
    NovaNotAttached = "NOVA_NOT_ATTACHED" => FailedPrecondition,
    NovaServerNotFound = "NOVA_SERVER_NOT_FOUND" => NotFound,
    NovaVolumeNotFound = "NOVA_VOLUME_NOT_FOUND" => NotFound,
    NovaForbidden = "NOVA_FORBIDDEN" => PermissionDenied,
    /// Nova's 403 "maximum number of disk devices exceeded": the server takes no more.
    NovaTooManyDisks = "NOVA_TOO_MANY_DISKS" => ResourceExhausted,
    /// Locked or in a task_state, and it never cleared within the budget.
    NovaConflict = "NOVA_CONFLICT" => Aborted,
    NovaThrottled = "NOVA_THROTTLED" => Aborted,
    NovaBadRequest = "NOVA_BAD_REQUEST" => FailedPrecondition,
    /// 401 even after re-authenticating once.
    NovaUnauthorized = "NOVA_UNAUTHORIZED" => Unavailable,
    NovaServerError = "NOVA_SERVER_ERROR" => FailedPrecondition,
    NovaUnexpectedStatus = "NOVA_UNEXPECTED_STATUS" => FailedPrecondition,

    // --- how an operation ended or stands ---
    /// The volume is attached to another server (not multiattach).
    AlreadyAttachedElsewhere = "ALREADY_ATTACHED_ELSEWHERE" => FailedPrecondition,
    /// Nova accepted the attach, then the hypervisor or Cinder failed it and
    /// Nova rolled it back (the mapping is gone, Cinder shows the volume
    /// not attached: `available` or `error_attaching`).
    AttachRolledBack = "ATTACH_ROLLED_BACK" => Aborted,
    /// Cinder shows the volume in an error status (`error`,
    /// `error_attaching`, ...) or being deleted: nothing was sent; an
    /// operator resets it first.
    VolumeInError = "VOLUME_IN_ERROR" => FailedPrecondition,
    /// May have taken effect; not observed yet. The reconciler resolves it.
    OutcomeUnknown = "OUTCOME_UNKNOWN" => DeadlineExceeded,
    /// Never observed within the operation's deadline and settle window.
    NotObserved = "NOT_OBSERVED" => Aborted,
    /// Its server's attachments could not be listed until past its deadline
    /// and settle window: handed to people.
    NotObservable = "NOT_OBSERVABLE" => Unavailable,
    /// Recorded but never sent before its deadline.
    NotSent = "NOT_SENT" => DeadlineExceeded,
    /// The deadline came before any request could be sent.
    BudgetExhausted = "BUDGET_EXHAUSTED" => DeadlineExceeded,
    /// An operator decided it (`ops resolve`).
    OperatorResolved = "OPERATOR_RESOLVED" => FailedPrecondition,
    /// A failed row without a recorded reason (never written by this
    /// version).
    Failed = "FAILED" => FailedPrecondition,

    // --- the API's own refusals ---
    InvalidField = "INVALID_FIELD" => InvalidArgument,
    IdempotencyKeyReused = "IDEMPOTENCY_KEY_REUSED" => FailedPrecondition,
    /// The key named an operation older than `--retain`, pruned since: it
    /// is refused, never run again.
    IdempotencyKeyExpired = "IDEMPOTENCY_KEY_EXPIRED" => FailedPrecondition,
    /// Another operation on the volume is in flight.
    VolumeBusy = "VOLUME_BUSY" => Aborted,
    OperationNotFound = "OPERATION_NOT_FOUND" => NotFound,
    OperationAlreadyDecided = "OPERATION_ALREADY_DECIDED" => FailedPrecondition,
    /// Still running at the caller's deadline (a joined replay).
    OperationInProgress = "OPERATION_IN_PROGRESS" => DeadlineExceeded,
    /// The caller's deadline leaves too little time to call Nova.
    BudgetTooSmall = "BUDGET_TOO_SMALL" => DeadlineExceeded,
    /// The deadline layer answered for a handler that ran out of time.
    DeadlineExceeded = "DEADLINE_EXCEEDED" => DeadlineExceeded,
    WatchIdle = "WATCH_IDLE" => DeadlineExceeded,
    LedgerOverloaded = "LEDGER_OVERLOADED" => ResourceExhausted,
    DatabaseDeadline = "DATABASE_DEADLINE" => DeadlineExceeded,
    DatabaseUnavailable = "DATABASE_UNAVAILABLE" => Unavailable,
    LedgerRowUnreadable = "LEDGER_ROW_UNREADABLE" => Internal,
    /// The task running an operation ended without an answer (a bug).
    OperationTaskLost = "OPERATION_TASK_LOST" => Internal,
    Unauthenticated = "UNAUTHENTICATED" => Unauthenticated,
    PermissionDenied = "PERMISSION_DENIED" => PermissionDenied,
    CallerRateLimited = "CALLER_RATE_LIMITED" => ResourceExhausted,
    /// `--max-inflight-mutations` attach/detach operations are running.
    Overloaded = "OVERLOADED" => ResourceExhausted,
    /// `--max-inflight-reads` unary reads are in flight.
    ReadsOverloaded = "READS_OVERLOADED" => ResourceExhausted,
    /// `--max-watch-streams` WatchOperation streams are open.
    WatchesOverloaded = "WATCHES_OVERLOADED" => ResourceExhausted,
    MessageTooLarge = "MESSAGE_TOO_LARGE" => ResourceExhausted,
    /// The client's own deadline passed (client side).
    ClientDeadline = "CLIENT_DEADLINE" => DeadlineExceeded,
    /// A reason text this version does not know (read from a ledger row
    /// written by another version).
    Unrecognized = "UNRECOGNIZED" => FailedPrecondition,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for Reason {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Reason {
    /// Unknown texts become [`Reason::Unrecognized`]: a ledger row stays
    /// readable whatever version wrote it.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = std::borrow::Cow::<str>::deserialize(d)?;
        Ok(Reason::parse(&text).unwrap_or(Reason::Unrecognized))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_round_trips_through_its_text_and_texts_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for r in Reason::ALL {
            assert_eq!(Reason::parse(r.as_str()), Some(*r));
            assert!(seen.insert(r.as_str()), "{} twice", r.as_str());
            let json = serde_json::to_string(r).unwrap();
            assert_eq!(serde_json::from_str::<Reason>(&json).unwrap(), *r);
        }
        assert_eq!(
            serde_json::from_str::<Reason>("\"SOMETHING_NEW\"").unwrap(),
            Reason::Unrecognized
        );
    }
}
