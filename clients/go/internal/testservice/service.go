// Package testservice runs the real service for the Go module's tests: the
// project's binary, as `volume-reconciler nova-sim` (Nova, Cinder and
// Keystone over HTTP, with its fault API under /sim) and
// `volume-reconciler serve` on an embedded SQLite ledger, both on
// 127.0.0.1 ports chosen free, started and stopped by the tests
// themselves.
package testservice

import (
	"bytes"
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
	"syscall"
	"testing"
	"time"
)

// binary is the service's binary: VOLUME_RECONCILER_BIN, else the debug
// build of this checkout (`cargo build --bin volume-reconciler`), found
// from the test's directory up to the repository's root.
func binary(t testing.TB) string {
	t.Helper()
	bin := os.Getenv("VOLUME_RECONCILER_BIN")
	if bin == "" {
		bin = filepath.Join(RepoRoot(t), "target", "debug", "volume-reconciler")
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

// Eventually polls check every 50 ms until it holds, failing after within
// (wide: the machine is shared with compiles).
func Eventually(t testing.TB, within time.Duration, what string, check func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !check() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %s: %s", within, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

type Service struct {
	t         testing.TB
	bin, dir  string
	SimURL    string // http://127.0.0.1:P (the admin API under /sim)
	Addr      string // the gRPC address, host:port
	admin     string // the admin listener, host:port
	serveArgs []string
	serve     *exec.Cmd
	serveDone chan error
	starts    int
}

// Start starts nova-sim and serve (with extra serve flags) and
// stops both when the test ends. A port chosen free can be taken by
// another process before the binary binds it (every free-port helper has
// that race, and the tests run eight at once): a process that exits before
// it answers because its address is in use is started again on fresh
// ports, up to three times; any other early exit fails the test at once
// with its log.
func Start(t testing.TB, extra ...string) *Service {
	t.Helper()
	s := &Service{t: t, bin: binary(t), dir: t.TempDir()}
	// Registered first so it runs last, after both processes stopped, and
	// also when the start itself fails.
	t.Cleanup(s.dumpLogsOnFailure)
	s.onFreePorts("nova-sim", "nova-sim.log", func() error {
		simAddr := freeAddr(t)
		s.SimURL = "http://" + simAddr
		sim := s.command("nova-sim.log", "nova-sim", "--listen", simAddr, "--record-history")
		if err := sim.Start(); err != nil {
			t.Fatalf("nova-sim: %v", err)
		}
		simDone := waitFor(sim)
		exit := s.waitReady("nova-sim answers at "+s.SimURL, simDone, func() bool {
			return httpOK(s.SimURL + "/sim/truth")
		})
		if exit == nil {
			t.Cleanup(func() { stop(t, sim, simDone, "nova-sim") })
		}
		return exit
	})
	s.onFreePorts("serve", "serve.log", func() error {
		s.Addr, s.admin = freeAddr(t), freeAddr(t)
		s.serveArgs = append([]string{
			"serve",
			"--listen", s.Addr,
			"--admin-listen", s.admin,
			"--database-url", "sqlite://" + filepath.Join(s.dir, "ledger.db"),
			"--nova-url", s.SimURL + "/v2.1",
			"--cinder-url", s.SimURL + "/v3/" + SimProject,
			// A drain at once (no load balancer to tell first).
			"--shutdown-delay", "0s",
		}, extra...)
		return s.tryServe()
	})
	t.Cleanup(func() {
		if s.serve != nil {
			s.Signal(syscall.SIGTERM)
		}
	})
	return s
}

// onFreePorts runs start (which picks its ports, starts a process and
// waits until it answers: nil, or the process's exit) until it answers,
// up to three times while the process's log says its address was in use.
func (s *Service) onFreePorts(what, logName string, start func() error) {
	s.t.Helper()
	for attempt := 1; ; attempt++ {
		from := s.logSize(logName)
		exit := start()
		if exit == nil {
			return
		}
		s.startFailed(what, logName, from, attempt < 3, exit)
	}
}

// startFailed decides about a process that exited before it answered:
// when retry and its log (from offset from) says its address was in use,
// it returns for another try on fresh ports; else the test fails with the
// log.
func (s *Service) startFailed(what, logName string, from int64, retry bool, exit error) {
	s.t.Helper()
	log := s.logFrom(logName, from)
	if retry && strings.Contains(log, "Address already in use") {
		s.t.Logf("%s: a port chosen free was taken before it bound it; starting it again on fresh ports", what)
		return
	}
	s.t.Fatalf("%s exited before it answered (%v); its log:\n%s", what, exit, log)
}

// SimProject is the project id the simulator's Cinder serves under.
const SimProject = "a6944d763bf64ee6a275f1263fae0352"

func (s *Service) command(logName string, args ...string) *exec.Cmd {
	cmd := exec.Command(s.bin, args...)
	dieWithTheTest(cmd)
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

// startServe starts serve with s.serveArgs (its ports kept: a restart's
// clients reconnect to them) and waits until it is ready; an exit before
// that fails the test with serve's log.
func (s *Service) startServe() {
	s.t.Helper()
	from := s.logSize("serve.log")
	if exit := s.tryServe(); exit != nil {
		s.startFailed("serve", "serve.log", from, false, exit)
	}
}

// tryServe starts serve with s.serveArgs and waits until it is ready (nil)
// or has exited (its exit, and s.serve is nil again).
func (s *Service) tryServe() error {
	s.t.Helper()
	s.starts++
	s.serve = s.command("serve.log", s.serveArgs...)
	if err := s.serve.Start(); err != nil {
		s.t.Fatalf("serve: %v", err)
	}
	s.serveDone = waitFor(s.serve)
	exit := s.waitReady("serve is ready at "+s.admin, s.serveDone, func() bool {
		return httpOK("http://" + s.admin + "/readyz")
	})
	if exit != nil {
		s.serve = nil
	}
	return exit
}

// waitFor is a channel that gets cmd's exit (exactly once).
func waitFor(cmd *exec.Cmd) chan error {
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	return done
}

// waitReady waits (as eventually: 60 s, then the test fails) until ready
// holds (nil) or the process whose exit done reports has exited (that
// exit, never nil).
func (s *Service) waitReady(what string, done <-chan error, ready func() bool) error {
	s.t.Helper()
	var exit error
	Eventually(s.t, 60*time.Second, what, func() bool {
		select {
		case err := <-done:
			exit = err
			if exit == nil {
				exit = fmt.Errorf("exit status 0")
			}
			return true
		default:
			return ready()
		}
	})
	return exit
}

// logSize is the length of the log name now (0 before it exists).
func (s *Service) logSize(name string) int64 {
	fi, err := os.Stat(filepath.Join(s.dir, name))
	if err != nil {
		return 0
	}
	return fi.Size()
}

// logFrom is the log name from offset from on (its last 20000 bytes).
func (s *Service) logFrom(name string, from int64) string {
	b, err := os.ReadFile(filepath.Join(s.dir, name))
	if err != nil {
		return fmt.Sprintf("(no %s: %v)", name, err)
	}
	if from > int64(len(b)) {
		from = 0
	}
	b = b[from:]
	if len(b) > 20000 {
		b = b[len(b)-20000:]
	}
	return string(b)
}

// Signal sends sig to serve and waits for it to exit.
func (s *Service) Signal(sig os.Signal) {
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

// Restart drains serve (SIGTERM), waits for it to exit and starts it again
// on the same ledger and ports.
func (s *Service) Restart() {
	s.t.Helper()
	s.Signal(syscall.SIGTERM)
	s.startServe()
}

func stop(t testing.TB, cmd *exec.Cmd, done <-chan error, what string) {
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Logf("%s: %v", what, err)
	}
	// Its exit status after a SIGTERM says nothing the test needs.
	<-done
}

func (s *Service) dumpLogsOnFailure() {
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

// probe is the client of the readiness polls: a port whose listener never
// answers (another process's, taken in the free-port race) is a failed poll
// after 5 s, not a poll that hangs the test.
var probe = &http.Client{Timeout: 5 * time.Second}

func httpOK(url string) bool {
	resp, err := probe.Get(url)
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body) // drained so the connection is reused
	return resp.StatusCode == http.StatusOK
}

// SimPost sends body as JSON to the simulator's admin API.
func (s *Service) SimPost(path string, body any) {
	s.t.Helper()
	b, err := json.Marshal(body)
	if err != nil {
		s.t.Fatal(err)
	}
	resp, err := http.Post(s.SimURL+path, "application/json", bytes.NewReader(b))
	if err != nil {
		s.t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		msg, _ := io.ReadAll(resp.Body) // for the failure message only
		s.t.Fatalf("POST %s: %s %s", path, resp.Status, msg)
	}
}

// Fault adds a rule to the simulator's fault API (src/sim/faults.rs):
// op is attach, detach, list, ...; fault is {"kind": ..., ...}.
func (s *Service) Fault(op, volumeID string, fault map[string]any) {
	s.t.Helper()
	s.SimPost("/sim/faults", map[string]any{"op": op, "volume_id": volumeID, "count": 1, "fault": fault})
}

// Truth is the part of the simulator's record the tests read.
type Truth struct {
	AttachEffects  map[string]int `json:"attach_effects"`
	AttachRequests map[string]int `json:"attach_requests"`
	DetachEffects  map[string]int `json:"detach_effects"`
	Attachments    []struct {
		ServerID string `json:"server_id"`
		VolumeID string `json:"volume_id"`
	} `json:"attachments"`
}

func (s *Service) Truth() Truth {
	s.t.Helper()
	resp, err := http.Get(s.SimURL + "/sim/truth")
	if err != nil {
		s.t.Fatalf("GET /sim/truth: %v", err)
	}
	defer resp.Body.Close()
	var tr Truth
	if err := json.NewDecoder(resp.Body).Decode(&tr); err != nil {
		s.t.Fatalf("/sim/truth: %v", err)
	}
	return tr
}

// RepoRoot is the repository's root: the nearest directory above the
// test's own that holds Cargo.toml.
func RepoRoot(t testing.TB) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "Cargo.toml")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("no Cargo.toml above the test's directory: not in the repository")
		}
		dir = parent
	}
}

// SimDelete sends DELETE path to the simulator's admin API.
func (s *Service) SimDelete(path string) {
	s.t.Helper()
	req, err := http.NewRequest(http.MethodDelete, s.SimURL+path, nil)
	if err != nil {
		s.t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		s.t.Fatalf("DELETE %s: %v", path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		s.t.Fatalf("DELETE %s: %s", path, resp.Status)
	}
}

// NewUUID is a random (version 4) UUID.
func NewUUID(t testing.TB) string {
	t.Helper()
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}

// Attached reports whether the simulator holds volume attached to server.
func (tr Truth) Attached(server, volume string) bool {
	for _, a := range tr.Attachments {
		if a.ServerID == server && a.VolumeID == volume {
			return true
		}
	}
	return false
}
