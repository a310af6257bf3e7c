package csi_test

// The code table of docs/kubernetes.md, row by row: the table as printed
// is the endpoint's (csi.Rules), and for every reason of every row a
// publish and an unpublish through the endpoint, against a scripted
// volume-reconciler that answers that reason as the service does (its
// code, an ErrorInfo), answer the row's codes. The rows of special cases
// below the table have a test each too.

import (
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	csispec "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	vr "github.com/volume-reconciler/volume-reconciler/clients/go"
	"github.com/volume-reconciler/volume-reconciler/clients/go/csi"
	"github.com/volume-reconciler/volume-reconciler/clients/go/internal/testservice"
	reconcilerv1 "github.com/volume-reconciler/volume-reconciler/clients/go/volume_reconciler/v1"
)

// scripted is a volume-reconciler that answers every ensure call with err.
type scripted struct {
	reconcilerv1.UnimplementedVolumeReconcilerServer
	mu  sync.Mutex
	err error
}

func (s *scripted) answer() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

func (s *scripted) EnsureAttached(context.Context, *reconcilerv1.EnsureAttachedRequest) (*reconcilerv1.Operation, error) {
	return nil, s.answer()
}

func (s *scripted) EnsureDetached(context.Context, *reconcilerv1.EnsureDetachedRequest) (*reconcilerv1.Operation, error) {
	return nil, s.answer()
}

// serviceAnswer is the status the service sends for reason: its code and
// an ErrorInfo with meta.
func serviceAnswer(t *testing.T, reason string, meta map[string]string) error {
	t.Helper()
	code, known := vr.ReasonCode(reason)
	if !known {
		t.Fatalf("reason %s is not in the client's list", reason)
	}
	st, err := status.New(code, "the service says "+reason).WithDetails(&errdetails.ErrorInfo{Reason: reason, Domain: vr.Domain, Metadata: meta})
	if err != nil {
		t.Fatal(err)
	}
	return st.Err()
}

// endpoint serves the CSI endpoint on a unix socket in front of svc (a
// VolumeReconciler server, in-process) and answers a CSI client of it.
func endpoint(t *testing.T, svc reconcilerv1.VolumeReconcilerServer) csispec.ControllerClient {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	reconcilerv1.RegisterVolumeReconcilerServer(g, svc)
	go func() {
		if err := g.Serve(l); err != nil {
			t.Errorf("scripted service: %v", err)
		}
	}()
	t.Cleanup(g.Stop)
	return csiClient(t, serveEndpoint(t, l.Addr().String()))
}

// serveEndpoint serves the endpoint on a socket in a fresh directory, its
// service at target; it answers the socket's path.
func serveEndpoint(t *testing.T, target string, opts ...grpc.DialOption) string {
	t.Helper()
	conn, err := grpc.NewClient(target, append([]grpc.DialOption{vr.Insecure()}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() }) // nothing to report at the test's end
	srv := csi.NewServer(conn, csi.Options{Logger: testLogger(t)})
	g := grpc.NewServer(srv.ServerOptions()...)
	srv.Register(g)
	dir, err := os.MkdirTemp("", "csi-") // short: a socket path has at most 107 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) }) // a temporary directory
	socket := filepath.Join(dir, "csi.sock")
	l, err := csi.Listen("unix://" + socket)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		if err := g.Serve(l); err != nil {
			t.Errorf("endpoint: %v", err)
		}
	}()
	t.Cleanup(g.Stop)
	return socket
}

func csiClient(t *testing.T, socket string) csispec.ControllerClient {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+socket, vr.Insecure())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() }) // nothing to report at the test's end
	return csispec.NewControllerClient(conn)
}

var mountCapability = &csispec.VolumeCapability{
	AccessType: &csispec.VolumeCapability_Mount{Mount: &csispec.VolumeCapability_MountVolume{}},
	AccessMode: &csispec.VolumeCapability_AccessMode{Mode: csispec.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
}

// publishUnpublish is what a publish and an unpublish of a fresh volume
// answer through c.
func publishUnpublish(t *testing.T, c csispec.ControllerClient) (error, error) {
	t.Helper()
	// Short: an OUTCOME_UNKNOWN is replayed (by the client, in the
	// endpoint) until the deadline is near.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, pub := c.ControllerPublishVolume(ctx, &csispec.ControllerPublishVolumeRequest{
		VolumeId: testservice.NewUUID(t), NodeId: testservice.NewUUID(t), VolumeCapability: mountCapability})
	_, unpub := c.ControllerUnpublishVolume(ctx, &csispec.ControllerUnpublishVolumeRequest{
		VolumeId: testservice.NewUUID(t), NodeId: testservice.NewUUID(t)})
	return pub, unpub
}

// docRow is a row of docs/kubernetes.md's code table.
type docRow struct {
	reasons            []string
	publish, unpublish codes.Code
}

var codeByName = func() map[string]codes.Code {
	m := map[string]codes.Code{}
	for c := codes.OK; c <= codes.Unauthenticated; c++ {
		var b strings.Builder
		for i, r := range c.String() {
			if i > 0 && r >= 'A' && r <= 'Z' {
				b.WriteByte('_')
			}
			b.WriteRune(r)
		}
		m[strings.ToUpper(b.String())] = c
	}
	m["OK"] = codes.OK
	m["CANCELED"] = codes.Canceled
	return m
}()

var backticked = regexp.MustCompile("`([A-Z_]+)`")

// docTable reads the table under "## The codes" in docs/kubernetes.md:
// its rows whose first cell names reasons.
func docTable(t *testing.T) []docRow {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(testservice.RepoRoot(t), "docs", "kubernetes.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(b), "\n## The codes")
	if !ok {
		t.Fatal("docs/kubernetes.md has no section \"## The codes\"")
	}
	section, _, _ = strings.Cut(section, "\n## ")
	var rows []docRow
	for _, line := range strings.Split(section, "\n") {
		cells := strings.Split(line, "|")
		if len(cells) < 5 || !strings.HasPrefix(strings.TrimSpace(cells[1]), "`") {
			continue
		}
		var r docRow
		for _, m := range backticked.FindAllStringSubmatch(cells[1], -1) {
			r.reasons = append(r.reasons, m[1])
		}
		pub, unpub := backticked.FindStringSubmatch(cells[2]), backticked.FindStringSubmatch(cells[3])
		if pub == nil || unpub == nil {
			t.Fatalf("docs/kubernetes.md row %q: the codes are not `CODE`", line)
		}
		r.publish, r.unpublish = codeByName[pub[1]], codeByName[unpub[1]]
		rows = append(rows, r)
	}
	return rows
}

func TestTheDocsCodeTableIsTheEndpointsAndEveryRowHolds(t *testing.T) {
	rows := docTable(t)
	if len(rows) != len(csi.Rules) {
		t.Fatalf("docs/kubernetes.md has %d rows, the endpoint %d", len(rows), len(csi.Rules))
	}
	svc := &scripted{}
	c := endpoint(t, svc)
	for i, row := range rows {
		rule := csi.Rules[i]
		t.Run(strings.Join(row.reasons, ","), func(t *testing.T) {
			if !slices.Equal(row.reasons, rule.Reasons) || row.publish != rule.Publish || row.unpublish != rule.Unpublish {
				t.Fatalf("docs row %d: %v %s %s; the endpoint's: %v %s %s", i+1, row.reasons, row.publish, row.unpublish, rule.Reasons, rule.Publish, rule.Unpublish)
			}
			for _, reason := range row.reasons {
				meta := map[string]string{"operation_id": "op-1"}
				if reason == vr.ReasonAlreadyAttachedElsewhere {
					meta["attached_to"] = "server-b"
				}
				svc.mu.Lock()
				svc.err = serviceAnswer(t, reason, meta)
				svc.mu.Unlock()
				pub, unpub := publishUnpublish(t, c)
				if status.Code(pub) != row.publish || status.Code(unpub) != row.unpublish {
					t.Errorf("%s: publish %v, unpublish %v; want %s, %s", reason, pub, unpub, row.publish, row.unpublish)
				}
				if pub != nil && !strings.Contains(status.Convert(pub).Message(), reason) {
					t.Errorf("%s: the publish's message does not name the reason: %v", reason, pub)
				}
			}
		})
	}
}

// Every reason the service sends is in a row: none falls to the default.
func TestEveryReasonOfTheServiceHasARow(t *testing.T) {
	in := map[string]bool{}
	for _, r := range csi.Rules {
		for _, reason := range r.Reasons {
			if in[reason] {
				t.Errorf("%s is in two rows", reason)
			}
			in[reason] = true
		}
	}
	// The API's own refusals of a request this endpoint never sends wrong
	// (INVALID_FIELD has its own rule below) and the watch's idle end.
	for _, special := range []string{vr.ReasonInvalidField, vr.ReasonWatchIdle} {
		in[special] = true
	}
	for _, reason := range allReasons(t) {
		if !in[reason] {
			t.Errorf("the service's reason %s is in no row of csi.Rules", reason)
		}
	}
}

// Only Nova's too-many-disks is RESOURCE_EXHAUSTED, whatever else the
// service answers with that code (its shedding, its rate limits, a reason
// this endpoint does not know yet).
func TestOnlyTooManyDisksIsResourceExhausted(t *testing.T) {
	svc := &scripted{}
	c := endpoint(t, svc)
	for _, reason := range append(allReasons(t), "SOMETHING_NEWER") {
		code, _ := vr.ReasonCode(reason)
		if reason == "SOMETHING_NEWER" {
			code = codes.ResourceExhausted
		}
		st, err := status.New(code, reason).WithDetails(&errdetails.ErrorInfo{Reason: reason, Domain: vr.Domain})
		if err != nil {
			t.Fatal(err)
		}
		svc.mu.Lock()
		svc.err = st.Err()
		svc.mu.Unlock()
		pub, unpub := publishUnpublish(t, c)
		exhausted := status.Code(pub) == codes.ResourceExhausted || status.Code(unpub) == codes.ResourceExhausted
		if exhausted != (reason == vr.ReasonNovaTooManyDisks) {
			t.Errorf("%s (the service's %s): publish %s, unpublish %s", reason, code, status.Code(pub), status.Code(unpub))
		}
	}
}

// The special rows below the table.
func TestANonUUIDIdIsNotFoundOnPublishAndDoneOnUnpublish(t *testing.T) {
	svc := &scripted{err: serviceAnswer(t, vr.ReasonInvalidField, map[string]string{"field": "server_id"})}
	pub, unpub := publishUnpublish(t, endpoint(t, svc))
	if status.Code(pub) != codes.NotFound || unpub != nil {
		t.Fatalf("publish %v, unpublish %v", pub, unpub)
	}
}

func TestAServiceWithoutTheEnsureCallsIsAFailedPreconditionThatSaysUpgrade(t *testing.T) {
	pub, unpub := publishUnpublish(t, endpoint(t, &scripted{err: status.Error(codes.Unimplemented, "unknown method")}))
	for _, err := range []error{pub, unpub} {
		if status.Code(err) != codes.FailedPrecondition || !strings.Contains(status.Convert(err).Message(), "upgrade") {
			t.Fatalf("got %v", err)
		}
	}
}

func TestTheTransportsAnswersKeepTheirCode(t *testing.T) {
	pub, unpub := publishUnpublish(t, endpoint(t, &scripted{err: status.Error(codes.PermissionDenied, "a proxy said no")}))
	if status.Code(pub) != codes.PermissionDenied || status.Code(unpub) != codes.PermissionDenied {
		t.Fatalf("publish %v, unpublish %v", pub, unpub)
	}
}

func TestAPublishWithoutWhatCSIRequiresIsInvalidArgumentAndAsksNothing(t *testing.T) {
	svc := &scripted{err: status.Error(codes.Internal, "the service was asked")}
	c := endpoint(t, svc)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	vol, node := testservice.NewUUID(t), testservice.NewUUID(t)
	for name, req := range map[string]*csispec.ControllerPublishVolumeRequest{
		"volume_id":         {NodeId: node, VolumeCapability: mountCapability},
		"node_id":           {VolumeId: vol, VolumeCapability: mountCapability},
		"volume_capability": {VolumeId: vol, NodeId: node},
		"access_mode":       {VolumeId: vol, NodeId: node, VolumeCapability: &csispec.VolumeCapability{AccessType: mountCapability.AccessType}},
		"access_type":       {VolumeId: vol, NodeId: node, VolumeCapability: &csispec.VolumeCapability{AccessMode: mountCapability.AccessMode}},
		"readonly":          {VolumeId: vol, NodeId: node, VolumeCapability: mountCapability, Readonly: true},
	} {
		_, err := c.ControllerPublishVolume(ctx, req)
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), name) {
			t.Errorf("without %s: %v", name, err)
		}
	}
	for name, req := range map[string]*csispec.ControllerUnpublishVolumeRequest{
		"volume_id": {NodeId: node},
		"node_id":   {VolumeId: vol},
	} {
		_, err := c.ControllerUnpublishVolume(ctx, req)
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), name) {
			t.Errorf("unpublish without %s: %v", name, err)
		}
	}
}

// allReasons is every reason constant the client has (reasons.go).
func allReasons(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(testservice.RepoRoot(t), "clients", "go", "reasons.go"))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, m := range regexp.MustCompile(`(?m)^\s*Reason\w+ = "([A-Z_]+)"`).FindAllStringSubmatch(string(b), -1) {
		out = append(out, m[1])
	}
	if len(out) < 50 {
		t.Fatalf("read %d reasons from reasons.go", len(out))
	}
	return out
}

// testLogger writes the endpoint's lines to the test's log.
func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, nil))
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(b []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimSuffix(string(b), "\n"))
	return len(b), nil
}
