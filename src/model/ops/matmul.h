/*
 * matmul.h - batch-invariant matrix products for the model: y[m, n] = sum_k x[m, k] w[n, k].
 * Owns: the CPU GEMM/GEMV kernels (AVX2/FMA with a scalar twin) and the optional BLAS path.
 * Must not: depend on M, on tiling, or on the thread count in any output bit.
 *
 * Reduction order of every output element (both paths, so SIMD == scalar bit for bit):
 *   8 partial sums s[j] (j = k mod 8) over k < K8 = K & ~7, each s[j] = fma(x, w, s[j])
 *   in ascending k from 0; then ((s0+s4)+(s2+s6)) + ((s1+s5)+(s3+s7)); then k >= K8 in
 *   ascending order with fma; then + bias[n] if any.
 * Weights are [n, k] row-major (the Hugging Face layout) in f32, f16 or bf16, read in place.
 */
#ifndef TQKV_MATMUL_H
#define TQKV_MATMUL_H

#include <stddef.h>
#include <stdint.h>

typedef enum { MM_F32 = 0, MM_F16, MM_BF16 } mm_type;

typedef struct {
    const void  *data;   /* [n, k] elements of `type` */
    mm_type      type;
    int          n, k;
    const float *f32;    /* optional f32 copy [n, k] for the BLAS path (NULL if none) */
    int          packed; /* bf16 only: [n/8][k/16][8][16] (8 rows' 16-blocks interleaved, so a
                            GEMV streams one contiguous run; same math, same bits) */
    const float *f32p;   /* optional, bf16 with k % 16 == 0: the same values as f32 [n, k] with
                            each 16-block pair-permuted (evens then odds, like x for bf16). The
                            f32 kernels on it follow the bf16 order exactly, so products with
                            many rows use it (1.5-1.8x the FLOP rate) with the same bits. */
    int          bf16_act; /* packed bf16 only, and only where the CPU has AVX512_BF16: the
                            activations are rounded to bf16 and the products run as bf16 dot
                            products (vdpbf16ps, f32 sums; matmul_avx512.c): NOT the f32
                            numerics above, but batch invariant all the same. Elsewhere
                            ignored (the exact path runs). */
} mm_weight;

/* y [m, n] = x [m, k] . w^T (+ bias [n] if not NULL). threads >= 1. Batch invariant.
 * scratch: NULL or [m, k] floats the call may overwrite (bf16 weights use it for a
 * permuted copy of x; without it the call allocates). */
void mm_matmul(const float *x, int m, const mm_weight *w, const float *bias, float *y,
               int threads, float *scratch);
/* Same with y rows ldy floats apart (ldy >= n): writes y[i * ldy + j], j < n. */
void mm_matmul_ld(const float *x, int m, const mm_weight *w, const float *bias, float *y,
                  size_t ldy, int threads, float *scratch);
/* Same with the scalar kernel only (reference; bitwise equal to mm_matmul). */
void mm_matmul_scalar(const float *x, int m, const mm_weight *w, const float *bias, float *y,
                      int threads);
/* cblas_sgemm on w->f32 (must be set); not batch invariant. */
void mm_matmul_blas(const float *x, int m, const mm_weight *w, const float *bias, float *y,
                    size_t ldy, int threads);

/* Packing (bf16, n % 8 == 0, k % 16 == 0): dst [n * k] gets w in the packed layout. */
int   mm_can_pack(const mm_weight *w);
void  mm_pack(const mm_weight *w, uint16_t *dst, int threads);

/* f32 pair-permuted copy for w->f32p: dst [n * k] (bf16, k % 16 == 0). */
int   mm_can_f32p(const mm_weight *w);
void  mm_make_f32p(const mm_weight *w, float *dst, int threads);
/* Rows from which products use w->f32p when present. */
#define MM_F32P_MIN_ROWS 8

/* Columns [n0, n1) of every row of y [m, ldy] from x (the range function's own layout). */
typedef void (*mm_range_fn)(const float *x, int m, const mm_weight *w, const float *bias,
                            float *y, size_t ldy, int n0, int n1);
/* fn over all N columns, split into items of whole units (the tile width fn needs) run by
 * `threads` threads of the compute pool (util/pool.h); small products run on the caller.
 * The split never changes a bit: every range function computes each element alone. */
void  mm_run_split(mm_range_fn fn, const float *x, int m, const mm_weight *w,
                   const float *bias, float *y, size_t ldy, int threads, int unit);

/* Element conversion helpers (any layout). */
float mm_weight_at(const mm_weight *w, int n, int k);
/* Row n of w to floats: out [k]. */
void  mm_weight_row(const mm_weight *w, int n, float *out);

#endif
