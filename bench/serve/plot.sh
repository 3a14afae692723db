#!/usr/bin/env bash
# bench/serve/plot.sh - regenerate bench/serve/serve.png from bench/serve/results.jsonl:
# aggregate generated tokens/s and p99 inter-token latency against concurrent streams,
# one line per KV format. Needs gnuplot (Debian gnuplot-nox) and node.
set -euo pipefail
dir="$(cd "$(dirname "$0")" && pwd)"
tmp="$(mktemp -d)"
node -e '
const fs = require("fs");
const rows = fs.readFileSync(process.argv[1], "utf8").split("\n").filter(Boolean).map(JSON.parse)
  .filter(r => r.label === "sweep");
for (const kv of ["f16", "tq4", "tq3"]) {
  const d = rows.filter(r => r.kv === kv).sort((a, b) => a.streams - b.streams)
    .map(r => `${r.streams} ${r.tokens_per_s} ${r.itl_p99_s ?? "NaN"}`).join("\n");
  fs.writeFileSync(`${process.argv[2]}/${kv}.dat`, d + "\n");
}' "$dir/results.jsonl" "$tmp"
gnuplot <<GP
set terminal pngcairo size 1100,450 noenhanced font ",10"
set output "$dir/serve.png"
set multiplot layout 1,2 title "tqkv serve, qwen3-code-28m, one KV budget, 2 threads (bench/serve/results.jsonl)"
set logscale x 2
set xtics (1,4,16,64)
set xrange [0.8:80]
set grid
set key left top
set xlabel "concurrent streams"
set ylabel "generated tokens/s (aggregate)"
plot "$tmp/f16.dat" u 1:2 w lp lw 2 t "f16", "$tmp/tq4.dat" u 1:2 w lp lw 2 t "tq4", "$tmp/tq3.dat" u 1:2 w lp lw 2 t "tq3"
set ylabel "p99 inter-token latency (s)"
plot "$tmp/f16.dat" u 1:3 w lp lw 2 t "f16", "$tmp/tq4.dat" u 1:3 w lp lw 2 t "tq4", "$tmp/tq3.dat" u 1:3 w lp lw 2 t "tq3"
unset multiplot
GP
rm -rf "$tmp"
echo "wrote $dir/serve.png" >&2
