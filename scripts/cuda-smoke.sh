#!/usr/bin/env bash
# Checks a `--features cuda` hearth-worker on a machine without a GPU, against the link stubs
# (scripts/cuda-link-stubs.sh), which answer every call with an error as a missing driver would:
# the binary needs the CUDA libraries by their sonames, `--device cuda:0` is refused with a
# message naming the device, and `--device auto` serves the model on the CPU.
#
#   scripts/cuda-smoke.sh target/cuda/hearth-worker
set -euo pipefail
bin="${1:?usage: cuda-smoke.sh HEARTH_WORKER_BINARY}"
cd "$(dirname "$0")/.."
eval "$(scripts/cuda-toolchain.sh --link 2>/dev/null)"
export LD_LIBRARY_PATH="$CUDA_ROOT/lib/stubs:$CUDA_ROOT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
model="${HEARTH_MODELS_DIR:-$HOME/.cache/hearth/models}/gemma-3-270m-q4_k_m.gguf"
[ -f "$model" ] || { echo "cuda-smoke: $model missing (make fetch-model)" >&2; exit 1; }
fail() { echo "cuda-smoke: FAILED: $*" >&2; exit 1; }

needed="$(readelf -d "$bin" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | tr '\n' ' ')"
# (The linker drops the libraries nothing calls, NVRTC and cuBLASLt among them.)
for lib in libcuda.so.1 libcudart.so.13 libcublas.so.13 libcurand.so.10; do
    [[ " $needed" == *" $lib "* ]] || fail "$bin does not need $lib (needs: $needed)"
done
echo "cuda-smoke: $(du -h "$bin" | cut -f1) binary; needs $needed"

out="$("$bin" serve --model "$model" --device cuda:0 --listen 127.0.0.1:0 \
    --metrics-listen 127.0.0.1:0 2>&1)" && fail "--device cuda:0 started without a GPU"
grep -q "cuda:0 is not usable" <<<"$out" || fail "--device cuda:0 without a GPU said: $out"
echo "cuda-smoke: --device cuda:0 refused: $(grep -o 'device: cuda:0 is not usable.*' <<<"$out" | head -1)"

log="$(mktemp)"
"$bin" serve --model "$model" --device auto --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
    --kv-budget 256MiB >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -f "$log"' EXIT
metrics=""
for _ in $(seq 300); do
    metrics="$(sed -n 's/.*"metrics":"\([^"]*\)".*/\1/p' "$log" | head -1)"
    if [ -n "$metrics" ] && curl -sf "http://$metrics/readyz" >/dev/null 2>&1; then
        break
    fi
    kill -0 $pid 2>/dev/null || fail "--device auto exited: $(cat "$log")"
    sleep 0.1
done
ready="$(curl -sf "http://$metrics/readyz")" || fail "--device auto never became ready: $(cat "$log")"
grep -q '"cpu"' <<<"$ready" || fail "--device auto without a GPU is not on the CPU: $ready"
echo "cuda-smoke: --device auto without a GPU serves on the CPU: $ready"
