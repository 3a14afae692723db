#!/usr/bin/env bash
# tests/serve/openai/run.sh TQKV_BINARY [CHAT] - start `tqkv serve` on a free loopback
# port with an API key, install the pinned openai npm client (npm ci, from
# package-lock.json) and run client.mjs against it; then SIGTERM, expecting exit 0.
# Exit 77 (skipped) when node/npm or the npm registry is unavailable.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="$1"; chat="${2:-0}"
command -v node >/dev/null && command -v npm >/dev/null || { echo "SKIP: node/npm absent"; exit 77; }
if [ ! -d "$here/node_modules/openai" ]; then
  (cd "$here" && npm ci --no-audit --no-fund >/dev/null 2>&1) || { echo "SKIP: npm ci failed (offline?)"; exit 77; }
fi
pf="$(mktemp)"; rm -f "$pf"
"$bin" serve --port 0 --port-file "$pf" --api-key test-key --kv tq4 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null || true' EXIT
for _ in $(seq 1200); do [ -s "$pf" ] && break; sleep 0.1; done
[ -s "$pf" ] || { echo "server did not start"; exit 1; }
port="$(cat "$pf")"; rm -f "$pf"
node "$here/client.mjs" "http://127.0.0.1:$port/v1" test-key "$chat"
kill -TERM $pid
trap - EXIT
wait $pid
