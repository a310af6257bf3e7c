package volumereconciler

import (
	"fmt"
	"sort"
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
// FAILED (what Wait returns with it): its recorded reason, message and
// metadata, under FAILED_PRECONDITION, the service's code for a failed
// operation in general (the reason says which failure it was).
func operationError(method string, op *reconcilerv1.Operation) *Error {
	last := op.GetLastError()
	meta := map[string]string{"operation_id": op.GetId()}
	for k, v := range last.GetMetadata() {
		meta[k] = v
	}
	info := &errdetails.ErrorInfo{Reason: last.GetReason(), Domain: "volume-reconciler", Metadata: meta}
	msg := last.GetMessage()
	if msg == "" {
		msg = "the operation failed"
	}
	st, err := status.New(codes.FailedPrecondition, msg).WithDetails(info)
	if err != nil {
		// An ErrorInfo always marshals; keep the plain status if not.
		st = status.New(codes.FailedPrecondition, msg)
	}
	return newError(method, st, 1)
}

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
		fmt.Fprintf(&b, " [after %d attempts with the same key]", e.Attempts)
	}
	return b.String()
}

// GRPCStatus lets status.Code, status.FromError and grpc's own helpers
// read the answer as it came.
func (e *Error) GRPCStatus() *status.Status { return e.status }

// OperationID is the ledger's id of the operation the error is about,
// when the service named one (operation_id).
func (e *Error) OperationID() string { return e.Metadata["operation_id"] }

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
