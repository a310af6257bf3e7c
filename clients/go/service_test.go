package volumereconciler_test

// The real service for the tests: the project's binary, run as
// `volume-reconciler nova-sim` (Nova, Cinder and Keystone over HTTP, with
// its fault API under /sim) and `volume-reconciler serve` on an embedded
// SQLite ledger, both on 127.0.0.1 ports chosen free, started and stopped
// by the tests themselves.

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"

	vr "github.com/volume-reconciler/volume-reconciler/clients/go"
	reconcilerv1 "github.com/volume-reconciler/volume-reconciler/clients/go/volume_reconciler/v1"
)

// binary is the service's binary: VOLUME_RECONCILER_BIN, else the debug
// build of this checkout (`cargo build --bin volume-reconciler`).
func binary(t testing.TB) string {
	t.Helper()
	bin := os.Getenv("VOLUME_RECONCILER_BIN")
	if bin == "" {
		bin = filepath.Join("..", "..", "target", "debug", "volume-reconciler")
	}
	abs, err := filepath.Abs(bin)
	if err != nil {
		t.Fatalf("binary %s: %v", bin, err)
	}
	if _, err := os.Stat(abs); err != nil {
		t.Fatalf("the service's binary is missing (%v): build it with `cargo build --bin volume-reconciler` at the repository's root, or point VOLUME_RECONCILER_BIN at one", err)
	}
	return abs
}

// freeAddr is a 127.0.0.1 port nothing listens on now.
func freeAddr(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return addr
}

// eventually polls check every 50 ms until it holds, failing after within
// (wide: the machine is shared with compiles).
func eventually(t testing.TB, within time.Duration, what string, check func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !check() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %s: %s", within, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

type service struct {
	t         testing.TB
	bin, dir  string
	simURL    string // http://127.0.0.1:P (the admin API under /sim)
	Addr      string // the gRPC address, host:port
	admin     string // the admin listener, host:port
	serveArgs []string
	serve     *exec.Cmd
	serveDone chan error
	starts    int
}

// startService starts nova-sim and serve (with extra serve flags) and
// stops both when the test ends.
func startService(t testing.TB, extra ...string) *service {
	t.Helper()
	s := &service{t: t, bin: binary(t), dir: t.TempDir()}
	simAddr := freeAddr(t)
	s.simURL = "http://" + simAddr
	sim := s.command("nova-sim.log", "nova-sim", "--listen", simAddr, "--record-history")
	if err := sim.Start(); err != nil {
		t.Fatalf("nova-sim: %v", err)
	}
	t.Cleanup(func() { stop(t, sim, "nova-sim") })
	eventually(t, 60*time.Second, "nova-sim answers at "+s.simURL, func() bool {
		return httpOK(s.simURL + "/sim/truth")
	})
	s.Addr, s.admin = freeAddr(t), freeAddr(t)
	s.serveArgs = append([]string{
		"serve",
		"--listen", s.Addr,
		"--admin-listen", s.admin,
		"--database-url", "sqlite://" + filepath.Join(s.dir, "ledger.db"),
		"--nova-url", s.simURL + "/v2.1",
		"--cinder-url", s.simURL + "/v3/" + simProject,
		// A drain at once (no load balancer to tell first).
		"--shutdown-delay", "0s",
	}, extra...)
	s.startServe()
	t.Cleanup(func() {
		if s.serve != nil {
			s.signal(syscall.SIGTERM)
		}
		s.dumpLogsOnFailure()
	})
	return s
}

// simProject is the project id the simulator's Cinder serves under.
const simProject = "a6944d763bf64ee6a275f1263fae0352"

func (s *service) command(logName string, args ...string) *exec.Cmd {
	cmd := exec.Command(s.bin, args...)
	// The service's own settings come from flags only.
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "VOLUME_RECONCILER_") || strings.HasPrefix(k, "OS_") ||
			strings.HasPrefix(k, "NOVA_SIM_") || k == "DATABASE_URL" {
			continue
		}
		cmd.Env = append(cmd.Env, kv)
	}
	cmd.Env = append(cmd.Env, "VOLUME_RECONCILER_LOG=info")
	log, err := os.OpenFile(filepath.Join(s.dir, logName), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		s.t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = log, log
	return cmd
}

func (s *service) startServe() {
	s.t.Helper()
	s.starts++
	s.serve = s.command("serve.log", s.serveArgs...)
	if err := s.serve.Start(); err != nil {
		s.t.Fatalf("serve: %v", err)
	}
	done := make(chan error, 1)
	go func(cmd *exec.Cmd) { done <- cmd.Wait() }(s.serve)
	s.serveDone = done
	eventually(s.t, 60*time.Second, "serve is ready at "+s.admin, func() bool {
		return httpOK("http://" + s.admin + "/readyz")
	})
}

// signal sends sig to serve and waits for it to exit.
func (s *service) signal(sig os.Signal) {
	s.t.Helper()
	if err := s.serve.Process.Signal(sig); err != nil {
		s.t.Fatalf("signal serve: %v", err)
	}
	select {
	case err := <-s.serveDone:
		if err != nil && sig == syscall.SIGTERM {
			s.t.Errorf("serve exited with %v after SIGTERM", err)
		}
	case <-time.After(90 * time.Second):
		s.t.Fatalf("serve did not exit within 90 s of %v", sig)
	}
	s.serve = nil
}

// restart drains serve (SIGTERM), waits for it to exit and starts it again
// on the same ledger and ports.
func (s *service) restart() {
	s.t.Helper()
	s.signal(syscall.SIGTERM)
	s.startServe()
}

func stop(t testing.TB, cmd *exec.Cmd, what string) {
	if cmd.Process == nil {
		return
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Logf("%s: %v", what, err)
	}
	// Its exit status after a SIGTERM says nothing the test needs.
	_ = cmd.Wait()
}

func (s *service) dumpLogsOnFailure() {
	if !s.t.Failed() {
		return
	}
	for _, name := range []string{"serve.log", "nova-sim.log"} {
		b, err := os.ReadFile(filepath.Join(s.dir, name))
		if err != nil {
			continue
		}
		if len(b) > 20000 {
			b = b[len(b)-20000:]
		}
		s.t.Logf("---- %s (end) ----\n%s", name, b)
	}
}

func httpOK(url string) bool {
	resp, err := http.Get(url)
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body) // drained so the connection is reused
	return resp.StatusCode == http.StatusOK
}

// simPost sends body as JSON to the simulator's admin API.
func (s *service) simPost(path string, body any) {
	s.t.Helper()
	b, err := json.Marshal(body)
	if err != nil {
		s.t.Fatal(err)
	}
	resp, err := http.Post(s.simURL+path, "application/json", bytes.NewReader(b))
	if err != nil {
		s.t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		msg, _ := io.ReadAll(resp.Body) // for the failure message only
		s.t.Fatalf("POST %s: %s %s", path, resp.Status, msg)
	}
}

// fault adds a rule to the simulator's fault API (src/sim/faults.rs):
// op is attach, detach, list, ...; fault is {"kind": ..., ...}.
func (s *service) fault(op, volumeID string, fault map[string]any) {
	s.t.Helper()
	s.simPost("/sim/faults", map[string]any{"op": op, "volume_id": volumeID, "count": 1, "fault": fault})
}

// truth is the part of the simulator's record the tests read.
type truth struct {
	AttachEffects  map[string]int `json:"attach_effects"`
	AttachRequests map[string]int `json:"attach_requests"`
	DetachEffects  map[string]int `json:"detach_effects"`
	Attachments    []struct {
		ServerID string `json:"server_id"`
		VolumeID string `json:"volume_id"`
	} `json:"attachments"`
}

func (s *service) truth() truth {
	s.t.Helper()
	resp, err := http.Get(s.simURL + "/sim/truth")
	if err != nil {
		s.t.Fatalf("GET /sim/truth: %v", err)
	}
	defer resp.Body.Close()
	var tr truth
	if err := json.NewDecoder(resp.Body).Decode(&tr); err != nil {
		s.t.Fatalf("/sim/truth: %v", err)
	}
	return tr
}

// client is a Client of this service; calls counts every RPC sent.
func (s *service) client(opts ...grpc.DialOption) (*vr.Client, *counter) {
	s.t.Helper()
	n := &counter{}
	opts = append([]grpc.DialOption{vr.Insecure(), grpc.WithChainUnaryInterceptor(n.intercept)}, opts...)
	c, conn, err := vr.Dial(s.Addr, opts...)
	if err != nil {
		s.t.Fatal(err)
	}
	s.t.Cleanup(func() {
		if err := conn.Close(); err != nil {
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

func newUUID(t testing.TB) string {
	t.Helper()
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}
