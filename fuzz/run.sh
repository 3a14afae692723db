#!/usr/bin/env bash
# fuzz/run.sh [SECONDS] - build the state-restore fuzzer with clang (libFuzzer + ASan + UBSan)
# into build-fuzz, generate a small seed corpus of valid states, and fuzz for SECONDS
# (default 60). Crashes are written to build-fuzz/artifacts/. Exit status: the fuzzer's.
set -euo pipefail
secs="${1:-60}"
root="$(cd "$(dirname "$0")/.." && pwd)"
bld="$root/build-fuzz"
jobs="${JOBS:-2}"

# The library itself is instrumented for coverage (fuzzer-no-link); the target links libFuzzer.
# The project builds with gcc -Werror; clang alone warns about unused static helpers in
# per-ISA files, so that one warning stays a warning here (it is not a restore bug).
cmake -S "$root" -B "$bld" -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DTQKV_FUZZ=ON -DTQKV_SANITIZE=ON \
  -DCMAKE_C_FLAGS="-fsanitize=fuzzer-no-link -Wno-error=unused-function" >/dev/null
cmake --build "$bld" -j"$jobs" --target fuzz_restore

corpus="$bld/corpus"
mkdir -p "$corpus" "$bld/artifacts"
TQKV_FUZZ_WRITE_SEEDS="$corpus" "$bld/fuzz_restore"

# -malloc_limit_mb above restore's own refusal limit (16 x state + 256 MiB): a larger
# allocation is a bug the fuzzer should report.
exec "$bld/fuzz_restore" "$corpus" -max_total_time="$secs" -max_len=4096 \
  -rss_limit_mb=3072 -malloc_limit_mb=1024 -print_final_stats=1 \
  -artifact_prefix="$bld/artifacts/"
