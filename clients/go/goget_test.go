package volumereconciler_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The module path as go.mod declares it (and the proto's go_package, and
// docs/api.md).
const modulePath = "github.com/volume-reconciler/volume-reconciler/clients/go"

// A caller's view: a scratch module `go get`s this one (a replace to the
// checkout standing in for the published repository) and the first attach
// of docs/api.md, as printed but for its address, compiles and attaches.
func TestTheDocsFirstAttachBuildsThroughGoGetAndAttaches(t *testing.T) {
	t.Parallel()
	s := startService(t)
	doc, err := os.ReadFile(filepath.Join("..", "..", "docs", "api.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(doc), "```go\n")
	program, _, closed := strings.Cut(rest, "```")
	if !ok || !closed || !strings.Contains(program, modulePath) {
		t.Fatalf("docs/api.md has no ```go block importing %s", modulePath)
	}
	checkout, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	run := func(name string, args ...string) string {
		t.Helper()
		cmd := exec.Command(name, args...)
		cmd.Dir = dir
		// The replace stands in for the published repository; without
		// GOPROXY=off, `go get` would first ask the proxy for that path's
		// versions, which it does not serve. The dependencies come from the
		// module cache this module's own build filled.
		cmd.Env = append(os.Environ(), "GOPROXY=off", "GOFLAGS=-mod=mod")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	run("go", "mod", "init", "example.com/scratch")
	// The module's own sums, so no checksum is looked up again.
	sums, err := os.ReadFile("go.sum")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "go.sum"), sums, 0o644); err != nil {
		t.Fatal(err)
	}
	run("go", "mod", "edit", "-replace", modulePath+"="+checkout)
	run("go", "get", modulePath)
	main := strings.ReplaceAll(program, "127.0.0.1:50051", s.Addr)
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(main), 0o644); err != nil {
		t.Fatal(err)
	}
	out := run("go", "run", ".")
	if !strings.Contains(out, "STATE_SUCCEEDED RESOLUTION_RESPONSE") {
		t.Fatalf("the docs' program printed:\n%s", out)
	}
}
