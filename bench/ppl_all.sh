#!/usr/bin/env bash
# ppl_all.sh - perplexity and KL divergence of every KV configuration on the held-out text
# (ctx 2048, all 48 windows), as in ../shared/README.md's reference table. Takes a while:
# each configuration runs an f32-cache pass and its own pass per window. Configurations with a
# recent window feed tokens one at a time (--chunk 1), as decoding does: the q8 window is
# measured from the end of the row, so a whole-window prefill would reach only its last W tokens.
# usage: bench/ppl_all.sh [OUTDIR] [MAX_WINDOWS]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/out}
mw=${2:-48}
text=${TQKV_TEXT:-../shared/data/heldout-code.txt}
mkdir -p "$out"
for cfg in "f32" "q8" "q4" "tq4" "tq3" "tq4/tq3" "tq2" "tq4 32" "tq3 32" "tq3 64" "tq3/tq2 32"; do
  set -- $cfg
  kv=$1; w=${2:-0}
  name=$(echo "$kv-w$w" | tr '/' '_')
  echo "== ppl $kv window $w" >&2
  kld=--kld; [ "$kv" = f32 ] && kld=
  chunk=2048; [ "$w" != 0 ] && chunk=1
  build/tqkv ppl --model models/qwen3-code-28m --text "$text" --ctx 2048 --max-windows "$mw" \
    --kv "$kv" --window "$w" --chunk "$chunk" $kld --threads "${TQKV_BENCH_THREADS:-2}" --json \
    | tail -n 1 > "$out/ppl_$name.json"
  cat "$out/ppl_$name.json" >&2
done
