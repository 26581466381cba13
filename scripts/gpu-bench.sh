#!/usr/bin/env bash
# The GPU check, in one run: Hearth's CUDA worker against llama.cpp's CUDA build on the same GPU
# and the same GGUF files, for model shapes GPUs serve (gen-model's random-weight Gemma 3 270M,
# 1B, 4B). Made for a GPU host with no Rust toolchain and no network, inside a few minutes; it
# also runs end to end on a CPU with a tiny shape (`--device cpu --shapes tiny`), which CI does,
# so a GPU run spends no time on the script itself.
#
#   bash scripts/gpu-bench.sh --bundle gpu-bundle --out "$OUT"                  # on the GPU host
#   bash scripts/gpu-bench.sh --device cpu --shapes tiny --bin target/debug/hearth-worker \
#        --llama-src DIR --llama-build DIR --out target/gpu-bench                # anywhere
#
# A bundle (scripts/gpu-pack.sh) holds the stripped CUDA worker and llama.cpp: built ahead of
# time for the GPU (`--llama`), or its trimmed sources to build there. Steps, each logged with
# its start time:
#   1. the host: nvidia-smi, the GPU's compute capability, the worker's libraries (ldd);
#   2. llama.cpp (llama-bench, llama-batched-bench): built ahead of time, or built for that GPU's
#      architecture only, started in the background at once, at low priority;
#   3. gen-model for each shape;
#   4. `hearth-worker bench` on each shape: prefill 512, single-stream decode, batched decode at
#      16 and 64 streams (GPU utilisation sampled during the 64-stream run);
#   5. llama-bench (pp512, tg128) and llama-batched-bench (1, 16, 64 streams) on the same files;
#   6. variants, while llama.cpp builds: `--dense-gemm-tokens 16`, single-stream decode without
#      CUDA graphs; and, where the host has Nsight Compute, every kernel's time in the first
#      shape's decode at 1 and 64 streams (profile-<shape>-<streams>.txt);
#   7. `hearth-worker check-greedy` on the first shape: the device's greedy tokens and logits
#      against the CPU pass, within stated tolerances;
#   8. one JSON file (gpu-bench-<gpu>.json, per shape `prefill_512_ratio`, `decode_1_ratio`,
#      `decode_64_ratio`: Hearth over llama.cpp, beside the raw figures) and a summary table.
# --real-model FILE (the real Gemma 3 270M Q4_K_M, carried in chunks of at most 60 MiB) adds
# `hearth-worker check-golden`: the device's picks against llama.cpp's greedy tokens on it.
# --budget-s stops starting new shapes once that many seconds have passed (default 480);
# --kv-budget-mb sizes the worker's K/V (default 8192 on a GPU, 512 on a CPU); --profile-only
# runs steps 1, 3 and the profile alone (no llama.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."

device=cuda:0 shapes="gemma-3-270m,gemma-3-1b,gemma-3-4b" bundle="" bin="" forward=auto kv_mb=""
profile_only=0 llama_src="" llama_build="" llama_bin="" out="${OUT:-target/gpu-bench}" budget=480 decode_tokens=128 real=""
while (($#)); do
  case "$1" in
    --device) device="$2"; shift 2 ;;
    --shapes) shapes="$2"; shift 2 ;;
    --bundle) bundle="$2"; shift 2 ;;
    --bin) bin="$2"; shift 2 ;;
    --forward) forward="$2"; shift 2 ;;
    --llama-src) llama_src="$2"; shift 2 ;;
    --llama-build) llama_build="$2"; shift 2 ;;
    --llama-bin) llama_bin="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --budget-s) budget="$2"; shift 2 ;;
    --decode-tokens) decode_tokens="$2"; shift 2 ;;
    --kv-budget-mb) kv_mb="$2"; shift 2 ;;
    --real-model) real="$2"; shift 2 ;;
    --profile-only) profile_only=1; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-bench: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
start=$SECONDS
log() { echo "[$((SECONDS - start))s] gpu-bench: $*" >&2; }
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/gpu-bench.XXXXXX")"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -rf "$work"' EXIT
gpu=$([[ "$device" == cuda* ]] && echo 1 || echo 0)
kv_mb="${kv_mb:-$( ((gpu)) && echo 8192 || echo 512)}"

# --- 1. the host ----------------------------------------------------------------------------
if [[ -n "$bundle" ]]; then
  if [[ -z "$bin" ]]; then
    bin="$work/hearth-worker"
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "$bundle/hearth-worker.xz" "$bin"
    chmod +x "$bin"
  fi
  # Built ahead of time for this GPU's architecture, or the sources to build here.
  if [[ -z "$llama_bin" && -f "$bundle/llama-cuda.tar.xz" ]]; then
    llama_bin="$work/llama-bin"
    mkdir -p "$llama_bin" && tar xJf "$bundle/llama-cuda.tar.xz" -C "$llama_bin"
  elif [[ -z "$llama_src" && -f "$bundle/llama.cpp.tar.gz" ]]; then
    llama_src="$work/llama.cpp"
    mkdir -p "$llama_src" && tar xzf "$bundle/llama.cpp.tar.gz" -C "$llama_src" --strip-components=1
  fi
fi
[[ -x "$bin" ]] || { echo "gpu-bench: no worker binary (--bin or --bundle)" >&2; exit 2; }
if [[ -z "$llama_bin" ]] && ((!profile_only)); then
  [[ -d "$llama_src" ]] || { echo "gpu-bench: no llama.cpp (--llama-bin, --llama-src or --bundle)" >&2; exit 2; }
  command -v cmake >/dev/null || { echo "gpu-bench: cmake is missing (apt-get install cmake)" >&2; exit 2; }
fi
llama_build="${llama_build:-$work/llama-build}"
arch=""
if ((gpu)); then
  log "host: $(nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader)"
  nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
  arch="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')"
  # The worker needs the CUDA 13 runtime, cuBLAS and cuRAND beside the driver: from the system
  # toolkit or from the CUDA wheels a Python environment carries.
  libs="$(python3 - <<'PY' 2>/dev/null || true
import glob, os, site, sys
roots = site.getsitepackages() + [p for p in sys.path if p.endswith("site-packages")]
dirs = {os.path.dirname(f) for r in roots for f in glob.glob(f"{r}/nvidia/*/lib/lib*.so*")}
print(":".join(sorted(dirs)))
PY
)"
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [[ -d "$d" ]] && libs="$libs:$d"
  done
  export LD_LIBRARY_PATH="${libs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
ldd "$bin" >"$out/ldd.txt" 2>&1 || true
if grep -q "not found" "$out/ldd.txt"; then
  log "the worker's libraries are missing: $(grep 'not found' "$out/ldd.txt" | tr -s ' \t' ' ')"
  exit 1
fi
log "worker: $("$bin" --version), libraries: $(grep -oE '(libcu[a-z]*|libcurand)\.so[.0-9]*' "$out/ldd.txt" | sort -u | tr '\n' ' ')"
lscpu >"$out/lscpu.txt" 2>&1 || true

# --- 2. llama.cpp, in the background ---------------------------------------------------------
if ((profile_only)); then
  :
elif [[ -n "$llama_bin" ]]; then
  # Built ahead of time (scripts/gpu-pack.sh --llama): its libraries sit beside the binaries.
  export LD_LIBRARY_PATH="$llama_bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "0 ahead of time" >"$work/llama-build.done"
  log "llama.cpp: built ahead of time ($llama_bin)"
else
  cmake_flags=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DBUILD_SHARED_LIBS=OFF)
  if ((gpu)); then
    cmake_flags+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$arch" -DGGML_NATIVE=OFF)
    # The host's toolkit: nvcc on the PATH, else the usual install, else a Python environment's
    # CUDA wheels (nvidia/cu13 holds nvcc, headers and cuBLAS there).
    nvcc="$(command -v nvcc || true)"
    for c in /usr/local/cuda/bin/nvcc $(python3 -c 'import glob, site; print(" ".join(glob.glob(site.getsitepackages()[0] + "/nvidia/cu*/bin/nvcc")))' 2>/dev/null); do
      [[ -z "$nvcc" && -x "$c" ]] && nvcc="$c"
    done
    if [[ -n "$nvcc" ]]; then
      root="$(cd "$(dirname "$nvcc")/.." && pwd)"
      cmake_flags+=("-DCMAKE_CUDA_COMPILER=$nvcc" "-DCUDAToolkit_ROOT=$root")
      log "llama.cpp: toolkit $root ($("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'))"
    fi
  else
    cmake_flags+=(-DGGML_NATIVE=ON)
    # On a host with AMX, -march=native builds ggml's AMX kernels, and they die with an illegal
    # instruction (the process never asks the kernel for the tile permission). Undefining the
    # AMX macros leaves them out; compilers never emit AMX instructions on their own.
    if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
      noamx="-U__AMX_TILE__ -U__AMX_INT8__ -U__AMX_BF16__"
      cmake_flags+=("-DCMAKE_C_FLAGS=$noamx" "-DCMAKE_CXX_FLAGS=$noamx")
    fi
  fi
  command -v ninja >/dev/null && cmake_flags+=(-G Ninja)
  (
    t0=$SECONDS
    nice -n 19 cmake -S "$llama_src" -B "$llama_build" "${cmake_flags[@]}" >"$out/llama-build.log" 2>&1 &&
      nice -n 19 cmake --build "$llama_build" -j "$(nproc)" --target llama-bench llama-batched-bench \
        >>"$out/llama-build.log" 2>&1
    rc=$?
    echo "$rc here in $((SECONDS - t0)) s" >"$work/llama-build.done"
  ) &
  pids+=($!)
  llama_bin="$llama_build/bin"
  log "llama.cpp: building in the background ($llama_build)"
fi

# --- 3. the models ---------------------------------------------------------------------------
IFS=, read -ra shape_list <<<"$shapes"
for s in "${shape_list[@]}"; do
  "$bin" gen-model --like "$s" --out "$work/$s.gguf" 2>>"$out/gen-model.log"
done
log "models: ${shape_list[*]} ($(du -ch "$work"/*.gguf | tail -1 | cut -f1))"

# --- 4. Hearth ---------------------------------------------------------------------------------
bench=(bench --device "$device" --forward "$forward" --sessions 1 --turns 1 --warm-tokens 0
  --disk-tokens 0 --interference-streams 0 --spec-tokens 0 --batch-tokens "$decode_tokens"
  --kv-budget-mb "$kv_mb")
# --- 4b. a kernel profile -------------------------------------------------------------------------
# Nsight Compute, where the host has it: every kernel's time on the GPU (warm caches) in a
# single-stream and a 64-stream decode of shape $1, summed by kernel (scripts/gpu-profile-summary.py).
profile() {
  local s="$1" ncu
  ncu="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true)"
  ((gpu)) && [[ -n "$ncu" ]] || return 0
  # The bench's prefill and single-stream runs come first: with 64 streams they are kept short
  # and skipped, so the kernels counted are mostly the 64-stream steps'.
  local c decode skip
  for c in 1 64; do
    decode=$( ((c == 1)) && echo 16 || echo 2) skip=$( ((c == 1)) && echo 0 || echo 1500)
    timeout 70 "$ncu" --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
      --page raw --launch-skip "$skip" --launch-count 6000 "$bin" "${bench[@]}" --grammar-streams \
      --model "$work/$s.gguf" --prefill-tokens 16 --decode-tokens "$decode" --concurrency "$c" \
      >"$work/ncu-$c.csv" 2>"$out/ncu-$s-$c.log" ||
      log "ncu ($c streams): rc $? (its log: $(tail -2 "$out/ncu-$s-$c.log"))"
    python3 scripts/gpu-profile-summary.py "$work/ncu-$c.csv" >"$out/profile-$s-$c.txt" 2>&1 || true
    log "profile of $s, $c streams: $(head -1 "$out/profile-$s-$c.txt")"
  done
}

# One variant of Hearth on shape $1, tagged $2 in the file names ("" for the default), with the
# worker's extra flags after: prefill 512, single-stream decode and 16 streams in one run; 64
# streams in another, with the GPU's utilisation sampled every 100 ms meanwhile.
hearth_variant() {
  local s="$1" tag="$2"
  shift 2
  # The constrained-decoding runs once per shape, with the default.
  local grammar=()
  [[ -n "$tag" ]] && grammar=(--grammar-streams)
  if ! "$bin" "${bench[@]}" "$@" "${grammar[@]}" --model "$work/$s.gguf" --prefill-tokens 512 --decode-tokens "$decode_tokens" \
    --concurrency 1,16 >"$out/hearth-$s$tag.json" 2>"$out/hearth-$s$tag.log"; then
    log "hearth: $s$tag failed; the end of its log:"
    tail -15 "$out/hearth-$s$tag.log" >&2
    return 1
  fi
  local sampler=""
  if ((gpu)); then
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits -lms 100 \
      >"$out/util-$s$tag.csv" 2>/dev/null &
    sampler=$!
  fi
  "$bin" "${bench[@]}" "$@" --grammar-streams --model "$work/$s.gguf" --prefill-tokens 16 --decode-tokens 2 \
    --concurrency 64 >"$out/hearth-$s$tag-64.json" 2>"$out/hearth-$s$tag-64.log" ||
    { log "hearth: $s$tag at 64 streams failed: $(tail -5 "$out/hearth-$s$tag-64.log")"; echo '{"batched_decode": []}' >"$out/hearth-$s$tag-64.json"; }
  [[ -n "$sampler" ]] && kill "$sampler" 2>/dev/null || true
}
if ((profile_only)); then
  profile "${shape_list[0]}"
  exit 0
fi
done_shapes=()
for s in "${shape_list[@]}"; do
  if ((SECONDS - start > budget)); then
    log "hearth: $s skipped (past the ${budget}s budget)"
    continue
  fi
  hearth_variant "$s" "" || continue
  done_shapes+=("$s")
  log "hearth: $s done"
done
# Variants, measured while llama.cpp builds: the layers' products through dequantized f16 copies
# (cuBLAS) from 16 tokens a step, and single-stream decode without CUDA graphs.
for s in "${done_shapes[@]}"; do
  ((SECONDS - start > budget)) && break
  hearth_variant "$s" -dense16 --dense-gemm-tokens 16 || true
  "$bin" "${bench[@]}" --cuda-graphs false --grammar-streams --model "$work/$s.gguf" --prefill-tokens 16 \
    --decode-tokens "$decode_tokens" --concurrency 1 >"$out/hearth-$s-nographs.json" 2>"$out/hearth-$s-nographs.log" ||
    rm -f "$out/hearth-$s-nographs.json"
  log "hearth: $s variants done"
done

((${#done_shapes[@]})) && profile "${done_shapes[0]}"

# --- 5. llama.cpp ------------------------------------------------------------------------------
log "llama.cpp: waiting for the build"
while [[ ! -f "$work/llama-build.done" ]]; do sleep 1; done
read -r rc how <"$work/llama-build.done"
llama_shapes=("${done_shapes[@]}")
if ((rc != 0)); then
  # Hearth's figures are still worth the run: the report carries them without ratios.
  log "llama.cpp: the build failed ($how; tail of $out/llama-build.log):"
  tail -20 "$out/llama-build.log" >&2
  echo "failed ($how)" >"$out/llama-build.txt"
  llama_shapes=()
else
  echo "$how" >"$out/llama-build.txt"
  log "llama.cpp: built $how"
fi
lb="$llama_bin"
ngl=(); ((gpu)) && ngl=(-ngl 99)
for s in "${llama_shapes[@]}"; do
  "$lb/llama-bench" -m "$work/$s.gguf" -p 512 -n "$decode_tokens" -r 3 "${ngl[@]}" -o json \
    >"$out/llama-bench-$s.json" 2>"$out/llama-bench-$s.log" ||
    { log "llama-bench failed on $s: $(tail -3 "$out/llama-bench-$s.log")"; rm -f "$out/llama-bench-$s.json"; }
  "$lb/llama-batched-bench" -m "$work/$s.gguf" -c $((64 * (16 + decode_tokens) + 256)) -b 2048 \
    -ub 512 -npp 16 -ntg "$decode_tokens" -npl 1,16,64 "${ngl[@]}" --output-format jsonl \
    >"$out/llama-batched-$s.jsonl" 2>"$out/llama-batched-$s.log" ||
    log "llama-batched-bench failed on $s: $(tail -3 "$out/llama-batched-$s.log")"
  log "llama.cpp: $s done"
done

# --- 6. greedy tokens against the CPU -----------------------------------------------------------
greedy=pass
"$bin" check-greedy --model "$work/${shape_list[0]}.gguf" --device "$device" --forward "$forward" \
  >"$out/check-greedy.json" 2>"$out/check-greedy.log" || greedy=fail
log "check-greedy (${shape_list[0]}): $greedy"
if [[ -n "$real" ]]; then
  golden=pass
  "$bin" check-golden --model "$real" --device "$device" --forward "$forward" \
    >"$out/check-golden.json" 2>"$out/check-golden.log" || golden=fail
  log "check-golden (the real 270M against llama.cpp's greedy tokens): $golden"
fi

# --- 7. the report -------------------------------------------------------------------------------
name="$( ((gpu)) && nvidia-smi --query-gpu=name --format=csv,noheader | head -1 || echo cpu)"
slug="$(echo "$name" | tr 'A-Z' 'a-z' | tr -cs 'a-z0-9' '-' | sed 's/-$//')"
python3 - "$out" "$slug" "$name" "$device" "$greedy" "${done_shapes[@]}" <<'PY'
import json, os, statistics, sys
out, slug, name, device, greedy, shapes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6:]
load = lambda p: json.load(open(os.path.join(out, p)))
exists = lambda p: os.path.exists(os.path.join(out, p))
report = {"gpu": name, "device": device, "check_greedy": load("check-greedy.json") if exists("check-greedy.json") and greedy == "pass" else greedy,
          "check_golden": {k: v for k, v in load("check-golden.json").items()} if exists("check-golden.json") and os.path.getsize(os.path.join(out, "check-golden.json")) else None,
          "llama_cpp_built": open(os.path.join(out, "llama-build.txt")).read().strip(), "shapes": {}}
rows = []
for s in shapes:
    h, h64 = load(f"hearth-{s}.json"), load(f"hearth-{s}-64.json")
    pp = tg = None
    lbb = {}
    if exists(f"llama-bench-{s}.json") and os.path.getsize(os.path.join(out, f"llama-bench-{s}.json")):
        lb = load(f"llama-bench-{s}.json")
        pp = next(t["avg_ts"] for t in lb if t["n_prompt"] > 0)
        tg = next(t["avg_ts"] for t in lb if t["n_gen"] > 0)
    if exists(f"llama-batched-{s}.jsonl"):
        batched = [json.loads(l) for l in open(os.path.join(out, f"llama-batched-{s}.jsonl")) if l.startswith("{")]
        lbb = {b["pl"]: b["speed_tg"] for b in batched}
    hb = {b["concurrency"]: b["decode_phase_tok_s"] for b in h["batched_decode"] + h64["batched_decode"]}
    util = []
    if os.path.exists(os.path.join(out, f"util-{s}.csv")):
        util = [float(l.split(",")[0]) for l in open(os.path.join(out, f"util-{s}.csv")) if l.strip()]
    r = {
        "hearth": {"prefill_512_tok_s": h["prefill"]["tok_s"], "decode_1_tok_s": h["decode_single_stream_tok_s"],
                   "decode_16_tok_s": hb.get(16), "decode_64_tok_s": hb.get(64), "load_s": h["load_s"],
                   "weights_mb": h["weights_mb"], "forward": h["forward"], "device_ops": h.get("device_ops")},
        "llama_cpp": {"pp512_tok_s": pp, "tg_tok_s": tg, "batched_tg_tok_s": lbb},
        "gpu_utilisation_64_streams": {"mean_pct": statistics.mean(util) if util else None,
                                       "max_pct": max(util) if util else None, "samples": len(util)},
    }
    r["prefill_512_ratio"] = round(r["hearth"]["prefill_512_tok_s"] / pp, 3) if pp else None
    r["decode_1_ratio"] = round(r["hearth"]["decode_1_tok_s"] / tg, 3) if tg else None
    r["decode_64_ratio"] = round(hb[64] / lbb[64], 3) if hb.get(64) and lbb.get(64) else None
    ratio = lambda a, b: round(a / b, 3) if a and b else None
    variants = {}
    if exists(f"hearth-{s}-dense16.json") and exists(f"hearth-{s}-dense16-64.json"):
        d, d64 = load(f"hearth-{s}-dense16.json"), load(f"hearth-{s}-dense16-64.json")
        db = {b["concurrency"]: b["decode_phase_tok_s"] for b in d["batched_decode"] + d64["batched_decode"]}
        variants["dense_gemm_16"] = {
            "prefill_512_tok_s": d["prefill"]["tok_s"], "decode_1_tok_s": d["decode_single_stream_tok_s"],
            "decode_16_tok_s": db.get(16), "decode_64_tok_s": db.get(64),
            "prefill_512_ratio": ratio(d["prefill"]["tok_s"], pp), "decode_64_ratio": ratio(db.get(64), lbb.get(64))}
    if exists(f"hearth-{s}-nographs.json"):
        n = load(f"hearth-{s}-nographs.json")["decode_single_stream_tok_s"]
        variants["no_cuda_graphs"] = {"decode_1_tok_s": n, "decode_1_ratio": ratio(n, tg)}
    r["variants"] = variants
    report["shapes"][s] = r
    rows.append((s, r))
path = os.path.join(out, f"gpu-bench-{slug}.json")
json.dump(report, open(path, "w"), indent=1)
print(f"\n{name} ({device}); llama.cpp built {report['llama_cpp_built']}; check-greedy: {greedy}")
print("| shape | prefill 512 (H / L) | ratio | decode 1 (H / L) | ratio | decode 64 (H / L) | ratio | GPU util 64 |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for s, r in rows:
    h, l, u = r["hearth"], r["llama_cpp"], r["gpu_utilisation_64_streams"]
    d64 = l["batched_tg_tok_s"].get(64)
    fmt = lambda x: "-" if x is None else f"{x:.0f}"
    print(f"| {s} | {fmt(h['prefill_512_tok_s'])} / {fmt(l['pp512_tok_s'])} | {r['prefill_512_ratio']} "
          f"| {fmt(h['decode_1_tok_s'])} / {fmt(l['tg_tok_s'])} | {r['decode_1_ratio']} "
          f"| {fmt(h['decode_64_tok_s'])} / {fmt(d64)} | {r['decode_64_ratio']} | {fmt(u['mean_pct'])}% |")
for s, r in rows:
    for v, fig in r["variants"].items():
        print(f"{s} {v}: " + ", ".join(f"{k} {x:.3g}" if isinstance(x, float) else f"{k} {x}" for k, x in fig.items()))
print(f"\nwrote {path}")
PY
log "done"
[[ "$greedy" == pass ]]
