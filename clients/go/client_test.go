package volumereconciler_test

// The Go client against the real service (service_test.go starts it):
// each test asserts the reply, the ledger (through the service's own
// reads) and what Nova really saw (the simulator's truth).

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	vr "github.com/volume-reconciler/volume-reconciler/clients/go"
	reconcilerv1 "github.com/volume-reconciler/volume-reconciler/clients/go/volume_reconciler/v1"
)

func wantDecided(t *testing.T, op *reconcilerv1.Operation, err error, res reconcilerv1.Resolution) {
	t.Helper()
	if err != nil {
		t.Fatalf("the attach failed: %v", err)
	}
	if op.GetState() != reconcilerv1.State_STATE_SUCCEEDED || op.GetResolution() != res {
		t.Fatalf("operation %s: %s %s, want STATE_SUCCEEDED %s", op.GetId(), op.GetState(), op.GetResolution(), res)
	}
}

func metaInt(t *testing.T, ev *reconcilerv1.OperationEvent, key string) int64 {
	t.Helper()
	n, err := strconv.ParseInt(ev.GetMetadata()[key], 10, 64)
	if err != nil {
		t.Fatalf("event %s: %s=%q: %v", ev.GetKind(), key, ev.GetMetadata()[key], err)
	}
	return n
}

// The first incident, from Go: a caller whose context allows an hour and a
// Nova that answers after 35 s (past the 30 s header timeout that cut the
// first incident's attach). The client adds no bound of its own, so the
// service plans with the caller's hour and Nova's own answer decides.
func TestAnAttachWithAnHourDeadlineOutlastsANovaThatAnswersAfter35Seconds(t *testing.T) {
	t.Parallel()
	s := startService(t)
	c, calls := s.client()
	server, volume := newUUID(t), newUUID(t)
	s.fault("attach", volume, map[string]any{"kind": "delay_after_effect", "ms": 35000})

	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	started := time.Now()
	op, err := c.Attach(ctx, vr.AttachRequest{Key: vr.KeyFor("incident", server, volume), ServerID: server, VolumeID: volume})
	took := time.Since(started)
	wantDecided(t, op, err, reconcilerv1.Resolution_RESOLUTION_RESPONSE)
	if took < 35*time.Second {
		t.Fatalf("answered after %s, before Nova did (35 s)", took)
	}
	if len(calls.sent()) != 1 {
		t.Fatalf("%d calls, want 1: %v", len(calls.sent()), calls.sent())
	}
	// The ledger: the service saw the caller's hour, not a constant.
	evs := events(t, c, op.GetId())
	recorded := event(t, evs, "recorded")
	if got := metaInt(t, recorded, "caller_deadline_ms"); got < 3_500_000 || got > 3_600_000 {
		t.Fatalf("the service saw a deadline of %d ms, want the caller's hour", got)
	}
	if recorded.GetMetadata()["deadline_from_caller"] != "true" {
		t.Fatalf("deadline_from_caller=%q: the service used its default", recorded.GetMetadata()["deadline_from_caller"])
	}
	if got := metaInt(t, event(t, evs, "request_sent"), "outbound_deadline_ms"); got < 30*60*1000 {
		t.Fatalf("Nova's request had %d ms, want most of the hour", got)
	}
	// What Nova saw: one attach, one effect.
	tr := s.truth()
	if tr.AttachRequests[volume] != 1 || tr.AttachEffects[volume] != 1 {
		t.Fatalf("Nova saw %d requests, %d effects; want 1, 1", tr.AttachRequests[volume], tr.AttachEffects[volume])
	}
}

// Nova attaches and the connection closes before its answer: the service
// lists the server's attachments and records what it saw.
func TestALostResponseIsReobservedAndTakesEffectOnce(t *testing.T) {
	t.Parallel()
	s := startService(t)
	c, calls := s.client()
	server, volume := newUUID(t), newUUID(t)
	s.fault("attach", volume, map[string]any{"kind": "close_after_effect"})

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	op, err := c.Attach(ctx, vr.AttachRequest{Key: vr.KeyFor("lost", server, volume), ServerID: server, VolumeID: volume})
	wantDecided(t, op, err, reconcilerv1.Resolution_RESOLUTION_REOBSERVED)
	if len(calls.sent()) != 1 {
		t.Fatalf("%d calls, want 1", len(calls.sent()))
	}
	event(t, events(t, c, op.GetId()), "observed")
	tr := s.truth()
	if tr.AttachRequests[volume] != 1 || tr.AttachEffects[volume] != 1 {
		t.Fatalf("Nova saw %d requests, %d effects; want 1, 1", tr.AttachRequests[volume], tr.AttachEffects[volume])
	}
}

// keys records the idempotency key of every attach a client sent.
type keys struct{ sent []string }

func (k *keys) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if r, ok := req.(*reconcilerv1.AttachVolumeRequest); ok {
		k.sent = append(k.sent, r.GetIdempotencyKey())
	}
	return invoker(ctx, method, req, reply, cc, opts...)
}

func sameKey(t *testing.T, k *keys, want string) {
	t.Helper()
	if len(k.sent) < 2 {
		t.Fatalf("%d attach calls, want a replay", len(k.sent))
	}
	for i, got := range k.sent {
		if got != want {
			t.Fatalf("call %d sent key %q, want the same key %q every time", i+1, got, want)
		}
	}
}

// Nova answers 503 after attaching and the service's look at the server
// hangs past the call's time: the service answers OUTCOME_UNKNOWN while the
// caller still has time (its safety margin), the reconciler then sees the
// attachment, and the client's replay of the same key returns that decision.
func TestAnUnknownOutcomeIsReplayedWithTheSameKeyUntilTheReconcilerDecides(t *testing.T) {
	t.Parallel()
	s := startService(t, "--reconcile-interval", "200ms")
	k := &keys{}
	c, calls := s.client(grpc.WithChainUnaryInterceptor(k.intercept))
	server, volume := newUUID(t), newUUID(t)
	s.fault("attach", volume, map[string]any{"kind": "status", "code": 503, "effect": true})
	// The service's one look at the server (by server: the list has no
	// volume) hangs until the call's time is over.
	s.simPost("/sim/faults", map[string]any{"op": "list", "server_id": server, "count": 1,
		"fault": map[string]any{"kind": "delay_before_effect", "ms": 120000}})

	// 40 s: the service keeps 2 s of it (its safety margin's maximum) to
	// answer, which is the time the replays have to meet the decision.
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	key := vr.KeyFor("unknown", server, volume)
	op, err := c.Attach(ctx, vr.AttachRequest{Key: key, ServerID: server, VolumeID: volume})
	wantDecided(t, op, err, reconcilerv1.Resolution_RESOLUTION_RECONCILER)
	first := status.Convert(calls.sent()[0])
	if first.Code() != codes.DeadlineExceeded || reasonOf(first) != "OUTCOME_UNKNOWN" {
		t.Fatalf("the first answer was %s %s, want DEADLINE_EXCEEDED OUTCOME_UNKNOWN", first.Code(), reasonOf(first))
	}
	sameKey(t, k, key)
	tr := s.truth()
	if tr.AttachRequests[volume] != 1 || tr.AttachEffects[volume] != 1 {
		t.Fatalf("Nova saw %d requests, %d effects; want 1, 1", tr.AttachRequests[volume], tr.AttachEffects[volume])
	}
}

func reasonOf(st *status.Status) string {
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return info.GetReason()
		}
	}
	return ""
}

// The service is drained (SIGTERM) while Nova still holds the attach, and
// started again on the same ledger: the client replays the same key over
// the refused connections until the new process answers the decision. No
// error reaches the caller, and Nova saw one attach.
func TestADrainMidCallReachesTheCallerAsTheDecisionNotAnError(t *testing.T) {
	t.Parallel()
	// A drain shorter than Nova's answer, so the call is cut.
	s := startService(t, "--drain-timeout", "1s", "--reconcile-interval", "200ms")
	k := &keys{}
	c, _ := s.client(grpc.WithChainUnaryInterceptor(k.intercept))
	server, volume := newUUID(t), newUUID(t)
	s.fault("attach", volume, map[string]any{"kind": "delay_after_effect", "ms": 8000})

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	key := vr.KeyFor("drain", server, volume)
	type answer struct {
		op  *reconcilerv1.Operation
		err error
	}
	done := make(chan answer, 1)
	go func() {
		op, err := c.Attach(ctx, vr.AttachRequest{Key: key, ServerID: server, VolumeID: volume})
		done <- answer{op, err}
	}()
	eventually(t, 60*time.Second, "Nova received the attach", func() bool {
		return s.truth().AttachRequests[volume] >= 1
	})
	s.restart()
	got := <-done
	if got.err != nil {
		t.Fatalf("an error reached the caller: %v", got.err)
	}
	if got.op.GetState() != reconcilerv1.State_STATE_SUCCEEDED {
		t.Fatalf("operation %s is %s", got.op.GetId(), got.op.GetState())
	}
	sameKey(t, k, key)
	tr := s.truth()
	if tr.AttachRequests[volume] != 1 || tr.AttachEffects[volume] != 1 {
		t.Fatalf("Nova saw %d requests, %d effects; want 1, 1", tr.AttachRequests[volume], tr.AttachEffects[volume])
	}
}

// A volume attached to another server: the typed error keeps every key of
// every ErrorInfo the service sent, and names them in Error().
func TestARefusalIsATypedErrorWithEveryKeyTheServiceSent(t *testing.T) {
	t.Parallel()
	s := startService(t)
	c, calls := s.client()
	server, other, volume := newUUID(t), newUUID(t), newUUID(t)
	s.simPost("/sim/attachments", []map[string]string{{"server_id": other, "volume_id": volume}})

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	_, err := c.Attach(ctx, vr.AttachRequest{Key: vr.KeyFor("elsewhere", server, volume), ServerID: server, VolumeID: volume})
	var e *vr.Error
	if !errors.As(err, &e) {
		t.Fatalf("not a *volumereconciler.Error: %T %v", err, err)
	}
	if e.Code != codes.FailedPrecondition || e.Reason != "ALREADY_ATTACHED_ELSEWHERE" || status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("got %v", e)
	}
	if len(calls.sent()) != 1 {
		t.Fatalf("a refusal was sent %d times", len(calls.sent()))
	}
	// Every key of every ErrorInfo on the wire, with its value.
	sent := 0
	for _, d := range status.Convert(calls.sent()[0]).Details() {
		info, ok := d.(*errdetails.ErrorInfo)
		if !ok {
			continue
		}
		for k, v := range info.GetMetadata() {
			sent++
			if e.Metadata[k] != v {
				t.Errorf("metadata %s: the error has %q, the service sent %q", k, e.Metadata[k], v)
			}
			if !strings.Contains(e.Error(), k+"="+v) {
				t.Errorf("Error() does not name %s=%s: %s", k, v, e.Error())
			}
		}
	}
	if sent < 4 || e.Metadata["attached_to"] != other || e.OperationID() == "" {
		t.Fatalf("the service sent %d keys; the error: %v", sent, e)
	}
	tr := s.truth()
	if tr.AttachEffects[volume] != 0 {
		t.Fatalf("Nova attached it %d times", tr.AttachEffects[volume])
	}
}

// A token the service does not know: UNAUTHENTICATED at once, never sent
// again, nothing recorded.
func TestAWrongTokenIsUnauthenticatedAndNotRetried(t *testing.T) {
	t.Parallel()
	sum := sha256.Sum256([]byte("right-token"))
	s := startService(t, "--auth-tokens", "ci:orchestrator:"+hex.EncodeToString(sum[:]))
	wrong, calls := s.client(vr.WithBearerToken("wrong-token"))
	server, volume := newUUID(t), newUUID(t)
	key := vr.KeyFor("token", server, volume)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	_, err := wrong.Attach(ctx, vr.AttachRequest{Key: key, ServerID: server, VolumeID: volume})
	var e *vr.Error
	if !errors.As(err, &e) || e.Code != codes.Unauthenticated {
		t.Fatalf("got %T %v, want UNAUTHENTICATED", err, err)
	}
	if len(calls.sent()) != 1 || e.Attempts != 1 {
		t.Fatalf("sent %d times (attempts %d), want once", len(calls.sent()), e.Attempts)
	}
	// Nothing recorded under the key, and Nova never asked.
	right, _ := s.client(vr.WithBearerToken("right-token"))
	_, err = right.Stub().GetOperation(ctx, &reconcilerv1.GetOperationRequest{IdempotencyKey: key})
	if status.Code(err) != codes.NotFound {
		t.Fatalf("the key's operation: %v, want NOT_FOUND", err)
	}
	if n := s.truth().AttachRequests[volume]; n != 0 {
		t.Fatalf("Nova saw %d attaches", n)
	}
}
