/*
 * codec_cuda.cuh - device helpers of the CUDA codec, shared (header-only, inline) by the
 * encode kernel (codec_cuda.cu) and the attention kernels (attn_cuda*.cu).
 * Owns: the warp-wide randomized Hadamard rotation of one d = 128 vector (lane l holds
 * elements 4l..4l+3; cw_*: the tuned decode kernels' copy, left as it is) and of one
 * d = 32 E vector (lane l holds elements E l..E l + E - 1; cw_*_n<E>, E = 4 or 8), bitwise
 * equal to codec_rotate / codec_unrotate (same butterflies in the same stage order, plain
 * IEEE adds and multiplies, never contracted into FMA), and the exact fp32 -> fp16
 * rounding of src/util/common.c.
 * Must not: know about caches, rows or attention.
 */
#ifndef TQKV_CODEC_CUDA_CUH
#define TQKV_CODEC_CUDA_CUH

#include <stdint.h>

/* Unnormalized Walsh-Hadamard butterflies over a warp: x[k] is element 4 * lane + k.
 * Stage h pairs (j, j + h): lower gets a + b, upper a - b (a = lower, b = upper). */
__device__ __forceinline__ void cw_fwht_raw(float x[4], int lane) {
    float a, b;
    // h = 1
    a = x[0]; b = x[1]; x[0] = __fadd_rn(a, b); x[1] = __fsub_rn(a, b);
    a = x[2]; b = x[3]; x[2] = __fadd_rn(a, b); x[3] = __fsub_rn(a, b);
    // h = 2
    a = x[0]; b = x[2]; x[0] = __fadd_rn(a, b); x[2] = __fsub_rn(a, b);
    a = x[1]; b = x[3]; x[1] = __fadd_rn(a, b); x[3] = __fsub_rn(a, b);
    // h = 4 .. 64: partner lane = lane ^ (h / 4)
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {
        const int upper = lane & m;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const float o = __shfl_xor_sync(0xffffffffu, x[k], m);
            x[k] = upper ? __fsub_rn(o, x[k]) : __fadd_rn(x[k], o);
        }
    }
}

/* x <- H D x / sqrt(d) (codec_rotate). s[k] = signs[4 lane + k]. */
__device__ __forceinline__ void cw_rotate(float x[4], const float s[4], float inv, int lane) {
#pragma unroll
    for (int k = 0; k < 4; k++) x[k] = __fmul_rn(x[k], s[k]);
    cw_fwht_raw(x, lane);
#pragma unroll
    for (int k = 0; k < 4; k++) x[k] = __fmul_rn(x[k], inv);
}

/* x <- D H x / sqrt(d) (codec_unrotate). */
__device__ __forceinline__ void cw_unrotate(float x[4], const float s[4], float inv, int lane) {
    cw_fwht_raw(x, lane);
#pragma unroll
    for (int k = 0; k < 4; k++) x[k] = __fmul_rn(x[k], __fmul_rn(s[k], inv));
}

/* The same butterflies for d = 32 E: x[k] is element E * lane + k. Stages h = 1 .. E / 2
 * inside the lane, then h = E .. 16 E across lanes (partner lane ^ (h / E)): the order of
 * codec_fwht_raw (h ascending; a stage's butterflies are independent). E = 4 performs the
 * operations of cw_fwht_raw. */
template <int E> __device__ __forceinline__ void cw_fwht_raw_n(float (&x)[E], int lane) {
    static_assert(E == 4 || E == 8, "d = 128 or 256");
#pragma unroll
    for (int h = 1; h < E; h <<= 1)
#pragma unroll
        for (int j = 0; j < E; j += 2 * h)
#pragma unroll
            for (int k = j; k < j + h; k++) {
                const float a = x[k], b = x[k + h];
                x[k] = __fadd_rn(a, b);
                x[k + h] = __fsub_rn(a, b);
            }
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {
        const int upper = lane & m;
#pragma unroll
        for (int k = 0; k < E; k++) {
            const float o = __shfl_xor_sync(0xffffffffu, x[k], m);
            x[k] = upper ? __fsub_rn(o, x[k]) : __fadd_rn(x[k], o);
        }
    }
}

/* x <- H D x / sqrt(d) (codec_rotate). s[k] = signs[E lane + k]. */
template <int E>
__device__ __forceinline__ void cw_rotate_n(float (&x)[E], const float (&s)[E], float inv, int lane) {
#pragma unroll
    for (int k = 0; k < E; k++) x[k] = __fmul_rn(x[k], s[k]);
    cw_fwht_raw_n<E>(x, lane);
#pragma unroll
    for (int k = 0; k < E; k++) x[k] = __fmul_rn(x[k], inv);
}

/* One warp's vector row [32 E] (16-byte aligned) into x, lane l holding elements E l .. E l
 * + E - 1, rotated with codec C (its signs and 1 / sqrt(d)) when `rotate`. */
template <int E, class Codec>
__device__ __forceinline__ void cw_load_rotate(const float *row, const Codec &C, int rotate, int lane,
                                               float (&x)[E]) {
#pragma unroll
    for (int j = 0; j < E / 4; j++) {
        const float4 in = reinterpret_cast<const float4 *>(row + E * lane)[j];
        x[4 * j] = in.x; x[4 * j + 1] = in.y; x[4 * j + 2] = in.z; x[4 * j + 3] = in.w;
    }
    if (rotate) {
        float s[E];
#pragma unroll
        for (int k = 0; k < E; k++) s[k] = C.signs[E * lane + k];
        cw_rotate_n<E>(x, s, C.inv, lane);
    }
}

/* x <- D H x / sqrt(d) (codec_unrotate). */
template <int E>
__device__ __forceinline__ void cw_unrotate_n(float (&x)[E], const float (&s)[E], float inv, int lane) {
    cw_fwht_raw_n<E>(x, lane);
#pragma unroll
    for (int k = 0; k < E; k++) x[k] = __fmul_rn(x[k], __fmul_rn(s[k], inv));
}

/* A codec's signs as bits (bit i of word w set: element 32 w + i has sign -1), passed by value
 * to kernels whose lanes need their own elements' signs: a lane's word is picked from the
 * parameter bank by constant-indexed (uniform) reads, where C.signs[E * lane + k] makes every
 * lane read its own address (a replayed, cold constant-bank load). Filled by cw_sbits_of. */
struct cw_sbits {
    uint32_t w[8];            /* d <= 256 */
};

__host__ inline cw_sbits cw_sbits_of(const float *signs, int d) {
    cw_sbits b;
    for (int j = 0; j < 8; j++) b.w[j] = 0;
    for (int i = 0; i < d && i < 256; i++) b.w[i >> 5] |= (uint32_t)(signs[i] < 0.0f) << (i & 31);
    return b;
}

/* s[k] = sign of element E lane + k (+-1.0f, the values of the codec's signs array), d = 32 E. */
template <int E>
__device__ __forceinline__ void cw_signs_n(const cw_sbits &b, int lane, float (&s)[E]) {
    const int wi = (E * lane) >> 5;
    uint32_t w = b.w[0];
#pragma unroll
    for (int j = 1; j < E; j++) w = wi == j ? b.w[j] : w;   /* (d = 32 E: E words) */
#pragma unroll
    for (int k = 0; k < E; k++) s[k] = (w >> ((E * lane + k) & 31)) & 1u ? -1.0f : 1.0f;
}

/* tqkv_f32_to_f16, bit for bit (round to nearest even, NaN -> sign | 0x7e00). */
__device__ __forceinline__ uint16_t cw_f32_to_f16(float f) {
    const uint32_t x = __float_as_uint(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t mant = x & 0x7fffffu;
    int32_t exp = (int32_t)((x >> 23) & 0xffu);
    if (exp == 0xff) return (uint16_t)(sign | 0x7c00u | (mant ? 0x200u : 0));
    exp = exp - 127 + 15;
    if (exp >= 31) return (uint16_t)(sign | 0x7c00u);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        mant |= 0x800000u;
        const uint32_t shift = (uint32_t)(14 - exp);
        const uint32_t half = 1u << (shift - 1);
        const uint32_t rem = mant & ((1u << shift) - 1);
        uint32_t h = mant >> shift;
        if (rem > half || (rem == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((uint32_t)exp << 10) | (mant >> 13);
    const uint32_t rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

#endif
