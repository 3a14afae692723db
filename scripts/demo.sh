#!/usr/bin/env bash
# demo.sh - build tqkv and run the bundled model with a TurboQuant tq4 KV cache.
# Extra arguments go to `tqkv run` (e.g. --kv tq3 --json -n 64).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh build
# BUILD_TESTING=OFF: the demo needs no test dependency (cmocka). A tree configured by
# scripts/test.sh keeps its tests (the cache variable is only set when absent).
[ -f build/CMakeCache.txt ] || testing=-DBUILD_TESTING=OFF
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release ${testing:-} >/dev/null
cmake --build build -j"$(nproc)" --target tqkv-cli >/dev/null
exec build/tqkv run --model models/qwen3-code-28m --kv tq4 --temp 0 -n 96 \
  --prompt 'def fibonacci(n):
    """Return the n-th Fibonacci number."""
' "$@"
