#!/usr/bin/env bash
# Starts `hearth-worker serve`, first checking that the model is in the models volume so a
# missing file is one clear line rather than a crash loop with a long flag dump.
set -euo pipefail
models="${HEARTH_MODELS_DIR:-/models}"
model="${HEARTH_MODEL:-$models/gemma-3-270m-q4_k_m.gguf}"
if [[ -z "${HEARTH_WORKER_SCRIPTED_TOKEN_MS:-}" && ! -f "$model" ]]; then
  echo "hearth-worker: no model at $model. Mount a models volume holding it at $models, or run" \
       "the model-fetch image once on that volume (docker compose runs it as the 'models' service)." >&2
  exit 2
fi
exec hearth-worker serve "$@"
