// Package volumereconciler is the Go client of volume-reconciler: it attaches
// and detaches OpenStack volumes exactly once per idempotency key (Attach,
// Detach), or makes a volume attached or detached however often it is asked
// (EnsureAttached, EnsureDetached: the calls of level-triggered callers that
// hold no key), and answers with the operation the service's ledger decided.
//
// The caller's context is the only bound of a call: the client adds no
// timeout of its own, and grpc-go sends the context's deadline to the
// service (grpc-timeout), which plans its calls to Nova within it. Within
// that deadline the client replays the same request when the outcome could
// not be known yet (DEADLINE_EXCEEDED with OUTCOME_UNKNOWN, reported with
// time left), when the connection failed or was drained under the call
// (UNAVAILABLE, a GOAWAY, a reset stream: answers without an ErrorInfo), and
// when the service asked to come back later (ABORTED or RESOURCE_EXHAUSTED
// with a google.rpc.RetryInfo). A replay is safe because the service runs a
// key at most once and an "ensure" call joins the open operation of its
// identity: a replay never sends Nova a second request. A replay is not sent
// into less time than it needs to be answered (replayFloor): the answer
// that named the operation is returned instead.
//
// Errors are *Error values (errors.As) that keep every ErrorInfo and every
// other detail the service sent; IsRetryable says whether asking again may
// be answered differently; the Reason constants (reasons.go) name every
// reason the service sends.
//
// The generated stubs are in the subpackage volume_reconciler/v1
// (package reconcilerv1), for the RPCs this package does not wrap.
package volumereconciler

import (
	"context"
	"errors"
	"fmt"
	"io"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	reconcilerv1 "github.com/volume-reconciler/volume-reconciler/clients/go/volume_reconciler/v1"
)

// ErrMissingKey is the error (errors.Is) of an Attach or Detach asked
// without a Key: nothing is sent. KeyFor makes a key from the intent's
// parts; a caller without one calls EnsureAttached or EnsureDetached.
var ErrMissingKey = errors.New("a Key is required (KeyFor makes one; EnsureAttached and EnsureDetached need none)")

// Client calls one volume-reconciler service over a gRPC connection.
// It is safe for concurrent use.
type Client struct {
	rpc reconcilerv1.VolumeReconcilerClient
	// The connection NewClient made (nil for New's, which the caller owns).
	owned *grpc.ClientConn
}

// NewClient makes a client of the service at target ("host:port", or any
// grpc-go target) with opts: the credentials (Insecure, WithBearerToken,
// WithMTLS) and any other grpc.DialOption. As grpc.NewClient, it connects
// lazily: the first call connects. Close it when done.
func NewClient(target string, opts ...grpc.DialOption) (*Client, error) {
	conn, err := grpc.NewClient(target, opts...)
	if err != nil {
		return nil, fmt.Errorf("volume-reconciler %s: %w", target, err)
	}
	return &Client{rpc: reconcilerv1.NewVolumeReconcilerClient(conn), owned: conn}, nil
}

// New wraps a connection the caller made and closes itself (Close leaves
// it open).
func New(conn grpc.ClientConnInterface) *Client {
	return &Client{rpc: reconcilerv1.NewVolumeReconcilerClient(conn)}
}

// Close closes the connection NewClient made; calls in flight end with
// CANCELED. For a client made by New it does nothing.
func (c *Client) Close() error {
	if c.owned == nil {
		return nil
	}
	return c.owned.Close()
}

// Stub is the generated client on the same connection, for the RPCs this
// package does not wrap (GetOperation, ListOperations, ...).
func (c *Client) Stub() reconcilerv1.VolumeReconcilerClient { return c.rpc }

// AttachRequest is an attach to run once per Key.
type AttachRequest struct {
	// Required: the same key for every try of the same intent (KeyFor
	// makes one from the intent's parts).
	Key string
	// Nova server UUID.
	ServerID string
	// Cinder volume UUID.
	VolumeID string
	// Optional, e.g. "/dev/vdb".
	Device string
	// Optional (Nova microversion >= 2.49).
	Tag string
	// Optional (microversion >= 2.79).
	DeleteOnTermination *bool
	// Optional: the operation's labels (at most 8; keys [prefix/]name of
	// [a-z0-9_.-], values up to 255 printable characters; not for
	// secrets). Part of the request: the same Key with other labels is
	// refused IDEMPOTENCY_KEY_REUSED.
	Labels map[string]string
}

// DetachRequest is a detach to run once per Key.
type DetachRequest struct {
	Key      string
	ServerID string
	VolumeID string
	// Optional: the operation's labels (at most 8; keys [prefix/]name of
	// [a-z0-9_.-], values up to 255 printable characters; not for
	// secrets). Part of the request: the same Key with other labels is
	// refused IDEMPOTENCY_KEY_REUSED.
	Labels map[string]string
}

// Attach attaches req.VolumeID to req.ServerID once per req.Key, and
// answers with the decided operation (SUCCEEDED) or an *Error. ctx is the
// only bound: give it the deadline the attach may take (Nova's own attach
// may take minutes; a one-hour deadline is reasonable). Without a Key it
// sends nothing and answers ErrMissingKey.
func (c *Client) Attach(ctx context.Context, req AttachRequest, opts ...grpc.CallOption) (*reconcilerv1.Operation, error) {
	if req.Key == "" {
		return nil, fmt.Errorf("volume-reconciler AttachVolume: %w", ErrMissingKey)
	}
	msg := &reconcilerv1.AttachVolumeRequest{
		IdempotencyKey:      req.Key,
		ServerId:            req.ServerID,
		VolumeId:            req.VolumeID,
		Device:              req.Device,
		Tag:                 req.Tag,
		DeleteOnTermination: req.DeleteOnTermination,
		Labels:              req.Labels,
	}
	return replay(ctx, "AttachVolume", func(ctx context.Context) (*reconcilerv1.Operation, error) {
		return c.rpc.AttachVolume(ctx, msg, opts...)
	})
}

// Detach detaches req.VolumeID from req.ServerID once per req.Key; same
// contract as Attach. Detaching a volume that is not attached succeeds.
func (c *Client) Detach(ctx context.Context, req DetachRequest, opts ...grpc.CallOption) (*reconcilerv1.Operation, error) {
	if req.Key == "" {
		return nil, fmt.Errorf("volume-reconciler DetachVolume: %w", ErrMissingKey)
	}
	msg := &reconcilerv1.DetachVolumeRequest{
		IdempotencyKey: req.Key,
		ServerId:       req.ServerID,
		VolumeId:       req.VolumeID,
		Labels:         req.Labels,
	}
	return replay(ctx, "DetachVolume", func(ctx context.Context) (*reconcilerv1.Operation, error) {
		return c.rpc.DetachVolume(ctx, msg, opts...)
	})
}

// EnsureRequest names a volume and a server for EnsureAttached and
// EnsureDetached; the attach's options are used only if an attach is sent.
type EnsureRequest struct {
	// Nova server UUID (a CSI node id, as cinder-csi's NodeGetInfo gives).
	ServerID string
	// Cinder volume UUID (a CSI volume id).
	VolumeID string
	// Optional, attach only: e.g. "/dev/vdb".
	Device string
	// Optional, attach only (Nova microversion >= 2.49).
	Tag string
	// Optional, attach only (microversion >= 2.79).
	DeleteOnTermination *bool
	// Optional: the operation's labels, set when it is created (a call
	// that joins an open operation keeps that operation's); as
	// AttachRequest's.
	Labels map[string]string
}

// EnsureAttached makes req.VolumeID attached to req.ServerID, however
// often it is asked, and answers with the operation that made it so (or
// found it so: SUCCEEDED at once, nothing sent) or an *Error. It needs no
// key: the call's identity is (caller, server, volume, attached), and it
// joins the open operation of that identity when there is one, so a call
// asked again after a lost answer never sends Nova a second request. A
// decided operation is never the answer to a later call: each call looks
// at the truth again, so a success is never stale after a detach and a
// refusal does not stick. For callers that hold no state between calls (a
// CSI controller's publish); ctx is the only bound, as for Attach.
func (c *Client) EnsureAttached(ctx context.Context, req EnsureRequest, opts ...grpc.CallOption) (*reconcilerv1.Operation, error) {
	msg := &reconcilerv1.EnsureAttachedRequest{
		ServerId:            req.ServerID,
		VolumeId:            req.VolumeID,
		Device:              req.Device,
		Tag:                 req.Tag,
		DeleteOnTermination: req.DeleteOnTermination,
		Labels:              req.Labels,
	}
	return replay(ctx, "EnsureAttached", func(ctx context.Context) (*reconcilerv1.Operation, error) {
		return c.rpc.EnsureAttached(ctx, msg, opts...)
	})
}

// EnsureDetached makes req.VolumeID not attached to req.ServerID (a server
// that is gone counts as detached); as EnsureAttached, with the identity
// (caller, server, volume, detached). Device, Tag and DeleteOnTermination
// are not used.
func (c *Client) EnsureDetached(ctx context.Context, req EnsureRequest, opts ...grpc.CallOption) (*reconcilerv1.Operation, error) {
	msg := &reconcilerv1.EnsureDetachedRequest{ServerId: req.ServerID, VolumeId: req.VolumeID, Labels: req.Labels}
	return replay(ctx, "EnsureDetached", func(ctx context.Context) (*reconcilerv1.Operation, error) {
		return c.rpc.EnsureDetached(ctx, msg, opts...)
	})
}

// Terminal reports whether an operation's state is final (SUCCEEDED or
// FAILED).
func Terminal(op *reconcilerv1.Operation) bool {
	s := op.GetState()
	return s == reconcilerv1.State_STATE_SUCCEEDED || s == reconcilerv1.State_STATE_FAILED
}

// Wait follows an operation (by its id, e.g. an *Error's OperationID after
// the caller's own deadline passed) over WatchOperation until it is
// terminal, within ctx. A SUCCEEDED operation is returned with a nil error;
// a FAILED one with the *Error that AttachVolume answers for it (the same
// code, reason, message and metadata keys). A stream that ends before a
// terminal state (the service's idle limit, a drain, a broken connection)
// is opened again while ctx has time.
func (c *Client) Wait(ctx context.Context, operationID string, opts ...grpc.CallOption) (*reconcilerv1.Operation, error) {
	return replay(ctx, "WatchOperation", func(ctx context.Context) (*reconcilerv1.Operation, error) {
		stream, err := c.rpc.WatchOperation(ctx, &reconcilerv1.WatchOperationRequest{OperationId: operationID}, opts...)
		if err != nil {
			return nil, err
		}
		var last *reconcilerv1.Operation
		for {
			op, err := stream.Recv()
			switch {
			case err == nil && Terminal(op):
				if op.GetState() == reconcilerv1.State_STATE_FAILED {
					return op, operationError("WatchOperation", op)
				}
				return op, nil
			case err == nil:
				last = op
			case errors.Is(err, io.EOF):
				// Ended without a terminal state: watch again.
				return last, status.Error(codes.Unavailable, "the watch ended before the operation was decided")
			default:
				return last, err
			}
		}
	})
}
