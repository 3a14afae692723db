#!/bin/bash
# cuda_decode_ab_device.sh - one device call measuring a decode-step change against the build
# before it (written in session 20 for branch s20-decode: the merge writing the o GEMM's split,
# the router's weights loaded before its grid wait, the 8-stage grouped s8n, default since
# session 21, whose A/B TQKV_GROUPED_ST8=0 is the "st16" variant): the device suites, then
# one-row / 8-row decode of the full Llama-8B shape and the 4-layer Qwen3-30B-A3B shape (depth
# 4096, tq4, synthetic fill) for new / old / st16 in two interleaved rounds, and kernel traces
# of the MoE step per variant (cupti_trace.so). Session 21 ran it (with a TQKV_SPLIT_MIN=128
# variant since removed): bench/RESULTS.md "Session 21".
# Ordered by priority: each step packs its results (cuda_run_common.sh), so a call cut short
# returns what it did. Runs in a scripts/cuda_pack.sh folder that also holds tqkv_old.xz (the
# build to compare against), draft.tar.xz (../shared/models/qwen3-code-draft-4m, tar cJf) and
# the xz'd binaries tqkv, test_cuda, test_cuda_model, test_cuda_moe:
#   cd PACK && OUT=$OUT bash ./cuda_decode_ab_device.sh
set -u
for f in tqkv tqkv_old test_cuda test_cuda_model test_cuda_moe; do xz -d $f.xz; chmod +x $f; done
mkdir -p /tmp/m && xz -dc draft.tar.xz | tar xf - -C /tmp/m
NAME=decode_ab; . ./cuda_run_common.sh
export TQKV_TEST_MODEL=/tmp/m/qwen3-code-draft-4m
sum() { echo "$1: $(grep -hE '^\[  (PASSED|FAILED)' $2 | tr '\n' ' ')"; }
for t in test_cuda_model test_cuda_moe; do step 60 $t ./$t >"$W/$t.log" 2>&1; sum $t $W/$t.log; done
step 60 tc_xf env TQKV_TEST_FILTER='test_cuda_attend_xf' ./test_cuda >"$W/tc_xf.log" 2>&1; sum tc_xf $W/tc_xf.log
Q=/tmp/q4; step 60 make_moe python3 cuda_make_qwen3moe30b.py $Q 4 >"$W/make_moe.log" 2>&1
L=/tmp/llama8b; step 90 make8b python3 cuda_make_llama8b.py $L >"$W/make8b.log" 2>&1
B="bench model --device cuda --ctx 4096 --kv tq4 --fill synthetic --json"
envof() { case $1 in st16) echo TQKV_GROUPED_ST8=0;; *) echo TQKV_X=0;; esac; }
bench_round() {
  for m in moe l8; do for v in new old st16; do
    d=$L; [ $m = moe ] && d=$Q; b=./tqkv; [ $v = old ] && b=./tqkv_old
    [ $v = st16 ] && [ $m = l8 ] && continue
    step 60 ${m}_${v}_$1 env $(envof $v) $b $B --model $d --rows 1,8 --gen 32 --reps 2 >"$W/${m}_${v}_$1.json" 2>"$W/${m}_${v}_$1.err"
    grep "^4096" "$W/${m}_${v}_$1.err" | sed "s/^/$m $v r$1 /"
  done; done
}
bench_round 1
step 60 tc_pdl env TQKV_TEST_FILTER=test_cuda_decode_pdl ./test_cuda >"$W/tc_pdl.log" 2>&1
sum "test_cuda decode_pdl" $W/tc_pdl.log
bench_round 2
for v in new old st16; do
  b=./tqkv; [ $v = old ] && b=./tqkv_old
  step 30 tr_moe_$v env $(envof $v) CUPTI_TRACE_OUT=$W/tr_moe_$v.csv LD_PRELOAD=$PWD/cupti_trace.so \
    $b $B --model $Q --rows 1 --gen 16 --reps 1 >"$W/tr_moe_$v.json" 2>"$W/tr_moe_$v.err"
  python3 cupti_step_table.py $W/tr_moe_$v.csv >$W/tr_moe_$v.txt 2>&1
  python3 cupti_step_table.py $W/tr_moe_$v.csv --json >$W/tr_moe_${v}_table.json 2>/dev/null
  rm -f $W/tr_moe_$v.csv; head -1 $W/tr_moe_$v.txt | sed "s/^/moe $v: /"
done
cat "$LOG"
