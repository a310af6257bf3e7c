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
	// When set, answers every attach instead of answers.
	answerWith func(context.Context) error
	keys       []string
	at         []time.Time
	ensured    []string // server/volume of every EnsureAttached
}

func (s *scripted) AttachVolume(ctx context.Context, r *reconcilerv1.AttachVolumeRequest) (*reconcilerv1.Operation, error) {
	s.mu.Lock()
	s.keys = append(s.keys, r.GetIdempotencyKey())
	s.at = append(s.at, time.Now())
	answer := s.answerWith
	s.mu.Unlock()
	if answer != nil {
		return nil, answer(ctx)
	}
	if err := s.next(); err != nil {
		return nil, err
	}
	return &reconcilerv1.Operation{Id: "op-1", IdempotencyKey: r.GetIdempotencyKey(), State: reconcilerv1.State_STATE_SUCCEEDED}, nil
}

func (s *scripted) EnsureAttached(_ context.Context, r *reconcilerv1.EnsureAttachedRequest) (*reconcilerv1.Operation, error) {
	s.mu.Lock()
	s.ensured = append(s.ensured, r.GetServerId()+"/"+r.GetVolumeId())
	s.mu.Unlock()
	if err := s.next(); err != nil {
		return nil, err
	}
	return &reconcilerv1.Operation{Id: "op-1", Ensure: true, State: reconcilerv1.State_STATE_SUCCEEDED}, nil
}

// next is the scripted answer of the next call.
func (s *scripted) next() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	err := s.answers[0]
	if len(s.answers) > 1 {
		s.answers = s.answers[1:]
	}
	return err
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
	c, err := vr.NewClient(l.Addr().String(), vr.Insecure())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() }) // closing a client connection has nothing to report here
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

// slowUnknown answers OUTCOME_UNKNOWN naming op-1 as the service does: a
// margin before the caller's deadline (here 150 ms, under replayFloor).
func slowUnknown(margin time.Duration) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		if d, ok := ctx.Deadline(); ok {
			time.Sleep(time.Until(d) - margin)
		}
		return withInfo(codes.DeadlineExceeded, "OUTCOME_UNKNOWN", 0)
	}
}

// The service answers OUTCOME_UNKNOWN 150 ms before the caller's deadline:
// too little for a replay to be answered, so none is sent and the caller
// gets that answer, operation id included (then Wait follows it).
func TestNoReplayIsSentIntoLessTimeThanItNeedsTheUnknownOutcomeIsReturned(t *testing.T) {
	c, s := serveScripted(t)
	s.answerWith = slowUnknown(150 * time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	_, err := c.Attach(ctx, vr.AttachRequest{Key: "k-floor", ServerID: "s", VolumeID: "v"})
	var e *vr.Error
	if !errors.As(err, &e) || e.Reason != vr.ReasonOutcomeUnknown || e.OperationID() != "op-1" {
		t.Fatalf("got %v, want OUTCOME_UNKNOWN naming op-1", err)
	}
	if len(s.keys) != 1 || e.Attempts != 1 {
		t.Fatalf("%d calls (attempts %d): a replay was sent into 150 ms", len(s.keys), e.Attempts)
	}
}

// A replay whose answer is the transport's bare DEADLINE_EXCEEDED (no
// ErrorInfo, no operation id) does not replace the OUTCOME_UNKNOWN that
// named the operation: that one is returned, the bare one kept in Last.
func TestAReplayThatLostTheOperationIDNeverReplacesTheAnswerThatNamedIt(t *testing.T) {
	c, s := serveScripted(t,
		withInfo(codes.DeadlineExceeded, "OUTCOME_UNKNOWN", 0),
		status.Error(codes.DeadlineExceeded, "context deadline exceeded"))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err := c.Attach(ctx, vr.AttachRequest{Key: "k-lost-id", ServerID: "s", VolumeID: "v"})
	var e *vr.Error
	if !errors.As(err, &e) || e.Reason != vr.ReasonOutcomeUnknown || e.OperationID() != "op-1" {
		t.Fatalf("got %v, want the OUTCOME_UNKNOWN naming op-1", err)
	}
	if e.Attempts != 2 || len(s.keys) != 2 || e.Last == nil || e.Last.Code != codes.DeadlineExceeded || e.Last.Reason != "" {
		t.Fatalf("attempts %d after %d calls, last %v: want 2 and the bare DEADLINE_EXCEEDED", e.Attempts, len(s.keys), e.Last)
	}
}

// EnsureAttached replays as Attach does (the same identity joins the same
// operation) and sends no key.
func TestEnsureAttachedIsReplayedAfterAnUnknownOutcomeWithTheSameRequest(t *testing.T) {
	c, s := serveScripted(t, withInfo(codes.DeadlineExceeded, "OUTCOME_UNKNOWN", 0), nil)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	op, err := c.EnsureAttached(ctx, vr.EnsureRequest{ServerID: "s", VolumeID: "v"})
	if err != nil || op.GetState() != reconcilerv1.State_STATE_SUCCEEDED {
		t.Fatalf("%v %v", op, err)
	}
	if len(s.ensured) != 2 || s.ensured[0] != "s/v" || s.ensured[1] != "s/v" {
		t.Fatalf("ensure calls: %v", s.ensured)
	}
}

// A transport failure (INTERNAL without an ErrorInfo: a stream reset) is
// replayed whatever its message says; the service's own INTERNAL (with an
// ErrorInfo) is an answer.
func TestRetryDecisionsComeFromCodesAndReasonsNotMessages(t *testing.T) {
	c, s := serveScripted(t, status.Error(codes.Internal, "something unusual"), nil)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := c.Attach(ctx, vr.AttachRequest{Key: "k-int", ServerID: "s", VolumeID: "v"}); err != nil || len(s.keys) != 2 {
		t.Fatalf("%v after %d calls, want a replay and the operation", err, len(s.keys))
	}
	c2, s2 := serveScripted(t, withInfo(codes.Internal, "LEDGER_ROW_UNREADABLE", 0))
	_, err := c2.Attach(ctx, vr.AttachRequest{Key: "k-int2", ServerID: "s", VolumeID: "v"})
	if status.Code(err) != codes.Internal || len(s2.keys) != 1 {
		t.Fatalf("%v after %d calls, want the service's INTERNAL at once", err, len(s2.keys))
	}
}

func TestAnAttachWithoutAKeyIsErrMissingKeyAndSendsNothing(t *testing.T) {
	c, s := serveScripted(t, nil)
	_, err := c.Attach(context.Background(), vr.AttachRequest{ServerID: "s", VolumeID: "v"})
	_, err2 := c.Detach(context.Background(), vr.DetachRequest{ServerID: "s", VolumeID: "v"})
	if !errors.Is(err, vr.ErrMissingKey) || !errors.Is(err2, vr.ErrMissingKey) || len(s.keys) != 0 {
		t.Fatalf("%v, %v after %d calls", err, err2, len(s.keys))
	}
}

// Close ends the connection NewClient made: a call after it fails at once
// (CANCELED, grpc-go's answer on a closed connection), nothing is sent.
func TestCloseClosesTheClientsConnection(t *testing.T) {
	c, s := serveScripted(t, nil)
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	started := time.Now()
	_, err := c.Attach(ctx, vr.AttachRequest{Key: "k-closed", ServerID: "s", VolumeID: "v"})
	if status.Code(err) != codes.Canceled || len(s.keys) != 0 {
		t.Fatalf("after Close: %v, %d calls", err, len(s.keys))
	}
	// Not replayed until the deadline: a closed client stays closed.
	if took := time.Since(started); took > 10*time.Second {
		t.Fatalf("answered after %s", took)
	}
}
