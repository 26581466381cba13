# Shared by the anchor scripts that serve Hearth and llama-server side by side (sourced, not run):
# the model, Hearth's release binaries and llama.cpp built, a scratch data directory removed on
# exit with every server started through `serve`, and `wait_http`.
#
# Sets: models, gguf, llama_bin, data.

models="${HEARTH_MODELS_DIR:-$HOME/.cache/hearth/models}"
gguf="$models/gemma-3-270m-q4_k_m.gguf"

bash scripts/fetch-model.sh >&2
cargo build --release -p hearth-worker -p hearth-orchestrator -p hearth-e2e --bins >&2
llama_bin="$(bash tests/anchor/llama-cpp.sh)"
data="$(mktemp -d)"
anchor_pids=()
anchor_cleanup() {
  for p in "${anchor_pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$data"
}
trap anchor_cleanup EXIT

# serve LOG CMD...: starts CMD in the background with its output in LOG; its pid is in $served.
serve() {
  local log="$1"
  shift
  "$@" >"$log" 2>&1 &
  served=$!
  anchor_pids+=("$served")
}

# stop PID: stops a server started by `serve` and waits for it.
stop() {
  kill "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}

wait_http() { # url
  for _ in $(seq 1 300); do
    curl -fsS -o /dev/null "$1" 2>/dev/null && return 0
    sleep 0.5
  done
  echo "$(basename "$0"): $1 did not come up" >&2
  return 1
}
