#!/bin/bash
# cuda_model_device.sh - one device run of the model forward on the GPU (--device cuda):
# test_cuda_model (GPU vs CPU logits, batch invariance), tqkv ppl on the GPU (f32 / tq4 / tq3,
# ctx 2048, 4 windows; the CPU figures are run on the build host on the same text), greedy
# 64-token continuations GPU vs CPU, bench model decode speed (rows 1 / 8 / 32),
# compute-sanitizer memcheck of test_cuda_model. CPU_PPL=1 also runs tqkv ppl on the CPU here
# (a model the build host cannot hold, or too slow there); ./test_cuda_hybrid runs first
# when packed (it finds its fixture through TQKV_SHARED). The 8B-shaped end to end run is
# cuda_e2e_device.sh. Logs go to a work folder
# packed into $OUT/results.tgz after every step (at most 8 files come back).
# Runs in a scripts/cuda_pack.sh folder:   cd PACK && ./cuda_model_device.sh MODEL_DIR TEXT_FILE
set -u -o pipefail
M=${1:?model dir}; TXT=${2:?text file}
NAME=model; . "$(dirname "$0")/cuda_run_common.sh"
[ -x ./test_cuda_hybrid ] && step 180 test_cuda_hybrid ./test_cuda_hybrid >"$W/test_cuda_hybrid.log" 2>&1
TQKV_TEST_MODEL=$M step 150 test_cuda_model ./test_cuda_model >"$W/test_cuda_model.log" 2>&1
DEVS=cuda; [ "${CPU_PPL:-0}" = 1 ] && DEVS="cuda cpu"
for kv in f32 tq4 tq3; do for dev in $DEVS; do
  step 60 "ppl_${dev}_$kv" ./tqkv ppl --device $dev --model "$M" --text "$TXT" --ctx 2048 --max-windows 4 \
    --kv "$kv" --threads 16 --json >"$W/ppl_${dev}_$kv.txt" 2>"$W/ppl_${dev}_$kv.err"
done; done
for kv in f32 tq4 tq3; do for dev in cuda cpu; do
  step 60 "run_${dev}_$kv" ./tqkv run --device $dev --model "$M" --prompt "def fibonacci(n):" -n 64 --temp 0 \
    --ignore-eos --kv $kv --threads 16 --json >"$W/run_${dev}_$kv.txt" 2>"$W/run_${dev}_$kv.err"
done; done
for rows in 1 8 32; do
  step 90 "bench_rows$rows" ./tqkv bench model --device cuda --model "$M" --ctx 512,4096 --kv f32,tq4,tq3 \
    --rows $rows --gen 32 --reps 2 --json >"$W/bench_rows$rows.json" 2>"$W/bench_rows$rows.err"
done
step 90 memcheck compute-sanitizer --tool memcheck --error-exitcode 9 env TQKV_TEST_MODEL="$M" TQKV_TEST_SEED=1 \
  ./test_cuda_model >"$W/sanitizer_memcheck_model.log" 2>&1
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >>"$LOG" 2>&1
cp "$LOG" "$OUT/model.log"
