#!/usr/bin/env bash
# fuzz/run_request.sh [SECONDS] - build the server request-parser fuzzer with clang
# (libFuzzer + ASan + UBSan) into build-fuzz, write its seed corpus, and fuzz for SECONDS
# (default 60). Crashes go to build-fuzz/artifacts-request/. Exit status: the fuzzer's.
set -euo pipefail
secs="${1:-60}"
root="$(cd "$(dirname "$0")/.." && pwd)"
bld="$root/build-fuzz"
jobs="${JOBS:-2}"
cmake -S "$root" -B "$bld" -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DTQKV_FUZZ=ON -DTQKV_SANITIZE=ON \
  -DCMAKE_C_FLAGS="-fsanitize=fuzzer-no-link -Wno-error=unused-function" >/dev/null
cmake --build "$bld" -j"$jobs" --target fuzz_request
corpus="$bld/corpus-request"
mkdir -p "$corpus" "$bld/artifacts-request"
TQKV_FUZZ_WRITE_SEEDS="$corpus" "$bld/fuzz_request"
exec "$bld/fuzz_request" "$corpus" -max_total_time="$secs" -max_len=8192 \
  -rss_limit_mb=2048 -malloc_limit_mb=512 -print_final_stats=1 \
  -artifact_prefix="$bld/artifacts-request/"
