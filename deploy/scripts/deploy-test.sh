#!/usr/bin/env bash
# `make deploy-test`: the docker-compose stack for real. Builds the Hearth images, brings the
# stack up, checks the web UI is served at / through the load balancer, chats through it, kills
# a worker in the middle of a streamed reply and checks the reply completes on the other worker,
# restarts PostgreSQL and checks chat recovers, checks every Prometheus target is up, and tears
# everything down (volumes included).
# Prints how long each step took.
#
# Needs a running Docker daemon and docker-compose (v1 or the `docker compose` plugin). Where
# registry images cannot be pulled, run deploy/scripts/offline-base-images.sh first: when its
# images exist this uses docker-compose.offline.yml (OFFLINE=0 or 1 forces the choice).
# Uses host ports 18080 (entry point) and 19090 (Prometheus) unless HEARTH_HTTP_PORT /
# HEARTH_PROMETHEUS_PORT say otherwise. Building is CPU-heavy: it runs under `nice`.
set -euo pipefail
cd "$(dirname "$0")/../.."

log() { printf '\ndeploy-test [%s]: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }
t0=$(date +%s)
declare -a timings=()
mark() { local now; now=$(date +%s); timings+=("$1: $((now - step_start)) s"); step_start=$now; }
step_start=$t0

docker info >/dev/null 2>&1 || die "the Docker daemon is not running (start it: dockerd &)"
if command -v docker-compose >/dev/null; then compose_bin=(docker-compose); else compose_bin=(docker compose); fi
files=(-f deploy/docker-compose.yml)
offline="${OFFLINE:-auto}"
if [[ "$offline" == auto ]]; then
  docker image inspect hearth-offline/rust-builder:local >/dev/null 2>&1 && offline=1 || offline=0
fi
[[ "$offline" == 1 ]] && files+=(-f deploy/docker-compose.offline.yml)

export HEARTH_HTTP_PORT="${HEARTH_HTTP_PORT:-18080}"
export HEARTH_PROMETHEUS_PORT="${HEARTH_PROMETHEUS_PORT:-19090}"
export HEARTH_GRAFANA_PORT="${HEARTH_GRAFANA_PORT:-13000}"
export HEARTH_HOST_MODELS_DIR="${HEARTH_HOST_MODELS_DIR:-${HEARTH_MODELS_DIR:-$HOME/.cache/hearth/models}}"
env_file="$(mktemp)"
rand() { head -c 18 /dev/urandom | base64 | tr -dc 'A-Za-z0-9'; }
cat >"$env_file" <<ENV
POSTGRES_USER=hearth
POSTGRES_PASSWORD=$(rand)
POSTGRES_DB=hearth
REDIS_PASSWORD=$(rand)
HEARTH_WORKER_TOKEN=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
GF_SECURITY_ADMIN_USER=admin
GF_SECURITY_ADMIN_PASSWORD=$(rand)
ENV
compose() { "${compose_bin[@]}" -p hearth-deploy-test --env-file "$env_file" "${files[@]}" "$@"; }
base="http://127.0.0.1:$HEARTH_HTTP_PORT"
prom="http://127.0.0.1:$HEARTH_PROMETHEUS_PORT"
work="$(mktemp -d)"

teardown() {
  local rc=$?
  if ((rc)); then
    log "logs of the stack (last lines of each service)"
    compose logs --tail=30 2>&1 | tail -200 >&2 || true
  fi
  log "tearing down"
  compose down -v --remove-orphans >/dev/null 2>&1 || true
  rm -rf "$env_file" "$work"
  exit "$rc"
}
trap teardown EXIT

log "building the images ($([[ $offline == 1 ]] && echo offline override || echo official bases))"
nice -n 10 "${compose_bin[@]}" -p hearth-deploy-test --env-file "$env_file" "${files[@]}" build
mark "build images"

log "starting the stack"
compose up -d
for _ in $(seq 1 180); do
  [[ "$(curl -s -o /dev/null -w '%{http_code}' "$base/readyz")" == 200 ]] && break
  sleep 2
done
[[ "$(curl -s -o /dev/null -w '%{http_code}' "$base/readyz")" == 200 ]] || die "the entry point never became ready"
mark "stack up and ready"

log "checking the web UI is served through the entry point"
page="$(curl -sf -D "$work/ui-headers.txt" "$base/")" || die "GET / through the entry point failed"
grep -qi '^content-type: text/html' "$work/ui-headers.txt" \
  || die "GET / is not HTML: $(grep -i '^content-type' "$work/ui-headers.txt")"
grep -q '<title>Hearth</title>' <<<"$page" || die "GET / is not the chat UI: $(head -c 300 <<<"$page")"
script="$(grep -o '/_next/static/[^"]*\.js' <<<"$page" | head -1)"
[[ -n "$script" ]] || die "the UI page names no script"
[[ "$(curl -s -o /dev/null -w '%{http_code}' "$base$script")" == 200 ]] || die "the UI's $script is not served"
log "web UI ok: GET / is the chat page ($(wc -c <<<"$page") bytes), $script served"
mark "web UI through the entry point"

log "creating an API key"
key="$(compose run --rm --no-deps -T hearth-1 keys create --user deploy-test 2>/dev/null | tr -d '\r' | grep -E '^hk_' | tail -1)"
[[ "$key" == hk_* ]] || die "keys create printed no key"
auth=(-H "Authorization: Bearer $key" -H 'Content-Type: application/json')

chat() { # prints the stored reply JSON of a non-streamed turn in a new session
  local sid
  sid="$(curl -sf "${auth[@]}" "$base/v1/sessions" -d '{"title": "deploy-test"}' | jq -r .id)" || return 1
  curl -sf "${auth[@]}" "$base/v1/sessions/$sid/messages" \
    -d '{"content": "Tell me about the sea.", "max_tokens": 16, "stream": false}'
}
reply="$(chat)" || die "chat through the entry point failed"
echo "$reply" | jq -e '.status == "complete" and (.content | length) > 0' >/dev/null \
  || die "unexpected reply: $reply"
log "chat ok: $(echo "$reply" | jq -c '{status, finish_reason, worker, completion_tokens: .usage.completion_tokens}')"
# And the OpenAI API, streamed.
curl -sfN "${auth[@]}" "$base/v1/chat/completions" \
  -d '{"model": "gemma-3-270m-q4_k_m", "stream": true, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}' \
  | grep -q '^data: \[DONE\]' || die "streamed OpenAI completion did not end with [DONE]"
mark "chat through the entry point"

in_flight() { # a worker's hearth_worker_in_flight_requests, read inside its container
  compose exec -T "$1" bash -c 'exec 3<>/dev/tcp/127.0.0.1/9091; printf "GET /metrics HTTP/1.0\r\n\r\n" >&3; cat <&3' 2>/dev/null \
    | awk '/^hearth_worker_in_flight_requests /{print $2}'
}

log "killing the worker that serves a streaming reply"
sid="$(curl -sf "${auth[@]}" "$base/v1/sessions" -d '{"title": "failover"}' | jq -r .id)"
max_tokens=300
curl -sN "${auth[@]}" "$base/v1/sessions/$sid/messages" \
  -d "{\"content\": \"Write a long story about a lighthouse.\", \"max_tokens\": $max_tokens, \"ignore_eos\": true}" \
  >"$work/stream.txt" &
stream_pid=$!
victim=""
for _ in $(seq 1 100); do
  if [[ "$(grep -c '^event: token' "$work/stream.txt" 2>/dev/null || true)" -ge 5 ]]; then
    for w in worker-1 worker-2; do
      [[ "$(in_flight "$w")" =~ ^[1-9] ]] && victim="$w"
    done
    [[ -n "$victim" ]] && break
  fi
  sleep 0.2
done
[[ -n "$victim" ]] || die "no worker had the reply in flight"
tokens_before=$(grep -c '^event: token' "$work/stream.txt" || true)
docker kill "$(compose ps -q "$victim")" >/dev/null
log "killed $victim after $tokens_before token events"
wait "$stream_pid" || die "the stream broke when $victim was killed"
grep -q '^event: message_end' "$work/stream.txt" || die "the reply did not end (no message_end): $(tail -5 "$work/stream.txt")"
grep -q '^event: error' "$work/stream.txt" && die "the client saw an error event"
stored="$(curl -sf "${auth[@]}" "$base/v1/sessions/$sid/messages" | jq -c '.data[-1]')"
echo "$stored" | jq -e --arg v "$victim" --argjson n "$max_tokens" \
  '.status == "complete" and .completion_tokens == $n and (.worker | contains($v) | not)' >/dev/null \
  || die "the stored reply is not complete on the other worker: $stored"
log "reply completed on $(echo "$stored" | jq -r .worker) with $max_tokens tokens"
compose up -d "$victim" >/dev/null 2>&1
mark "worker killed mid-stream, reply completed elsewhere"

log "restarting PostgreSQL"
compose restart postgres >/dev/null 2>&1
recovered=""
for i in $(seq 1 60); do
  if reply="$(chat 2>/dev/null)" && echo "$reply" | jq -e '.status == "complete"' >/dev/null; then
    recovered="$i"; break
  fi
  sleep 1
done
[[ -n "$recovered" ]] || die "chat did not recover within 60 s of the PostgreSQL restart"
log "chat works again (attempt $recovered)"
mark "PostgreSQL restart, chat recovered"

log "checking every Prometheus target is up"
ok=""
for _ in $(seq 1 60); do
  targets="$(curl -sf "$prom/api/v1/targets" | jq -c '[.data.activeTargets[] | {job: .labels.job, instance: .labels.instance, health}]')" || targets="[]"
  if echo "$targets" | jq -e 'length >= 5 and all(.[]; .health == "up")' >/dev/null; then ok=1; break; fi
  sleep 2
done
[[ -n "$ok" ]] || die "not every target is up: $targets"
rules="$(curl -sf "$prom/api/v1/rules" | jq '[.data.groups[].rules[]] | length')"
((rules > 0)) || die "Prometheus loaded no rules"
log "targets: $targets; $rules rules loaded"
mark "Prometheus targets up"

log "PASSED in $(( $(date +%s) - t0 )) s"
printf '  %s\n' "${timings[@]}" >&2
