package volumereconciler

// The reason constants and the code of each, checked against the service's
// one list of reasons (src/domain/reason.rs, its `reasons!` table): every
// reason there has a constant here with the same text and the same code,
// and every constant has a code. The constants file itself is generated
// from that list by the service's tests.

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
)

// A row of the table: `Variant = "TEXT" => Code,`.
var rustReason = regexp.MustCompile(`(?m)^\s*\w+ = "([A-Z_]+)" => (\w+),`)

// serviceReasons is the service's list: reason text → code.
func serviceReasons(t *testing.T) map[string]codes.Code {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "src", "domain", "reason.rs"))
	if err != nil {
		t.Fatal(err)
	}
	body, _, _ := strings.Cut(string(b), "impl fmt::Display")
	_, table, ok := strings.Cut(body, "reasons! {")
	if !ok {
		t.Fatal("src/domain/reason.rs has no `reasons! {` table any more: update this test")
	}
	byName := map[string]codes.Code{}
	for c := codes.OK; c <= codes.Unauthenticated; c++ {
		byName[c.String()] = c
	}
	byName["Cancelled"] = codes.Canceled // the Rust enum's spelling
	out := map[string]codes.Code{}
	for _, m := range rustReason.FindAllStringSubmatch(table, -1) {
		code, known := byName[m[2]]
		if !known {
			t.Fatalf("reason %s: code %s is no gRPC code", m[1], m[2])
		}
		out[m[1]] = code
	}
	if len(out) < 50 {
		t.Fatalf("read %d reasons from src/domain/reason.rs: the table's shape changed", len(out))
	}
	return out
}

// constants is every Reason… constant of reasons.go: name → text.
func constants(t *testing.T) map[string]string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), "reasons.go", nil, parser.ParseComments)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	ast.Inspect(f, func(n ast.Node) bool {
		spec, ok := n.(*ast.ValueSpec)
		if !ok || len(spec.Values) != 1 {
			return true
		}
		lit, ok := spec.Values[0].(*ast.BasicLit)
		if !ok || lit.Kind != token.STRING {
			return true
		}
		text, err := strconv.Unquote(lit.Value)
		if err != nil {
			t.Fatal(err)
		}
		out[spec.Names[0].Name] = text
		return true
	})
	return out
}

func camel(reason string) string {
	var b strings.Builder
	b.WriteString("Reason")
	for _, w := range strings.Split(reason, "_") {
		b.WriteString(w[:1] + strings.ToLower(w[1:]))
	}
	return b.String()
}

func TestEveryReasonOfTheServiceHasAConstantAndTheServicesCode(t *testing.T) {
	consts := constants(t)
	texts := map[string]bool{}
	for name, text := range consts {
		if name != camel(text) {
			t.Errorf("constant %s = %q: want the name %s", name, text, camel(text))
		}
		texts[text] = true
		if _, ok := reasonCodes[text]; !ok {
			t.Errorf("reason %s has no code in reasonCodes", text)
		}
	}
	if len(reasonCodes) != len(consts) {
		t.Errorf("reasonCodes has %d reasons, reasons.go %d", len(reasonCodes), len(consts))
	}
	for text, code := range serviceReasons(t) {
		if !texts[text] {
			t.Errorf("the service's reason %s has no constant in reasons.go", text)
		}
		if got := reasonCodes[text]; got != code {
			t.Errorf("reason %s: reasonCodes says %s, the service answers %s", text, got, code)
		}
	}
}
