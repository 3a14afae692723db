#!/usr/bin/env bash
# bench/serve/run.sh [DURATION_S] - the serving benchmark of issue 9 section 8.
# For KV formats f16, tq4 and tq3 under ONE fixed KV budget (KV_BUDGET, default 128M):
# start one `tqkv serve` per format (2 compute threads, passive OpenMP waits, --parallel
# 64), run the
# closed-loop load generator (loadgen.mjs: prompts of ~200 tokens cut from
# ../shared/data/heldout-code.txt, max_tokens 128, greedy, streamed) at 1, 4, 16 and 64
# streams for DURATION_S seconds each (default 60, after WARMUP seconds, default 10, that
# are not measured), then the headline: the number of
# 2048-token conversations each format fits in the budget (tqkv bench capacity, projected
# bytes) and the throughput at that concurrency. Writes bench/serve/results.jsonl and
# regenerates the plot (bench/serve/plot.sh). Records uptime's load average per point.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
dur="${1:-60}"
bin="${TQKV_BIN:-$root/build/tqkv}"
budget="${KV_BUDGET:-128M}"
threads="${THREADS:-2}"
data="$root/../shared/data/heldout-code.txt"
[ -f "$data" ] || { echo "bench serve: $data absent (needs ../shared)" >&2; exit 77; }
out="$root/bench/serve/results.jsonl"
: > "$out"
cap_json="$("$bin" bench capacity --kv f16,tq4,tq3 --kv-budget "$budget" --tokens 2048 --json 2>/dev/null)"
echo "$cap_json" | sed 's/^/{"capacity":/; s/$/}/' >> "$out"

serve_start() { # $1 kv -> appends to pids/ports
  local pf; pf="$(mktemp)"; rm -f "$pf"
  OMP_WAIT_POLICY=passive OMP_NUM_THREADS="$threads" OPENBLAS_NUM_THREADS=1 \
    "$bin" serve --port 0 --port-file "$pf" --kv "$1" --threads "$threads" --parallel 64 \
    --queue 512 --kv-budget "$budget" 2>/dev/null &
  pids[$1]=$!
  for _ in $(seq 600); do [ -s "$pf" ] && break; sleep 0.1; done
  ports[$1]="$(cat "$pf")"; rm -f "$pf"
}
point() { # kv streams prompt_chars max_tokens label
  local load; load="$(cut -d' ' -f1-3 /proc/loadavg)"
  local r; r="$(node "$root/bench/serve/loadgen.mjs" --url "http://127.0.0.1:${ports[$1]}" --streams "$2" \
      --duration "$dur" --warmup "${WARMUP:-10}" --max-tokens "$4" --prompt-file "$data" --prompt-chars "$3")"
  echo "$r" | sed "s/^{/{\"kv\":\"$1\",\"label\":\"$5\",\"loadavg\":\"$load\",\"kv_budget\":\"$budget\",/" | tee -a "$out" >&2
}
# One server per format, all up at once (an idle server does not compute); the formats are
# measured one after another at each concurrency, so they see the same machine load.
declare -A pids ports
kvs="f16 tq4 tq3"
for kv in $kvs; do
  serve_start "$kv"
  node "$root/bench/serve/loadgen.mjs" --url "http://127.0.0.1:${ports[$kv]}" --streams 2 \
      --duration 3 --max-tokens 8 --prompt-file "$data" >/dev/null   # warm-up
done
for c in 1 4 16 64; do for kv in $kvs; do point "$kv" "$c" 700 128 sweep; done; done
# headline: conversations of up to 2048 tokens (~1700-token prompts + 128 generated) at the
# largest concurrency the budget admits for each format
if [ "${HEADLINE:-1}" = 1 ]; then
  for kv in $kvs; do
    n="$(echo "$cap_json" | grep -o "\"kv\":\"$kv\"[^}]*" | grep -o '"conversations":[0-9]*' | cut -d: -f2)"
    point "$kv" "$n" 6000 128 "headline-2048"
  done
fi
for kv in $kvs; do kill -TERM "${pids[$kv]}"; wait "${pids[$kv]}" || true; done
bash "$root/bench/serve/plot.sh"
