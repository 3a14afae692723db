#!/bin/bash
# cuda_gemma4_device.sh - the Gemma 4 device run (docs/CUDA.md, "Gemma 4 on the device"), in
# a scripts/cuda_pack.sh folder that also holds gemma4.tar.xz (the fixture, made on the build
# host: tar cJf PACK/gemma4.tar.xz -C ../shared/models gemma4-code-30m) and heldout-150k.txt.
# Unpacks the fixture to ./shared/models, then: test_cuda_gemma4 (GPU vs CPU parity past the
# sliding window, batch invariance, spec rounds, row operations, export / import, graphs,
# misuse), tqkv ppl on the GPU and the CPU (f32 / tq4 / tq3, ctx 2048, 4 windows; f32 on
# the device is its dense bf16 cache, head_dim 128 and 256), greedy 64-token continuations
# GPU vs CPU (short: the sliding bound is crossed by test_cuda_gemma4 and by ppl's
# 2048-token windows), bench model decode speed (rows 1 / 8 / 32, ctx 512 / 4096: past the
# window; f32, the dense bf16 baseline, at rows 8), compute-sanitizer memcheck of
# test_cuda_gemma4's spec-round and row cases. Logs in a work folder packed into
# $OUT/results.tgz after every step (at most 8 files come back).
# Mode graphs: test_cuda_gemma4, test_cuda_model's graph and device-pick cases on the fixture
# (TQKV_TEST_MODEL; its parity bounds are Qwen3's, so the rest of it is not run here) and
# bench model with decode graphs off and on, below the sliding window (ctx 128 / 400) and
# past it (4096), rows 1 / 8 / 32, tq4.
#   Usage: cd PACK && OUT=$OUT ./cuda_gemma4_device.sh [full|graphs]
set -u -o pipefail
MODE=${1:-full}
mkdir -p shared/models && tar xJf gemma4.tar.xz -C shared/models || exit 1
export TQKV_SHARED=$PWD/shared
M=shared/models/gemma4-code-30m; TXT=heldout-150k.txt
NAME=gemma4; . "$(dirname "$0")/cuda_run_common.sh"
step 300 test_cuda_gemma4 ./test_cuda_gemma4 >"$W/test_cuda_gemma4.log" 2>&1
if [ "$MODE" = graphs ]; then
  for f in 'test_graphs*' 'test_pick_model*'; do
    step 300 "test_cuda_model_${f%\*}" env TQKV_TEST_MODEL="$M" TQKV_TEST_FILTER="$f" ./test_cuda_model \
      >"$W/test_cuda_model_${f%\*}.log" 2>&1
  done
  for rows in 1 8 32; do
    step 120 "bench_graphs_rows$rows" ./tqkv bench model --device cuda --model "$M" --ctx 128,400,4096 \
      --kv tq4 --rows $rows --gen 64 --reps 2 --graphs 0,1 --json >"$W/bench_graphs_rows$rows.json" \
      2>"$W/bench_graphs_rows$rows.err"
  done
  cp "$LOG" "$OUT/gemma4.log"
  exit 0
fi
for kv in f32 tq4 tq3; do for dev in cuda cpu; do
  step 90 "ppl_${dev}_$kv" ./tqkv ppl --device $dev --model "$M" --text "$TXT" --ctx 2048 --max-windows 4 \
    --kv "$kv" --threads 16 --json >"$W/ppl_${dev}_$kv.txt" 2>"$W/ppl_${dev}_$kv.err"
done; done
for kv in f32 tq4 tq3; do for dev in cuda cpu; do
  step 60 "run_${dev}_$kv" ./tqkv run --device $dev --model "$M" --prompt "def fibonacci(n):" -n 64 --temp 0 \
    --ignore-eos --kv $kv --threads 16 --json >"$W/run_${dev}_$kv.txt" 2>"$W/run_${dev}_$kv.err"
done; done
for rows in 1 8 32; do
  step 90 "bench_rows$rows" ./tqkv bench model --device cuda --model "$M" --ctx 512,4096 --kv tq4,tq3 \
    --rows $rows --gen 32 --reps 2 --json >"$W/bench_rows$rows.json" 2>"$W/bench_rows$rows.err"
done
step 90 bench_f32_rows8 ./tqkv bench model --device cuda --model "$M" --ctx 512,4096 --kv f32 \
  --rows 8 --gen 32 --reps 2 --json >"$W/bench_f32_rows8.json" 2>"$W/bench_f32_rows8.err"
step 300 memcheck compute-sanitizer --tool memcheck --error-exitcode 9 env TQKV_TEST_SEED=1 \
  TQKV_TEST_FILTER='test_spec_rounds*' ./test_cuda_gemma4 >"$W/sanitizer_memcheck_gemma4.log" 2>&1
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >>"$LOG" 2>&1
cp "$LOG" "$OUT/gemma4.log"
