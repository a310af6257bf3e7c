// Command orchestrator is what a CSI controller's ControllerPublishVolume
// and ControllerUnpublishVolume would do with volume-reconciler: attach the
// volume to the node's server with a key from the recipe, follow the
// operation until it is decided, and detach it the same way.
//
//	go run ./examples/orchestrator -server 127.0.0.1:50051 \
//	    -volume VOLUME_UUID -node SERVER_UUID -generation 1
//
// CSI's requests carry no request id, so the key is made from what names
// the intent: the volume handle, the node id and a generation. The
// generation is what makes a publish after an unpublish a new intent (a
// Kubernetes controller can use the VolumeAttachment's UID, which a new
// attachment object gets anew; or a counter it bumps when an unpublish
// completes). Without it, a second publish of the same volume to the same
// node would be a replay of the first and answer the first's operation.
// A caller that holds no such generation calls EnsureAttached and
// EnsureDetached instead, which need no key (the CSI endpoint, ./csi, does).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"time"

	"google.golang.org/grpc"

	vr "github.com/volume-reconciler/volume-reconciler/clients/go"
	reconcilerv1 "github.com/volume-reconciler/volume-reconciler/clients/go/volume_reconciler/v1"
)

// publish is ControllerPublishVolume: attach once per (volume, node,
// generation), however often the CO retries the call.
func publish(ctx context.Context, c *vr.Client, volume, node, generation string) (*reconcilerv1.Operation, error) {
	key := vr.KeyFor("publish", volume, node, generation)
	op, err := c.Attach(ctx, vr.AttachRequest{Key: key, ServerID: node, VolumeID: volume})
	var e *vr.Error
	if errors.As(err, &e) && e.Undecided() {
		// The caller's own deadline is near and the outcome is still being
		// decided: a CSI controller would return DEADLINE_EXCEEDED and be
		// called again (the same key joins the same operation); a program
		// with more time follows the operation to its decision.
		return c.Wait(ctx, e.OperationID())
	}
	return op, err
}

// unpublish is ControllerUnpublishVolume: detach once per (volume, node,
// generation). Detaching a volume that is not attached succeeds.
func unpublish(ctx context.Context, c *vr.Client, volume, node, generation string) (*reconcilerv1.Operation, error) {
	key := vr.KeyFor("unpublish", volume, node, generation)
	return c.Detach(ctx, vr.DetachRequest{Key: key, ServerID: node, VolumeID: volume})
}

func main() {
	server := flag.String("server", "127.0.0.1:50051", "the service's gRPC address")
	token := flag.String("token", os.Getenv("VOLUME_RECONCILER_TOKEN"), "bearer token (default $VOLUME_RECONCILER_TOKEN)")
	volume := flag.String("volume", "", "Cinder volume UUID (CSI's volume handle)")
	node := flag.String("node", "", "Nova server UUID (CSI's node id)")
	generation := flag.String("generation", "1", "what makes this publish a new intent (e.g. the VolumeAttachment's UID)")
	within := flag.Duration("within", time.Hour, "the whole run's deadline (the only bound of every call)")
	flag.Parse()
	if *volume == "" || *node == "" {
		log.Fatal("-volume and -node are required")
	}
	opts := []grpc.DialOption{vr.Insecure()}
	if *token != "" {
		opts = append(opts, vr.WithBearerToken(*token))
	}
	c, err := vr.NewClient(*server, opts...)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), *within)
	defer cancel()

	op, err := publish(ctx, c, *volume, *node, *generation)
	if err != nil {
		log.Fatalf("publish: %v", err)
	}
	fmt.Printf("published: operation %s %s %s, device %s\n", op.GetId(), op.GetState(), op.GetResolution(), op.GetAttachment().GetDevice())
	op, err = unpublish(ctx, c, *volume, *node, *generation)
	if err != nil {
		log.Fatalf("unpublish: %v", err)
	}
	fmt.Printf("unpublished: operation %s %s %s\n", op.GetId(), op.GetState(), op.GetResolution())
}
