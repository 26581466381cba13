#!/usr/bin/env bash
# Installs the CUDA compiler and headers that candle's CUDA kernels need at build time, from PyPI
# (no system CUDA install), into a virtual environment, and prints the environment variables a
# `--features cuda` build needs. Idempotent.
#
#   eval "$(scripts/cuda-toolchain.sh)" && cargo check -p hearth-worker --features cuda
#   eval "$(scripts/cuda-toolchain.sh --link)" && cargo build -p hearth-worker --features cuda
#
# With --link it also writes link stubs for the driver and the CUDA libraries candle links
# (scripts/cuda-link-stubs.sh) where the build looks for them, so a `cuda` binary links on a
# machine without a GPU; the GPU host supplies the real libraries at run time.
#
# HEARTH_CUDA_DIR (default ~/.cache/hearth/cuda) holds the environment; CUDA_COMPUTE_CAP (default
# 90, Hopper) picks the GPU generation candle's kernels are compiled for.
set -euo pipefail

dir="${HEARTH_CUDA_DIR:-$HOME/.cache/hearth/cuda}"
cap="${CUDA_COMPUTE_CAP:-90}"
# cudarc names the toolkit versions it knows; 13.4's API serves newer 13.x compilers.
cudarc_version="${CUDARC_CUDA_VERSION:-13040}"

if [ ! -x "$dir/venv/bin/python" ]; then
    echo "cuda-toolchain: creating $dir/venv" >&2
    python3 -m venv "$dir/venv"
fi
root="$("$dir/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia/cu13"
if [ ! -x "$root/bin/nvcc" ]; then
    echo "cuda-toolchain: installing nvcc, runtime headers and CCCL from PyPI" >&2
    "$dir/venv/bin/pip" install --quiet nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cuda-cccl >&2
fi
"$root/bin/nvcc" --version | tail -1 >&2
if [ "${1:-}" = "--link" ] && [ ! -e "$root/lib/stubs/libcuda.so" ]; then
    bash "$(dirname "$0")/cuda-link-stubs.sh" "$root/lib/stubs" "${cudarc_version:0:2}" >&2
    # The runtime library comes with the wheel, under its soname only; the linker wants the
    # plain name (candle's kernels link it).
    ln -sf "../$(cd "$root/lib" && ls libcudart.so.* | head -1)" "$root/lib/stubs/libcudart.so"
fi

cat <<ENV
export CUDA_ROOT="$root" CUDA_PATH="$root" CUDA_HOME="$root"
export PATH="$root/bin:\$PATH"
export CUDA_COMPUTE_CAP="$cap" CUDARC_CUDA_VERSION="$cudarc_version"
export NVCC_APPEND_FLAGS="-I$root/cccl/include -I$root/include"
ENV
