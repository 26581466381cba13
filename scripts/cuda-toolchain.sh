#!/usr/bin/env bash
# Installs the CUDA compiler and headers that candle's CUDA kernels and Hearth's own need at build
# time, from PyPI (no system CUDA install), into a virtual environment, and prints the environment
# variables a `--features cuda` build needs. Idempotent.
#
#   eval "$(scripts/cuda-toolchain.sh)" && cargo check -p hearth-worker --features cuda
#   eval "$(scripts/cuda-toolchain.sh --link)" && cargo build -p hearth-worker --features cuda
#   eval "$(scripts/cuda-toolchain.sh --link --cublas)"     # also cuBLAS (llama.cpp's CUDA build)
#
# The toolkit is pinned to the CUDA version of the GPU hosts' driver, HEARTH_CUDA_VERSION (default
# 13.0: driver 580). A driver refuses PTX from a newer toolkit than its own, and candle ships most
# of its kernels as PTX that the driver compiles at first use, so a newer nvcc builds a worker
# that loads its model and then fails at its first kernel. cudarc's driver API is pinned to the
# same version (CUDARC_CUDA_VERSION), so the binary calls no function that driver lacks. Set
# HEARTH_CUDA_VERSION=13.2 (say) for hosts with a newer driver; 12.x selects the `-cu12` wheels.
#
# With --link it also writes link stubs for the driver and the CUDA libraries candle links
# (scripts/cuda-link-stubs.sh) where the build looks for them, so a `cuda` binary links on a
# machine without a GPU; the GPU host supplies the real libraries at run time.
#
# HEARTH_CUDA_DIR (default ~/.cache/hearth/cuda) holds one environment per CUDA version;
# CUDA_COMPUTE_CAP (default 90: H100, H200) picks the GPU generation kernels are compiled for.
set -euo pipefail

version="${HEARTH_CUDA_VERSION:-13.0}"
[[ "$version" =~ ^(1[2-9])\.([0-9]+)$ ]] ||
    { echo "cuda-toolchain: HEARTH_CUDA_VERSION must be MAJOR.MINOR (12.4, 13.0), got '$version'" >&2; exit 1; }
major="${BASH_REMATCH[1]}" minor="${BASH_REMATCH[2]}"
dir="${HEARTH_CUDA_DIR:-$HOME/.cache/hearth/cuda}/$version"
cap="${CUDA_COMPUTE_CAP:-90}"
cudarc_version="$major$(printf '%02d' "$minor")0"

if [ ! -x "$dir/venv/bin/python" ]; then
    echo "cuda-toolchain: creating $dir/venv" >&2
    python3 -m venv "$dir/venv"
fi
site="$("$dir/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [ "$major" -ge 13 ]; then
    # One tree, nvidia/cu13, holds the compiler, headers and libraries.
    root="$site/nvidia/cu$major"
    # nvcc's own dependencies (NVVM, which writes the PTX, and the CRT headers) are unpinned in
    # its wheel: pinned here too, or pip brings the newest NVVM and its newer PTX.
    wheels=(nvidia-cuda-nvcc nvidia-nvvm nvidia-cuda-crt nvidia-cuda-runtime nvidia-cuda-cccl)
else
    # The cu12 wheels each install their own tree; gather them in one.
    root="$dir/root"
    wheels=(nvidia-cuda-nvcc-cu12 nvidia-cuda-runtime-cu12 nvidia-cuda-cccl-cu12)
fi
# The PTX ISA version a toolkit writes: 12.x writes 8.x (8.5 from 12.5 on, 8.7 from 12.8), 13.x 9.x.
ptx_isa() { "$root/bin/nvcc" -x cu -arch=sm_${cap} --ptx -o - /dev/null 2>/dev/null | sed -n 's/^\.version //p'; }
if ! "$root/bin/nvcc" --version 2>/dev/null | grep -q "release $version," || [ -z "$(ptx_isa)" ]; then
    echo "cuda-toolchain: installing nvcc, runtime headers and CCCL $version.* from PyPI" >&2
    "$dir/venv/bin/pip" install --quiet --upgrade "${wheels[@]/%/==$version.*}" >&2
    if [ "$major" -lt 13 ]; then
        mkdir -p "$root/bin" "$root/include" "$root/lib"
        for part in cuda_nvcc cuda_runtime cuda_cccl; do
            for sub in bin include lib nvvm; do
                [ -d "$site/nvidia/$part/$sub" ] && cp -rs "$site/nvidia/$part/$sub/." "$root/$sub/" 2>/dev/null || true
            done
        done
        [ -d "$root/nvvm" ] || ln -sfn "$site/nvidia/cuda_nvcc/nvvm" "$root/nvvm"
    fi
fi
if [[ " $* " == *" --cublas "* ]] && ! ls "$root"/lib/libcublas.so.* >/dev/null 2>&1; then
    echo "cuda-toolchain: installing cuBLAS $version.* from PyPI" >&2
    suffix=$([ "$major" -ge 13 ] || echo "-cu$major")
    "$dir/venv/bin/pip" install --quiet "nvidia-cublas$suffix==$version.*" >&2
fi
# nvcc links its programs from lib64 (nvcc.profile); the wheels install lib.
[ -e "$root/lib64" ] || ln -s lib "$root/lib64"
"$root/bin/nvcc" --version | grep -q "release $version," ||
    { echo "cuda-toolchain: $root/bin/nvcc is not CUDA $version:" >&2; "$root/bin/nvcc" --version >&2; exit 1; }
echo "cuda-toolchain: $("$root/bin/nvcc" --version | tail -1), writes PTX $(ptx_isa)" >&2
if [[ " $* " == *" --link "* ]] && [ ! -e "$root/lib/stubs/libcuda.so" ]; then
    bash "$(dirname "$0")/cuda-link-stubs.sh" "$root/lib/stubs" "$major" >&2
    # The runtime library comes with the wheel, under its soname only; the linker wants the
    # plain name (candle's kernels link it).
    ln -sf "../$(cd "$root/lib" && ls libcudart.so.* | head -1)" "$root/lib/stubs/libcudart.so"
fi

cat <<ENV
export CUDA_ROOT="$root" CUDA_PATH="$root" CUDA_HOME="$root"
export PATH="$root/bin:\$PATH"
export HEARTH_CUDA_VERSION="$version" CUDA_COMPUTE_CAP="$cap" CUDARC_CUDA_VERSION="$cudarc_version"
export NVCC_APPEND_FLAGS="-I$root/cccl/include -I$root/include"
ENV
