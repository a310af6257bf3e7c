package csi

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"strings"
)

// Listen listens on endpoint, a unix socket as CSI names it
// ("unix:///csi/csi.sock", "unix:/csi/csi.sock" or a plain path): a socket
// file left by an earlier run is removed first (the pod's shared emptyDir
// outlives a container's restart). Anything but a socket at that path is
// an error, never removed.
func Listen(endpoint string) (net.Listener, error) {
	p := SocketPath(endpoint)
	if p == "" {
		return nil, fmt.Errorf("CSI endpoint %q: want unix:///path/to/csi.sock", endpoint)
	}
	if fi, err := os.Lstat(p); err == nil {
		if fi.Mode().Type() != fs.ModeSocket {
			return nil, fmt.Errorf("CSI endpoint %s: exists and is not a socket", p)
		}
		if err := os.Remove(p); err != nil {
			return nil, fmt.Errorf("CSI endpoint %s: removing the stale socket: %w", p, err)
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("CSI endpoint %s: %w", p, err)
	}
	l, err := net.Listen("unix", p)
	if err != nil {
		return nil, fmt.Errorf("CSI endpoint %s: %w", p, err)
	}
	return l, nil
}

// SocketPath is the path of a unix endpoint ("" for any other scheme).
func SocketPath(endpoint string) string {
	switch {
	case strings.HasPrefix(endpoint, "unix://"):
		return strings.TrimPrefix(endpoint, "unix://")
	case strings.HasPrefix(endpoint, "unix:"):
		return strings.TrimPrefix(endpoint, "unix:")
	case strings.Contains(endpoint, "://"):
		return ""
	}
	return endpoint
}
