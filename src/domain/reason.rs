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

/// What a reason is to the caller that meets it, and what a keyed replay
/// of an operation decided with it is answered (docs/api.md's tables are
/// made from these, by `tests/ops/reasons.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReasonKind {
    /// The reason of a FAILED operation, and the key's answer from then on:
    /// a replay of the key is answered the same (Stripe's contract).
    Decided,
    /// The reason of a FAILED operation that Nova provably never acted on
    /// (refused, never sent, or undone) and whose code says "retry": no
    /// result is saved for it, so a replay of the key starts a new
    /// operation under it (the ledger keeps both).
    Retried,
    /// Said while the operation goes on: a replay of the key joins it.
    Open,
    /// One attempt's failure, in `last_error` and the reconcile log of an
    /// operation that goes on to a decision the tables make; never the
    /// answer of a call by itself.
    Attempt,
    /// The call itself is refused; nothing is recorded, so a replay is a
    /// call like the first.
    Refused,
}

macro_rules! reasons {
    ($( $(#[$doc:meta])* $variant:ident = $text:literal => $code:ident, $kind:ident,
        $when:literal, $then:literal; )*) => {
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

            /// What it is to the caller that meets it.
            pub fn kind(self) -> ReasonKind {
                match self { $(Reason::$variant => ReasonKind::$kind,)* }
            }

            /// When the service says it (docs/api.md's error table).
            pub fn when(self) -> &'static str {
                match self { $(Reason::$variant => $when,)* }
            }

            /// What the caller does about it (docs/api.md's error table).
            pub fn then(self) -> &'static str {
                match self { $(Reason::$variant => $then,)* }
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
    NovaTimeout = "NOVA_TIMEOUT" => DeadlineExceeded, Retried,
        "the request's deadline passed before it could leave (it waited for a connection slot or a Keystone token): provably never sent",
        "call again with more time; a keyed replay starts a new attempt";
    /// Connecting to Nova failed for the whole budget: provably never sent.
    NovaUnreachable = "NOVA_UNREACHABLE" => Unavailable, Retried,
        "every connection to Nova was refused or timed out for the whole budget: nothing was sent",
        "retry later (with the same key: a replay starts a new attempt)";
    /// Sent, but no complete answer came.
    NovaResponseLost = "NOVA_RESPONSE_LOST" => FailedPrecondition, Attempt,
        "a request left but its answer was lost (a reset, a cut body, a deadline awaiting the answer)",
        "nothing: the service looks at the server instead and decides from what it sees";
    /// A 2xx whose body does not fit the contract.
    NovaBadResponse = "NOVA_BAD_RESPONSE" => FailedPrecondition, Attempt,
        "an answer that is not Nova's (a proxy's page, another service's JSON, a body cut short): of unknown effect",
        "nothing: the service looks at the server instead";
    /// Keystone did not issue a token.
    KeystoneAuthFailed = "KEYSTONE_AUTH_FAILED" => Unavailable, Retried,
        "Keystone issued no token for the whole budget: nothing was sent to Nova",
        "an operator checks the service's OpenStack credentials; retry later (a keyed replay starts a new attempt)";
    /// Nova says the volume is attached already.
    NovaAlreadyAttached = "NOVA_ALREADY_ATTACHED" => FailedPrecondition, Attempt,
        "Nova refused an attach as already attached",
        "nothing: the service looks whether it is attached here (SUCCEEDED) or elsewhere (ALREADY_ATTACHED_ELSEWHERE)";
    /// The volume is not in use (detaching, or still attaching).
    NovaDetaching = "NOVA_DETACHING" => FailedPrecondition, Attempt,
        "Nova refused a detach while the volume was attaching or detaching",
        "nothing: the service looks and retries within the deadline";
    /// The volume is creating, downloading or reserved, and stayed so.
    NovaVolumeNotReady = "NOVA_VOLUME_NOT_READY" => FailedPrecondition, Decided,
        "the volume stayed creating, downloading or reserved until no request fitted the deadline; nothing took effect",
        "call again once the volume is available, with a new key (or EnsureAttached)";
    /// The device path asked for is taken on the server.
    NovaDeviceInUse = "NOVA_DEVICE_IN_USE" => FailedPrecondition, Decided,
        "the device path asked for is taken on the server",
        "ask for another device (a new key), or none";
    /// Nova says the volume is not attached to the server.
    NovaNotAttached = "NOVA_NOT_ATTACHED" => FailedPrecondition, Attempt,
        "Nova answered a detach that the volume is not attached to this server",
        "nothing: the detach is SUCCEEDED";
    NovaServerNotFound = "NOVA_SERVER_NOT_FOUND" => NotFound, Decided,
        "an attach's server does not exist (Nova's 404 naming it, confirmed by GET /servers/{id} where it decides alone)",
        "none: the server is gone; check the server id";
    NovaVolumeNotFound = "NOVA_VOLUME_NOT_FOUND" => NotFound, Decided,
        "an attach's volume does not exist (Nova's or Cinder's 404 naming it)",
        "none: check the volume id";
    NovaForbidden = "NOVA_FORBIDDEN" => PermissionDenied, Decided,
        "Nova's policy refused the request (403): at once when Nova's words say so; a 403 in words the service does not read (another language) after retrying until no request fitted",
        "an operator checks the service account's roles; then call again with a new key";
    /// Nova's 403 "the maximum allowed number of disk devices to attach to
    /// a single instance has been exceeded": the server can take no more.
    NovaTooManyDisks = "NOVA_TOO_MANY_DISKS" => ResourceExhausted, Retried,
        "the server has as many disk devices as Nova allows (403 TooManyDiskDevices); nothing took effect",
        "detach another volume from the server first, or choose another server; a keyed replay starts a new attempt";
    /// Locked or in a task_state, and it never cleared within the budget.
    NovaConflict = "NOVA_CONFLICT" => Aborted, Retried,
        "the server stayed locked or busy in a task state (409), or Nova over its rate limit (413/429), until no request fitted the deadline; nothing took effect",
        "retry later; a keyed replay starts a new attempt";
    NovaThrottled = "NOVA_THROTTLED" => Aborted, Retried,
        "Nova over its rate limit (413/429) until no request fitted; nothing took effect",
        "retry later; a keyed replay starts a new attempt";
    NovaBadRequest = "NOVA_BAD_REQUEST" => FailedPrecondition, Decided,
        "Nova refused the request as invalid (400): at once when its words are one of Nova's final refusals; a 400 in words the service does not read (another language, other words) after retrying until no request fitted",
        "none with the same request: read the message";
    /// 401 even after re-authenticating once.
    NovaUnauthorized = "NOVA_UNAUTHORIZED" => Unavailable, Retried,
        "Nova answered 401 even to a fresh token: nothing took effect",
        "an operator checks the service's credentials and Nova's Keystone settings; a keyed replay starts a new attempt";
    NovaServerError = "NOVA_SERVER_ERROR" => FailedPrecondition, Attempt,
        "Nova or a proxy answered 5xx: of unknown effect",
        "nothing: the service looks at the server instead";
    NovaUnexpectedStatus = "NOVA_UNEXPECTED_STATUS" => FailedPrecondition, Attempt,
        "a status Nova's API does not give for the call: of unknown effect",
        "nothing: the service looks at the server instead";

    // --- how an operation ended or stands ---
    /// The volume is attached to another server (not multiattach).
    AlreadyAttachedElsewhere = "ALREADY_ATTACHED_ELSEWHERE" => FailedPrecondition, Decided,
        "the volume is attached to another server (metadata attached_to) and is not multiattach",
        "detach it there first, then attach with a new key (or EnsureAttached)";
    /// Nova accepted the attach, then the hypervisor or Cinder failed it and
    /// Nova rolled it back (the mapping is gone, Cinder shows the volume
    /// not attached: `available` or `error_attaching`).
    AttachRolledBack = "ATTACH_ROLLED_BACK" => Aborted, Retried,
        "Nova accepted the attach, then the compute host or Cinder failed it and Nova rolled it back: nothing stands",
        "retry (a keyed replay starts a new attempt); if it repeats, an operator looks at the compute host";
    /// Cinder shows the volume in an error status (`error`,
    /// `error_attaching`, ...) or being deleted: nothing was sent; an
    /// operator resets it first.
    VolumeInError = "VOLUME_IN_ERROR" => FailedPrecondition, Decided,
        "Cinder shows the volume in an error status or being deleted: nothing was sent",
        "an operator resets the volume in Cinder; then call again with a new key (or EnsureAttached)";
    /// May have taken effect; not observed yet. The reconciler resolves it.
    OutcomeUnknown = "OUTCOME_UNKNOWN" => DeadlineExceeded, Open,
        "the deadline came before the outcome could be observed (metadata operation_id); the operation goes on and the reconciler decides it",
        "keep operation_id: wait for it (WatchOperation, GetOperation, the Go client's Wait), or call again (the same key, or the same Ensure call, joins it)";
    /// Never observed within the operation's deadline and settle window.
    NotObserved = "NOT_OBSERVED" => Aborted, Retried,
        "after the settle window the change was still not there and no request fitted the operation's deadline: nothing took effect",
        "call again; a keyed replay starts a new attempt";
    /// Its server's attachments could not be listed until past its deadline
    /// and settle window: handed to people.
    NotObservable = "NOT_OBSERVABLE" => Unavailable, Open,
        "the server's attachments could not be listed until past the deadline and settle window: the operation is escalated to operators (ops list --escalated)",
        "an operator decides it (ops resolve); callers wait for that decision";
    /// Recorded but never sent before its deadline.
    NotSent = "NOT_SENT" => DeadlineExceeded, Retried,
        "recorded, but no request left before its deadline (its lease could not be confirmed, or the database was away)",
        "call again; a keyed replay starts a new attempt";
    /// The deadline came before any request could be sent.
    BudgetExhausted = "BUDGET_EXHAUSTED" => DeadlineExceeded, Retried,
        "the deadline came before any request could be sent",
        "call again with more time; a keyed replay starts a new attempt";
    /// An operator decided it (`ops resolve`).
    OperatorResolved = "OPERATOR_RESOLVED" => FailedPrecondition, Decided,
        "an operator decided the operation FAILED (ops resolve; metadata caller, the reason in the message)",
        "read the operator's reason; a new key (or an Ensure call) asks anew";
    /// Cancelled before anything that may take effect was sent for it
    /// (`CancelOperation`, or superseded by a detach of its volume).
    Cancelled = "CANCELLED" => FailedPrecondition, Decided,
        "the operation was cancelled before anything that may take effect was sent (CancelOperation, or a detach of the same volume superseded it; metadata caller): nothing was sent for it, and nothing ever will be",
        "nothing took effect: call again with a new key (or an Ensure call) to ask anew";
    /// A failed row without a recorded reason (never written by this
    /// version).
    Failed = "FAILED" => FailedPrecondition, Decided,
        "a FAILED operation written without a reason (by no released version)",
        "read the reconcile log (ops show)";

    // --- the API's own refusals ---
    InvalidField = "INVALID_FIELD" => InvalidArgument, Refused,
        "a field is invalid (metadata field, and a BadRequest violation)",
        "fix the field";
    IdempotencyKeyReused = "IDEMPOTENCY_KEY_REUSED" => FailedPrecondition, Refused,
        "the key was used for a different request (metadata operation_id and the existing request), or collides with another key's hash (cause=key_hash_collision)",
        "use a new key for a new request";
    /// The key named an operation older than `--retain`, pruned since: it
    /// is refused, never run again.
    IdempotencyKeyExpired = "IDEMPOTENCY_KEY_EXPIRED" => FailedPrecondition, Refused,
        "the key's operation was pruned after --retain (metadata expired_at): it is never run again",
        "look at the volume, then use a new key";
    /// Another operation on the volume is in flight.
    VolumeBusy = "VOLUME_BUSY" => Aborted, Refused,
        "the volume has another operation in flight (its operation_id only to its own caller and to operators)",
        "retry later, or wait for that operation";
    OperationNotFound = "OPERATION_NOT_FOUND" => NotFound, Refused,
        "no such operation, or (to an orchestrator) another caller's",
        "check the id";
    OperationAlreadyDecided = "OPERATION_ALREADY_DECIDED" => FailedPrecondition, Refused,
        "ResolveOperation or CancelOperation of an operation that is decided already",
        "nothing to resolve or cancel: read its decision";
    /// Cancelled too late: a request that may take effect may have left.
    CancelTooLate = "CANCEL_TOO_LATE" => FailedPrecondition, Refused,
        "CancelOperation of an operation whose request may be leaving or may have left (metadata operation_id): nothing was cancelled, and it goes on",
        "wait for its decision (only a detach undoes an attach)";
    /// Still running at the caller's deadline (a joined replay).
    OperationInProgress = "OPERATION_IN_PROGRESS" => DeadlineExceeded, Open,
        "the caller's deadline came while the operation still runs (metadata operation_id)",
        "keep operation_id: wait for it, or call again (it joins)";
    /// The caller's deadline leaves too little time to call Nova.
    BudgetTooSmall = "BUDGET_TOO_SMALL" => DeadlineExceeded, Refused,
        "the caller's deadline leaves too little time to start a request to Nova: this call started nothing (a replay of an open or decided key is answered with its operation instead)",
        "call again with a longer deadline";
    /// The deadline layer answered for a handler that ran out of time.
    DeadlineExceeded = "DEADLINE_EXCEEDED" => DeadlineExceeded, Open,
        "the service answered for a handler still working at the caller's deadline (metadata stage)",
        "call again; an operation it started is joined by the same key or Ensure call";
    WatchIdle = "WATCH_IDLE" => DeadlineExceeded, Open,
        "WatchOperation saw no change for --watch-idle-timeout",
        "open the watch again";
    LedgerOverloaded = "LEDGER_OVERLOADED" => ResourceExhausted, Refused,
        "the ledger's write queue is full (--max-queued-writes): nothing recorded (RetryInfo)",
        "retry after the RetryInfo delay";
    DatabaseDeadline = "DATABASE_DEADLINE" => DeadlineExceeded, Open,
        "the caller's deadline came while the ledger had not answered (metadata stage)",
        "call again; if the intent was written, the same key joins it";
    DatabaseUnavailable = "DATABASE_UNAVAILABLE" => Unavailable, Refused,
        "the ledger is unreachable or failed (metadata stage, cause)",
        "retry later with the same key (an intent that was written is joined)";
    LedgerRowUnreadable = "LEDGER_ROW_UNREADABLE" => Internal, Refused,
        "a ledger row could not be read (a bug or a foreign write)",
        "report it: an operator reads the row (metadata row)";
    /// The task running an operation ended without an answer (a bug).
    OperationTaskLost = "OPERATION_TASK_LOST" => Internal, Open,
        "the task running the operation ended without an answer (a bug)",
        "call again with the same key; report it";
    Unauthenticated = "UNAUTHENTICATED" => Unauthenticated, Refused,
        "no valid token or client certificate",
        "fix the credentials";
    PermissionDenied = "PERMISSION_DENIED" => PermissionDenied, Refused,
        "the caller's role may not call this RPC (operators only)",
        "use an operator's credentials";
    CallerRateLimited = "CALLER_RATE_LIMITED" => ResourceExhausted, Refused,
        "the caller is over its rate (--caller-rate-limit): nothing recorded (RetryInfo)",
        "retry after the RetryInfo delay";
    /// Over a quota of the caller's row of `--caller-quotas`.
    CallerQuotaExceeded = "CALLER_QUOTA_EXCEEDED" => ResourceExhausted, Refused,
        "the caller is over a quota of its row of --caller-quotas, its rate or its operations in flight (QuotaFailure names the caller and the quota; RetryInfo): nothing recorded",
        "retry after the RetryInfo delay";
    /// `--max-inflight-mutations` attach/detach operations are running.
    Overloaded = "OVERLOADED" => ResourceExhausted, Refused,
        "--max-inflight-mutations operations are running: nothing recorded (RetryInfo)",
        "retry after the RetryInfo delay";
    /// `--max-inflight-reads` unary reads are in flight.
    ReadsOverloaded = "READS_OVERLOADED" => ResourceExhausted, Refused,
        "--max-inflight-reads reads are in flight (RetryInfo)",
        "retry after the RetryInfo delay";
    /// `--max-watch-streams` WatchOperation streams are open.
    WatchesOverloaded = "WATCHES_OVERLOADED" => ResourceExhausted, Refused,
        "--max-watch-streams watches are open (RetryInfo)",
        "retry after the RetryInfo delay, or poll GetOperation";
    MessageTooLarge = "MESSAGE_TOO_LARGE" => ResourceExhausted, Refused,
        "the request is larger than --max-message-bytes",
        "send a smaller request";
    /// The client's own deadline passed (client side).
    ClientDeadline = "CLIENT_DEADLINE" => DeadlineExceeded, Open,
        "the Rust client's own deadline passed before an answer (said by the client, never the service)",
        "call again with the same key";
    /// A reason text this version does not know (read from a ledger row
    /// written by another version).
    Unrecognized = "UNRECOGNIZED" => FailedPrecondition, Decided,
        "a reason this version does not know, read from a row another version wrote",
        "read the reconcile log (ops show)";
}

impl Reason {
    /// Whether a keyed replay of an operation FAILED with this reason
    /// starts a new operation under the key (see [`ReasonKind::Retried`]).
    pub fn frees_key(self) -> bool {
        self.kind() == ReasonKind::Retried
    }
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

    /// A reason that frees its key says "retry" by its code: a caller
    /// that retries on the code meets a new attempt, never the same answer
    /// again; and every other decision's code is one a caller does not
    /// retry blindly, or it would loop on the key's saved answer.
    #[test]
    fn only_reasons_whose_code_says_retry_free_their_key() {
        use ErrorCode::*;
        for r in Reason::ALL {
            let retry = matches!(
                r.code(),
                Aborted | Unavailable | ResourceExhausted | DeadlineExceeded
            );
            match r.kind() {
                ReasonKind::Retried => assert!(
                    retry,
                    "{r} frees its key but its code {:?} does not say retry",
                    r.code()
                ),
                ReasonKind::Decided => assert!(
                    !retry,
                    "{r} sticks to its key but its code {:?} says retry: a caller would loop on it",
                    r.code()
                ),
                _ => {}
            }
            assert!(
                !r.when().is_empty() && !r.then().is_empty(),
                "{r} undocumented"
            );
        }
    }
}
