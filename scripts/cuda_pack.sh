#!/bin/bash
# cuda_pack.sh - bundle the CUDA-enabled binaries built HERE (tqkv, test_cuda) with the
# shared libraries they need into DEST, for a device machine whose image has the CUDA
# toolkit and PyTorch but not the project's Debian -dev packages (see cuda_device.sh).
# libopenblas is replaced by a stub that aborts if called: the GPU attention benchmark and
# the kernel tests never call BLAS (only the CPU model forward does), and the real library
# is too large to carry. LEAN=1 leaves out libstdc++ and libgcc_s (the binaries need only
# GLIBCXX_3.4; the device image has both) when the working tree nears the 64 MiB a device
# run carries.   Usage: [LEAN=1] scripts/cuda_pack.sh BUILD_DIR DEST
set -eu
BUILD=${1:?build dir}; DEST=${2:?dest}
mkdir -p "$DEST/lib"
cp "$BUILD/tqkv" "$BUILD/test_cuda" "$DEST/" && strip "$DEST/tqkv" "$DEST/test_cuda"
for t in test_cuda_model test_cuda_hybrid test_cuda_gemma4 test_cuda_slide test_cuda_moe test_cuda_tp; do
  if [ -f "$BUILD/$t" ]; then cp "$BUILD/$t" "$DEST/" && strip "$DEST/$t"; fi
done
cp scripts/cuda_tiles_device.sh scripts/cuda_step_profile.sh scripts/ncu_step_table.py scripts/cupti_step_table.py scripts/cuda_anchor.py scripts/cuda_gemm_anchor.py scripts/cuda_run_common.sh scripts/cuda_device.sh scripts/cuda_seed_sweep.sh scripts/cuda_model_device.sh scripts/cuda_tp_device.sh scripts/cuda_hybrid_device.sh scripts/cuda_gemma4_device.sh scripts/cuda_d256_device.sh scripts/cuda_fp8_device.sh scripts/cuda_tq3_probe_device.sh scripts/cuda_gemm_device.sh scripts/cuda_e2e_device.sh scripts/cuda_make_llama8b.py scripts/cuda_prefill_device.sh scripts/cuda_session_device.sh scripts/cuda_decode_ab_device.sh scripts/cuda_moe_device.sh scripts/cuda_make_qwen3moe30b.py bench/cuda-serve/loadgen.py bench/cuda-serve/extend_tokenizer.py bench/cuda-serve/run.sh "$DEST/"
# the one-token GEMM probe (dev/experiments/kchunk_probe.cu), where this host has nvcc
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
if [ -x "$NVCC" ]; then
  "$NVCC" -O3 -gencode arch=compute_90a,code=sm_90a -o "$DEST/kchunk_probe" dev/experiments/kchunk_probe.cu
fi
# the kernel tracer (scripts/cupti_trace.c; cuda_step_profile.sh TRACE=1) and its libcupti,
# where this host's toolkit has CUPTI
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}
CUPTI_LIB=$(ls "$CUDA_HOME"/lib/libcupti.so.* "$CUDA_HOME"/lib64/libcupti.so.* "$CUDA_HOME"/extras/CUPTI/lib64/libcupti.so.* 2>/dev/null | head -1)
if [ -f "$CUDA_HOME/include/cupti.h" ] && [ -n "$CUPTI_LIB" ]; then
  gcc -shared -fPIC -O2 -I"$CUDA_HOME/include" -o "$DEST/cupti_trace.so" scripts/cupti_trace.c \
    -L"$(dirname "$CUPTI_LIB")" -lcupti && cp -L "$CUPTI_LIB" "$DEST/lib/"
fi
LIBS="libcjson.so.1 libcmocka.so.0 libpcre2-8.so.0 libutf8proc.so.2 libgomp.so.1 libz.so.1 libmicrohttpd.so.12"
[ "${LEAN:-0}" = 1 ] || LIBS="$LIBS libstdc++.so.6 libgcc_s.so.1"
for l in $LIBS; do
  p=$(ldd "$BUILD/tqkv" "$BUILD/test_cuda" | awk -v l=$l '$1 == l {print $3; exit}')
  [ -n "$p" ] && cp -L "$p" "$DEST/lib/$l"
done
cat > "$DEST/lib/openblas_stub.c" <<'C'
#include <stdio.h>
#include <stdlib.h>
void cblas_sgemm(void) { fprintf(stderr, "openblas stub: BLAS is not available here\n"); abort(); }
void openblas_set_num_threads(int n) { (void)n; }
C
gcc -shared -fPIC -o "$DEST/lib/libopenblas.so.0" "$DEST/lib/openblas_stub.c"
du -sh "$DEST"
