// Code generated from src/domain/reason.rs by the service's tests; DO NOT EDIT.

package volumereconciler

import "google.golang.org/grpc/codes"

// The reasons the service sends in google.rpc.ErrorInfo.reason (Error.Reason)
// and in an operation's last_error, one constant each: compare with these,
// never with a message's text. docs/api.md's error table says what each
// means and what to do.
const (
	// ReasonNovaTimeout (DEADLINE_EXCEEDED): the request's deadline passed before it could leave (it waited for a connection slot or a Keystone token): provably never sent.
	// The caller: call again with more time; a keyed replay starts a new attempt.
	ReasonNovaTimeout = "NOVA_TIMEOUT"

	// ReasonNovaUnreachable (UNAVAILABLE): every connection to Nova was refused or timed out for the whole budget: nothing was sent.
	// The caller: retry later (with the same key: a replay starts a new attempt).
	ReasonNovaUnreachable = "NOVA_UNREACHABLE"

	// ReasonNovaResponseLost (FAILED_PRECONDITION): a request left but its answer was lost (a reset, a cut body, a deadline awaiting the answer).
	// The caller: nothing: the service looks at the server instead and decides from what it sees.
	ReasonNovaResponseLost = "NOVA_RESPONSE_LOST"

	// ReasonNovaBadResponse (FAILED_PRECONDITION): an answer that is not Nova's (a proxy's page, another service's JSON, a body cut short): of unknown effect.
	// The caller: nothing: the service looks at the server instead.
	ReasonNovaBadResponse = "NOVA_BAD_RESPONSE"

	// ReasonKeystoneAuthFailed (UNAVAILABLE): Keystone issued no token for the whole budget: nothing was sent to Nova.
	// The caller: an operator checks the service's OpenStack credentials; retry later (a keyed replay starts a new attempt).
	ReasonKeystoneAuthFailed = "KEYSTONE_AUTH_FAILED"

	// ReasonNovaAlreadyAttached (FAILED_PRECONDITION): Nova refused an attach as already attached.
	// The caller: nothing: the service looks whether it is attached here (SUCCEEDED) or elsewhere (ALREADY_ATTACHED_ELSEWHERE).
	ReasonNovaAlreadyAttached = "NOVA_ALREADY_ATTACHED"

	// ReasonNovaDetaching (FAILED_PRECONDITION): Nova refused a detach while the volume was attaching or detaching.
	// The caller: nothing: the service looks and retries within the deadline.
	ReasonNovaDetaching = "NOVA_DETACHING"

	// ReasonNovaVolumeNotReady (FAILED_PRECONDITION): the volume stayed creating, downloading or reserved until no request fitted the deadline; nothing took effect.
	// The caller: call again once the volume is available, with a new key (or EnsureAttached).
	ReasonNovaVolumeNotReady = "NOVA_VOLUME_NOT_READY"

	// ReasonNovaDeviceInUse (FAILED_PRECONDITION): the device path asked for is taken on the server.
	// The caller: ask for another device (a new key), or none.
	ReasonNovaDeviceInUse = "NOVA_DEVICE_IN_USE"

	// ReasonNovaNotAttached (FAILED_PRECONDITION): Nova answered a detach that the volume is not attached to this server.
	// The caller: nothing: the detach is SUCCEEDED.
	ReasonNovaNotAttached = "NOVA_NOT_ATTACHED"

	// ReasonNovaServerNotFound (NOT_FOUND): an attach's server does not exist (Nova's 404 naming it, confirmed by GET /servers/{id} where it decides alone).
	// The caller: none: the server is gone; check the server id.
	ReasonNovaServerNotFound = "NOVA_SERVER_NOT_FOUND"

	// ReasonNovaVolumeNotFound (NOT_FOUND): an attach's volume does not exist (Nova's or Cinder's 404 naming it).
	// The caller: none: check the volume id.
	ReasonNovaVolumeNotFound = "NOVA_VOLUME_NOT_FOUND"

	// ReasonNovaForbidden (PERMISSION_DENIED): Nova's policy refused the request (403): at once when Nova's words say so; a 403 in words the service does not read (another language) after retrying until no request fitted.
	// The caller: an operator checks the service account's roles; then call again with a new key.
	ReasonNovaForbidden = "NOVA_FORBIDDEN"

	// ReasonNovaTooManyDisks (RESOURCE_EXHAUSTED): the server has as many disk devices as Nova allows (403 TooManyDiskDevices); nothing took effect.
	// The caller: detach another volume from the server first, or choose another server; a keyed replay starts a new attempt.
	ReasonNovaTooManyDisks = "NOVA_TOO_MANY_DISKS"

	// ReasonNovaConflict (ABORTED): the server stayed locked or busy in a task state (409), or Nova over its rate limit (413/429), until no request fitted the deadline; nothing took effect.
	// The caller: retry later; a keyed replay starts a new attempt.
	ReasonNovaConflict = "NOVA_CONFLICT"

	// ReasonNovaThrottled (ABORTED): Nova over its rate limit (413/429) until no request fitted; nothing took effect.
	// The caller: retry later; a keyed replay starts a new attempt.
	ReasonNovaThrottled = "NOVA_THROTTLED"

	// ReasonNovaBadRequest (FAILED_PRECONDITION): Nova refused the request as invalid (400): at once when its words are one of Nova's final refusals; a 400 in words the service does not read (another language, other words) after retrying until no request fitted.
	// The caller: none with the same request: read the message.
	ReasonNovaBadRequest = "NOVA_BAD_REQUEST"

	// ReasonNovaUnauthorized (UNAVAILABLE): Nova answered 401 even to a fresh token: nothing took effect.
	// The caller: an operator checks the service's credentials and Nova's Keystone settings; a keyed replay starts a new attempt.
	ReasonNovaUnauthorized = "NOVA_UNAUTHORIZED"

	// ReasonNovaServerError (FAILED_PRECONDITION): Nova or a proxy answered 5xx: of unknown effect.
	// The caller: nothing: the service looks at the server instead.
	ReasonNovaServerError = "NOVA_SERVER_ERROR"

	// ReasonNovaUnexpectedStatus (FAILED_PRECONDITION): a status Nova's API does not give for the call: of unknown effect.
	// The caller: nothing: the service looks at the server instead.
	ReasonNovaUnexpectedStatus = "NOVA_UNEXPECTED_STATUS"

	// ReasonAlreadyAttachedElsewhere (FAILED_PRECONDITION): the volume is attached to another server (metadata attached_to) and is not multiattach.
	// The caller: detach it there first, then attach with a new key (or EnsureAttached).
	ReasonAlreadyAttachedElsewhere = "ALREADY_ATTACHED_ELSEWHERE"

	// ReasonAttachRolledBack (ABORTED): Nova accepted the attach, then the compute host or Cinder failed it and Nova rolled it back: nothing stands.
	// The caller: retry (a keyed replay starts a new attempt); if it repeats, an operator looks at the compute host.
	ReasonAttachRolledBack = "ATTACH_ROLLED_BACK"

	// ReasonVolumeInError (FAILED_PRECONDITION): Cinder shows the volume in an error status or being deleted: nothing was sent.
	// The caller: an operator resets the volume in Cinder; then call again with a new key (or EnsureAttached).
	ReasonVolumeInError = "VOLUME_IN_ERROR"

	// ReasonOutcomeUnknown (DEADLINE_EXCEEDED): the deadline came before the outcome could be observed (metadata operation_id); the operation goes on and the reconciler decides it.
	// The caller: keep operation_id: wait for it (WatchOperation, GetOperation, the Go client's Wait), or call again (the same key, or the same Ensure call, joins it).
	ReasonOutcomeUnknown = "OUTCOME_UNKNOWN"

	// ReasonNotObserved (ABORTED): after the settle window the change was still not there and no request fitted the operation's deadline: nothing took effect.
	// The caller: call again; a keyed replay starts a new attempt.
	ReasonNotObserved = "NOT_OBSERVED"

	// ReasonNotObservable (UNAVAILABLE): the server's attachments could not be listed until past the deadline and settle window: the operation is escalated to operators (ops list --escalated).
	// The caller: an operator decides it (ops resolve); callers wait for that decision.
	ReasonNotObservable = "NOT_OBSERVABLE"

	// ReasonNotSent (DEADLINE_EXCEEDED): recorded, but no request left before its deadline (its lease could not be confirmed, or the database was away).
	// The caller: call again; a keyed replay starts a new attempt.
	ReasonNotSent = "NOT_SENT"

	// ReasonBudgetExhausted (DEADLINE_EXCEEDED): the deadline came before any request could be sent.
	// The caller: call again with more time; a keyed replay starts a new attempt.
	ReasonBudgetExhausted = "BUDGET_EXHAUSTED"

	// ReasonOperatorResolved (FAILED_PRECONDITION): an operator decided the operation FAILED (ops resolve; metadata caller, the reason in the message).
	// The caller: read the operator's reason; a new key (or an Ensure call) asks anew.
	ReasonOperatorResolved = "OPERATOR_RESOLVED"

	// ReasonCancelled (FAILED_PRECONDITION): the operation was cancelled before anything that may take effect was sent (CancelOperation, or a detach of the same volume superseded it; metadata caller): nothing was sent for it, and nothing ever will be.
	// The caller: nothing took effect: call again with a new key (or an Ensure call) to ask anew.
	ReasonCancelled = "CANCELLED"

	// ReasonFailed (FAILED_PRECONDITION): a FAILED operation written without a reason (by no released version).
	// The caller: read the reconcile log (ops show).
	ReasonFailed = "FAILED"

	// ReasonInvalidField (INVALID_ARGUMENT): a field is invalid (metadata field, and a BadRequest violation).
	// The caller: fix the field.
	ReasonInvalidField = "INVALID_FIELD"

	// ReasonIdempotencyKeyReused (FAILED_PRECONDITION): the key was used for a different request (metadata operation_id and the existing request), or collides with another key's hash (cause=key_hash_collision).
	// The caller: use a new key for a new request.
	ReasonIdempotencyKeyReused = "IDEMPOTENCY_KEY_REUSED"

	// ReasonIdempotencyKeyExpired (FAILED_PRECONDITION): the key's operation was pruned after --retain (metadata expired_at): it is never run again.
	// The caller: look at the volume, then use a new key.
	ReasonIdempotencyKeyExpired = "IDEMPOTENCY_KEY_EXPIRED"

	// ReasonVolumeBusy (ABORTED): the volume has another operation in flight (its operation_id only to its own caller and to operators).
	// The caller: retry later, or wait for that operation.
	ReasonVolumeBusy = "VOLUME_BUSY"

	// ReasonOperationNotFound (NOT_FOUND): no such operation, or (to an orchestrator) another caller's.
	// The caller: check the id.
	ReasonOperationNotFound = "OPERATION_NOT_FOUND"

	// ReasonOperationAlreadyDecided (FAILED_PRECONDITION): ResolveOperation or CancelOperation of an operation that is decided already.
	// The caller: nothing to resolve or cancel: read its decision.
	ReasonOperationAlreadyDecided = "OPERATION_ALREADY_DECIDED"

	// ReasonCancelTooLate (FAILED_PRECONDITION): CancelOperation of an operation whose request may be leaving or may have left (metadata operation_id): nothing was cancelled, and it goes on.
	// The caller: wait for its decision (only a detach undoes an attach).
	ReasonCancelTooLate = "CANCEL_TOO_LATE"

	// ReasonOperationInProgress (DEADLINE_EXCEEDED): the caller's deadline came while the operation still runs (metadata operation_id).
	// The caller: keep operation_id: wait for it, or call again (it joins).
	ReasonOperationInProgress = "OPERATION_IN_PROGRESS"

	// ReasonBudgetTooSmall (DEADLINE_EXCEEDED): the caller's deadline leaves too little time to start a request to Nova: this call started nothing (a replay of an open or decided key is answered with its operation instead).
	// The caller: call again with a longer deadline.
	ReasonBudgetTooSmall = "BUDGET_TOO_SMALL"

	// ReasonDeadlineExceeded (DEADLINE_EXCEEDED): the service answered for a handler still working at the caller's deadline (metadata stage).
	// The caller: call again; an operation it started is joined by the same key or Ensure call.
	ReasonDeadlineExceeded = "DEADLINE_EXCEEDED"

	// ReasonWatchIdle (DEADLINE_EXCEEDED): WatchOperation saw no change for --watch-idle-timeout.
	// The caller: open the watch again.
	ReasonWatchIdle = "WATCH_IDLE"

	// ReasonLedgerOverloaded (RESOURCE_EXHAUSTED): the ledger's write queue is full (--max-queued-writes): nothing recorded (RetryInfo).
	// The caller: retry after the RetryInfo delay.
	ReasonLedgerOverloaded = "LEDGER_OVERLOADED"

	// ReasonDatabaseDeadline (DEADLINE_EXCEEDED): the caller's deadline came while the ledger had not answered (metadata stage).
	// The caller: call again; if the intent was written, the same key joins it.
	ReasonDatabaseDeadline = "DATABASE_DEADLINE"

	// ReasonDatabaseUnavailable (UNAVAILABLE): the ledger is unreachable or failed (metadata stage, cause).
	// The caller: retry later with the same key (an intent that was written is joined).
	ReasonDatabaseUnavailable = "DATABASE_UNAVAILABLE"

	// ReasonLedgerRowUnreadable (INTERNAL): a ledger row could not be read (a bug or a foreign write).
	// The caller: report it: an operator reads the row (metadata row).
	ReasonLedgerRowUnreadable = "LEDGER_ROW_UNREADABLE"

	// ReasonOperationTaskLost (INTERNAL): the task running the operation ended without an answer (a bug).
	// The caller: call again with the same key; report it.
	ReasonOperationTaskLost = "OPERATION_TASK_LOST"

	// ReasonUnauthenticated (UNAUTHENTICATED): no valid token or client certificate.
	// The caller: fix the credentials.
	ReasonUnauthenticated = "UNAUTHENTICATED"

	// ReasonPermissionDenied (PERMISSION_DENIED): the caller's role may not call this RPC (operators only).
	// The caller: use an operator's credentials.
	ReasonPermissionDenied = "PERMISSION_DENIED"

	// ReasonCallerRateLimited (RESOURCE_EXHAUSTED): the caller is over its rate (--caller-rate-limit): nothing recorded (RetryInfo).
	// The caller: retry after the RetryInfo delay.
	ReasonCallerRateLimited = "CALLER_RATE_LIMITED"

	// ReasonCallerQuotaExceeded (RESOURCE_EXHAUSTED): the caller is over a quota of its row of --caller-quotas, its rate or its operations in flight (QuotaFailure names the caller and the quota; RetryInfo): nothing recorded.
	// The caller: retry after the RetryInfo delay.
	ReasonCallerQuotaExceeded = "CALLER_QUOTA_EXCEEDED"

	// ReasonOverloaded (RESOURCE_EXHAUSTED): --max-inflight-mutations operations are running: nothing recorded (RetryInfo).
	// The caller: retry after the RetryInfo delay.
	ReasonOverloaded = "OVERLOADED"

	// ReasonReadsOverloaded (RESOURCE_EXHAUSTED): --max-inflight-reads reads are in flight (RetryInfo).
	// The caller: retry after the RetryInfo delay.
	ReasonReadsOverloaded = "READS_OVERLOADED"

	// ReasonWatchesOverloaded (RESOURCE_EXHAUSTED): --max-watch-streams watches are open (RetryInfo).
	// The caller: retry after the RetryInfo delay, or poll GetOperation.
	ReasonWatchesOverloaded = "WATCHES_OVERLOADED"

	// ReasonMessageTooLarge (RESOURCE_EXHAUSTED): the request is larger than --max-message-bytes.
	// The caller: send a smaller request.
	ReasonMessageTooLarge = "MESSAGE_TOO_LARGE"

	// ReasonClientDeadline (DEADLINE_EXCEEDED): the Rust client's own deadline passed before an answer (said by the client, never the service).
	// The caller: call again with the same key.
	ReasonClientDeadline = "CLIENT_DEADLINE"

	// ReasonUnrecognized (FAILED_PRECONDITION): a reason this version does not know, read from a row another version wrote.
	// The caller: read the reconcile log (ops show).
	ReasonUnrecognized = "UNRECOGNIZED"
)

// reasonCodes is the code the service answers each reason with: what
// Wait answers a FAILED operation with, as AttachVolume does.
var reasonCodes = map[string]codes.Code{
	ReasonNovaTimeout:              codes.DeadlineExceeded,
	ReasonNovaUnreachable:          codes.Unavailable,
	ReasonNovaResponseLost:         codes.FailedPrecondition,
	ReasonNovaBadResponse:          codes.FailedPrecondition,
	ReasonKeystoneAuthFailed:       codes.Unavailable,
	ReasonNovaAlreadyAttached:      codes.FailedPrecondition,
	ReasonNovaDetaching:            codes.FailedPrecondition,
	ReasonNovaVolumeNotReady:       codes.FailedPrecondition,
	ReasonNovaDeviceInUse:          codes.FailedPrecondition,
	ReasonNovaNotAttached:          codes.FailedPrecondition,
	ReasonNovaServerNotFound:       codes.NotFound,
	ReasonNovaVolumeNotFound:       codes.NotFound,
	ReasonNovaForbidden:            codes.PermissionDenied,
	ReasonNovaTooManyDisks:         codes.ResourceExhausted,
	ReasonNovaConflict:             codes.Aborted,
	ReasonNovaThrottled:            codes.Aborted,
	ReasonNovaBadRequest:           codes.FailedPrecondition,
	ReasonNovaUnauthorized:         codes.Unavailable,
	ReasonNovaServerError:          codes.FailedPrecondition,
	ReasonNovaUnexpectedStatus:     codes.FailedPrecondition,
	ReasonAlreadyAttachedElsewhere: codes.FailedPrecondition,
	ReasonAttachRolledBack:         codes.Aborted,
	ReasonVolumeInError:            codes.FailedPrecondition,
	ReasonOutcomeUnknown:           codes.DeadlineExceeded,
	ReasonNotObserved:              codes.Aborted,
	ReasonNotObservable:            codes.Unavailable,
	ReasonNotSent:                  codes.DeadlineExceeded,
	ReasonBudgetExhausted:          codes.DeadlineExceeded,
	ReasonOperatorResolved:         codes.FailedPrecondition,
	ReasonCancelled:                codes.FailedPrecondition,
	ReasonFailed:                   codes.FailedPrecondition,
	ReasonInvalidField:             codes.InvalidArgument,
	ReasonIdempotencyKeyReused:     codes.FailedPrecondition,
	ReasonIdempotencyKeyExpired:    codes.FailedPrecondition,
	ReasonVolumeBusy:               codes.Aborted,
	ReasonOperationNotFound:        codes.NotFound,
	ReasonOperationAlreadyDecided:  codes.FailedPrecondition,
	ReasonCancelTooLate:            codes.FailedPrecondition,
	ReasonOperationInProgress:      codes.DeadlineExceeded,
	ReasonBudgetTooSmall:           codes.DeadlineExceeded,
	ReasonDeadlineExceeded:         codes.DeadlineExceeded,
	ReasonWatchIdle:                codes.DeadlineExceeded,
	ReasonLedgerOverloaded:         codes.ResourceExhausted,
	ReasonDatabaseDeadline:         codes.DeadlineExceeded,
	ReasonDatabaseUnavailable:      codes.Unavailable,
	ReasonLedgerRowUnreadable:      codes.Internal,
	ReasonOperationTaskLost:        codes.Internal,
	ReasonUnauthenticated:          codes.Unauthenticated,
	ReasonPermissionDenied:         codes.PermissionDenied,
	ReasonCallerRateLimited:        codes.ResourceExhausted,
	ReasonCallerQuotaExceeded:      codes.ResourceExhausted,
	ReasonOverloaded:               codes.ResourceExhausted,
	ReasonReadsOverloaded:          codes.ResourceExhausted,
	ReasonWatchesOverloaded:        codes.ResourceExhausted,
	ReasonMessageTooLarge:          codes.ResourceExhausted,
	ReasonClientDeadline:           codes.DeadlineExceeded,
	ReasonUnrecognized:             codes.FailedPrecondition,
}
