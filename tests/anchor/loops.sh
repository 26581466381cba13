#!/usr/bin/env bash
# How many of 20 chat prompts loop within 256 tokens on the default model, greedy, with each
# repetition setting (tests/anchor/loops.py): the measurement behind the web UI's default DRY
# multiplier (web/lib/settings.ts). Serves Hearth's release build with its embedded defaults
# on PORT (a scratch data directory), then prints one JSON line per setting and a table.
set -euo pipefail
cd "$(dirname "$0")/../.."
port="${PORT:-18090}"
bash scripts/fetch-model.sh >&2
cargo build --release -p hearth-worker -p hearth-orchestrator >&2
data="$(mktemp -d)"
HEARTH_DATA_DIR="$data" ./target/release/hearth --listen "127.0.0.1:$port" >"$data/hearth.log" 2>&1 &
served=$!
trap 'kill $served 2>/dev/null; wait $served 2>/dev/null; rm -rf "$data"' EXIT
for _ in $(seq 1 300); do
  curl -fsS -o /dev/null "http://127.0.0.1:$port/readyz" 2>/dev/null && break
  sleep 0.5
done
python3 tests/anchor/loops.py --url "http://127.0.0.1:$port" --clients 20 \
  --setting off='{}' \
  --setting repetition_penalty=1.1='{"repetition_penalty": 1.1}' \
  --setting dry=0.8='{"dry_multiplier": 0.8}' \
  --setting dry=1.5='{"dry_multiplier": 1.5}' \
  --setting dry=3='{"dry_multiplier": 3}' \
  --setting dry=1.5+rep=1.1='{"dry_multiplier": 1.5, "repetition_penalty": 1.1}'
