package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Settings come from the environment as sidecars take them, a flag wins
// over its variable, and what cannot work is refused at start with what
// to fix.
func TestTheSettingsComeFromTheEnvironmentAndFlagsWin(t *testing.T) {
	t.Setenv("CSI_ENDPOINT", "unix:///csi/reconciler.sock")
	t.Setenv("VOLUME_RECONCILER_SERVER", "from-env:50051")
	t.Setenv("CSI_DRIVER_NAME", "env.csi.test")
	t.Setenv("CSI_DRAIN_TIMEOUT", "7s")
	c, err := parse([]string{"--server", "from-flag:50051"})
	if err != nil {
		t.Fatal(err)
	}
	if c.endpoint != "unix:///csi/reconciler.sock" || c.server != "from-flag:50051" || c.driver != "env.csi.test" || c.drain != 7*time.Second {
		t.Fatalf("%+v", c)
	}

	t.Setenv("VOLUME_RECONCILER_SERVER", "")
	if _, err := parse(nil); err == nil || !strings.Contains(err.Error(), "--server") {
		t.Fatalf("without a server: %v", err)
	}
	if _, err := parse([]string{"--server", "x:1", "--drain-timeout", "soon"}); err == nil || !strings.Contains(err.Error(), "--drain-timeout") {
		t.Fatalf("a bad duration: %v", err)
	}

	dir := t.TempDir()
	empty := filepath.Join(dir, "empty")
	if err := os.WriteFile(empty, []byte("\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for name, cfg := range map[string]config{
		"an empty token file":   {server: "x:1", tokenFile: empty},
		"a missing token file":  {server: "x:1", tokenFile: filepath.Join(dir, "none")},
		"a missing CA":          {server: "x:1", ca: filepath.Join(dir, "ca.pem")},
		"a certificate, no key": {server: "x:1", cert: filepath.Join(dir, "client.pem")},
	} {
		if _, err := credentials(cfg); err == nil || !strings.Contains(err.Error(), dir) {
			t.Errorf("%s: %v, want an error naming the file", name, err)
		}
	}
	if opts, err := credentials(config{server: "x:1"}); err != nil || len(opts) != 1 {
		t.Fatalf("plaintext without a token: %v %v", opts, err)
	}
}
