#!/usr/bin/env bash
# Builds the web UI (web/, Next.js) into web/out, the static export `hearth` serves at /.
#
#   scripts/build-web.sh          install dependencies if needed, build if web/out is missing
#                                 or older than any source file under web/
#   scripts/build-web.sh --deps   only check Node and install dependencies if needed
#   scripts/build-web.sh --force  build even if web/out looks current
#
# Dependencies are installed with `npm ci` (exact versions from package-lock.json) when
# web/node_modules is missing or older than web/package-lock.json. Nothing is downloaded at
# build time beyond the npm packages themselves.
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:-build}"
case "$mode" in
  build | --deps | --force) ;;
  *)
    echo "usage: $0 [--deps | --force]" >&2
    exit 2
    ;;
esac

web=web
stamp="$web/out/.hearth-built"
need_node="20.9"
install_hint="Node.js >= $need_node with npm (Debian: apt-get install nodejs npm; or https://nodejs.org)"

log() { printf 'build-web: %s\n' "$*" >&2; }

# Next.js needs Node >= 20.9.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  missing=$(command -v node >/dev/null 2>&1 && echo npm || echo node)
  log "the web UI needs $install_hint; \`$missing\` is not installed"
  exit 1
fi
version="$(node -p 'process.versions.node' 2>/dev/null || echo 0.0.0)"
IFS=. read -r major minor _ <<<"$version"
want_major="${need_node%%.*}"
want_minor="${need_node#*.}"
if ((major < want_major || (major == want_major && minor < want_minor))); then
  log "Node.js $version is too old: the web UI needs $install_hint"
  exit 1
fi

if [[ ! -d "$web/node_modules" || "$web/package-lock.json" -nt "$web/node_modules" ]]; then
  log "installing the UI's dependencies (npm ci)"
  ci_log="$(mktemp)"
  if ! (cd "$web" && npm ci --no-audit --no-fund) >"$ci_log" 2>&1; then
    # A registry mirror without every platform's optional packages (macOS and Windows builds
    # of Next's compiler, say) yields a lock file that `npm ci` calls out of sync although
    # every package this machine needs is in it; `npm install` installs the same versions.
    grep -m 3 'npm error' "$ci_log" >&2 || true
    log "npm ci refused (above); installing the locked versions with npm install"
    (cd "$web" && npm install --no-audit --no-fund)
  else
    cat "$ci_log" >&2
  fi
  rm -f "$ci_log"
  touch "$web/node_modules"
fi
[[ "$mode" == --deps ]] && exit 0

# Current when the last build's stamp is newer than every source file (build outputs, test
# results, the e2e run's screenshots and dependencies are not sources).
stale() {
  [[ "$mode" == --force || ! -f "$stamp" || ! -f "$web/out/index.html" ]] && return 0
  local newer
  newer="$(find "$web" \
    \( -path "$web/node_modules" -o -path "$web/.next" -o -path "$web/out" \
    -o -path "$web/test-results" -o -path "$web/playwright-report" -o -path "$web/screenshots" \) \
    -prune \
    -o -type f ! -name '*.tsbuildinfo' ! -name 'next-env.d.ts' -newer "$stamp" -print -quit)"
  [[ -n "$newer" ]] && log "$newer changed since the last build"
  [[ -n "$newer" ]]
}

if stale; then
  log "building the UI into $web/out (npm run build)"
  started=$SECONDS
  (cd "$web" && npm run build)
  if [[ ! -f "$web/out/index.html" ]]; then
    log "the build wrote no $web/out/index.html (is \`output: \"export\"\` set in next.config.ts?)"
    exit 1
  fi
  touch "$stamp"
  log "built in $((SECONDS - started)) s"
else
  log "$web/out is up to date"
fi
