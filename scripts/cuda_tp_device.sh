#!/bin/bash
# cuda_tp_device.sh - one device run of tensor parallelism on the GPU (issue 25; docs/TP.md):
# test_cuda_tp (the collectives' self checks, N = 1 through NCCL, N = 2 / 4 on one GPU against
# the unsharded device state and the CPU sharded forward, batch invariance, refusals; again on
# the draft fixture when DRAFT_DIR is given), test_cuda_model (TP off unchanged), greedy
# 64-token runs with --tensor-parallel 1 / 2 / 4 (and a 1-rank sharded state through NCCL,
# TQKV_TP_ONE_RANK=1), ppl and bench model with TP 1 vs 2, compute-sanitizer memcheck of one
# sharded case. Logs go to a work folder packed into $OUT/results.tgz after every step.
# The other graphs' sharded device forward (Qwen 3.5, Gemma 4, the MoE graphs) are
# test_cuda_tp's test_{q35,g4,q3m,q35m,g4m}_* cases: the MoE checkpoints are written by the
# test; Qwen 3.5's and Gemma 4's are the ../shared fixtures, unpacked from qwen35.tar.xz /
# gemma4.tar.xz when the pack holds them (made on the build host: tar cJf PACK/qwen35.tar.xz
# -C ../shared/models qwen35-code-hybrid-30m; tar cJf PACK/gemma4.tar.xz -C ../shared/models
# gemma4-code-30m; else those cases print SKIPPED), then greedy runs of each fixture at
# --tensor-parallel 1 and 2.
# Runs in a scripts/cuda_pack.sh folder:
#   cd PACK && ./cuda_tp_device.sh MODEL_DIR TEXT_FILE [DRAFT_DIR]
set -u -o pipefail
M=${1:?model dir}; TXT=${2:?text file}; DRAFT=${3:-}
for f in qwen35 gemma4; do
  if [ -f $f.tar.xz ]; then mkdir -p shared/models && tar xJf $f.tar.xz -C shared/models; fi
done
export TQKV_SHARED=$PWD/shared
NAME=tp; . "$(dirname "$0")/cuda_run_common.sh"
TQKV_TEST_MODEL=$M step 480 test_cuda_tp ./test_cuda_tp >"$W/test_cuda_tp.log" 2>&1
for g in qwen35-code-hybrid-30m gemma4-code-30m; do
  [ -d shared/models/$g ] || continue
  for tp in 1 2; do
    step 60 "run_${g}_tp$tp" ./tqkv run --device cuda --model shared/models/$g --prompt "def fibonacci(n):" \
      -n 64 --temp 0 --ignore-eos --kv tq4 --threads 16 --tensor-parallel $tp --json \
      >"$W/run_${g}_tp$tp.txt" 2>"$W/run_${g}_tp$tp.err"
  done
done
if [ -n "$DRAFT" ]; then
  TQKV_TEST_MODEL=$DRAFT step 180 test_cuda_tp_draft ./test_cuda_tp >"$W/test_cuda_tp_draft.log" 2>&1
fi
TQKV_TEST_MODEL=$M step 150 test_cuda_model ./test_cuda_model >"$W/test_cuda_model.log" 2>&1
for tp in 1 2 4; do
  step 60 "run_tp$tp" ./tqkv run --device cuda --model "$M" --prompt "def fibonacci(n):" -n 64 --temp 0 \
    --ignore-eos --kv tq4 --threads 16 --tensor-parallel $tp --json >"$W/run_tp$tp.txt" 2>"$W/run_tp$tp.err"
done
TQKV_TP_ONE_RANK=1 step 60 run_tp1_nccl ./tqkv run --device cuda --model "$M" --prompt "def fibonacci(n):" \
  -n 64 --temp 0 --ignore-eos --kv tq4 --threads 16 --tensor-parallel 1 --json >"$W/run_tp1_nccl.txt" \
  2>"$W/run_tp1_nccl.err"
for tp in 1 2; do
  step 90 "ppl_tp$tp" ./tqkv ppl --device cuda --model "$M" --text "$TXT" --ctx 2048 --max-windows 4 --kv tq4 \
    --threads 16 --tensor-parallel $tp --json >"$W/ppl_tp$tp.txt" 2>"$W/ppl_tp$tp.err"
  step 120 "bench_tp$tp" ./tqkv bench model --device cuda --model "$M" --ctx 512,4096 --kv tq4 --rows 1,8 \
    --gen 32 --reps 2 --tensor-parallel $tp --json >"$W/bench_tp$tp.json" 2>"$W/bench_tp$tp.err"
done
step 150 memcheck compute-sanitizer --tool memcheck --error-exitcode 9 env TQKV_TEST_MODEL="$M" \
  TQKV_TEST_SEED=1 TQKV_TEST_FILTER='test_parity_n2_tq4' ./test_cuda_tp >"$W/sanitizer_memcheck_tp.log" 2>&1
step 150 memcheck_g4m compute-sanitizer --tool memcheck --error-exitcode 9 env TQKV_TEST_MODEL="$M" TQKV_TEST_SEED=1 \
  TQKV_TEST_FILTER='test_g4m_n2_tq4' ./test_cuda_tp >"$W/sanitizer_memcheck_tp_g4m.log" 2>&1
step 150 memcheck_q35m compute-sanitizer --tool memcheck --error-exitcode 9 env TQKV_TEST_MODEL="$M" TQKV_TEST_SEED=1 \
  TQKV_TEST_FILTER='test_q35m_n2_tq4' ./test_cuda_tp >"$W/sanitizer_memcheck_tp_q35m.log" 2>&1
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >>"$LOG" 2>&1
cp "$LOG" "$OUT/tp.log"
