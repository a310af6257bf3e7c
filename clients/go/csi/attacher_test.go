package csi_test

// external-attacher's own controller (kubernetes-csi/external-attacher's
// pkg/controller, pinned in go.mod), in-process as its own tests build it:
// client-go's fake clientset and informers, its CSI handler with
// attacher.NewAttacher on a gRPC connection, here to the endpoint's
// socket, with cinder-csi's --timeout=3m and the sidecar's default retry
// intervals (1 s, doubling to 5 min). Each scenario runs against its own
// real service and nova-sim, and ends with the simulator's truth: one
// attach taking effect.

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kubernetes-csi/external-attacher/v4/pkg/attacher"
	"github.com/kubernetes-csi/external-attacher/v4/pkg/controller"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	clienttesting "k8s.io/client-go/testing"
	"k8s.io/client-go/util/workqueue"
	csitrans "k8s.io/csi-translation-lib"
	"k8s.io/klog/v2"

	vr "github.com/volume-reconciler/volume-reconciler/clients/go"
	"github.com/volume-reconciler/volume-reconciler/clients/go/csi"
	"github.com/volume-reconciler/volume-reconciler/clients/go/internal/testservice"
)

// cinderTimeout is cinder-csi's --timeout of its csi-attacher sidecar.
const cinderTimeout = 3 * time.Minute

// cluster is one external-attacher against the endpoint, with one
// PersistentVolume (the Cinder volume) and the node's CSINode (the Nova
// server as its node id).
type cluster struct {
	t      *testing.T
	svc    *testservice.Service
	client *fake.Clientset
	server string // the node's Nova server
	volume string // the PV's Cinder volume

	mu        sync.Mutex
	published []codes.Code // the code of every publish the attacher got
}

// record keeps the code of every ControllerPublishVolume the attacher's
// connection carried.
func (c *cluster) record(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	err := invoker(ctx, method, req, reply, cc, opts...)
	if strings.HasSuffix(method, "/ControllerPublishVolume") {
		c.mu.Lock()
		c.published = append(c.published, status.Code(err))
		c.mu.Unlock()
	}
	return err
}

func (c *cluster) publishCodes() []codes.Code {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]codes.Code(nil), c.published...)
}

const (
	nodeName = "node-a"
	pvName   = "pv-a"
	vaName   = "va-a"
)

// startAttacher runs external-attacher's controller with timeout against
// an endpoint in front of svc, until the test ends.
func startAttacher(t *testing.T, svc *testservice.Service, timeout time.Duration) *cluster {
	t.Helper()
	c := &cluster{t: t, svc: svc, server: testservice.NewUUID(t), volume: testservice.NewUUID(t)}
	socket := serveEndpoint(t, svc.Addr)
	conn, err := grpc.NewClient("unix://"+socket, vr.Insecure(), grpc.WithChainUnaryInterceptor(c.record))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() }) // nothing to report at the test's end

	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: pvName},
		Spec: corev1.PersistentVolumeSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: csi.DefaultDriverName, VolumeHandle: c.volume, FSType: "ext4",
			}},
		},
	}
	csiNode := &storagev1.CSINode{
		ObjectMeta: metav1.ObjectMeta{Name: nodeName},
		Spec: storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{
			{Name: csi.DefaultDriverName, NodeID: c.server},
		}},
	}
	c.client = versionedClientset(pv, csiNode)
	factory := informers.NewSharedInformerFactory(c.client, 0)
	vas, pvs, nodes := factory.Storage().V1().VolumeAttachments(), factory.Core().V1().PersistentVolumes(), factory.Storage().V1().CSINodes()
	handler := controller.NewCSIHandler(c.client, csi.DefaultDriverName, attacher.NewAttacher(conn),
		attacher.NewVolumeLister(conn, 0), pvs.Lister(), nodes.Lister(), vas.Lister(), &timeout,
		false, false, csitrans.New(), "ext4")
	logger := klog.Background()
	ctrl := controller.NewCSIAttachController(logger, c.client, csi.DefaultDriverName, handler, vas, pvs,
		workqueue.NewTypedItemExponentialFailureRateLimiter[string](time.Second, 5*time.Minute),
		workqueue.NewTypedItemExponentialFailureRateLimiter[string](time.Second, 5*time.Minute),
		false, time.Minute)
	ctx, cancel := context.WithCancel(klog.NewContext(context.Background(), logger))
	var wg sync.WaitGroup
	factory.Start(ctx.Done())
	wg.Add(1)
	go func() {
		defer wg.Done()
		ctrl.Run(ctx, 1, &wg)
	}()
	t.Cleanup(func() {
		cancel()
		factory.Shutdown()
		wg.Wait()
	})
	return c
}

// versionedClientset is client-go's fake clientset (as external-attacher's
// tests make it) whose writes stamp a new resourceVersion on the object, as
// the API server does: the controller tells its own status writes (an
// attach error) from a change by that, and re-enqueues only a change, so
// that its retries follow its backoff. Without it every status write
// re-enqueued the VolumeAttachment at once: a retry loop no cluster runs.
func versionedClientset(objects ...runtime.Object) *fake.Clientset {
	cs := fake.NewSimpleClientset(objects...)
	v := &versioned{ObjectTracker: cs.Tracker()}
	cs.ReactionChain = nil
	cs.AddReactor("*", "*", clienttesting.ObjectReaction(v))
	return cs
}

type versioned struct {
	clienttesting.ObjectTracker
	n atomic.Int64
}

func (v *versioned) stamp(obj runtime.Object) {
	if m, err := meta.Accessor(obj); err == nil {
		m.SetResourceVersion(strconv.FormatInt(v.n.Add(1), 10))
	}
}

func (v *versioned) Create(gvr schema.GroupVersionResource, obj runtime.Object, ns string, opts ...metav1.CreateOptions) error {
	v.stamp(obj)
	return v.ObjectTracker.Create(gvr, obj, ns, opts...)
}

func (v *versioned) Update(gvr schema.GroupVersionResource, obj runtime.Object, ns string, opts ...metav1.UpdateOptions) error {
	v.stamp(obj)
	return v.ObjectTracker.Update(gvr, obj, ns, opts...)
}

func (v *versioned) Patch(gvr schema.GroupVersionResource, obj runtime.Object, ns string, opts ...metav1.PatchOptions) error {
	v.stamp(obj)
	return v.ObjectTracker.Patch(gvr, obj, ns, opts...)
}

// attach creates the VolumeAttachment, as the attach-detach controller
// does for a pod scheduled on the node.
func (c *cluster) attach() {
	c.t.Helper()
	pv := pvName
	va := &storagev1.VolumeAttachment{
		ObjectMeta: metav1.ObjectMeta{Name: vaName},
		Spec: storagev1.VolumeAttachmentSpec{
			Attacher: csi.DefaultDriverName, NodeName: nodeName,
			Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &pv},
		},
	}
	if _, err := c.client.StorageV1().VolumeAttachments().Create(context.Background(), va, metav1.CreateOptions{}); err != nil {
		c.t.Fatal(err)
	}
}

// detach marks the VolumeAttachment deleted, as the API server does for
// an object with finalizers (the fake clientset would drop it at once).
func (c *cluster) detach() {
	c.t.Helper()
	va := c.va()
	now := metav1.Now()
	va.DeletionTimestamp = &now
	if _, err := c.client.StorageV1().VolumeAttachments().Update(context.Background(), va, metav1.UpdateOptions{}); err != nil {
		c.t.Fatal(err)
	}
}

func (c *cluster) va() *storagev1.VolumeAttachment {
	c.t.Helper()
	va, err := c.client.StorageV1().VolumeAttachments().Get(context.Background(), vaName, metav1.GetOptions{})
	if err != nil {
		c.t.Fatal(err)
	}
	return va
}

// anyRequests: waitAttached does not count the POSTs Nova received.
const anyRequests = -1

// waitAttached waits (within) until the VolumeAttachment is attached, and
// checks its device and the simulator's truth: one attach took effect,
// after requests POSTs reached Nova (anyRequests: however many).
func (c *cluster) waitAttached(within time.Duration, requests int) {
	c.t.Helper()
	var va *storagev1.VolumeAttachment
	testservice.Eventually(c.t, within, "the VolumeAttachment is attached", func() bool {
		va = c.va()
		return va.Status.Attached
	})
	if va.Status.AttachmentMetadata[csi.PublishContextDevice] == "" {
		c.t.Fatalf("attached without a device: %v", va.Status.AttachmentMetadata)
	}
	tr := c.svc.Truth()
	if tr.AttachEffects[c.volume] != 1 || (requests != anyRequests && tr.AttachRequests[c.volume] != requests) {
		c.t.Fatalf("Nova saw %d attach requests and %d effects; want %d and 1", tr.AttachRequests[c.volume], tr.AttachEffects[c.volume], requests)
	}
	if !tr.Attached(c.server, c.volume) {
		c.t.Fatalf("the simulator does not hold %s on %s", c.volume, c.server)
	}
}

func TestExternalAttacherAttachesAndDetachesThroughTheEndpoint(t *testing.T) {
	t.Parallel()
	s := testservice.Start(t)
	c := startAttacher(t, s, cinderTimeout)
	c.attach()
	c.waitAttached(2*time.Minute, 1)
	c.detach()
	testservice.Eventually(t, 2*time.Minute, "the VolumeAttachment's finalizer is removed (detached)", func() bool {
		return len(c.va().Finalizers) == 0
	})
	tr := s.Truth()
	if tr.DetachEffects[c.volume] != 1 || tr.Attached(c.server, c.volume) {
		t.Fatalf("Nova: %d detaches took effect; still attached: %v", tr.DetachEffects[c.volume], tr.Attached(c.server, c.volume))
	}
}

// Nova attaches and the connection closes before its answer: the service
// re-observes, the publish answers the attachment.
func TestExternalAttacherALostResponseIsAttachedOnce(t *testing.T) {
	t.Parallel()
	s := testservice.Start(t, "--reconcile-interval", "200ms")
	c := startAttacher(t, s, cinderTimeout)
	s.Fault("attach", c.volume, map[string]any{"kind": "close_after_effect"})
	c.attach()
	c.waitAttached(2*time.Minute, 1)
}

// Nova answers 35 s late (past the 30 s that cut the first incident's
// attach): one publish waits for it, no second POST.
func TestExternalAttacherAnAnswer35SecondsLateIsAttachedWithOnePOST(t *testing.T) {
	t.Parallel()
	s := testservice.Start(t)
	c := startAttacher(t, s, cinderTimeout)
	s.Fault("attach", c.volume, map[string]any{"kind": "delay_after_effect", "ms": 35000})
	c.attach()
	c.waitAttached(3*time.Minute, 1)
}

// Nova answers 409 (the server locked) for a minute, then attaches: the
// VolumeAttachment is attached in the end, one effect.
func TestExternalAttacherNovaBusyForAMinuteThenHealthyIsAttached(t *testing.T) {
	t.Parallel()
	s := testservice.Start(t, "--reconcile-interval", "200ms")
	c := startAttacher(t, s, cinderTimeout)
	s.SimPost("/sim/servers/"+c.server+"/lock", map[string]any{})
	unlock := time.AfterFunc(time.Minute, func() { s.SimDelete("/sim/servers/" + c.server + "/lock") })
	t.Cleanup(func() { unlock.Stop() })
	c.attach()
	// Every refused POST is a request Nova received: any number of them,
	// one effect.
	c.waitAttached(5*time.Minute, anyRequests)
}

// The server holds no more disks (Nova's 403 TooManyDiskDevices): the
// VolumeAttachment's attachError carries RESOURCE_EXHAUSTED, which tells
// Kubernetes the node is full.
func TestExternalAttacherTooManyDisksIsResourceExhausted(t *testing.T) {
	t.Parallel()
	s := testservice.Start(t)
	c := startAttacher(t, s, cinderTimeout)
	s.SimPost("/sim/servers/"+c.server+"/max_disk_devices_to_attach", map[string]any{"max_disk_devices_to_attach": 0})
	c.attach()
	var va *storagev1.VolumeAttachment
	testservice.Eventually(t, 2*time.Minute, "an attach error is recorded", func() bool {
		va = c.va()
		return va.Status.AttachError != nil
	})
	if va.Status.Attached || va.Status.AttachError.ErrorCode == nil || codes.Code(*va.Status.AttachError.ErrorCode) != codes.ResourceExhausted {
		t.Fatalf("attached %v, attach error %+v: want RESOURCE_EXHAUSTED", va.Status.Attached, va.Status.AttachError)
	}
	if n := s.Truth().AttachEffects[c.volume]; n != 0 {
		t.Fatalf("Nova attached it %d times", n)
	}
}

// The service sheds the publish (one attach at a time, and another volume's
// attach holds the place for 40 s): the VolumeAttachment's attachError is
// UNAVAILABLE, never RESOURCE_EXHAUSTED (the node is not full), and once the
// other attach is done the volume is attached, once. external-attacher's
// timeout is 15 s here (its own default before cinder-csi raised it), so
// that a publish ends while the service still sheds: with 3 min, the
// client's replays would outlast the hold and no shed answer would reach
// Kubernetes.
func TestExternalAttacherTheServiceSheddingIsNeverResourceExhausted(t *testing.T) {
	t.Parallel()
	s := testservice.Start(t, "--max-inflight-mutations", "1")
	c := startAttacher(t, s, 15*time.Second)
	holder, other := testservice.NewUUID(t), testservice.NewUUID(t)
	s.Fault("attach", other, map[string]any{"kind": "delay_after_effect", "ms": 40000})
	vc, err := vr.NewClient(s.Addr, vr.Insecure())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = vc.Close() }) // nothing to report at the test's end
	held := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		_, err := vc.Attach(ctx, vr.AttachRequest{Key: vr.KeyFor("holder", holder, other), ServerID: holder, VolumeID: other})
		held <- err
	}()
	testservice.Eventually(t, time.Minute, "Nova holds the other attach", func() bool {
		return s.Truth().AttachRequests[other] == 1
	})
	c.attach()
	var va *storagev1.VolumeAttachment
	testservice.Eventually(t, time.Minute, "an attach error is recorded while the service sheds", func() bool {
		va = c.va()
		return va.Status.AttachError != nil
	})
	if code := va.Status.AttachError.ErrorCode; code == nil || codes.Code(*code) != codes.Unavailable {
		t.Fatalf("the shed publish's attach error: %+v, want UNAVAILABLE", va.Status.AttachError)
	}
	if err := <-held; err != nil {
		t.Fatalf("the other attach: %v", err)
	}
	c.waitAttached(3*time.Minute, 1)
}

// Nova takes the attach 30 s after a load balancer answered 504, longer
// than the attacher's timeout (15 s here, external-attacher's default):
// the publish answers DEADLINE_EXCEEDED, external-attacher calls again,
// and the next publish joins the open operation (DEADLINE_EXCEEDED again
// while it is open, never ABORTED VOLUME_BUSY as a call of its own would
// be: the CO's earlier call is not another operation), or once it is
// decided finds the volume attached. One POST.
func TestExternalAttacherAnAttachOutlastingTheAttachersTimeoutIsJoinedNotSentAgain(t *testing.T) {
	t.Parallel()
	s := testservice.Start(t, "--reconcile-interval", "200ms")
	c := startAttacher(t, s, 15*time.Second)
	s.Fault("attach", c.volume, map[string]any{"kind": "late_effect", "ms": 30000})
	c.attach()
	c.waitAttached(3*time.Minute, 1)
	got := c.publishCodes()
	first := slices.Index(got, codes.OK)
	if first < 1 {
		t.Fatalf("the publishes answered %v: want DEADLINE_EXCEEDED, then OK", got)
	}
	for i, code := range got {
		if (i < first && code != codes.DeadlineExceeded) || (i > first && code != codes.OK) {
			t.Fatalf("the publishes answered %v: each before the first OK should have joined the open operation (DEADLINE_EXCEEDED)", got)
		}
	}
}

// The service is drained and started again while Nova holds the attach:
// the publish's client replays over the refused connections, the new
// process joins the open operation, one POST.
func TestExternalAttacherTheServiceRestartedDuringAnAttachIsAttachedOnce(t *testing.T) {
	t.Parallel()
	s := testservice.Start(t, "--drain-timeout", "1s", "--reconcile-interval", "200ms")
	c := startAttacher(t, s, cinderTimeout)
	s.Fault("attach", c.volume, map[string]any{"kind": "delay_after_effect", "ms": 8000})
	c.attach()
	testservice.Eventually(t, time.Minute, "Nova received the attach", func() bool {
		return s.Truth().AttachRequests[c.volume] == 1
	})
	s.Restart()
	c.waitAttached(3*time.Minute, 1)
}
