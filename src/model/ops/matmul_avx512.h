/*
 * matmul_avx512.h - AVX-512 kernels behind mm_matmul (matmul.c picks them at run time).
 * Owns: the AVX-512 paths for packed bf16 weights (the layout of matmul.h: [n/8][k/16][8][16]).
 * Must not: be called unless tqkv_cpu_has_avx512() (exact) / tqkv_cpu_has_avx512_bf16()
 * (bf16 activations) holds, nor on weights that are not packed bf16.
 */
#ifndef TQKV_MATMUL_AVX512_H
#define TQKV_MATMUL_AVX512_H

#include <stddef.h>

#include "model/ops/matmul.h"

/* Exact path: columns [n0, n1) (multiples of 8) of every row of y = xp . w^T (+ bias), xp
 * pair-permuted as for the AVX2 bf16 kernels. Each output element follows matmul.h's order
 * to the bit: the same bits as the AVX2 and scalar kernels. */
void mm512_range_exact(const float *xp, int m, const mm_weight *w, const float *bias, float *y,
                       size_t ldy, int n0, int n1);

/* bf16-activation path (w->bf16_act): x rounded to bf16 (nearest even), then per output
 * element 8 lanes, lane l summing with vdpbf16ps the pairs (16b + 2l, 16b + 2l + 1) over
 * the 16-blocks b in ascending order from 0; then ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7));
 * then + bias. Batch invariant (nothing depends on M, the tile or the thread split).
 * scratch: NULL or [m, k] floats (room for the bf16 copy of x). 0 without memory (y
 * untouched), else 1. */
int mm512_matmul_bf16(const float *x, int m, const mm_weight *w, const float *bias, float *y,
                      size_t ldy, int threads, float *scratch);

#endif
