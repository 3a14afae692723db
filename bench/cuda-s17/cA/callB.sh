#!/bin/bash
# session 17, call B: (H200 only) the 8B 1-row decode, then issue 22's serving sets at
# request rates 8 and 2 (input 1024 / output 512, 300 requests) for tq4 and fp8, one server
# at a time (SEQ=1); bf16 KV (f32) follows in call C (KVS=f32) on the same warm machine.
set -u
for f in *.xz; do [ -f "$f" ] && xz -d "$f"; done; chmod +x tqkv test_* 2>/dev/null
export PATH=$PATH:/usr/local/cuda/bin LD_LIBRARY_PATH=$PWD/lib:/usr/local/cuda/lib64
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total --format=csv | tee $OUT/gpu.txt
B=/tmp/llama8b
[ -f $B/model.safetensors.index.json ] || python3 cuda_make_llama8b.py $B 2>&1 | tail -2
if grep -q H200 $OUT/gpu.txt; then
  timeout 120 ./tqkv bench model --device cuda --model $B --ctx 4096 --kv tq4,f32 --rows 1 --gen 32 --reps 2 \
    --fill synthetic --shape llama-8b --json >$OUT/e2e8b.json 2>$OUT/e2e8b.err; grep "^4096" $OUT/e2e8b.err
fi
mkdir -p $OUT/sv
OUT=$OUT/sv SEQ=1 KVS="${KVS:-tq4 fp8}" SETS="8:1024:512:300 2:1024:512:300" timeout $((${TEND:-570} - SECONDS)) bash run.sh ../../models/qwen3-code-28m
grep -v loadgen $OUT/sv/run.log
