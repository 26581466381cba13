# The CPU worker image (`hearth-worker serve`). Build from the repository root:
#   docker build -f deploy/docker/worker.Dockerfile -t hearth-worker:local .
# The GPU variant is worker-cuda.Dockerfile.
ARG RUST_IMAGE=rust:1.89-slim-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${RUST_IMAGE} AS builder
WORKDIR /src
# Portable SIMD level (AVX2 + FMA) rather than the build machine's: see README "Build targets".
ENV RUSTFLAGS="-C target-cpu=x86-64-v3" CARGO_TERM_COLOR=never CARGO_INCREMENTAL=0
# Only what cargo reads, so that a change to deploy/ or web/ does not rebuild the workspace.
COPY Cargo.toml Cargo.lock ./
COPY proto proto
COPY migrations migrations
COPY shared shared
COPY gpu-worker gpu-worker
COPY orchestrator orchestrator
COPY tests tests
RUN cargo build --release --locked -p hearth-orchestrator -p hearth-worker \
 && mkdir -p /out && cp target/release/hearth target/release/hearth-worker /out/ \
 && strip /out/hearth /out/hearth-worker

FROM ${RUNTIME_IMAGE}
RUN echo 'hearth:x:10001:10001:hearth:/var/lib/hearth:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'hearth:x:10001:' >> /etc/group \
 && mkdir -p /var/lib/hearth /models \
 && chown 10001:10001 /var/lib/hearth /models
COPY --from=builder /out/hearth-worker /usr/local/bin/hearth-worker
COPY deploy/docker/probe.sh /usr/local/bin/hearth-probe
COPY deploy/docker/worker-entrypoint.sh /usr/local/bin/hearth-worker-entrypoint
# gRPC on 50051, /metrics /healthz /readyz on 9091, both on every interface of the container.
ENV HEARTH_WORKER_LISTEN=0.0.0.0:50051 \
    HEARTH_WORKER_METRICS_LISTEN=0.0.0.0:9091 \
    HEARTH_MODELS_DIR=/models \
    RUST_LOG=warn
USER 10001:10001
WORKDIR /var/lib/hearth
EXPOSE 50051 9091
# Liveness; /readyz on the same port says whether the model is loaded.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["hearth-probe", "9091", "/healthz"]
ENTRYPOINT ["hearth-worker-entrypoint"]
