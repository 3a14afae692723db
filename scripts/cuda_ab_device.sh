#!/bin/bash
# cuda_ab_device.sh - decode speed of two builds of tqkv side by side, interleaved, in one
# device call (the A/B of a change to the GPU forward). Runs in a scripts/cuda_pack.sh folder
# that holds the new build (./tqkv, ./test_cuda*) and, in OLD_DIR, the old build's tqkv:
#   cd PACK && OUT=$OUT ./cuda_ab_device.sh OLD_DIR [STEPS]
# STEPS (default "tests llama8b qwen3moe"):
#  - tests: test_cuda, test_cuda_model (on the draft fixture in ./draft) and test_cuda_moe
#    of the new build (parity with the CPU, batch invariance bit for bit); "modeltests": the
#    last two only;
#  - tiles: `tqkv bench gemm --tokens 1` on Llama-3.1-8B's shapes under each decode tile
#    forced (TQKV_GEMM_TILE=s8, s8n), and in llama8b the new build's 1-row decode under s8
#    as well (the pick at T = 1 is s8n);
#  - llama8b: the Llama-3.1-8B-shaped random checkpoint (cuda_make_llama8b.py), decode at
#    depth 4096, rows 1 and 8, tq4 and bf16 KV (f32: the device's dense bf16 cache), CUDA
#    graphs on, 32 greedy steps after a synthetic fill; old, new, old, new;
#  - qwen3moe: the Qwen3-30B-A3B-shaped one (cuda_make_qwen3moe30b.py, 61 GB), rows 1 and 8,
#    tq4, depth 4096; old, new (one 61 GB load per process, about 50 s each).
# JSON rows in $OUT/ab_SHAPE_{old,new}_ROUND.json; the log in $OUT/ab.log.
set -u -o pipefail
OLD=${1:?old build folder}; STEPS=${2:-tests llama8b qwen3moe}
NAME=ab; . "$(dirname "$0")/cuda_run_common.sh"
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
if has tests || has modeltests; then
  has tests && step 120 test_cuda ./test_cuda >"$W/test_cuda.log" 2>&1
  TQKV_TEST_MODEL=draft step 180 test_cuda_model ./test_cuda_model >"$W/test_cuda_model.log" 2>&1
  step 240 test_cuda_moe ./test_cuda_moe >"$W/test_cuda_moe.log" 2>&1
fi
bench() { # NAME BIN MODEL ARGS...
  local n=$1 b=$2 m=$3; shift 3
  step 300 "$n" "$b" bench model --device cuda --model "$m" --ctx 4096 --gen 32 --reps 2 \
    --fill synthetic --json "$@" >"$W/$n.json" 2>"$W/$n.err"
  cp "$W/$n.json" "$OUT/" 2>/dev/null
}
if has tiles; then
  for t in s8 s8n; do
    TQKV_GEMM_TILE=$t step 60 "gemm_$t" ./tqkv bench gemm --tokens 1 --reps 20 --json \
      >"$W/gemm_$t.json" 2>"$W/gemm_$t.err"; cp "$W/gemm_$t.json" "$OUT/"
  done
fi
if has llama8b; then
  step 200 make_llama8b python3 cuda_make_llama8b.py /tmp/ab_l8 >"$W/make_llama8b.log" 2>&1
  for r in 1 2; do
    bench "ab_llama8b_old_$r" "$OLD/tqkv" /tmp/ab_l8 --rows 1,8 --kv tq4,f32 --shape llama-8b
    bench "ab_llama8b_new_$r" ./tqkv /tmp/ab_l8 --rows 1,8 --kv tq4,f32 --shape llama-8b
  done
  if has tiles; then
    for t in s8; do
      TQKV_GEMM_TILE=$t bench "ab_llama8b_new_$t" ./tqkv /tmp/ab_l8 --rows 1 --kv tq4 --shape llama-8b
    done
  fi
  rm -rf /tmp/ab_l8
fi
if has qwen3moe; then
  step 300 make_qwen3moe python3 cuda_make_qwen3moe30b.py /tmp/ab_moe >"$W/make_qwen3moe.log" 2>&1
  bench ab_qwen3moe_old_1 "$OLD/tqkv" /tmp/ab_moe --rows 1,8 --kv tq4 --shape qwen3-30b-a3b
  bench ab_qwen3moe_new_1 ./tqkv /tmp/ab_moe --rows 1,8 --kv tq4 --shape qwen3-30b-a3b
  rm -rf /tmp/ab_moe
fi
