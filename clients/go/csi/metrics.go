package csi

import (
	"context"
	"errors"
	"log/slog"
	"path"
	"strings"
	"time"

	csispec "github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	vr "github.com/volume-reconciler/volume-reconciler/clients/go"
)

// Metrics are the endpoint's families, named as the CSI sidecars name
// theirs (csi_sidecar_operations_seconds) with this endpoint's prefix.
type Metrics struct {
	// Every CSI call by method and the code answered, as a histogram of
	// its duration.
	operations *prometheus.HistogramVec
	// Every answer of the service that was not an operation, by CSI
	// method and the service's reason ("" for the transport's).
	serviceErrors *prometheus.CounterVec
	// 1 when the last Probe found the service serving.
	ready prometheus.Gauge
}

// NewMetrics registers the endpoint's families on reg for driver.
func NewMetrics(reg prometheus.Registerer, driver string) *Metrics {
	labels := prometheus.Labels{"driver_name": driver}
	m := &Metrics{
		operations: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:        "volume_reconciler_csi_operations_seconds",
			Help:        "CSI calls served, by method and the gRPC code answered (csi_sidecar_operations_seconds' labels).",
			Buckets:     []float64{0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 25, 50, 120, 300, 600},
			ConstLabels: labels,
		}, []string{"method_name", "grpc_status_code"}),
		serviceErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name:        "volume_reconciler_csi_service_errors_total",
			Help:        "Answers of volume-reconciler that were not an operation, by CSI method and the service's reason (empty: the transport's).",
			ConstLabels: labels,
		}, []string{"method_name", "reason"}),
		ready: prometheus.NewGauge(prometheus.GaugeOpts{
			Name:        "volume_reconciler_csi_service_ready",
			Help:        "1 when the last Probe found volume-reconciler serving (grpc.health.v1).",
			ConstLabels: labels,
		}),
	}
	reg.MustRegister(m.operations, m.serviceErrors, m.ready)
	return m
}

func (m *Metrics) probed(ready bool) {
	if m == nil {
		return
	}
	v := 0.0
	if ready {
		v = 1
	}
	m.ready.Set(v)
}

// observe logs every call once (info for an answer, warn for a code that
// needs an operator's look) and counts it: the method, the volume and
// node, the code, and the service's reason and operation id when it sent
// them.
func (s *Server) observe(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	started := time.Now()
	resp, err := handler(ctx, req)
	took := time.Since(started)
	method := path.Base(info.FullMethod)
	code := status.Code(err)
	if m := s.opts.Metrics; m != nil {
		m.operations.WithLabelValues(method, code.String()).Observe(took.Seconds())
	}
	if strings.HasPrefix(info.FullMethod, "/csi.v1.Identity/") && err == nil {
		// Probes come every few seconds: not worth a line each.
		return resp, err
	}
	attrs := []any{"method", method, "code", code.String(), "duration_ms", took.Milliseconds()}
	if r, ok := req.(interface{ GetVolumeId() string }); ok && r.GetVolumeId() != "" {
		attrs = append(attrs, "volume_id", r.GetVolumeId())
	}
	if r, ok := req.(interface{ GetNodeId() string }); ok && r.GetNodeId() != "" {
		attrs = append(attrs, "node_id", r.GetNodeId())
	}
	if r, ok := resp.(*csispec.ControllerPublishVolumeResponse); ok {
		attrs = append(attrs, "device", r.GetPublishContext()[PublishContextDevice])
	}
	level := slog.LevelInfo
	if err != nil {
		attrs = append(attrs, "error", status.Convert(err).Message())
		if serious(code.String()) {
			level = slog.LevelWarn
		}
	}
	s.opts.Logger.Log(ctx, level, "csi call", attrs...)
	return resp, err
}

// serious is a code that will not clear by retrying: an operator looks.
func serious(code string) bool {
	switch code {
	case "FailedPrecondition", "Internal", "InvalidArgument", "Unimplemented":
		return true
	}
	return false
}

// serviceError counts an answer of the service that was not an operation.
func (s *Server) serviceError(method string, err error) {
	if s.opts.Metrics == nil {
		return
	}
	reason := ""
	var e *vr.Error
	if errors.As(err, &e) {
		reason = e.Reason
	}
	s.opts.Metrics.serviceErrors.WithLabelValues(method, reason).Inc()
}
