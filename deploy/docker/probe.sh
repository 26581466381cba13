#!/usr/bin/env bash
# HTTP probe for container healthchecks: `hearth-probe PORT PATH` exits 0 when
# http://127.0.0.1:PORT/PATH answers 200. Uses bash's /dev/tcp, so the runtime image needs no
# curl or wget.
set -euo pipefail
port="${1:?usage: hearth-probe PORT PATH}"
path="${2:-/healthz}"
exec 3<>"/dev/tcp/127.0.0.1/${port}"
printf 'GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n' "$path" >&3
read -r -t 5 _proto status _rest <&3
[[ "$status" == "200" ]]
