# syntax=docker/dockerfile:1
# Multi-stage: build with the Rust toolchain, run on distroless (glibc,
# libgcc, CA certificates, tzdata; no shell, no package manager) as a
# non-root user. `serve` is the default command; `nova-sim`, `ops`,
# `migrate` and `healthcheck` come from the same image.
#
#   docker build -t volume-reconciler:0.2.0 \
#     --build-arg GIT_SHA=$(git rev-parse HEAD) \
#     --build-arg CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ) .
#
# The admin listener (/healthz, /readyz, /metrics) binds 0.0.0.0:9090 in the
# image so that probes and scrapes reach it; keep that port on a private
# network. Without DATABASE_URL the embedded ledger is used
# (sqlite://volume-reconciler.db in the /var/lib/volume-reconciler volume,
# one process only); replicas need DATABASE_URL=postgres://...

ARG RUST_VERSION=1.95
# The bases are named by tag, not yet pinned by digest: no digest of either
# could be verified from where this file is maintained. Pin them where you
# build (`docker buildx imagetools inspect rust:1.95-bookworm`, then
# `FROM rust:1.95-bookworm@sha256:...`, likewise the distroless one), and
# let your registry's update bot move the pins.

FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
# 1. Dependencies only, cached until Cargo.toml, Cargo.lock, build.rs, the
#    proto or the migrations change: a stub crate with the real manifest
#    builds every dependency (and the generated gRPC code; build.rs embeds
#    the migrations, so it reads them here too).
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto proto
COPY migrations migrations
RUN mkdir src \
 && echo 'fn main() {}' > src/main.rs \
 && touch src/lib.rs \
 && cargo build --release --locked \
 && cargo clean --release --locked --package volume-reconciler \
 && rm -rf src
# 2. The crate itself. `cargo clean --package` above dropped the stub's
#    artifacts, so the real sources always rebuild, whatever their mtimes.
#    The context has no .git: the commit comes in as a build argument.
COPY src src
ARG GIT_SHA=unknown
RUN VOLUME_RECONCILER_GIT_SHA=${GIT_SHA} cargo build --release --locked \
 && strip target/release/volume-reconciler \
 && mkdir -p /data

FROM gcr.io/distroless/cc-debian12
ARG VERSION=0.2.0
ARG GIT_SHA=unknown
ARG CREATED=
ARG SOURCE=
LABEL org.opencontainers.image.title="volume-reconciler" \
      org.opencontainers.image.description="Runs non-idempotent OpenStack Nova volume attach/detach calls exactly once per idempotency key and records their true outcome" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${GIT_SHA}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="gcr.io/distroless/cc-debian12"
COPY --from=build /src/target/release/volume-reconciler /usr/local/bin/volume-reconciler
# The embedded ledger's directory, owned by the runtime user (distroless has
# no shell to make it at run time).
COPY --from=build --chown=10001:10001 /data /var/lib/volume-reconciler
USER 10001:10001
WORKDIR /var/lib/volume-reconciler
VOLUME ["/var/lib/volume-reconciler"]
ENV VOLUME_RECONCILER_LISTEN=0.0.0.0:50051 \
    VOLUME_RECONCILER_ADMIN_LISTEN=0.0.0.0:9090 \
    VOLUME_RECONCILER_LOG_FORMAT=json
EXPOSE 50051 9090
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=5s --timeout=3s --retries=3 \
  CMD ["volume-reconciler", "healthcheck"]
ENTRYPOINT ["volume-reconciler"]
CMD ["serve"]
