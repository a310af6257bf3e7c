package csi

import (
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	vr "github.com/volume-reconciler/volume-reconciler/clients/go"
)

// Rule is one row of the mapping from what the service answered to the
// code a CO reads (docs/kubernetes.md prints this table; a test checks it
// row by row against the endpoint). A CO reads the code, not the reason:
// external-attacher's isFinalError takes DEADLINE_EXCEEDED, UNAVAILABLE,
// RESOURCE_EXHAUSTED, ABORTED and CANCELED as "may still be in progress,
// retry", everything else as "certainly not in progress"; and since
// KEP-4876 a RESOURCE_EXHAUSTED from a publish says the node is full.
type Rule struct {
	// The service's reasons (vr.Reason…) the row covers.
	Reasons []string
	// The code of a publish answered so.
	Publish codes.Code
	// The code of an unpublish answered so (codes.OK: the volume is not
	// attached there, which is what was asked).
	Unpublish codes.Code
	// Why, for the docs' table.
	Why string
}

// Rules is the mapping, row by row. A reason in no row keeps the service's
// code, except RESOURCE_EXHAUSTED (see unlisted).
var Rules = []Rule{
	{[]string{vr.ReasonOutcomeUnknown, vr.ReasonOperationInProgress, vr.ReasonBudgetTooSmall, vr.ReasonBudgetExhausted,
		vr.ReasonNotSent, vr.ReasonNovaTimeout, vr.ReasonDeadlineExceeded, vr.ReasonDatabaseDeadline, vr.ReasonClientDeadline},
		codes.DeadlineExceeded, codes.DeadlineExceeded,
		"not known yet, or not begun in time: the CO calls again and the call joins the open operation"},
	{[]string{vr.ReasonVolumeBusy, vr.ReasonNovaConflict, vr.ReasonNovaThrottled, vr.ReasonNovaDetaching,
		vr.ReasonNovaVolumeNotReady, vr.ReasonAttachRolledBack, vr.ReasonNotObserved, vr.ReasonOperationTaskLost,
		vr.ReasonCancelled},
		codes.Aborted, codes.Aborted,
		"another operation on the volume, or Nova busy (409, 429, a volume still attaching, detaching or being created), or an operator cancelled the open operation before anything was sent: retry (the next call asks anew)"},
	{[]string{vr.ReasonAlreadyAttachedElsewhere}, codes.FailedPrecondition, codes.OK,
		"attached to another server: the message names it (attached_to); for an unpublish from this node, it is not attached here"},
	{[]string{vr.ReasonNovaServerNotFound, vr.ReasonNovaVolumeNotFound, vr.ReasonNovaNotAttached}, codes.NotFound, codes.OK,
		"the server (node) or the volume does not exist; an unpublish of what is gone, or not attached, is done"},
	{[]string{vr.ReasonNovaTooManyDisks}, codes.ResourceExhausted, codes.ResourceExhausted,
		"Nova's 403 \"maximum number of disk devices exceeded\": the node is full, the one RESOURCE_EXHAUSTED"},
	{[]string{vr.ReasonOverloaded, vr.ReasonCallerRateLimited, vr.ReasonCallerQuotaExceeded, vr.ReasonLedgerOverloaded,
		vr.ReasonReadsOverloaded, vr.ReasonWatchesOverloaded, vr.ReasonNovaUnreachable, vr.ReasonDatabaseUnavailable,
		vr.ReasonNotObservable},
		codes.Unavailable, codes.Unavailable,
		"the service shed the call, rate-limited it or held it to its caller's quota, or cannot reach Nova or its ledger, or handed the operation to an operator: never RESOURCE_EXHAUSTED (that would tell Kubernetes the node is full)"},
	{[]string{vr.ReasonUnauthenticated, vr.ReasonPermissionDenied, vr.ReasonKeystoneAuthFailed, vr.ReasonNovaUnauthorized},
		codes.Unavailable, codes.Unavailable,
		"credentials refused (the endpoint's by the service, or the service's by OpenStack): the message says which to fix; retried once fixed"},
	{[]string{vr.ReasonNovaForbidden, vr.ReasonNovaDeviceInUse, vr.ReasonNovaBadRequest, vr.ReasonVolumeInError,
		vr.ReasonNovaAlreadyAttached, vr.ReasonIdempotencyKeyReused, vr.ReasonIdempotencyKeyExpired, vr.ReasonOperatorResolved,
		vr.ReasonFailed, vr.ReasonUnrecognized},
		codes.FailedPrecondition, codes.FailedPrecondition,
		"Nova or the service refused, and asking again as it is will not change it: an operator acts (the message names the reason)"},
	{[]string{vr.ReasonNovaServerError, vr.ReasonNovaUnexpectedStatus, vr.ReasonNovaBadResponse, vr.ReasonNovaResponseLost},
		codes.Unavailable, codes.Unavailable,
		"Nova failed (5xx, an answer outside its contract, a response lost and not re-observed): retry"},
	{[]string{vr.ReasonMessageTooLarge, vr.ReasonLedgerRowUnreadable, vr.ReasonOperationNotFound, vr.ReasonOperationAlreadyDecided,
		vr.ReasonCancelTooLate},
		codes.Internal, codes.Internal,
		"a fault of the endpoint or the service, not of the request (the endpoint never cancels or resolves, so an answer of those calls is one): the message says which"},
}

var byReason = func() map[string]Rule {
	m := map[string]Rule{}
	for _, r := range Rules {
		for _, reason := range r.Reasons {
			m[reason] = r
		}
	}
	return m
}()

// toCSI is the CSI answer of a call to the service that failed with err:
// a status with the code the CO reads, whose message carries everything
// the service said (the method, code, reason, message, operation id and
// every metadata key), and nil for an unpublish the answer shows done.
func toCSI(publish bool, err error) error {
	var e *vr.Error
	if !errors.As(err, &e) {
		// Not an answer of the service (a bug of this endpoint).
		return status.Errorf(codes.Internal, "volume-reconciler: %v", err)
	}
	code := codeOf(publish, e)
	if code == codes.OK {
		return nil
	}
	msg := e.Error()
	switch {
	case e.Reason == vr.ReasonAlreadyAttachedElsewhere && e.Metadata["attached_to"] != "":
		msg = fmt.Sprintf("volume %s is attached to node %s: %s", e.Metadata["volume_id"], e.Metadata["attached_to"], msg)
	case e.Reason == vr.ReasonUnauthenticated || e.Reason == vr.ReasonPermissionDenied:
		msg = "volume-reconciler refused this endpoint's credentials (check --token-file, --tls-cert and --tls-key, and the service's --auth-tokens or --tls-client-ca): " + msg
	case e.Reason == vr.ReasonKeystoneAuthFailed || e.Reason == vr.ReasonNovaUnauthorized:
		msg = "volume-reconciler cannot authenticate to OpenStack (check the service's clouds.yaml or OS_* settings): " + msg
	case e.Code == codes.Unimplemented:
		msg = "the volume-reconciler service does not have this call (EnsureAttached and EnsureDetached need a newer service): upgrade it: " + msg
	}
	return status.Error(code, msg)
}

// codeOf is the code a CO reads for e.
func codeOf(publish bool, e *vr.Error) codes.Code {
	if r, ok := byReason[e.Reason]; ok {
		if publish {
			return r.Publish
		}
		return r.Unpublish
	}
	switch {
	case e.Reason == vr.ReasonInvalidField && (e.Metadata["field"] == "server_id" || e.Metadata["field"] == "volume_id"):
		// No server or volume has an id that is not a UUID.
		if publish {
			return codes.NotFound
		}
		return codes.OK
	case e.Code == codes.Unimplemented:
		return codes.FailedPrecondition
	case e.Code == codes.ResourceExhausted:
		// Only Nova's too-many-disks (a row above) says the node is full.
		return codes.Unavailable
	}
	return e.Code
}
