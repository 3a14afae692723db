#!/bin/sh
# check_exports.sh CC "HEADER..." LIB... - fail unless the installed libraries export
# exactly the functions declared in the installed public headers (issue 20: "only
# tqkv_-prefixed functions that are in a public header are exported").
#   1. every symbol a library exports must be a function declared in one of the headers
#      (an internal helper exported across the library boundary, or an exported variable,
#      fails). Shared libraries: the dynamic symbol table (nm -D --defined-only); static
#      archives: every defined global symbol (what an embedder's static link sees);
#   2. every TQKV_API declaration of the headers must be exported by one of the
#      libraries (so an empty or wrong library cannot pass, and no public function is
#      silently hidden).
# The headers are read through the C preprocessor (CC -E), so comments and examples in
# them do not count as declarations.
set -u
cc="$1"; headers="$2"; shift 2
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT

# ---- what the headers declare ----------------------------------------------
# One line per preprocessed header set; TQKV_API becomes a marker we can match.
: > "$tmp/pp"
for h in $headers; do
  "$cc" -E -P -DTQKV_API=TQKV_API_MARK -I"$(dirname "$h")" "$h" >> "$tmp/pp" ||
    { echo "FAIL: cannot preprocess $h"; exit 1; }
done
tr '\n' ' ' < "$tmp/pp" | tr ';{}' '\n\n\n' > "$tmp/decls"
# declared: any tqkv_ name directly followed by "(" (a function declaration)
grep -o 'tqkv_[A-Za-z0-9_]*[[:space:]]*(' "$tmp/decls" | sed 's/[[:space:]]*($//' |
  sort -u > "$tmp/declared"
# api: the name in a declaration that starts with TQKV_API
grep 'TQKV_API_MARK' "$tmp/decls" | sed 's/.*TQKV_API_MARK//' |
  grep -o '^[^(]*(' | grep -o 'tqkv_[A-Za-z0-9_]*[[:space:]]*($' | sed 's/[[:space:]]*($//' |
  sort -u > "$tmp/api"
n_api=$(wc -l < "$tmp/api")
if [ "$n_api" -lt 10 ]; then
  echo "FAIL: found only $n_api TQKV_API declarations in: $headers"; exit 1
fi

# ---- what the libraries export ---------------------------------------------
status=0
: > "$tmp/all_exports"
for lib in "$@"; do
  # TQKV_0 and the like are version nodes (absolute symbols), not code or data
  case "$lib" in
    *.so|*.so.*) nm -D --defined-only "$lib" > "$tmp/nm" || { echo "FAIL: nm -D $lib"; exit 1; } ;;
    *)           nm -g --defined-only "$lib" > "$tmp/nm" || { echo "FAIL: nm -g $lib"; exit 1; } ;;
  esac
  awk '$2 != "A" && NF >= 3 { print $3 }' "$tmp/nm" | sed 's/@.*//' | sort -u > "$tmp/exports"
  cat "$tmp/exports" >> "$tmp/all_exports"
  comm -23 "$tmp/exports" "$tmp/declared" > "$tmp/bad"
  n_exp=$(wc -l < "$tmp/exports")
  if [ -s "$tmp/bad" ]; then
    n_bad=$(wc -l < "$tmp/bad")
    echo "FAIL: $lib exports $n_bad of $n_exp symbols that no public header declares:"
    sed 's/^/  /' "$tmp/bad"
    status=1
  else
    echo "ok: $lib exports $n_exp symbols, all declared in a public header"
  fi
done
sort -u "$tmp/all_exports" -o "$tmp/all_exports"
comm -23 "$tmp/api" "$tmp/all_exports" > "$tmp/missing"
if [ -s "$tmp/missing" ]; then
  n_miss=$(wc -l < "$tmp/missing")
  echo "FAIL: $n_miss TQKV_API declarations of the public headers are exported by no library:"
  sed 's/^/  /' "$tmp/missing"
  status=1
else
  echo "ok: all $n_api TQKV_API declarations are exported"
fi
exit $status
