#!/bin/bash
# cuda_d256_device.sh - the head_dim 256 decode's device run (docs/CUDA.md, "head_dim 256"), in
# a scripts/cuda_pack.sh folder: the d = 256 cases of test_cuda and test_cuda_slide on the
# tensor-core kernel and again on the float32 one (TQKV_WIDE_TC=0), all of test_cuda once
# (d = 128 unchanged), compute-sanitizer memcheck and racecheck of test_cuda_decode_d256_tc,
# then `tqkv bench attention --dim 256` with both kernels at Gemma-like shapes (8 q heads / 4
# kv heads and 32 / 4; batch 1 / 8 / 32; ctx 4k / 16k / 64k; tq4, tq3, tq4 + q8 window,
# bf16), and, when the folder holds gemma4.tar.xz (the fixture, as for cuda_gemma4_device.sh),
# `tqkv bench model` on it with both kernels. Logs in a work folder packed into
# $OUT/results.tgz after every step (at most 8 files come back).
#   Usage: cd PACK && OUT=$OUT ./cuda_d256_device.sh [quick]   (quick: no sanitizers, one bench shape)
set -u -o pipefail
MODE=${1:-full}
NAME=d256; . "$(dirname "$0")/cuda_run_common.sh"
for tc in 1 0; do
  step 600 "test_d256_tc$tc" env TQKV_WIDE_TC=$tc TQKV_TEST_FILTER='*d256*' ./test_cuda >"$W/test_d256_tc$tc.log" 2>&1
  step 300 "slide_tc$tc" env TQKV_WIDE_TC=$tc ./test_cuda_slide >"$W/slide_tc$tc.log" 2>&1
done
step 900 test_cuda_all ./test_cuda >"$W/test_cuda_all.log" 2>&1
if [ "$MODE" != quick ]; then
  for tool in memcheck racecheck; do
    step 900 "sanitizer_$tool" compute-sanitizer --tool $tool --error-exitcode 9 env TQKV_TEST_SEED=1 \
      TQKV_TEST_FILTER=test_cuda_decode_d256_tc ./test_cuda >"$W/sanitizer_$tool.log" 2>&1
  done
  SHAPES="8:4 32:4"; B=1,8,32; C=4096,16384,65536
else
  SHAPES="8:4"; B=1,8; C=4096,65536
fi
for s in $SHAPES; do qh=${s%%:*}; kvh=${s##*:}; for tc in 1 0; do
  step 600 "bench_q${qh}_kv${kvh}_tc$tc" env TQKV_WIDE_TC=$tc ./tqkv bench attention --device cuda --dim 256 \
    --q-heads $qh --kv-heads $kvh --batches $B --ctxs $C --formats tq4,tq3,tq4w,bf16 --reps 20 \
    --out "$W/bench_q${qh}_kv${kvh}_tc$tc.json" >"$W/bench_q${qh}_kv${kvh}_tc$tc.txt" 2>&1
done; done
if [ -f gemma4.tar.xz ]; then
  mkdir -p shared/models && tar xJf gemma4.tar.xz -C shared/models
  export TQKV_SHARED=$PWD/shared
  for tc in 1 0; do for rows in 1 8 32; do
    step 300 "gemma4_bench_rows${rows}_tc$tc" env TQKV_WIDE_TC=$tc ./tqkv bench model --device cuda \
      --model shared/models/gemma4-code-30m --ctx 512,4096 --kv tq4,tq3 --rows $rows --gen 32 --reps 2 \
      --json >"$W/gemma4_bench_rows${rows}_tc$tc.json" 2>"$W/gemma4_bench_rows${rows}_tc$tc.err"
  done; done
  step 300 gemma4_bench_f32 ./tqkv bench model --device cuda --model shared/models/gemma4-code-30m \
    --ctx 512,4096 --kv f32 --rows 8 --gen 32 --reps 2 --json >"$W/gemma4_bench_f32.json" 2>"$W/gemma4_bench_f32.err"
  [ -x ./test_cuda_gemma4 ] && step 300 test_cuda_gemma4 ./test_cuda_gemma4 >"$W/test_cuda_gemma4.log" 2>&1
fi
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >>"$LOG" 2>&1
cp "$LOG" "$OUT/d256.log"
