#!/usr/bin/env bash
# fuzz/run.sh TARGET [SECONDS] - build one libFuzzer target with clang (libFuzzer + ASan +
# UBSan) into build-fuzz, seed its corpus, and fuzz for SECONDS (default 60). Crashes are
# written to build-fuzz/artifacts-TARGET/. Exit status: the fuzzer's.
#   restore        state restore (tqkv_cache_restore / tqkv_batch_restore), seeded with valid states
#   chat_template  the Jinja chat-template parser and renderer, seeded with the real templates
#   request        the server's OpenAI request parser, seeded with valid requests
#   config         config.json / generation_config.json readers, seeded with the checkpoints'
set -euo pipefail
target="${1:?usage: fuzz/run.sh restore|chat_template|request|config [SECONDS]}"
secs="${2:-60}"
root="$(cd "$(dirname "$0")/.." && pwd)"
bld="$root/build-fuzz"
jobs="${JOBS:-2}"

# The libraries are instrumented for coverage (fuzzer-no-link); the target links libFuzzer.
# The project builds with gcc -Werror; clang alone warns about unused static helpers in
# per-ISA files, and under coverage instrumentation it cannot always honour `omp simd`
# (-Wpass-failed), so those two warnings stay warnings here.
cmake -S "$root" -B "$bld" -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DTQKV_FUZZ=ON -DTQKV_SANITIZE=ON -DBUILD_TESTING=OFF \
  -DCMAKE_C_FLAGS="-fsanitize=fuzzer-no-link -Wno-error=unused-function -Wno-error=pass-failed" >/dev/null
cmake --build "$bld" -j"$jobs" --target "fuzz_$target"

corpus="$bld/corpus-$target"
mkdir -p "$corpus" "$bld/artifacts-$target"
bin="$bld/fuzz_$target"
# Each target writes its own seeds when TQKV_FUZZ_WRITE_SEEDS names a folder.
# -malloc_limit_mb sits above each code path's own refusal limit: a larger allocation is a
# bug the fuzzer should report.
case "$target" in
restore)
  TQKV_FUZZ_WRITE_SEEDS="$corpus" "$bin"
  opts=(-max_len=4096 -rss_limit_mb=3072 -malloc_limit_mb=1024) ;;
chat_template)
  TQKV_FUZZ_WRITE_SEEDS="$corpus" "$bin" "$root"/tests/golden/chat/*.jinja
  opts=(-max_len=16384 -timeout=20 -rss_limit_mb=3072 -malloc_limit_mb=1024
        -dict="$root/fuzz/chat_template.dict") ;;
request)
  TQKV_FUZZ_WRITE_SEEDS="$corpus" "$bin"
  opts=(-max_len=8192 -rss_limit_mb=2048 -malloc_limit_mb=512) ;;
config)
  TQKV_FUZZ_WRITE_SEEDS="$corpus" "$bin" "$root"/models/*/config.json \
    "$root"/tests/golden/*/*/config.json
  opts=(-max_len=16384 -rss_limit_mb=2048 -malloc_limit_mb=512) ;;
*) echo "fuzz/run.sh: unknown target '$target'" >&2; exit 2 ;;
esac
exec "$bin" "$corpus" -max_total_time="$secs" -print_final_stats=1 "${opts[@]}" \
  -artifact_prefix="$bld/artifacts-$target/"
