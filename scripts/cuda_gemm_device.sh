#!/bin/bash
# cuda_gemm_device.sh - the tiled GEMM's device run (docs/CUDA.md "Model forward"), in a
# scripts/cuda_pack.sh folder with heldout-150k.txt: test_cuda_model on MODEL_DIR (its
# test_gemm: float64 accuracy and bitwise rows across the direct, split and tiled paths),
# racecheck and memcheck of test_gemm, tqkv bench gemm with each TQKV_GEMM_TILED mode in
# MODES (default "1 0": the tiled kernel, then the direct one; two rounds, alternating)
# beside cuBLAS (cuda_gemm_anchor.py), ppl on the device in each mode (the same arithmetic:
# the same digits), and the Llama-3.1-8B-shaped random checkpoint's prefill (8 rows x 512
# and 2 x 4096) and decode (32 rows at 4096, synthetic fill) in each mode.
# Logs and JSON in $OUT/results.tgz (+ $OUT/gemm.log).
#   Usage: cd PACK && OUT=$OUT [MODES='1 0'] ./cuda_gemm_device.sh MODEL_DIR
set -u -o pipefail
M=${1:?model dir}
NAME=gemm; . "$(dirname "$0")/cuda_run_common.sh"
TOK=${TOKENS:-1,8,16,24,32,64,128,512,2048}
step 120 test_cuda_model env TQKV_TEST_MODEL="$M" ./test_cuda_model >"$W/test_cuda_model.log" 2>&1
for tool in racecheck memcheck; do
  step 200 "$tool" compute-sanitizer --tool $tool --error-exitcode 9 env TQKV_TEST_MODEL="$M" \
    TQKV_TEST_SEED=1 TQKV_TEST_FILTER=test_gemm ./test_cuda_model >"$W/sanitizer_$tool.log" 2>&1
done
MODES=${MODES:-1 0}
for r in 1 2; do for t in $MODES; do
  step 150 "bench_gemm_t${t}_r$r" env TQKV_GEMM_TILED=$t ./tqkv bench gemm \
    --shapes 6144x4096,4096x4096,28672x4096,4096x14336,128256x4096 --tokens "$TOK" --json \
    >"$W/bench_gemm_t${t}_r$r.json" 2>"$W/bench_gemm_t${t}_r$r.err"
done; done
step 180 gemm_anchor python3 cuda_gemm_anchor.py --tokens "$TOK" --out "$W/gemm_anchor.json" \
  >"$W/gemm_anchor.log" 2>&1
for t in $MODES; do
  step 90 "ppl_t$t" env TQKV_GEMM_TILED=$t ./tqkv ppl --device cuda --model "$M" --text heldout-150k.txt \
    --ctx 2048 --max-windows 4 --kv tq4 --json >"$W/ppl_t$t.json" 2>"$W/ppl_t$t.err"
done
B=/tmp/llama8b
step 150 make_llama8b python3 cuda_make_llama8b.py $B >"$W/make_llama8b.log" 2>&1
for t in $MODES; do
  step 150 "prefill8_t$t" env TQKV_GEMM_TILED=$t ./tqkv bench model --device cuda --model $B --ctx 512 \
    --kv tq4 --rows 8 --gen 8 --reps 2 --json >"$W/prefill8_t$t.json" 2>"$W/prefill8_t$t.err"
  step 150 "prefill4k_t$t" env TQKV_GEMM_TILED=$t ./tqkv bench model --device cuda --model $B --ctx 4096 \
    --kv tq4 --rows 2 --gen 8 --reps 1 --json >"$W/prefill4k_t$t.json" 2>"$W/prefill4k_t$t.err"
  step 150 "decode32_t$t" env TQKV_GEMM_TILED=$t ./tqkv bench model --device cuda --model $B --ctx 4096 \
    --kv tq4 --rows 32 --gen 16 --reps 2 --fill synthetic --json >"$W/decode32_t$t.json" 2>"$W/decode32_t$t.err"
done
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >>"$LOG" 2>&1
cp "$LOG" "$OUT/gemm.log"
