#!/bin/bash
# cuda_gemm_device.sh - the batch-invariant GEMM's device run (docs/CUDA.md "Model forward"),
# in a scripts/cuda_pack.sh folder with heldout-150k.txt:
#  - test_cuda and test_cuda_model on MODEL_DIR (its test_gemm: float64 accuracy and bitwise
#    rows across every tile shape, both activation precisions); racecheck and memcheck of
#    test_gemm;
#  - tqkv bench gemm on Llama-3.1-8B's shapes, --parts 1 (bf16 activations) and 2 (hi + lo),
#    each point beside cuBLAS bf16 timed in the same loop (cublas_ms), two rounds;
#    cuda_gemm_anchor.py (PyTorch's cuBLAS linear) once;
#  - tqkv ppl on MODEL_DIR in each GEMM mode (GEMMS: "" = bf16 activations, --exact = hi +
#    lo, --fast-gemm = cuBLAS);
#  - the Llama-3.1-8B-shaped random checkpoint (made here): prefill 8 rows x 512, and decode
#    at depth 4096 of 1 and 32 rows (synthetic fill), in each GEMM mode.
# Logs and JSON in $OUT/results.tgz (+ $OUT/gemm.log).
#   Usage: cd PACK && OUT=$OUT [GEMMS='"" --exact --fast-gemm'] ./cuda_gemm_device.sh MODEL_DIR
set -u -o pipefail
M=${1:?model dir}
NAME=gemm; . "$(dirname "$0")/cuda_run_common.sh"
TOK=${TOKENS:-1,8,16,32,64,128,512,2048,4096}
SHAPES=6144x4096,4096x4096,28672x4096,4096x14336,128256x4096
step 120 test_cuda ./test_cuda >"$W/test_cuda.log" 2>&1
step 300 test_cuda_model env TQKV_TEST_MODEL="$M" ./test_cuda_model >"$W/test_cuda_model.log" 2>&1
for tool in racecheck memcheck; do
  step 200 "$tool" compute-sanitizer --tool $tool --error-exitcode 9 env TQKV_TEST_MODEL="$M" \
    TQKV_TEST_SEED=1 TQKV_TEST_FILTER=test_gemm ./test_cuda_model >"$W/sanitizer_$tool.log" 2>&1
done
for r in 1 2; do for p in 1 2; do
  step 150 "bench_gemm_p${p}_r$r" ./tqkv bench gemm --shapes $SHAPES --tokens "$TOK" --parts $p \
    --reps 10 --json >"$W/bench_gemm_p${p}_r$r.json" 2>"$W/bench_gemm_p${p}_r$r.err"
done; done
step 180 gemm_anchor python3 cuda_gemm_anchor.py --tokens "$TOK" --out "$W/gemm_anchor.json" \
  >"$W/gemm_anchor.log" 2>&1
GEMMS=${GEMMS:-default --exact --fast-gemm}
flag() { [ "$1" = default ] || echo "$1"; }
for g in $GEMMS; do
  step 90 "ppl$g" ./tqkv ppl --device cuda $(flag $g) --model "$M" --text heldout-150k.txt \
    --ctx 2048 --max-windows 4 --kv tq4 --json >"$W/ppl$g.json" 2>"$W/ppl$g.err"
done
B=/tmp/llama8b
step 150 make_llama8b python3 cuda_make_llama8b.py $B >"$W/make_llama8b.log" 2>&1
for g in $GEMMS; do
  step 150 "prefill8$g" ./tqkv bench model --device cuda $(flag $g) --model $B --ctx 512 \
    --kv tq4 --rows 8 --gen 8 --reps 2 --json >"$W/prefill8$g.json" 2>"$W/prefill8$g.err"
  for rows in 1 32; do
    step 150 "decode${rows}$g" ./tqkv bench model --device cuda $(flag $g) --model $B --ctx 4096 \
      --kv tq4 --rows $rows --gen 32 --reps 2 --fill synthetic --json >"$W/decode${rows}$g.json" \
      2>"$W/decode${rows}$g.err"
  done
done
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >>"$LOG" 2>&1
cp "$LOG" "$OUT/gemm.log"
