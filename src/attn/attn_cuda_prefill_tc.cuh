/*
 * attn_cuda_prefill_tc.cuh - what the two tensor-core masked prefill kernels share
 * (attn_cuda_prefill_tc.cu: 4 warps per CTA, synchronous tiles; attn_cuda_prefill_tc8.cu:
 * 8 warps, prefetched double-buffered tiles): the tile size, the shared-memory row pitch,
 * ldmatrix, the decode of one (token, 32-dim group) of the main plane or of a q8 copy into a
 * 16-bit tile row, the per-token factors, the synchronous tile load, the fragments' scores and
 * P . V products, the block's range and window state. The arithmetic is described in
 * attn_cuda_prefill_tc.cu's header.
 * Must not: hold kernel state or host code.
 */
#ifndef TQKV_ATTN_CUDA_PREFILL_TC_CUH
#define TQKV_ATTN_CUDA_PREFILL_TC_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "attn/attn_cuda_prefill.cuh"
#include "attn/attn_cuda_tile.cuh"
#include "codec/codec_cuda.cuh"

namespace ptc {

constexpr int TK = 64;   /* tokens per tile */
/* 16-bit tile row pitch: rows 16 bytes apart modulo 128, so ldmatrix reads 8 rows without bank
 * conflicts */
template <int D> constexpr int TC_LD = D + 8;

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm4t(uint32_t (&r)[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

/* 32 values (one 32-dim group) as 16-bit words into dst (16-byte aligned). */
template <int F> __device__ __forceinline__ void put32(uint16_t *dst, const float (&x)[32]) {
#pragma unroll
    for (int c = 0; c < 4; c++) {
        uint4 w;
        w.x = pack2<F>(x[8 * c], x[8 * c + 1]);
        w.y = pack2<F>(x[8 * c + 2], x[8 * c + 3]);
        w.z = pack2<F>(x[8 * c + 4], x[8 * c + 5]);
        w.w = pack2<F>(x[8 * c + 6], x[8 * c + 7]);
        reinterpret_cast<uint4 *>(dst)[c] = w;
    }
}

/* Group g of a main-plane token (column col) into dst; returns the token's factor. */
template <int D, int F>
__device__ float load_main(uint16_t *dst, const uint8_t *data, const uint16_t *sc, size_t pay, int bits,
                           const float *cent, size_t col, int g) {
    const uint8_t *p = data + col * pay;
    if constexpr (F == F_BF16) {
#pragma unroll
        for (int c = 0; c < 4; c++) reinterpret_cast<uint4 *>(dst)[c] = reinterpret_cast<const uint4 *>(p + 64 * g)[c];
        return 1.0f;
    } else {
        float x[32];
        if (bits == CUDA_BITS_FP8) { /* codec_fp8_half: the e4m3 value x 2^-8, exact in fp16 */
            const uint4 w0 = reinterpret_cast<const uint4 *>(p + 32 * g)[0], w1 = reinterpret_cast<const uint4 *>(p + 32 * g)[1];
            const uint32_t b[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
            for (int j = 0; j < 32; j++) {
                const uint32_t by = (b[j >> 2] >> (8 * (j & 3))) & 0xFFu;
                x[j] = __half2float(__ushort_as_half((uint16_t)(((by & 0x80u) << 8) | ((by & 0x7fu) << 7))));
            }
            put32<F>(dst, x);
            return __half2float(__ushort_as_half(sc[col])) * 256.0f;
        }
        if (bits == 4) {
            const uint4 w = *reinterpret_cast<const uint4 *>(p + 16 * g);
            const uint32_t b[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int j = 0; j < 32; j++) x[j] = cent[(b[(j & 15) >> 2] >> (8 * (j & 3) + 4 * (j >> 4))) & 15];
        } else {
            const uint2 w = *reinterpret_cast<const uint2 *>(p + 8 * g);
            const uint32_t b[2] = {w.x, w.y};
            const uint32_t hb = bits == 3 ? *reinterpret_cast<const uint32_t *>(p + D / 4 + 4 * g) : 0u;
#pragma unroll
            for (int j = 0; j < 32; j++) {
                int idx = (b[(j & 7) >> 2] >> (8 * (j & 3) + 2 * (j >> 3))) & 3;
                idx |= ((hb >> (8 * (j >> 3) + (j & 7))) & 1) << 2;
                x[j] = cent[idx];
            }
        }
        put32<F>(dst, x);
        return __half2float(__ushort_as_half(sc[col]));
    }
}

/* Group g of a q8 copy (slot) into dst, relative to the token's factor (returned). */
template <int D, int F>
__device__ float load_q8(uint16_t *dst, const int8_t *q, const uint16_t *qs, size_t slot, int g) {
    float tf = 0.0f;
#pragma unroll
    for (int b = 0; b < D / 32; b++) tf = fmaxf(tf, fabsf(__half2float(__ushort_as_half(qs[slot * (D / 32) + b]))));
    const float rel = q8_rel(__half2float(__ushort_as_half(qs[slot * (D / 32) + g])), tf);
    const int8_t *src = q + slot * D + 32 * g;
    float x[32];
#pragma unroll
    for (int c = 0; c < 2; c++) {
        const uint4 w = reinterpret_cast<const uint4 *>(src)[c];
        const uint32_t b[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 16; j++) x[16 * c + j] = (float)(int8_t)(b[j >> 2] >> (8 * (j & 3))) * rel;
    }
    put32<F>(dst, x);
    return tf;
}

/* P = 2^(s' - m + PSHIFT), at most 2^15 (fp16 holds 65504): weights down to 2^-24 of the
 * largest stay normal fp16 numbers instead of subnormal or 0 (at PSHIFT 0 the many small
 * weights of a long, peaked row lost their bits, and with them part of the numerator). The
 * sum l adds the same rounded P / f, so numerator and denominator weigh each token alike. */
constexpr float PSHIFT = 15.0f;

/* x rounded to the mma's 16-bit type, as a float (exact in that type). */
template <int F> __device__ __forceinline__ float round16(float x) {
    if constexpr (F == F_BF16) return __bfloat162float(__float2bfloat16_rn(x));
    else return __half2float(__float2half_rn(x));
}

/* The window's state of one CTA: tokens [cmin, cmax) come from both sources, t >= cmax from
 * the q8 copies (side buffer or ring). */
struct Win {
    int on, cmin, cmax, xon, xlo, xhi;
};

/* Per token of a tile: the V factor's log2 and inverse (at least VSCALE_MIN; 1 for a padding
 * token, whose values are 0 and whose scores are masked). */
__device__ __forceinline__ void put_factors(float *fk, float *lfv, float *ifv, int tt, float kf, float vf) {
    const float v = vf >= VSCALE_MIN ? vf : (vf != vf ? vf : VSCALE_MIN);
    fk[tt] = kf;
    lfv[tt] = log2f(v);
    ifv[tt] = 1.0f / v;
}

/* Decode tokens [t0, t0 + TK) of row r, kv head rh into the tiles (second: the copy tile of
 * [cmin, cmax), or NULL). Every thread of the CTA takes (token, group) items. */
template <int D, int F, int NT>
__device__ void tile_load(const PParams<D> &P, const cuda_row &row, size_t rh, int t0, int tend, const Win &wn,
                          const float *ck, const float *cv, uint16_t *sk, uint16_t *sv, float *f1,
                          uint16_t *sk2, uint16_t *sv2, float *f2) {
    constexpr int LD = TC_LD<D>, NG = D / 32;
    for (int it = threadIdx.x; it < TK * NG; it += NT) {
        const int tt = it / NG, g = it % NG, t = t0 + tt;
        uint16_t *dk = sk + tt * LD + 32 * g, *dv = sv + tt * LD + 32 * g;
        float kf = 0.0f, vf = 1.0f;
        size_t xs = 0;
        const int8_t *kq = P.kw, *vq = P.vw;
        const uint16_t *kqs = P.kws, *vqs = P.vws;
        const bool have = t < tend, q8 = have && wn.on && t >= wn.cmin;
        if (q8 && wn.xon && t >= wn.xlo && t < wn.xhi) {
            xs = rh * P.xcap + (size_t)(t - wn.xlo);
            kq = P.kx; vq = P.vx; kqs = P.kxs; vqs = P.vxs;
        } else if (q8) {
            xs = rh * P.ring + (size_t)(t % P.ring);
        }
        if (!have) {
            const float z[32] = {};
            put32<F>(dk, z);
            put32<F>(dv, z);
        } else if (q8 && t >= wn.cmax) {
            kf = load_q8<D, F>(dk, kq, kqs, xs, g);
            vf = load_q8<D, F>(dv, vq, vqs, xs, g);
        } else {
            const size_t col = rh * P.cap + (size_t)(row.left_pad + t);
            kf = load_main<D, F>(dk, P.kd, P.ks, P.kpay, P.kc.bits, ck, col, g);
            vf = load_main<D, F>(dv, P.vd, P.vs, P.vpay, P.vc.bits, cv, col, g);
        }
        if (g == 0) put_factors(f1, f1 + TK, f1 + 2 * TK, tt, kf, vf);
        if (!sk2) continue;
        uint16_t *ek = sk2 + tt * LD + 32 * g, *ev = sv2 + tt * LD + 32 * g;
        float kf2 = 0.0f, vf2 = 1.0f;
        if (q8 && t < wn.cmax) {
            kf2 = load_q8<D, F>(ek, kq, kqs, xs, g);
            vf2 = load_q8<D, F>(ev, vq, vqs, xs, g);
        } else {
            const float z[32] = {};
            put32<F>(ek, z);
            put32<F>(ev, z);
        }
        if (g == 0) put_factors(f2, f2 + TK, f2 + 2 * TK, tt, kf2, vf2);
    }
}

/* S [16, 64] of this warp's vectors against tile sk (fragment j: tokens 8 j .. 8 j + 7). */
template <int D, int F>
__device__ __forceinline__ void tile_scores(float (&s)[8][4], const uint16_t *sq, const uint16_t *sk, int lane) {
    constexpr int LD = TC_LD<D>;
#pragma unroll
    for (int j = 0; j < 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll 4
    for (int kk = 0; kk < D / 16; kk++) {
        uint32_t a[4];
        ldsm4(a, sq + (lane & 15) * LD + 16 * kk + 8 * (lane >> 4));
#pragma unroll
        for (int np = 0; np < 4; np++) {
            uint32_t b[4];
            ldsm4(b, sk + (16 * np + (lane & 7) + 8 * (lane >> 4)) * LD + 16 * kk + 8 * ((lane >> 3) & 1));
            mma<F>(s[2 * np], a, b[0], b[1]);
            mma<F>(s[2 * np + 1], a, b[2], b[3]);
        }
    }
}

/* The scores against the copy tile sk2 where this thread's (vector, token) reads the copy
 * (t >= c(vector), t < cmax), times the copy's K factor, replacing s (already scaled by the
 * main factors); two fragments at a time, so that only 8 more accumulators are live. */
template <int D, int F>
__device__ __forceinline__ void tile_scores2(float (&s)[8][4], const uint16_t *sq, const uint16_t *sk2,
                                             const float *fk2, int t0, const int (&vc)[2], int cmax, int lane) {
    constexpr int LD = TC_LD<D>;
#pragma unroll
    for (int np = 0; np < 4; np++) {
        float c[2][4] = {};
#pragma unroll 4
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t a[4], b[4];
            ldsm4(a, sq + (lane & 15) * LD + 16 * kk + 8 * (lane >> 4));
            ldsm4(b, sk2 + (16 * np + (lane & 7) + 8 * (lane >> 4)) * LD + 16 * kk + 8 * ((lane >> 3) & 1));
            mma<F>(c[0], a, b[0], b[1]);
            mma<F>(c[1], a, b[2], b[3]);
        }
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int u = e >> 1, tt = 16 * np + 8 * h + 2 * (lane & 3) + (e & 1), t = t0 + tt;
                if (t >= vc[u] && t < cmax) s[2 * np + h][e] = c[h][e] * fk2[tt];
            }
    }
}

/* O [16, D] += P [16, 16 tokens of step kt] . V (tile sv). */
template <int D, int F>
__device__ __forceinline__ void tile_pv(float (&o)[D / 8][4], const uint32_t (&a)[4], const uint16_t *sv, int kt,
                                        int lane) {
    constexpr int LD = TC_LD<D>;
#pragma unroll
    for (int np = 0; np < D / 16; np++) {
        uint32_t b[4];
        ldsm4t(b, sv + (16 * kt + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD + 16 * np + 8 * (lane >> 4));
        mma<F>(o[2 * np], a, b[0], b[1]);
        mma<F>(o[2 * np + 1], a, b[2], b[3]);
    }
}

/* The block's visible range [tlo, thi) and window state (as the float32 kernel's). */
template <int D>
__device__ void block_range(const PParams<D> &P, const cuda_row &row, int r, int q0, int bq, int &tlo, int &thi,
                            Win &wn) {
    tlo = 1 << 30; thi = 0;
    if (P.lo == nullptr) {
        if (row.ntok > 0) { tlo = 0; thi = row.ntok; }
    } else {
        for (int i = 0; i < bq && q0 + i < P.nq; i++) {
            const int lo = P.lo[(size_t)r * P.nq + q0 + i], hi = P.hi[(size_t)r * P.nq + q0 + i];
            if (lo < hi) { tlo = min(tlo, lo); thi = max(thi, hi); }
        }
    }
    const int *xr = P.x;
    wn.xon = xr != nullptr && xr[P.nrows + r] > xr[r];
    wn.xlo = wn.xon ? xr[r] : 0;
    wn.xhi = wn.xon ? xr[P.nrows + r] : 0;
    const int q8lo = wn.xon ? xr[r] : row.win_lo;
    wn.on = P.window > 0;
    wn.cmin = wn.cmax = 1 << 30;
    for (int i = 0; wn.on && i < bq && q0 + i < P.nq; i++) {
        const int c = max(row.ntok - P.nq + q0 + i + 1 - P.window, q8lo);
        wn.cmin = i ? min(wn.cmin, c) : c;
        wn.cmax = i ? max(wn.cmax, c) : c;
    }
}
} // namespace ptc

#endif
