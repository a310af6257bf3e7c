package volumereconciler_test

// The replay policy alone, against a scripted in-process server (real
// gRPC over a loopback socket): which answers are replayed, that the key
// stays the same, that RetryInfo's delay is honoured and that the
// caller's deadline ends the replays. The real service's cases are in
// client_test.go.

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	vr "github.com/volume-reconciler/volume-reconciler/clients/go"
	reconcilerv1 "github.com/volume-reconciler/volume-reconciler/clients/go/volume_reconciler/v1"
)

type scripted struct {
	reconcilerv1.UnimplementedVolumeReconcilerServer
	mu      sync.Mutex
	answers []error // nil: succeed; the last one repeats
	keys    []string
	at      []time.Time
}

func (s *scripted) AttachVolume(_ context.Context, r *reconcilerv1.AttachVolumeRequest) (*reconcilerv1.Operation, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.keys = append(s.keys, r.GetIdempotencyKey())
	s.at = append(s.at, time.Now())
	err := s.answers[0]
	if len(s.answers) > 1 {
		s.answers = s.answers[1:]
	}
	if err != nil {
		return nil, err
	}
	return &reconcilerv1.Operation{Id: "op-1", IdempotencyKey: r.GetIdempotencyKey(), State: reconcilerv1.State_STATE_SUCCEEDED}, nil
}

func serveScripted(t *testing.T, answers ...error) (*vr.Client, *scripted) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	s := &scripted{answers: answers}
	reconcilerv1.RegisterVolumeReconcilerServer(srv, s)
	go func() {
		if err := srv.Serve(l); err != nil {
			t.Errorf("serve: %v", err)
		}
	}()
	t.Cleanup(srv.Stop)
	c, conn, err := vr.Dial(l.Addr().String(), vr.Insecure())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() }) // closing a client connection has nothing to report here
	return c, s
}

func withInfo(code codes.Code, reason string, delay time.Duration) error {
	info := &errdetails.ErrorInfo{Reason: reason, Domain: "volume-reconciler", Metadata: map[string]string{"operation_id": "op-1"}}
	st, err := status.New(code, reason).WithDetails(info)
	if err == nil && delay > 0 {
		st, err = st.WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(delay)})
	}
	if err != nil {
		panic(err)
	}
	return st.Err()
}

func TestAnAbortWithARetryHintIsReplayedAfterTheHintWithTheSameKey(t *testing.T) {
	c, s := serveScripted(t, withInfo(codes.Aborted, "VOLUME_BUSY", 300*time.Millisecond), nil)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	op, err := c.Attach(ctx, vr.AttachRequest{Key: "k-1", ServerID: "s", VolumeID: "v"})
	if err != nil || op.GetState() != reconcilerv1.State_STATE_SUCCEEDED {
		t.Fatalf("%v %v", op, err)
	}
	if len(s.keys) != 2 || s.keys[0] != "k-1" || s.keys[1] != "k-1" {
		t.Fatalf("keys sent: %v", s.keys)
	}
	if gap := s.at[1].Sub(s.at[0]); gap < 300*time.Millisecond {
		t.Fatalf("replayed after %s, before the service's 300 ms", gap)
	}
}

func TestAnAbortWithoutARetryHintIsAnAnswer(t *testing.T) {
	c, s := serveScripted(t, withInfo(codes.Aborted, "NOVA_CONFLICT", 0))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err := c.Attach(ctx, vr.AttachRequest{Key: "k-2", ServerID: "s", VolumeID: "v"})
	var e *vr.Error
	if !errors.As(err, &e) || e.Reason != "NOVA_CONFLICT" || len(s.keys) != 1 {
		t.Fatalf("%v after %d calls", err, len(s.keys))
	}
}

func TestReplaysEndAtTheCallersDeadline(t *testing.T) {
	c, s := serveScripted(t, withInfo(codes.DeadlineExceeded, "OUTCOME_UNKNOWN", 0))
	ctx, cancel := context.WithTimeout(context.Background(), 700*time.Millisecond)
	defer cancel()
	started := time.Now()
	_, err := c.Attach(ctx, vr.AttachRequest{Key: "k-3", ServerID: "s", VolumeID: "v"})
	took := time.Since(started)
	var e *vr.Error
	if !errors.As(err, &e) || e.Reason != "OUTCOME_UNKNOWN" || e.OperationID() != "op-1" {
		t.Fatalf("got %v", err)
	}
	if len(s.keys) < 3 || e.Attempts != len(s.keys) {
		t.Fatalf("%d calls, %d attempts counted: want replays until the deadline", len(s.keys), e.Attempts)
	}
	// Never a pause past the deadline; wide for a loaded machine.
	if took > 3*time.Second {
		t.Fatalf("answered after %s, long past the 700 ms deadline", took)
	}
}
