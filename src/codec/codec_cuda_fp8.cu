/*
 * codec_cuda_fp8.cu - GPU encode of the fp8 format (OCP e4m3 per value, one fp16 scale per
 * vector; docs/FORMATS.md "fp8") for the CUDA backend's append.
 * Owns: one warp per vector (d = 128 or 256): the scale fp16(amax / 448) (binary32 quotient),
 * the e4m3 byte of each value divided by the scale (float64 quotient, round to nearest even,
 * saturating at 448), written at each row's append column. Bytes equal codec_encode's
 * (fp8_scale / codec_e4m3_from_double of src/codec/codec.c, same operations in the same
 * precision): tests/test_cuda.c compares every byte. fp8 is not rotated and has no q8 window.
 * Must not: run attention, decide row state or know the cache's structs. Kept apart from
 * codec_cuda.cu's tq kernel so that either can change without the other.
 */
#include <cuda_fp16.h>
#include <math.h>

#include "codec/codec_cuda.cuh"
#include "codec/codec_cuda_params.h"

namespace {

/* codec_e4m3_from_double of codec.c, step for step (no contraction: explicit roundings). */
__device__ uint8_t cf8_e4m3(double v) {
    const uint8_t sign = signbit(v) ? 0x80 : 0;
    const double a = fabs(v);
    if (!(a < 448.0)) return sign | 0x7e;                      /* saturate */
    if (a < 0x1p-6) {                                          /* subnormal grid: 2^-9 */
        const double r = __dsub_rn(__dadd_rn(a, 0x1p43), 0x1p43);
        return sign | (uint8_t)(r * 512.0);                    /* exact: r is k 2^-9, k <= 8 */
    }
    uint64_t u = (uint64_t)__double_as_longlong(a);
    u += ((uint64_t)1 << 48) - 1 + ((u >> 49) & 1);            /* RNE to 3 mantissa bits */
    u &= ~(((uint64_t)1 << 49) - 1);
    const int e = (int)(u >> 52) - 1023;                       /* -6..8 */
    return sign | (uint8_t)(((e + 7) << 3) | (int)((u >> 49) & 7));
}

/* x: [rows, kvh, n, D] floats; grid-stride over rows * kvh * n warps; lane l holds elements
 * E l .. E l + E - 1 (E = D / 32). */
template <int D>
__global__ void __launch_bounds__(256) cf8_encode_kernel(const float *__restrict__ x, ce_plane P,
                                                         const cuda_row *__restrict__ rows,
                                                         int nrows, int kvh, int n, int cap) {
    constexpr int E = D / 32;
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const long long total = (long long)nrows * kvh * n;
    for (long long v = (long long)blockIdx.x * 8 + wib; v < total; v += (long long)gridDim.x * 8) {
        const int i = (int)(v % n);
        const int h = (int)((v / n) % kvh);
        const int r = (int)(v / ((long long)n * kvh));
        const size_t slot = ((size_t)r * kvh + h) * cap + (size_t)(rows[r].col0 + i);
        float xr[E];
#pragma unroll
        for (int j = 0; j < E / 4; j++) {
            const float4 in = reinterpret_cast<const float4 *>(x + (size_t)v * D)[(E / 4) * lane + j];
            xr[4 * j] = in.x; xr[4 * j + 1] = in.y; xr[4 * j + 2] = in.z; xr[4 * j + 3] = in.w;
        }
        // ---- scale: fp8_scale of codec.c (max is exact in any order; NaN / inf flagged)
        float am = 0.0f;
        int nan = 0, inf = 0;
#pragma unroll
        for (int k = 0; k < E; k++) {
            const float a = fabsf(xr[k]);
            nan |= a != a;
            inf |= a == INFINITY;
            if (a > am) am = a;
        }
#pragma unroll
        for (int m = 16; m; m >>= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, m));
        nan = __any_sync(0xffffffffu, nan);
        inf = __any_sync(0xffffffffu, inf);
        uint16_t h16;
        if (nan) h16 = 0x7e00u;
        else if (inf) h16 = 0x7c00u;
        else {
            const float s = __fdiv_rn(am, 448.0f);
            h16 = s >= 65504.0f ? 0x7bffu : cw_f32_to_f16(s);
        }
        const float s = __half2float(__ushort_as_half(h16));
        const bool zero = !(s > 0.0f) || s == INFINITY;
        // ---- payload: e4m3 of x / s (float64 quotient), lane's E bytes
        uint8_t b[E];
#pragma unroll
        for (int k = 0; k < E; k++) b[k] = zero ? 0 : cf8_e4m3(__ddiv_rn((double)xr[k], (double)s));
        uint8_t *out = P.data + slot * P.pay + E * lane;
        if constexpr (E == 4) {
            *reinterpret_cast<uint32_t *>(out) =
                (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
        } else {
            uint2 w;
            w.x = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
            w.y = (uint32_t)b[4] | (uint32_t)b[5] << 8 | (uint32_t)b[6] << 16 | (uint32_t)b[7] << 24;
            *reinterpret_cast<uint2 *>(out) = w;
        }
        if (lane == 0) P.scales[slot] = h16;
    }
}

} // namespace

// ---------------------------------------------------------------------------
// Launcher
// ---------------------------------------------------------------------------
cudaError_t codec_cuda_encode_fp8(const float *x, const ce_plane &P, int d, const cuda_row *rows,
                                  int nrows, int kvh, int n, int cap, cudaStream_t stream) {
    const long long vecs = (long long)nrows * kvh * n;
    const int blocks = (int)(vecs / 8 + 1 < 65536 * 4 ? vecs / 8 + 1 : 65536 * 4);
    if (d == CUDA_DIM)
        cf8_encode_kernel<CUDA_DIM><<<blocks, 256, 0, stream>>>(x, P, rows, nrows, kvh, n, cap);
    else
        cf8_encode_kernel<CUDA_DIM_WIDE><<<blocks, 256, 0, stream>>>(x, P, rows, nrows, kvh, n, cap);
    return cudaGetLastError();
}
