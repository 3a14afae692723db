#!/bin/bash
# cuda_session_device.sh - one device call that checks and measures a new build against an old
# one (issues 22 and 24): everything goes into the work folder W and comes back as ONE file,
# $OUT/results.tgz, plus $OUT/sess.log (the device tool returns at most 8 files a call; session
# 11 lost its serving figures to that limit). Runs in a scripts/cuda_pack.sh folder holding the
# new build; OLD_DIR holds the old build's tqkv (its libraries: this folder's lib/).
#   cd PACK && OUT=$OUT ./cuda_session_device.sh OLD_DIR DRAFT_DIR [STEPS]
# STEPS (default "tests attn step prefill e2e serve"):
#  - tests: test_cuda, test_cuda_model (DRAFT_DIR: the qwen3-code-draft-4m fixture), test_cuda_moe;
#  - attn: decode attention, old and new, beside cuDNN bf16 (cuda_anchor.py), batch 8 / 32,
#    ctx 32k / 64k / 128k, tq4, tq3, fp8, tq4 + q8 window;
#  - step: one-row and 8-row decode of 4-layer checkpoints of the Llama-8B and Qwen3-30B-A3B
#    shapes (every matrix full size), old, new, old, new;
#  - prefill: one row of 2048 / 8192 tokens on the 4-layer Llama-8B, old, new, old, new;
#  - e2e: the full Llama-8B shape, new build: decode at one and 8 rows (depth 4096, synthetic
#    fill), prefill 8 x 512 and 1 x 8192;
#  - serve: the serving benchmark (bench/cuda-serve/run.sh, copied into the pack) with the new
#    build, bf16 KV and tq4, one server at a time, bursts of 1024/512 and 8192/512 (SETS, BUDGET,
#    KVS and SERVE_ARGS as run.sh takes them; defaults below; TOKSRC: the folder whose tokenizer
#    the random checkpoint gets, default ../../models/qwen3-code-28m, the bundled model from
#    build-dev/pN). A 300 x 1024 and a 100 x 8192 set take about 60 + 75-130 s a format on an
#    H100 with 2048-token chunks (session 12): give SERVE_S room, or split formats over calls.
# Each part is a `step` with a time limit; W is packed after every step, so a call cut short
# still returns what it did.
set -u -o pipefail
OLD=${1:?old build folder}; DRAFT=${2:?draft model folder}
STEPS=${3:-tests attn step prefill e2e serve}
NAME=sess; . "$(dirname "$0")/cuda_run_common.sh"
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
head -2 "$LOG" | tail -1
# the tests find ../shared fixtures through TQKV_SHARED: the folder holding DRAFT_DIR's models/
export TQKV_SHARED=${TQKV_SHARED:-$(cd "$(dirname "$DRAFT")/.." && pwd)}
if has tests; then
  step 200 test_cuda ./test_cuda >"$W/test_cuda.log" 2>&1
  TQKV_TEST_MODEL=$DRAFT step 150 test_cuda_model ./test_cuda_model >"$W/test_cuda_model.log" 2>&1
  # the split pick's refused-cluster fallback beside the split path (d425bef), and without the split
  TQKV_TEST_MODEL=$DRAFT TQKV_PICK_SPLIT=0 TQKV_TEST_FILTER='test_pick*' step 30 pick_nosplit \
    ./test_cuda_model >"$W/test_pick_nosplit.log" 2>&1
  step 120 test_cuda_moe ./test_cuda_moe >"$W/test_cuda_moe.log" 2>&1
  grep -hE "^\[  (PASSED|FAILED)|^\[  SKIPPED" "$W"/test_cuda*.log
fi
if has attn; then
  B=8,32; C=32768,65536,131072
  step 60 anchor python3 cuda_anchor.py --batches $B --ctxs $C --out "$W/anchor.json" >"$W/anchor.txt" 2>&1
  for b in new old; do
    T=./tqkv; [ $b = old ] && T=$OLD/tqkv
    step 90 attn_$b $T bench attention --device cuda --batches $B --ctxs $C --formats tq4,tq3,fp8,tq4w \
      --reps 20 --anchor "$W/anchor.json" --out "$W/attn_$b.json" >"$W/attn_$b.txt" 2>&1
  done
fi
if has step || has prefill; then
  step 60 mk4 bash -c "python3 cuda_make_llama8b.py /tmp/l4 4 && python3 cuda_make_qwen3moe30b.py /tmp/m4 4" \
    >"$W/mk4.log" 2>&1
  for r in 1 2; do for b in old new; do
    T=./tqkv; [ $b = old ] && T=$OLD/tqkv
    if has step; then for m in l4 m4; do
      step 60 tg_${m}_${b}_$r $T bench model --device cuda --model /tmp/$m --ctx 4096 --kv tq4 --rows 1,8 \
        --gen 32 --reps 2 --fill synthetic --json >"$W/tg_${m}_${b}_$r.json" 2>"$W/tg_${m}_${b}_$r.err"
    done; fi
    has prefill && step 60 pp_l4_${b}_$r $T bench model --device cuda --model /tmp/l4 --ctx 2048,8192 \
      --kv f32,tq4 --rows 1 --gen 2 --reps 1 --json >"$W/pp_l4_${b}_$r.json" 2>"$W/pp_l4_${b}_$r.err"
  done; done
fi
L=/tmp/llama8b
if has e2e || has serve; then
  [ -f $L/model.safetensors.index.json ] || step 90 make python3 cuda_make_llama8b.py $L >"$W/make.log" 2>&1
fi
if has e2e; then
  step 60 tg8b ./tqkv bench model --device cuda --model $L --ctx 4096 --kv tq4,f32 --rows 1,8 --gen 32 \
    --reps 2 --fill synthetic --shape llama-8b --json >"$W/tg8b.json" 2>"$W/tg8b.err"
  step 60 pp8b ./tqkv bench model --device cuda --model $L --ctx 512,8192 --kv f32,tq4 --rows 1 --gen 2 \
    --reps 1 --shape llama-8b --json >"$W/pp8b.json" 2>"$W/pp8b.err"
fi
if has serve; then
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  BUD=${BUDGET:-48G}; [ -z "${BUDGET:-}" ] && [ "$mem" -gt 100000 ] && BUD=100G
  step ${SERVE_S:-400} serve env OUT="$W/serve" SERVE_ARGS="${SERVE_ARGS:-}" SEQ=1 KVS="${KVS:-f32 tq4}" PAR=${PAR:-300} BUDGET=$BUD \
    SETS="${SETS:-inf:1024:512:300 inf:8192:512:100}" bash run.sh "${TOKSRC:-../../models/qwen3-code-28m}"
fi
cat "$LOG"
