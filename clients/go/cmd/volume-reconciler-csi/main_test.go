package main

// The command as a cluster runs it: built, started with flags and
// environment, its socket asked over CSI, its /metrics read, stopped with
// SIGTERM.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
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

	csispec "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	vr "github.com/volume-reconciler/volume-reconciler/clients/go"
	"github.com/volume-reconciler/volume-reconciler/clients/go/internal/testservice"
)

// endpointProcess is the command, running.
type endpointProcess struct {
	cmd    *exec.Cmd
	done   chan error
	socket string
	http   string
	log    *lockedLog
	exited bool
}

// lockedLog is the command's stderr, written by os/exec's copier while the
// test reads it.
type lockedLog struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// wait is the command's exit, within a minute.
func (p *endpointProcess) wait(t *testing.T) error {
	t.Helper()
	select {
	case err := <-p.done:
		p.exited = true
		return err
	case <-time.After(time.Minute):
		t.Fatal("the command did not exit within a minute")
		return nil
	}
}

func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// startCommand builds the command and runs it with env (and the socket
// and HTTP endpoint in it), until it answers on its socket.
func startCommand(t *testing.T, env ...string) *endpointProcess {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "volume-reconciler-csi")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	dir, err := os.MkdirTemp("", "vrcsi-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) }) // a temporary directory
	p := &endpointProcess{socket: filepath.Join(dir, "csi.sock"), http: freePort(t), log: &lockedLog{}, done: make(chan error, 1)}
	p.cmd = exec.Command(bin)
	p.cmd.Env = append(os.Environ(), append(env, "CSI_ENDPOINT=unix://"+p.socket, "CSI_HTTP_ENDPOINT="+p.http)...)
	p.cmd.Stderr = p.log
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		if !p.exited {
			_ = p.cmd.Process.Kill() // the test is over: its process goes too
			<-p.done
		}
		if t.Failed() {
			t.Logf("the command's log:\n%s", p.log.String())
		}
	})
	testservice.Eventually(t, time.Minute, "the command serves its socket", func() bool {
		_, err := os.Stat(p.socket)
		return err == nil
	})
	return p
}

func (p *endpointProcess) identity(t *testing.T) (csispec.IdentityClient, csispec.ControllerClient) {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+p.socket, vr.Insecure())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() }) // nothing to report at the test's end
	return csispec.NewIdentityClient(conn), csispec.NewControllerClient(conn)
}

func TestTheCommandProbesTheServiceServesMetricsAndStopsOnSIGTERM(t *testing.T) {
	t.Parallel()
	s := testservice.Start(t)
	p := startCommand(t, "VOLUME_RECONCILER_SERVER="+s.Addr, "CSI_DRIVER_NAME=example.csi.test")
	id, _ := p.identity(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	info, err := id.GetPluginInfo(ctx, &csispec.GetPluginInfoRequest{})
	if err != nil || info.GetName() != "example.csi.test" {
		t.Fatalf("GetPluginInfo: %v %v", info, err)
	}
	probe, err := id.Probe(ctx, &csispec.ProbeRequest{})
	if err != nil || !probe.GetReady().GetValue() {
		t.Fatalf("Probe with the service serving: %v %v", probe, err)
	}
	// The service gone: the probe says so, naming why.
	s.Signal(syscall.SIGTERM)
	_, err = id.Probe(ctx, &csispec.ProbeRequest{})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "health") {
		t.Fatalf("Probe with the service stopped: %v", err)
	}

	resp, err := http.Get("http://" + p.http + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`volume_reconciler_csi_operations_seconds_count{driver_name="example.csi.test",grpc_status_code="OK",method_name="Probe"} 1`,
		`volume_reconciler_csi_operations_seconds_count{driver_name="example.csi.test",grpc_status_code="FailedPrecondition",method_name="Probe"} 1`,
		`volume_reconciler_csi_service_ready{driver_name="example.csi.test"} 0`,
	} {
		if !strings.Contains(string(body), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}

	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := p.wait(t); err != nil {
		t.Fatalf("exit after SIGTERM: %v", err)
	}
	if _, err := os.Stat(p.socket); !os.IsNotExist(err) {
		t.Fatalf("the socket is still there: %v", err)
	}
	if !strings.Contains(p.log.String(), `"msg":"stopped: every call in flight finished"`) {
		t.Fatalf("no JSON line of the stop in its log:\n%s", p.log.String())
	}
}

// The token from --token-file's file reaches the service: a publish is
// attached; with a token the service does not know, the publish is
// UNAVAILABLE with a message that names the credentials to fix.
func TestTheCommandSendsTheTokenFromItsFile(t *testing.T) {
	t.Parallel()
	sum := sha256.Sum256([]byte("csi-token"))
	s := testservice.Start(t, "--auth-tokens", "csi:orchestrator:"+hex.EncodeToString(sum[:]))
	dir := t.TempDir()
	right, wrong := filepath.Join(dir, "right"), filepath.Join(dir, "wrong")
	for f, token := range map[string]string{right: "csi-token\n", wrong: "not-the-token"} {
		if err := os.WriteFile(f, []byte(token), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	server, volume := testservice.NewUUID(t), testservice.NewUUID(t)
	req := &csispec.ControllerPublishVolumeRequest{VolumeId: volume, NodeId: server, VolumeCapability: &csispec.VolumeCapability{
		AccessType: &csispec.VolumeCapability_Block{Block: &csispec.VolumeCapability_BlockVolume{}},
		AccessMode: &csispec.VolumeCapability_AccessMode{Mode: csispec.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	_, bad := startCommand(t, "VOLUME_RECONCILER_SERVER="+s.Addr, "VOLUME_RECONCILER_TOKEN_FILE="+wrong).identity(t)
	_, err := bad.ControllerPublishVolume(ctx, req)
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "--token-file") {
		t.Fatalf("with a wrong token: %v", err)
	}
	_, good := startCommand(t, "VOLUME_RECONCILER_SERVER="+s.Addr, "VOLUME_RECONCILER_TOKEN_FILE="+right).identity(t)
	r, err := good.ControllerPublishVolume(ctx, req)
	if err != nil || r.GetPublishContext()["DevicePath"] == "" {
		t.Fatalf("with the token: %v %v", r, err)
	}
	if n := s.Truth().AttachEffects[volume]; n != 1 {
		t.Fatalf("Nova attached it %d times", n)
	}
}
