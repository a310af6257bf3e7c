package volumereconciler_test

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The example orchestrator (examples/orchestrator) publishes and
// unpublishes a volume against the real service: one attach and one detach
// reach Nova, and the volume ends detached.
func TestTheExampleOrchestratorPublishesAndUnpublishesOnce(t *testing.T) {
	t.Parallel()
	s := startService(t)
	bin := filepath.Join(t.TempDir(), "orchestrator")
	if out, err := exec.Command("go", "build", "-o", bin, "./examples/orchestrator").CombinedOutput(); err != nil {
		t.Fatalf("go build ./examples/orchestrator: %v\n%s", err, out)
	}
	server, volume := newUUID(t), newUUID(t)
	out, err := exec.Command(bin, "-server", s.Addr, "-volume", volume, "-node", server, "-generation", "1").CombinedOutput()
	if err != nil {
		t.Fatalf("orchestrator: %v\n%s", err, out)
	}
	for _, want := range []string{"published: operation", "STATE_SUCCEEDED RESOLUTION_RESPONSE", "unpublished: operation"} {
		if !strings.Contains(string(out), want) {
			t.Fatalf("the orchestrator's output lacks %q:\n%s", want, out)
		}
	}
	tr := s.truth()
	if tr.AttachEffects[volume] != 1 || tr.DetachEffects[volume] != 1 {
		t.Fatalf("Nova: %d attaches, %d detaches took effect; want 1, 1", tr.AttachEffects[volume], tr.DetachEffects[volume])
	}
	for _, a := range tr.Attachments {
		if a.VolumeID == volume {
			t.Fatalf("the volume is still attached to %s", a.ServerID)
		}
	}
}
