//go:build !linux

package testservice

import "os/exec"

// dieWithTheTest: only Linux can tie a child's life to its parent's; on
// other systems a test that dies leaves its services to the test's own
// cleanup.
func dieWithTheTest(*exec.Cmd) {}
