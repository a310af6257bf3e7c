package csi_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"time"

	csispec "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"

	vr "github.com/volume-reconciler/volume-reconciler/clients/go"
	"github.com/volume-reconciler/volume-reconciler/clients/go/csi"
)

// The endpoint on a unix socket, in front of a volume-reconciler service
// (connected lazily: the first publish connects), asked for its name as
// external-attacher asks it.
func ExampleNewServer() {
	conn, err := grpc.NewClient("volume-reconciler.volume-reconciler.svc:50051", vr.Insecure())
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	srv := csi.NewServer(conn, csi.Options{})
	g := grpc.NewServer(srv.ServerOptions()...)
	srv.Register(g)
	dir, err := os.MkdirTemp("", "csi-example-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	l, err := csi.Listen("unix://" + filepath.Join(dir, "csi.sock"))
	if err != nil {
		log.Fatal(err)
	}
	go func() {
		// Serve answers only when g.Stop below ends it: nothing to report.
		_ = g.Serve(l)
	}()
	defer g.Stop()

	co, err := grpc.NewClient("unix://"+filepath.Join(dir, "csi.sock"), vr.Insecure())
	if err != nil {
		log.Fatal(err)
	}
	defer co.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	info, err := csispec.NewIdentityClient(co).GetPluginInfo(ctx, &csispec.GetPluginInfoRequest{})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(info.GetName())
	// Output: cinder.csi.openstack.org
}
