#!/bin/bash
# cuda_tiles_device.sh - the one-token GEMM on the device (bench/RESULTS.md "Session 18"):
#  1. kchunk_probe (dev/experiments; in the pack when cuda_pack.sh found nvcc): a one-token
#     GEMM over fixed K chunks in parallel warps against one chain over K (its base is weaker
#     than the production s8n: read it beside step 3);
#  2. test_cuda_model and test_cuda_moe, plain and with PDL (s8t is the one-token pick);
#  3. the Llama-8B and 4-layer Qwen3-30B-A3B 1-row steps, the pick (s8t) against s8n forced,
#     two rounds.
# MODEL_DIR: a qwen3 checkpoint for test_cuda_model (the draft model of ../shared is 7.4 MB).
# Runs in a scripts/cuda_pack.sh folder:   cd PACK && ./cuda_tiles_device.sh MODEL_DIR
set -u -o pipefail
M=${1:?model dir}
NAME=tiles; . "$(dirname "$0")/cuda_run_common.sh"
t() { local s=$1 n=$2; shift 2; step $s $n "$@" >"$W/$n.log" 2>&1; echo "== $n: $(grep -hE '^\[  (PASSED|FAILED)|SKIPPED' "$W/$n.log" | tr '\n' ' ')"; }
[ -x ./kchunk_probe ] && { step 120 kchunk ./kchunk_probe 50 --json >"$W/kchunk.json" 2>"$W/kchunk.txt"; cat "$W/kchunk.txt"; }
export TQKV_TEST_MODEL=$M
for pdl in 0 1; do
  TQKV_PDL=$pdl t 120 model_pdl$pdl ./test_cuda_model
  TQKV_PDL=$pdl t 60 moe_pdl$pdl ./test_cuda_moe
done
L=/tmp/llama8b; [ -f $L/model.safetensors.index.json ] || step 90 make8b python3 cuda_make_llama8b.py $L >"$W/make8b.log" 2>&1
Q=/tmp/prof_moe; [ -f $Q/config.json ] || step 60 make_moe python3 cuda_make_qwen3moe30b.py $Q 4 >"$W/make_moe.log" 2>&1
for r in 1 2; do for tile in pick s8n; do for m in l8 moe; do
  d=$L; [ $m = moe ] && d=$Q
  TQKV_GEMM_TILE=$([ $tile = s8n ] && echo s8n) step 60 ${m}_${tile}_$r ./tqkv bench model --device cuda --model $d \
    --rows 1 --ctx 4096 --kv tq4 --gen 32 --reps 2 --fill synthetic --json >"$W/${m}_${tile}_$r.json" 2>"$W/${m}_${tile}_$r.err"
  grep "^4096" "$W/${m}_${tile}_$r.err" | sed "s/^/$m $tile r$r /"
done; done; done
cat "$LOG"
