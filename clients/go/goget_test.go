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

// docPrograms is every ```go block of docs/api.md that is a whole program
// (package main), in order.
func docPrograms(t *testing.T) []string {
	t.Helper()
	doc, err := os.ReadFile(filepath.Join("..", "..", "docs", "api.md"))
	if err != nil {
		t.Fatal(err)
	}
	var programs []string
	rest := string(doc)
	for {
		_, after, ok := strings.Cut(rest, "```go\n")
		if !ok {
			return programs
		}
		block, tail, closed := strings.Cut(after, "```")
		if !closed {
			t.Fatal("docs/api.md: a ```go block is not closed")
		}
		if strings.HasPrefix(block, "package main") && strings.Contains(block, modulePath) {
			programs = append(programs, block)
		}
		rest = tail
	}
}

// The docs' commands for a checkout, as printed (docs/api.md: the
// replace, then `go get …@v0.0.0`), in a scratch module on an empty module
// cache, as a new user's machine has it: the module proxy gives the
// dependencies, the checkout the module. Then the docs' two programs, as
// printed but for the address and the certificate paths: the first attach
// (plaintext) and the one over mutual TLS (WithMTLS), each attaching.
func TestTheDocsProgramsBuildThroughGoGetOnAnEmptyModuleCacheAndAttach(t *testing.T) {
	t.Parallel()
	programs := docPrograms(t)
	if len(programs) != 2 || !strings.Contains(programs[1], "vr.WithMTLS(") {
		t.Fatalf("docs/api.md has %d Go programs; want the first attach and the WithMTLS one", len(programs))
	}
	plain := startService(t)
	p := newPKI(t, t.TempDir())
	tls := startService(t, "--tls-cert", p.serverCert, "--tls-key", p.serverKey, "--tls-client-ca", p.ca)
	checkout, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	// The module cache starts empty; -modcacherw lets the test remove it.
	env := append(os.Environ(), "GOMODCACHE="+t.TempDir(), "GOFLAGS=-modcacherw")
	run := func(name string, args ...string) string {
		t.Helper()
		cmd := exec.Command(name, args...)
		cmd.Dir = dir
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	run("go", "mod", "init", "example.com/scratch")
	for _, line := range docShellLines(t, "go mod edit -replace", "go get "+modulePath+"@v0.0.0") {
		line = strings.ReplaceAll(line, "/path/to/checkout/clients/go", checkout)
		fields := strings.Fields(line)
		run(fields[0], fields[1:]...)
	}
	write := func(sub, program string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Join(dir, sub), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, sub, "main.go"), []byte(program), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("attach", strings.ReplaceAll(programs[0], "127.0.0.1:50051", plain.Addr))
	mtls := strings.NewReplacer("127.0.0.1:50051", tls.Addr,
		"/etc/volume-reconciler/ca.pem", p.ca,
		"/etc/volume-reconciler/client.pem", p.clientCert,
		"/etc/volume-reconciler/client.key", p.clientKey).Replace(programs[1])
	write("mtls", mtls)
	if out := run("go", "run", "./attach"); !strings.Contains(out, "STATE_SUCCEEDED RESOLUTION_RESPONSE") {
		t.Fatalf("the docs' first attach printed:\n%s", out)
	}
	if out := run("go", "run", "./mtls"); !strings.Contains(out, "STATE_SUCCEEDED") {
		t.Fatalf("the docs' mTLS program printed:\n%s", out)
	}
	if plain.truth().AttachEffects["a07f71dc-8151-4e7d-a0cc-cd24a3f11113"] != 1 || tls.truth().AttachEffects["a07f71dc-8151-4e7d-a0cc-cd24a3f11113"] != 1 {
		t.Fatal("the docs' programs did not attach once each")
	}
}

// docShellLines is, for each prefix, the first line of a ```sh block of
// docs/api.md that starts with it: the command as the docs print it.
func docShellLines(t *testing.T, prefixes ...string) []string {
	t.Helper()
	doc, err := os.ReadFile(filepath.Join("..", "..", "docs", "api.md"))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, prefix := range prefixes {
		found := ""
		for _, l := range strings.Split(string(doc), "\n") {
			if strings.HasPrefix(l, prefix) {
				found = l
				break
			}
		}
		if found == "" {
			t.Fatalf("docs/api.md has no command starting %q any more: update this test", prefix)
		}
		out = append(out, found)
	}
	return out
}
