#!/usr/bin/env bash
# Packs what the GPU check (scripts/gpu-bench.sh) needs on a GPU host that has no Rust toolchain
# and no network into gpu-bundle/ (ignored by git; carried to the host beside the checkout):
# the stripped CUDA worker from `make build-cuda`, xz-compressed, and the trimmed llama.cpp
# sources (scripts/llama-cpp-source.sh); with --llama also llama.cpp built here for the GPU
# (scripts/llama-cpp-cuda.sh, about an hour on 2 cores the first time), which the check then
# runs instead of building it on the host. Fails if the bundle is over 60 MiB.
#
#   make build-cuda && bash scripts/gpu-pack.sh [--llama]
#   # on the GPU host, from the checkout's root:
#   bash scripts/gpu-bench.sh --bundle gpu-bundle --out "$OUT"
set -euo pipefail
cd "$(dirname "$0")/.."
llama=0 bin=target/cuda/hearth-worker
for a in "$@"; do
  case "$a" in --llama) llama=1 ;; *) bin="$a" ;; esac
done
dest=gpu-bundle
[[ -x "$bin" ]] || { echo "gpu-pack: $bin missing (make build-cuda)" >&2; exit 1; }
python3 scripts/cuda-check-binary.py "$bin" --cuda "${HEARTH_CUDA_VERSION:-13.0}" --arch "${CUDA_COMPUTE_CAP:-90}"
rm -rf "$dest"
mkdir -p "$dest"
xz -9 -T0 -c "$bin" >"$dest/hearth-worker.xz"
src="$(bash scripts/llama-cpp-source.sh "target/llama.cpp-src")"
tar czf "$dest/llama.cpp.tar.gz" -C "$(dirname "$src")" "$(basename "$src")"
((llama)) && bash scripts/llama-cpp-cuda.sh "$dest/llama-cuda.tar.xz"
total=$(du -cb "$dest"/* | tail -1 | cut -f1)
ls -l "$dest" >&2
echo "gpu-pack: $dest holds $((total >> 20)) MiB" >&2
((total < 60 << 20)) || { echo "gpu-pack: over the 60 MiB a GPU call carries" >&2; exit 1; }
