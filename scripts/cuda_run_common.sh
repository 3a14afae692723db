# cuda_run_common.sh - sourced by cuda_model_device.sh and cuda_e2e_device.sh (in a
# scripts/cuda_pack.sh folder on the device): NAME=<run name> before sourcing.
# Sets OUT, the work folder W=/tmp/tqkv_$NAME, LOG=$W/$NAME.log (GPU name and clocks,
# missing libraries), the library path (./lib; /usr/local/cuda/lib64 for cuBLAS, which
# --fast-gemm dlopens), and step: `step SECONDS NAME CMD...` runs CMD under timeout, logs
# its status and time, and packs W into $OUT/results.tgz (+ $OUT/$NAME.log) after each step,
# so a run cut short still returns what it did.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=/tmp/tqkv_$NAME; rm -rf "$W"; mkdir -p "$W"
export PATH=$PATH:/usr/local/cuda/bin LD_LIBRARY_PATH=$PWD/lib:/usr/local/cuda/lib64
# libnccl.so.2 (the CUDA builds link it for tensor parallelism's NCCL backend): the toolkit's
# lib/ here, else PyTorch's nvidia-nccl wheel
for d in /usr/local/cuda/lib $(python3 -c "import nvidia.nccl, os; print(os.path.join(os.path.dirname(nvidia.nccl.__file__), 'lib'))" 2>/dev/null); do
  [ -f "$d/libnccl.so.2" ] && { LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d; break; }
done
LOG=$W/$NAME.log
{ date -u; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv; } >"$LOG" 2>&1
ldd ./tqkv | grep -i "not found" >>"$LOG" && echo "MISSING LIBRARIES" >>"$LOG"
step() { local s=$1 name=$2; shift 2; local t0=$SECONDS; timeout "$s" "$@"; local rc=$?
         echo "$name rc=$rc ${SECONDS}s (+$((SECONDS - t0))s)" >>"$LOG"
         tar czf "$OUT/results.tgz" -C "$W" . ; cp "$LOG" "$OUT/$NAME.log"; }
