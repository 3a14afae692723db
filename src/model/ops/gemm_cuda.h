/*
 * gemm_cuda.h - the GPU forward's batch-invariant GEMM, C-callable:
 *     y[T, N] = x[T, K] . W[N, K]^T (+ bias[N])
 * x f32, W bf16 (stored as uint16_t), y f32, on tensor cores (mma.sync m16n8k16 bf16,
 * f32 accumulate).
 * Owns: the activations' bf16 form (one part: x rounded to bf16, as every bf16 engine does;
 * two parts: x = hi + lo, |x - hi - lo| <= 2^-17 |x|, two MMAs per weight fragment, so the
 * activations keep ~16 significant bits, the CPU's exact class), the shared-memory tiles
 * and the fixed reduction order below.
 * Must not: let one output element's arithmetic depend on T, on the token's place in a tile,
 * on the tile shape or on the other rows.
 *
 * Reduction order (the batch-invariance contract): one running f32 sum per output, starting
 * at 0, to which the k16 steps of K are added in ascending order, each step one mma (the
 * hi part) or two (hi, then lo); the bias last. No split of K, no partials, no fold. The
 * tile shape (picked from T and N for speed: small tiles for decode, 128 x 128 and 128 x
 * 256 for prefill) decides which CTA and warp computes an output, never its arithmetic: the weight
 * rows are always the mma's A operand and the tokens its B operand, at the same fragment
 * places for the same k. So a row's outputs are bitwise the same for every T;
 * test_cuda_model checks it across every tile shape.
 */
#ifndef TQKV_GEMM_CUDA_H
#define TQKV_GEMM_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "tqkv.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GEMM_CUDA_SMALL_T 64 /* T at or below which decode tiles (32 weight rows) run */

/* Scratch bytes for a GEMM of up to T tokens and K <= kmax: the activations' bf16 parts
 * [parts, T, K] (room for two parts). */
size_t tqkv_cuda_gemm_xf_bytes(size_t T, size_t kmax);

/* y[t * ldy + n] = sum_k x[t * ldx + k] w[n * K + k] (+ bias[n]) for t < T, n < N.
 * All pointers are device memory, w and xf 16-byte aligned (the tiles copy 16 bytes at a
 * time; an address off 16 is refused with TQKV_EINVAL); K % 8 == 0; xf as sized above; parts 1 (bf16
 * activations) or 2 (hi + lo). Asynchronous on `stream` (a cudaStream_t; NULL: the legacy
 * default stream); allocates nothing and never waits, so it can be captured in a graph. */
tqkv_status tqkv_cuda_gemm(const float *x, size_t ldx, int T, const uint16_t *w, int N,
                           int K, const float *bias, float *y, size_t ldy, void *xf,
                           int parts, void *stream);

/* tqkv_cuda_gemm whose activations are already in xf: the kernel before it wrote x's split
 * [parts, T, K] (element i of token t: hi at t K + i, lo at T K + t K + i; gemm_cuda.cu's
 * split, element for element: ops_cuda.cuh's mc_split_store), so no split launch runs.
 * The same bits as tqkv_cuda_gemm on that x. pdl: a Programmatic Dependent Launch (sm_90):
 * the kernel starts while the one before it on the stream still runs, streams its first
 * weight stages and waits for that kernel's completion before it reads xf or writes y (a
 * plain launch if the runtime refuses the attribute); 0: a plain launch. The same bits. */
tqkv_status tqkv_cuda_gemm_presplit(int T, const uint16_t *w, int N, int K, const float *bias,
                                    float *y, size_t ldy, const void *xf, int parts, int pdl,
                                    void *stream);

/* 1 when the current device takes a programmatic (PDL) launch on `stream` (a cudaStream_t;
 * tried with a tiny kernel and synchronized, so never while the stream is captured), else 0. */
int tqkv_cuda_gemm_pdl_probe(void *stream);

/* tqkv_cuda_gemm_grouped whose activations are already in xf (x's split [parts, T, K], as
 * for tqkv_cuda_gemm_presplit): no split launch; the same bits. pdl: a programmatic launch
 * (util/cuda_pdl.cuh: every CTA waits before it reads the groups). */
tqkv_status tqkv_cuda_gemm_grouped_presplit(int T, const uint16_t *w, size_t wstride, int N, int K,
                                            float *y, size_t ldy, const int32_t *groups, int G,
                                            int max_rows, const void *xf, int parts, int pdl,
                                            void *stream);

/* G GEMMs over row groups of one x [T, K] (one split, one launch; the experts of a
 * mixture-of-experts layer): group g, groups[4 g ..] = {row0, rows, matrix, unused} (device
 * int32, 16-byte aligned), computes y[t * ldy + n] = sum_k x[t * ldx + k] w_g[n * K + k] for
 * row0 <= t < row0 + rows, with w_g = w + matrix * wstride ([N, K] each; wstride % 8 == 0,
 * so every w_g is 16-byte aligned as tqkv_cuda_gemm wants of w); no bias. Every
 * output's arithmetic is tqkv_cuda_gemm's (bitwise what G separate calls on the groups' rows
 * give). max_rows: the most rows of a group (<= T, sizes the grid); xf sized for T rows. */
tqkv_status tqkv_cuda_gemm_grouped(const float *x, size_t ldx, int T, const uint16_t *w,
                                   size_t wstride, int N, int K, float *y, size_t ldy,
                                   const int32_t *groups, int G, int max_rows, void *xf,
                                   int parts, void *stream);

/* A gated MLP's activation in a grouped GEMM's epilogue (tqkv_cuda_gemm_grouped_act). */
enum { TQKV_GEMM_ACT_SILU = 1, TQKV_GEMM_ACT_GELU = 2 };
typedef struct {
    int    act;  /* TQKV_GEMM_ACT_SILU: gate / (1 + exp(-gate)) up with the CPU's exp (ops.c);
                  * TQKV_GEMM_ACT_GELU: gelu_tanh(gate) up (ops_cuda.cuh: mc_silu_mul, mc_gelu_mul) */
    float *h;    /* [T, N / 2] the activation, row t at h + t ldh */
    size_t ldh;
    void  *hf;   /* h's GEMM split [parts, T, N / 2] (16-byte aligned; ldh == N / 2), or NULL */
} tqkv_gemm_act;

/* tqkv_cuda_gemm_grouped over gate | up matrices (w_g [N, K] = gate rows 0 .. N / 2, then up
 * rows, as stored; N % 16 == 0) with the gated activation as the epilogue: h[t, i] =
 * act(gate_i . x_t) * (up_i . x_t), each product's arithmetic tqkv_cuda_gemm's, so the same
 * bits as the grouped GEMM into y [T, N] followed by the activation kernel. The tiles read
 * the weight rows in an order that puts gate row i and up row i in one thread (gemm_cuda.cu's
 * gemm_wrow): no second matrix layout. x NULL: xf already holds x's split (the presplit form,
 * pdl as there); else x [T, ldx] is split into xf first. */
tqkv_status tqkv_cuda_gemm_grouped_act(const float *x, size_t ldx, int T, const uint16_t *w,
                                       size_t wstride, int N, int K, const tqkv_gemm_act *a,
                                       const int32_t *groups, int G, int max_rows, void *xf,
                                       int parts, int pdl, void *stream);

/* The tile shape tqkv_cuda_gemm picks for T tokens, N outputs and `parts` ("s8t" / "s8n", "s8" ..
 * "s32", "s32w" / "s64w" (T 33 .. 64; "s64" by name only), "m", "l", "xl", and on sm_90a the
 * warpgroup tiles "wl", "wxl" and their TMA-fed twins "tl", "txl", which the pick takes in
 * their place unless TQKV_GEMM_TMA=0, and the clustered "cxl" (TQKV_GEMM_TMA=2 picks it for
 * "wxl"); two parts take "l" / "wl" / "tl" for "xl" / "wxl" / "txl" / "cxl"): for benchmarks
 * and the tests' coverage. "s8t" (s8n fed by the copy engine: the one-token pick where N / 16
 * CTAs leave an SM at most one, else s8n) is s8n in a build without sm_90a and in the
 * grouped launch.
 * A TMA tile whose tensor map can't be made (no encoder) runs as wl / wxl (s8t as s8n), and
 * cxl with an odd count of 128-row weight tiles as txl (the same bits), under its own name
 * here. */
const char *tqkv_cuda_gemm_tile(int T, int N, int parts);

/* The launches of a TMA tile (tl, txl, cxl) in this process so far, and in *clustered (when
 * not NULL) those of cxl: for the tests, to tell a TMA tile that ran from one that fell back
 * to wl / wxl (no tensor map) or cxl to txl. 0 in a build without sm_90a. */
unsigned long tqkv_cuda_gemm_tma_runs(unsigned long *clustered);

/* Make every later call take the named tile shape (NULL: the pick by T and N again), as
 * TQKV_GEMM_TILE does: for the tests (every shape must give the same bits) and A/B
 * benchmarks. TQKV_EINVAL for an unknown name. Not for use while GEMMs run on other threads. */
tqkv_status tqkv_cuda_gemm_set_tile(const char *name);

#ifdef __cplusplus
}
#endif

#endif
