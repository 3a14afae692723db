#!/bin/bash
# session 17 call A (priority order, each step packs its results): the token-major tiles'
# bits (test_gemm, the grouped tiles), one-token GEMMs forced s8n / s8d / r8 / r8d / r16
# beside cuBLAS, the 4-layer Qwen3-30B-A3B step and the Llama-8B 1-row step under each.
set -u
for f in *.xz; do [ -f "$f" ] && xz -d "$f"; done; chmod +x tqkv test_* 2>/dev/null
NAME=cA17; . ./cuda_run_common.sh
cat $LOG
t() { local s=$1 n=$2; shift 2; step $s $n "$@" >"$W/$n.log" 2>&1; echo "== $n: $(grep -hE '^\[  (PASSED|FAILED)|SKIPPED|FAILED  \]|ERROR SUMMARY' $W/$n.log | tr '\n' ' ')"; grep -h -B2 -A6 "ERROR\|rror:\|fault\|Failure\|differ" $W/$n.log | head -16; }
if [ "${1:-}" != steps ]; then
TQKV_TEST_FILTER=test_gemm t 120 gemm_bits ./test_cuda_model
t 90 moe ./test_cuda_moe
TILES="s8n r8 r16 r8d s8d"
SH=2048x4096,5120x2048,1536x2048,2048x768,4096x4096,6144x4096,4096x14336,28672x4096
for r in ${ROUNDS:-1 2}; do for tile in $TILES; do
  TQKV_GEMM_TILE=$tile step 30 gt_${tile}_$r ./tqkv bench gemm --shapes $SH --tokens 1,8 --reps 30 --json >"$W/gt_${tile}_$r.json" 2>"$W/gt_${tile}_$r.err"
  grep -E "^[0-9]+x" $W/gt_${tile}_$r.err | sed "s/^/r$r /"
done; done
step 60 ncu_o ncu --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis -k regex:gemm_kernel --launch-skip 2 --launch-count 1 \
  ./tqkv bench gemm --shapes 2048x4096 --tokens 1 --reps 3 >"$W/ncu_o_s8n.txt" 2>&1
TQKV_GEMM_TILE=r8 step 60 ncu_o_r8 ncu --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis -k regex:gemm_r_kernel --launch-skip 2 --launch-count 1 \
  ./tqkv bench gemm --shapes 2048x4096 --tokens 1 --reps 3 >"$W/ncu_o_r8.txt" 2>&1
fi
[ "${1:-}" = quick ] && { cat $LOG; exit 0; }
M=/tmp/prof_moe; step 150 make_moe python3 cuda_make_qwen3moe30b.py $M 4 >"$W/make_moe.log" 2>&1
for r in 1 2; do for tile in ${STILES:-s8n r8 r16}; do
  TQKV_GEMM_TILE=$tile step 60 moe_${tile}_$r ./tqkv bench model --device cuda --model $M --rows 1 --ctx 4096 --kv tq4 --gen 32 --reps 2 --fill synthetic --json >"$W/moe_${tile}_$r.json" 2>"$W/moe_${tile}_$r.err"
  grep "^4096" $W/moe_${tile}_$r.err | sed "s/^/$tile r$r /"
done; done
L=/tmp/llama8b; [ -f $L/model.safetensors.index.json ] || step 120 make8b python3 cuda_make_llama8b.py $L >"$W/make8b.log" 2>&1
for r in 1 2; do for tile in ${STILES:-s8n r8 r16}; do
  TQKV_GEMM_TILE=$tile step 60 l8_${tile}_$r ./tqkv bench model --device cuda --model $L --rows 1 --ctx 4096 --kv tq4 --gen 32 --reps 2 --fill synthetic --shape llama-8b --json >"$W/l8_${tile}_$r.json" 2>"$W/l8_${tile}_$r.err"
  grep "^4096" $W/l8_${tile}_$r.err | sed "s/^/$tile r$r /"
done; done
cat $LOG
