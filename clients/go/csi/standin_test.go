package csi_test

// A stand-in of cinder-csi for the peers' tests: what a cluster gets from
// cinder-csi and not from this endpoint (CreateVolume and DeleteVolume from
// the simulator's Cinder, NodeGetInfo with a server of the simulator's
// Nova), with every call of the endpoint's (Identity, publish, unpublish)
// passed to the endpoint's socket as it came.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"

	csispec "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	vr "github.com/volume-reconciler/volume-reconciler/clients/go"
	"github.com/volume-reconciler/volume-reconciler/clients/go/csi"
	"github.com/volume-reconciler/volume-reconciler/clients/go/internal/testservice"
)

// sim is the simulator's HTTP APIs, with errors returned (callable from
// csi-sanity's specs, where a test's Fatal cannot run).
type sim struct{ url string }

func (s sim) do(method, path string, body any) ([]byte, error) {
	var r io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return nil, err
		}
		r = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, s.url+path, r)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", method, path, err)
	}
	if resp.StatusCode/100 != 2 {
		return b, fmt.Errorf("%s %s: %s %s", method, path, resp.Status, b)
	}
	return b, nil
}

// standIn is cinder-csi's part.
type standIn struct {
	csispec.UnimplementedControllerServer
	csispec.UnimplementedNodeServer
	csispec.UnimplementedIdentityServer
	sim      sim
	node     string // the Nova server NodeGetInfo answers
	maxDisks int64  // NodeGetInfo's max_volumes_per_node (0: none)
	identity csispec.IdentityClient
	ctl      csispec.ControllerClient
}

// serveStandIn serves the stand-in on its own socket, in front of the
// endpoint's socket; it answers the stand-in's socket.
func serveStandIn(t testingT, s *standIn, endpointSocket string) string {
	conn, err := grpc.NewClient("unix://"+endpointSocket, vr.Insecure())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() }) // nothing to report at the test's end
	s.identity, s.ctl = csispec.NewIdentityClient(conn), csispec.NewControllerClient(conn)
	g := grpc.NewServer()
	csispec.RegisterIdentityServer(g, s)
	csispec.RegisterControllerServer(g, s)
	csispec.RegisterNodeServer(g, s)
	dir, err := os.MkdirTemp("", "standin-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) }) // a temporary directory
	socket := filepath.Join(dir, "csi.sock")
	l, err := csi.Listen("unix://" + socket)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		if err := g.Serve(l); err != nil {
			t.Errorf("stand-in: %v", err)
		}
	}()
	t.Cleanup(g.Stop)
	return socket
}

type testingT interface {
	Fatal(...any)
	Errorf(string, ...any)
	Cleanup(func())
}

// Identity: the endpoint's, as it answers.
func (s *standIn) GetPluginInfo(ctx context.Context, r *csispec.GetPluginInfoRequest) (*csispec.GetPluginInfoResponse, error) {
	return s.identity.GetPluginInfo(ctx, r)
}
func (s *standIn) GetPluginCapabilities(ctx context.Context, r *csispec.GetPluginCapabilitiesRequest) (*csispec.GetPluginCapabilitiesResponse, error) {
	return s.identity.GetPluginCapabilities(ctx, r)
}
func (s *standIn) Probe(ctx context.Context, r *csispec.ProbeRequest) (*csispec.ProbeResponse, error) {
	return s.identity.Probe(ctx, r)
}

// The endpoint's controller calls, as it answers them; its capabilities
// with cinder-csi's CREATE_DELETE_VOLUME added (the stand-in's).
func (s *standIn) ControllerPublishVolume(ctx context.Context, r *csispec.ControllerPublishVolumeRequest) (*csispec.ControllerPublishVolumeResponse, error) {
	return s.ctl.ControllerPublishVolume(ctx, r)
}
func (s *standIn) ControllerUnpublishVolume(ctx context.Context, r *csispec.ControllerUnpublishVolumeRequest) (*csispec.ControllerUnpublishVolumeResponse, error) {
	return s.ctl.ControllerUnpublishVolume(ctx, r)
}
func (s *standIn) ControllerGetCapabilities(ctx context.Context, r *csispec.ControllerGetCapabilitiesRequest) (*csispec.ControllerGetCapabilitiesResponse, error) {
	caps, err := s.ctl.ControllerGetCapabilities(ctx, r)
	if err != nil {
		return nil, err
	}
	caps.Capabilities = append(caps.Capabilities, &csispec.ControllerServiceCapability{
		Type: &csispec.ControllerServiceCapability_Rpc{Rpc: &csispec.ControllerServiceCapability_RPC{
			Type: csispec.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		}},
	})
	return caps, nil
}

// CreateVolume creates the volume in the simulator's Cinder.
func (s *standIn) CreateVolume(_ context.Context, r *csispec.CreateVolumeRequest) (*csispec.CreateVolumeResponse, error) {
	if r.GetName() == "" || len(r.GetVolumeCapabilities()) == 0 {
		return nil, status.Error(codes.InvalidArgument, "name and volume_capabilities are required")
	}
	gib := max((r.GetCapacityRange().GetRequiredBytes()+1<<30-1)>>30, 1)
	b, err := s.sim.do(http.MethodPost, "/v3/"+testservice.SimProject+"/volumes",
		map[string]any{"volume": map[string]any{"size": gib, "name": r.GetName()}})
	if err != nil {
		return nil, status.Errorf(codes.Internal, "Cinder: %v", err)
	}
	var created struct {
		Volume struct {
			ID string `json:"id"`
		} `json:"volume"`
	}
	if err := json.Unmarshal(b, &created); err != nil || created.Volume.ID == "" {
		return nil, status.Errorf(codes.Internal, "Cinder's answer %s: %v", b, err)
	}
	return &csispec.CreateVolumeResponse{Volume: &csispec.Volume{VolumeId: created.Volume.ID, CapacityBytes: gib << 30}}, nil
}

// DeleteVolume deletes it there; one that is gone is deleted.
func (s *standIn) DeleteVolume(_ context.Context, r *csispec.DeleteVolumeRequest) (*csispec.DeleteVolumeResponse, error) {
	if r.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	if b, err := s.sim.do(http.MethodDelete, "/v3/"+testservice.SimProject+"/volumes/"+r.GetVolumeId(), nil); err != nil && !bytes.Contains(b, []byte("could not be found")) {
		return nil, status.Errorf(codes.Internal, "Cinder: %v", err)
	}
	return &csispec.DeleteVolumeResponse{}, nil
}

// The node: a server of the simulator's Nova.
func (s *standIn) NodeGetInfo(context.Context, *csispec.NodeGetInfoRequest) (*csispec.NodeGetInfoResponse, error) {
	return &csispec.NodeGetInfoResponse{NodeId: s.node, MaxVolumesPerNode: s.maxDisks}, nil
}
func (s *standIn) NodeGetCapabilities(context.Context, *csispec.NodeGetCapabilitiesRequest) (*csispec.NodeGetCapabilitiesResponse, error) {
	return &csispec.NodeGetCapabilitiesResponse{}, nil
}
func (s *standIn) NodeUnpublishVolume(context.Context, *csispec.NodeUnpublishVolumeRequest) (*csispec.NodeUnpublishVolumeResponse, error) {
	return &csispec.NodeUnpublishVolumeResponse{}, nil
}
