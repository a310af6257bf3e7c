package volumereconciler_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	vr "github.com/volume-reconciler/volume-reconciler/clients/go"
)

// exampleTarget is where the examples' service listens; TestMain starts
// one there when the examples run (examples_main_test.go).
var exampleTarget = "127.0.0.1:50051"

// The first attach: a key from the intent, the caller's deadline as the
// only bound, the decided operation back.
func ExampleClient_Attach() {
	c, err := vr.NewClient(exampleTarget, vr.Insecure())
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	server, volume := "7ebed2ce-85b3-40b5-84ae-8cc725c37ed2", "a07f71dc-8151-4e7d-a0cc-cd24a3f11113"
	op, err := c.Attach(ctx, vr.AttachRequest{Key: vr.KeyFor("example", server, volume), ServerID: server, VolumeID: volume})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(op.GetState(), op.GetResolution())
	// Output: STATE_SUCCEEDED RESOLUTION_RESPONSE
}

// A refusal read as a value: the reason and every key the service sent.
func ExampleError() {
	c, err := vr.NewClient(exampleTarget, vr.Insecure())
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	// An id that is not a UUID.
	_, err = c.Detach(ctx, vr.DetachRequest{Key: "example-bad", ServerID: "not-a-uuid", VolumeID: "a07f71dc-8151-4e7d-a0cc-cd24a3f11113"})
	var e *vr.Error
	if errors.As(err, &e) {
		fmt.Println(e.Code, e.Reason, e.Metadata["field"])
	}
	// Output: InvalidArgument INVALID_FIELD server_id
}

// Following an operation by its id until it is decided (here one that is
// already decided: Wait answers at once).
func ExampleClient_Wait() {
	c, err := vr.NewClient(exampleTarget, vr.Insecure())
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	server, volume := "0b4d6c1e-2f6a-4c3e-9d51-6a1f0e2b7c90", "5e0c3f2a-8b7d-4e61-a9c4-2d3b1f0a6e57"
	op, err := c.Attach(ctx, vr.AttachRequest{Key: vr.KeyFor("wait", server, volume), ServerID: server, VolumeID: volume})
	if err != nil {
		log.Fatal(err)
	}
	done, err := c.Wait(ctx, op.GetId())
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(done.GetId() == op.GetId(), done.GetState())
	// Output: true STATE_SUCCEEDED
}

// A key from the parts of an intent: stable, and different when any part
// (or where the parts are cut) differs.
func ExampleKeyFor() {
	fmt.Println(vr.KeyFor("publish", "vol-1", "node-a", "1"))
	fmt.Println(vr.KeyFor("publish", "vol-1", "node-a", "1") == vr.KeyFor("publish", "vol-1", "node-a1"))
	// Output:
	// vr1-d7f4161e95732f594a2f72338317ceea
	// false
}

// "Make it so": the volume attached to the server however often it is
// asked, with no key. The second call finds it attached and answers a new
// operation that sent nothing.
func ExampleClient_EnsureAttached() {
	c, err := vr.NewClient(exampleTarget, vr.Insecure())
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	req := vr.EnsureRequest{ServerID: "3f1c2b9a-6d4e-4f7a-9b2c-1e0d5a7c8b61", VolumeID: "c2a9e8f1-4b3d-4e6a-8f7c-5d1b0a9e2c34"}
	first, err := c.EnsureAttached(ctx, req)
	if err != nil {
		log.Fatal(err)
	}
	again, err := c.EnsureAttached(ctx, req)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(first.GetState(), again.GetState(), again.GetAttempts())
	// Output: STATE_SUCCEEDED STATE_SUCCEEDED 0
}

// Whether asking again may be answered differently, from the code and the
// reason (never the message).
func ExampleIsRetryable() {
	busy := status.New(codes.Aborted, "volume busy")
	busy, _ = busy.WithDetails(&errdetails.ErrorInfo{Reason: vr.ReasonVolumeBusy, Domain: vr.Domain})
	refused := status.New(codes.FailedPrecondition, "attached elsewhere")
	refused, _ = refused.WithDetails(&errdetails.ErrorInfo{Reason: vr.ReasonAlreadyAttachedElsewhere, Domain: vr.Domain})
	fmt.Println(vr.IsRetryable(busy.Err()), vr.IsRetryable(refused.Err()))
	// Output: true false
}
