#!/usr/bin/env bash
# bench/llamacpp/run.sh - tqkv against the llama.cpp anchor, on this machine, in one run.
#
# usage: bench/llamacpp/run.sh [ANCHOR] [--mode bench|serve] [--reps N] [--json] [--out FILE]
#                              [--tqkv-args "..."] [--variant 'NAME|BIN|ARGS' ...]
#   ANCHOR  the anchor kit (default ../shared/anchors/llama.cpp beside the repository);
#           absent: prints 'skipped' and exits 77.
#
# bench (default): llama-bench against `tqkv bench model`, single stream, 2 threads, flash
#   attention on the llama side: prefill of 512 and 3968 tokens from empty, 128 decode steps
#   at depth 512 and 3968 (3968 + 128 = 4096, the model's context; see the anchor README,
#   note 1). llama.cpp runs a BF16 GGUF made by the anchor's converter into a temp dir; its
#   KV cache is f16. tqkv runs its f16 and tq4 caches. Each of REPS rounds (default 3) runs
#   llama-bench prefill, tqkv, llama-bench decode, one after the other (interleaved), each
#   measuring once; the table shows medians over the rounds and tqkv / llama ratios.
#   --variant 'NAME|BIN|ARGS' (repeatable) measures several tqkv builds / flags in the same
#   rounds (e.g. 'base|/tmp/old/tqkv|' 'new|build/tqkv|' 'exact|build/tqkv|--exact'), each
#   right after the other; default one variant 'tqkv|$TQKV_BIN|--tqkv-args'.
# serve: llama-server (f16 KV, -np C slots of 2304 tokens) against `tqkv serve` (f16 and
#   tq4, --parallel 64) under bench/serve/loadgen.mjs: closed loop, prompts of ~200 tokens
#   (700 characters of ../shared/data/heldout-code.txt), 128 generated, greedy, at 1, 4, 16
#   and 64 streams (DURATION s each after WARMUP s, defaults 20 and 5), REPS rounds, the
#   three servers one after the other at each point. Also records each server's CPU use
#   (cores busy over the window) and RSS (VmRSS after the point, VmHWM).
#
# Writes one JSON (default bench/llamacpp/results-<mode>.json) and prints the table; with
# --json prints the JSON on stdout instead of the table. Environment: TQKV_BIN (default
# build/tqkv), THREADS (default 2), DURATION, WARMUP, STREAMS (default "1 4 16 64"),
# PYTHON (an interpreter with numpy for the converter; default /usr/bin/python3).
# llama.cpp runs with no OMP_* variables (its README, note 2); the machine should be quiet.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
anchor="$root/../shared/anchors/llama.cpp"
mode=bench reps=3 json=0 out="" targs="" variants=()
while [ $# -gt 0 ]; do
  case "$1" in
    --mode) mode="$2"; shift 2 ;;
    --reps) reps="$2"; shift 2 ;;
    --json) json=1; shift ;;
    --out) out="$2"; shift 2 ;;
    --tqkv-args) targs="$2"; shift 2 ;;
    --variant) variants+=("$2"); shift 2 ;;
    -h|--help) sed -n 2,30p "$0"; exit 0 ;;
    -*) echo "bench/llamacpp: unknown option $1" >&2; exit 2 ;;
    *) anchor="$1"; shift ;;
  esac
done
case "$mode" in bench|serve) ;; *) echo "bench/llamacpp: --mode takes bench or serve" >&2; exit 2 ;; esac
[[ "$reps" =~ ^[1-9][0-9]*$ ]] || { echo "bench/llamacpp: --reps must be >= 1" >&2; exit 2; }
if [ ! -x "$anchor/bin/llama-bench" ] || [ ! -f "$anchor/convert_qwen3.py" ]; then
  echo "skipped: no llama.cpp anchor at $anchor"
  exit 77
fi
anchor="$(cd "$anchor" && pwd)"
bin="${TQKV_BIN:-$root/build/tqkv}"
[ -x "$bin" ] || { echo "bench/llamacpp: $bin not built" >&2; exit 2; }
[ ${#variants[@]} -gt 0 ] || variants=("tqkv|$bin|$targs")
threads="${THREADS:-2}"
py="${PYTHON:-/usr/bin/python3}"
model="${MODEL:-$root/models/qwen3-code-28m}" # MODEL: another copy of the bundled model
out="${out:-$root/bench/llamacpp/results-$mode.json}"
tmp="$(mktemp -d)"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT
log() { echo "bench/llamacpp: $*" >&2; }

# ---- the GGUF (converter output in a dir named like the model, so it is byte-stable) ----
mkdir -p "$tmp/qwen3-code-28m"
gguf="$tmp/qwen3-code-28m/qwen3-code-28m-bf16.gguf"
log "converting $model to BF16 GGUF"
(cd "$tmp/qwen3-code-28m" && "$py" "$anchor/convert_qwen3.py" "$model" "$gguf" > "$tmp/convert.log" 2>&1) ||
  { cat "$tmp/convert.log" >&2; echo "bench/llamacpp: conversion failed (needs numpy: apt-get install python3-numpy)" >&2; exit 1; }
variant="$( (cd "$tmp" && "$anchor/bin/llama-bench" --help 2>&1 || true) | sed -n '1{s/.*libggml-cpu-//; s/\.so.*//; p}')"
cpu="$(lscpu | sed -n 's/^Model name: *//p' | head -1)"
flags="$(grep -m1 '^flags' /proc/cpuinfo | grep -o 'avx512[a-z0-9_]*\|avx_vnni\|avx2' | sort -u | tr '\n' ' ' || true)"
meta="$(jq -nc --arg cpu "$cpu" --arg flags "$flags" --arg variant "$variant" --arg date "$(date -u +%FT%TZ)" \
  --arg commit "$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)" \
  --argjson threads "$threads" --argjson reps "$reps" --arg mode "$mode" --arg targs "$targs" \
  '{date:$date, cpu:$cpu, flags:$flags, llama_cpu_variant:$variant, tqkv_commit:$commit,
    threads:$threads, reps:$reps, mode:$mode, tqkv_extra_args:$targs}')"
loadavg() { cut -d' ' -f1-3 /proc/loadavg; }

# ---- bench mode -------------------------------------------------------------------------
run_bench() {
  local recs="$tmp/recs.jsonl"; : > "$recs"
  for r in $(seq "$reps"); do
    log "round $r/$reps (load $(loadavg))"
    (cd "$tmp" && "$anchor/bin/llama-bench" -m "$gguf" -t "$threads" -fa 1 -p 512,3968 -n 0 -r 1 -o json 2>/dev/null) |
      jq -c --argjson r "$r" --arg l "$(loadavg)" '.[] | {engine:"llama", round:$r, loadavg:$l, test:("pp" + (.n_prompt|tostring)), depth:.n_depth, ts:.avg_ts}' >> "$recs"
    for v in "${variants[@]}"; do
      local name="${v%%|*}" rest="${v#*|}"; local vbin="${rest%%|*}" vargs="${rest#*|}"
      # shellcheck disable=SC2086
      "$vbin" bench model --model "$model" --ctx 512,3968 --kv f16,tq4 --gen 128 --reps 1 --threads "$threads" $vargs --json 2>/dev/null |
        jq -c --argjson r "$r" --arg l "$(loadavg)" --arg n "$name" '.[] | ({engine:($n + "-" + .kv), round:$r, loadavg:$l, test:("pp" + (.ctx|tostring)), depth:0, ts:.prefill_tokens_per_s},
                                        {engine:($n + "-" + .kv), round:$r, loadavg:$l, test:"tg128", depth:.ctx, ts:.decode_tokens_per_s})' >> "$recs"
    done
    (cd "$tmp" && "$anchor/bin/llama-bench" -m "$gguf" -t "$threads" -fa 1 -p 0 -n 128 -d 512,3968 -r 1 -o json 2>/dev/null) |
      jq -c --argjson r "$r" --arg l "$(loadavg)" '.[] | {engine:"llama", round:$r, loadavg:$l, test:("tg" + (.n_gen|tostring)), depth:.n_depth, ts:.avg_ts}' >> "$recs"
  done
  jq -s --argjson meta "$meta" --arg variants "$(printf '%s\n' "${variants[@]}")" '
    def median: sort | if length % 2 == 1 then .[length/2|floor] else (.[length/2 - 1] + .[length/2]) / 2 end;
    . as $recs | (map(.engine) | unique | map(select(. != "llama"))) as $eng
    | (group_by([.engine, .test, .depth]) | map({key: "\(.[0].engine)|\(.[0].test)|\(.[0].depth)",
        value: (map(.ts) | median)}) | from_entries) as $m
    | [["pp512",0],["pp3968",0],["tg128",512],["tg128",3968]] | map(. as [$t,$d] |
        {test:$t, depth:$d, llama:$m["llama|\($t)|\($d)"],
         tqkv: ($eng | map({key:., value:$m["\(.)|\($t)|\($d)"]}) | from_entries)}
        | .ratio = (.llama as $l | .tqkv | with_entries(.value = (if $l and .value then .value / $l else null end)))) as $rows
    | $meta + {variants:($variants | split("\n") | map(select(length > 0))), unit:"tokens/s, median of rounds",
               engines:$eng, results:$rows, records:$recs}' "$recs" > "$out"
  [ "$json" = 1 ] && { cat "$out"; return; }
  jq -r '"\(.date)  \(.cpu)  llama.cpp variant \(.llama_cpu_variant)  threads \(.threads)  medians of \(.reps)"' "$out"
  jq -r '.engines as $e | (["test", "depth", "llama f16"] + $e + ($e | map(. + "/llama"))) | join("\t")' "$out" > "$tmp/table"
  jq -r '.engines as $e | .results[] | . as $x | ([.test, (.depth|tostring), (.llama*10|round/10|tostring)]
      + ($e | map($x.tqkv[.]*10|round/10|tostring)) + ($e | map($x.ratio[.] | if . == null then "n/a" else (.*100|round/100|tostring) + "x" end))) | join("\t")' "$out" >> "$tmp/table"
  column -t -s $'\t' "$tmp/table"
  log "wrote $out"
}

# ---- serve mode -------------------------------------------------------------------------
data="$root/../shared/data/heldout-code.txt"
dur="${DURATION:-20}" warm="${WARMUP:-5}"
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
rss_kb() { awk -v k="$2" '$1 == k":" {print $2}' "/proc/$1/status"; }
wait_port() { # $1 url; 600 tries of 0.1 s
  for _ in $(seq 600); do curl -sf "$1/health" > /dev/null 2>&1 && return 0; sleep 0.1; done
  echo "bench/llamacpp: no server at $1" >&2; return 1
}
# point ENGINE PID URL STREAMS ROUND -> one JSON line on stdout
point() {
  local hz t0 c0 r
  hz="$(getconf CLK_TCK)"; t0="$(date +%s.%N)"; c0="$(cpu_ticks "$2")"
  local l; l="$(loadavg)"
  r="$(node "$root/bench/serve/loadgen.mjs" --url "$3" --streams "$4" --duration "$dur" --warmup "$warm" \
        --max-tokens 128 --prompt-file "$data" --prompt-chars 700)"
  local c1 t1; c1="$(cpu_ticks "$2")"; t1="$(date +%s.%N)"
  echo "$r" | jq -c --arg e "$1" --argjson s "$4" --argjson rd "$5" --arg l "$l" \
    --argjson cores "$(echo "($c1 - $c0) / $hz / ($t1 - $t0)" | bc -l | sed 's/^\./0./')" \
    --argjson rss "$(rss_kb "$2" VmRSS)" --argjson hwm "$(rss_kb "$2" VmHWM)" \
    '{engine:$e, streams:$s, round:$rd, loadavg:$l, cores_busy:$cores, rss_kib:$rss, hwm_kib:$hwm} + .'
}
run_serve() {
  [ -f "$data" ] || { echo "skipped: $data absent"; exit 77; }
  [ -x "$anchor/bin/llama-server" ] || { echo "skipped: no llama-server in $anchor"; exit 77; }
  local recs="$tmp/recs.jsonl"; : > "$recs"
  declare -A turl tpid
  for kv in f16 tq4; do # tqkv servers stay up (an idle server does not compute)
    local pf="$tmp/port-$kv"
    # shellcheck disable=SC2086
    "$bin" serve --model "$model" --port 0 --port-file "$pf" --kv "$kv" --threads "$threads" --parallel 64 \
      --queue 512 $targs 2> "$tmp/tqkv-$kv.log" &
    tpid[$kv]=$!; pids+=("$!")
    for _ in $(seq 600); do [ -s "$pf" ] && break; sleep 0.1; done
    turl[$kv]="http://127.0.0.1:$(cat "$pf")"
    wait_port "${turl[$kv]}"
  done
  local port=$((18090 + RANDOM % 1000))
  for c in ${STREAMS:-1 4 16 64}; do
    (cd "$tmp" && "$anchor/bin/llama-server" -m "$gguf" -t "$threads" -fa on -np "$c" -c $((c * 2304)) \
      -ctk f16 -ctv f16 --cache-ram 0 --host 127.0.0.1 --port "$port" > "$tmp/llama-server.log" 2>&1) &
    local lp=$!; pids+=("$lp")
    wait_port "http://127.0.0.1:$port"
    local spid; spid="$(pgrep -P "$lp" llama-server || echo "$lp")"
    for r in $(seq "$reps"); do
      log "streams $c round $r/$reps (load $(loadavg))"
      point llama "$spid" "http://127.0.0.1:$port" "$c" "$r" >> "$recs"
      for kv in f16 tq4; do point "tqkv-$kv" "${tpid[$kv]}" "${turl[$kv]}" "$c" "$r" >> "$recs"; done
    done
    kill "$spid" "$lp" 2>/dev/null || true; wait "$lp" 2>/dev/null || true
    port=$((port + 1))
  done
  jq -s --argjson meta "$meta" --argjson dur "$dur" '
    def median: sort | if length % 2 == 1 then .[length/2|floor] else (.[length/2 - 1] + .[length/2]) / 2 end;
    def med(f): map(f) | median;
    (group_by(.streams) | map(. as $g | {streams: $g[0].streams}
       + ([ "llama", "tqkv-f16", "tqkv-tq4" ] | map(. as $e | ($g | map(select(.engine == $e))) as $x
           | {($e): {tokens_per_s: ($x | med(.tokens_per_s)), cores_busy: ($x | med(.cores_busy)),
                     rss_mib: (($x | map(.rss_kib) | max) / 1024), hwm_mib: (($x | map(.hwm_kib) | max) / 1024),
                     ttft_p50_s: ($x | med(.ttft_p50_s))}}) | add)
       | .tq4_ratio = (if .llama.tokens_per_s > 0 then .["tqkv-tq4"].tokens_per_s / .llama.tokens_per_s else null end)
       | .f16_ratio = (if .llama.tokens_per_s > 0 then .["tqkv-f16"].tokens_per_s / .llama.tokens_per_s else null end))) as $rows
    | $meta + {duration_s:$dur, unit:"generated tokens/s, median of rounds", results:$rows, records:.}' "$recs" > "$out"
  [ "$json" = 1 ] && { cat "$out"; return; }
  jq -r '"\(.date)  \(.cpu)  threads \(.threads)  medians of \(.reps), \(.duration_s) s a point"' "$out"
  jq -r 'def x: if . == null then "n/a" else (.*100|round/100|tostring) + "x" end;
    "streams\tllama f16\ttqkv f16\ttqkv tq4\ttq4/llama\tf16/llama\tcores llama/f16/tq4\tRSS MiB llama/f16/tq4",
    (.results[] | "\(.streams)\t\(.llama.tokens_per_s)\t\(.["tqkv-f16"].tokens_per_s)\t\(.["tqkv-tq4"].tokens_per_s)\t\(.tq4_ratio|x)\t\(.f16_ratio|x)\t\(.llama.cores_busy*100|round/100)/\(.["tqkv-f16"].cores_busy*100|round/100)/\(.["tqkv-tq4"].cores_busy*100|round/100)\t\(.llama.rss_mib|round)/\(.["tqkv-f16"].rss_mib|round)/\(.["tqkv-tq4"].rss_mib|round)")' "$out" | column -t -s $'\t'
  log "wrote $out"
}

mkdir -p "$(dirname "$out")"
if [ "$mode" = bench ]; then run_bench; else run_serve; fi
