#!/usr/bin/env bash
# What publishing native replies' events to Redis (so that any replica can resume them) costs
# per token at 64 concurrent streams: `hearth` built from BASE (default 9e935a2, the last commit
# before the shared streams) against this tree's, alternately, ROUNDS times, both with
# --redis-url, over a scripted worker (no model: one token every TOKEN_MS per reply), so that
# the orchestrator's own work is what differs. Each run is `hearth-bench --api native` at
# concurrency 64; it prints the orchestrator's and redis-server's CPU time per output token and
# the output tokens/s, then the medians and their ratios (this tree over BASE).
#
# Needs Redis at REDIS_URL (default redis://127.0.0.1:6379) on this machine. BASE is built in a
# scratch worktree with its own target directory (OLD_TARGET keeps it between runs).
set -euo pipefail
cd "$(dirname "$0")/../.."
base="${BASE:-9e935a2}"
rounds="${ROUNDS:-3}"
token_ms="${TOKEN_MS:-2}"
requests="${REQUESTS:-256}"
tokens="${TOKENS:-256}"
redis="${REDIS_URL:-redis://127.0.0.1:6379}"
scratch="$(mktemp -d)"
old_target="${OLD_TARGET:-$scratch/target}"
cleanup() {
  git worktree remove --force "$scratch/base" >/dev/null 2>&1 || true
  rm -rf "$scratch"
}
trap cleanup EXIT

cargo build --release -p hearth-orchestrator -p hearth-worker -p hearth-e2e --bins >&2
git worktree add --detach "$scratch/base" "$base" >&2
(cd "$scratch/base" && CARGO_TARGET_DIR="$old_target" cargo build --release -p hearth-orchestrator --bin hearth >&2)
cp "$old_target/release/hearth" "$scratch/hearth-base"
cp target/release/hearth "$scratch/hearth-this"
redis_pid="$(pgrep -xo redis-server)"
ticks="$(getconf CLK_TCK)"

cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# One run of `$1` (a hearth binary); prints `label cpu_us_per_token redis_us_per_token tok_s`.
run() {
  local bin="$1" label="$2" dir
  dir="$(mktemp -d -p "$scratch")"
  ./target/release/hearth-stack --hearth-bin "$bin" --worker-bin target/release/hearth-worker \
    --scripted-token-ms "$token_ms" --hearth-arg="--redis-url=$redis" \
    >"$dir/stack.json" 2>"$dir/stack.log" </dev/null &
  local stack=$!
  for _ in $(seq 1 240); do
    [ -s "$dir/stack.json" ] && break
    sleep 0.5
  done
  local url pid c0 r0 c1 r1
  url="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["url"])' "$dir/stack.json")"
  pid="$(pgrep -n -f "^$bin ")"
  c0="$(cpu "$pid")"
  r0="$(cpu "$redis_pid")"
  ./target/release/hearth-bench --url "$url" --api native --workload sweep --concurrency 64 \
    --requests "$requests" --output-tokens "$tokens" --input-words 16 --quiet \
    --out "$dir/report.json" >&2
  c1="$(cpu "$pid")"
  r1="$(cpu "$redis_pid")"
  kill "$stack" 2>/dev/null || true
  wait "$stack" 2>/dev/null || true
  python3 - "$dir/report.json" "$label" "$c0" "$c1" "$r0" "$r1" "$ticks" <<'PY'
import json, sys
report, label, c0, c1, r0, r1, ticks = sys.argv[1:]
r = json.load(open(report))
level = r["results"][0]
if level["errors"]:
    sys.exit(f"{label}: {level['errors']} requests failed")
tokens = level["output_tokens"]
tps = level["output_tokens_per_s"]
us = lambda a, b: (float(b) - float(a)) / float(ticks) * 1e6 / tokens
print(f"{label} {us(c0, c1):.2f} {us(r0, r1):.2f} {tps:.0f}")
PY
}

results="$scratch/results"
for round in $(seq 1 "$rounds"); do
  run "$scratch/hearth-base" base | tee -a "$results"
  run "$scratch/hearth-this" this | tee -a "$results"
done
python3 - "$results" "$base" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
def med(label, i):
    return statistics.median(float(r[i]) for r in rows if r[0] == label)
print(f"{'':22}{'base ' + sys.argv[2]:>14}{'this tree':>14}{'ratio':>8}")
for name, i in [("hearth CPU µs/token", 1), ("redis CPU µs/token", 2), ("output tok/s", 3)]:
    b, t = med("base", i), med("this", i)
    ratio = f"{t / b:.2f}" if b else "-"
    print(f"{name:22}{b:>14.2f}{t:>14.2f}{ratio:>8}")
PY
