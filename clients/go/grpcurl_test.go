package volumereconciler_test

// The docs' grpcurl commands, run as the docs print them against a real
// service, so a reader's first attach cannot rot. The one change made to a
// command is its address: the docs' 127.0.0.1:50051 becomes the test
// service's host:port (chosen free). A command that sends the demo
// overlay's token (deploy/kubernetes/overlays/demo) runs against a service
// that knows that token; the others against one without authentication.

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// The version .ci/run installs (go install ...@this).
const grpcurlVersion = "v1.9.4"

func grpcurlBinary(t *testing.T) string {
	t.Helper()
	bin := os.Getenv("GRPCURL")
	if bin == "" {
		bin = filepath.Join("..", "..", "target", "ci-tools", "go-bin", "grpcurl")
	}
	abs, err := filepath.Abs(bin)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(abs); err != nil {
		t.Fatalf("grpcurl is missing (%v): install it with `GOBIN=$PWD/target/ci-tools/go-bin go install github.com/fullstorydev/grpcurl/cmd/grpcurl@%s` at the repository's root (.ci/run does), or point GRPCURL at one", err, grpcurlVersion)
	}
	return abs
}

// docCommand is one grpcurl command of a doc, its continuation lines
// joined, and the fragments the doc says its output holds (a comment line
// `# → "key": "value", ...` right after it).
type docCommand struct {
	doc, line string
	expect    []string
}

var quoted = regexp.MustCompile(`"[^"]*": "[^"]*"`)

func grpcurlCommands(t *testing.T, doc string) []docCommand {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", doc))
	if err != nil {
		t.Fatal(err)
	}
	var cmds []docCommand
	lines := strings.Split(string(b), "\n")
	inBlock := false
	for i := 0; i < len(lines); i++ {
		l := lines[i]
		if strings.HasPrefix(l, "```") {
			inBlock = !inBlock
			continue
		}
		if !inBlock || !strings.HasPrefix(l, "grpcurl ") {
			continue
		}
		cmd := l
		for strings.HasSuffix(cmd, "\\") && i+1 < len(lines) {
			i++
			cmd = strings.TrimSuffix(cmd, "\\") + " " + strings.TrimSpace(lines[i])
		}
		c := docCommand{doc: doc, line: cmd}
		if i+1 < len(lines) && strings.HasPrefix(lines[i+1], "# →") {
			c.expect = quoted.FindAllString(lines[i+1], -1)
		}
		cmds = append(cmds, c)
	}
	return cmds
}

func TestTheDocsGrpcurlCommandsRunAsWritten(t *testing.T) {
	t.Parallel()
	grpcurl := grpcurlBinary(t)
	var cmds []docCommand
	for _, doc := range []string{"docs/api.md", "docs/deploying.md"} {
		found := grpcurlCommands(t, doc)
		if len(found) == 0 {
			t.Fatalf("%s has no grpcurl command any more: update this test", doc)
		}
		cmds = append(cmds, found...)
	}
	plain := startService(t)
	sum := sha256.Sum256([]byte("demo-token"))
	demo := startService(t, "--auth-tokens", "demo:orchestrator:"+hex.EncodeToString(sum[:]))
	// grpcurl from the pinned install, first on PATH: the docs call it by name.
	path := filepath.Dir(grpcurl) + string(os.PathListSeparator) + os.Getenv("PATH")
	for _, c := range cmds {
		target := plain.Addr
		if strings.Contains(c.line, "Bearer demo-token") {
			target = demo.Addr
		}
		line := strings.ReplaceAll(c.line, "127.0.0.1:50051", target)
		sh := exec.Command("sh", "-c", line)
		sh.Env = append(os.Environ(), "PATH="+path)
		out, err := sh.CombinedOutput()
		if err != nil {
			t.Errorf("%s: %s\n%v\n%s", c.doc, c.line, err, out)
			continue
		}
		for _, want := range c.expect {
			if !strings.Contains(string(out), want) {
				t.Errorf("%s: %s\nthe doc says the output holds %s; it was:\n%s", c.doc, c.line, want, out)
			}
		}
	}
}
