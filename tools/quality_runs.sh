#!/bin/bash
# tools/quality_runs.sh OUT.jsonl [WINDOWS_QWEN3] [WINDOWS_OTHERS]
# Runs `tqkv ppl --kld --json` for every configuration of docs/QUALITY.md on the held-out
# text (ctx 2048) and appends one line per run: {"model", "args", "res": <ppl --json>}.
# Then the long-context set (issue 23): qwen3-code-28m-8k at ctx 8192, WINDOWS_OTHERS windows.
# ONLY=long runs only that set, ONLY=short only the ctx-2048 one.
# Then: python3 tools/quality_table.py OUT.jsonl > table.md
set -e
OUT=${1:?usage: quality_runs.sh OUT.jsonl [windows_qwen3] [windows_others]}
WQ=${2:-48}; WO=${3:-16}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${TQKV:-$ROOT/build/tqkv}
TEXT=$ROOT/../shared/data/heldout-code.txt
run() { # model windows args...
  local m=$1 w=$2; shift 2
  local res
  res=$($BIN ppl --model "$m" --text "$TEXT" --max-windows "$w" --json "$@" 2>/dev/null | tail -1)
  echo "{\"model\":\"$(basename "$m")\",\"args\":\"$*\",\"res\":$res}" >> "$OUT"
}
ONLY=${ONLY:-}
[ "$ONLY" = long ] || for m in "$ROOT/models/qwen3-code-28m" "$ROOT/../shared/models/gemma4-code-30m" \
         "$ROOT/../shared/models/qwen35-code-hybrid-30m"; do
  [ -d "$m" ] || continue
  w=$WO; case $m in *qwen3-code-28m) w=$WQ;; esac
  run "$m" "$w" --kv f32
  for kv in q8 fp8 q4 tq4 tq3 tq4/tq3 q8/tq4 auto:4.25 auto:3.25 auto:2.5; do
    run "$m" "$w" --kv "$kv" --kld
  done
  run "$m" "$w" --kv tq4 --window 32 --kld
  run "$m" "$w" --kv tq3 --window 32 --kld
done
L=$ROOT/../shared/models/qwen3-code-28m-8k
if [ -d "$L" ] && [ "$ONLY" != short ]; then
  run "$L" "$WO" --ctx 8192 --kv f32
  for kv in tq4 fp8 auto:4.25 auto:3.25 auto:2.5; do
    run "$L" "$WO" --ctx 8192 --kv "$kv" --kld
  done
fi
