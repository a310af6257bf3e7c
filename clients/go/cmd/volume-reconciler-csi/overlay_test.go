package main

// The deployment of this command (deploy/kubernetes/csi-attach), rendered
// with the kustomize Go API as `kubectl apply -k` would, and its image's
// build line, run.

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"

	"github.com/volume-reconciler/volume-reconciler/clients/go/internal/testservice"
)

// render is the controller Deployment that the kustomization in dir
// renders.
func render(t *testing.T, dir string) *appsv1.Deployment {
	t.Helper()
	m, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		t.Fatalf("kustomize %s: %v", dir, err)
	}
	var found *appsv1.Deployment
	for _, r := range m.Resources() {
		if r.GetKind() != "Deployment" || r.GetName() != "csi-cinder-controllerplugin" {
			continue
		}
		b, err := r.AsYAML()
		if err != nil {
			t.Fatal(err)
		}
		found = &appsv1.Deployment{}
		if err := yaml.UnmarshalStrict(b, found); err != nil {
			t.Fatalf("%s: the rendered Deployment: %v", dir, err)
		}
	}
	if found == nil {
		t.Fatalf("%s renders no Deployment csi-cinder-controllerplugin", dir)
	}
	return found
}

func container(t *testing.T, d *appsv1.Deployment, name string) corev1.Container {
	t.Helper()
	for _, c := range d.Spec.Template.Spec.Containers {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no container %s", name)
	return corev1.Container{}
}

func envOf(c corev1.Container, name string) string {
	for _, e := range c.Env {
		if e.Name == name {
			return e.Value
		}
	}
	return ""
}

func mountOf(c corev1.Container, volume string) string {
	for _, m := range c.VolumeMounts {
		if m.Name == volume {
			return m.MountPath
		}
	}
	return ""
}

// The overlay adds the endpoint to cinder-csi's controller pod on the
// shared socket-dir, points csi-attacher (with cinder-csi's --timeout=3m)
// at the endpoint's socket, and leaves every other container as it was.
func TestTheOverlayAddsTheEndpointAndPointsTheAttacherAtItAlone(t *testing.T) {
	root := filepath.Join(testservice.RepoRoot(t), "deploy", "kubernetes", "csi-attach")
	before := render(t, filepath.Join(root, "cinder-csi"))
	after := render(t, root)

	ep := container(t, after, "volume-reconciler-csi")
	socket := strings.TrimPrefix(envOf(ep, "CSI_ENDPOINT"), "unix://")
	dir := mountOf(ep, "socket-dir")
	if socket == "" || dir == "" || filepath.Dir(socket) != filepath.Clean(dir) {
		t.Fatalf("the endpoint serves %q, socket-dir is mounted at %q", socket, dir)
	}
	if ep.Image != "volume-reconciler-csi:0.2.0" || envOf(ep, "CSI_DRIVER_NAME") != "cinder.csi.openstack.org" ||
		envOf(ep, "VOLUME_RECONCILER_SERVER") == "" || envOf(ep, "VOLUME_RECONCILER_TOKEN_FILE") == "" {
		t.Fatalf("the endpoint's container: %+v", ep)
	}
	// Its flags are this command's.
	if _, err := parse(append(ep.Args, "--server", "x:1")); err != nil {
		t.Fatalf("the container's args %v: %v", ep.Args, err)
	}

	attacher := container(t, after, "csi-attacher")
	address := envOf(attacher, "ADDRESS")
	if filepath.Dir(address) != filepath.Clean(mountOf(attacher, "socket-dir")) || filepath.Base(address) != filepath.Base(socket) {
		t.Fatalf("csi-attacher talks to %s (socket-dir at %s); the endpoint serves %s", address, mountOf(attacher, "socket-dir"), socket)
	}
	if !contains(attacher.Args, "--timeout=3m") || !contains(attacher.Args, "--csi-address=$(ADDRESS)") {
		t.Fatalf("csi-attacher's args: %v", attacher.Args)
	}

	if got, want := len(after.Spec.Template.Spec.Containers), len(before.Spec.Template.Spec.Containers)+1; got != want {
		t.Fatalf("%d containers, want cinder-csi's %d and the endpoint", got, want-1)
	}
	for _, c := range before.Spec.Template.Spec.Containers {
		if c.Name == "csi-attacher" {
			continue
		}
		if !reflect.DeepEqual(c, container(t, after, c.Name)) {
			t.Errorf("container %s changed:\nbefore %+v\nafter  %+v", c.Name, c, container(t, after, c.Name))
		}
		if filepath.Base(envOf(c, "ADDRESS")) == filepath.Base(socket) {
			t.Errorf("container %s talks to the endpoint", c.Name)
		}
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// The Dockerfile's build line, run as it is written (CGO off, the version
// stamped) but for the output path: the image's binary keeps building.
func TestTheDockerfilesBuildLineBuildsAStaticBinary(t *testing.T) {
	t.Parallel()
	f, err := os.Open("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var line string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "RUN CGO_ENABLED=0 go build") {
			line = strings.TrimPrefix(sc.Text(), "RUN ")
		}
	}
	if line == "" {
		t.Fatal("the Dockerfile has no `RUN CGO_ENABLED=0 go build` line")
	}
	out := filepath.Join(t.TempDir(), "volume-reconciler-csi")
	line = strings.NewReplacer("/out/volume-reconciler-csi", out, "${VERSION}", "9.9.9").Replace(line)
	cmd := exec.Command("sh", "-c", line)
	cmd.Dir = filepath.Join("..", "..") // the build context: clients/go
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", line, err, b)
	}
	v, err := exec.Command(out, "--version").CombinedOutput()
	if err != nil || !strings.Contains(string(v), "9.9.9") {
		t.Fatalf("%s --version: %v %s", out, err, v)
	}
}

// The docs' render command (docs/kubernetes.md), run as printed where
// kubectl is installed: it renders what the kustomize Go API renders.
func TestTheDocsKubectlKustomizeCommandRendersTheOverlay(t *testing.T) {
	root := testservice.RepoRoot(t)
	doc, err := os.ReadFile(filepath.Join(root, "docs", "kubernetes.md"))
	if err != nil {
		t.Fatal(err)
	}
	const command = "kubectl kustomize deploy/kubernetes/csi-attach"
	if !slices.ContainsFunc(strings.Split(string(doc), "\n"), func(l string) bool { return strings.TrimSpace(l) == command }) {
		t.Fatalf("docs/kubernetes.md no longer prints %q: update this test", command)
	}
	kubectl, err := exec.LookPath("kubectl")
	if err != nil {
		t.Skipf("kubectl is not installed (%v); the overlay is rendered with the kustomize Go API above", err)
	}
	cmd := exec.Command(kubectl, strings.Fields(command)[1:]...)
	cmd.Dir = root
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", command, err, out)
	}
	for _, want := range []string{"name: volume-reconciler-csi", "value: /var/lib/csi/sockets/pluginproxy/reconciler.sock", "value: unix:///csi/reconciler.sock"} {
		if !strings.Contains(string(out), want) {
			t.Fatalf("%s does not render %q:\n%s", command, want, out)
		}
	}
}
