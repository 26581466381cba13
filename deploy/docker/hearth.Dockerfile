# The orchestrator image (`hearth`). Build from the repository root:
#   docker build -f deploy/docker/hearth.Dockerfile -t hearth:local .
#
# The builder stage is the same text in worker.Dockerfile, so Docker builds the workspace once
# and both images reuse that layer. The `web` stage builds the chat UI (web/, a Next.js static
# export) that `hearth` serves at `/`; Next.js needs Node >= 20.9.
ARG RUST_IMAGE=rust:1.89-slim-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim
ARG NODE_IMAGE=node:20-bookworm-slim

# First, so that `--target web` builds the UI alone (the classic builder runs every earlier stage).
FROM ${NODE_IMAGE} AS web
WORKDIR /web
ENV NEXT_TELEMETRY_DISABLED=1 npm_config_fund=false npm_config_audit=false \
    npm_config_update_notifier=false
COPY web/package.json web/package-lock.json ./
# As scripts/build-web.sh: `npm ci` refuses a lock file that lists only Linux builds of the
# platform packages; `npm install` then installs the same locked versions.
RUN npm ci || npm install
COPY web/ ./
RUN npm run build && test -s out/index.html

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
# A fixed non-root user; written directly so the image needs no `passwd` package.
RUN echo 'hearth:x:10001:10001:hearth:/var/lib/hearth:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'hearth:x:10001:' >> /etc/group \
 && mkdir -p /var/lib/hearth /models \
 && chown 10001:10001 /var/lib/hearth /models
COPY --from=builder /out/hearth /usr/local/bin/hearth
COPY --from=web /web/out /usr/share/hearth/web
COPY deploy/docker/probe.sh /usr/local/bin/hearth-probe
# Every flag has a HEARTH_… variable (`hearth --help`); these suit a container. Without auth the
# server refuses a non-loopback address, so keys are on.
ENV HEARTH_LISTEN=0.0.0.0:8080 \
    HEARTH_AUTH=keys \
    HEARTH_MODELS_DIR=/models \
    HEARTH_DATA_DIR=/var/lib/hearth \
    HEARTH_WEB_DIR=/usr/share/hearth/web \
    RUST_LOG=warn
USER 10001:10001
WORKDIR /var/lib/hearth
EXPOSE 8080
# Ready = database reachable and at least one worker ready (JSON on /readyz); /healthz is
# liveness only.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD ["hearth-probe", "8080", "/readyz"]
ENTRYPOINT ["hearth"]
