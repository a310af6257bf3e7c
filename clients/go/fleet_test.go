package volumereconciler_test

// Operating a fleet through the Go client, against the real binary:
// labels asked with an attach, a list by label and by creation time, a
// cancel before anything was sent (and one too late), and a bulk resolve
// whose dry run touches nothing.

import (
	"context"
	"errors"
	"testing"
	"time"

	vr "github.com/volume-reconciler/volume-reconciler/clients/go"
	reconcilerv1 "github.com/volume-reconciler/volume-reconciler/clients/go/volume_reconciler/v1"
)

func TestLabelsAreKeptAndListedByLabelAndCreationTime(t *testing.T) {
	t.Parallel()
	s := startService(t)
	c, _ := s.client()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	before := time.Now().Add(-time.Second)
	east := map[string]string{"cluster": "east", "csi.k8s.io/pv": "pv-1"}
	server, volume := newUUID(t), newUUID(t)
	op, err := c.Attach(ctx, vr.AttachRequest{Key: "g1", ServerID: server, VolumeID: volume, Labels: east})
	wantDecided(t, op, err, reconcilerv1.Resolution_RESOLUTION_RESPONSE)
	if op.GetLabels()["csi.k8s.io/pv"] != "pv-1" {
		t.Fatalf("labels %v", op.GetLabels())
	}
	other, err := c.Attach(ctx, vr.AttachRequest{Key: "g2", ServerID: newUUID(t), VolumeID: newUUID(t), Labels: map[string]string{"cluster": "west"}})
	wantDecided(t, other, err, reconcilerv1.Resolution_RESOLUTION_RESPONSE)

	got, next, err := c.List(ctx, vr.Filter{Labels: map[string]string{"cluster": "east"}}, 0, "")
	if err != nil || next != "" || len(got) != 1 || got[0].GetId() != op.GetId() {
		t.Fatalf("by label: %v %q %v", got, next, err)
	}
	got, _, err = c.List(ctx, vr.Filter{CreatedAfter: before, CreatedBefore: time.Now().Add(time.Second)}, 1, "")
	if err != nil || len(got) != 1 || got[0].GetId() != other.GetId() {
		t.Fatalf("by creation time, newest first, a page of one: %v %v", got, err)
	}
	// "Make it so" calls carry labels too.
	north := map[string]string{"cluster": "north"}
	ensured, err := c.EnsureAttached(ctx, vr.EnsureRequest{ServerID: server, VolumeID: newUUID(t), Labels: north})
	wantDecided(t, ensured, err, reconcilerv1.Resolution_RESOLUTION_RESPONSE)
	undone, err := c.EnsureDetached(ctx, vr.EnsureRequest{ServerID: server, VolumeID: ensured.GetVolumeId(), Labels: north})
	if err != nil || undone.GetState() != reconcilerv1.State_STATE_SUCCEEDED || undone.GetLabels()["cluster"] != "north" {
		t.Fatalf("EnsureDetached with labels: %v %v", undone, err)
	}
	got, _, err = c.List(ctx, vr.Filter{Labels: north}, 0, "")
	if err != nil || len(got) != 2 || got[0].GetId() != undone.GetId() || got[1].GetId() != ensured.GetId() {
		t.Fatalf("the Ensure calls by their label: %v %v", got, err)
	}
	// The same key with other labels is another request.
	_, err = c.Attach(ctx, vr.AttachRequest{Key: "g1", ServerID: server, VolumeID: volume, Labels: map[string]string{"cluster": "west"}})
	var e *vr.Error
	if !errors.As(err, &e) || e.Reason != vr.ReasonIdempotencyKeyReused {
		t.Fatalf("other labels under the same key: %v", err)
	}
	if n := s.truth().AttachRequests[volume]; n != 1 {
		t.Fatalf("Nova saw %d attaches of the labelled volume, want 1", n)
	}
}

func TestACancelBeforeAnythingWasSentAndOneTooLate(t *testing.T) {
	t.Parallel()
	s := startService(t)
	c, _ := s.client()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// Cinder shows the volume being created: the attach waits, nothing sent.
	server, volume := newUUID(t), newUUID(t)
	s.simPost("/sim/cinder/volumes/"+volume+"/status", map[string]any{"status": "creating"})
	attached := make(chan error, 1)
	go func() {
		_, err := c.Attach(ctx, vr.AttachRequest{Key: "p1", ServerID: server, VolumeID: volume})
		attached <- err
	}()
	var id string
	eventually(t, 30*time.Second, "the attach waits for its volume", func() bool {
		ops, _, err := c.List(ctx, vr.Filter{State: reconcilerv1.State_STATE_PENDING, VolumeID: volume}, 0, "")
		if err == nil && len(ops) == 1 {
			id = ops[0].GetId()
		}
		return id != ""
	})
	op, err := c.Cancel(ctx, id, "the pod went away")
	if err != nil || op.GetResolution() != reconcilerv1.Resolution_RESOLUTION_CANCELLED {
		t.Fatalf("cancel: %v %v", op, err)
	}
	s.simPost("/sim/cinder/volumes/"+volume+"/status", map[string]any{"status": nil})
	var e *vr.Error
	if err := <-attached; !errors.As(err, &e) || e.Reason != vr.ReasonCancelled || e.OperationID() != id {
		t.Fatalf("the attach's caller: %v", err)
	}
	if n := s.truth().AttachRequests[volume]; n != 0 {
		t.Fatalf("Nova saw %d attaches of a cancelled operation", n)
	}
	// Again: decided already.
	if _, err := c.Cancel(ctx, id, ""); !errors.As(err, &e) || e.Reason != vr.ReasonOperationAlreadyDecided {
		t.Fatalf("a second cancel: %v", err)
	}
	// A request that may be leaving: too late, and it goes on.
	server, volume = newUUID(t), newUUID(t)
	s.fault("attach", volume, map[string]any{"kind": "delay_after_effect", "ms": 2000})
	go func() {
		_, err := c.Attach(ctx, vr.AttachRequest{Key: "p2", ServerID: server, VolumeID: volume})
		attached <- err
	}()
	eventually(t, 30*time.Second, "its request reached Nova", func() bool {
		return s.truth().AttachRequests[volume] == 1
	})
	ops, _, err := c.List(ctx, vr.Filter{VolumeID: volume}, 0, "")
	if err != nil || len(ops) != 1 {
		t.Fatalf("%v %v", ops, err)
	}
	_, err = c.Cancel(ctx, ops[0].GetId(), "")
	if !errors.As(err, &e) || e.Reason != vr.ReasonCancelTooLate || e.OperationID() != ops[0].GetId() {
		t.Fatalf("a cancel too late: %v", err)
	}
	if err := <-attached; err != nil {
		t.Fatalf("the attach went on: %v", err)
	}
}

func TestABulkResolvesDryRunTouchesNothing(t *testing.T) {
	t.Parallel()
	s := startService(t)
	c, _ := s.client()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// An attach left open: Nova holds its answer, the caller's deadline
	// passes (OUTCOME_UNKNOWN), the reconciler is not asked.
	server, volume := newUUID(t), newUUID(t)
	s.fault("attach", volume, map[string]any{"kind": "delay_before_effect", "ms": 60000})
	short, stop := context.WithTimeout(ctx, 2*time.Second)
	if _, err := c.Attach(short, vr.AttachRequest{Key: "b1", ServerID: server, VolumeID: volume, Labels: map[string]string{"batch": "a"}}); err == nil {
		t.Fatal("decided before Nova answered")
	}
	stop()
	f := vr.Filter{Labels: map[string]string{"batch": "a"}}
	open, _, err := c.List(ctx, f, 0, "")
	if err != nil || len(open) != 1 || Terminal(open[0]) {
		t.Fatalf("an open operation: %v %v", open, err)
	}
	dry, err := c.ResolveMatching(ctx, f, reconcilerv1.State_STATE_FAILED, "rebuilt", vr.Bulk{DryRun: true})
	if err != nil || len(dry.GetItems()) != 1 || dry.GetItems()[0].GetOperationId() != open[0].GetId() {
		t.Fatalf("dry run: %v %v", dry, err)
	}
	ops, _, err := c.List(ctx, f, 0, "")
	if err != nil || len(ops) != 1 || Terminal(ops[0]) {
		t.Fatalf("the dry run touched it: %v %v", ops, err)
	}
}

// Terminal is vr.Terminal (kept short in the assertions above).
func Terminal(op *reconcilerv1.Operation) bool { return vr.Terminal(op) }
