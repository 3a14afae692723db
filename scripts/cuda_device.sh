#!/bin/bash
# cuda_device.sh - one device run of the CUDA backend (kernel tests, sanitizer, anchor,
# benchmark), logs and JSON under $OUT. Runs in a folder made by scripts/cuda_pack.sh
# (binaries built on the build host, their shared libraries in ./lib):
#   cd PACK && ./cuda_device.sh [quick|full]
# quick: build + test_cuda + a small benchmark; full: + compute-sanitizer + the whole grid.
set -u -o pipefail
MODE=${1:-quick}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PATH=$PATH:/usr/local/cuda/bin
LOG=$OUT/device.log
{
date -u; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv
apt list --installed 2>/dev/null | grep -E "^(libcmocka|libcjson|libpcre2-dev|libutf8proc|libopenblas)" | head
} >"$LOG" 2>&1
export LD_LIBRARY_PATH=$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
mkdir -p build-dev && cp tqkv test_cuda build-dev/
ldd build-dev/tqkv | grep -i "not found" && { echo "MISSING LIBRARIES"; exit 1; }
# ---- kernel tests ----
./build-dev/test_cuda 2>&1 | tee "$OUT/test_cuda.log"
echo "test_cuda rc=${PIPESTATUS[0]}" | tee -a "$LOG"
if [ "$MODE" = full ]; then
  for tool in memcheck racecheck; do
    TQKV_TEST_SEED=1 compute-sanitizer --tool $tool --error-exitcode 9 ./build-dev/test_cuda >"$OUT/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool rc=$?  $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1)" | tee -a "$LOG"
  done
  B=${BATCHES:-1,8,32}; C=${CTXS:-4096,16384,65536,131072}
else
  B=${BATCHES:-1,8}; C=${CTXS:-4096,131072}
fi
# ---- anchor (PyTorch cuDNN SDPA, bf16) then ours, in this one run ----
PYTHONUNBUFFERED=1 python3 cuda_anchor.py --batches $B --ctxs $C --out "$OUT/anchor.json" 2>&1 | tee -a "$LOG"
./build-dev/tqkv bench attention --device cuda --batches $B --ctxs $C --anchor "$OUT/anchor.json" \
  --out "$OUT/cuda-attention.json" 2>&1 | tee "$OUT/bench.txt"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >>"$LOG" 2>&1
