package volumereconciler_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	vr "github.com/volume-reconciler/volume-reconciler/clients/go"
	reconcilerv1 "github.com/volume-reconciler/volume-reconciler/clients/go/volume_reconciler/v1"
)

// pki is a throwaway CA with a server certificate for 127.0.0.1 and a
// client certificate, as PEM files in dir.
type pki struct{ ca, serverCert, serverKey, clientCert, clientKey string }

func newPKI(t *testing.T, dir string) pki {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatal(err)
	}
	write := func(name, kind string, der []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	leaf := func(name string, serial int64, usage x509.ExtKeyUsage, ips []net.IP) (string, string) {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: name},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage}, IPAddresses: ips,
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		keyDER, err := x509.MarshalPKCS8PrivateKey(key)
		if err != nil {
			t.Fatal(err)
		}
		return write(name+".pem", "CERTIFICATE", der), write(name+".key", "PRIVATE KEY", keyDER)
	}
	var p pki
	p.ca = write("ca.pem", "CERTIFICATE", caDER)
	p.serverCert, p.serverKey = leaf("server", 2, x509.ExtKeyUsageServerAuth, []net.IP{net.ParseIP("127.0.0.1")})
	p.clientCert, p.clientKey = leaf("orchestrator", 3, x509.ExtKeyUsageClientAuth, nil)
	return p
}

// Mutual TLS through WithMTLS: a client with a certificate from the CA
// attaches; one without is refused at the handshake and nothing is
// recorded.
func TestMutualTLSThroughWithMTLSAttachesAndACertlessClientIsRefused(t *testing.T) {
	t.Parallel()
	p := newPKI(t, t.TempDir())
	s := startService(t, "--tls-cert", p.serverCert, "--tls-key", p.serverKey, "--tls-client-ca", p.ca)
	dial := func(cert, key string) *vr.Client {
		creds, err := vr.WithMTLS(p.ca, cert, key)
		if err != nil {
			t.Fatal(err)
		}
		c, err := vr.NewClient(s.Addr, creds)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() }) // nothing to report on close
		return c
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	server, volume := newUUID(t), newUUID(t)
	c := dial(p.clientCert, p.clientKey)
	op, err := c.Attach(ctx, vr.AttachRequest{Key: vr.KeyFor("mtls", server, volume), ServerID: server, VolumeID: volume})
	if err != nil || op.GetState() != reconcilerv1.State_STATE_SUCCEEDED {
		t.Fatalf("with a client certificate: %v %v", op, err)
	}

	// A refused handshake looks like a connection failure, which the
	// client replays: bounded by this context, as every replay is.
	short, cancelShort := context.WithTimeout(ctx, 3*time.Second)
	defer cancelShort()
	certless := dial("", "")
	other := newUUID(t)
	key := vr.KeyFor("mtls-certless", server, other)
	if _, err := certless.Attach(short, vr.AttachRequest{Key: key, ServerID: server, VolumeID: other}); err == nil {
		t.Fatal("a client without a certificate attached")
	}
	_, err = c.Stub().GetOperation(ctx, &reconcilerv1.GetOperationRequest{IdempotencyKey: key})
	if status.Code(err) != codes.NotFound {
		t.Fatalf("the certless client's key: %v, want NOT_FOUND", err)
	}
	if tr := s.truth(); tr.AttachEffects[volume] != 1 || tr.AttachRequests[other] != 0 {
		t.Fatalf("Nova: %d effects for the attach, %d requests for the refused one", tr.AttachEffects[volume], tr.AttachRequests[other])
	}
}
