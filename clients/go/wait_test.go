package volumereconciler_test

import (
	"context"
	"errors"
	"reflect"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	vr "github.com/volume-reconciler/volume-reconciler/clients/go"
)

// An attach to a server Nova does not have fails NOT_FOUND: Wait on that
// operation answers the same error as the attach did (code, reason,
// message, every metadata key), not a FAILED_PRECONDITION of its own.
func TestWaitAnswersAFailedOperationExactlyAsTheAttachDid(t *testing.T) {
	t.Parallel()
	s := startService(t)
	c, _ := s.client()
	server, volume := newUUID(t), newUUID(t)
	s.simDelete("/sim/servers/" + server)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	_, err := c.Attach(ctx, vr.AttachRequest{Key: vr.KeyFor("wait-map", server, volume), ServerID: server, VolumeID: volume})
	var attach *vr.Error
	if !errors.As(err, &attach) || attach.Code != codes.NotFound || attach.OperationID() == "" {
		t.Fatalf("the attach: %v, want NOT_FOUND naming its operation", err)
	}
	op, err := c.Wait(ctx, attach.OperationID())
	var waited *vr.Error
	if !errors.As(err, &waited) {
		t.Fatalf("Wait: %T %v", err, err)
	}
	if op.GetId() != attach.OperationID() {
		t.Fatalf("Wait returned operation %s, want %s", op.GetId(), attach.OperationID())
	}
	if waited.Code != attach.Code || status.Code(err) != attach.Code || waited.Reason != attach.Reason ||
		waited.Message != attach.Message || waited.Domain != attach.Domain {
		t.Fatalf("Wait: %v\nthe attach: %v", waited, attach)
	}
	if !reflect.DeepEqual(waited.Metadata, attach.Metadata) {
		t.Fatalf("metadata: Wait %v, the attach %v", waited.Metadata, attach.Metadata)
	}
	if n := s.truth().AttachEffects[volume]; n != 0 {
		t.Fatalf("Nova attached it %d times", n)
	}
}
