#!/bin/bash
# cuda_tq3_probe_device.sh - how far any new tq3 byte layout could take tq3's decode
# attention (docs/CUDA.md "Not done"): in a scripts/cuda_pack.sh folder that also holds
# tqkv_sol1 and tqkv_sol2 (tqkv-cli built with -DCMAKE_CUDA_FLAGS=-DTQKV_TQ3_SOL=1 / 2:
# lookup words as cheap as any layout could make them / and no codebook loads; their tq3
# attention is wrong on purpose, timing only), ROUNDS rounds of bench attention on the
# three binaries in turn, then the cuDNN anchor at the same points. Logs and JSON in
# $OUT/results.tgz (+ $OUT/tq3probe.log).
#   Usage: cd PACK && OUT=$OUT [BATCHES=8,32 CTXS=65536,131072 ROUNDS=3] ./cuda_tq3_probe_device.sh
set -u -o pipefail
NAME=tq3probe; . "$(dirname "$0")/cuda_run_common.sh"
B=${BATCHES:-8,32}; C=${CTXS:-65536,131072}
for r in $(seq "${ROUNDS:-3}"); do
  for v in tqkv tqkv_sol1 tqkv_sol2; do
    step 120 "${v}_r$r" ./$v bench attention --device cuda --batches "$B" --ctxs "$C" \
      --formats tq4,tq3 --reps 20 --out "$W/${v}_r$r.json" >"$W/${v}_r$r.txt" 2>&1
  done
done
step 180 anchor python3 cuda_anchor.py --batches "$B" --ctxs "$C" --out "$W/anchor.json" \
  >"$W/anchor.txt" 2>&1
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >>"$LOG" 2>&1
cp "$LOG" "$OUT/tq3probe.log"
