package testservice

import (
	"os/exec"
	"syscall"
)

// dieWithTheTest makes the kernel end cmd when the test process ends,
// however it ends (a panic, a timeout's kill, os.Exit), so that no service
// outlives its test.
func dieWithTheTest(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
