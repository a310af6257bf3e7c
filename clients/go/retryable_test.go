package volumereconciler_test

import (
	"errors"
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	vr "github.com/volume-reconciler/volume-reconciler/clients/go"
)

// IsRetryable decides from the code and the reason; the message never
// enters (each row's message says the opposite of its answer).
func TestIsRetryableReadsCodesAndReasonsOnly(t *testing.T) {
	rows := []struct {
		err  error
		want bool
	}{
		{withInfo(codes.DeadlineExceeded, vr.ReasonOutcomeUnknown, 0), true},
		{withInfo(codes.DeadlineExceeded, vr.ReasonBudgetTooSmall, 0), true},
		{withInfo(codes.Aborted, vr.ReasonVolumeBusy, 0), true},
		{withInfo(codes.Aborted, vr.ReasonNovaConflict, 0), true},
		{withInfo(codes.ResourceExhausted, vr.ReasonOverloaded, 0), true},
		{withInfo(codes.ResourceExhausted, vr.ReasonNovaTooManyDisks, 0), true},
		{withInfo(codes.Unavailable, vr.ReasonNovaUnreachable, 0), true},
		{withInfo(codes.Unavailable, vr.ReasonNotObservable, 0), false},
		{withInfo(codes.Internal, vr.ReasonOperationTaskLost, 0), true},
		{withInfo(codes.Internal, vr.ReasonLedgerRowUnreadable, 0), false},
		{withInfo(codes.FailedPrecondition, vr.ReasonAlreadyAttachedElsewhere, 0), false},
		{withInfo(codes.NotFound, vr.ReasonNovaServerNotFound, 0), false},
		{withInfo(codes.InvalidArgument, vr.ReasonInvalidField, 0), false},
		{withInfo(codes.Unauthenticated, vr.ReasonUnauthenticated, 0), false},
		{status.Error(codes.Internal, "not retryable, it says"), true},
		{status.Error(codes.Unknown, "final"), true},
		{status.Error(codes.Unavailable, "permanent"), true},
		{status.Error(codes.PermissionDenied, "retry me: connection reset"), false},
		{fmt.Errorf("wrapped: %w", withInfo(codes.Aborted, vr.ReasonVolumeBusy, 0)), true},
		{vr.ErrMissingKey, false},
		{errors.New("connection reset by peer"), false},
		{nil, false},
	}
	for _, r := range rows {
		if got := vr.IsRetryable(r.err); got != r.want {
			t.Errorf("IsRetryable(%v) = %v, want %v", r.err, got, r.want)
		}
	}
}
