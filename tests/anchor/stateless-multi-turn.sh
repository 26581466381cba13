#!/usr/bin/env bash
# Stateless multi-turn chat, Hearth against llama-server, one after the other on this machine with
# the same GGUF and the same hearth-bench workload: SESSIONS conversations of TURNS turns, CLIENTS
# requests in flight, TOKENS-token replies, every request resending the whole history over the
# OpenAI API (as OpenAI-compatible chat UIs do). Hearth runs with its embedded defaults (one local
# worker, SQLite in a temporary directory); llama-server with `-np SLOTS` (its prompt cache reuses
# each slot's longest common prefix). Writes both JSON reports to OUT and prints the last turn's
# TTFT p50 of each, their ratio and Hearth's cached share.
#
# llama-server's OpenAI chat endpoint formats the messages as ChatML (the GGUF carries no chat
# template), Hearth as Gemma turns: prompts differ by a few marker tokens per message.
set -euo pipefail
cd "$(dirname "$0")/../.."

sessions="${SESSIONS:-32}" turns="${TURNS:-8}" clients="${CLIENTS:-4}" tokens="${TOKENS:-64}"
slots="${SLOTS:-16}" out="${OUT:-target/anchor/stateless}" threads="${THREADS:-$(nproc)}"
hearth_port="${HEARTH_PORT:-18080}" llama_port="${LLAMA_PORT:-18081}"
source tests/anchor/common.sh
mkdir -p "$out"

bench() { # name url
  ./target/release/hearth-bench --url "$2" --api openai --workload multi-turn \
    --sessions "$sessions" --turns "$turns" --clients "$clients" --output-tokens "$tokens" \
    --label "$1" --quiet --out "$out/$1.json" | tee "$out/$1.txt" >&2
}

HEARTH_DATA_DIR="$data" HEARTH_LISTEN="127.0.0.1:$hearth_port" HEARTH_MODELS_DIR="$models" \
  serve "$out/hearth.log" ./target/release/hearth
wait_http "http://127.0.0.1:$hearth_port/readyz"
bench hearth "http://127.0.0.1:$hearth_port"
stop "$served"

serve "$out/llama-server.log" "$llama_bin/llama-server" -m "$gguf" --host 127.0.0.1 \
  --port "$llama_port" -np "$slots" -c $((slots * 4096)) -t "$threads"
wait_http "http://127.0.0.1:$llama_port/health"
bench llama-server "http://127.0.0.1:$llama_port"

python3 - "$out" "$turns" <<'PY'
import json, sys
out, turns = sys.argv[1], int(sys.argv[2])
def last(name):
    rows = json.load(open(f"{out}/{name}.json"))["results"]
    row = next(r for r in rows if r.get("turns"))
    t = next(t for t in row["turns"] if t["turn"] == turns)
    return t, row
h, hrow = last("hearth")
l, _ = last("llama-server")
print(f"turn-{turns} TTFT p50: hearth {h['ttft_ms']['p50']:.0f} ms, llama-server {l['ttft_ms']['p50']:.0f} ms, "
      f"ratio {h['ttft_ms']['p50'] / l['ttft_ms']['p50']:.2f}; hearth cached share {h.get('cached_ratio')}")
PY
