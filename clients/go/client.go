// Package volumereconciler is the Go client of volume-reconciler: it attaches
// and detaches OpenStack volumes exactly once per idempotency key, and
// answers with the operation the service's ledger decided.
//
// The caller's context is the only bound of a call: the client adds no
// timeout of its own, and grpc-go sends the context's deadline to the
// service (grpc-timeout), which plans its calls to Nova within it. Within
// that deadline the client replays the same key when the outcome could not
// be known yet (DEADLINE_EXCEEDED with OUTCOME_UNKNOWN, reported with time
// left), when the connection failed or was drained under the call
// (UNAVAILABLE, a GOAWAY), and when the service asked to come back later
// (ABORTED or RESOURCE_EXHAUSTED with a google.rpc.RetryInfo). A replay is
// safe because the service runs a key at most once: a replay joins the
// key's operation and never sends Nova a second request.
//
// Errors are *Error values (errors.As) that keep every ErrorInfo and every
// other detail the service sent.
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

// Client calls one volume-reconciler service over a gRPC connection.
// It is safe for concurrent use.
type Client struct {
	conn grpc.ClientConnInterface
	rpc  reconcilerv1.VolumeReconcilerClient
}

// New wraps a connection the caller made (and closes).
func New(conn grpc.ClientConnInterface) *Client {
	return &Client{conn: conn, rpc: reconcilerv1.NewVolumeReconcilerClient(conn)}
}

// Dial makes a connection to target ("host:port", or any grpc-go target)
// with opts: the credentials (Insecure, WithBearerToken, WithMTLS) and any
// other grpc.DialOption. Close the returned connection when done.
func Dial(target string, opts ...grpc.DialOption) (*Client, *grpc.ClientConn, error) {
	conn, err := grpc.NewClient(target, opts...)
	if err != nil {
		return nil, nil, fmt.Errorf("volume-reconciler %s: %w", target, err)
	}
	return New(conn), conn, nil
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
}

// DetachRequest is a detach to run once per Key.
type DetachRequest struct {
	Key      string
	ServerID string
	VolumeID string
}

// Attach attaches req.VolumeID to req.ServerID once per req.Key, and
// answers with the decided operation (SUCCEEDED) or an *Error. ctx is the
// only bound: give it the deadline the attach may take (Nova's own attach
// may take minutes; a one-hour deadline is reasonable).
func (c *Client) Attach(ctx context.Context, req AttachRequest, opts ...grpc.CallOption) (*reconcilerv1.Operation, error) {
	if req.Key == "" {
		return nil, errors.New("volume-reconciler AttachVolume: a Key is required (KeyFor makes one)")
	}
	msg := &reconcilerv1.AttachVolumeRequest{
		IdempotencyKey:      req.Key,
		ServerId:            req.ServerID,
		VolumeId:            req.VolumeID,
		Device:              req.Device,
		Tag:                 req.Tag,
		DeleteOnTermination: req.DeleteOnTermination,
	}
	return replay(ctx, "AttachVolume", func(ctx context.Context) (*reconcilerv1.Operation, error) {
		return c.rpc.AttachVolume(ctx, msg, opts...)
	})
}

// Detach detaches req.VolumeID from req.ServerID once per req.Key; same
// contract as Attach. Detaching a volume that is not attached succeeds.
func (c *Client) Detach(ctx context.Context, req DetachRequest, opts ...grpc.CallOption) (*reconcilerv1.Operation, error) {
	if req.Key == "" {
		return nil, errors.New("volume-reconciler DetachVolume: a Key is required (KeyFor makes one)")
	}
	msg := &reconcilerv1.DetachVolumeRequest{
		IdempotencyKey: req.Key,
		ServerId:       req.ServerID,
		VolumeId:       req.VolumeID,
	}
	return replay(ctx, "DetachVolume", func(ctx context.Context) (*reconcilerv1.Operation, error) {
		return c.rpc.DetachVolume(ctx, msg, opts...)
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
// a FAILED one with an *Error made of its last_error. A stream that ends
// before a terminal state (the service's idle limit, a drain, a broken
// connection) is opened again while ctx has time.
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
