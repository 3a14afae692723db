#!/bin/bash
# cuda_seed_sweep.sh - one test_cuda test over many seeds, JOBS at a time (the attention
# test's CPU reference takes 2 threads each), to measure a tolerance's tail before trusting
# it. Runs in a scripts/cuda_pack.sh folder:
#   cd PACK && [JOBS=8] ./cuda_seed_sweep.sh FIRST LAST [TEST]   (TEST: test_cuda_attend_tq)
# Logs in $OUT/sweep/seedN.log; prints one line per seed and the worst rel. L2 of any case;
# exits 1 if a seed failed, 77 if every seed skipped (no GPU).
set -u
FIRST=${1:?first seed}; LAST=${2:?last seed}; TEST=${3:-test_cuda_attend_tq}; JOBS=${JOBS:-8}
OUT=${OUT:-/tmp/out}; D=$OUT/sweep; mkdir -p "$D"
export LD_LIBRARY_PATH=$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
BIN=${TEST_CUDA:-./test_cuda}
s=$FIRST
while [ "$s" -le "$LAST" ]; do
  for ((j = 0; j < JOBS && s <= LAST; j++, s++)); do
    (TQKV_TEST_SEED=$s TQKV_TEST_FILTER=$TEST "$BIN" >"$D/seed$s.log" 2>&1; echo $? >"$D/seed$s.rc") &
  done
  wait
done
failed=0; skipped=0; n=0
for ((s = FIRST; s <= LAST; s++)); do
  rc=$(cat "$D/seed$s.rc"); n=$((n + 1))
  case $rc in 0) r=passed ;; 77) r=skipped; skipped=$((skipped + 1)) ;; *) r="FAILED (rc $rc)"; failed=1 ;; esac
  echo "seed $s: $r"
done
worst=$(grep -h "worst rel L2" "$D"/seed*.log 2>/dev/null | awk '{print $NF}' | sort -g | tail -1)
echo "$TEST over seeds $FIRST..$LAST: worst rel L2 ${worst:-none}"
[ "$failed" = 1 ] && exit 1
[ "$skipped" = "$n" ] && exit 77
exit 0
