#!/usr/bin/env bash
# test.sh - build and run the whole test suite: Release (then install it to a temporary
# prefix and build the examples against the install), then ASan+UBSan, then short
# libFuzzer runs (state restore, server request parser, chat templates, config readers). Exits non-zero on
# any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh test
jobs=$(nproc)

echo "== Release build + ctest"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=ON >/dev/null
cmake --build build -j"$jobs"
(cd build && ctest --output-on-failure -j1) | tee build/ctest.log

echo "== install to a temporary prefix; build and run examples/ against it"
scripts/check_install.sh build

echo "== ASan+UBSan build + ctest"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTQKV_SANITIZE=ON \
  -DBUILD_TESTING=ON >/dev/null
cmake --build build-asan -j"$jobs"
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
   ctest --output-on-failure -j1) | tee build-asan/ctest.log

# Short fuzz runs (longer recorded runs: bench/RESULTS.md).
for target in restore request chat_template config; do
  echo "== fuzz: $target (${TQKV_FUZZ_SECONDS:-60} s)"
  bash fuzz/run.sh "$target" "${TQKV_FUZZ_SECONDS:-60}"
done

# One closing line for CI: counts over both ctest runs (a failure above already exited).
total=0 skipped=0
for log in build/ctest.log build-asan/ctest.log; do
  n=$(grep -Eo 'tests failed out of [0-9]+' "$log" | grep -Eo '[0-9]+$')
  s=$(grep -c '\*\*\*Skipped' "$log" || true)
  total=$((total + n)) skipped=$((skipped + s))
done
echo "summary: $((total - skipped)) passed, 0 failed, $skipped skipped"
