/*
 * codec_cuda_encode.cuh - the CUDA codec's encode of one vector by one warp (header-only),
 * shared by the encode kernel (codec_cuda.cu) and kernels of higher layers that compute K and
 * V in registers and encode them in place (the common graph's decode: forward_cuda.cu's
 * qkv_post_enc_kernel, through the cache's tqkv_cuda_kv_append_begin).
 * Owns: the kernel's codec form (ce_codec), an append's parameters (ce_args), the tq part's
 * float64 norm, indices, scale and packing (ce_tq_store: codec_encode's bytes) and one
 * vector's store into its plane (ce_encode_vec).
 * Must not: decide row state or know the cache's structs (cache_cuda.cu fills ce_args).
 */
#ifndef TQKV_CODEC_CUDA_ENCODE_CUH
#define TQKV_CODEC_CUDA_ENCODE_CUH

#include <cuda_bf16.h>
#include <math.h>

#include "codec/codec_cuda.cuh"
#include "codec/codec_cuda_params.h"

// ---------------------------------------------------------------------------
// Scalar pieces (ports of src/codec/codec.c)
// ---------------------------------------------------------------------------
/* f64_to_f16_sat of codec.c: one RNE rounding through round-to-odd binary32. */
__device__ static inline uint16_t ce_f64_to_f16_sat(double s) {
    if (s != s) return 0x7e00u;
    if (s >= 65504.0) return 0x7bffu;
    float t = __double2float_rn(s);
    if ((double)t > s) t = nextafterf(t, 0.0f);
    if ((double)t != s) t = __uint_as_float(__float_as_uint(t) | 1u);
    return cw_f32_to_f16(t);
}

__device__ static inline int ce_round_half_away(double v) {
    const int r = (int)v;
    const double f = v - (double)r;
    return r + (f >= 0.5) - (f <= -0.5);
}

// ---------------------------------------------------------------------------
// An append's parameters and one vector's encode by one warp
// ---------------------------------------------------------------------------
/* The encode kernel's form of a codec (a few hundred bytes of parameters, every read a
 * constant-bank operand or one uniform load): the signs as bits (bit i of word w set: sign of
 * element 32 w + i is -1), the rest as in cuda_codec. */
struct ce_codec {
    float cent[16];
    float bounds[15];
    uint32_t sbits[CUDA_DIM_WIDE / 32];
    float inv;
    int bits;
};

/* Both planes of one append: x[0] / P[0] / C[0] = K, x[1] / P[1] / C[1] = V. */
struct ce_args {
    const float *x[2];           /* [rows, kvh, n, D] each */
    ce_plane P[2];
    ce_codec C[2];
    const cuda_row *rows;        /* [rows] */
    int nrows, kvh, n, cap, ring;
    int roles;                   /* warps per vector: 2 with a q8 window (its copy on a warp of its own), else 1 */
};

/* (a0 + a1) + (a2 + a3) of codec.c's four interleaved float64 accumulators over t [D]
 * (a_k = sequential sum of t[4 i + k], i ascending, from 0), on every lane: lane k < 4 runs
 * a_k's chain from shared memory, then lanes 0..3 combine through shuffles. t is written by
 * the whole warp before the call (this syncs the warp first). */
template <int D> __device__ inline double ce_sum4_smem(const double *t, int lane) {
    __syncwarp();
    double a = 0;
    if (lane < 4) {
#pragma unroll
        for (int i = 0; i < D / 4; i++) a = __dadd_rn(a, t[4 * i + lane]);
    }
    const double b = __shfl_xor_sync(0xffffffffu, a, 1);  /* lane 0: a1, lane 2: a3 */
    const double s = __dadd_rn(a, b);                     /* lane 0: a0 + a1, lane 2: a2 + a3 */
    const double s23 = __shfl_sync(0xffffffffu, s, 2);
    const double r = __shfl_sync(0xffffffffu, __dadd_rn(s, s23), 0);
    __syncwarp();                                         /* t may be written again */
    return r;
}

/* The tq part of one rotated vector xr (lane l holds elements E l .. E l + E - 1): the norm,
 * the indices, the norm-corrected fp16 scale, the index planes (out [pay], *scale). st, si:
 * the warp's shared scratch ([D] doubles, [D] bytes). */
template <int D>
__device__ inline void ce_tq_store(const float (&xr)[D / 32], const ce_codec &C, float cl, double *st,
                                   uint8_t *si, uint8_t *out, uint16_t *scale, int lane) {
    constexpr int E = D / 32;
    double t[E];
#pragma unroll
    for (int k = 0; k < E; k++) st[E * lane + k] = __dmul_rn((double)xr[k], (double)xr[k]);
    const double n2 = ce_sum4_smem<D>(st, lane);
    const double nn = sqrt(n2);
    const float inv = nn > 0 && nn <= 1e300 ? __double2float_rn(1.0 / nn) : 0.0f;
    const int L = 1 << C.bits;
    uint8_t idx[E];
#pragma unroll
    for (int k = 0; k < E; k++) {
        const float u = __fmul_rn(xr[k], inv);
        int q = 0;             /* bounds below u (ascending: the CPU's binary search) */
#pragma unroll
        for (int b = 0; b < 15; b++) q += (b < L - 1) & (u > C.bounds[b]);
        idx[k] = (uint8_t)q;
        const double c = __shfl_sync(0xffffffffu, cl, q);     /* C.cent[q] */
        t[k] = __dmul_rn(c, c);
    }
#pragma unroll
    for (int k = 0; k < E; k++) st[E * lane + k] = t[k];
    const double cn2 = ce_sum4_smem<D>(st, lane);
    // ---- pack ------------------------------------------------------------------
#pragma unroll
    for (int k = 0; k < E; k++) si[E * lane + k] = idx[k];
    __syncwarp();
    if (C.bits == 4) {           /* byte 16g + j: lo elem 32g + j, hi elem 32g + 16 + j */
#pragma unroll
        for (int e = 0; e < E / 2; e++) {
            const int B = (E / 2) * lane + e, g = B >> 4, j = B & 15;
            out[B] = (uint8_t)(si[32 * g + j] | (si[32 * g + 16 + j] << 4));
        }
    } else {                     /* 2-bit plane: byte 8g + j bits 2k = elem 32g + 8k + j */
#pragma unroll
        for (int e = 0; e < E / 4; e++) {
            const int B = (E / 4) * lane + e, g = B >> 3, j = B & 7;
            uint8_t by = 0;
#pragma unroll
            for (int k = 0; k < 4; k++) by |= (uint8_t)((si[32 * g + 8 * k + j] & 3) << (2 * k));
            out[B] = by;
        }
        if (C.bits == 3 && lane < E) { /* 1-bit plane: bit i of LE u32 at D / 4 + 4g */
            uint32_t w = 0;
            for (int b = 0; b < 32; b++) w |= (uint32_t)(si[32 * lane + b] >> 2) << b;
            uint8_t *hp = out + D / 4 + 4 * lane;
            hp[0] = (uint8_t)w; hp[1] = (uint8_t)(w >> 8);
            hp[2] = (uint8_t)(w >> 16); hp[3] = (uint8_t)(w >> 24);
        }
    }
    if (lane == 0) {
        uint16_t sc;
        if (!(nn > 0)) sc = nn == 0 ? 0 : 0x7e00u;
        else if (!(nn <= 1e300)) sc = 0x7c00u;
        else sc = ce_f64_to_f16_sat(nn / sqrt(cn2));
        *scale = sc;
    }
    __syncwarp();                /* si is read before the next vector writes it */
}

/* xr <- the sign flip and rotation of codec C (lane l holds elements E l .. E l + E - 1). */
template <int D>
__device__ __forceinline__ void ce_rotate(const ce_codec &C, float (&xr)[D / 32], int lane) {
    constexpr int E = D / 32;
    const uint32_t sw = C.sbits[(E * lane) >> 5];
    float s[E];
#pragma unroll
    for (int k = 0; k < E; k++) s[k] = (sw >> ((E * lane + k) & 31)) & 1u ? -1.0f : 1.0f;
    cw_rotate_n<E>(xr, s, C.inv, lane);
}

/* Vector xr (lane l holds elements E l .. E l + E - 1, E = D / 32; the original domain) into
 * plane P at `slot` (its row, head and column: ((r kvh + h) cap + col)): the bf16 copy, or
 * the sign flip and rotation by codec C, then ce_tq_store (cl: C.cent[lane & 15]; st, si: the
 * warp's shared scratch). xr is left rotated (tq). */
template <int D>
__device__ inline void ce_encode_vec(const ce_plane &P, const ce_codec &C, float cl, size_t slot,
                                     float (&xr)[D / 32], double *st, uint8_t *si, int lane) {
    constexpr int E = D / 32;
    if (P.bf16) {
        __nv_bfloat16 *o = reinterpret_cast<__nv_bfloat16 *>(P.data) + slot * D + E * lane;
#pragma unroll
        for (int k = 0; k < E; k++) o[k] = __float2bfloat16_rn(xr[k]);
        return;
    }
    ce_rotate<D>(C, xr, lane);
    ce_tq_store<D>(xr, C, cl, st, si, P.data + slot * P.pay, P.scales + slot, lane);
}

/* ce_args for an append of k and v [rows, kvh, n, d] into planes P (codec_cuda_encode's
 * parameters: the codecs of head_dim d, the rows' targets, the ring). */
void codec_cuda_encode_args(const float *k, const float *v, const ce_plane P[2],
                            const cuda_codec &k128, const cuda_codec &v128,
                            const cuda_codec256 &k256, const cuda_codec256 &v256, int d,
                            const cuda_row *rows, int nrows, int kvh, int n, int cap, int ring,
                            ce_args *A);

#endif
