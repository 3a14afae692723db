/*
 * attn_cuda_wide.cu - decode attention (one query per row) at head_dim 256 (Gemma 4's full
 * layers) over the device cache, sm_90: cuda_attend_decode_wide, which attn_cuda.cu's entry
 * points call for a d = 256 cache.
 * Owns: the d = 256 dispatch (tq4 / tq3: the tensor-core split kernel, split_kernel<F, 2, 2,
 * 256> of attn_cuda_split.cuh, unless TQKV_WIDE_TC selects the float32 kernel; the dense bf16
 * cache: the float32 kernel), their query preparation, the float32 split kernel (wdec_kernel),
 * the merge of either kernel's partials (wmerge_kernel: split order, divided by the sum,
 * un-rotated once), the d = 256 workspace (tqkv_cuda_attend_ws_bytes_dim) and the tensor-core
 * kernels' setup (cuda_wide_setup, run by tqkv_cuda_attn_setup).
 * Must not: mutate the cache; let a row's result depend on other rows (each row's split length
 * from its own length on the device, attn_cuda_splits.h; fixed reduction orders); take from the
 * host anything but kv's rows and storage, q_heads, the workspace and the split bound implied
 * by the longest row (a decode step's CUDA graph keys on these); allocate, free or wait when a
 * workspace is passed.
 *
 * The choice of kernel: the environment's TQKV_WIDE_TC (0: float32, 1: tensor cores), read once
 * by the setup, else the build's TQKV_WIDE_TC (default 1), so one binary times both
 * (docs/CUDA.md "head_dim 256"). Both kernels write the same partials' layout into the same
 * workspace and share the merge; their split rules differ (tsplit_len / wsplit_len), both
 * within wsplit_bound.
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

extern "C" {
#include "util/common.h"
}
#include "attn/attn_cuda_split.cuh"
#include "cache/cache_cuda_impl.h"
#include "codec/codec_cuda.cuh"

#ifndef TQKV_WIDE_TC
#define TQKV_WIDE_TC 1        /* d = 256 tq decode on tensor cores (0: the float32 kernel) */
#endif

namespace {

constexpr int WD = CUDA_DIM_WIDE;

// ---------------------------------------------------------------------------
// Query preparation (one warp per (row, q head), lane l: dims 8 l .. 8 l + 7)
// ---------------------------------------------------------------------------
/* The query rotated into K's domain (rotate; the bf16 cache is stored as given) and scaled by
 * softmax scale * log2(e). OUT < 0: float32 in natural order (the float32 kernel's, bitwise
 * what the masked kernels' pqprep_kernel<256> gives); OUT = F_TQ4 / F_TQ3: fp16 in the split
 * kernel's qdim<OUT, 256> order (element o holds dim qdim(o): a lane of column c loads its 32
 * pairs as four uint4 from 32 c and four from 128 + 32 c). q [n, 256] -> out [n, 256]. */
template <int OUT>
__global__ void wprep_kernel(const float *__restrict__ q, void *__restrict__ out, cw_sbits sb, float cinv,
                             int rotate, float mul, int n) {
    constexpr int E = WD / 32;
    __shared__ float s_q[4][WD];
    cuda_pdl_trigger(); /* a programmatic split kernel may start its prologue now (tc_partials) */
    const int wv = threadIdx.x >> 5, v = blockIdx.x * 4 + wv, lane = threadIdx.x & 31;
    if (v >= n) return;
    float x[E];
#pragma unroll
    for (int j = 0; j < E / 4; j++) {
        const float4 in = reinterpret_cast<const float4 *>(q + (size_t)v * WD + E * lane)[j];
        x[4 * j] = in.x; x[4 * j + 1] = in.y; x[4 * j + 2] = in.z; x[4 * j + 3] = in.w;
    }
    if (rotate) { /* cw_load_rotate's rotation, K's signs as bits (no per-lane parameter reads) */
        float sg[E];
        cw_signs_n<E>(sb, lane, sg);
        cw_rotate_n<E>(x, sg, cinv, lane);
    }
    if constexpr (OUT < 0) {
        float *const o = reinterpret_cast<float *>(out) + (size_t)v * WD + E * lane;
#pragma unroll
        for (int j = 0; j < E / 4; j++)
            reinterpret_cast<float4 *>(o)[j] =
                make_float4(x[4 * j] * mul, x[4 * j + 1] * mul, x[4 * j + 2] * mul, x[4 * j + 3] * mul);
    } else {
#pragma unroll
        for (int k = 0; k < E; k++) s_q[wv][E * lane + k] = x[k];
        __syncwarp();
        uint16_t *const o = reinterpret_cast<uint16_t *>(out) + (size_t)v * WD;
#pragma unroll
        for (int k = 0; k < E; k++) {
            const int i = E * lane + k;
            o[i] = __half_as_ushort(__float2half_rn(s_q[wv][qdim<OUT, WD>(i)] * mul));
        }
    }
}

// ---------------------------------------------------------------------------
// The tensor-core kernel: configurations (persistent grids, set by cuda_wide_setup)
// ---------------------------------------------------------------------------
/* NG = 2 groups of 4 warps per CTA (256 threads: up to 255 registers, which acc[16][4] and
 * qb[16][2] need) and ST = 2 stages per warp: with the 64 KiB table the stages (8608 bytes a
 * tq4 tile, 6560 tq3) fill the SM's shared memory (smem_bytes, about 207 KiB each). */
constexpr int WIDE_NG = 2, WIDE_ST = 2;
struct WideCfg {
    void (*fn)(Params<WD>);
    int ng, st, smem;
    int ctas;                 /* resident CTAs (one per SM), set by the setup */
};
#define WIDE_CFG(F) {split_kernel<F, WIDE_NG, WIDE_ST, WD>, WIDE_NG, WIDE_ST, smem_bytes<F, WIDE_NG, WIDE_ST, WD>(), 0}
WideCfg g_wcfg[2] = {WIDE_CFG(F_TQ4), WIDE_CFG(F_TQ3)};
#undef WIDE_CFG
int g_wide_tc = TQKV_WIDE_TC;  /* the setup's choice (TQKV_WIDE_TC in the environment) */

// ---------------------------------------------------------------------------
// The float32 kernel (TQKV_WIDE_TC=0, and the dense bf16 cache): split-KV in float32 with
// plain FMA, one CTA per work item, the splits of wsplit_len (attn_cuda_splits.h)
// ---------------------------------------------------------------------------
constexpr int WNW = 4;                 /* warps per CTA (one CTA per work item) */

struct WParams {
    const uint8_t *kd, *vd;            /* [rows, kvh, cap, pay] (bf16: [.., 256] bf16) */
    const uint16_t *ks, *vs;           /* [rows, kvh, cap] fp16 (bf16: NULL) */
    const int8_t *kw, *vw;             /* [rows, kvh, ring, 256] q8 window */
    const uint16_t *kws, *vws;         /* [rows, kvh, ring, 8] fp16 block scales */
    const cuda_row *rows;              /* [rows] */
    const float *q;                    /* [rows, qh, 256] rotated (tq), scaled by scale * log2(e) */
    float *po;                         /* [rows * qh, nsmax, 256] partial outputs (V domain) */
    float2 *pml;                       /* [rows * qh, nsmax] (running max, sum) */
    float kcent[16], vcent[16];        /* codebooks (ascending) */
    int pay, ring, cap, kvh, G, qh, nsmax;
};

/* The 8 values of lane l (dims 8 l .. 8 l + 7) of one token, before its scale: tq (B bits)
 * from the 8 payload bytes the lane loaded (raw) and, for tq3, its byte of the 1-bit plane
 * (hb); q8 from the lane's 8 window bytes. Payload layout (codec.h): dim 32 g + j has its
 * tq4 nibble j >> 4 in byte 16 g + (j & 15); its tq3 2-bit field j >> 3 in byte 8 g + (j & 7)
 * and its high bit j & 7 in byte D / 4 + 4 g + (j >> 3). */
template <int B>
__device__ __forceinline__ void wdec_tq(uint2 raw, uint32_t hb, int sh, const float *cent, float (&x)[8]) {
#pragma unroll
    for (int c = 0; c < 8; c++) {
        const uint32_t by = ((c < 4 ? raw.x : raw.y) >> (8 * (c & 3))) & 0xFFu;
        const uint32_t idx = B == 4 ? (by >> sh) & 15u : ((by >> sh) & 3u) | (((hb >> c) & 1u) << 2);
        x[c] = cent[idx];
    }
}
__device__ __forceinline__ void wdec_q8(uint2 raw, float (&x)[8]) {
#pragma unroll
    for (int c = 0; c < 8; c++) x[c] = (float)(int8_t)(((c < 4 ? raw.x : raw.y) >> (8 * (c & 3))) & 0xFFu);
}
/* bf16: the lane's 8 values (dims 8 l .. 8 l + 7, little endian pairs), exact in float. */
__device__ __forceinline__ void wdec_bf16(uint2 lo, uint2 hi, float (&x)[8]) {
    const uint32_t w[4] = {lo.x, lo.y, hi.x, hi.y};
#pragma unroll
    for (int c = 0; c < 4; c++) {
        x[2 * c] = __uint_as_float(w[c] << 16);
        x[2 * c + 1] = __uint_as_float(w[c] & 0xFFFF0000u);
    }
}

/* The bits argument B of the decode kernels for the dense bf16 baseline. */
constexpr int WB_BF16 = 16;

/* One token's raw bytes for lane l: main plane (tq, bf16) or q8 window. */
struct WRaw {
    uint2 w;                           /* 8 payload / window bytes (bf16: dims 8 l .. + 3) */
    uint2 w2;                          /* bf16: dims 8 l + 4 .. 8 l + 7 */
    uint32_t hb;                       /* tq3: the lane's 1-bit plane byte */
    float sc;                          /* tq: the token's scale; q8: its block scale; bf16: 1 */
    bool win;
};

template <int B>
__device__ __forceinline__ WRaw wload(const uint8_t *base, const uint16_t *sc, const int8_t *wv, const uint16_t *wsc,
                                      int pay, int off, int lane, int t, bool win, size_t slot) {
    WRaw x;
    x.win = win;
    x.hb = 0;
    x.w2 = make_uint2(0, 0);
    if constexpr (B == WB_BF16) { /* 16 bytes per lane, no scale (win is false: no ring) */
        const uint4 u = __ldg(reinterpret_cast<const uint4 *>(base + (size_t)t * pay) + lane);
        x.w = make_uint2(u.x, u.y);
        x.w2 = make_uint2(u.z, u.w);
        x.sc = 1.0f;
    } else if (win) {
        x.w = __ldg(reinterpret_cast<const uint2 *>(wv + slot * WD) + lane);
        x.sc = __half2float(__ushort_as_half(__ldg(wsc + slot * (WD / 32) + (lane >> 2))));
    } else {
        const uint8_t *p = base + (size_t)t * pay;
        x.w = __ldg(reinterpret_cast<const uint2 *>(p + off));
        if (B == 3) x.hb = __ldg(p + WD / 4 + lane);
        x.sc = __half2float(__ushort_as_half(__ldg(sc + t)));
    }
    return x;
}

/* Work item (row blockIdx.z, kv head blockIdx.y, split blockIdx.x); items past the row's
 * split count exit. B: 4 / 3 (tq bits) or WB_BF16 (the dense bf16 cache: the values as
 * stored, scale 1, no q8 window). Warp w takes the split's tokens in runs of U: a + U w + U WNW k ..; lane
 * l holds dims 8 l .. 8 l + 7 of the G query heads (MG slots: G rounded up to 2, 4, 8), their
 * running max / sum / output (float32, base-2 online softmax). The warps' partials merge
 * in warp order through shared memory; the item writes (max, sum, output) per q head. */
template <int B, int MG>
__global__ void __launch_bounds__(WNW * 32) wdec_kernel(const WParams P) {
    constexpr int U = MG >= 8 ? 2 : 4;           /* tokens per warp step (registers at G 8) */
    __shared__ float s_cent[2][16];
    __shared__ float2 s_ml[WNW][MG];
    __shared__ __align__(16) float s_acc[WNW][MG][WD];
    const int sp = blockIdx.x, h = blockIdx.y, r = blockIdx.z;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const cuda_row row = P.rows[r];
    const int ntok = row.ntok;
    if (sp >= wsplit_count(ntok)) return;       /* the whole CTA, before any barrier */
    const int seg = wsplit_len(ntok), a = sp * seg, z = min(ntok, a + seg);
    if (threadIdx.x < 32) s_cent[threadIdx.x >> 4][threadIdx.x & 15] =
        threadIdx.x < 16 ? P.kcent[threadIdx.x] : P.vcent[threadIdx.x - 16];
    const int G = P.G;
    const size_t rh = (size_t)r * P.kvh + h, v0 = (size_t)r * P.qh + (size_t)h * G;
    float q[MG][8], acc[MG][8], m[MG], l[MG];
#pragma unroll
    for (int hd = 0; hd < MG; hd++) {
        float4 x0 = make_float4(0, 0, 0, 0), x1 = x0;
        if (hd < G) {
            const float4 *qp = reinterpret_cast<const float4 *>(P.q + (v0 + hd) * WD + 8 * lane);
            x0 = qp[0];
            x1 = qp[1];
        }
        q[hd][0] = x0.x; q[hd][1] = x0.y; q[hd][2] = x0.z; q[hd][3] = x0.w;
        q[hd][4] = x1.x; q[hd][5] = x1.y; q[hd][6] = x1.z; q[hd][7] = x1.w;
        m[hd] = -INFINITY;
        l[hd] = 0.0f;
#pragma unroll
        for (int c = 0; c < 8; c++) acc[hd][c] = 0.0f;
    }
    /* the lane's payload bytes: tq4 dims 8 l .. 8 l + 7 are nibble (l >> 1) & 1 of bytes
     * 16 (l >> 2) + 8 (l & 1) ..; tq3 2-bit field l & 3 of bytes 8 (l >> 2) .., high bits in
     * byte D / 4 + l */
    const int off = B == 4 ? 16 * (lane >> 2) + 8 * (lane & 1) : 8 * (lane >> 2);
    const int sh = B == 4 ? 4 * ((lane >> 1) & 1) : 2 * (lane & 3);
    const size_t col0 = rh * P.cap + (size_t)row.left_pad;
    const uint8_t *kb = P.kd + col0 * P.pay, *vb = P.vd + col0 * P.pay;
    const uint16_t *ksb = B == WB_BF16 ? P.ks : P.ks + col0,
                   *vsb = B == WB_BF16 ? P.vs : P.vs + col0;
    const size_t ring0 = rh * P.ring;
    __syncthreads();                             /* s_cent */
    for (int t0 = a + U * w; t0 < z; t0 += U * WNW) {
        WRaw kr[U], vr[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int t = min(t0 + u, z - 1);   /* past z: a valid token, masked below */
            const bool win = B != WB_BF16 && t >= row.wstart;
            const size_t slot = win ? ring0 + (size_t)(t % P.ring) : 0;
            kr[u] = wload<B>(kb, ksb, P.kw, P.kws, P.pay, off, lane, t, win, slot);
            vr[u] = wload<B>(vb, vsb, P.vw, P.vws, P.pay, off, lane, t, win, slot);
        }
        // ---- scores s[u][hd] (log2 units): the lane's 8-dim dot, its scale, a butterfly
        float s[U][MG];
#pragma unroll
        for (int u = 0; u < U; u++) {
            float x[8];
            if constexpr (B == WB_BF16) wdec_bf16(kr[u].w, kr[u].w2, x);
            else if (kr[u].win) wdec_q8(kr[u].w, x);
            else wdec_tq<B>(kr[u].w, kr[u].hb, sh, s_cent[0], x);
#pragma unroll
            for (int hd = 0; hd < MG; hd++) {
                float d = 0.0f;
#pragma unroll
                for (int c = 0; c < 8; c++) d = fmaf(q[hd][c], x[c], d);
                s[u][hd] = d * kr[u].sc;
            }
        }
#pragma unroll
        for (int o = 16; o; o >>= 1)
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int hd = 0; hd < MG; hd++) s[u][hd] += __shfl_xor_sync(0xffffffffu, s[u][hd], o);
        // ---- online softmax per head over the U tokens (the first is always in range)
        float p[U][MG];
#pragma unroll
        for (int hd = 0; hd < MG; hd++) {
            float mx = m[hd];
#pragma unroll
            for (int u = 0; u < U; u++)
                if (t0 + u < z) mx = fmaxf(mx, s[u][hd]);
            const float al = exp2f(m[hd] - mx); /* m = -inf: 0 */
            float ps = 0.0f;
#pragma unroll
            for (int u = 0; u < U; u++) {
                p[u][hd] = t0 + u < z ? exp2f(s[u][hd] - mx) : 0.0f;
                ps += p[u][hd];
            }
            l[hd] = l[hd] * al + ps;
            m[hd] = mx;
#pragma unroll
            for (int c = 0; c < 8; c++) acc[hd][c] *= al;
        }
        // ---- acc += p V (V's scale folded into the weight)
#pragma unroll
        for (int u = 0; u < U; u++) {
            float x[8];
            if constexpr (B == WB_BF16) wdec_bf16(vr[u].w, vr[u].w2, x);
            else if (vr[u].win) wdec_q8(vr[u].w, x);
            else wdec_tq<B>(vr[u].w, vr[u].hb, sh, s_cent[1], x);
#pragma unroll
            for (int hd = 0; hd < MG; hd++) {
                const float pv = p[u][hd] * vr[u].sc;
#pragma unroll
                for (int c = 0; c < 8; c++) acc[hd][c] = fmaf(pv, x[c], acc[hd][c]);
            }
        }
    }
    // ---- the warps' partials, merged in warp order (a warp without tokens: m = -inf)
#pragma unroll
    for (int hd = 0; hd < MG; hd++) {
        if (hd >= G) continue;
        float4 *dst = reinterpret_cast<float4 *>(&s_acc[w][hd][8 * lane]);
        dst[0] = make_float4(acc[hd][0], acc[hd][1], acc[hd][2], acc[hd][3]);
        dst[1] = make_float4(acc[hd][4], acc[hd][5], acc[hd][6], acc[hd][7]);
        if (lane == 0) s_ml[w][hd] = make_float2(m[hd], l[hd]);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < G * WD; e += WNW * 32) {
        const int hd = e / WD, d = e % WD;
        float M = -INFINITY;
#pragma unroll
        for (int ww = 0; ww < WNW; ww++) M = fmaxf(M, s_ml[ww][hd].x);
        float o = 0.0f, L = 0.0f;
#pragma unroll
        for (int ww = 0; ww < WNW; ww++) {
            const float2 ml = s_ml[ww][hd];
            if (ml.x == -INFINITY) continue;
            const float f = exp2f(ml.x - M);
            o = fmaf(s_acc[ww][hd][d], f, o);
            L = fmaf(ml.y, f, L);
        }
        const size_t pi = (v0 + hd) * P.nsmax + sp;
        P.po[pi * WD + d] = o;
        if (d == 0) P.pml[pi] = make_float2(M, L);
    }
}

// ---------------------------------------------------------------------------
// Merge
// ---------------------------------------------------------------------------
/* Per (row, q head) one warp (lane l: dims 8 l .. 8 l + 7): the row's splits' (max, sum,
 * output) merged in split order, divided by the sum, un-rotated once (V codec; unrotate 0:
 * the bf16 baseline, stored unrotated). TC: the partials of the tensor-core kernel (its split
 * rule, tsplit_count), else the float32 kernel's (wsplit_count); both write natural dim order,
 * unnormalized, V domain, (max, sum) in base 2 (the tensor-core kernel's max of a split that saw
 * no finite score is M_START with a sum of 0: weighed 2^(M_START - M) = 0). */
template <bool TC>
__global__ void wmerge_kernel(const float *__restrict__ po, const float2 *__restrict__ pml,
                              const cuda_row *__restrict__ rows, float *__restrict__ out, cw_sbits sb,
                              float cinv, int unrotate, int qh, int nsmax, int n) {
    constexpr int B = 8;      /* splits' loads in flight */
    cuda_pdl_wait();               /* programmatic (TC): the split kernel's partials */
    const int v = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (v >= n) return;
    const int ntok = rows[v / qh].ntok;
    const int ns = min(TC ? tsplit_count(ntok) : wsplit_count(ntok), nsmax);
    const float2 *ml = pml + (size_t)v * nsmax;
    float M = -INFINITY;
    for (int s = lane; s < ns; s += 32) M = fmaxf(M, ml[s].x);
#pragma unroll
    for (int o = 16; o; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    float o8[8] = {0, 0, 0, 0, 0, 0, 0, 0}, L = 0.0f;
    if (M != -INFINITY)
        for (int s0 = 0; s0 < ns; s0 += B) {  /* B splits' loads in flight, added in order */
            float2 mj[B];
            float4 pa[B], pb[B];
#pragma unroll
            for (int j = 0; j < B; j++) {
                mj[j] = make_float2(-INFINITY, 0.0f);
                pa[j] = pb[j] = make_float4(0, 0, 0, 0);
                if (s0 + j < ns) {
                    mj[j] = ml[s0 + j];
                    const float4 *p = reinterpret_cast<const float4 *>(po + ((size_t)v * nsmax + s0 + j) * WD + 8 * lane);
                    pa[j] = p[0];
                    pb[j] = p[1];
                }
            }
#pragma unroll
            for (int j = 0; j < B; j++) {
                if (mj[j].x == -INFINITY) continue;
                const float f = exp2f(mj[j].x - M);
                o8[0] += pa[j].x * f; o8[1] += pa[j].y * f; o8[2] += pa[j].z * f; o8[3] += pa[j].w * f;
                o8[4] += pb[j].x * f; o8[5] += pb[j].y * f; o8[6] += pb[j].z * f; o8[7] += pb[j].w * f;
                L += mj[j].y * f;
            }
        }
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
#pragma unroll
    for (int c = 0; c < 8; c++) o8[c] *= inv;
    if (unrotate) {
        float sg[8];
        cw_signs_n<8>(sb, lane, sg);
        cw_unrotate_n<8>(o8, sg, cinv, lane);
    }
    float4 *op = reinterpret_cast<float4 *>(out + (size_t)v * WD + 8 * lane);
    op[0] = make_float4(o8[0], o8[1], o8[2], o8[3]);
    op[1] = make_float4(o8[4], o8[5], o8[6], o8[7]);
}

template <int B>
void wdec_launch(const WParams &P, dim3 grid, cudaStream_t s) {
    if (P.G <= 2) wdec_kernel<B, 2><<<grid, WNW * 32, 0, s>>>(P);
    else if (P.G <= 4) wdec_kernel<B, 4><<<grid, WNW * 32, 0, s>>>(P);
    else wdec_kernel<B, 8><<<grid, WNW * 32, 0, s>>>(P);
}


// ---------------------------------------------------------------------------
// Workspace
// ---------------------------------------------------------------------------
/* For nv query vectors and nsmax splits: partial outputs [nv, nsmax, 256] f32, (max, sum)
 * [nv, nsmax] float2, prepared queries [nv, 256] f32 (the float32 kernel's; the tensor-core
 * kernel's fp16 ones take the first half). */
size_t wide_ws(size_t nv, int nsmax, size_t *po_b, size_t *pml_b) {
    *po_b = nv * (size_t)nsmax * WD * sizeof(float);
    *pml_b = (nv * (size_t)nsmax * sizeof(float2) + 255) / 256 * 256; /* the queries after it: 16-byte loads */
    return *po_b + *pml_b + nv * WD * sizeof(float) + 256;
}

} // namespace

static tqkv_status check_heads(const cuda_kv *kv, int q_heads, const char *fn) {
    if (q_heads < 1 || q_heads % kv->kvh || q_heads / kv->kvh > CUDA_MAX_G)
        return tqkv_fail(TQKV_EINVAL, "%s: q_heads %d must be a multiple of kv_heads %d with at most %d "
                         "query heads per kv head", fn, q_heads, kv->kvh, CUDA_MAX_G);
    return TQKV_OK;
}

/* The tensor-core kernels' dynamic shared memory and persistent grids (one CTA per SM), and the
 * choice of kernel; run once by tqkv_cuda_attn_setup (under its lock, before any capture). */
tqkv_status cuda_wide_setup(int sms) {
    const char *env = getenv("TQKV_WIDE_TC");
    g_wide_tc = env && *env ? atoi(env) != 0 : TQKV_WIDE_TC;
    cudaError_t e = cudaSuccess;
    for (int f = 0; f < 2 && e == cudaSuccess; f++) {
        WideCfg *k = &g_wcfg[f];
        e = cudaFuncSetAttribute(k->fn, cudaFuncAttributeMaxDynamicSharedMemorySize, k->smem);
        int per_sm = 0;
        if (e == cudaSuccess)
            e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k->fn, k->ng * NW * 32, k->smem);
        if (e == cudaSuccess && per_sm < 1)
            return tqkv_fail(TQKV_EUNSUPPORTED, "d 256 attention kernels: a %d-warp CTA with %d bytes of shared "
                             "memory does not fit an SM", k->ng * NW, k->smem);
        k->ctas = per_sm * sms;
    }
    return cuda_check(e, "d 256 attention kernel setup");
}

extern "C" int tqkv_cuda_wide_tc(void) {
    if (tqkv_cuda_attn_setup()) return -1;
    return g_wide_tc;
}

extern "C" size_t tqkv_cuda_attend_ws_bytes_dim(int rows, int q_heads, int max_tokens, int head_dim) {
    if (head_dim == CUDA_DIM) return tqkv_cuda_attend_ws_bytes(rows, q_heads, max_tokens);
    size_t po_b, pml_b;
    const size_t nv = (size_t)(rows > 0 ? rows : 0) * (size_t)(q_heads > 0 ? q_heads : 0);
    return wide_ws(nv, wsplit_bound(max_tokens), &po_b, &pml_b);
}

/* The tensor-core kernel's partials of kv (F: its format) into po / pml, its queries in qp;
 * pdl: the split kernel launched programmatically (cuda_attn_pdl_on). */
template <int F>
static void tc_partials(const cuda_kv *kv, const float *q, int q_heads, float scale, float *po,
                        float2 *pml, uint16_t *qp, int nsmax, int pdl) {
    const int nvi = kv->rows * q_heads;
    wprep_kernel<F><<<(unsigned)((nvi + 3) / 4), 128, 0, kv->stream>>>(q, qp, cw_sbits_of(kv->kc256.signs, WD),
                                                                      kv->kc256.inv, 1, scale * LOG2E, nvi);
    Params<WD> P = split_params<WD>(kv, kv->kc256, kv->vc256, qp, po, pml, q_heads, nsmax);
    P.pdl = pdl;              /* as at d = 128 (attn_cuda.cu's attend) */
    /* persistent: the resident CTAs, at most one per possible work item (a CTA's groups take
     * items gridDim.x apart, so the first items land on different SMs) */
    const WideCfg *k = &g_wcfg[F];
    const long items_ub = (long)kv->rows * kv->kvh * nsmax;
    const unsigned grid = (unsigned)(items_ub < k->ctas ? items_ub : k->ctas);
    cuda_pdl_launch(P.pdl, k->fn, dim3(grid), dim3(k->ng * NW * 32), (size_t)k->smem, kv->stream, P);
}

/* Decode attention at d = 256 (attn_cuda.cu's entry points dispatch here): query prep, the
 * split kernel (tensor cores for tq unless TQKV_WIDE_TC = 0; the float32 one for bf16), the
 * merge, all on kv->stream. ws == NULL: kv's own workspace, grown here. */
tqkv_status cuda_attend_decode_wide(cuda_kv *kv, const float *q, int q_heads, float scale, float *out,
                                    void *ws, size_t ws_bytes) {
    if (!kv || !q || !out) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_attend: NULL argument");
    tqkv_status st = check_heads(kv, q_heads, "tqkv_cuda_kv_attend");
    if (st) return st;
    if (kv->d != CUDA_DIM_WIDE ||
        (!kv->bf16 && (kv->kfmt != kv->vfmt || (kv->kfmt != TQKV_TQ4 && kv->kfmt != TQKV_TQ3))))
        return tqkv_fail(TQKV_EUNSUPPORTED,
                         "tqkv_cuda_kv_attend: head_dim %d with these formats (the device "
                         "kernels take %d, or %d with tq4/tq4, tq3/tq3 or the dense bf16 cache)",
                         kv->d, CUDA_DIM, CUDA_DIM_WIDE);
    if (kv->rows == 0) return TQKV_OK;
    /* tq: the kernel's choice and grids (model states run the setup at init, before any
     * capture); bf16 needs no setup */
    if (!kv->bf16) {
        st = tqkv_cuda_attn_setup();
        if (st) return st;
    }
    const int tc = !kv->bf16 && g_wide_tc;
    if (tc) {
        if (kv->rows > ATTN_MAX_ROWS)
            return tqkv_fail(TQKV_EUNSUPPORTED, "tqkv_cuda_kv_attend: %d rows (the decode kernel takes at most %d)",
                             kv->rows, ATTN_MAX_ROWS);
#if TQKV_COPY_TOK32
        /* the staged copies index tokens of a plane in 32 bits (as at d = 128) */
        if ((uint64_t)kv->rows * (uint64_t)kv->kvh * (uint64_t)kv->cap > 0xFFFFFFFFull)
            return tqkv_fail(TQKV_EUNSUPPORTED, "tqkv_cuda_kv_attend: %d rows x %d heads x %d columns exceed 2^32 "
                             "tokens per plane", kv->rows, kv->kvh, kv->cap);
#endif
        if (kv->kpay != (size_t)Fmt<F_TQ4, WD>::PAY && kv->kpay != (size_t)Fmt<F_TQ3, WD>::PAY)
            return tqkv_fail(TQKV_EUNSUPPORTED, "tqkv_cuda_kv_attend: %zu payload bytes per vector at d 256",
                             kv->kpay);
    } else if (kv->rows > 65535) {
        return tqkv_fail(TQKV_EUNSUPPORTED, "tqkv_cuda_kv_attend: %d rows at head_dim %d (at most 65535)",
                         kv->rows, kv->d);
    }
    int maxtok = 0;
    for (int r = 0; r < kv->rows; r++) maxtok = kv->h_offset[r] > maxtok ? kv->h_offset[r] : maxtok;
    const int nsmax = wsplit_bound(maxtok); /* >= every row's split count (both kernels); the graph key's */
    const size_t nv = (size_t)kv->rows * q_heads;
    size_t po_b, pml_b;
    const size_t need = wide_ws(nv, nsmax, &po_b, &pml_b);
    if (ws && need > ws_bytes)
        return tqkv_fail(TQKV_ERANGE, "tqkv_cuda_kv_attend_ws: workspace of %zu bytes < %zu needed", ws_bytes, need);
    if (!ws && need > kv->ws_bytes) {
        tqkv_cuda_free(kv->ws);
        kv->ws = NULL;
        kv->ws_bytes = 0;
        st = tqkv_cuda_malloc(&kv->ws, need);
        if (st) return st;
        kv->ws_bytes = need;
    }
    if (!ws) ws = kv->ws;
    float *po = (float *)ws;                                   /* [nv, nsmax, 256] */
    float2 *pml = (float2 *)((char *)ws + po_b);               /* [nv, nsmax] */
    void *qp = (char *)ws + po_b + pml_b;                      /* [nv, 256] f32 or fp16 */
    const int nvi = (int)nv;
    const unsigned qgrid = (unsigned)((nv + 3) / 4);
    if (tc) {
        const int pdl = cuda_attn_pdl_on();
        if (kv->kfmt == TQKV_TQ4)
            tc_partials<F_TQ4>(kv, q, q_heads, scale, po, pml, (uint16_t *)qp, nsmax, pdl);
        else tc_partials<F_TQ3>(kv, q, q_heads, scale, po, pml, (uint16_t *)qp, nsmax, pdl);
        cuda_pdl_launch(pdl, wmerge_kernel<true>, dim3(qgrid), dim3(128), 0, kv->stream,
                   (const float *)po, (const float2 *)pml, (const cuda_row *)kv->d_rows, out,
                   cw_sbits_of(kv->vc256.signs, WD), kv->vc256.inv, 1, q_heads, nsmax, nvi);
        return cuda_check(cudaGetLastError(), "d 256 decode attention launch");
    }
    /* bf16: not rotated (stored as given), so the queries are only scaled */
    wprep_kernel<-1><<<qgrid, 128, 0, kv->stream>>>(q, qp, cw_sbits_of(kv->kc256.signs, WD), kv->kc256.inv,
                                                    !kv->bf16, scale * LOG2E, nvi);
    WParams P;
    P.kd = kv->kd; P.vd = kv->vd; P.ks = kv->ks; P.vs = kv->vs;
    P.kw = kv->kw; P.vw = kv->vw; P.kws = kv->kws; P.vws = kv->vws;
    P.rows = kv->d_rows; P.q = (const float *)qp; P.po = po; P.pml = pml;
    for (int i = 0; i < 16; i++) {
        P.kcent[i] = kv->kc256.cent[i];
        P.vcent[i] = kv->vc256.cent[i];
    }
    P.pay = (int)kv->kpay; P.ring = kv->ring > 0 ? kv->ring : 1; P.cap = kv->cap;
    P.kvh = kv->kvh; P.G = q_heads / kv->kvh; P.qh = q_heads; P.nsmax = nsmax;
    /* every (row, kv head, split) up to the bound; items past a row's count exit at once.
     * Each row's length, split length and count come from d_rows on the device. */
    const dim3 grid((unsigned)nsmax, (unsigned)kv->kvh, (unsigned)kv->rows);
    if (kv->bf16) wdec_launch<WB_BF16>(P, grid, kv->stream);
    else if (kv->kfmt == TQKV_TQ4) wdec_launch<4>(P, grid, kv->stream);
    else wdec_launch<3>(P, grid, kv->stream);
    wmerge_kernel<false><<<qgrid, 128, 0, kv->stream>>>(po, pml, kv->d_rows, out, cw_sbits_of(kv->vc256.signs, WD),
                                                        kv->vc256.inv, !kv->bf16, q_heads,
                                                        nsmax, nvi);
    return cuda_check(cudaGetLastError(), "d 256 decode attention launch");
}
