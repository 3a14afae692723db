#!/bin/bash
# cuda_step_profile.sh - where one decode step's time goes, kernel by kernel (Nsight Compute),
# in a scripts/cuda_pack.sh folder on the device:
#   ./cuda_step_profile.sh MODEL_DIR [SKIP] [COUNT] [-- extra `tqkv bench model` options]
# Runs `tqkv bench model --device cuda --model MODEL_DIR --rows 1 --ctx 4096 --kv tq4 --fill
# synthetic` under ncu (gpu__time_duration.sum, dram__bytes_read.sum) over COUNT launches
# after SKIP (the synthetic fill's launches: 4400 was past them for a 4-layer Qwen3-30B-A3B at
# ctx 4096, session 18), then ncu_step_table.py: one step's kernels (from one embed_kernel to
# the next) as a table and as JSON. Writes $OUT/step.txt, $OUT/step.json, $OUT/ncu.txt.
# Each kernel runs alone under ncu (serialized, caches flushed, clocks locked): the sum is
# more than the step takes in its CUDA graph; use it for shares, not for the step's time.
set -u
M=${1:?model dir}; SKIP=${2:-4400}; COUNT=${3:-200}; shift $(( $# < 3 ? $# : 3 ))
[ "${1:-}" = "--" ] && shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PATH=$PATH:/usr/local/cuda/bin LD_LIBRARY_PATH=$PWD/lib:/usr/local/cuda/lib64
timeout 300 ncu --launch-skip "$SKIP" --launch-count "$COUNT" \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum ./tqkv bench model --device cuda \
  --model "$M" --rows 1 --ctx 4096 --kv tq4 --gen 64 --reps 1 --fill synthetic "$@" >"$OUT/ncu.txt" 2>&1
python3 ncu_step_table.py "$OUT/ncu.txt" | tee "$OUT/step.txt"
python3 ncu_step_table.py "$OUT/ncu.txt" --json >"$OUT/step.json"
