#!/usr/bin/env bash
# Builds, on a machine that cannot pull from a container registry, the images that
# docker-compose.offline.yml names:
#   debian:bookworm-slim               debootstrap --variant=minbase bookworm + docker import
#   hearth-offline/rust-builder:local  that base + gcc + the host's Rust toolchain and crate cache
#                                      (rustup cannot download inside a build; cargo runs offline)
#   hearth-offline/node:local          that base + the host's Node.js (>= 20.9) and npm, and an npm
#                                      cache with the web UI's locked packages (npm runs offline)
#   hearth-offline/postgres:local      stand-ins from Debian's packages, behaving like the
#   hearth-offline/redis:local         official images as far as docker-compose.yml uses them
#   hearth-offline/prometheus:local    (env variables, paths, healthcheck commands)
#   hearth-offline/nginx:local
# Needs root, debootstrap and a running Docker daemon; Debian's mirror must be reachable (the
# stand-ins' packages are installed with `docker build --network host`). Idempotent: an image
# that exists is kept unless REBUILD=1.
set -euo pipefail
cd "$(dirname "$0")"

MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
TOOLCHAIN="${RUST_TOOLCHAIN_DIR:-$(rustc --print sysroot)}"
CARGO_REGISTRY="${CARGO_HOME:-$HOME/.cargo}/registry"
work="${OFFLINE_WORK_DIR:-/var/tmp/hearth-offline-images}"

log() { printf 'offline-images: %s\n' "$*" >&2; }
have() { [[ "${REBUILD:-0}" != 1 ]] && docker image inspect "$1" >/dev/null 2>&1; }
for tool in docker debootstrap; do
  command -v "$tool" >/dev/null || { log "$tool is missing (apt-get install ${tool/docker/docker.io})"; exit 1; }
done
docker info >/dev/null 2>&1 || { log "the Docker daemon is not running (start it: dockerd &)"; exit 1; }
mkdir -p "$work"

# 1. debian:bookworm-slim from a minbase debootstrap.
if ! have debian:bookworm-slim; then
  root="$work/bookworm"
  rm -rf "$root"
  log "debootstrap --variant=minbase bookworm (a few minutes)"
  debootstrap --variant=minbase bookworm "$root" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
    || { log "debootstrap failed: see $work/debootstrap.log"; exit 1; }
  # As in the official slim image: no docs or apt lists, and apt keeps no package cache.
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* "$root"/usr/share/man/*
  echo "deb $MIRROR bookworm main" >"$root/etc/apt/sources.list"
  tar -C "$root" --numeric-owner -c . \
    | docker import --change 'CMD ["bash"]' --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        - debian:bookworm-slim >/dev/null
  rm -rf "$root"
  log "built debian:bookworm-slim"
fi

build() { # NAME DIR: docker build with the host's network (apt reaches the mirror)
  docker build --network host -q -t "$1" "$2" >/dev/null
  log "built $1"
}

# 2. The Rust builder: the host's toolchain and downloaded crates, cargo offline.
if ! have hearth-offline/rust-builder:local; then
  ctx="$work/rust-builder"
  rm -rf "$ctx" && mkdir -p "$ctx"
  log "copying the Rust toolchain from $TOOLCHAIN and the crate cache from $CARGO_REGISTRY"
  cp -a "$TOOLCHAIN" "$ctx/rust"
  rm -rf "$ctx/rust/share/doc" "$ctx/rust/share/man"
  mkdir -p "$ctx/cargo-home"
  cp -a "$CARGO_REGISTRY" "$ctx/cargo-home/registry"
  cat >"$ctx/Dockerfile" <<'DOCKERFILE'
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev binutils \
 && rm -rf /var/lib/apt/lists/*
COPY rust /usr/local/rust
COPY cargo-home /usr/local/cargo
ENV PATH=/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    CARGO_HOME=/usr/local/cargo CARGO_NET_OFFLINE=true
RUN cargo --version && rustc --version
DOCKERFILE
  build hearth-offline/rust-builder:local "$ctx"
  rm -rf "$ctx"
fi

# 3. Node.js for the web UI's build stage (hearth.Dockerfile, NODE_IMAGE): the host's Node, which
#    must be >= 20.9 for Next.js (Debian bookworm's nodejs is 18), its npm, and an npm cache
#    holding every package web/package-lock.json names, filled here by an install on the host;
#    npm runs offline in the build. After a change to the lock file, rebuild this image (REBUILD=1).
if ! have hearth-offline/node:local; then
  node_bin="$(command -v node || true)"
  npm_bin="$(command -v npm || true)"
  [[ -n "$node_bin" && -n "$npm_bin" ]] || { log "node and npm are missing on this host (Node >= 20.9)"; exit 1; }
  node_version="$("$node_bin" -p 'process.versions.node')"
  IFS=. read -r node_major node_minor _ <<<"$node_version"
  if ((node_major < 20 || (node_major == 20 && node_minor < 9))); then
    log "the host's Node.js is $node_version; the web UI needs >= 20.9"; exit 1
  fi
  # npm is a script inside its package directory: <prefix>/lib/node_modules/npm/bin/npm-cli.js.
  npm_dir="$(dirname "$(dirname "$(readlink -f "$npm_bin")")")"
  [[ -f "$npm_dir/package.json" ]] || { log "cannot find npm's package directory from $npm_bin"; exit 1; }
  ctx="$work/node"
  rm -rf "$ctx" && mkdir -p "$ctx/web"
  log "copying Node.js $node_version from $node_bin and npm from $npm_dir"
  cp "$(readlink -f "$node_bin")" "$ctx/node"
  cp -a "$npm_dir" "$ctx/npm"
  log "filling an npm cache with web/package-lock.json's packages (npm install on the host)"
  cp ../../web/package.json ../../web/package-lock.json "$ctx/web/"
  # As scripts/build-web.sh: npm ci refuses a lock file with only Linux builds of the platform
  # packages; npm install then installs (and caches) the same locked versions.
  (cd "$ctx/web" && { npm ci --cache "$ctx/npm-cache" --no-audit --no-fund >"$work/npm.log" 2>&1 \
    || npm install --cache "$ctx/npm-cache" --no-audit --no-fund >>"$work/npm.log" 2>&1; }) \
    || { log "npm install failed: see $work/npm.log"; exit 1; }
  rm -rf "$ctx/web" "$ctx/npm-cache/_logs"
  cat >"$ctx/Dockerfile" <<'DOCKERFILE'
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends libstdc++6 \
 && rm -rf /var/lib/apt/lists/*
COPY node /usr/local/bin/node
COPY npm /usr/local/lib/node_modules/npm
COPY npm-cache /usr/local/share/npm-cache
RUN ln -s ../lib/node_modules/npm/bin/npm-cli.js /usr/local/bin/npm \
 && ln -s ../lib/node_modules/npm/bin/npx-cli.js /usr/local/bin/npx \
 && node --version && npm --version
ENV npm_config_cache=/usr/local/share/npm-cache npm_config_offline=true
CMD ["node"]
DOCKERFILE
  build hearth-offline/node:local "$ctx"
  rm -rf "$ctx"
fi

# 4. Stand-ins.
standin() { # NAME: Dockerfile text on stdin
  have "$1" && return
  local ctx="$work/$(echo "$1" | tr '/:' '__')"
  rm -rf "$ctx" && mkdir -p "$ctx"
  cat >"$ctx/Dockerfile"
  [[ -f "$ctx/Dockerfile" ]]
  [[ -n "${2:-}" ]] && cp "$2" "$ctx/"
  build "$1" "$ctx"
  rm -rf "$ctx"
}

# PostgreSQL: POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB and the data directory as in the
# official image; pg_isready on PATH.
pg_entry="$work/pg-entrypoint.sh"
cat >"$pg_entry" <<'SH'
#!/bin/bash
set -euo pipefail
export PGDATA=/var/lib/postgresql/data
bin=/usr/lib/postgresql/15/bin
if [[ ! -s "$PGDATA/PG_VERSION" ]]; then
  install -d -o postgres -g postgres -m 700 "$PGDATA"
  pw="$(mktemp)"; echo "${POSTGRES_PASSWORD:?}" >"$pw"; chown postgres "$pw"
  su postgres -c "$bin/initdb -D $PGDATA -U ${POSTGRES_USER:-postgres} --pwfile=$pw --auth-host=scram-sha-256 --auth-local=trust" >/dev/null
  rm -f "$pw"
  echo "host all all 0.0.0.0/0 scram-sha-256" >>"$PGDATA/pg_hba.conf"
  su postgres -c "$bin/pg_ctl -D $PGDATA -o '-c listen_addresses=' -w start" >/dev/null
  if [[ "${POSTGRES_DB:-}" && "${POSTGRES_DB}" != "${POSTGRES_USER:-postgres}" ]]; then
    su postgres -c "psql -U ${POSTGRES_USER:-postgres} -d postgres -c 'CREATE DATABASE \"${POSTGRES_DB}\"'" >/dev/null
  elif [[ "${POSTGRES_DB:-}" ]]; then
    su postgres -c "psql -U ${POSTGRES_USER:-postgres} -d postgres -c 'CREATE DATABASE \"${POSTGRES_DB}\"'" >/dev/null 2>&1 || true
  fi
  su postgres -c "$bin/pg_ctl -D $PGDATA -m fast -w stop" >/dev/null
fi
chown -R postgres:postgres "$PGDATA"
exec su postgres -c "exec $bin/postgres -D $PGDATA -c listen_addresses=*"
SH
standin hearth-offline/postgres:local "$pg_entry" <<'DOCKERFILE'
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends postgresql-15 postgresql-client-15 \
 && rm -rf /var/lib/apt/lists/* && rm -rf /var/lib/postgresql/15 /etc/postgresql/15/main \
 && mkdir -p /var/run/postgresql && chown postgres:postgres /var/run/postgresql
COPY pg-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
RUN chmod +x /usr/local/bin/docker-entrypoint.sh
STOPSIGNAL SIGINT
EXPOSE 5432
ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]
DOCKERFILE

standin hearth-offline/redis:local <<'DOCKERFILE'
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends redis-server redis-tools \
 && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no"]
DOCKERFILE

standin hearth-offline/prometheus:local <<'DOCKERFILE'
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends prometheus wget \
 && rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
USER prometheus
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
DOCKERFILE

standin hearth-offline/nginx:local <<'DOCKERFILE'
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends nginx-light \
 && rm -rf /var/lib/apt/lists/*
EXPOSE 8080
STOPSIGNAL SIGQUIT
CMD ["nginx", "-g", "daemon off;"]
DOCKERFILE

log "done: $(docker images --format '{{.Repository}}:{{.Tag}}' | grep -E '^(debian:bookworm-slim|hearth-offline/)' | tr '\n' ' ')"
