#!/usr/bin/env bash
# run_all.sh - the benchmarks behind bench/RESULTS.md, in one run on one machine.
# usage: bench/run_all.sh [OUTDIR]    (default bench/out; JSON per benchmark + machine.txt)
# Needs a Release build in build/ (scripts/demo.sh or cmake --build build).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/out}
mkdir -p "$out"
bin=build/tqkv
t=${TQKV_BENCH_THREADS:-2}
{
  echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
  echo "cores: $(nproc), threads used: $t"
  echo "flags: $(grep -o -w -E 'avx2|fma|f16c|avx512f' /proc/cpuinfo | sort -u | tr '\n' ' ')"
} | tee "$out/machine.txt"

step() { echo "== $1" >&2; }
step "formats";   $bin formats --dim 128 --json > "$out/formats.json"
step "codec";     $bin bench codec --dim 128 --json > "$out/codec.json"
step "attention ctx 16384"
$bin bench attention --ctx 16384 --batch 1 --q-heads 32 --kv-heads 8 --dim 128 \
  --threads "$t" --reps 31 --json > "$out/attention_16k.json"
step "attention ctx 4096"
$bin bench attention --ctx 4096 --batch 1 --q-heads 32 --kv-heads 8 --dim 128 \
  --threads "$t" --reps 31 --json > "$out/attention_4k.json"
step "model"
$bin bench model --model models/qwen3-code-28m --ctx 512,4096 --kv f32,f16,q8,tq4,tq3 \
  --threads "$t" --gen 64 --json > "$out/model.json"
echo "results in $out" >&2
