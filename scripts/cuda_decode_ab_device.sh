#!/bin/bash
# cuda_decode_ab_device.sh - one device call measuring a decode-step change against the build
# before it: the device suites, then one-row / 8-row decode of the full Llama-8B shape and the
# 4-layer Qwen3-30B-A3B shape (depth 4096, tq4, synthetic fill) per variant in two interleaved
# rounds, and kernel traces of the one-row MoE step per variant (cupti_trace.so).
# VARIANTS (default "new old"): names, each optionally with environment settings after a
# colon (comma-separated); a name starting with "old" runs tqkv_old, the others tqkv. MODELS
# (default "moe l8") picks the shapes; SUITES (default test_cuda_moe test_cuda_model test_cuda) the
# suites run whole, TC_FILTERS test_cuda name patterns run one group each. Session 21 ran VARIANTS="new old st16:TQKV_GROUPED_ST8=0"
# (bench/RESULTS.md "Session 21"); session 22 "new old nofold:TQKV_MOE_FOLD_NORM=0"; session 23
# "new noact:TQKV_MOE_FOLD_ACT=0 nomw:TQKV_MERGE_WIDE=0 noenc:TQKV_QKV_ENCODE=0" with MODELS=moe.
# Ordered by priority: each step packs its results (cuda_run_common.sh), so a call cut short
# returns what it did. Runs in a scripts/cuda_pack.sh folder that also holds tqkv_old.xz (the
# build to compare against), draft.tar.xz (../shared/models/qwen3-code-draft-4m, tar cJf) and
# the xz'd binaries tqkv, test_cuda, test_cuda_model, test_cuda_moe:
#   cd PACK && OUT=$OUT VARIANTS="new old" bash ./cuda_decode_ab_device.sh
set -u
VARIANTS=${VARIANTS:-new old}; MODELS=${MODELS:-moe l8}
for f in tqkv tqkv_old test_cuda test_cuda_model test_cuda_moe; do
  [ -f $f.xz ] && { xz -d $f.xz; chmod +x $f; }; done
mkdir -p /tmp/m && xz -dc draft.tar.xz | tar xf - -C /tmp/m
NAME=decode_ab; . ./cuda_run_common.sh
export TQKV_TEST_MODEL=/tmp/m/qwen3-code-draft-4m
sum() { echo "$1: $(grep -hE '^\[  (PASSED|FAILED)' $2 | tr '\n' ' ')"; }
for t in ${SUITES:-test_cuda_moe test_cuda_model test_cuda}; do
  [ -x ./$t ] && { step 120 $t ./$t >"$W/$t.log" 2>&1; sum $t $W/$t.log; }; done
set -f  # (the patterns are for cmocka, not the shell)
for f in ${TC_FILTERS:-}; do   # test_cuda groups alone (e.g. 'test_cuda_decode_*': the whole suite runs > 120 s)
  n=${f//\*/}; step 120 tc_$n env TQKV_TEST_FILTER="$f" ./test_cuda >"$W/tc_$n.log" 2>&1; sum "test_cuda $f" "$W/tc_$n.log"; done
set +f
Q=/tmp/q4; step 60 make_moe python3 cuda_make_qwen3moe30b.py $Q 4 >"$W/make_moe.log" 2>&1
L=/tmp/llama8b
case " $MODELS " in *" l8 "*) step 90 make8b python3 cuda_make_llama8b.py $L >"$W/make8b.log" 2>&1;; esac
B="bench model --device cuda --ctx 4096 --kv tq4 --fill synthetic --json"
vname() { echo "${1%%:*}"; }
venv() { case $1 in *:*) echo "${1#*:}" | tr ',' ' ';; *) echo TQKV_X=0;; esac; }
vbin() { case $1 in old*) echo ./tqkv_old;; *) echo ./tqkv;; esac; }
bench_round() {
  for m in $MODELS; do for v in $VARIANTS; do
    n=$(vname $v); d=$L; [ $m = moe ] && d=$Q
    step 60 ${m}_${n}_$1 env $(venv $v) $(vbin $v) $B --model $d --rows 1,8 --gen 32 --reps 2 \
      >"$W/${m}_${n}_$1.json" 2>"$W/${m}_${n}_$1.err"
    grep "^4096" "$W/${m}_${n}_$1.err" | sed "s/^/$m $n r$1 /"
  done; done
}
bench_round 1
bench_round 2
for v in $VARIANTS; do
  n=$(vname $v)
  step 30 tr_moe_$n env $(venv $v) CUPTI_TRACE_OUT=$W/tr_moe_$n.csv LD_PRELOAD=$PWD/cupti_trace.so \
    $(vbin $v) $B --model $Q --rows 1 --gen 16 --reps 1 >"$W/tr_moe_$n.json" 2>"$W/tr_moe_$n.err"
  python3 cupti_step_table.py $W/tr_moe_$n.csv >$W/tr_moe_$n.txt 2>&1
  python3 cupti_step_table.py $W/tr_moe_$n.csv --json >$W/tr_moe_${n}_table.json 2>/dev/null
  rm -f $W/tr_moe_$n.csv; head -1 $W/tr_moe_$n.txt | sed "s/^/moe $n: /"
done
tar czf "$OUT/results.tgz" -C "$W" . # (the last trace's tables came after its step packed)
cat "$LOG"
