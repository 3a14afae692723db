/*
 * codec_cuda.cu - GPU encode of the cache formats (the CUDA backend's append).
 * Owns: one warp per vector (d = 128 or 256, a template): sign flip + Walsh-Hadamard rotation, the tq2/3/4
 * quantizer with the norm-corrected fp16 scale, bit packing into the planes of
 * docs/FORMATS.md, and the q8 copy of the rotated vector into the recent-window ring;
 * the bf16 baseline's plain conversion. Bytes equal codec_encode's (same float64 norm
 * order, same comparisons, same rounding): tests/test_cuda.c compares every byte.
 * Must not: run attention, decide row state or know the cache's structs (cache_cuda.cu
 *   fills the kernel's parameters and calls codec_cuda_encode).
 */
#include <cuda_bf16.h>
#include <math.h>

#include "codec/codec_cuda.cuh"
#include "codec/codec_cuda_params.h"

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

/* Sequential float64 sums over the 32 lanes of E lane-local terms, then
 * (a0 + a1) + (a2 + a3): the four interleaved accumulators of codec.c (element 4i + k
 * lives in lane i / (E / 4), slot 4 (i % (E / 4)) + k). Every lane gets the same result. */
template <int E> __device__ static double ce_sum4_ordered(const double (&t)[E]) {
    double a[4] = {0, 0, 0, 0};
    for (int i = 0; i < 32; i++)
#pragma unroll
        for (int j = 0; j < E; j += 4)
#pragma unroll
            for (int k = 0; k < 4; k++) a[k] = __dadd_rn(a[k], __shfl_sync(0xffffffffu, t[j + k], i));
    return __dadd_rn(__dadd_rn(a[0], a[1]), __dadd_rn(a[2], a[3]));
}

// ---------------------------------------------------------------------------
// Encode kernel: one warp per vector
// ---------------------------------------------------------------------------

/* x: [rows, kvh, n, D] floats; grid-stride over rows * kvh * n warps. Lane l holds
 * elements E l .. E l + E - 1 (E = D / 32). */
template <int D>
__global__ void __launch_bounds__(256) ce_encode_kernel(const float *__restrict__ x,
                                                        ce_plane P, typename cuda_codec_of<D>::type C,
                                                        const cuda_row *__restrict__ rows,
                                                        int nrows, int kvh, int n, int cap,
                                                        int ring) {
    constexpr int E = D / 32;          /* elements per lane; also the 32-value groups per vector */
    constexpr int LB = 32 / E;         /* lanes per 32-value q8 block (8 or 4) */
    static_assert(E == 4 || E == 8, "d = 128 or 256");
    __shared__ uint8_t s_idx[8][D];
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const long long total = (long long)nrows * kvh * n;
    for (long long v = (long long)blockIdx.x * 8 + wib; v < total; v += (long long)gridDim.x * 8) {
        const int i = (int)(v % n);
        const int h = (int)((v / n) % kvh);
        const int r = (int)(v / ((long long)n * kvh));
        const cuda_row rw = rows[r];
        const size_t slot = ((size_t)r * kvh + h) * cap + (size_t)(rw.col0 + i);
        float xr[E];
#pragma unroll
        for (int j = 0; j < E / 4; j++) {
            const float4 in = reinterpret_cast<const float4 *>(x + (size_t)v * D)[(E / 4) * lane + j];
            xr[4 * j] = in.x; xr[4 * j + 1] = in.y; xr[4 * j + 2] = in.z; xr[4 * j + 3] = in.w;
        }
        if (P.bf16) {
            __nv_bfloat16 *o = reinterpret_cast<__nv_bfloat16 *>(P.data) + slot * D + E * lane;
#pragma unroll
            for (int k = 0; k < E; k++) o[k] = __float2bfloat16_rn(xr[k]);
            continue;
        }
        float s[E];
#pragma unroll
        for (int k = 0; k < E; k++) s[k] = C.signs[E * lane + k];
        cw_rotate_n<E>(xr, s, C.inv, lane);
        // ---- tq: norm, indices, norm-corrected scale --------------------------------
        double t[E];
#pragma unroll
        for (int k = 0; k < E; k++) t[k] = __dmul_rn((double)xr[k], (double)xr[k]);
        const double n2 = ce_sum4_ordered<E>(t);
        const double nn = sqrt(n2);
        const float inv = nn > 0 && nn <= 1e300 ? __double2float_rn(1.0 / nn) : 0.0f;
        const int L = 1 << C.bits;
        uint8_t idx[E];
#pragma unroll
        for (int k = 0; k < E; k++) {
            const float u = __fmul_rn(xr[k], inv);
            int q = 0;
            for (int b = 0; b < L - 1; b++) q += u > C.bounds[b];
            idx[k] = (uint8_t)q;
            const double c = C.cent[q];
            t[k] = __dmul_rn(c, c);
        }
        const double cn2 = ce_sum4_ordered<E>(t);
        uint16_t scale;
        if (!(nn > 0)) scale = nn == 0 ? 0 : 0x7e00u;
        else if (!(nn <= 1e300)) scale = 0x7c00u;
        else scale = ce_f64_to_f16_sat(nn / sqrt(cn2));
        // ---- pack ------------------------------------------------------------------
        uint8_t *si = s_idx[wib];
#pragma unroll
        for (int k = 0; k < E; k++) si[E * lane + k] = idx[k];
        __syncwarp();
        uint8_t *out = P.data + slot * P.pay;
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
        if (lane == 0) P.scales[slot] = scale;
        __syncwarp();
        // ---- q8 copy of the rotated vector into the ring (ggml q8_0 on 32 blocks) -------
        /* only the newest `ring` tokens of this append land in the ring (several tokens
         * share a slot otherwise); the older ones go to the side buffer when it is on */
        const bool to_ring = P.win && i >= n - ring, to_ext = P.win && P.ext && i < n - ring;
        if (to_ring || to_ext) {
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
            const size_t ws = to_ring ? ((size_t)r * kvh + h) * ring + (size_t)((rw.ntok + i) % ring)
                                      : ((size_t)r * kvh + h) * P.xcap + (size_t)(rw.ntok + i - P.xlo[r]);
            int8_t *wq = (to_ring ? P.win : P.ext) + ws * D + E * lane;
#pragma unroll
            for (int k = 0; k < E; k++) {
                double q = dq != 0.0f ? (double)xr[k] / (double)dq : 0.0;
                if (q != q) q = 0.0;
                q = q < -127.0 ? -127.0 : q > 127.0 ? 127.0 : q;
                wq[k] = (int8_t)ce_round_half_away(q);
            }
            if ((lane & (LB - 1)) == 0)
                (to_ring ? P.wsc : P.exs)[ws * (D / 32) + (lane >> (E == 4 ? 3 : 2))] = cw_f32_to_f16(dq);
        }
    }
}

// ---------------------------------------------------------------------------
// Launcher
// ---------------------------------------------------------------------------
cudaError_t codec_cuda_encode(const float *x, const ce_plane &P, const cuda_codec &c128,
                              const cuda_codec256 &c256, int d, const cuda_row *rows, int nrows,
                              int kvh, int n, int cap, int ring, cudaStream_t stream) {
    const long long vecs = (long long)nrows * kvh * n;
    const int blocks = (int)(vecs / 8 + 1 < 65536 * 4 ? vecs / 8 + 1 : 65536 * 4);
    if (d == CUDA_DIM)
        ce_encode_kernel<CUDA_DIM><<<blocks, 256, 0, stream>>>(x, P, c128, rows, nrows, kvh, n,
                                                                cap, ring);
    else
        ce_encode_kernel<CUDA_DIM_WIDE><<<blocks, 256, 0, stream>>>(x, P, c256, rows, nrows, kvh,
                                                                     n, cap, ring);
    return cudaGetLastError();
}
