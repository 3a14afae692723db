#!/bin/bash
# cuda_prefill_device.sh - one device run of the masked prefill kernels (issue 22): the tests
# that run them (test_cuda's prefill cases on the three kernels, first alone, then the whole
# test_cuda; test_cuda_model's parity and batch invariance on the default kernel when a model
# folder is given; test_cuda_slide and test_cuda_gemma4 when packed), then the A/B of prefill
# speed on the Llama-3.1-8B-shaped random checkpoint (cuda_make_llama8b.py, made here):
# `tqkv bench model` at ctx 512 / 2048 / 8192, bf16 (--kv f32 on the device) and tq4 KV, one
# row, under TQKV_PREFILL_TC=1 (the 4-warp kernel) and 2 (the 8-warp one, the default) in the
# same binary, interleaved 1, 2, 1, 2.
# Runs in a scripts/cuda_pack.sh folder:
#   cd PACK && OUT=$OUT ./cuda_prefill_device.sh [MODEL_DIR|-] [STEPS]
# STEPS (default "tests ab"; also "sanitizer": the prefill cases under compute-sanitizer's
# memcheck, racecheck and synccheck). JSON rows in $OUT/ab_tc{1,2}_{1,2}.json; logs in
# $OUT/results.tgz.
set -u -o pipefail
M=${1:--}; STEPS=${2:-tests ab}
NAME=prefill; . "$(dirname "$0")/cuda_run_common.sh"
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
if has tests; then
  TQKV_TEST_FILTER='test_cuda_prefill*' step 180 test_cuda_prefill ./test_cuda >"$W/test_cuda_prefill.log" 2>&1
  step 300 test_cuda ./test_cuda >"$W/test_cuda.log" 2>&1
  [ "$M" != - ] && TQKV_TEST_MODEL=$M step 240 test_cuda_model ./test_cuda_model >"$W/test_cuda_model.log" 2>&1
  for t in test_cuda_slide test_cuda_gemma4; do
    [ -x "./$t" ] && step 240 "$t" "./$t" >"$W/$t.log" 2>&1
  done
fi
if has sanitizer; then # the prefill cases under memcheck, racecheck (shared memory: the tiles'
  # double buffer) and synccheck
  for tool in memcheck racecheck synccheck; do
    step 300 "$tool" compute-sanitizer --tool $tool --error-exitcode 9 env TQKV_TEST_SEED=1 \
      TQKV_TEST_FILTER='test_cuda_prefill*' ./test_cuda >"$W/sanitizer_$tool.log" 2>&1
  done
fi
if has ab; then
  B=/tmp/pf_l8
  [ -f $B/config.json ] || step 200 make_llama8b python3 cuda_make_llama8b.py $B >"$W/make_llama8b.log" 2>&1
  for r in 1 2; do
    for k in 1 2; do
      TQKV_PREFILL_TC=$k step 240 "ab_tc${k}_$r" ./tqkv bench model --device cuda --model $B \
        --ctx 512,2048,8192 --kv f32,tq4 --rows 1 --gen 2 --reps 2 --json >"$W/ab_tc${k}_$r.json" 2>"$W/ab_tc${k}_$r.err"
      cp "$W/ab_tc${k}_$r.json" "$OUT/" 2>/dev/null
    done
  done
fi
