#!/usr/bin/env bash
# tests/serve/openai/run_tools.sh FAKE_SERVE - the official openai npm client against the
# server's HTTP layer on the engine test double whose every output is a tool call
# (fake_serve_main.c): tools.mjs checks message.tool_calls, streamed delta.tool_calls
# assembled by the client, and the history of a tool round trip. Exit 77 (skipped) when
# node/npm or the npm registry is unavailable.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="$1"
command -v node >/dev/null && command -v npm >/dev/null || { echo "SKIP: node/npm absent"; exit 77; }
if [ ! -d "$here/node_modules/openai" ]; then
  (cd "$here" && npm ci --no-audit --no-fund >/dev/null 2>&1) || { echo "SKIP: npm ci failed (offline?)"; exit 77; }
fi
script="$(mktemp)"; pf="$(mktemp)"; rm -f "$pf"
printf 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' > "$script"
"$bin" "$script" "$pf" test-key &
pid=$!
trap 'kill -TERM $pid 2>/dev/null || true; rm -f "$script"' EXIT
for _ in $(seq 600); do [ -s "$pf" ] && break; sleep 0.1; done
[ -s "$pf" ] || { echo "fake server did not start"; exit 1; }
port="$(cat "$pf")"; rm -f "$pf"
node "$here/tools.mjs" "http://127.0.0.1:$port/v1" test-key
kill -TERM $pid
trap - EXIT
wait $pid
rm -f "$script"
