#!/bin/bash
# session 17, command 1: the GEMM tiles (quick: bits, one round, ncu), then serving tq4 / fp8.
# Everything lands in /tmp/o17 (tarred into $OUT/all.tgz at the end; <= 8 files come back).
O=/tmp/o17; rm -rf $O; mkdir -p $O/a $O/b
ROUNDS=1 OUT=$O/a timeout 150 bash callA.sh quick
cp $O/a/cA17.log $OUT/ 2>/dev/null; (cd /tmp/tqkv_cA17 && tar czf $O/a/results.tgz .)
OUT=$O/b TEND=$((570 - SECONDS)) bash callB.sh
cp $O/b/sv/serve.jsonl $O/b/sv/run.log $OUT/ 2>/dev/null
tar czf $OUT/all.tgz -C $O .
