#!/usr/bin/env bash
# Builds llama.cpp's llama-bench and llama-batched-bench with CUDA, for one GPU architecture, with
# the toolkit pinned to the GPU hosts' driver (scripts/cuda-toolchain.sh, plus cuBLAS), on a
# machine without a GPU, and packs the two binaries and their shared libraries into TARBALL
# (xz), for the GPU check to run instead of building there (scripts/gpu-pack.sh --llama). About
# an hour on 2 cores; the build directory is kept, so a second run only relinks.
#
#   scripts/llama-cpp-cuda.sh gpu-bundle/llama-cuda.tar.xz
set -euo pipefail
cd "$(dirname "$0")/.."
tarball="${1:?usage: llama-cpp-cuda.sh TARBALL}"
eval "$(scripts/cuda-toolchain.sh --link --cublas)"
src="$(bash scripts/llama-cpp-source.sh "target/llama.cpp-src")"
build="target/llama.cpp-cuda-$HEARTH_CUDA_VERSION-sm$CUDA_COMPUTE_CAP"
lib() { ls "$CUDA_ROOT"/lib/"$1".so.* | head -1; }
command -v cmake >/dev/null || { echo "llama-cpp-cuda: cmake is missing (apt-get install cmake)" >&2; exit 1; }
# The wheels carry versioned libraries only: name them, and the driver's link stub; the tools'
# link resolves libggml-cuda's needs through -rpath-link (the host supplies them at run time).
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DBUILD_SHARED_LIBS=ON \
  -DGGML_CUDA=ON -DGGML_NATIVE=OFF "-DCMAKE_CUDA_ARCHITECTURES=$CUDA_COMPUTE_CAP" \
  "-DCMAKE_CUDA_COMPILER=$CUDA_ROOT/bin/nvcc" "-DCUDAToolkit_ROOT=$CUDA_ROOT" \
  "-DCUDA_cudart_LIBRARY=$(lib libcudart)" "-DCUDA_cublas_LIBRARY=$(lib libcublas)" \
  "-DCUDA_cublasLt_LIBRARY=$(lib libcublasLt)" "-DCUDA_cuda_driver_LIBRARY=$CUDA_ROOT/lib/stubs/libcuda.so" \
  "-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,$CUDA_ROOT/lib:$CUDA_ROOT/lib/stubs" \
  "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,-rpath-link,$CUDA_ROOT/lib:$CUDA_ROOT/lib/stubs" >&2
cmake --build "$build" -j "$(nproc)" --target llama-bench llama-batched-bench >&2
mkdir -p "$(dirname "$tarball")"
(cd "$build/bin" && strip --strip-unneeded llama-bench llama-batched-bench lib*.so* 2>/dev/null || true
 tar cf - llama-bench llama-batched-bench lib*.so*) | xz -9 -T0 >"$tarball"
python3 scripts/cuda-check-binary.py "$build/bin/libggml-cuda.so" --cuda "$HEARTH_CUDA_VERSION" --arch "$CUDA_COMPUTE_CAP" >&2
echo "llama-cpp-cuda: $tarball ($(du -h "$tarball" | cut -f1))" >&2
