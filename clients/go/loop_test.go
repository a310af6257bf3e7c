package volumereconciler_test

// The caller's loop, as level-triggered callers run it (a CSI controller's
// publish, a controller that re-reads the server), through the Go client
// against the real service: the operation kept at the deadline, a refusal
// that does not stick to a key, no stale success after a detach, and many
// callers of one identity joining one operation.

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	vr "github.com/volume-reconciler/volume-reconciler/clients/go"
	reconcilerv1 "github.com/volume-reconciler/volume-reconciler/clients/go/volume_reconciler/v1"
)

// Nova holds the attach's answer past the caller's deadline and its list
// of attachments fails: at a 3 s, 10 s and 30 s deadline the caller gets
// an undecided answer naming the operation (never BUDGET_TOO_SMALL, never a
// bare DEADLINE_EXCEEDED); a replay of the key with 300 ms answers the
// same operation; once Nova's list answers again, Wait returns the
// reconciler's decision. One POST, one effect.
func TestAnUnknownOutcomeAtTheDeadlineNamesTheOperationAndWaitReturnsTheDecision(t *testing.T) {
	t.Parallel()
	for _, deadline := range []time.Duration{3 * time.Second, 10 * time.Second, 30 * time.Second} {
		t.Run(deadline.String(), func(t *testing.T) {
			t.Parallel()
			s := startService(t, "--reconcile-interval", "200ms")
			c, _ := s.client()
			server, volume := newUUID(t), newUUID(t)
			s.fault("attach", volume, map[string]any{"kind": "delay_after_effect", "ms": (deadline + 20*time.Second).Milliseconds()})
			s.simPost("/sim/faults", map[string]any{"op": "list", "server_id": server, "fault": map[string]any{"kind": "status", "code": 500, "effect": false}})

			key := vr.KeyFor("loop-unknown", server, volume)
			req := vr.AttachRequest{Key: key, ServerID: server, VolumeID: volume}
			ctx, cancel := context.WithTimeout(context.Background(), deadline)
			_, err := c.Attach(ctx, req)
			cancel()
			var e *vr.Error
			// OUTCOME_UNKNOWN, or OPERATION_IN_PROGRESS when the run had not
			// recorded its unknown outcome by the caller's deadline (a ledger
			// slowed by a loaded machine): either names the operation.
			if !errors.As(err, &e) || !e.Undecided() {
				t.Fatalf("at %s: %v, want OUTCOME_UNKNOWN or OPERATION_IN_PROGRESS naming the operation", deadline, err)
			}
			short, cancelShort := context.WithTimeout(context.Background(), 300*time.Millisecond)
			_, err = c.Attach(short, req)
			cancelShort()
			var replayed *vr.Error
			if !errors.As(err, &replayed) || replayed.OperationID() != e.OperationID() || replayed.Reason == vr.ReasonBudgetTooSmall {
				t.Fatalf("a 300 ms replay of the open key: %v, want operation %s", err, e.OperationID())
			}

			s.clearFaults()
			wait, cancelWait := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancelWait()
			op, err := c.Wait(wait, e.OperationID())
			if err != nil || op.GetState() != reconcilerv1.State_STATE_SUCCEEDED {
				t.Fatalf("Wait: %v %v", op, err)
			}
			tr := s.truth()
			if tr.AttachRequests[volume] != 1 || tr.AttachEffects[volume] != 1 {
				t.Fatalf("Nova saw %d requests, %d effects; want 1, 1", tr.AttachRequests[volume], tr.AttachEffects[volume])
			}
		})
	}
}

// clearFaults removes every fault rule of the simulator.
func (s *service) clearFaults() {
	s.t.Helper()
	req, err := http.NewRequest(http.MethodDelete, s.SimURL+"/sim/faults", nil)
	if err != nil {
		s.t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		s.t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		s.t.Fatalf("DELETE /sim/faults: %s", resp.Status)
	}
}

// Nova answers 409 (the server locked) for longer than the call's
// deadline, then is healthy: the caller's next call attaches, whether it
// is keyed with the documented recipe (the same key) or "make it so". One
// effect each; the refusal did not stick.
func TestABusyNovaPastTheDeadlineDoesNotStickToTheNextCall(t *testing.T) {
	t.Parallel()
	s := startService(t)
	c, _ := s.client()
	server := newUUID(t)
	keyed, ensured := newUUID(t), newUUID(t)
	s.simPost("/sim/servers/"+server+"/lock", map[string]any{})
	key := vr.KeyFor("publish", keyed, server, "1")

	short, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	_, errKeyed := c.Attach(short, vr.AttachRequest{Key: key, ServerID: server, VolumeID: keyed})
	_, errEnsured := c.EnsureAttached(short, vr.EnsureRequest{ServerID: server, VolumeID: ensured})
	cancel()
	if errKeyed == nil || errEnsured == nil {
		t.Fatalf("a locked server attached: %v, %v", errKeyed, errEnsured)
	}
	s.simDelete("/sim/servers/" + server + "/lock")

	ctx, cancelLong := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancelLong()
	if op, err := c.Attach(ctx, vr.AttachRequest{Key: key, ServerID: server, VolumeID: keyed}); err != nil || op.GetState() != reconcilerv1.State_STATE_SUCCEEDED {
		t.Fatalf("the keyed call again after the refusal (first: %v): %v %v", errKeyed, op, err)
	}
	if op, err := c.EnsureAttached(ctx, vr.EnsureRequest{ServerID: server, VolumeID: ensured}); err != nil || op.GetState() != reconcilerv1.State_STATE_SUCCEEDED {
		t.Fatalf("the ensure call again after the refusal (first: %v): %v %v", errEnsured, op, err)
	}
	tr := s.truth()
	for _, v := range []string{keyed, ensured} {
		if tr.AttachEffects[v] != 1 {
			t.Fatalf("volume %s: %d effects, want 1", v, tr.AttachEffects[v])
		}
	}
}

// Publish, unpublish, publish of the same (volume, node) with "make it so"
// calls: attached at the end, each attach its own operation with its own
// effect, no stale success.
func TestPublishUnpublishPublishWithEnsureCallsEndsAttached(t *testing.T) {
	t.Parallel()
	s := startService(t)
	c, _ := s.client()
	server, volume := newUUID(t), newUUID(t)
	req := vr.EnsureRequest{ServerID: server, VolumeID: volume}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	first, err := c.EnsureAttached(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.EnsureDetached(ctx, req); err != nil {
		t.Fatal(err)
	}
	if s.truth().Attached(server, volume) {
		t.Fatal("still attached after EnsureDetached")
	}
	second, err := c.EnsureAttached(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if second.GetId() == first.GetId() {
		t.Fatalf("the second publish answered the first's operation %s", first.GetId())
	}
	tr := s.truth()
	if !tr.Attached(server, volume) || tr.AttachEffects[volume] != 2 || tr.DetachEffects[volume] != 1 {
		t.Fatalf("attached %v; Nova: %d attaches, %d detaches took effect; want attached, 2, 1",
			tr.Attached(server, volume), tr.AttachEffects[volume], tr.DetachEffects[volume])
	}
	if !second.GetEnsure() || second.GetAttachment().GetDevice() == "" {
		t.Fatalf("the second operation: %v", second)
	}
}

// 100 goroutines, 50 volumes, two callers per volume with EnsureAttached
// (the same credentials), and one POST in five losing its response: every
// volume attached exactly once, both callers of a volume answered with the
// same operation.
func TestTwoCallersPerVolumeJoinOneOperationEachAttachedOnce(t *testing.T) {
	t.Parallel()
	s := startService(t, "--reconcile-interval", "200ms")
	c, _ := s.client()
	const volumes = 50
	servers, vols := make([]string, volumes), make([]string, volumes)
	for i := range vols {
		servers[i], vols[i] = newUUID(t), newUUID(t)
		if i%5 == 0 {
			s.fault("attach", vols[i], map[string]any{"kind": "close_after_effect"})
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	ids := make([][2]string, volumes)
	errs := make(chan error, 2*volumes)
	var wg sync.WaitGroup
	for i := range vols {
		for caller := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				op, err := c.EnsureAttached(ctx, vr.EnsureRequest{ServerID: servers[i], VolumeID: vols[i]})
				if err != nil {
					errs <- fmt.Errorf("volume %d, caller %d: %w", i, caller, err)
					return
				}
				ids[i][caller] = op.GetId()
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	tr := s.truth()
	for i := range vols {
		if ids[i][0] == "" || ids[i][0] != ids[i][1] {
			t.Errorf("volume %d: the callers were answered operations %q and %q", i, ids[i][0], ids[i][1])
		}
		if tr.AttachEffects[vols[i]] != 1 || tr.AttachRequests[vols[i]] != 1 || !tr.Attached(servers[i], vols[i]) {
			t.Errorf("volume %d: %d requests, %d effects, attached %v", i, tr.AttachRequests[vols[i]], tr.AttachEffects[vols[i]], tr.Attached(servers[i], vols[i]))
		}
	}
}
