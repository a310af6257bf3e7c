package volumereconciler

import (
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	reconcilerv1 "github.com/volume-reconciler/volume-reconciler/clients/go/volume_reconciler/v1"
)

// Error is what the service (or the transport under it) answered when a
// call did not return an operation. It keeps everything the status
// carried: the code, the message, every google.rpc.ErrorInfo (their
// metadata merged into Metadata, the first reason in Reason) and every
// other detail (RetryInfo, BadRequest, ...) in Details. Get it with
// errors.As:
//
//	var e *volumereconciler.Error
//	if errors.As(err, &e) && e.Reason == "ALREADY_ATTACHED_ELSEWHERE" {
//		log.Printf("attached to %s", e.Metadata["attached_to"])
//	}
//
// status.Code(err) and status.FromError(err) work on it too (GRPCStatus).
type Error struct {
	// The RPC, e.g. "AttachVolume".
	Method string
	// The gRPC code of the last answer.
	Code codes.Code
	// The status message of the last answer.
	Message string
	// The first ErrorInfo's reason (OUTCOME_UNKNOWN, VOLUME_BUSY, ...);
	// empty when the answer carried none (a transport failure).
	Reason string
	// The first ErrorInfo's domain ("volume-reconciler").
	Domain string
	// Every ErrorInfo's metadata, merged: operation_id, method, url,
	// http_status, nova_fault, cause, attached_to... When two ErrorInfos
	// name the same key with different values, the later one is kept
	// under "KEY#N" (N its position), so nothing is dropped.
	Metadata map[string]string
	// Every ErrorInfo of the answer, as sent.
	Infos []*errdetails.ErrorInfo
	// Every detail of the answer (ErrorInfo, RetryInfo, BadRequest, ...),
	// as sent; a detail of a type this program does not know is an error
	// value in its place (status.Status.Details' convention).
	Details []any
	// How many times the call was sent with the same key (1: no replay).
	Attempts int
	// The last attempt's answer when it is not this one: a replay whose
	// answer lost the operation id (a bare DEADLINE_EXCEEDED of the
	// transport) never replaces an answer that named the operation, which
	// is returned instead with this one kept here. Nil otherwise.
	Last *Error

	status *status.Status
}

// newError reads everything the status carries.
func newError(method string, st *status.Status, attempts int) *Error {
	e := &Error{
		Method:   method,
		Code:     st.Code(),
		Message:  st.Message(),
		Metadata: map[string]string{},
		Details:  st.Details(),
		Attempts: attempts,
		status:   st,
	}
	for _, d := range e.Details {
		info, ok := d.(*errdetails.ErrorInfo)
		if !ok {
			continue
		}
		if len(e.Infos) == 0 {
			e.Reason, e.Domain = info.GetReason(), info.GetDomain()
		}
		e.Infos = append(e.Infos, info)
		for k, v := range info.GetMetadata() {
			if old, seen := e.Metadata[k]; seen && old != v {
				k = fmt.Sprintf("%s#%d", k, len(e.Infos))
			}
			e.Metadata[k] = v
		}
	}
	return e
}

// operationError is the error of an operation the ledger recorded as
// FAILED (what Wait returns with it), made as the service makes the answer
// of AttachVolume for it (src/grpc/status.rs, from_operation): the code of
// its recorded reason, the message "operation ID failed: MESSAGE", and its
// last_error's metadata with operation_id, state, server_id, volume_id and
// attempts. A reason this client does not know (a newer service's) is
// answered FAILED_PRECONDITION, as the service reads an unknown one.
func operationError(method string, op *reconcilerv1.Operation) *Error {
	last := op.GetLastError()
	reason, message := last.GetReason(), last.GetMessage()
	if last == nil {
		reason, message = ReasonFailed, "the operation failed"
	}
	meta := map[string]string{}
	for k, v := range last.GetMetadata() {
		meta[k] = v
	}
	meta["operation_id"] = op.GetId()
	meta["state"] = "failed"
	meta["server_id"] = op.GetServerId()
	meta["volume_id"] = op.GetVolumeId()
	meta["attempts"] = strconv.FormatUint(uint64(op.GetAttempts()), 10)
	code, known := reasonCodes[reason]
	if !known {
		code = codes.FailedPrecondition
	}
	info := &errdetails.ErrorInfo{Reason: reason, Domain: Domain, Metadata: meta}
	msg := fmt.Sprintf("operation %s failed: %s", op.GetId(), message)
	st, err := status.New(code, msg).WithDetails(info)
	if err != nil {
		// An ErrorInfo always marshals; keep the plain status if not.
		st = status.New(code, msg)
	}
	return newError(method, st, 1)
}

// Domain is the ErrorInfo domain of every answer of the service.
const Domain = "volume-reconciler"

// Error reads as one line: the RPC, the code, the reason, the message and
// every metadata key, sorted:
//
//	AttachVolume: FAILED_PRECONDITION ALREADY_ATTACHED_ELSEWHERE: volume ... (attached_to=..., method=POST, url=..., http_status=409, ...)
func (e *Error) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s: %s", e.Method, codeName(e.Code))
	if e.Reason != "" {
		b.WriteString(" " + e.Reason)
	}
	fmt.Fprintf(&b, ": %s", e.Message)
	keys := make([]string, 0, len(e.Metadata))
	for k := range e.Metadata {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for i, k := range keys {
		if i == 0 {
			b.WriteString(" (")
		} else {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s=%s", k, e.Metadata[k])
	}
	if len(keys) > 0 {
		b.WriteString(")")
	}
	if e.Attempts > 1 {
		fmt.Fprintf(&b, " [after %d attempts with the same request]", e.Attempts)
	}
	if e.Last != nil {
		fmt.Fprintf(&b, " [the last attempt: %s %s]", codeName(e.Last.Code), e.Last.Message)
	}
	return b.String()
}

// GRPCStatus lets status.Code, status.FromError and grpc's own helpers
// read the answer as it came.
func (e *Error) GRPCStatus() *status.Status { return e.status }

// OperationID is the ledger's id of the operation the error is about,
// when the service named one (operation_id).
func (e *Error) OperationID() string { return e.Metadata["operation_id"] }

// Undecided reports whether the answer names an operation that is not
// decided yet: OUTCOME_UNKNOWN (its request's outcome is being settled)
// or OPERATION_IN_PROGRESS (the caller's deadline came before the run
// recorded anything more, e.g. a slow ledger), with its operation_id.
// Either way the operation goes on: Wait for it, or call again with the
// same key (or the same Ensure call), which joins it.
func (e *Error) Undecided() bool {
	return e.OperationID() != "" && (e.Reason == ReasonOutcomeUnknown || e.Reason == ReasonOperationInProgress)
}

// RetryDelay is the pause the service asked for (google.rpc.RetryInfo),
// and whether it sent one.
func (e *Error) RetryDelay() (time.Duration, bool) {
	for _, det := range e.Details {
		if ri, is := det.(*errdetails.RetryInfo); is && ri.GetRetryDelay() != nil {
			return ri.GetRetryDelay().AsDuration(), true
		}
	}
	return 0, false
}

// codeName is the canonical name of a code (FAILED_PRECONDITION), as the
// service's docs and metrics spell it; codes.Code.String is CamelCase.
func codeName(c codes.Code) string {
	s := c.String()
	if s == "OK" {
		return s
	}
	var b strings.Builder
	for i, r := range s {
		if i > 0 && r >= 'A' && r <= 'Z' {
			b.WriteByte('_')
		}
		b.WriteRune(r)
	}
	return strings.ToUpper(b.String())
}

// IsRetryable reports whether asking again (the same key, or the same
// EnsureAttached or EnsureDetached call) may be answered differently, from
// the error's code and reason only: the outcome not known yet
// (DEADLINE_EXCEEDED: OUTCOME_UNKNOWN, OPERATION_IN_PROGRESS, a deadline
// too short), the service or its dependencies unavailable, shed or
// rate-limited (UNAVAILABLE, RESOURCE_EXHAUSTED), a volume busy or Nova
// busy (ABORTED), and a failure of the transport (CANCELED, INTERNAL or
// UNKNOWN that carry no ErrorInfo: the service sends one with every answer
// of its own). Not retryable: a refusal that asking again cannot change
// (INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, PERMISSION_DENIED,
// UNAUTHENTICATED, the service's own INTERNAL), and an operation handed to
// people (NOT_OBSERVABLE: an operator decides it). A nil error is not
// retryable; ErrMissingKey is not; an error that is no gRPC status is not.
func IsRetryable(err error) bool {
	if err == nil {
		return false
	}
	var e *Error
	if !errors.As(err, &e) {
		st, ok := status.FromError(err)
		if !ok {
			return false
		}
		e = newError("", st, 1)
	}
	return e.Retryable()
}

// Retryable is IsRetryable for this error.
func (e *Error) Retryable() bool {
	switch e.Reason {
	case ReasonNotObservable:
		return false
	case ReasonOperationTaskLost:
		// The service's own INTERNAL that says "ask again".
		return true
	}
	switch e.Code {
	case codes.DeadlineExceeded, codes.Unavailable, codes.ResourceExhausted, codes.Aborted:
		return true
	case codes.Canceled, codes.Internal, codes.Unknown:
		return len(e.Infos) == 0
	}
	return false
}

// ReasonCode is the code the service answers reason with (as its list of
// reasons says), and whether this client knows the reason.
func ReasonCode(reason string) (codes.Code, bool) {
	c, ok := reasonCodes[reason]
	return c, ok
}
