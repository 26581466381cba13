#!/usr/bin/env bash
# What tracing costs at 64 concurrent streams through the whole stack: `hearth` (release) with
# its local worker on the real model, once with tracing off and once with every trace sampled
# (OTEL_TRACES_SAMPLER_ARG=1) and sent to a real OTLP/gRPC receiver (`hearth-otlp-sink`),
# alternately, ROUNDS times, in one run. Each run is `hearth-bench` at concurrency 64; it prints
# the output tokens/s and the CPU time the orchestrator and the worker spent per output token,
# then the medians and their ratios (traced over untraced), and the spans the receiver got.
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds="${ROUNDS:-3}"
requests="${REQUESTS:-128}"
tokens="${TOKENS:-64}"
scratch="$(mktemp -d)"
sink_pid=""
cleanup() {
  [ -n "$sink_pid" ] && kill "$sink_pid" 2>/dev/null || true
  rm -rf "$scratch"
}
trap cleanup EXIT

cargo build --release -p hearth-orchestrator -p hearth-worker -p hearth-e2e --bins >&2
ticks="$(getconf CLK_TCK)"
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }

./target/release/hearth-otlp-sink >"$scratch/sink.json" 2>"$scratch/sink.log" &
sink_pid=$!
for _ in $(seq 1 100); do
  [ -s "$scratch/sink.json" ] && break
  sleep 0.1
done
sink="$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["listening"])' "$scratch/sink.json")"

# One run, traced or not (`$1`: off or on); prints `label tok_s hearth_us_per_token worker_us_per_token`.
run() {
  local label="$1" dir
  dir="$(mktemp -d -p "$scratch")"
  local -a env=(env -u OTEL_EXPORTER_OTLP_ENDPOINT)
  if [ "$label" = on ]; then
    env=(env "OTEL_EXPORTER_OTLP_ENDPOINT=http://$sink" OTEL_TRACES_SAMPLER_ARG=1)
  fi
  "${env[@]}" ./target/release/hearth --listen 127.0.0.1:0 --data-dir "$dir/data" \
    >"$dir/hearth.json" 2>"$dir/hearth.log" </dev/null &
  local hearth=$!
  local url=""
  for _ in $(seq 1 600); do
    url="$(python3 -c 'import json,sys
try: print("http://" + json.loads(open(sys.argv[1]).readline())["listening"]["http"])
except Exception: pass' "$dir/hearth.json")"
    if [ -n "$url" ] && curl -sf "$url/readyz" >/dev/null; then break; fi
    sleep 0.5
  done
  local worker
  worker="$(pgrep -P "$hearth" -f hearth-worker | head -1)"
  local h0 w0 h1 w1
  h0="$(cpu "$hearth")"
  w0="$(cpu "$worker")"
  ./target/release/hearth-bench --url "$url" --workload sweep --concurrency 64 \
    --requests "$requests" --output-tokens "$tokens" --input-words 32 --quiet \
    --out "$dir/report.json" >&2
  h1="$(cpu "$hearth")"
  w1="$(cpu "$worker")"
  kill "$hearth" 2>/dev/null || true
  wait "$hearth" 2>/dev/null || true
  python3 - "$dir/report.json" "$label" "$h0" "$h1" "$w0" "$w1" "$ticks" <<'PY'
import json, sys
report, label, h0, h1, w0, w1, ticks = sys.argv[1:]
level = json.load(open(report))["results"][0]
if level["errors"]:
    sys.exit(f"{label}: {level['errors']} requests failed")
tokens = level["output_tokens"]
us = lambda a, b: (float(b) - float(a)) / float(ticks) * 1e6 / tokens
print(f"{label} {level['output_tokens_per_s']:.1f} {us(h0, h1):.1f} {us(w0, w1):.1f}")
PY
}

results="$scratch/results"
for _ in $(seq 1 "$rounds"); do
  run off | tee -a "$results"
  run on | tee -a "$results"
done
kill "$sink_pid"
wait "$sink_pid" 2>/dev/null || true
sink_pid=""
python3 - "$results" "$scratch/sink.json" <<'PY'
import json, statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
def med(label, i):
    return statistics.median(float(r[i]) for r in rows if r[0] == label)
print(f"{'':26}{'tracing off':>12}{'on (ratio 1)':>14}{'ratio':>8}")
for name, i in [("output tok/s", 1), ("hearth CPU µs/token", 2), ("worker CPU µs/token", 3)]:
    off, on = med("off", i), med("on", i)
    print(f"{name:26}{off:>12.1f}{on:>14.1f}{on / off if off else 0:>8.3f}")
lines = open(sys.argv[2]).read().split("\n")
print("spans received:", json.loads(lines[1])["spans"] if len(lines) > 1 and lines[1] else "?")
PY
