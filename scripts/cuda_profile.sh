#!/bin/bash
# cuda_profile.sh - where the decode attention kernel's time goes (run in a cuda_pack.sh
# folder on the device): SASS instruction mix of each split kernel, and Nsight Compute
# (clocks left alone) for one tq4 and one tq3 launch at batch 8, ctx 64k.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PATH=$PATH:/usr/local/cuda/bin LD_LIBRARY_PATH=$PWD/lib
cuobjdump -sass test_cuda > "$OUT/sass.txt" 2>&1
awk '/Function :/{name=$3} /^ +\/\*[0-9a-f]+\*\/ +[A-Z@]/{ op=$2; if (op ~ /^@/) op=$3; sub(/\..*/, "", op); cnt[name" "op]++ }
     END { for (k in cnt) print cnt[k], k }' "$OUT/sass.txt" | sort -k2,2 -k1,1nr | grep split_kernel > "$OUT/sass_mix.txt"
for f in tq4 tq3; do
  ncu --clock-control none -k regex:split_kernel -c 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
      --section InstructionStats --section SchedulerStats \
      ./tqkv bench attention --device cuda --batches 8 --ctxs 65536 --formats $f --reps 1 > "$OUT/ncu_$f.txt" 2>&1
done
grep -E "Duration|Throughput|Pipe|Issue|Warp Cycles|Stall|Eligible|Achieved Occupancy|Registers|Executed Ipc|L1/TEX Hit|Bank" "$OUT/ncu_tq4.txt" | head -60
