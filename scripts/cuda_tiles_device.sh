#!/bin/bash
# cuda_tiles_device.sh - the next steps for the one-token GEMM (bench/RESULTS.md "Session 17"),
# in priority order, each step's logs packed into $OUT/results.tgz as it ends:
#  1. kchunk_probe (dev/experiments; in the pack when cuda_pack.sh found nvcc): a one-token
#     GEMM over fixed K chunks in parallel warps against one chain over K, on the Llama-8B and
#     Qwen3-30B-A3B shapes: how much a fixed K-chunked order would buy before anyone builds it;
#  2. s8t as the one-token tile everywhere (TQKV_GEMM_TILE=s8t forces it at every T, prefill
#     included, a stronger check than the pick): test_cuda_model and test_cuda_moe, plain and
#     with PDL; they must pass as they do under the pick before s8t becomes the pick;
#  3. the Llama-8B and 4-layer Qwen3-30B-A3B 1-row steps, pick against s8t, two rounds.
# MODEL_DIR: a qwen3 checkpoint for test_cuda_model (the draft model of ../shared is 7.4 MB).
# Runs in a scripts/cuda_pack.sh folder:   cd PACK && ./cuda_tiles_device.sh MODEL_DIR
set -u -o pipefail
M=${1:?model dir}
NAME=tiles; . "$(dirname "$0")/cuda_run_common.sh"
t() { local s=$1 n=$2; shift 2; step $s $n "$@" >"$W/$n.log" 2>&1; echo "== $n: $(grep -hE '^\[  (PASSED|FAILED)|SKIPPED' "$W/$n.log" | tr '\n' ' ')"; }
[ -x ./kchunk_probe ] && { step 120 kchunk ./kchunk_probe 50 --json >"$W/kchunk.json" 2>"$W/kchunk.txt"; cat "$W/kchunk.txt"; }
export TQKV_TEST_MODEL=$M
for pdl in 0 1; do
  TQKV_GEMM_TILE=s8t TQKV_PDL=$pdl t 120 model_s8t_pdl$pdl ./test_cuda_model
  TQKV_GEMM_TILE=s8t TQKV_PDL=$pdl t 60 moe_s8t_pdl$pdl ./test_cuda_moe
done
L=/tmp/llama8b; [ -f $L/model.safetensors.index.json ] || step 90 make8b python3 cuda_make_llama8b.py $L >"$W/make8b.log" 2>&1
Q=/tmp/prof_moe; [ -f $Q/config.json ] || step 60 make_moe python3 cuda_make_qwen3moe30b.py $Q 4 >"$W/make_moe.log" 2>&1
for r in 1 2; do for tile in pick s8t; do for m in l8 moe; do
  d=$L; [ $m = moe ] && d=$Q
  TQKV_GEMM_TILE=$([ $tile = s8t ] && echo s8t) step 60 ${m}_${tile}_$r ./tqkv bench model --device cuda --model $d \
    --rows 1 --ctx 4096 --kv tq4 --gen 32 --reps 2 --fill synthetic --json >"$W/${m}_${tile}_$r.json" 2>"$W/${m}_${tile}_$r.err"
  grep "^4096" "$W/${m}_${tile}_$r.err" | sed "s/^/$m $tile r$r /"
done; done; done
cat "$LOG"
