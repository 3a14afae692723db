#!/bin/bash
# session 17, command 2 (the same warm machine): serving bf16 KV (f32), then the MoE / 8B
# one-row steps under forced tiles. Results in /tmp/o17c -> $OUT/all2.tgz (+ 3 small files).
O=/tmp/o17c; rm -rf $O; mkdir -p $O/a $O/b
KVS=f32 OUT=$O/b TEND=${TSERVE:-250} bash callB.sh
cp $O/b/sv/serve.jsonl $OUT/serve2.jsonl; cp $O/b/sv/run.log $OUT/run2.log
ROUNDS=1 OUT=$O/a timeout $((575 - SECONDS)) bash callA.sh steps
(cd /tmp/tqkv_cA17 && tar czf $O/a/results.tgz .); cp $O/a/cA17.log $OUT/cA17_steps.log
tar czf $OUT/all2.tgz -C $O .
