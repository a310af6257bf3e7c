package csi_test

// csi-sanity (kubernetes-csi/csi-test's pkg/sanity, pinned in go.mod)
// against the endpoint, the real service and nova-sim: its Identity suite
// and its Controller suite's publish and unpublish cases, which must run,
// not be skipped (but for the cases whose capability the endpoint does
// not offer). The counts are printed. csi-sanity's CreateVolume and
// NodeGetInfo are the stand-in's (standin_test.go), as cinder-csi serves
// them in a cluster.

import (
	"flag"
	"fmt"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/ginkgo/v2/types"
	"github.com/onsi/gomega"

	"github.com/volume-reconciler/volume-reconciler/clients/go/internal/testservice"
)

// The suites that run: csi-sanity's spec texts, from a word's start (a
// bare "ControllerGetCapabilities" would also pick
// GroupControllerGetCapabilities; Ginkgo puts the suite's name first).
var sanityFocus = []string{
	`(^|\s)Identity Service `,
	`(^|\s)Controller Service \[Controller Server\] (ControllerGetCapabilities|ControllerPublishVolume|volume lifecycle|ControllerUnpublishVolume) `,
}

// The cases that may be skipped, for a capability the endpoint does not
// offer: a readonly publish (Nova attaches read-write), and the node's
// attach limit when the simulator cannot hold a server to one.
var mayBeSkipped = []string{
	"should fail when the volume is already published but is incompatible",
	"should fail when publishing more volumes than the node max attach limit",
}

// ids are csi-sanity's "valid" ids: UUIDs, as Nova's and Cinder's are, of
// a volume or a server that does not exist. The simulator holds every id
// it has not heard of as existing (its tests use fresh ids), so each is
// removed there first, as it is in a cloud where it was never created.
type ids struct{ sim sim }

func (g ids) removed(kind string) string {
	id := testservice.NewUUID(ginkgoT{})
	_, err := g.sim.do(http.MethodDelete, "/sim/"+kind+"/"+id, nil)
	gomega.Expect(err).NotTo(gomega.HaveOccurred())
	return id
}

func (g ids) GenerateUniqueValidVolumeID() string { return g.removed("volumes") }
func (g ids) GenerateInvalidVolumeID() string     { return "not-a-volume-uuid" }
func (g ids) GenerateUniqueValidNodeID() string   { return g.removed("servers") }
func (g ids) GenerateInvalidNodeID() string       { return "not-a-server-uuid" }

// ginkgoT is a testing.TB for NewUUID inside a spec: a failure fails the
// spec.
type ginkgoT struct{ testing.TB }

func (ginkgoT) Helper()                      {}
func (ginkgoT) Fatal(args ...any)            { ginkgo.Fail(fmt.Sprint(args...)) }
func (ginkgoT) Fatalf(f string, args ...any) { ginkgo.Fail(fmt.Sprintf(f, args...)) }

func TestCSISanityIdentityAndPublishUnpublishRunAgainstTheEndpoint(t *testing.T) {
	t.Parallel()
	// Ginkgo ends the whole test process when go test's -parallel flag was
	// given (its specs do not run in go test's parallel): fail this test
	// alone instead, saying what to do.
	flag.Visit(func(f *flag.Flag) {
		if f.Name == "test.parallel" {
			t.Fatal("csi-sanity (Ginkgo) refuses go test's -parallel flag: leave it out (GOMAXPROCS sets its default; .ci/run sets GOMAXPROCS=8)")
		}
	})
	s := testservice.Start(t, "--reconcile-interval", "200ms")
	node := testservice.NewUUID(t)
	stand := &standIn{sim: sim{s.SimURL}, node: node}
	// The node's attach limit, held by the simulator's Nova to the same
	// number, when it can (its control: docs/testing.md).
	const limit = 3
	limited := false
	if _, err := stand.sim.do(http.MethodPost, "/sim/servers/"+node+"/max_disk_devices_to_attach",
		map[string]any{"max_disk_devices_to_attach": limit}); err == nil {
		stand.maxDisks, limited = limit, true
	} else {
		t.Logf("the simulator holds no server to a maximum of disk devices (%v): the attach-limit case is skipped", err)
	}
	socket := serveStandIn(t, stand, serveEndpoint(t, s.Addr))

	cfg := sanity.NewTestConfig()
	cfg.Address = "unix://" + socket
	cfg.IDGen = ids{stand.sim}
	cfg.TestNodeVolumeAttachLimit = limited
	cfg.TargetPath = t.TempDir() + "/target"
	cfg.StagingPath = t.TempDir() + "/staging"
	// The idempotent lifecycle publishes the same volume to the same node
	// this many times: every call after the first finds it attached.
	cfg.IdempotentCount = 5

	var report types.Report
	ginkgo.ReportAfterSuite("counts", func(r ginkgo.Report) { report = r })
	sc := sanity.GinkgoTest(&cfg)
	gomega.RegisterFailHandler(ginkgo.Fail)
	suite, reporter := ginkgo.GinkgoConfiguration()
	suite.FocusStrings = sanityFocus
	reporter.Succinct = true
	reporter.NoColor = true
	ginkgo.RunSpecs(t, "csi-sanity: identity, publish and unpublish", suite, reporter)
	sc.Finalize()

	ran, skipped, failed := countSpecs(report)
	t.Logf("csi-sanity: %d ran, %d skipped, %d failed", len(ran), len(skipped), len(failed))
	fmt.Printf("csi-sanity: %d ran, %d skipped (%s)\n", len(ran), len(skipped), strings.Join(skipped, "; "))
	for _, name := range skipped {
		if !slices.ContainsFunc(mayBeSkipped, func(allowed string) bool { return strings.HasSuffix(name, allowed) }) ||
			(limited && strings.HasSuffix(name, mayBeSkipped[1])) {
			t.Errorf("csi-sanity skipped %q", name)
		}
	}
	if len(ran) < 12 {
		t.Errorf("csi-sanity ran %d cases: %v", len(ran), ran)
	}
}

// countSpecs sorts the focused cases of report by how they ended.
func countSpecs(report types.Report) (ran, skipped, failed []string) {
	var focus []*regexp.Regexp
	for _, f := range sanityFocus {
		focus = append(focus, regexp.MustCompile(f))
	}
	for _, spec := range report.SpecReports {
		if spec.LeafNodeType != types.NodeTypeIt {
			continue
		}
		name := spec.FullText()
		if !slices.ContainsFunc(focus, func(re *regexp.Regexp) bool { return re.MatchString(name) }) {
			continue
		}
		switch spec.State {
		case types.SpecStatePassed:
			ran = append(ran, name)
		case types.SpecStateSkipped, types.SpecStatePending:
			skipped = append(skipped, name)
		default:
			failed = append(failed, name)
		}
	}
	return ran, skipped, failed
}
