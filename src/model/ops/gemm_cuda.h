/*
 * gemm_cuda.h - the GPU forward's batch-invariant GEMM, C-callable:
 *     y[T, N] = x[T, K] . W[N, K]^T (+ bias[N])
 * x f32, W bf16 (stored as uint16_t), y f32, on tensor cores (mma.sync m16n8k16 bf16,
 * f32 accumulate).
 * Owns: the split of each activation into two bf16 parts (x = hi + lo, |x - hi - lo| <=
 * 2^-17 |x|: two MMAs per weight fragment, so activations keep ~16 significant bits where a
 * plain bf16 GEMM keeps 8), the fragment-ordered activation buffer, and the fixed
 * reduction order below.
 * Must not: let one output element's arithmetic depend on T, on the token's place in a tile
 * or on the other rows.
 *
 * Reduction order (the batch-invariance contract): K is cut into segments of
 * GEMM_CUDA_SEG values. Inside a segment the k32 blocks are dealt to GEMM_CUDA_KW warps
 * round robin, each warp accumulating its blocks in ascending order (hi then lo per
 * k16 step), and the warps' sums are added in warp order. Segments are then added left to
 * right (s0 + s1 + ... ), and the bias last. Whether the segments are summed inside one
 * CTA (T > 32) or written as partials and folded by a second kernel (T <= 32, for
 * parallelism), and whether a warp keeps the four warps' sums itself (the tiled kernel, T >=
 * GEMM_CUDA_TILED_T, and per segment for GEMM_CUDA_SEG_TILED_T <= T <= 32: tiles staged in
 * shared memory), changes nothing in that order, so a row's outputs are bitwise the same for
 * every T. test_cuda_model checks it.
 */
#ifndef TQKV_GEMM_CUDA_H
#define TQKV_GEMM_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "tqkv.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GEMM_CUDA_SEG 1024 /* k values per reduction segment */
#define GEMM_CUDA_KW 4     /* warps sharing one segment's k32 blocks */
#define GEMM_CUDA_SPLIT_T 32 /* T at or below which segments run in separate CTAs */
#define GEMM_CUDA_TILED_T 128 /* T from which the kernel stages tiles in shared memory */
#define GEMM_CUDA_SEG_TILED_T 17 /* T from which segments (T <= 32) are staged tiles too */

/* Scratch bytes for a GEMM of up to T tokens, K <= kmax, N <= nmax:
 * xf: fragment-ordered activations; part: segment partials (T <= GEMM_CUDA_SPLIT_T). */
TQKV_API size_t tqkv_cuda_gemm_xf_bytes(size_t T, size_t kmax);
TQKV_API size_t tqkv_cuda_gemm_part_bytes(size_t nmax, size_t kmax);

/* y[t * ldy + n] = sum_k x[t * ldx + k] w[n * K + k] (+ bias[n]) for t < T, n < N.
 * All pointers are device memory; K % 8 == 0; xf / part as sized above (part may be NULL
 * when T > GEMM_CUDA_SPLIT_T). Asynchronous on `stream` (a cudaStream_t; NULL: the legacy
 * default stream); allocates nothing and never waits, so it can be captured in a graph. */
TQKV_API tqkv_status tqkv_cuda_gemm(const float *x, size_t ldx, int T, const uint16_t *w, int N,
                                    int K, const float *bias, float *y, size_t ldy, void *xf,
                                    float *part, void *stream);

/* 1 when the tiled kernel serves T >= GEMM_CUDA_TILED_T and GEMM_CUDA_SEG_TILED_T <= T <= 32
 * (0: TQKV_GEMM_TILED=0 in the environment, or the device refused its shared memory). */
TQKV_API int tqkv_cuda_gemm_tiled(void);

#ifdef __cplusplus
}
#endif

#endif
