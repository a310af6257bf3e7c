package volumereconciler_test

import (
	"fmt"
	"os"
	"testing"
)

// exampleT lets the service harness, written for tests, serve the
// examples too (examples have no *testing.T): a failure ends the run.
type exampleT struct {
	testing.TB
	cleanups []func()
	dir      string
}

func (e *exampleT) Helper()                    {}
func (e *exampleT) Cleanup(f func())           { e.cleanups = append(e.cleanups, f) }
func (e *exampleT) Failed() bool               { return false }
func (e *exampleT) TempDir() string            { return e.dir }
func (e *exampleT) Logf(f string, args ...any) { fmt.Fprintf(os.Stderr, f+"\n", args...) }
func (e *exampleT) Errorf(f string, args ...any) {
	fmt.Fprintf(os.Stderr, "examples' service: "+f+"\n", args...)
}
func (e *exampleT) Fatal(args ...any) { e.Fatalf("%s", fmt.Sprint(args...)) }
func (e *exampleT) Fatalf(f string, args ...any) {
	fmt.Fprintf(os.Stderr, "examples' service: "+f+"\n", args...)
	e.stop()
	os.Exit(1)
}

func (e *exampleT) stop() {
	for i := len(e.cleanups) - 1; i >= 0; i-- {
		e.cleanups[i]()
	}
	e.cleanups = nil
	if err := os.RemoveAll(e.dir); err != nil {
		fmt.Fprintf(os.Stderr, "examples' service: %v\n", err)
	}
}

// TestMain starts the service the examples call (at exampleTarget); each
// test starts its own.
func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "vr-go-examples-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	et := &exampleT{dir: dir}
	s := startService(et)
	exampleTarget = s.Addr
	code := m.Run()
	et.stop()
	os.Exit(code)
}
