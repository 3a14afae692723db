#!/bin/bash
# session 16, call B (priority order; each step packs its results): the decode GEMM tiles at
# T 32..96 forced (s64 / s64w / s32 / s32w / m / tl), the fused merge's test, attention fused /
# unfused, the model suites (every tile's bits), a second attention round, the 8B 1-row step
# (H200 only), where a 1-row Qwen3-30B-A3B step goes (ncu, real clocks).
set -u
for f in *.xz; do case $f in *.tar.xz) ;; *) xz -d "$f";; esac; done; chmod +x tqkv test_* 2>/dev/null
mkdir -p shared/models; tar xJf draft.tar.xz -C shared/models
export TQKV_SHARED=$PWD/shared; D=$PWD/shared/models/qwen3-code-draft-4m
NAME=cC16; . ./cuda_run_common.sh
cat $LOG
t() { local s=$1 n=$2; shift 2; step $s $n "$@" >"$W/$n.log" 2>&1; echo "== $n: $(grep -hE '^\[  (PASSED|FAILED)|SKIPPED|FAILED  \]|ERROR SUMMARY' $W/$n.log | tr '\n' ' ')"; grep -h -B2 -A6 "ERROR\|rror:\|fault\|Failure" $W/$n.log | head -16; }
export TQKV_TEST_MODEL=$D
for tile in s64 s64w m s32w; do
  TQKV_GEMM_TILE=$tile step 30 gt_$tile ./tqkv bench gemm --shapes 28672x4096,4096x14336,6144x4096,4096x4096 --tokens 48,64 \
    --reps 20 --json >"$W/gt_$tile.json" 2>"$W/gt_$tile.err"; grep -E "^[0-9]+x" $W/gt_$tile.err | sed "s/^/$tile /"
done
TQKV_TEST_FILTER='test_cuda_decode_fused' t 90 fused ./test_cuda
FOK=0; grep -q "^\[  PASSED  \] 1 test" $W/fused.log && FOK=1
echo "FUSED_OK=$FOK" | tee -a $LOG
B=8,32; C=1024,4096,32768,65536,131072
step 60 anchor python3 cuda_anchor.py --batches $B --ctxs $C --out "$W/anchor.json" >"$W/anchor.txt" 2>&1
attn() { local r=$1; for fu in 0 $FOK; do
  TQKV_ATTN_FUSE=$fu step 60 attn_f${fu}_$r ./tqkv bench attention --device cuda --batches $B --ctxs $C --formats tq4 \
    --reps 30 --anchor "$W/anchor.json" --out "$W/attn_f${fu}_$r.json" >"$W/attn_f${fu}_$r.txt" 2>&1
  grep -E "^tq" "$W/attn_f${fu}_$r.txt" | sed "s/^/f$fu r$r /"
done; }
attn 1
export TQKV_ATTN_FUSE=$FOK
t 60 model ./test_cuda_model
t 60 moe ./test_cuda_moe
TQKV_TEST_FILTER='test_cuda_attend*' t 60 cuda_attend ./test_cuda
TQKV_TEST_FILTER='test_cuda_rows*' t 40 cuda_rows ./test_cuda
attn 2
H200=0; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && H200=1
L=/tmp/l8b
if [ $H200 = 1 ]; then
  step 90 make8b python3 cuda_make_llama8b.py $L >"$W/make8b.log" 2>&1
  for fu in 0 $FOK; do
    TQKV_ATTN_FUSE=$fu step 60 tg_f$fu ./tqkv bench model --device cuda --model $L --ctx 4096 --kv tq4 --rows 1 --gen 32 --reps 2 --fill synthetic --shape llama-8b --json > $W/tg_f$fu.json 2>$W/tg_f$fu.err; grep "^4096" $W/tg_f$fu.err | sed "s/^/f$fu /"
  done
  rm -rf $L
fi
# last: where a 1-row Qwen3-30B-A3B step goes (4 layers of the full shape), real clocks, warm caches
M=/tmp/prof_moe; step 150 make_moe python3 cuda_make_qwen3moe30b.py $M 4 >"$W/make_moe.log" 2>&1
step 60 step_moe ./tqkv bench model --device cuda --model $M --rows 1 --ctx 4096 --kv tq4 --gen 16 --reps 2 --graphs 0,1 --fill synthetic --json >"$W/step_moe.json" 2>"$W/step_moe.err"
grep "^4096" $W/step_moe.err
step 150 ncu_moe ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --page raw \
  ./tqkv bench model --device cuda --model $M --rows 1 --ctx 4096 --kv tq4 --gen 3 --reps 1 --graphs 0 --fill synthetic >"$W/ncu_moe.csv" 2>"$W/ncu_moe.err"
cat $LOG
