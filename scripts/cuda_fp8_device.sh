#!/bin/bash
# cuda_fp8_device.sh - fp8's decode on the tensor-core split kernel (docs/CUDA.md "Other
# formats"), in a scripts/cuda_pack.sh folder: test_cuda's fmt cases with fp8 at d = 128 on the
# tensor-core kernel and again on the float32 one (TQKV_FP8_TC=0), all of test_cuda once,
# test_cuda_model's fp8 parity, compute-sanitizer memcheck / racecheck / synccheck of
# test_cuda_decode_fmt (full mode), then the cuDNN anchor (PyTorch SDPA, bf16) and ROUNDS
# rounds of `tqkv bench attention` (bf16, tq4, fp8 on the tensor-core kernel; fp8 on the
# float32 one) against it (speedup = the anchor's ms / ms). When the folder also holds tqkv_int
# and test_cuda_int (tqkv-cli and test_cuda built with -DCMAKE_CUDA_FLAGS=-DTQKV_FP8_CVT=0: the
# fragments by integer ops instead of cvt), their fmt tests and fp8 bench run too.
# Logs and JSON in $OUT/results.tgz (+ $OUT/fp8.log).
#   Usage: cd PACK && OUT=$OUT [BATCHES=8,32 CTXS=65536,131072 ROUNDS=2] ./cuda_fp8_device.sh [quick]
set -u -o pipefail
MODE=${1:-full}
NAME=fp8; . "$(dirname "$0")/cuda_run_common.sh"
for tc in 1 0; do
  step 600 "test_fmt_tc$tc" env TQKV_FP8_TC=$tc TQKV_TEST_FILTER='*_fmt' ./test_cuda >"$W/test_fmt_tc$tc.log" 2>&1
done
step 900 test_cuda_all ./test_cuda >"$W/test_cuda_all.log" 2>&1
[ -x ./test_cuda_int ] && step 600 test_fmt_int env TQKV_TEST_FILTER='*_fmt' ./test_cuda_int >"$W/test_fmt_int.log" 2>&1
[ -x ./test_cuda_model ] && step 300 test_parity_fp8 env TQKV_TEST_FILTER=test_parity_fp8 ./test_cuda_model \
  >"$W/test_parity_fp8.log" 2>&1
if [ "$MODE" != quick ]; then
  for tool in memcheck racecheck synccheck; do
    step 900 "sanitizer_$tool" compute-sanitizer --tool $tool --error-exitcode 9 env TQKV_TEST_SEED=1 \
      TQKV_TEST_FILTER=test_cuda_decode_fmt ./test_cuda >"$W/sanitizer_$tool.log" 2>&1
  done
fi
B=${BATCHES:-8,32}; C=${CTXS:-65536,131072}
step 180 anchor python3 cuda_anchor.py --batches "$B" --ctxs "$C" --out "$W/anchor.json" >"$W/anchor.txt" 2>&1
A=(); [ -s "$W/anchor.json" ] && A=(--anchor "$W/anchor.json")   # speedup = cuDNN ms / ms
for r in $(seq "${ROUNDS:-2}"); do
  step 180 "bench_tc_r$r" ./tqkv bench attention --device cuda --batches "$B" --ctxs "$C" \
    --formats bf16,tq4,fp8 --reps 20 ${A[@]+"${A[@]}"} --out "$W/bench_tc_r$r.json" >"$W/bench_tc_r$r.txt" 2>&1
  step 180 "bench_f32_r$r" env TQKV_FP8_TC=0 ./tqkv bench attention --device cuda --batches "$B" --ctxs "$C" \
    --formats fp8 --reps 20 ${A[@]+"${A[@]}"} --out "$W/bench_f32_r$r.json" >"$W/bench_f32_r$r.txt" 2>&1
  [ -x ./tqkv_int ] && step 180 "bench_int_r$r" ./tqkv_int bench attention --device cuda --batches "$B" --ctxs "$C" \
    --formats fp8 --reps 20 ${A[@]+"${A[@]}"} --out "$W/bench_int_r$r.json" >"$W/bench_int_r$r.txt" 2>&1
done
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >>"$LOG" 2>&1
cp "$LOG" "$OUT/fp8.log"
