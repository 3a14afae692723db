#!/usr/bin/env bash
# bench/serve/rss.sh [BIN...] - resident memory of `tqkv serve` at 64 streams (issue 26).
# For each binary (default build/tqkv): start `tqkv serve --kv $KV --parallel 64` (KV default
# f16, --kv-budget $KV_BUDGET default 1G, 2 threads), record its RSS once idle after start
# ("base": code + weights + tokenizer), then run $ROUNDS bursts (default 2) of the closed-loop
# load generator (loadgen.mjs: 64 streams, prompts of ~200 tokens cut from
# ../shared/data/heldout-code.txt, 128 tokens each, greedy, streamed) for $DUR seconds (default
# 30) each, sampling VmRSS and the engine's tqkv_kv_bytes_used every 0.2 s; after each burst,
# RSS once the server is idle again (2 s). Prints one JSON line per binary:
#   {"bin", "kv", "rss_base_mb", "rss_peak_mb", "kv_used_peak_mb", "rss_idle_after_mb": [..],
#    "kv_allocated_peak_mb" (new binaries only), "tokens_per_s": [..],
#    "over_base_plus_kv_mb": rss_peak - base - kv_used_peak, "requests": ..}
# The issue's target: rss_peak <= base + kv_used_peak + 150 MB.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
data="$root/../shared/data/heldout-code.txt"
[ -f "$data" ] || { echo "rss: $data absent (needs ../shared)" >&2; exit 77; }
kv="${KV:-f16}"; budget="${KV_BUDGET:-1G}"; dur="${DUR:-30}"; rounds="${ROUNDS:-2}"
bins=("$@"); [ ${#bins[@]} -gt 0 ] || bins=("$root/build/tqkv")

rss_kb() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }
metric() { curl -s "http://127.0.0.1:$1/metrics" | awk -v m="$2" '$1 == m {print $2}'; }

for bin in "${bins[@]}"; do
  pf="$(mktemp)"; rm -f "$pf"
  OMP_WAIT_POLICY=passive OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=1 \
    "$bin" serve --port 0 --port-file "$pf" --kv "$kv" --threads 2 --parallel 64 --queue 512 \
    --kv-budget "$budget" 2>/dev/null &
  pid=$!
  for _ in $(seq 600); do [ -s "$pf" ] && break; sleep 0.1; done
  port="$(cat "$pf")"; rm -f "$pf"
  sleep 1
  base="$(rss_kb "$pid")"; peak="$base"; kvpeak=0; allocpeak=0; idle=(); reqs=0; tps=()
  for r in $(seq "$rounds"); do
    node "$root/bench/serve/loadgen.mjs" --url "http://127.0.0.1:$port" --streams 64 \
      --duration "$dur" --max-tokens 128 --prompt-file "$data" --prompt-chars 700 --seed "$r" \
      > "/tmp/rss-loadgen-$$.json" &
    lg=$!
    while kill -0 "$lg" 2>/dev/null; do
      x="$(rss_kb "$pid")"; [ "$x" -gt "$peak" ] && peak="$x"
      k="$(metric "$port" tqkv_kv_bytes_used || echo 0)"; k="${k:-0}"
      [ "${k%.*}" -gt "$kvpeak" ] && kvpeak="${k%.*}"
      a="$(metric "$port" tqkv_kv_bytes_allocated || echo 0)"; a="${a:-0}"
      [ "${a%.*}" -gt "$allocpeak" ] && allocpeak="${a%.*}"
      sleep 0.2
    done
    wait "$lg" || true
    n="$(grep -o "\"requests_completed\":[0-9]*" "/tmp/rss-loadgen-$$.json" | cut -d: -f2 || echo 0)"
    reqs=$((reqs + ${n:-0}))
    tps+=("$(grep -o '"tokens_per_s":[0-9.]*' "/tmp/rss-loadgen-$$.json" | cut -d: -f2)")
    sleep 2
    idle+=("$(( $(rss_kb "$pid") / 1024 ))")
  done
  kill -TERM "$pid"; wait "$pid" || true
  rm -f "/tmp/rss-loadgen-$$.json"
  idle_json="$(IFS=,; echo "${idle[*]}")"; tps_json="$(IFS=,; echo "${tps[*]}")"
  echo "{\"bin\":\"$bin\",\"kv\":\"$kv\",\"kv_budget\":\"$budget\",\"streams\":64,\"rounds\":$rounds,\"dur_s\":$dur,\"rss_base_mb\":$((base / 1024)),\"rss_peak_mb\":$((peak / 1024)),\"kv_used_peak_mb\":$((kvpeak / 1048576)),\"kv_allocated_peak_mb\":$((allocpeak / 1048576)),\"tokens_per_s\":[$tps_json],\"rss_idle_after_mb\":[$idle_json],\"over_base_plus_kv_mb\":$(( peak / 1024 - base / 1024 - kvpeak / 1048576 )),\"requests\":$reqs}"
done
