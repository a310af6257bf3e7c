package csi

import (
	"context"

	csispec "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	vr "github.com/volume-reconciler/volume-reconciler/clients/go"
)

// ControllerPublishVolume attaches the volume (volume_id: the Cinder
// volume) to the node (node_id: the Nova server, as cinder-csi's
// NodeGetInfo gives it) with one EnsureAttached call, bounded by the CO's
// deadline (external-attacher's --timeout). The call's identity is the
// volume and the node: a publish asked again joins the open operation,
// one asked after an unpublish looks at the server again. The answer's
// publish_context has the device (DevicePath, as cinder-csi's).
func (s *Server) ControllerPublishVolume(ctx context.Context, req *csispec.ControllerPublishVolumeRequest) (*csispec.ControllerPublishVolumeResponse, error) {
	if err := validatePublish(req); err != nil {
		return nil, err
	}
	op, err := s.client.EnsureAttached(ctx, vr.EnsureRequest{ServerID: req.GetNodeId(), VolumeID: req.GetVolumeId()})
	if err != nil {
		s.serviceError("ControllerPublishVolume", err)
		return nil, toCSI(true, err)
	}
	return &csispec.ControllerPublishVolumeResponse{
		PublishContext: map[string]string{PublishContextDevice: op.GetAttachment().GetDevice()},
	}, nil
}

// ControllerUnpublishVolume detaches the volume from the node with one
// EnsureDetached call. A volume not attached there, a server or a volume
// that no longer exists: done (OK), as CSI and external-attacher expect.
func (s *Server) ControllerUnpublishVolume(ctx context.Context, req *csispec.ControllerUnpublishVolumeRequest) (*csispec.ControllerUnpublishVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	if req.GetNodeId() == "" {
		// CSI lets a CO unpublish from every node at once; Nova detaches
		// from one server, and this endpoint does not look for them all.
		return nil, status.Error(codes.InvalidArgument, "node_id is required: this endpoint unpublishes from one node (the Nova server) at a time")
	}
	if _, err := s.client.EnsureDetached(ctx, vr.EnsureRequest{ServerID: req.GetNodeId(), VolumeID: req.GetVolumeId()}); err != nil {
		s.serviceError("ControllerUnpublishVolume", err)
		if err := toCSI(false, err); err != nil {
			return nil, err
		}
	}
	return &csispec.ControllerUnpublishVolumeResponse{}, nil
}

// validatePublish checks what CSI requires of a publish before anything
// is asked: the ids, a capability with an access type and a mode, and no
// readonly publish (not offered: PUBLISH_READONLY is not a capability of
// this endpoint, so a CO must not ask for it).
func validatePublish(req *csispec.ControllerPublishVolumeRequest) error {
	switch {
	case req.GetVolumeId() == "":
		return status.Error(codes.InvalidArgument, "volume_id is required")
	case req.GetNodeId() == "":
		return status.Error(codes.InvalidArgument, "node_id is required")
	case req.GetVolumeCapability() == nil:
		return status.Error(codes.InvalidArgument, "volume_capability is required")
	case req.GetVolumeCapability().GetAccessMode().GetMode() == csispec.VolumeCapability_AccessMode_UNKNOWN:
		return status.Error(codes.InvalidArgument, "volume_capability.access_mode is required")
	case req.GetVolumeCapability().GetBlock() == nil && req.GetVolumeCapability().GetMount() == nil:
		return status.Error(codes.InvalidArgument, "volume_capability.access_type (block or mount) is required")
	case req.GetReadonly():
		return status.Error(codes.InvalidArgument, "readonly: a readonly publish is not supported (Nova attaches read-write; PUBLISH_READONLY is not a capability of this endpoint)")
	}
	return nil
}
