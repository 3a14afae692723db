/*
 * codec_cuda.cu - GPU encode of the cache formats (the CUDA backend's append).
 * Owns: one launch for both planes of an append, one warp per vector (d = 128 or 256, a
 * template): sign flip + Walsh-Hadamard rotation, the tq2/3/4 quantizer with the
 * norm-corrected fp16 scale, bit packing into the planes of docs/FORMATS.md, and the q8 copy
 * of the rotated vector into the recent-window ring; the bf16 baseline's plain conversion. Bytes equal codec_encode's (same float64 norm
 * order, same comparisons, same rounding): tests/test_cuda.c compares every byte.
 * Must not: run attention, decide row state or know the cache's structs (cache_cuda.cu
 *   fills the kernel's parameters and calls codec_cuda_encode).
 */
#include <cuda_bf16.h>
#include <math.h>

#include "codec/codec_cuda.cuh"
#include "codec/codec_cuda_params.h"
#include "util/cuda_pdl.cuh"

// ---------------------------------------------------------------------------
// Scalar pieces (ports of src/codec/codec.c)
// ---------------------------------------------------------------------------
/* f64_to_f16_sat of codec.c: one RNE rounding through round-to-odd binary32. */
__device__ static uint16_t ce_f64_to_f16_sat(double s) {
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
// Encode kernel: K and V in one launch, one warp per vector
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

constexpr int CE_WARPS = 4;      /* warps (vectors in flight) per block */

/* (a0 + a1) + (a2 + a3) of codec.c's four interleaved float64 accumulators over t [D]
 * (a_k = sequential sum of t[4 i + k], i ascending, from 0), on every lane: lane k < 4 runs
 * a_k's chain from shared memory, then lanes 0..3 combine through shuffles. t is written by
 * the whole warp before the call (this syncs the warp first). */
template <int D> __device__ static double ce_sum4_smem(const double *t, int lane) {
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
__device__ static void ce_tq_store(const float (&xr)[D / 32], const ce_codec &C, float cl, double *st,
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

/* The q8 copy (ggml q8_0 on 32-value blocks) of the rotated vector xr into wq [D] and its
 * block scales ws [D / 32]. */
template <int D>
__device__ static void ce_q8_store(const float (&xr)[D / 32], int8_t *wq, uint16_t *ws, int lane) {
    constexpr int E = D / 32, LB = 32 / E;   /* LB: lanes per 32-value block (8 or 4) */
    float am = 0.0f;
#pragma unroll
    for (int j = 0; j < E; j += 4) { /* (d = 128: the one tree of four) */
        const float a4 = fmaxf(fmaxf(fabsf(xr[j]), fabsf(xr[j + 1])),
                               fmaxf(fabsf(xr[j + 2]), fabsf(xr[j + 3])));
        am = j ? fmaxf(am, a4) : a4;
    }
#pragma unroll
    for (int m = 1; m < LB; m <<= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, m));
    const float dq = __fdiv_rn(am, 127.0f);
#pragma unroll
    for (int k = 0; k < E; k++) {
        double q = dq != 0.0f ? (double)xr[k] / (double)dq : 0.0;
        if (q != q) q = 0.0;
        q = q < -127.0 ? -127.0 : q > 127.0 ? 127.0 : q;
        wq[E * lane + k] = (int8_t)ce_round_half_away(q);
    }
    if ((lane & (LB - 1)) == 0) ws[lane >> (E == 4 ? 3 : 2)] = cw_f32_to_f16(dq);
}

/* Warp w of 2 * rows * kvh * n * A.roles: vector w / roles, role w % roles (0: the tq part or
 * the bf16 conversion; 1: the q8 copy into the ring or side buffer, on a warp of its own so
 * that it runs beside the tq part's float64 sums; roles = 2 only with a window). Vector u:
 * plane u / (rows kvh n) (0 = K), then (r, h, i) of that plane's x [rows, kvh, n, D];
 * grid-stride. Lane l holds elements E l .. E l + E - 1 (E = D / 32). */
template <int D> __global__ void __launch_bounds__(32 * CE_WARPS) ce_encode_kernel(const ce_args A) {
    constexpr int E = D / 32;
    static_assert(E == 4 || E == 8, "d = 128 or 256");
    __shared__ double s_t[CE_WARPS][D];
    __shared__ uint8_t s_idx[CE_WARPS][D];
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    cuda_pdl_wait(); /* programmatic: the kernel that wrote k and v has completed */
    cuda_pdl_trigger();
    const unsigned n = (unsigned)A.n, kvh = (unsigned)A.kvh, roles = (unsigned)A.roles;
    const unsigned vecs = (unsigned)A.nrows * kvh * n;  /* per plane (the launcher checks 2 vecs roles < 2^31) */
    const float cl0 = A.C[0].cent[lane & 15], cl1 = A.C[1].cent[lane & 15];
    for (unsigned w = blockIdx.x * CE_WARPS + wib; w < 2 * vecs * roles; w += gridDim.x * CE_WARPS) {
        const unsigned u = roles == 2 ? w >> 1 : w, role = roles == 2 ? w & 1 : 0;
        const int p = u >= vecs;
        const unsigned v = u - (p ? vecs : 0);
        const ce_plane &P = A.P[p];
        const ce_codec &C = A.C[p];
        const int i = (int)(v % n);
        const int h = (int)((v / n) % kvh);
        const int r = (int)(v / (n * kvh));
        /* only the newest `ring` tokens of this append land in the ring (several tokens
         * share a slot otherwise); the older ones go to the side buffer when it is on */
        const int ring = A.ring;
        const bool to_ring = P.win && i >= (int)n - ring, to_ext = P.win && P.ext && i < (int)n - ring;
        if (role == 1 && !to_ring && !to_ext) continue;
        const cuda_row rw = A.rows[r];
        float xr[E];
#pragma unroll
        for (int j = 0; j < E / 4; j++) {
            const float4 in = reinterpret_cast<const float4 *>(A.x[p] + (size_t)v * D)[(E / 4) * lane + j];
            xr[4 * j] = in.x; xr[4 * j + 1] = in.y; xr[4 * j + 2] = in.z; xr[4 * j + 3] = in.w;
        }
        const size_t slot = ((size_t)r * kvh + h) * A.cap + (size_t)(rw.col0 + i);
        if (P.bf16) {
            __nv_bfloat16 *o = reinterpret_cast<__nv_bfloat16 *>(P.data) + slot * D + E * lane;
#pragma unroll
            for (int k = 0; k < E; k++) o[k] = __float2bfloat16_rn(xr[k]);
            continue;
        }
        const uint32_t sw = C.sbits[(E * lane) >> 5];
        float s[E];
#pragma unroll
        for (int k = 0; k < E; k++) s[k] = (sw >> ((E * lane + k) & 31)) & 1u ? -1.0f : 1.0f;
        cw_rotate_n<E>(xr, s, C.inv, lane);
        if (role == 0) {
            ce_tq_store<D>(xr, C, p ? cl1 : cl0, s_t[wib], s_idx[wib], P.data + slot * P.pay,
                           P.scales + slot, lane);
        }
        if (role == 1) {            /* (roles = 1: no window, so no q8 copy) */
            const size_t ws = to_ring ? ((size_t)r * kvh + h) * ring + (size_t)((rw.ntok + i) % ring)
                                      : ((size_t)r * kvh + h) * P.xcap + (size_t)(rw.ntok + i - P.xlo[r]);
            ce_q8_store<D>(xr, (to_ring ? P.win : P.ext) + ws * D, (to_ring ? P.wsc : P.exs) + ws * (D / 32),
                           lane);
        }
    }
}

// ---------------------------------------------------------------------------
// Launcher
// ---------------------------------------------------------------------------
template <class CC> static void ce_codec_from(const CC &c, int d, ce_codec *o) {
    for (int i = 0; i < 16; i++) o->cent[i] = c.cent[i];
    for (int i = 0; i < 15; i++) o->bounds[i] = c.bounds[i];
    for (int w = 0; w < CUDA_DIM_WIDE / 32; w++) o->sbits[w] = 0;
    for (int i = 0; i < d; i++) o->sbits[i >> 5] |= (uint32_t)(c.signs[i] < 0.0f) << (i & 31);
    o->inv = c.inv;
    o->bits = c.bits;
}

cudaError_t codec_cuda_encode(const float *k, const float *v, const ce_plane P[2],
                              const cuda_codec &k128, const cuda_codec &v128,
                              const cuda_codec256 &k256, const cuda_codec256 &v256, int d,
                              const cuda_row *rows, int nrows, int kvh, int n, int cap, int ring,
                              int pdl, cudaStream_t stream) {
    ce_args A;
    A.x[0] = k;
    A.x[1] = v;
    A.P[0] = P[0];
    A.P[1] = P[1];
    if (d == CUDA_DIM) {
        ce_codec_from(k128, d, &A.C[0]);
        ce_codec_from(v128, d, &A.C[1]);
    } else {
        ce_codec_from(k256, d, &A.C[0]);
        ce_codec_from(v256, d, &A.C[1]);
    }
    A.rows = rows;
    A.nrows = nrows;
    A.kvh = kvh;
    A.n = n;
    A.cap = cap;
    A.ring = ring;
    A.roles = P[0].win || P[1].win ? 2 : 1;
    const long long warps = 2 * (long long)nrows * kvh * n * A.roles;
    if (warps >= (1ll << 31)) return cudaErrorInvalidValue;  /* (the kernel counts warps in 32 bits) */
    const long long want = (warps + CE_WARPS - 1) / CE_WARPS;
    const int blocks = (int)(want < 65536 * 4 ? want : 65536 * 4);
    if (d == CUDA_DIM) cuda_pdl_launch(pdl, ce_encode_kernel<CUDA_DIM>, dim3(blocks), dim3(32 * CE_WARPS), 0, stream, A);
    else cuda_pdl_launch(pdl, ce_encode_kernel<CUDA_DIM_WIDE>, dim3(blocks), dim3(32 * CE_WARPS), 0, stream, A);
    return cudaGetLastError();
}
