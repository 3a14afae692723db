#!/bin/sh
# check_symbols.sh LIB... - fail if a tqkv library defines a global symbol outside the
# tqkv_ prefix (TQKV_* is the version node of the shared libraries).
# Shared libraries: the dynamic symbol table (what an embedder's program links against).
# Static archives: every defined global symbol (what an embedder's static link sees).
# Each library must also export the tqkv_ API (so an empty or wrong file cannot pass).
set -u
status=0
for lib in "$@"; do
  case "$lib" in
    *.so|*.so.*) syms=$(nm -D --defined-only "$lib") || { echo "FAIL: nm $lib"; exit 1; } ;;
    *)           syms=$(nm -g --defined-only "$lib") || { echo "FAIL: nm $lib"; exit 1; } ;;
  esac
  names=$(printf '%s\n' "$syms" | awk 'NF >= 3 { print $3 }' | sed 's/@.*//')
  bad=$(printf '%s\n' "$names" | grep -Ev '^(tqkv_|TQKV)' | sort -u)
  n_api=$(printf '%s\n' "$names" | grep -c '^tqkv_')
  if [ -n "$bad" ]; then
    n_bad=$(printf '%s\n' "$bad" | wc -l)
    echo "FAIL: $lib defines $n_bad global symbols without the tqkv_ prefix:"
    printf '%s\n' "$bad" | head -50 | sed 's/^/  /'
    status=1
  elif [ "$n_api" -lt 10 ]; then
    echo "FAIL: $lib exports only $n_api tqkv_ symbols (expected the public API)"
    status=1
  else
    echo "ok: $lib: $n_api tqkv_ symbols, none unprefixed"
  fi
done
exit $status
