#!/usr/bin/env bash
# Full stack against llama-server, one after the other on this machine with the same GGUF and the
# same hearth-bench workload: single-turn OpenAI chat completions streamed over SSE, INPUT_WORDS
# words of prompt, TOKENS-token replies (end-of-turn ignored), at 1, 16 and 64 requests in flight
# (LEVELS), 2 × the level requests per level (at least 8). Hearth runs with its embedded defaults
# (one local worker, SQLite in a temporary directory); llama-server with `-np N` for each level N
# (at least 16: `-np 16` serves levels 1 and 16). Writes the JSON reports to OUT and prints
# aggregate tok/s, TTFT p50 and ITL p50/p99 side by side with their ratios. With RATE set (requests
# per second), a Poisson phase follows on both (RATE_REQUESTS requests, default 48; llama-server
# with `-np 16`): new prompts arriving while replies stream, for ITL p99 against p50.
#
# llama-server's OpenAI chat endpoint formats the messages as ChatML (the GGUF carries no chat
# template), Hearth as Gemma turns: prompts differ by a few marker tokens.
set -euo pipefail
cd "$(dirname "$0")/../.."

levels="${LEVELS:-1,16,64}" tokens="${TOKENS:-128}" words="${INPUT_WORDS:-128}"
out="${OUT:-target/anchor/full-stack}" threads="${THREADS:-$(nproc)}"
hearth_port="${HEARTH_PORT:-18080}" llama_port="${LLAMA_PORT:-18081}"
source tests/anchor/common.sh
mkdir -p "$out"
server=""

stop_server() {
  stop "$server"
  server=""
}

bench() { # name url level
  local requests=$(($3 * 2))
  ((requests < 8)) && requests=8
  # A seed per level: each level's prompts are new to the server (none cached from the last).
  ./target/release/hearth-bench --url "$2" --api openai --workload sweep --concurrency "$3" \
    --requests "$requests" --input-words "$words" --output-tokens "$tokens" --seed "$3" \
    --label "$1 c$3" --quiet --out "$out/$1-c$3.json" | tee "$out/$1-c$3.txt" >&2
}

IFS=, read -r -a level_list <<<"$levels"
rate="${RATE:-}" rate_requests="${RATE_REQUESTS:-48}"

poisson() { # name url
  [[ -z "$rate" ]] && return 0
  # A seed of its own: the prompts would otherwise be the sweep's, already cached.
  ./target/release/hearth-bench --url "$2" --api openai --workload rate --rate "$rate" \
    --requests "$rate_requests" --input-words "$words" --output-tokens "$tokens" --seed 1000 \
    --label "$1 rate $rate" --quiet --out "$out/$1-rate.json" | tee "$out/$1-rate.txt" >&2
}

HEARTH_DATA_DIR="$data" HEARTH_LISTEN="127.0.0.1:$hearth_port" HEARTH_MODELS_DIR="$models" \
  serve "$out/hearth.log" ./target/release/hearth
server=$served
wait_http "http://127.0.0.1:$hearth_port/readyz"
for c in "${level_list[@]}"; do bench hearth "http://127.0.0.1:$hearth_port" "$c"; done
poisson hearth "http://127.0.0.1:$hearth_port"
stop_server

slots_for() { (($1 < 16)) && echo 16 || echo "$1"; }
running_slots=""
for c in "${level_list[@]}"; do
  slots="$(slots_for "$c")"
  if [[ "$slots" != "$running_slots" ]]; then
    [[ -n "$server" ]] && stop_server
    serve "$out/llama-server-np$slots.log" "$llama_bin/llama-server" -m "$gguf" \
      --host 127.0.0.1 --port "$llama_port" -np "$slots" -c $((slots * 2048)) -t "$threads"
    server=$served
    running_slots="$slots"
    wait_http "http://127.0.0.1:$llama_port/health"
  fi
  bench llama-server "http://127.0.0.1:$llama_port" "$c"
done
if [[ -n "$rate" && "$running_slots" != 16 ]]; then
  [[ -n "$server" ]] && stop_server
  serve "$out/llama-server-np16.log" "$llama_bin/llama-server" -m "$gguf" --host 127.0.0.1 \
    --port "$llama_port" -np 16 -c $((16 * 2048)) -t "$threads"
  server=$served
  wait_http "http://127.0.0.1:$llama_port/health"
fi
poisson llama-server "http://127.0.0.1:$llama_port"
stop_server

python3 - "$out" "$levels" "$rate" <<'PY'
import json, sys
out, levels, rate = sys.argv[1], [int(c) for c in sys.argv[2].split(",")], sys.argv[3]
def row(name, c):
    return json.load(open(f"{out}/{name}-c{c}.json"))["results"][0]
print(f"{'streams':>7} | {'hearth tok/s':>12} {'llama tok/s':>11} {'ratio':>5} | "
      f"{'TTFT p50 ms h/l':>17} | {'ITL p50 ms h/l':>15} | {'ITL p99 ms h/l':>15} | "
      f"{'stream tok/s h/l':>16}")
for c in levels:
    h, l = row("hearth", c), row("llama-server", c)
    for r, name in ((h, "hearth"), (l, "llama-server")):
        if r["errors"]:
            print(f"warning: {name} at {c} streams had {r['errors']} errors: {r['error_examples'][:1]}")
    ht, lt = h["output_tokens_per_s"], l["output_tokens_per_s"]
    print(f"{c:>7} | {ht:>12.1f} {lt:>11.1f} {ht / lt:>5.2f} | "
          f"{h['ttft_ms']['p50']:>8.0f}/{l['ttft_ms']['p50']:<8.0f} | "
          f"{h['itl_ms']['p50']:>7.1f}/{l['itl_ms']['p50']:<7.1f} | "
          f"{h['itl_ms']['p99']:>7.1f}/{l['itl_ms']['p99']:<7.1f} | "
          f"{h['per_stream_tokens_per_s']:>7.1f}/{l['per_stream_tokens_per_s']:<8.1f}")
if rate:
    for name in ("hearth", "llama-server"):
        r = json.load(open(f"{out}/{name}-rate.json"))["results"][0]
        itl = r["itl_ms"]
        print(f"Poisson {rate}/s, {name}: ITL p50 {itl['p50']:.1f} ms, p99 {itl['p99']:.1f} ms "
              f"(p99/p50 {itl['p99'] / itl['p50']:.2f}), TTFT p50 {r['ttft_ms']['p50']:.0f} ms, "
              f"{r['output_tokens_per_s']:.1f} tok/s, {r['errors']} errors")
PY
