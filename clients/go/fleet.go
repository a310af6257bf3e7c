package volumereconciler

// Operating a fleet (labels are a field of each request): lists by labels and
// time ranges, cancelling an operation before anything was sent for it,
// and the operators' bulk calls by filter (docs/api.md, "Operating a
// fleet").

import (
	"context"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	reconcilerv1 "github.com/volume-reconciler/volume-reconciler/clients/go/volume_reconciler/v1"
)

// Filter says which operations a list or a bulk call is about: every
// field set applies (the zero Filter: every operation the caller reads).
type Filter struct {
	// STATE_UNSPECIFIED: any.
	State    reconcilerv1.State
	ServerID string
	VolumeID string
	// Only another caller's operations (an operator's filter).
	Caller string
	// Only operations whose later observation disagreed.
	Drifted bool
	// Only operations handed to people.
	Escalated bool
	// Only operations carrying every one of these labels.
	Labels map[string]string
	// Created at or after, and before (zero: open).
	CreatedAfter, CreatedBefore time.Time
	// Last changed at or after, and before (zero: open).
	UpdatedAfter, UpdatedBefore time.Time
}

func stamp(t time.Time) *timestamppb.Timestamp {
	if t.IsZero() {
		return nil
	}
	return timestamppb.New(t)
}

// Proto is the filter as the API has it.
func (f Filter) Proto() *reconcilerv1.OperationFilter {
	return &reconcilerv1.OperationFilter{
		State:         f.State,
		ServerId:      f.ServerID,
		VolumeId:      f.VolumeID,
		Caller:        f.Caller,
		DriftedOnly:   f.Drifted,
		EscalatedOnly: f.Escalated,
		Labels:        f.Labels,
		CreatedAfter:  stamp(f.CreatedAfter),
		CreatedBefore: stamp(f.CreatedBefore),
		UpdatedAfter:  stamp(f.UpdatedAfter),
		UpdatedBefore: stamp(f.UpdatedBefore),
	}
}

// asError is a failed call's *Error (a read is not replayed: it is asked
// again by its caller).
func asError(method string, err error) error {
	st, _ := status.FromError(err)
	return newError(method, st, 1)
}

// List is one page of the operations f matches, newest first (pageSize 0:
// the service's 50; pageToken "": the first page), and the next page's
// token ("" after the last). Paged by a position that does not change: an
// operation that changes while the list is paged is listed at most once.
func (c *Client) List(ctx context.Context, f Filter, pageSize int32, pageToken string, opts ...grpc.CallOption) ([]*reconcilerv1.Operation, string, error) {
	page, err := c.rpc.ListOperations(ctx, &reconcilerv1.ListOperationsRequest{
		Filter:    f.Proto(),
		PageSize:  pageSize,
		PageToken: pageToken,
	}, opts...)
	if err != nil {
		return nil, "", asError("ListOperations", err)
	}
	return page.GetOperations(), page.GetNextPageToken(), nil
}

// Cancel decides an operation FAILED (RESOLUTION_CANCELLED) if nothing that
// may take effect was sent for it yet; nothing is then ever sent for it.
// Otherwise an *Error: CANCEL_TOO_LATE (a request may be leaving or have
// left: only a detach undoes an attach) or OPERATION_ALREADY_DECIDED. It
// is not replayed: asked again after a lost answer, a cancel that took
// effect answers OPERATION_ALREADY_DECIDED, and Get tells the state.
func (c *Client) Cancel(ctx context.Context, operationID, reason string, opts ...grpc.CallOption) (*reconcilerv1.Operation, error) {
	op, err := c.rpc.CancelOperation(ctx, &reconcilerv1.CancelOperationRequest{
		OperationId: operationID,
		Reason:      reason,
	}, opts...)
	if err != nil {
		return nil, asError("CancelOperation", err)
	}
	return op, nil
}

// Bulk says how a bulk call goes.
type Bulk struct {
	// List what a real run would act on; touch nothing.
	DryRun bool
	// At most this many operations (0: the service's 100).
	MaxCount uint32
	// At most this many a second (0: the service's 10).
	RatePerSecond float64
}

// ReconcileMatching re-observes every operation f matches (an operator's
// call): the set is pinned when the call starts, and each acted on only if
// it still matches when its turn comes. Safe to call again.
func (c *Client) ReconcileMatching(ctx context.Context, f Filter, b Bulk, opts ...grpc.CallOption) (*reconcilerv1.BulkResult, error) {
	r, err := c.rpc.ReconcileOperations(ctx, &reconcilerv1.ReconcileOperationsRequest{
		Filter:        f.Proto(),
		DryRun:        b.DryRun,
		MaxCount:      b.MaxCount,
		RatePerSecond: b.RatePerSecond,
	}, opts...)
	if err != nil {
		return nil, asError("ReconcileOperations", err)
	}
	return r, nil
}

// ResolveMatching decides every open operation f matches as state
// (SUCCEEDED or FAILED), for reason (an operator's call, audited): a dry
// run lists exactly what a real run decides. Interrupted, the same call
// again acts only on what still matches.
func (c *Client) ResolveMatching(ctx context.Context, f Filter, state reconcilerv1.State, reason string, b Bulk, opts ...grpc.CallOption) (*reconcilerv1.BulkResult, error) {
	r, err := c.rpc.ResolveOperations(ctx, &reconcilerv1.ResolveOperationsRequest{
		Filter:        f.Proto(),
		State:         state,
		Reason:        reason,
		DryRun:        b.DryRun,
		MaxCount:      b.MaxCount,
		RatePerSecond: b.RatePerSecond,
	}, opts...)
	if err != nil {
		return nil, asError("ResolveOperations", err)
	}
	return r, nil
}
