# syntax=docker/dockerfile:1
# Multi-stage: build with the Rust toolchain, run on a slim Debian as a
# non-root user. `serve` is the default command; `nova-sim` and `ops` are
# available from the same image.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto proto
COPY migrations migrations
COPY src src
RUN cargo build --release --locked \
 && strip target/release/volume-reconciler

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --create-home --home-dir /var/lib/volume-reconciler volume-reconciler
COPY --from=build /src/target/release/volume-reconciler /usr/local/bin/volume-reconciler
USER 10001
WORKDIR /var/lib/volume-reconciler
ENV VOLUME_RECONCILER_LISTEN=0.0.0.0:50051 \
    VOLUME_RECONCILER_LOG_FORMAT=json
EXPOSE 50051 9090
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=5s --timeout=3s --retries=3 \
  CMD ["volume-reconciler", "healthcheck"]
ENTRYPOINT ["volume-reconciler"]
CMD ["serve"]
