#!/usr/bin/env bash
# fuzz/run_chat.sh [SECONDS] - build the chat-template fuzzer with clang (libFuzzer + ASan +
# UBSan) into build-fuzz, seed it with the committed real templates, and fuzz for SECONDS
# (default 60). Crashes are written to build-fuzz/artifacts-chat/. Exit status: the fuzzer's.
set -euo pipefail
secs="${1:-60}"
root="$(cd "$(dirname "$0")/.." && pwd)"
bld="$root/build-fuzz"
jobs="${JOBS:-2}"

cmake -S "$root" -B "$bld" -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DTQKV_FUZZ=ON -DTQKV_SANITIZE=ON \
  -DCMAKE_C_FLAGS="-fsanitize=fuzzer-no-link -Wno-error=unused-function" >/dev/null
cmake --build "$bld" -j"$jobs" --target fuzz_chat_template

corpus="$bld/corpus-chat"
mkdir -p "$corpus" "$bld/artifacts-chat"
TQKV_FUZZ_WRITE_SEEDS="$corpus" "$bld/fuzz_chat_template" "$root"/tests/golden/chat/*.jinja

# The render arena refuses past 256 MiB + 64 x input, so 1 GiB of malloc is a bug.
exec "$bld/fuzz_chat_template" "$corpus" -max_total_time="$secs" -max_len=16384 -timeout=20 \
  -rss_limit_mb=3072 -malloc_limit_mb=1024 -print_final_stats=1 \
  -dict="$root/fuzz/chat_template.dict" -artifact_prefix="$bld/artifacts-chat/"
