/*
 * attn_cuda.cu - decode attention (one query per row) over the device cache, sm_90.
 * Owns: the query preparation (rotation into K's domain, softmax scale and log2(e) folded,
 * fp16/bf16), the split-KV flash-decoding kernel over compressed rows (tq4, tq3, q8 recent
 * window) and over the dense bf16 baseline, and the merge of split partials (log-sum-exp)
 * with the single un-rotation of each output.
 * Must not: mutate the cache, or let a row's result depend on other rows: a row's split
 * size depends only on its own token count, every reduction runs in a fixed order.
 *
 * Kernel shape (one CTA = one (row, kv head, split); 4 warps; each warp takes every 4th
 * tile of TT tokens of the split, TT = 32 for tq, 16 for bf16; tiles are 16-token
 * subtiles):
 *   S^T [16 tokens, 8 heads] = K [16, 128] . Q^T [128, 8]    mma.m16n8k16 (fp16/bf16)
 *   O^T [128, 8 heads]     += V^T [128, 16] . P^T [16, 8]    mma.m16n8k16
 * The G <= 8 query heads of the GQA group are the N = 8 columns (unused ones are zero).
 * K fragments are decoded straight from the payload bytes a thread loads (16 bytes per
 * token row for tq4): the head-dim order inside the dot product is permuted per format so
 * that every register pair comes from one byte (kdim()), and Q is loaded in the same
 * order; V^T fragments pair two tokens per register (vdim() is the output order).
 * Dequantization: 4-bit (tq4) and 3-bit (tq3) indices are looked up in fp16 codebook
 * tables held in registers (lo and hi byte planes, prmt = byte permute), no shared memory.
 * The per-token fp16 scale multiplies the score (K) and the softmax weight (V); the q8
 * window's tokens are decoded with their block scales (weight factor 1).
 * Online softmax in base 2 per warp, merged across warps in shared memory, and across
 * splits by the merge kernel in split order.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "util/common.h"
}
#include "cache/cache_cuda_impl.h"
#include "codec/codec_cuda.cuh"

namespace {

enum { F_TQ4 = 0, F_TQ3 = 1, F_BF16 = 2 };
constexpr int D = CUDA_DIM;
/* Warps per CTA: the template parameter NW (4). */
constexpr float LOG2E = 1.4426950408889634f;

// ---------------------------------------------------------------------------
// Splits (batch invariance: a function of the row's own token count only)
// ---------------------------------------------------------------------------
__host__ __device__ inline int split_len(int ntok) {
    int s = (ntok + 31) / 32;                 /* aim at <= 32 splits per (row, head) */
    s = (s + 255) / 256 * 256;                /* multiple of 256 tokens */
    return s < 256 ? 256 : s;
}
__host__ __device__ inline int split_count(int ntok) {
    return ntok <= 0 ? 0 : (ntok + split_len(ntok) - 1) / split_len(ntok);
}

// ---------------------------------------------------------------------------
// Small device helpers
// ---------------------------------------------------------------------------
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
    return r;
}

template <int F>
__device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    if constexpr (F == F_BF16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int F> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    if constexpr (F == F_BF16) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    } else {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
}

/* Spread bits 0..3 of v to bits 0, 8, 16, 24. */
__device__ __forceinline__ uint32_t spread4(uint32_t v) { return ((v & 0xFu) * 0x00204081u) & 0x01010101u; }

// ---------------------------------------------------------------------------
// Index orders (head-dim permutations; see the file comment)
// ---------------------------------------------------------------------------
/* K: thread column c, register pair p (0..15: k-step p/2, half p&1), element e (0/1). */
template <int F> __device__ __forceinline__ int kdim(int c, int p, int e) {
    if constexpr (F == F_TQ4) return 32 * c + p + 16 * e;
    else if constexpr (F == F_TQ3) return 32 * c + 4 * (p >> 3) + (p & 3) + 8 * ((p >> 2) & 1) + 16 * e;
    else return 32 * c + 2 * p + e;
}
/* V: thread row g, m-tile i (0..7), e = 0 for fragment row g, 1 for row g + 8. */
template <int F> __device__ __forceinline__ int vdim(int g, int i, int e) {
    if constexpr (F == F_TQ4) return 32 * (g >> 1) + 8 * (g & 1) + i + 16 * e;
    else if constexpr (F == F_TQ3) return 32 * (g >> 1) + 4 * (g & 1) + (i & 3) + 8 * (i >> 2) + 16 * e;
    else return 16 * g + 2 * i + e;
}

// ---------------------------------------------------------------------------
// Codebook lookup table in shared memory, one column per lane (conflict free)
// ---------------------------------------------------------------------------
/* The table: entry e (a payload byte, two indices, low nibble first) of lane l is the
 * fp16 pair (c[e & 15], c[e >> 4]) at byte offset 256 e + 4 l (tq3: 3-bit indices in the
 * nibbles). Bank = l: conflict free. One byte permute builds the offset from the payload
 * word and L = 4 l: byte 0 = L, byte 1 = payload byte k, bytes 2, 3 = 0 (L's zero byte). */
struct Tab {
    const char *base;         /* table in shared memory */
    uint32_t L;               /* 4 * lane */
};
__device__ __forceinline__ uint32_t tlook(const Tab &T, uint32_t w, int k) {
    const uint32_t off = prmt(w, T.L, 0x5504u | (uint32_t)k << 4);
    return *reinterpret_cast<const uint32_t *>(T.base + off);
}

/* tq3: 8 low bytes' worth of 2-bit fields (one u32 = 4 bytes, byte j) plus the group's
 * high-bit word -> two nibble words (A: fields 0 and 2, B: fields 1 and 3), x = 0/1 for
 * bytes 0..3 / 4..7 of the group. */
__device__ __forceinline__ void tq3_nibbles(uint32_t w, uint32_t hb, int x, uint32_t &A, uint32_t &B) {
    A = (w & 0x33333333u) | spread4(hb >> (4 * x)) << 2 | spread4(hb >> (16 + 4 * x)) << 6;
    B = ((w >> 2) & 0x33333333u) | spread4(hb >> (8 + 4 * x)) << 2 | spread4(hb >> (24 + 4 * x)) << 6;
}

// ---------------------------------------------------------------------------
// Raw tile (registers) and its loads
// ---------------------------------------------------------------------------
template <int F> struct Raw;
template <> struct Raw<F_TQ4> {
    static constexpr int SUB = 2;
    uint4 k[SUB][2];          /* [subtile][row A/B]: bytes 16c.. of the token */
    uint2 v[SUB][4];          /* [subtile][token 4c + j]: bytes 8g.. */
    uint32_t ksc, vsc;        /* fp16 scales of token t0 + lane */
};
template <> struct Raw<F_TQ3> {
    static constexpr int SUB = 2;
    uint2 kl[SUB][2];         /* 2-bit plane bytes 8c..8c+7 */
    uint32_t kh[SUB][2];      /* 1-bit plane word of group c */
    uint32_t vl[SUB][4];      /* 2-bit plane bytes 4g..4g+3 */
    uint32_t vh[SUB][4];      /* 1-bit plane word of group g/2 */
    uint32_t ksc, vsc;
};
template <> struct Raw<F_BF16> {
    static constexpr int SUB = 1;
    uint4 k[SUB][2][4];       /* dims 32c..32c+31 */
    uint4 v[SUB][4][2];       /* dims 16g..16g+15 */
    uint32_t ksc, vsc;
};

struct Ctx {
    const uint8_t *kb, *vb;   /* token 0 of (row, head) in the main planes */
    const uint16_t *ksb, *vsb;
    size_t kpay, vpay;
    const int8_t *kw, *vw;    /* slot 0 of (row, head) in the rings */
    const uint16_t *kws, *vws;
    int ring;
};

/* Row tokens of subtile u: fragment row g -> tok 4(g>>1) + (g&1), row g+8 -> that + 2. */
__device__ __forceinline__ int krow_tok(int g, int row) { return 4 * (g >> 1) + (g & 1) + 2 * row; }

template <int F, bool SLOW>
__device__ __forceinline__ void load_tile(Raw<F> &R, const Ctx &x, int t0, int lim, int g, int c, int lane) {
    constexpr int SUB = Raw<F>::SUB;
#pragma unroll
    for (int u = 0; u < SUB; u++) {
#pragma unroll
        for (int row = 0; row < 2; row++) {
            const int t = t0 + 16 * u + krow_tok(g, row);
            const bool ok = !SLOW || t < lim;
            const uint8_t *p = x.kb + (size_t)t * x.kpay;
            if constexpr (F == F_TQ4) {
                R.k[u][row] = ok ? __ldg(reinterpret_cast<const uint4 *>(p + 16 * c)) : make_uint4(0, 0, 0, 0);
            } else if constexpr (F == F_TQ3) {
                R.kl[u][row] = ok ? __ldg(reinterpret_cast<const uint2 *>(p + 8 * c)) : make_uint2(0, 0);
                R.kh[u][row] = ok ? __ldg(reinterpret_cast<const uint32_t *>(p + 32 + 4 * c)) : 0u;
            } else {
#pragma unroll
                for (int q = 0; q < 4; q++)
                    R.k[u][row][q] = ok ? __ldg(reinterpret_cast<const uint4 *>(p + 64 * c) + q) : make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int t = t0 + 16 * u + 4 * c + j;
            const bool ok = !SLOW || t < lim;
            const uint8_t *p = x.vb + (size_t)t * x.vpay;
            if constexpr (F == F_TQ4) {
                R.v[u][j] = ok ? __ldg(reinterpret_cast<const uint2 *>(p + 8 * g)) : make_uint2(0, 0);
            } else if constexpr (F == F_TQ3) {
                R.vl[u][j] = ok ? __ldg(reinterpret_cast<const uint32_t *>(p + 4 * g)) : 0u;
                R.vh[u][j] = ok ? __ldg(reinterpret_cast<const uint32_t *>(p + 32 + 4 * (g >> 1))) : 0u;
            } else {
#pragma unroll
                for (int q = 0; q < 2; q++)
                    R.v[u][j][q] = ok ? __ldg(reinterpret_cast<const uint4 *>(p + 32 * g) + q) : make_uint4(0, 0, 0, 0);
            }
        }
    }
    if constexpr (F != F_BF16) {
        const int t = t0 + lane;
        const bool ok = lane < 16 * SUB && (!SLOW || t < lim);
        R.ksc = ok ? __ldg(x.ksb + t) : 0u;
        R.vsc = ok ? __ldg(x.vsb + t) : 0u;
    }
}

/* K pairs of one row of subtile u. */
template <int F> __device__ __forceinline__ void deq_k(const Raw<F> &R, const Tab &T, int u, int row, uint32_t pr[16]) {
    if constexpr (F == F_TQ4) {
        const uint4 w = R.k[u][row];
        const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int p = 0; p < 16; p++) pr[p] = tlook(T, ws[p >> 2], p & 3);
    } else if constexpr (F == F_TQ3) {
        uint32_t n[4];
        tq3_nibbles(R.kl[u][row].x, R.kh[u][row], 0, n[0], n[1]);
        tq3_nibbles(R.kl[u][row].y, R.kh[u][row], 1, n[2], n[3]);
#pragma unroll
        for (int p = 0; p < 16; p++) pr[p] = tlook(T, n[p >> 2], p & 3);
    } else {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            pr[4 * q + 0] = R.k[u][row][q].x;
            pr[4 * q + 1] = R.k[u][row][q].y;
            pr[4 * q + 2] = R.k[u][row][q].z;
            pr[4 * q + 3] = R.k[u][row][q].w;
        }
    }
}

/* V^T fragments of subtile u: a[i] = {a0, a1, a2, a3} of m-tile i. */
template <int F> __device__ __forceinline__ void deq_v(const Raw<F> &R, const Tab &T, int u, uint32_t a[8][4]) {
#pragma unroll
    for (int hp = 0; hp < 2; hp++) {          /* token pair (4c, 4c+1) or (4c+2, 4c+3) */
        const int j0 = 2 * hp, j1 = 2 * hp + 1;
        if constexpr (F == F_BF16) {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const uint32_t w0 = (&R.v[u][j0][i >> 2].x)[i & 3], w1 = (&R.v[u][j1][i >> 2].x)[i & 3];
                a[i][2 * hp + 0] = prmt(w0, w1, 0x5410);
                a[i][2 * hp + 1] = prmt(w0, w1, 0x7632);
            }
        } else {
            uint32_t n0[2], n1[2];
            if constexpr (F == F_TQ4) {
                n0[0] = R.v[u][j0].x; n0[1] = R.v[u][j0].y;
                n1[0] = R.v[u][j1].x; n1[1] = R.v[u][j1].y;
            } else {
                const int xh = (threadIdx.x >> 2) & 1;   /* g & 1: bytes 0..3 / 4..7 of the group */
                tq3_nibbles(R.vl[u][j0], R.vh[u][j0], xh, n0[0], n0[1]);
                tq3_nibbles(R.vl[u][j1], R.vh[u][j1], xh, n1[0], n1[1]);
            }
            /* byte b of X = (tok0.lo, tok1.lo) of byte b, of Y = (tok0.hi, tok1.hi): the table
             * entry is then the fragment register itself */
#pragma unroll
            for (int wi = 0; wi < 2; wi++) {
                const uint32_t X = (n0[wi] & 0x0F0F0F0Fu) | ((n1[wi] << 4) & 0xF0F0F0F0u);
                const uint32_t Y = ((n0[wi] >> 4) & 0x0F0F0F0Fu) | (n1[wi] & 0xF0F0F0F0u);
#pragma unroll
                for (int b = 0; b < 4; b++) {
                    a[4 * wi + b][2 * hp + 0] = tlook(T, X, b);
                    a[4 * wi + b][2 * hp + 1] = tlook(T, Y, b);
                }
            }
        }
    }
}

/* Replace half `hi` of a packed fp16 pair. */
__device__ __forceinline__ uint32_t set_half(uint32_t w, int hi, float v) {
    const uint32_t h = __half_as_ushort(__float2half_rn(v));
    return hi ? (w & 0xFFFFu) | (h << 16) : (w & 0xFFFF0000u) | h;
}
__device__ __forceinline__ float q8_at(const int8_t *p, int i) { return (float)p[i]; }

// ---------------------------------------------------------------------------
// The split kernel
// ---------------------------------------------------------------------------
struct Params {
    Ctx base;                 /* pointers of (row 0, head 0) before offsets */
    const cuda_row *rows;
    const uint16_t *q;        /* [rows, qh, D] prepared queries (fp16 / bf16 bits) */
    float *po;                /* [rows, qh, nsmax, D] split outputs (unnormalized, V domain) */
    float2 *pml;              /* [rows, qh, nsmax] (max, sum) in base 2 */
    int kvh, G, qh, cap, nsmax;
    cuda_codec kc, vc;
};

/* Dynamic shared memory: the codebook table [256][32] u32 (tq), reused at the end for the
 * warps' partial outputs [NW][CUDA_MAX_G][D] floats. */
template <int F, int NW> constexpr int smem_bytes() {
    return F == F_BF16 ? NW * CUDA_MAX_G * D * 4 : 256 * 256;
}

/* (A 32 KiB table, offset (256 e + 8 l) >> 1, 4 CTAs per SM at <= 128 registers without the
 * double buffer, measured 5-10% slower; an 8-warp CTA without the double buffer 8-12%
 * slower. Both removed; see bench/RESULTS.md.) */
template <int F, bool PF, int NW>
__global__ void __launch_bounds__(NW * 32, F == F_BF16 ? 2 : 3) split_kernel(const Params P) {
    constexpr int SUB = Raw<F>::SUB, TT = 16 * SUB;
    extern __shared__ uint32_t s_dyn[];
    __shared__ float s_m[NW][CUDA_MAX_G], s_l[NW][CUDA_MAX_G];

    const int r = blockIdx.z, h = blockIdx.y, sp = blockIdx.x;
    const cuda_row row = P.rows[r];
    const int ntok = row.ntok;
    if (sp >= split_count(ntok)) return;
    const int seg = split_len(ntok);
    const int a = sp * seg, z = min(ntok, a + seg);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int G = P.G;

    // ---- pointers of this (row, head) --------------------------------------------
    Ctx x = P.base;
    const size_t rh = (size_t)r * P.kvh + h;
    const size_t col = rh * P.cap + (size_t)row.left_pad;
    x.kb += col * x.kpay;
    x.vb += col * x.vpay;
    if constexpr (F != F_BF16) {
        x.ksb += col;
        x.vsb += col;
        if (x.ring) {
            x.kw += rh * x.ring * D;
            x.vw += rh * x.ring * D;
            x.kws += rh * x.ring * (D / 32);
            x.vws += rh * x.ring * (D / 32);
        }
    }

    // ---- query fragments (B of QK^T): head g, pairs 2s / 2s+1 ---------------------
    uint32_t qb[8][2];
    {
        const uint16_t *q = P.q + ((size_t)r * P.qh + (size_t)h * G + g) * D;
#pragma unroll
        for (int s = 0; s < 8; s++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const int p = 2 * s + hh;
                qb[s][hh] = g < G ? (uint32_t)q[kdim<F>(c, p, 0)] | (uint32_t)q[kdim<F>(c, p, 1)] << 16 : 0u;
            }
    }
    if constexpr (F != F_BF16) {
        for (int i = threadIdx.x; i < 256 * 32; i += NW * 32) {
            const int e = i >> 5, m = F == F_TQ4 ? 15 : 7;
            const __half2 v = __floats2half2_rn(P.kc.cent[e & m], P.kc.cent[(e >> 4) & m]);
            s_dyn[e * 64 + (i & 31)] = *reinterpret_cast<const uint32_t *>(&v);
        }
        __syncthreads();
    }
    const Tab T = {reinterpret_cast<const char *>(s_dyn), 4u * (uint32_t)lane};

    float acc[8][4];
#pragma unroll
    for (int i = 0; i < 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    const int fast_end = min(z, row.wstart);
    // tiles of this warp: t0 = a + (w + NW * k) * TT
    auto process = [&](const Raw<F> &R, int t0, bool slow) {
        // ---- per-lane token factors (token t0 + lane) -----------------------------------
        float kf = 1.0f, vf = 1.0f;
        {
            const int t = t0 + lane;
            if constexpr (F != F_BF16) {
                kf = __half2float(__ushort_as_half((uint16_t)R.ksc));
                vf = __half2float(__ushort_as_half((uint16_t)R.vsc));
                if (slow && t >= row.wstart) kf = vf = 1.0f;
            }
            if (slow && (t >= z || lane >= TT)) kf = vf = 0.0f;
        }
        float sc[SUB][4];
#pragma unroll
        for (int u = 0; u < SUB; u++) {
            uint32_t pa[16], pb[16];
            deq_k<F>(R, T, u, 0, pa);
            deq_k<F>(R, T, u, 1, pb);
            if constexpr (F != F_BF16) {
                if (slow) { /* window tokens: q8 values with their block scale */
#pragma unroll
                    for (int row2 = 0; row2 < 2; row2++) {
                        const int t = t0 + 16 * u + krow_tok(g, row2);
                        if (t >= row.wstart && t < z) {
                            const size_t slot = (size_t)(t % x.ring);
                            const int8_t *qp = x.kw + slot * D;
                            const float bs = __half2float(__ushort_as_half(x.kws[slot * (D / 32) + c]));
                            uint32_t *pr = row2 ? pb : pa;
#pragma unroll
                            for (int p = 0; p < 16; p++)
                                pr[p] = pack2<F>(q8_at(qp, kdim<F>(c, p, 0)) * bs, q8_at(qp, kdim<F>(c, p, 1)) * bs);
                        }
                    }
                }
            }
            float s4[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s4b[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int s = 0; s < 8; s++) { /* two accumulators: half the dependent chain */
                const uint32_t af[4] = {pa[2 * s], pb[2 * s], pa[2 * s + 1], pb[2 * s + 1]};
                mma<F>(s & 1 ? s4b : s4, af, qb[s][0], qb[s][1]);
            }
#pragma unroll
            for (int k = 0; k < 4; k++) s4[k] += s4b[k];
            const float fA = __shfl_sync(0xffffffffu, kf, 16 * u + krow_tok(g, 0));
            const float fB = __shfl_sync(0xffffffffu, kf, 16 * u + krow_tok(g, 1));
            sc[u][0] = s4[0] * fA; sc[u][1] = s4[1] * fA;
            sc[u][2] = s4[2] * fB; sc[u][3] = s4[3] * fB;
            if (slow) {
                if (t0 + 16 * u + krow_tok(g, 0) >= z) sc[u][0] = sc[u][1] = -INFINITY;
                if (t0 + 16 * u + krow_tok(g, 1) >= z) sc[u][2] = sc[u][3] = -INFINITY;
            }
        }
        // ---- online softmax (heads 2c, 2c+1) ------------------------------------------
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int u = 0; u < SUB; u++) {
            mx[0] = fmaxf(mx[0], fmaxf(sc[u][0], sc[u][2]));
            mx[1] = fmaxf(mx[1], fmaxf(sc[u][1], sc[u][3]));
        }
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
            mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffffu, mx[0], o));
            mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffffu, mx[1], o));
        }
        float mu[2];
        /* rescale only when some running max grew (rare after the first tiles) */
        if (__any_sync(0xffffffffu, mx[0] > m[0] || mx[1] > m[1])) {
            float al[2];
#pragma unroll
            for (int k = 0; k < 2; k++) {
                const float mn = fmaxf(m[k], mx[k]);
                mu[k] = mn == -INFINITY ? 0.0f : mn;
                al[k] = exp2f(m[k] - mu[k]);
                m[k] = mn;
                l[k] *= al[k];
            }
#pragma unroll
            for (int i = 0; i < 8; i++) {
                acc[i][0] *= al[0]; acc[i][1] *= al[1];
                acc[i][2] *= al[0]; acc[i][3] *= al[1];
            }
        } else {
            mu[0] = m[0] == -INFINITY ? 0.0f : m[0];
            mu[1] = m[1] == -INFINITY ? 0.0f : m[1];
        }
#pragma unroll
        for (int u = 0; u < SUB; u++) {
            float p[4];
#pragma unroll
            for (int k = 0; k < 4; k++) p[k] = exp2f(sc[u][k] - mu[k & 1]);
            l[0] += p[0] + p[2];
            l[1] += p[1] + p[3];
            const float vA = __shfl_sync(0xffffffffu, vf, 16 * u + krow_tok(g, 0));
            const float vB = __shfl_sync(0xffffffffu, vf, 16 * u + krow_tok(g, 1));
            const uint32_t lo = pack2<F>(p[0] * vA, p[1] * vA), hi = pack2<F>(p[2] * vB, p[3] * vB);
            // P^T fragment: tokens 4c'..4c'+3 of head g' (this lane: g' = g, c' = c)
            const int src = 8 * c + (g >> 1);
            const uint32_t x0 = __shfl_sync(0xffffffffu, lo, src), x1 = __shfl_sync(0xffffffffu, lo, src + 4);
            const uint32_t x2 = __shfl_sync(0xffffffffu, hi, src), x3 = __shfl_sync(0xffffffffu, hi, src + 4);
            const uint32_t sel = (g & 1) ? 0x7632u : 0x5410u;
            const uint32_t b0 = g < G ? prmt(x0, x1, sel) : 0u, b1 = g < G ? prmt(x2, x3, sel) : 0u;
            uint32_t va[8][4];
            deq_v<F>(R, T, u, va);
            if constexpr (F != F_BF16) {
                if (slow) {
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        const int t = t0 + 16 * u + 4 * c + j;
                        if (t >= row.wstart && t < z) {
                            const size_t slot = (size_t)(t % x.ring);
                            const int8_t *qp = x.vw + slot * D;
                            const float bs = __half2float(__ushort_as_half(x.vws[slot * (D / 32) + (g >> 1)]));
#pragma unroll
                            for (int i = 0; i < 8; i++)
#pragma unroll
                                for (int e = 0; e < 2; e++)
                                    va[i][2 * (j >> 1) + e] = set_half(va[i][2 * (j >> 1) + e], j & 1,
                                                                       q8_at(qp, vdim<F>(g, i, e)) * bs);
                        }
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < 8; i++) mma<F>(acc[i], va[i], b0, b1);
        }
    };

    // ---- fast tiles (fully in the main plane and in range), register double buffer ----
    int t0 = a + w * TT;
    if (!PF) {
        for (; t0 + TT <= fast_end; t0 += NW * TT) {
            Raw<F> cur;
            load_tile<F, false>(cur, x, t0, 0, g, c, lane);
            process(cur, t0, false);
        }
    } else if (t0 + TT <= fast_end) {
        /* register double buffer, two named buffers so that nothing is copied */
        Raw<F> ra, rb;
        load_tile<F, false>(ra, x, t0, 0, g, c, lane);
        for (;;) {
            int tn = t0 + NW * TT;
            bool more = tn + TT <= fast_end;
            if (more) load_tile<F, false>(rb, x, tn, 0, g, c, lane);
            process(ra, t0, false);
            t0 = tn;
            if (!more) break;
            tn = t0 + NW * TT;
            more = tn + TT <= fast_end;
            if (more) load_tile<F, false>(ra, x, tn, 0, g, c, lane);
            process(rb, t0, false);
            t0 = tn;
            if (!more) break;
        }
    }
    // ---- remaining tiles: partial, or reaching into the q8 window ----------------------
    for (; t0 < z; t0 += NW * TT) {
        Raw<F> cur;
        load_tile<F, true>(cur, x, t0, fast_end, g, c, lane);
        process(cur, t0, true);
    }

    // ---- merge the warps (s_o aliases the table: wait until every warp is done) ---------
    __syncthreads();
    float (*s_o)[CUDA_MAX_G][D] = reinterpret_cast<float (*)[CUDA_MAX_G][D]>(s_dyn);
#pragma unroll
    for (int k = 0; k < 2; k++)
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) l[k] += __shfl_xor_sync(0xffffffffu, l[k], o);
#pragma unroll
    for (int i = 0; i < 8; i++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int d = vdim<F>(g, i, e);
            s_o[w][2 * c][d] = acc[i][2 * e];
            s_o[w][2 * c + 1][d] = acc[i][2 * e + 1];
        }
    if (g == 0) {
        s_m[w][2 * c] = m[0]; s_m[w][2 * c + 1] = m[1];
        s_l[w][2 * c] = l[0]; s_l[w][2 * c + 1] = l[1];
    }
    __syncthreads();
    const int d = threadIdx.x & (D - 1);
    for (int hd = threadIdx.x / D; hd < G; hd += NW * 32 / D) {
        float M = -INFINITY;
#pragma unroll
        for (int ww = 0; ww < NW; ww++) M = fmaxf(M, s_m[ww][hd]);
        float o = 0.0f, L = 0.0f;
        if (M != -INFINITY)
#pragma unroll
            for (int ww = 0; ww < NW; ww++) {
                if (s_m[ww][hd] == -INFINITY) continue;
                const float f = exp2f(s_m[ww][hd] - M);
                o += s_o[ww][hd][d] * f;
                L += s_l[ww][hd] * f;
            }
        const size_t pi = ((size_t)r * P.qh + (size_t)h * G + hd) * P.nsmax + sp;
        P.po[pi * D + d] = o;
        if (d == 0) P.pml[pi] = make_float2(M, L);
    }
}

// ---------------------------------------------------------------------------
// Query preparation and merge (one warp per (row, q head), lane l: dims 4l..4l+3)
// ---------------------------------------------------------------------------
__global__ void qprep_kernel(const float *__restrict__ q, uint16_t *__restrict__ out, cuda_codec C,
                             int rotate, int bf16, float mul, int n) {
    const int v = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (v >= n) return;
    const float4 in = reinterpret_cast<const float4 *>(q + (size_t)v * D)[lane];
    float x[4] = {in.x, in.y, in.z, in.w};
    if (rotate) {
        const float s[4] = {C.signs[4 * lane], C.signs[4 * lane + 1], C.signs[4 * lane + 2], C.signs[4 * lane + 3]};
        cw_rotate(x, s, C.inv, lane);
    }
#pragma unroll
    for (int k = 0; k < 4; k++)
        out[(size_t)v * D + 4 * lane + k] = bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(x[k] * mul))
                                                 : __half_as_ushort(__float2half_rn(x[k] * mul));
}

__global__ void merge_kernel(const float *__restrict__ po, const float2 *__restrict__ pml,
                             const cuda_row *__restrict__ rows, float *__restrict__ out, cuda_codec C,
                             int unrotate, int qh, int nsmax, int n) {
    const int v = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (v >= n) return;
    const int r = v / qh;
    const int ns = split_count(rows[r].ntok);
    float M = -INFINITY;
    for (int s = 0; s < ns; s++) M = fmaxf(M, pml[(size_t)v * nsmax + s].x);
    float o[4] = {0, 0, 0, 0}, L = 0.0f;
    if (M != -INFINITY)
        for (int s = 0; s < ns; s++) {
            const float2 ml = pml[(size_t)v * nsmax + s];
            if (ml.x == -INFINITY) continue;
            const float f = exp2f(ml.x - M);
            const float4 p = reinterpret_cast<const float4 *>(po + ((size_t)v * nsmax + s) * D)[lane];
            o[0] += p.x * f; o[1] += p.y * f; o[2] += p.z * f; o[3] += p.w * f;
            L += ml.y * f;
        }
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
#pragma unroll
    for (int k = 0; k < 4; k++) o[k] *= inv;
    if (unrotate) {
        const float s[4] = {C.signs[4 * lane], C.signs[4 * lane + 1], C.signs[4 * lane + 2], C.signs[4 * lane + 3]};
        cw_unrotate(o, s, C.inv, lane);
    }
    reinterpret_cast<float4 *>(out + (size_t)v * D)[lane] = make_float4(o[0], o[1], o[2], o[3]);
}

} // namespace

// ---------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------
/* Allow the split kernels their dynamic shared memory (the tq table is 64 KiB). */
tqkv_status attn_cuda_setup(void) {
    cudaError_t e = cudaSuccess;
#define ATTN_SMEM(F, PF, NW)                                                                    \
    if (e == cudaSuccess)                                                                       \
        e = cudaFuncSetAttribute(split_kernel<F, PF, NW>,                                       \
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<F, NW>());
    ATTN_SMEM(F_TQ4, true, 4) ATTN_SMEM(F_TQ3, true, 4) ATTN_SMEM(F_BF16, true, 4)
#undef ATTN_SMEM
    return cuda_check(e, "attention kernel shared memory");
}
/* Workspace layout for rows x q_heads vectors and nsmax splits: partial outputs
 * [nv, nsmax, D] f32, (max, sum) [nv, nsmax] float2, rotated queries [nv, D] fp16. */
static size_t ws_need(size_t nv, int nsmax, size_t *po_b, size_t *pml_b) {
    *po_b = nv * nsmax * D * sizeof(float);
    *pml_b = nv * nsmax * sizeof(float2);
    return *po_b + *pml_b + nv * D * sizeof(uint16_t) + 256;
}

extern "C" size_t tqkv_cuda_attend_ws_bytes(int rows, int q_heads, int max_tokens) {
    size_t a, b;
    const int ns = split_count(max_tokens);
    return ws_need((size_t)rows * q_heads, ns > 1 ? ns : 1, &a, &b);
}

static tqkv_status attend(cuda_kv *kv, const float *q, int q_heads, float scale, float *out,
                          void *ws, size_t ws_bytes);

extern "C" tqkv_status tqkv_cuda_kv_attend_ws(cuda_kv *kv, const float *q, int q_heads, float scale,
                                         float *out, void *ws, size_t ws_bytes) {
    if (!ws) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_attend_ws: NULL workspace");
    return attend(kv, q, q_heads, scale, out, ws, ws_bytes);
}

extern "C" tqkv_status tqkv_cuda_kv_attend(cuda_kv *kv, const float *q, int q_heads, float scale,
                                      float *out) {
    return attend(kv, q, q_heads, scale, out, NULL, 0);
}

/* ws == NULL: the cache's own workspace, grown as needed. */
static tqkv_status attend(cuda_kv *kv, const float *q, int q_heads, float scale, float *out,
                          void *ws, size_t ws_bytes) {
    if (!kv || !q || !out) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_attend: NULL argument");
    if (q_heads < 1 || q_heads % kv->kvh || q_heads / kv->kvh > CUDA_MAX_G)
        return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_attend: q_heads %d must be a multiple of kv_heads %d "
                         "with at most %d query heads per kv head", q_heads, kv->kvh, CUDA_MAX_G);
    if (kv->rows == 0) return TQKV_OK;
    int nsmax = 1;
    for (int r = 0; r < kv->rows; r++) {
        const int n = split_count(kv->h_offset[r]);
        if (n > nsmax) nsmax = n;
    }
    const size_t nv = (size_t)kv->rows * q_heads;
    size_t po_b, pml_b;
    const size_t need = ws_need(nv, nsmax, &po_b, &pml_b);
    if (ws && need > ws_bytes)
        return tqkv_fail(TQKV_ERANGE, "tqkv_cuda_kv_attend_ws: workspace of %zu bytes < %zu needed",
                         ws_bytes, need);
    if (!ws && need > kv->ws_bytes) {
        tqkv_cuda_free(kv->ws);
        kv->ws = NULL;
        kv->ws_bytes = 0;
        tqkv_status st = tqkv_cuda_malloc(&kv->ws, need);
        if (st) return st;
        kv->ws_bytes = need;
    }
    if (!ws) ws = kv->ws;
    float *po = (float *)ws;
    float2 *pml = (float2 *)((char *)ws + po_b);
    uint16_t *qp = (uint16_t *)((char *)ws + po_b + pml_b);
    const int fmt = kv->bf16 ? F_BF16 : kv->kfmt == TQKV_TQ4 ? F_TQ4 : F_TQ3;
    const int nvi = (int)nv;
    qprep_kernel<<<(nvi + 3) / 4, 128>>>(q, qp, kv->kc, !kv->bf16, kv->bf16, scale * LOG2E, nvi);
    Params P;
    P.base.kb = kv->kd; P.base.vb = kv->vd;
    P.base.ksb = kv->ks; P.base.vsb = kv->vs;
    P.base.kpay = kv->kpay; P.base.vpay = kv->vpay;
    P.base.kw = kv->kw; P.base.vw = kv->vw;
    P.base.kws = kv->kws; P.base.vws = kv->vws;
    P.base.ring = kv->ring;
    P.rows = kv->d_rows;
    P.q = qp;
    P.po = po;
    P.pml = pml;
    P.kvh = kv->kvh;
    P.G = q_heads / kv->kvh;
    P.qh = q_heads;
    P.cap = kv->cap;
    P.nsmax = nsmax;
    P.kc = kv->kc;
    P.vc = kv->vc;
    const dim3 grid((unsigned)nsmax, (unsigned)kv->kvh, (unsigned)kv->rows);
    if (fmt == F_TQ4) split_kernel<F_TQ4, true, 4><<<grid, 128, smem_bytes<F_TQ4, 4>()>>>(P);
    else if (fmt == F_TQ3) split_kernel<F_TQ3, true, 4><<<grid, 128, smem_bytes<F_TQ3, 4>()>>>(P);
    else split_kernel<F_BF16, true, 4><<<grid, 128, smem_bytes<F_BF16, 4>()>>>(P);
    merge_kernel<<<(nvi + 3) / 4, 128>>>(po, pml, kv->d_rows, out, kv->vc, !kv->bf16, q_heads, nsmax, nvi);
    return cuda_check(cudaGetLastError(), "attention kernel launch");
}
