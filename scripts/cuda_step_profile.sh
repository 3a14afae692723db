#!/bin/bash
# cuda_step_profile.sh - where a 1-row decode step's time goes, kernel by kernel (issue 22's
# batch-1 decode, issue 24's 1-row MoE bandwidth). Runs in a scripts/cuda_pack.sh folder:
#   cd PACK && OUT=$OUT ./cuda_step_profile.sh [SHAPES]     (default "llama8b qwen3moe")
# For each shape it makes a 4-layer checkpoint of the full shape (cuda_make_*.py OUT 4: the
# matrices, and so every kernel's time, are the full model's; only the layer count differs),
# then:
#  - step time: `tqkv bench model --device cuda --rows 1 --ctx 4096 --kv tq4 --gen 16
#    --graphs 0,1 --fill synthetic` (graphs replayed and kernel by kernel, one call);
#  - per kernel: Nsight Compute, gpu__time_duration and dram__bytes_read (one pass each), on
#    the same command kernel by kernel with --gen 3, as CSV (ncu_SHAPE.csv; launch order kept).
# The sum of the kernel times of one step against the graph's step time is the time between
# kernels. `python3 scripts/ncu_step_table.py ncu_SHAPE.csv` folds it by kernel name (with the
# DRAM bytes read and GB/s; --json for a JSON object).
# TRACE=1 also runs the graphs-on command under the kernel tracer (cupti_trace.so, packed by
# cuda_pack.sh where the toolkit has CUPTI): trace_SHAPE.csv, every kernel of the replayed
# steps as it ran (PDL overlap and the gaps between kernels included, which Nsight Compute's
# serialised runs leave out), folded by cupti_step_table.py into trace_SHAPE.txt / .json.
# NCU=0 leaves out the Nsight Compute runs. Extra environment for every run: ENVX="K=V ...".
# AB=1 runs both again with the small kernels' earlier paths (TQKV_MOE_ROUTE_FAST=0
# TQKV_NORM_REGS=0 TQKV_PICK_SPLIT=0 TQKV_MOE_ROUTER_WIDE=0 TQKV_MOE_FOLD_GATHER=0: the same
# bits), into step_SHAPE_old.json and
# ncu_SHAPE_old.csv (the router's 64-value loads have no switch: main's build for those).
set -u -o pipefail
SHAPES=${1:-llama8b qwen3moe}
VARIANTS=new; [ "${AB:-0}" = 1 ] && VARIANTS="new old"
NAME=prof; . "$(dirname "$0")/cuda_run_common.sh"
for s in $SHAPES; do
  case $s in
    llama8b) mk=cuda_make_llama8b.py ;;
    qwen3moe) mk=cuda_make_qwen3moe30b.py ;;
    *) echo "unknown shape $s" >>"$LOG"; continue ;;
  esac
  M=/tmp/prof_$s; rm -rf "$M"
  step 200 "make_$s" python3 "$mk" "$M" 4 >"$W/make_$s.log" 2>&1
  for v in $VARIANTS; do
    x=$s; E=(env ${ENVX:-})
    [ "$v" = old ] && x=${s}_old && E=(env ${ENVX:-} TQKV_MOE_ROUTE_FAST=0 TQKV_NORM_REGS=0 TQKV_PICK_SPLIT=0 \
      TQKV_MOE_ROUTER_WIDE=0 TQKV_MOE_FOLD_GATHER=0)
    step 200 "step_$x" "${E[@]}" ./tqkv bench model --device cuda --model "$M" --rows 1 --ctx 4096 \
      --kv tq4 --gen 16 --reps 2 --graphs 0,1 --fill synthetic --json >"$W/step_$x.json" 2>"$W/step_$x.err"
    if [ "${TRACE:-0}" = 1 ] && [ -f cupti_trace.so ]; then
      step 200 "trace_$x" "${E[@]}" CUPTI_TRACE_OUT="$W/trace_$x.csv" LD_PRELOAD="$PWD/cupti_trace.so" \
        ./tqkv bench model --device cuda --model "$M" --rows 1 --ctx 4096 --kv tq4 --gen 16 --reps 1 \
        --fill synthetic --json >"$W/trace_$x.json" 2>"$W/trace_$x.err"
      python3 cupti_step_table.py "$W/trace_$x.csv" >"$W/trace_$x.txt" 2>&1
      python3 cupti_step_table.py "$W/trace_$x.csv" --json >"$W/trace_${x}_table.json" 2>/dev/null
    fi
    [ "${NCU:-1}" = 0 ] && continue
    step 300 "ncu_$x" "${E[@]}" ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --page raw \
      ./tqkv bench model --device cuda --model "$M" --rows 1 --ctx 4096 --kv tq4 --gen 3 \
      --reps 1 --graphs 0 --fill synthetic >"$W/ncu_$x.csv" 2>"$W/ncu_$x.err"
  done
  rm -rf "$M"
done
