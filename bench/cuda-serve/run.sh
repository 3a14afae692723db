#!/bin/bash
# run.sh - the GPU serving benchmark of issue 22 (device run, in a scripts/cuda_pack.sh folder
# that holds loadgen.py, extend_tokenizer.py and cuda_make_llama8b.py):
#  - the Llama-3.1-8B-shaped random checkpoint made here (cuda_make_llama8b.py, 16 GB, never
#    committed), given TOKSRC's tokenizer padded to its vocab (extend_tokenizer.py);
#  - one `tqkv serve --device cuda` per KV format in KVS, all up at once (each with
#    --kv-budget BUDGET, so neither takes the other's memory), the load sets in SETS run
#    against each server in turn, set by set (interleaved);
#  - every point is one loadgen.py JSON line in $OUT/serve.jsonl (+ the servers' logs).
# SETS: "RATE:INPUT:OUTPUT:REQUESTS ..." (RATE inf = burst).
# SEQ=1: one server at a time instead (each has the card to itself: its --kv-budget BUDGET is
#   the only KV on the device), its sets run back to back, then the next format's server.
# SERVE_ARGS: extra `tqkv serve` arguments for every server (e.g. "--prefill-chunk 2048").
#   Usage: cd PACK && OUT=$OUT [KVS="f32 tq4"] [SETS=...] [BUDGET=40G] [PAR=128] [SEQ=1] \
#          bash run.sh TOKSRC_MODEL_DIR
set -u -o pipefail
TOKSRC=${1:?tokenizer source model dir}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
KVS=${KVS:-f32 tq4}; BUDGET=${BUDGET:-40G}; PAR=${PAR:-128}
SETS=${SETS:-2:1024:512:30 8:1024:512:60 inf:1024:512:80 inf:8192:512:16}
export PATH=$PATH:/usr/local/cuda/bin LD_LIBRARY_PATH=$PWD/lib:/usr/local/cuda/lib64
B=/tmp/llama8b; LOG=$OUT/run.log
{ date -u; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total --format=csv; } >"$LOG" 2>&1
t0=$SECONDS
[ -f $B/model.safetensors.index.json ] || python3 cuda_make_llama8b.py $B >>"$LOG" 2>&1
python3 extend_tokenizer.py "$TOKSRC" $B >>"$LOG" 2>&1
echo "checkpoint ready +$((SECONDS - t0))s" >>"$LOG"
declare -A PORT PID
serve_up() {   # serve_up KV: start its server, wait for its port
  local kv=$1; rm -f /tmp/pf.$kv
  ./tqkv serve --device cuda --model $B --kv $kv --parallel $PAR --queue 4096 --kv-budget $BUDGET \
    --prefix-cache 0 --port 0 --port-file /tmp/pf.$kv ${SERVE_ARGS:-} >"$OUT/serve_$kv.log" 2>&1 &
  PID[$kv]=$!
}
serve_wait() {
  local kv=$1
  for i in $(seq 600); do [ -s /tmp/pf.$kv ] && break; sleep 0.2; done
  PORT[$kv]=$(cat /tmp/pf.$kv 2>/dev/null)
  echo "server $kv port ${PORT[$kv]} +$((SECONDS - t0))s" >>"$LOG"
}
run_set() {   # run_set KV RATE:INPUT:OUTPUT:REQUESTS
  local kv=$1 rate inp outp n; IFS=: read -r rate inp outp n <<<"$2"
  [ -n "${PORT[$kv]}" ] || return
  timeout 400 python3 loadgen.py --url http://127.0.0.1:${PORT[$kv]} --requests $n --rate $rate \
    --input $inp --output $outp --label "$kv" --id-hi 8000 >>"$OUT/serve.jsonl" 2>>"$LOG"
  echo "set $2 kv $kv rc=$? +$((SECONDS - t0))s" >>"$LOG"
}
if [ "${SEQ:-0}" = 1 ]; then
  for kv in $KVS; do
    serve_up $kv; serve_wait $kv
    for s in $SETS; do run_set $kv $s; done
    kill ${PID[$kv]} 2>/dev/null; wait ${PID[$kv]} 2>/dev/null
  done
else
  for kv in $KVS; do serve_up $kv; done
  for kv in $KVS; do serve_wait $kv; done
  for s in $SETS; do for kv in $KVS; do run_set $kv $s; done; done
fi
for kv in $KVS; do kill ${PID[$kv]} 2>/dev/null; done
wait
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >>"$LOG" 2>&1
