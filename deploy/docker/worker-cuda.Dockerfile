# The GPU worker image: `hearth-worker` built with `--features cuda` on NVIDIA's CUDA images.
# Build from the repository root (needs network access for rustup and the CUDA base images):
#   docker build -f deploy/docker/worker-cuda.Dockerfile -t hearth-worker:cuda .
# Run with the NVIDIA container toolkit (`--gpus all`, or the compose `gpu` profile) and
# HEARTH_WORKER_DEVICE=cuda:0.
#
# CUDA_VERSION is the toolkit of the image and so the CUDA version the hosts' driver must reach:
# most kernels ship as PTX that the driver compiles at first use, and a driver refuses PTX from
# a newer toolkit (13.0 is driver 580's). Keep CUDARC_CUDA_VERSION (major, minor, 0) in step.
ARG CUDA_VERSION=13.0.1
ARG UBUNTU=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS builder
ARG RUST_VERSION=1.89.0
# Kernels are compiled for this compute capability (90: H100 and H200; 80: A100). Without it the
# build asks nvidia-smi, which a build container does not have.
ARG CUDA_COMPUTE_CAP=90
ARG CUDARC_CUDA_VERSION=13000
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl gcc libc6-dev pkg-config python3 \
 && rm -rf /var/lib/apt/lists/*
RUN curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain ${RUST_VERSION}
ENV PATH=/root/.cargo/bin:${PATH} \
    RUSTFLAGS="-C target-cpu=x86-64-v3" \
    CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP} \
    CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION} \
    CARGO_TERM_COLOR=never CARGO_INCREMENTAL=0
WORKDIR /src
COPY . .
# The device-code check fails the build on PTX newer than the driver accepts or code missing for
# the compute capability.
RUN cargo build --release --locked -p hearth-worker --features cuda \
 && mkdir -p /out && cp target/release/hearth-worker /out/ && strip /out/hearth-worker \
 && python3 scripts/cuda-check-binary.py /out/hearth-worker \
      --cuda "$(echo ${CUDA_VERSION} | cut -d. -f1,2)" --arch ${CUDA_COMPUTE_CAP}

# The runtime image carries the CUDA runtime, cuBLAS and cuRAND, which the worker links; the
# driver comes from the host through the NVIDIA container toolkit.
FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU}
RUN echo 'hearth:x:10001:10001:hearth:/var/lib/hearth:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'hearth:x:10001:' >> /etc/group \
 && mkdir -p /var/lib/hearth /models \
 && chown 10001:10001 /var/lib/hearth /models
COPY --from=builder /out/hearth-worker /usr/local/bin/hearth-worker
COPY deploy/docker/probe.sh /usr/local/bin/hearth-probe
COPY deploy/docker/worker-entrypoint.sh /usr/local/bin/hearth-worker-entrypoint
ENV HEARTH_WORKER_LISTEN=0.0.0.0:50051 \
    HEARTH_WORKER_METRICS_LISTEN=0.0.0.0:9091 \
    HEARTH_WORKER_DEVICE=cuda:0 \
    HEARTH_MODELS_DIR=/models \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    RUST_LOG=warn
USER 10001:10001
WORKDIR /var/lib/hearth
EXPOSE 50051 9091
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD ["hearth-probe", "9091", "/healthz"]
ENTRYPOINT ["hearth-worker-entrypoint"]
