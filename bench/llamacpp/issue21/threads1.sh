#!/bin/bash
# ab1l.sh: 1 thread, interleaved: llama-bench pp512 / tg64@512 and tqkv base/new/exact ctx 512
# Paths as run on 2026-12-05 (base = main be8d587 built in /tmp/wt21base, new = this branch):
K=${ANCHOR:-/work/shared/anchors/llama.cpp}; M=${GGUF:-/tmp/wt21g/qwen3-code-28m/qwen3-code-28m-bf16.gguf}
cd /tmp/wt21g
for r in 1 2 3; do
  l=$(cut -d' ' -f1-3 /proc/loadavg)
  $K/bin/llama-bench -m $M -t 1 -fa 1 -p 512 -n 0 -r 2 -o json 2>/dev/null | jq -c --arg r $r --arg l "$l" '.[] | {variant:"llama", round:$r, loadavg:$l, test:"pp512", ts:.avg_ts}'
  for v in "base|/tmp/wt21base/build/tqkv|" "new|/tmp/wt21new/tqkv|" "exact|/tmp/wt21new/tqkv|--exact"; do
    n=${v%%|*}; rest=${v#*|}; b=${rest%%|*}; a=${rest#*|}
    l=$(cut -d' ' -f1-3 /proc/loadavg)
    $b bench model --model /work/wt21/models/qwen3-code-28m --ctx 512 --kv f16,tq4 --gen 64 --reps 2 --threads 1 $a --json 2>/dev/null |
      jq -c --arg n $n --arg r $r --arg l "$l" '.[] | ({variant:($n + "-" + .kv), round:$r, loadavg:$l, test:"pp512", ts:.prefill_tokens_per_s}, {variant:($n + "-" + .kv), round:$r, loadavg:$l, test:"tg64@512", ts:.decode_tokens_per_s})'
  done
  l=$(cut -d' ' -f1-3 /proc/loadavg)
  $K/bin/llama-bench -m $M -t 1 -fa 1 -p 0 -n 64 -d 512 -r 2 -o json 2>/dev/null | jq -c --arg r $r --arg l "$l" '.[] | {variant:"llama", round:$r, loadavg:$l, test:"tg64@512", ts:.avg_ts}'
done
