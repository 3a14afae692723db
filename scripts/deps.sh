#!/usr/bin/env bash
# deps.sh - make sure the Debian packages tqkv needs are installed.
# usage: scripts/deps.sh [build|test|plot]   (plot: python3-matplotlib for tools/quality_plot.py)
# As root it installs what is missing with apt-get; otherwise it prints the exact
# apt-get line and exits 1.
set -euo pipefail
want=(build-essential cmake pkg-config libopenblas-dev libpcre2-dev libutf8proc-dev
      libcjson-dev zlib1g-dev libmicrohttpd-dev)
if [ "${1:-build}" = plot ]; then
  want=(python3-matplotlib)
fi
if [ "${1:-build}" = test ]; then
  # cmocka for the tests (BUILD_TESTING); dpkg-dev for the CPack .deb check
  want+=(libcmocka-dev dpkg-dev)
  # clang + its runtime for the libFuzzer state-restore fuzzer (run briefly in CI)
  want+=(clang libclang-rt-14-dev libomp-dev)
fi
missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ]; then
  echo "deps: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "deps: missing packages; run:" >&2
  echo "  sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
