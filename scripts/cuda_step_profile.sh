#!/bin/bash
# cuda_step_profile.sh - where one decode step's time goes, kernel by kernel (Nsight Compute),
# in a scripts/cuda_pack.sh folder on the device:
#   ./cuda_step_profile.sh MODEL_DIR [SKIP [COUNT]] [-- extra `tqkv bench model` options]
# Runs `tqkv bench model --device cuda --model MODEL_DIR --rows 1 --ctx 4096 --kv tq4 --gen 16
# --fill synthetic` under ncu (gpu__time_duration.sum, dram__bytes_read.sum), then
# ncu_step_table.py on the last complete step (from one embed_kernel to the next) as a table
# and as JSON: $OUT/step.txt, $OUT/step.json, $OUT/ncu.txt.
#  - no SKIP: the synthetic fill's kernels are left out by name (cf_fill_normal, ce_encode,
#    advance_rows), so the step's own ce_encode and advance_rows launches are too (two small
#    kernels a layer); COUNT (default 1000) launches of the rest: a short prefill, then decode
#    steps (a Llama-8B step is ~390 of them, session 18);
#  - SKIP: every kernel, COUNT (default 200) launches after the first SKIP (4400 was past the
#    fill for a 4-layer Qwen3-30B-A3B at ctx 4096).
# Each kernel runs alone under ncu (serialized, caches flushed, clocks locked): the sum is
# more than the step takes in its CUDA graph; use it for shares, not for the step's time.
set -u
M=${1:?model dir}; shift
SKIP=; COUNT=1000
if [ $# -gt 0 ] && [ "$1" != "--" ]; then SKIP=$1; COUNT=200; shift; fi
if [ $# -gt 0 ] && [ "$1" != "--" ]; then COUNT=$1; shift; fi
[ "${1:-}" = "--" ] && shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PATH=$PATH:/usr/local/cuda/bin LD_LIBRARY_PATH=$PWD/lib:/usr/local/cuda/lib64
if [ -z "$SKIP" ]; then SEL=(--kernel-name 'regex:^(?!cf_fill_normal|ce_encode|advance_rows)'); else SEL=(--launch-skip "$SKIP"); fi
timeout 300 ncu "${SEL[@]}" --launch-count "$COUNT" --metrics gpu__time_duration.sum,dram__bytes_read.sum \
  ./tqkv bench model --device cuda --model "$M" --rows 1 --ctx 4096 --kv tq4 --gen 16 --reps 1 \
  --fill synthetic "$@" >"$OUT/ncu.txt" 2>&1
python3 ncu_step_table.py "$OUT/ncu.txt" | tee "$OUT/step.txt"
python3 ncu_step_table.py "$OUT/ncu.txt" --json >"$OUT/step.json"
