// Code generated from src/domain/reason.rs by the service's tests; DO NOT EDIT.

package volumereconciler

// The reasons the service sends (google.rpc.ErrorInfo.reason, and an
// operation's last_error.reason): match Error.Reason against these.
const (
	// ReasonNovaTimeout is answered DEADLINE_EXCEEDED. The outbound deadline (derived from the caller's) expired.
	ReasonNovaTimeout = "NOVA_TIMEOUT"
	// ReasonNovaUnreachable is answered UNAVAILABLE. Connecting to Nova failed for the whole budget: provably never sent.
	ReasonNovaUnreachable = "NOVA_UNREACHABLE"
	// ReasonNovaResponseLost is answered FAILED_PRECONDITION. Sent, but no complete answer came.
	ReasonNovaResponseLost = "NOVA_RESPONSE_LOST"
	// ReasonNovaBadResponse is answered FAILED_PRECONDITION. A 2xx whose body does not fit the contract.
	ReasonNovaBadResponse = "NOVA_BAD_RESPONSE"
	// ReasonKeystoneAuthFailed is answered UNAVAILABLE. Keystone did not issue a token.
	ReasonKeystoneAuthFailed = "KEYSTONE_AUTH_FAILED"
	// ReasonNovaAlreadyAttached is answered FAILED_PRECONDITION. The reason NOVA_ALREADY_ATTACHED.
	ReasonNovaAlreadyAttached = "NOVA_ALREADY_ATTACHED"
	// ReasonNovaDetaching is answered FAILED_PRECONDITION. The volume is not in use (detaching, or still attaching).
	ReasonNovaDetaching = "NOVA_DETACHING"
	// ReasonNovaVolumeNotReady is answered FAILED_PRECONDITION. The volume is creating, downloading or reserved, and stayed so.
	ReasonNovaVolumeNotReady = "NOVA_VOLUME_NOT_READY"
	// ReasonNovaDeviceInUse is answered FAILED_PRECONDITION. The device path asked for is taken on the server.
	ReasonNovaDeviceInUse = "NOVA_DEVICE_IN_USE"
	// ReasonNovaNotAttached is answered FAILED_PRECONDITION. The reason NOVA_NOT_ATTACHED.
	ReasonNovaNotAttached = "NOVA_NOT_ATTACHED"
	// ReasonNovaServerNotFound is answered NOT_FOUND. The reason NOVA_SERVER_NOT_FOUND.
	ReasonNovaServerNotFound = "NOVA_SERVER_NOT_FOUND"
	// ReasonNovaVolumeNotFound is answered NOT_FOUND. The reason NOVA_VOLUME_NOT_FOUND.
	ReasonNovaVolumeNotFound = "NOVA_VOLUME_NOT_FOUND"
	// ReasonNovaForbidden is answered PERMISSION_DENIED. The reason NOVA_FORBIDDEN.
	ReasonNovaForbidden = "NOVA_FORBIDDEN"
	// ReasonNovaTooManyDisks is answered RESOURCE_EXHAUSTED. Nova refused the attach: the server has the maximum number of disk devices attached (its 403 "maximum number of disk devices exceeded").
	ReasonNovaTooManyDisks = "NOVA_TOO_MANY_DISKS"
	// ReasonNovaConflict is answered ABORTED. Locked or in a task_state, and it never cleared within the budget.
	ReasonNovaConflict = "NOVA_CONFLICT"
	// ReasonNovaThrottled is answered ABORTED. The reason NOVA_THROTTLED.
	ReasonNovaThrottled = "NOVA_THROTTLED"
	// ReasonNovaBadRequest is answered FAILED_PRECONDITION. The reason NOVA_BAD_REQUEST.
	ReasonNovaBadRequest = "NOVA_BAD_REQUEST"
	// ReasonNovaUnauthorized is answered UNAVAILABLE. 401 even after re-authenticating once.
	ReasonNovaUnauthorized = "NOVA_UNAUTHORIZED"
	// ReasonNovaServerError is answered FAILED_PRECONDITION. The reason NOVA_SERVER_ERROR.
	ReasonNovaServerError = "NOVA_SERVER_ERROR"
	// ReasonNovaUnexpectedStatus is answered FAILED_PRECONDITION. The reason NOVA_UNEXPECTED_STATUS.
	ReasonNovaUnexpectedStatus = "NOVA_UNEXPECTED_STATUS"
	// ReasonAlreadyAttachedElsewhere is answered FAILED_PRECONDITION. The volume is attached to another server (not multiattach).
	ReasonAlreadyAttachedElsewhere = "ALREADY_ATTACHED_ELSEWHERE"
	// ReasonAttachRolledBack is answered ABORTED. Nova accepted the attach, then the hypervisor or Cinder failed it and Nova rolled it back (the mapping is gone, Cinder shows the volume not attached: `available` or `error_attaching`).
	ReasonAttachRolledBack = "ATTACH_ROLLED_BACK"
	// ReasonVolumeInError is answered FAILED_PRECONDITION. Cinder shows the volume in an error status (`error`, `error_attaching`, ...) or being deleted: nothing was sent; an operator resets it first.
	ReasonVolumeInError = "VOLUME_IN_ERROR"
	// ReasonOutcomeUnknown is answered DEADLINE_EXCEEDED. May have taken effect; not observed yet. The reconciler resolves it.
	ReasonOutcomeUnknown = "OUTCOME_UNKNOWN"
	// ReasonNotObserved is answered ABORTED. Never observed within the operation's deadline and settle window.
	ReasonNotObserved = "NOT_OBSERVED"
	// ReasonNotObservable is answered UNAVAILABLE. Its server's attachments could not be listed until past its deadline and settle window: handed to people.
	ReasonNotObservable = "NOT_OBSERVABLE"
	// ReasonNotSent is answered DEADLINE_EXCEEDED. Recorded but never sent before its deadline.
	ReasonNotSent = "NOT_SENT"
	// ReasonBudgetExhausted is answered DEADLINE_EXCEEDED. The deadline came before any request could be sent.
	ReasonBudgetExhausted = "BUDGET_EXHAUSTED"
	// ReasonOperatorResolved is answered FAILED_PRECONDITION. An operator decided it (`ops resolve`).
	ReasonOperatorResolved = "OPERATOR_RESOLVED"
	// ReasonFailed is answered FAILED_PRECONDITION. A failed row without a recorded reason (never written by this version).
	ReasonFailed = "FAILED"
	// ReasonInvalidField is answered INVALID_ARGUMENT. The reason INVALID_FIELD.
	ReasonInvalidField = "INVALID_FIELD"
	// ReasonIdempotencyKeyReused is answered FAILED_PRECONDITION. The reason IDEMPOTENCY_KEY_REUSED.
	ReasonIdempotencyKeyReused = "IDEMPOTENCY_KEY_REUSED"
	// ReasonIdempotencyKeyExpired is answered FAILED_PRECONDITION. The key named an operation older than `--retain`, pruned since: it is refused, never run again.
	ReasonIdempotencyKeyExpired = "IDEMPOTENCY_KEY_EXPIRED"
	// ReasonVolumeBusy is answered ABORTED. Another operation on the volume is in flight.
	ReasonVolumeBusy = "VOLUME_BUSY"
	// ReasonOperationNotFound is answered NOT_FOUND. The reason OPERATION_NOT_FOUND.
	ReasonOperationNotFound = "OPERATION_NOT_FOUND"
	// ReasonOperationAlreadyDecided is answered FAILED_PRECONDITION. The reason OPERATION_ALREADY_DECIDED.
	ReasonOperationAlreadyDecided = "OPERATION_ALREADY_DECIDED"
	// ReasonOperationInProgress is answered DEADLINE_EXCEEDED. Still running at the caller's deadline (a joined replay).
	ReasonOperationInProgress = "OPERATION_IN_PROGRESS"
	// ReasonBudgetTooSmall is answered DEADLINE_EXCEEDED. The caller's deadline leaves too little time to call Nova.
	ReasonBudgetTooSmall = "BUDGET_TOO_SMALL"
	// ReasonDeadlineExceeded is answered DEADLINE_EXCEEDED. The deadline layer answered for a handler that ran out of time.
	ReasonDeadlineExceeded = "DEADLINE_EXCEEDED"
	// ReasonWatchIdle is answered DEADLINE_EXCEEDED. The reason WATCH_IDLE.
	ReasonWatchIdle = "WATCH_IDLE"
	// ReasonLedgerOverloaded is answered RESOURCE_EXHAUSTED. The reason LEDGER_OVERLOADED.
	ReasonLedgerOverloaded = "LEDGER_OVERLOADED"
	// ReasonDatabaseDeadline is answered DEADLINE_EXCEEDED. The reason DATABASE_DEADLINE.
	ReasonDatabaseDeadline = "DATABASE_DEADLINE"
	// ReasonDatabaseUnavailable is answered UNAVAILABLE. The reason DATABASE_UNAVAILABLE.
	ReasonDatabaseUnavailable = "DATABASE_UNAVAILABLE"
	// ReasonLedgerRowUnreadable is answered INTERNAL. The reason LEDGER_ROW_UNREADABLE.
	ReasonLedgerRowUnreadable = "LEDGER_ROW_UNREADABLE"
	// ReasonOperationTaskLost is answered INTERNAL. The task running an operation ended without an answer (a bug).
	ReasonOperationTaskLost = "OPERATION_TASK_LOST"
	// ReasonUnauthenticated is answered UNAUTHENTICATED. The reason UNAUTHENTICATED.
	ReasonUnauthenticated = "UNAUTHENTICATED"
	// ReasonPermissionDenied is answered PERMISSION_DENIED. The reason PERMISSION_DENIED.
	ReasonPermissionDenied = "PERMISSION_DENIED"
	// ReasonCallerRateLimited is answered RESOURCE_EXHAUSTED. The reason CALLER_RATE_LIMITED.
	ReasonCallerRateLimited = "CALLER_RATE_LIMITED"
	// ReasonOverloaded is answered RESOURCE_EXHAUSTED. `--max-inflight-mutations` attach/detach operations are running.
	ReasonOverloaded = "OVERLOADED"
	// ReasonReadsOverloaded is answered RESOURCE_EXHAUSTED. `--max-inflight-reads` unary reads are in flight.
	ReasonReadsOverloaded = "READS_OVERLOADED"
	// ReasonWatchesOverloaded is answered RESOURCE_EXHAUSTED. `--max-watch-streams` WatchOperation streams are open.
	ReasonWatchesOverloaded = "WATCHES_OVERLOADED"
	// ReasonMessageTooLarge is answered RESOURCE_EXHAUSTED. The reason MESSAGE_TOO_LARGE.
	ReasonMessageTooLarge = "MESSAGE_TOO_LARGE"
	// ReasonClientDeadline is answered DEADLINE_EXCEEDED. The client's own deadline passed (client side).
	ReasonClientDeadline = "CLIENT_DEADLINE"
	// ReasonUnrecognized is answered FAILED_PRECONDITION. A reason text this version does not know (read from a ledger row written by another version).
	ReasonUnrecognized = "UNRECOGNIZED"
)
