/*
 * gemm_cublas.h - the GPU forward's fast GEMM, NOT batch invariant (opt-in:
 * tqkv_model_state_params.device_fast_gemm): y[T, N] = x[T, K] . W[N, K]^T (+ bias) through
 * cuBLAS's bf16 GEMM with f32 accumulate, the activations rounded to bf16 first.
 * Owns: loading cuBLAS at run time (dlopen of libcublas.so.13 / .12 / .so: the library links
 * nothing new, and a machine without cuBLAS still runs the invariant path), one handle per
 * user, the f32 -> bf16 conversion and the bias add.
 * Must not: be used where a row's logits must not depend on the batch (the serving
 * engine): cuBLAS picks its kernel, tile and split-K by T (scripts/cuda_gemm_anchor.py
 * records where row 0 of a batch differs from row 0 alone).
 */
#ifndef TQKV_GEMM_CUBLAS_H
#define TQKV_GEMM_CUBLAS_H

#include <stddef.h>
#include <stdint.h>

#include "tqkv.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gemm_cublas gemm_cublas;

/* Load cuBLAS (once per process) and make a handle whose work runs on `stream` (a
 * cudaStream_t; NULL: the legacy default stream) with a workspace of its own
 * (GEMM_CUBLAS_WS bytes, so a GEMM captured into a CUDA graph allocates nothing);
 * TQKV_EUNSUPPORTED with the dlopen error when the library is not there. */
#define GEMM_CUBLAS_WS ((size_t)32 << 20) /* cuBLAS's recommendation for Hopper */
tqkv_status gemm_cublas_init(gemm_cublas **out, void *stream);
void        gemm_cublas_free(gemm_cublas *c);
/* scratch: device memory of at least T * K * 2 bytes (the bf16 activations). Asynchronous
 * on the handle's stream. */
tqkv_status gemm_cublas_run(gemm_cublas *c, const float *x, size_t ldx, int T, const uint16_t *w,
                            int N, int K, const float *bias, float *y, size_t ldy, void *scratch);

#ifdef __cplusplus
}
#endif

#endif
