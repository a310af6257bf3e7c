// Command volume-reconciler-csi is the CSI controller endpoint of
// volume-reconciler (package csi): it serves CSI's Identity and the
// Controller's publish and unpublish on a unix socket, beside cinder-csi's
// controller plugin, and attaches through the volume-reconciler service.
//
//	volume-reconciler-csi --endpoint unix:///csi/reconciler.sock \
//	    --server volume-reconciler.volume-reconciler.svc:50051 \
//	    --token-file /etc/volume-reconciler/token
//
// Every flag has an environment variable (flags win), as Kubernetes
// sidecars take their settings: CSI_ENDPOINT, VOLUME_RECONCILER_SERVER,
// VOLUME_RECONCILER_TOKEN_FILE, VOLUME_RECONCILER_TLS_CA,
// VOLUME_RECONCILER_TLS_CERT, VOLUME_RECONCILER_TLS_KEY, CSI_DRIVER_NAME,
// CSI_HTTP_ENDPOINT, CSI_LOG_LEVEL, CSI_DRAIN_TIMEOUT. Logs are JSON lines
// on stderr; /metrics and /healthz are served on --http-endpoint. On
// SIGTERM it stops taking calls, lets those in flight finish (up to
// --drain-timeout), removes its socket and exits 0.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"

	vr "github.com/volume-reconciler/volume-reconciler/clients/go"
	"github.com/volume-reconciler/volume-reconciler/clients/go/csi"
)

// version is set at build time (-ldflags "-X main.version=...").
var version = "dev"

type config struct {
	endpoint, server, tokenFile, ca, cert, key, driver, httpEndpoint, logLevel string
	drain                                                                      time.Duration
	showVersion                                                                bool
}

// env is the environment variable name's value, or def.
func env(name, def string) string {
	if v, ok := os.LookupEnv(name); ok {
		return v
	}
	return def
}

func parse(args []string) (config, error) {
	var c config
	fs := flag.NewFlagSet("volume-reconciler-csi", flag.ContinueOnError)
	fs.StringVar(&c.endpoint, "endpoint", env("CSI_ENDPOINT", "unix:///csi/csi.sock"), "the CSI socket to serve ($CSI_ENDPOINT)")
	fs.StringVar(&c.server, "server", env("VOLUME_RECONCILER_SERVER", ""), "the volume-reconciler service, host:port ($VOLUME_RECONCILER_SERVER)")
	fs.StringVar(&c.tokenFile, "token-file", env("VOLUME_RECONCILER_TOKEN_FILE", ""), "a file holding the bearer token ($VOLUME_RECONCILER_TOKEN_FILE)")
	fs.StringVar(&c.ca, "tls-ca", env("VOLUME_RECONCILER_TLS_CA", ""), "TLS: the CA of the service's certificate ($VOLUME_RECONCILER_TLS_CA); without it and a certificate, plaintext")
	fs.StringVar(&c.cert, "tls-cert", env("VOLUME_RECONCILER_TLS_CERT", ""), "mutual TLS: this endpoint's certificate ($VOLUME_RECONCILER_TLS_CERT)")
	fs.StringVar(&c.key, "tls-key", env("VOLUME_RECONCILER_TLS_KEY", ""), "mutual TLS: its key ($VOLUME_RECONCILER_TLS_KEY)")
	fs.StringVar(&c.driver, "driver-name", env("CSI_DRIVER_NAME", csi.DefaultDriverName), "the name GetPluginInfo answers: the VolumeAttachments' spec.attacher ($CSI_DRIVER_NAME)")
	fs.StringVar(&c.httpEndpoint, "http-endpoint", env("CSI_HTTP_ENDPOINT", ""), "host:port of /metrics and /healthz; empty: none ($CSI_HTTP_ENDPOINT)")
	fs.StringVar(&c.logLevel, "log-level", env("CSI_LOG_LEVEL", "info"), "debug, info, warn or error ($CSI_LOG_LEVEL)")
	fs.BoolVar(&c.showVersion, "version", false, "print the version and exit")
	drain := env("CSI_DRAIN_TIMEOUT", "30s")
	fs.StringVar(&drain, "drain-timeout", drain, "how long calls in flight may finish after SIGTERM ($CSI_DRAIN_TIMEOUT)")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	d, err := time.ParseDuration(drain)
	if err != nil {
		return c, fmt.Errorf("--drain-timeout %q: %w", drain, err)
	}
	c.drain = d
	if c.server == "" && !c.showVersion {
		return c, errors.New("--server (or VOLUME_RECONCILER_SERVER) is required: the volume-reconciler service's host:port")
	}
	return c, nil
}

// credentials are the dial options of the service's connection: TLS (and
// mutual TLS) when a CA or a certificate is given, else plaintext; the
// token when a token file is given.
func credentials(c config) ([]grpc.DialOption, error) {
	var opts []grpc.DialOption
	if c.ca != "" || c.cert != "" || c.key != "" {
		tls, err := vr.WithMTLS(c.ca, c.cert, c.key)
		if err != nil {
			return nil, err
		}
		opts = append(opts, tls)
	} else {
		opts = append(opts, vr.Insecure())
	}
	if c.tokenFile != "" {
		b, err := os.ReadFile(c.tokenFile)
		if err != nil {
			return nil, fmt.Errorf("--token-file: %w", err)
		}
		token := strings.TrimSpace(string(b))
		if token == "" {
			return nil, fmt.Errorf("--token-file %s is empty", c.tokenFile)
		}
		opts = append(opts, vr.WithBearerToken(token))
	}
	return opts, nil
}

func main() {
	c, err := parse(os.Args[1:])
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "volume-reconciler-csi:", err)
		os.Exit(2)
	}
	if c.showVersion {
		fmt.Println("volume-reconciler-csi", version)
		return
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(c.logLevel)); err != nil {
		fmt.Fprintln(os.Stderr, "volume-reconciler-csi: --log-level:", err)
		os.Exit(2)
	}
	log := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	if err := run(c, log); err != nil {
		log.Error("volume-reconciler-csi stopped", "error", err.Error())
		os.Exit(1)
	}
}

// run serves until SIGTERM or SIGINT.
func run(c config, log *slog.Logger) error {
	opts, err := credentials(c)
	if err != nil {
		return err
	}
	conn, err := grpc.NewClient(c.server, opts...)
	if err != nil {
		return fmt.Errorf("volume-reconciler %s: %w", c.server, err)
	}
	defer conn.Close()
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	srv := csi.NewServer(conn, csi.Options{
		DriverName: c.driver, DriverVersion: version, Logger: log, Metrics: csi.NewMetrics(reg, c.driver),
	})
	g := grpc.NewServer(srv.ServerOptions()...)
	srv.Register(g)
	l, err := csi.Listen(c.endpoint)
	if err != nil {
		return err
	}
	socket := csi.SocketPath(c.endpoint)
	stopHTTP, err := serveHTTP(c.httpEndpoint, reg, log)
	if err != nil {
		return err
	}
	defer stopHTTP()

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	served := make(chan error, 1)
	go func() { served <- g.Serve(l) }()
	log.Info("serving", "endpoint", c.endpoint, "server", c.server, "driver_name", c.driver, "version", version,
		"tls", c.ca != "" || c.cert != "", "token", c.tokenFile != "")
	select {
	case err := <-served:
		return fmt.Errorf("serving %s: %w", c.endpoint, err)
	case <-ctx.Done():
	}
	log.Info("stopping: no new calls; waiting for calls in flight", "drain_timeout", c.drain.String())
	drained := make(chan struct{})
	go func() { g.GracefulStop(); close(drained) }()
	select {
	case <-drained:
		log.Info("stopped: every call in flight finished")
	case <-time.After(c.drain):
		g.Stop()
		log.Warn("stopped: calls still in flight were cut at the drain timeout (the CO calls again; each joins its open operation)")
	}
	// GracefulStop closed the listener; the socket file stays on a
	// shared volume unless removed.
	if err := os.Remove(socket); err != nil && !errors.Is(err, os.ErrNotExist) {
		log.Warn("socket not removed", "socket", socket, "error", err.Error())
	}
	return nil
}

// serveHTTP serves /metrics and /healthz on addr ("" serves nothing); the
// returned func stops it.
func serveHTTP(addr string, reg *prometheus.Registry, log *slog.Logger) (func(), error) {
	if addr == "" {
		return func() {}, nil
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--http-endpoint %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		// The process answers: liveness only (readiness is CSI's Probe).
		w.WriteHeader(http.StatusOK)
	})
	hs := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := hs.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("http endpoint stopped", "address", addr, "error", err.Error())
		}
	}()
	log.Info("http endpoint", "address", l.Addr().String(), "paths", "/metrics /healthz")
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := hs.Shutdown(ctx); err != nil {
			log.Warn("http endpoint shutdown", "error", err.Error())
		}
	}, nil
}
