#!/usr/bin/env bash
# Offline checks of deploy/ (part of `make test`, no daemon, no network):
#   - the compose file (and the offline override) validate with docker-compose, every
#     orchestrator and worker gets the worker token, compose refuses to start without one,
#     and Prometheus runs without --web.enable-lifecycle;
#   - hearth.Dockerfile and worker.Dockerfile have the same builder stage;
#   - Prometheus config and rules pass promtool, and the rules' unit tests pass and show
#     every alert firing after its `for:` and then resolved (scripts/check-alert-tests.py);
#   - the Grafana dashboards match their generator;
#   - the Kubernetes base refuses to render without the operator's k8s/base/secrets.env;
#   - with a throwaway one, both overlays render with kubectl kustomize and validate against
#     the Kubernetes schemas (kubernetes-validate, strict: unknown fields are errors), and the
#     orchestrator and the workers read the Secret's worker-token, and the orchestrator finds the
#     workers through the headless Service's DNS records.
# Needs docker-compose, promtool (Debian `prometheus`), kubectl, kubernetes-validate (PyPI) and
# PyYAML for python3 (kubernetes-validate brings it); .ci/run installs them.
set -euo pipefail
cd "$(dirname "$0")/.."

K8S_VERSION="${K8S_VERSION:-1.30.0}"
fail=0
step() { printf 'deploy-check: %s\n' "$*"; }
need() { command -v "$1" >/dev/null || { echo "deploy-check: $1 is missing ($2)" >&2; exit 1; }; }
need docker-compose "apt-get install docker-compose"
need promtool "apt-get install prometheus"
need kubectl "the Kubernetes client, which includes kustomize"
need kubernetes-validate "python3 -m pip install kubernetes-validate"
python3 -c 'import yaml' 2>/dev/null \
  || { echo "deploy-check: python3 lacks PyYAML (python3 -m pip install pyyaml)" >&2; exit 1; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

step "docker-compose config"
# .env.example leaves the worker token empty on purpose; the checks pass a throwaway one.
compose() { HEARTH_WORKER_TOKEN=deploy-check docker-compose --env-file .env.example "$@"; }
compose -f docker-compose.yml config -q
compose -f docker-compose.yml -f docker-compose.offline.yml config -q
# Captured first: with pipefail, `grep -q` stopping early would fail the pipe (SIGPIPE).
gpu_config="$(compose -f docker-compose.yml --profile gpu config)"
gpu_services="$(compose -f docker-compose.yml --profile gpu config --services)"
grep -qx worker-gpu <<<"$gpu_services" \
  || { echo "deploy-check: the gpu profile has no worker-gpu service" >&2; fail=1; }
# Every orchestrator and worker (the gpu one too) gets the token.
for svc in $gpu_services; do
  [[ "$svc" == hearth-* || "$svc" == worker-* ]] || continue
  awk -v s="  $svc:" '$0 == s {on=1; next} on && /^  [^ ]/ {exit} on' <<<"$gpu_config" \
    | grep -q 'HEARTH_WORKER_TOKEN: deploy-check' \
    || { echo "deploy-check: $svc does not get HEARTH_WORKER_TOKEN" >&2; fail=1; }
done
# Prometheus's HTTP lifecycle endpoints (reload, quit) stay off.
if grep -q -- '--web.enable-lifecycle' <<<"$gpu_config"; then
  echo "deploy-check: Prometheus runs with --web.enable-lifecycle" >&2; fail=1
fi
# Without a token compose must refuse, naming the variable.
if no_token="$(env -u HEARTH_WORKER_TOKEN docker-compose --env-file .env.example -f docker-compose.yml config -q 2>&1)" \
  || ! grep -q 'set HEARTH_WORKER_TOKEN' <<<"$no_token"; then
  echo "deploy-check: compose does not refuse to start without HEARTH_WORKER_TOKEN" >&2; fail=1
fi

step "the CPU images share one builder stage"
# Docker compiles the workspace once only while both builder stages are the same text.
builder_stage() { awk '/^FROM .* AS builder$/{on=1} on&&/^$/{exit} on' "$1"; }
[[ -n "$(builder_stage docker/hearth.Dockerfile)" ]] \
  && [[ "$(builder_stage docker/hearth.Dockerfile)" == "$(builder_stage docker/worker.Dockerfile)" ]] \
  || { echo "deploy-check: the builder stages of hearth.Dockerfile and worker.Dockerfile differ" >&2; fail=1; }

step "promtool check config / rules / test rules"
# The config names its rules at their in-container path; check it with the path rewritten.
sed 's#/etc/prometheus/rules/#'"$PWD"'/prometheus/rules/#' prometheus/prometheus.yml >"$tmp/prometheus.yml"
promtool check config "$tmp/prometheus.yml" >/dev/null
promtool check rules prometheus/rules/*.yml >/dev/null
promtool test rules prometheus/tests/*.yml
# …and those tests show every alert firing after its `for:` and then resolved.
python3 scripts/check-alert-tests.py || fail=1

step "grafana dashboards match deploy/grafana/generate.py"
python3 grafana/generate.py --check

# The overlays render from a copy: the Secret's input, k8s/base/secrets.env, is the operator's
# (never committed), so the copy drops any local one and must then refuse to render, proving
# nothing applies unchanged; a throwaway file stands in for the rest.
mkdir -p "$tmp/deploy"
cp -R k8s grafana prometheus otel "$tmp/deploy/"
rm -f "$tmp/deploy/k8s/base/secrets.env"
step "the Kubernetes base refuses to render without k8s/base/secrets.env"
if kubectl kustomize "$tmp/deploy/k8s/overlays/cpu" >/dev/null 2>&1; then
  echo "deploy-check: the cpu overlay renders without secrets.env (a Secret ships with values)" >&2; fail=1
fi
cat >"$tmp/deploy/k8s/base/secrets.env" <<'ENV'
database-url=postgres://hearth:deploy-check@postgres:5432/hearth
redis-url=redis://:deploy-check@redis:6379/0
worker-token=deploy-check
ENV
for overlay in cpu gpu; do
  step "kustomize $overlay overlay + schema validation (Kubernetes $K8S_VERSION)"
  kubectl kustomize "$tmp/deploy/k8s/overlays/$overlay" >"$tmp/$overlay.yaml"
  kubernetes-validate --strict --quiet -k "$K8S_VERSION" "$tmp/$overlay.yaml" || fail=1
  if grep -q 'change-me' "$tmp/$overlay.yaml"; then
    echo "deploy-check: the $overlay overlay ships a change-me placeholder" >&2; fail=1
  fi
  # The orchestrator Deployment and the worker StatefulSet each read it.
  [[ "$(grep -c 'key: worker-token' "$tmp/$overlay.yaml")" == 2 ]] \
    || { echo "deploy-check: the $overlay overlay does not give orchestrator and worker the worker-token key" >&2; fail=1; }
  # The orchestrators find the workers through the headless Service's DNS records.
  grep -q 'HEARTH_WORKERS: dns:hearth-worker\.hearth\.svc\.' "$tmp/$overlay.yaml" \
    || { echo "deploy-check: the $overlay overlay's orchestrators do not look the workers up in DNS" >&2; fail=1; }
done
grep -q 'nvidia.com/gpu: 1' "$tmp/gpu.yaml" || { echo "deploy-check: gpu overlay requests no nvidia.com/gpu" >&2; fail=1; }
if grep -q 'nvidia.com/gpu: 1' "$tmp/cpu.yaml"; then echo "deploy-check: cpu overlay requests a GPU" >&2; fail=1; fi

if ((fail)); then
  step "FAILED"
  exit 1
fi
step "ok"
