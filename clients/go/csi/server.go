// Package csi is a CSI controller endpoint for volume attachment on
// OpenStack, on volume-reconciler: a ControllerPublishVolume is one
// EnsureAttached call and a ControllerUnpublishVolume one EnsureDetached
// call, so the attach reaches Nova at most once however often the CO asks
// (a publish asked again after a lost answer joins the open operation) and
// a success is never stale after an unpublish. It serves the Identity
// service and the Controller service's publish and unpublish on a socket
// beside a CSI driver's own (cinder-csi's controller pod: the csi-attacher
// sidecar is pointed at this endpoint, the provisioner, snapshotter and
// resizer keep cinder-csi's); every other Controller RPC answers
// UNIMPLEMENTED. docs/kubernetes.md has the deployment and the codes.
package csi

import (
	"context"
	"log/slog"
	"time"

	csispec "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	vr "github.com/volume-reconciler/volume-reconciler/clients/go"
)

// DefaultDriverName is cinder-csi's: external-attacher acts only on the
// VolumeAttachments whose spec.attacher is the name GetPluginInfo answers,
// and cinder-csi's StorageClasses and PersistentVolumes name this one.
const DefaultDriverName = "cinder.csi.openstack.org"

// PublishContextDevice is the publish_context key of the device path, as
// cinder-csi answers it (its node plugin finds the device by volume id and
// does not need it; it is there for what reads the VolumeAttachment).
const PublishContextDevice = "DevicePath"

// healthService is the service name volume-reconciler reports in
// grpc.health.v1: NOT_SERVING from its SIGTERM on.
const healthService = "volume_reconciler.v1.VolumeReconciler"

// probeTimeout bounds Probe's health check when the CO's call has no
// deadline of its own.
const probeTimeout = 5 * time.Second

// Options configure a Server; the zero value is cinder-csi's driver name,
// no version, logs through slog.Default and no metrics.
type Options struct {
	// The name GetPluginInfo answers (DefaultDriverName when empty).
	DriverName string
	// The version GetPluginInfo answers.
	DriverVersion string
	// Where the endpoint logs (slog.Default when nil).
	Logger *slog.Logger
	// The endpoint's metrics (none when nil).
	Metrics *Metrics
}

// Server is the endpoint: register it on a grpc.Server (Register).
type Server struct {
	csispec.UnimplementedIdentityServer
	csispec.UnimplementedControllerServer
	client *vr.Client
	health healthpb.HealthClient
	opts   Options
}

// NewServer makes the endpoint on a connection to the service (conn
// carries the credentials; the caller closes it).
func NewServer(conn grpc.ClientConnInterface, opts Options) *Server {
	if opts.DriverName == "" {
		opts.DriverName = DefaultDriverName
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	return &Server{client: vr.New(conn), health: healthpb.NewHealthClient(conn), opts: opts}
}

// Register serves the Identity and Controller services on g. Make g with
// ServerOptions() to get the logs and metrics of every call.
func (s *Server) Register(g *grpc.Server) {
	csispec.RegisterIdentityServer(g, s)
	csispec.RegisterControllerServer(g, s)
}

// ServerOptions are the grpc.ServerOptions that log every call once and
// count it in the metrics.
func (s *Server) ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{grpc.ChainUnaryInterceptor(s.observe)}
}

// GetPluginInfo answers the configured driver name.
func (s *Server) GetPluginInfo(context.Context, *csispec.GetPluginInfoRequest) (*csispec.GetPluginInfoResponse, error) {
	return &csispec.GetPluginInfoResponse{Name: s.opts.DriverName, VendorVersion: s.opts.DriverVersion}, nil
}

// GetPluginCapabilities: the Controller service (this endpoint serves no
// Node service: the nodes keep cinder-csi's).
func (s *Server) GetPluginCapabilities(context.Context, *csispec.GetPluginCapabilitiesRequest) (*csispec.GetPluginCapabilitiesResponse, error) {
	return &csispec.GetPluginCapabilitiesResponse{Capabilities: []*csispec.PluginCapability{{
		Type: &csispec.PluginCapability_Service_{Service: &csispec.PluginCapability_Service{
			Type: csispec.PluginCapability_Service_CONTROLLER_SERVICE,
		}},
	}}}, nil
}

// Probe is ready when the service reports itself serving in
// grpc.health.v1 (not while it drains); a service that cannot be asked is
// FAILED_PRECONDITION naming why (CSI's code for a missing dependency).
func (s *Server) Probe(ctx context.Context, _ *csispec.ProbeRequest) (*csispec.ProbeResponse, error) {
	if _, has := ctx.Deadline(); !has {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, probeTimeout)
		defer cancel()
	}
	r, err := s.health.Check(ctx, &healthpb.HealthCheckRequest{Service: healthService})
	if err != nil {
		s.opts.Metrics.probed(false)
		return nil, status.Errorf(codes.FailedPrecondition, "volume-reconciler's health (grpc.health.v1 %s): %v", healthService, err)
	}
	ready := r.GetStatus() == healthpb.HealthCheckResponse_SERVING
	s.opts.Metrics.probed(ready)
	return &csispec.ProbeResponse{Ready: wrapperspb.Bool(ready)}, nil
}

// ControllerGetCapabilities: publish and unpublish only (no readonly
// publish: Nova attaches read-write; no list of published nodes).
func (s *Server) ControllerGetCapabilities(context.Context, *csispec.ControllerGetCapabilitiesRequest) (*csispec.ControllerGetCapabilitiesResponse, error) {
	return &csispec.ControllerGetCapabilitiesResponse{Capabilities: []*csispec.ControllerServiceCapability{{
		Type: &csispec.ControllerServiceCapability_Rpc{Rpc: &csispec.ControllerServiceCapability_RPC{
			Type: csispec.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME,
		}},
	}}}, nil
}
