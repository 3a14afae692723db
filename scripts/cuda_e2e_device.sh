#!/bin/bash
# cuda_e2e_device.sh - one device run of the GPU forward at 8B scale: test_cuda and
# test_cuda_model (kernels, GEMM, parity, invariance), `tqkv bench gemm` on Llama-3.1-8B's
# matrix shapes beside PyTorch's cuBLAS bf16 linear (cuda_gemm_anchor.py, with its
# row-0-alone invariance check), then the Llama-3.1-8B-shaped random checkpoint made here
# (cuda_make_llama8b.py, never committed) end to end with `tqkv bench model --device cuda`:
#  - decode t/s at depth 4k and 32k, rows 1 / 8 / 32, bf16 (f32 KV on the dense bf16 cache)
#    vs tq4; the caches are filled synthetically (random K/V through the GPU encoder:
#    a 32k prefill of 32 rows would take the whole device budget), then 16 greedy steps;
#  - the most rows whose caches for 32k + 16 tokens fit (real allocations), and decode at
#    those row counts;
#  - a real prefill of 8 rows x 512 tokens for the pp figure.
# STEPS also takes "fast" (the same 8B decode matrix with --fast-gemm: cuBLAS, not batch
# invariant), "sanitizer" (compute-sanitizer memcheck of test_cuda and
# test_cuda_model) and "serve" (`tqkv bench engine --device cuda` against the CPU on the
# bundled model, and a `tqkv serve --device cuda` smoke test over HTTP with curl) and
# "graphs" (decode as replayed CUDA graphs vs kernel by kernel, `bench model --graphs 0,1`,
# on the bundled model at rows 1 / 8 / 32 and on the 8B shape at rows 1 / 32).
# Logs go to a work folder packed into $OUT/results.tgz after every step.
# Runs in a scripts/cuda_pack.sh folder:   cd PACK && ./cuda_e2e_device.sh MODEL_DIR [STEPS]
# STEPS (default "tests gemm e2e") picks the parts.
set -u -o pipefail
M=${1:?model dir}; STEPS=${2:-tests gemm e2e}
NAME=e2e; . "$(dirname "$0")/cuda_run_common.sh"
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
if has tests; then
  step 120 test_cuda ./test_cuda >"$W/test_cuda.log" 2>&1
  TQKV_TEST_MODEL=$M step 120 test_cuda_model ./test_cuda_model >"$W/test_cuda_model.log" 2>&1
  [ -f heldout-150k.txt ] && for g in "" --fast-gemm; do
    step 60 "ppl_tq4$g" ./tqkv ppl --device cuda $g --model "$M" --text heldout-150k.txt --ctx 2048 \
      --max-windows 4 --kv tq4 --json >"$W/ppl_tq4$g.json" 2>"$W/ppl_tq4$g.err"
  done
fi
if has sanitizer; then
  step 200 memcheck_cuda compute-sanitizer --tool memcheck --error-exitcode 9 env TQKV_TEST_SEED=1 \
    ./test_cuda >"$W/sanitizer_memcheck_cuda.log" 2>&1
  step 300 memcheck_model compute-sanitizer --tool memcheck --error-exitcode 9 env TQKV_TEST_MODEL="$M" \
    TQKV_TEST_SEED=1 ./test_cuda_model >"$W/sanitizer_memcheck_model.log" 2>&1
fi
if has serve; then
  for dev in cuda cpu; do
    step 150 "engine_$dev" ./tqkv bench engine --device $dev --model "$M" --concurrency 1,4,16 \
      --prompt-tokens 200 --max-tokens 128 --threads 16 --text heldout-150k.txt --json \
      >"$W/engine_$dev.json" 2>"$W/engine_$dev.err"
  done
  ./tqkv serve --device cuda --model "$M" --port 0 --port-file "$W/port" >"$W/serve.log" 2>&1 &
  sp=$!; for i in $(seq 1 60); do [ -s "$W/port" ] && break; sleep 0.5; done
  port=$(cat "$W/port" 2>/dev/null)
  step 30 serve_completion curl -s -m 20 "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0}' -o "$W/serve_completion.json"
  step 30 serve_chat_stream curl -s -N -m 20 "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"messages": [{"role": "user", "content": "Write a sort in Python."}], "max_tokens": 24, "stream": true}' \
    -o "$W/serve_chat_stream.txt"
  step 10 serve_metrics curl -s -m 5 "http://127.0.0.1:$port/metrics" -o "$W/serve_metrics.txt"
  kill $sp; wait $sp 2>/dev/null
fi
if has gemm; then
  step 120 bench_gemm ./tqkv bench gemm --shapes 6144x4096,4096x4096,28672x4096,4096x14336,128256x4096 \
    --tokens 1,8,32,128,512,2048 --json >"$W/bench_gemm.json" 2>"$W/bench_gemm.err"
  step 180 gemm_anchor python3 cuda_gemm_anchor.py --out "$W/gemm_anchor.json" >"$W/gemm_anchor.log" 2>&1
fi
if has e2e; then
  B=/tmp/llama8b
  step 150 make_llama8b python3 cuda_make_llama8b.py $B >"$W/make_llama8b.log" 2>&1
  for rows in 1 8 32; do
    step 150 "e2e_rows$rows" ./tqkv bench model --device cuda --model $B --ctx 4096,32768 --kv f32,tq4 \
      --rows $rows --gen 16 --reps 1 --fill synthetic --json >"$W/e2e_rows$rows.json" 2>"$W/e2e_rows$rows.err"
  done
  step 150 e2e_maxrows ./tqkv bench model --device cuda --model $B --ctx 32768 --kv f32,tq4 --rows 1 \
    --gen 16 --reps 1 --fill synthetic --max-rows --json >"$W/e2e_maxrows.json" 2>"$W/e2e_maxrows.err"
  # decode at the row counts that fit (from the search above; bf16 and tq4 separately)
  fb=$(python3 -c "import json;print([o['max_rows'] for o in json.load(open('$W/e2e_maxrows.json')) if o['kv']=='f32'][0])" 2>/dev/null || echo 0)
  ft=$(python3 -c "import json;print([o['max_rows'] for o in json.load(open('$W/e2e_maxrows.json')) if o['kv']=='tq4'][0])" 2>/dev/null || echo 0)
  [ "$fb" -gt 0 ] && step 150 e2e_bf16_max ./tqkv bench model --device cuda --model $B --ctx 32768 --kv f32 \
    --rows "$fb" --gen 16 --reps 1 --fill synthetic --json >"$W/e2e_bf16_max.json" 2>"$W/e2e_bf16_max.err"
  [ "$ft" -gt 0 ] && step 200 e2e_tq4_max ./tqkv bench model --device cuda --model $B --ctx 32768 --kv tq4 \
    --rows "$ft" --gen 16 --reps 1 --fill synthetic --json >"$W/e2e_tq4_max.json" 2>"$W/e2e_tq4_max.err"
  step 120 e2e_prefill ./tqkv bench model --device cuda --model $B --ctx 512 --kv f32,tq4 --rows 8 \
    --gen 16 --reps 1 --json >"$W/e2e_prefill.json" 2>"$W/e2e_prefill.err"
fi
if has fast; then # the same decode matrix with the opt-in cuBLAS GEMM (not batch invariant)
  B=/tmp/llama8b
  [ -f $B/config.json ] || step 150 make_llama8b python3 cuda_make_llama8b.py $B >"$W/make_llama8b.log" 2>&1
  for rows in 1 8 32; do
    step 150 "fast_rows$rows" ./tqkv bench model --device cuda --fast-gemm --model $B --ctx 4096,32768 \
      --kv f32,tq4 --rows $rows --gen 16 --reps 1 --fill synthetic --json >"$W/fast_rows$rows.json" 2>"$W/fast_rows$rows.err"
  done
  step 150 fast_bf16_30 ./tqkv bench model --device cuda --fast-gemm --model $B --ctx 32768 --kv f32 \
    --rows 30 --gen 16 --reps 1 --fill synthetic --json >"$W/fast_bf16_30.json" 2>"$W/fast_bf16_30.err"
  step 200 fast_tq4_119 ./tqkv bench model --device cuda --fast-gemm --model $B --ctx 32768 --kv tq4 \
    --rows 119 --gen 16 --reps 1 --fill synthetic --json >"$W/fast_tq4_119.json" 2>"$W/fast_tq4_119.err"
  step 120 fast_prefill ./tqkv bench model --device cuda --fast-gemm --model $B --ctx 512 --kv f32,tq4 \
    --rows 8 --gen 16 --reps 1 --json >"$W/fast_prefill.json" 2>"$W/fast_prefill.err"
fi
if has graphs; then
  for rows in 1 8 32; do
    step 150 "graphs_rows$rows" ./tqkv bench model --device cuda --model "$M" --ctx 512,4096 --kv f32,tq4 \
      --rows $rows --gen 128 --reps 3 --graphs 0,1 --json >"$W/graphs_rows$rows.json" 2>"$W/graphs_rows$rows.err"
  done
  B=/tmp/llama8b
  [ -f $B/config.json ] && for rows in 1 32; do
    step 150 "graphs_8b_rows$rows" ./tqkv bench model --device cuda --model $B --ctx 4096 --kv tq4 --rows $rows \
      --gen 32 --reps 1 --fill synthetic --graphs 0,1 --json >"$W/graphs_8b_rows$rows.json" 2>"$W/graphs_8b_rows$rows.err"
  done
fi
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >>"$LOG" 2>&1
cp "$LOG" "$OUT/e2e.log"
