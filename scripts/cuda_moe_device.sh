#!/bin/bash
# cuda_moe_device.sh - the mixture-of-experts device run of issue 24, in a scripts/cuda_pack.sh
# folder (no fixtures needed):
#  - tests: test_cuda_moe (Qwen3-MoE, Qwen 3.5 MoE and Gemma 4 MoE on the GPU against their CPU
#    forwards, batch invariance, spec rounds, row operations, the grouped experts GEMM; it
#    writes its own tiny checkpoints);
#  - make: a Qwen3-30B-A3B-shaped checkpoint (cuda_make_qwen3moe30b.py: 48 layers, hidden
#    2048, 128 experts top 8 of width 768, 32 q / 4 KV heads, head_dim 128, vocab 151936,
#    61 GB of bf16) in /tmp/qwen3moe30b. Its experts are ZEROS left as holes of sparse files,
#    so it takes ~3 GB of the device's 64 GB of disk; zero experts do not change the GEMMs'
#    time (the same bytes move, the same tensor-core multiply-adds run), the random router
#    spreads the tokens over the experts. The load maps the shards and uploads one stacked
#    matrix at a time (the largest staging buffer: one layer's gate|up, 0.8 GB), so the host
#    needs the page cache of the file and not twice the model;
#  - rows: `tqkv bench model --device cuda --fill synthetic` (one 61 GB load) over rows
#    1 / 8 / 32 / 64, depth 4096 and 32768, KV f32 (the device's dense bf16 cache: "bf16 KV")
#    and tq4, 16 greedy steps after the synthetic fill;
#  - maxrows: at depth 32768, --max-rows (the most rows whose caches for 32768 + 17 tokens
#    fit, real allocations) and --at-max-rows (decode at those rows), per KV format.
#    Every JSON row carries "shape": "qwen3-30b-a3b" (issue 24 item 5; the rows go to
#    bench/cuda-e2e.json as they are: max_rows is in the maxrows rows).
# Logs go to a work folder packed into $OUT/results.tgz after every step.
# The experts' GEMMs run as one grouped launch per projection (tqkv_cuda_gemm_grouped); when
# test_cuda_moe's test_gemm_grouped / test_grouped (grouped == per-expert, bitwise) do not
# pass, the script sets TQKV_MOE_GROUPED=0 (one GEMM per expert) for the rest and says so in
# moe.log (a later call without "tests" needs TQKV_MOE_GROUPED=0 set by hand then). STEPS
# "pergemm" measures the per-expert path at depth 4096, rows 1 / 8 / 64, for an A/B.
#   Usage: cd PACK && OUT=$OUT ./cuda_moe_device.sh [STEPS]   (default "tests make rows maxrows")
# The checkpoint stays in /tmp/qwen3moe30b while the machine is warm, so the steps can be
# spread over calls of at most 10 minutes; on an H100 (session 7) all four steps took 2.5 min
# in one call: tests 2 s, make 7 s, rows 58 s (about 50 s of it the load), maxrows 49 s.
# The load goes through the page cache at about 1 GB/s; Nsight Compute intercepting it ran
# past 7 minutes, so profile a smaller shape.
set -u -o pipefail
STEPS=${1:-tests make rows maxrows}
NAME=moe; . "$(dirname "$0")/cuda_run_common.sh"
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
B=/tmp/qwen3moe30b
if has tests; then
  step 240 test_cuda_moe ./test_cuda_moe >"$W/test_cuda_moe.log" 2>&1
  # the experts' grouped GEMM launch must give the per-expert GEMMs' bits (test_gemm_grouped
  # and test_grouped run first): if either did not pass, the rest runs the per-expert path
  # and the tests run again on it
  if ! grep -q "OK \] test_gemm_grouped" "$W/test_cuda_moe.log" ||
     ! grep -q "OK \] test_grouped" "$W/test_cuda_moe.log"; then
    echo "test_gemm_grouped / test_grouped did not pass: TQKV_MOE_GROUPED=0 from here on" >>"$LOG"
    export TQKV_MOE_GROUPED=0
    step 240 test_cuda_moe_pergemm ./test_cuda_moe >"$W/test_cuda_moe_pergemm.log" 2>&1
  fi
fi
if has make; then
  rm -rf "$B"
  step 300 make_qwen3moe30b python3 cuda_make_qwen3moe30b.py "$B" >"$W/make_qwen3moe30b.log" 2>&1
  { df -h /tmp; du -sh "$B"; free -g; } >>"$W/make_qwen3moe30b.log" 2>&1
fi
# host memory (page cache vs anonymous) and device memory every 5 s beside a bench step
mem_watch() { while sleep 5; do echo "$(date -u +%T) $(free -m | awk '/Mem:/ {print "used " $3 " MB, cache " $6 " MB"}') gpu $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"; done; }
if has rows; then # decode at rows 1 / 8 / 32 / 64, depth 4k and 32k, bf16 (f32) and tq4 KV
  mem_watch >"$W/mem_rows.log" 2>&1 & mp=$!
  step 420 bench_rows ./tqkv bench model --device cuda --model "$B" --ctx 4096,32768 \
    --kv f32,tq4 --rows 1,8,32,64 --gen 16 --reps 1 --fill synthetic --shape qwen3-30b-a3b \
    --json >"$W/bench_rows.json" 2>"$W/bench_rows.err"
  kill $mp; wait $mp 2>/dev/null
fi
if has maxrows; then # the most 32k-token rows that fit, and decode at that many
  mem_watch >"$W/mem_maxrows.log" 2>&1 & mp=$!
  step 360 bench_maxrows ./tqkv bench model --device cuda --model "$B" --ctx 32768 \
    --kv f32,tq4 --rows 1 --gen 16 --reps 1 --fill synthetic --max-rows --at-max-rows \
    --shape qwen3-30b-a3b --json >"$W/bench_maxrows.json" 2>"$W/bench_maxrows.err"
  kill $mp; wait $mp 2>/dev/null
fi
if has pergemm; then # A/B: the same decode points with one GEMM per expert (TQKV_MOE_GROUPED=0)
  TQKV_MOE_GROUPED=0 step 300 bench_pergemm ./tqkv bench model --device cuda --model "$B" \
    --ctx 4096 --kv f32,tq4 --rows 1,8,64 --gen 16 --reps 1 --fill synthetic \
    --shape qwen3-30b-a3b --json >"$W/bench_pergemm.json" 2>"$W/bench_pergemm.err"
fi
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >>"$LOG" 2>&1
tar czf "$OUT/results.tgz" -C "$W" . ; cp "$LOG" "$OUT/moe.log"
