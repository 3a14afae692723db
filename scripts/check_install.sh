#!/usr/bin/env bash
# check_install.sh BUILD_DIR - install a built tree to a temporary prefix, then build and
# run examples/ against the INSTALLED package three ways: pkg-config (shared),
# find_package(tqkv) (shared) and find_package(tqkv COMPONENTS static). Exits non-zero
# on any failure. The source tree's include/ and src/ are not on any include path.
set -euo pipefail
cd "$(dirname "$0")/.."
bld="${1:-build}"
model="$PWD/models/qwen3-code-28m"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
prefix="$tmp/prefix"

echo "== install to $prefix"
cmake --install "$bld" --prefix "$prefix" >/dev/null
libdir="$(dirname "$(find "$prefix" -name tqkv.pc)")/.."
export PKG_CONFIG_PATH="$libdir/pkgconfig"
export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
test -x "$prefix/bin/tqkv" && test -f "$prefix/share/man/man1/tqkv.1"
"$prefix/bin/tqkv" --help >/dev/null

echo "== examples via pkg-config ($(pkg-config --modversion tqkv))"
cp examples/*.c "$tmp/"
cc -std=c11 -Wall -Wextra -Werror -o "$tmp/cache_basics" "$tmp/cache_basics.c" \
  $(pkg-config --cflags --libs tqkv) -lm
cc -std=c11 -Wall -Wextra -Werror -o "$tmp/generate" "$tmp/generate.c" \
  $(pkg-config --cflags --libs tqkv-model)
"$tmp/cache_basics"
"$tmp/generate" "$model" 'def add(a, b):' 16 >/dev/null

for mode in OFF ON; do
  echo "== examples via find_package(tqkv) (static: $mode)"
  cmake -S examples -B "$tmp/cmake-$mode" -DCMAKE_PREFIX_PATH="$prefix" \
    -DTQKV_EXAMPLES_STATIC=$mode >/dev/null
  cmake --build "$tmp/cmake-$mode" -j2 >/dev/null
  if [ $mode = ON ] && ldd "$tmp/cmake-$mode/cache_basics" | grep -q libtqkv; then
    echo "static example links a shared libtqkv" >&2; exit 1
  fi
  "$tmp/cmake-$mode/cache_basics"
  "$tmp/cmake-$mode/generate" "$model" 'def add(a, b):' 16
  echo
done
echo "== CPack .deb"
(cd "$bld" && cpack -G DEB -B "$tmp/deb" >/dev/null 2>&1)
dpkg-deb -c "$tmp"/deb/tqkv_*.deb > "$tmp/deb.list"
grep -q 'libtqkv.so.0$' "$tmp/deb.list"
dpkg-deb -f "$tmp"/deb/tqkv_*.deb Package Version Depends
echo "== install check ok"
