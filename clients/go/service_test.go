package volumereconciler_test

// The real service for the tests (internal/testservice starts it), and
// this package's helpers around it.

import (
	"context"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	vr "github.com/volume-reconciler/volume-reconciler/clients/go"
	"github.com/volume-reconciler/volume-reconciler/clients/go/internal/testservice"
	reconcilerv1 "github.com/volume-reconciler/volume-reconciler/clients/go/volume_reconciler/v1"
)

type service struct {
	*testservice.Service
	t testing.TB
}

func startService(t testing.TB, extra ...string) *service {
	t.Helper()
	return &service{testservice.Start(t, extra...), t}
}

func (s *service) fault(op, volumeID string, fault map[string]any) { s.Fault(op, volumeID, fault) }
func (s *service) simPost(path string, body any)                   { s.SimPost(path, body) }
func (s *service) simDelete(path string)                           { s.SimDelete(path) }
func (s *service) truth() testservice.Truth                        { return s.Truth() }
func (s *service) restart()                                        { s.Restart() }

func eventually(t testing.TB, within time.Duration, what string, check func() bool) {
	t.Helper()
	testservice.Eventually(t, within, what, check)
}

func newUUID(t testing.TB) string { t.Helper(); return testservice.NewUUID(t) }

// client is a Client of this service; calls counts every RPC sent.
func (s *service) client(opts ...grpc.DialOption) (*vr.Client, *counter) {
	s.t.Helper()
	n := &counter{}
	opts = append([]grpc.DialOption{vr.Insecure(), grpc.WithChainUnaryInterceptor(n.intercept)}, opts...)
	c, err := vr.NewClient(s.Addr, opts...)
	if err != nil {
		s.t.Fatal(err)
	}
	s.t.Cleanup(func() {
		if err := c.Close(); err != nil {
			s.t.Logf("close: %v", err)
		}
	})
	return c, n
}

// counter records every unary call a client sent and how it ended.
type counter struct {
	mu    sync.Mutex
	calls []error
}

func (n *counter) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	err := invoker(ctx, method, req, reply, cc, opts...)
	n.mu.Lock()
	defer n.mu.Unlock()
	n.calls = append(n.calls, err)
	return err
}

// sent is every call's outcome so far, in order.
func (n *counter) sent() []error {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]error(nil), n.calls...)
}

// events is the operation's reconcile log.
func events(t testing.TB, c *vr.Client, id string) []*reconcilerv1.OperationEvent {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, err := c.Stub().ListOperationEvents(ctx, &reconcilerv1.ListOperationEventsRequest{OperationId: id})
	if err != nil {
		t.Fatalf("ListOperationEvents %s: %v", id, err)
	}
	return r.GetEvents()
}

func event(t testing.TB, evs []*reconcilerv1.OperationEvent, kind string) *reconcilerv1.OperationEvent {
	t.Helper()
	for _, e := range evs {
		if e.GetKind() == kind {
			return e
		}
	}
	var kinds []string
	for _, e := range evs {
		kinds = append(kinds, e.GetKind())
	}
	t.Fatalf("no %q event in %v", kind, kinds)
	return nil
}
