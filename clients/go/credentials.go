package volumereconciler

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// Insecure is a plaintext connection (a service on loopback, a demo).
func Insecure() grpc.DialOption {
	return grpc.WithTransportCredentials(insecure.NewCredentials())
}

// WithBearerToken sends "authorization: Bearer TOKEN" on every call of the
// connection (the service's --auth-tokens holds its SHA-256). It is sent
// over plaintext too: the service accepts tokens there, for loopback and
// for meshes that encrypt outside the process.
func WithBearerToken(token string) grpc.DialOption {
	return grpc.WithPerRPCCredentials(bearer(token))
}

type bearer string

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(b)}, nil
}

func (bearer) RequireTransportSecurity() bool { return false }

// WithMTLS is TLS that trusts the CA in caFile and, when certFile and
// keyFile are given, presents that client certificate (mutual TLS, the
// service's --tls-client-ca). An empty caFile trusts the system's roots.
func WithMTLS(caFile, certFile, keyFile string) (grpc.DialOption, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("volume-reconciler TLS CA: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("volume-reconciler TLS CA %s: no PEM certificate in it", caFile)
		}
		cfg.RootCAs = pool
	}
	if certFile != "" || keyFile != "" {
		pair, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("volume-reconciler TLS client certificate %s, key %s: %w", certFile, keyFile, err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return grpc.WithTransportCredentials(credentials.NewTLS(cfg)), nil
}
