#!/bin/bash
# session 17, command 3: s8t / s8t2 (copy-engine decode tiles): bits (test_gemm), one-token
# GEMMs beside s8n, the Llama-8B and Qwen3-30B-A3B 1-row steps. -> $OUT/all3.tgz + log
set -u
for f in *.xz; do [ -f "$f" ] && xz -d "$f"; done; chmod +x tqkv test_* 2>/dev/null
NAME=cC17; . ./cuda_run_common.sh
cat $LOG
step 30 make1 python3 cuda_make_llama8b.py /tmp/l1 1 >"$W/make1.log" 2>&1
TQKV_TEST_MODEL=/tmp/l1 TQKV_TEST_FILTER=test_gemm step 90 gemm_bits ./test_cuda_model >"$W/gemm_bits.log" 2>&1
grep -hE "PASSED|FAILED|differ|error|tiles" $W/gemm_bits.log | head -12
SH=2048x4096,5120x2048,4096x4096,6144x4096,4096x14336,28672x4096,151936x2048
for tile in s8n s8t s8t2 s8n s8t; do
  TQKV_GEMM_TILE=$tile step 30 gt_$tile ./tqkv bench gemm --shapes $SH --tokens 1,8 --reps 30 --json >>"$W/gt.json" 2>>"$W/gt.err"
  grep -E "^[0-9]+x" $W/gt.err | tail -14 | sed "s/^/$tile /"
done
L=/tmp/llama8b; [ -f $L/model.safetensors.index.json ] || step 60 make8b python3 cuda_make_llama8b.py $L >"$W/make8b.log" 2>&1
for r in 1 2; do for tile in s8n s8t; do
  TQKV_GEMM_TILE=$tile step 40 l8_${tile}_$r ./tqkv bench model --device cuda --model $L --rows 1 --ctx 4096 --kv tq4 --gen 32 --reps 2 --fill synthetic --shape llama-8b --json >"$W/l8_${tile}_$r.json" 2>"$W/l8_${tile}_$r.err"
  grep "^4096" $W/l8_${tile}_$r.err | sed "s/^/l8 $tile r$r /"
done; done
M=/tmp/prof_moe; step 60 make_moe python3 cuda_make_qwen3moe30b.py $M 4 >"$W/make_moe.log" 2>&1
for r in 1 2; do for tile in s8n s8t; do
  TQKV_GEMM_TILE=$tile step 30 moe_${tile}_$r ./tqkv bench model --device cuda --model $M --rows 1 --ctx 4096 --kv tq4 --gen 32 --reps 2 --fill synthetic --json >"$W/moe_${tile}_$r.json" 2>"$W/moe_${tile}_$r.err"
  grep "^4096" $W/moe_${tile}_$r.err | sed "s/^/moe $tile r$r /"
done; done
cat $LOG
